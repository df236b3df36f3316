"""A writer's diff that also ranks each change in its class (the ``classed`` positions' rank
pass folded into the diff): the same ranks as the rank pass, the same streams as a writer
without it, and the classes a long-lived writer keeps to rank the next step in."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr_format import DeltaWriter
from dcr_format.codings import classed
from dcr_format.delta import delta as delta_module
from dcr_format.delta import fingerprint as fp
from dcr_format.delta import pipeline
from dcr_format.delta.classed_change import KeptClasses, class_plan

native = pytest.importorskip("dcr_format.kernels.numba_kernels")  # numba is a dependency
kernels = pytest.importorskip("dcr_format.codings._classed_kernels")

SHIFT, MASK = classed.EXPONENT_FIELDS["bfloat16"]
UNSIGNED = {"float16": np.uint16, "float32": np.uint32, "float64": np.uint64}


@pytest.fixture(autouse=True)
def _compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCR_KERNELS", raising=False)


def weights(n: int, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Old bits of ``n`` weights of about 0.02 (a dozen exponents in use)."""
    values = (rng.standard_normal(n) * 0.02).astype(np.float32)
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    wide = {"float16": np.float16, "float32": np.float32, "float64": np.float64}[dtype]
    return values.astype(wide).view(UNSIGNED[dtype]).copy()


def middle_base(old: np.ndarray, dtype: str) -> int:
    """A base three exponents below the middle one: classes clamped at both ends."""
    shift, mask = classed.EXPONENT_FIELDS[dtype]
    return int(np.median((old >> shift) & mask)) - 3


def changed(old: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``old`` with ``rate`` of its elements changed, some of them across exponents."""
    new = old.copy()
    picked = rng.random(old.size) < rate
    flips = rng.integers(1, 1 << 9, int(picked.sum())).astype(old.dtype)  # low bits, some
    new[picked] ^= flips  # of them into the exponent field
    return new


def ranked_and_counted(
    old: np.ndarray, new: np.ndarray, dtype: str, base: int, count: int, advance: bool
) -> tuple[tuple, tuple, tuple, np.ndarray]:
    """A ranked diff, the plain diff, and the rank pass's ranks and runs of the same change."""
    shift, mask = classed.EXPONENT_FIELDS[dtype]
    rows = classed.exponent_rows(old, dtype)
    starts = classed.class_starts(rows, base, count)
    width = old.itemsize
    table, lanes = fp.native_table(width), (3 if width == 8 else 2)
    plain_old, ranked_old = old.copy(), old.copy()
    plain = native.diff(plain_old, new, 3, (True, True), table, lanes, advance=advance)
    plan = native.Ranking(shift, mask, kernels._low_base(base, mask), count, starts)
    ranked = native.ranked_diff(ranked_old, new, 3, (True, True), table, lanes, plan, advance)
    assert np.array_equal(plain_old, ranked_old)  # the same advance
    where = plain[0][0] - 3
    _, ranks, adjacent = kernels.class_ranks(
        old, where, old[where], shift, mask, base, count, starts
    )
    return plain, ranked, (ranks, adjacent), where


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("advance", [False, True])
def test_a_ranked_diff_is_the_diff_with_the_rank_pass_s_ranks(dtype, rate, advance):
    """Positions, bits, lane deltas and advance as the plain diff; each change's rank and
    the runs as the writer's rank pass counts them: one task, several tasks (one with no
    change), partial groups, classes clamped at both ends."""
    rng = np.random.default_rng(int(rate * 100) + len(dtype))
    task = native.TASK
    for n in (1, 63, 64, 65, 1000, 3 * task + 77):
        old = weights(n, dtype, rng)
        new = changed(old, rate, rng)
        if n > 2 * task:
            new[task : 2 * task] = old[task : 2 * task]
        base = middle_base(old, dtype)
        plain, ranked, (ranks, adjacent), _ = ranked_and_counted(old, new, dtype, base, 7, advance)
        assert all(np.array_equal(a, b) for a, b in zip(plain[0], ranked[0], strict=True))
        assert plain[1] == ranked[1]
        assert np.array_equal(ranked[2].ranks, ranks)
        assert ranked[2].adjacent == adjacent


def test_long_tensors_are_ranked_a_slab_of_whole_tasks_at_a_time(monkeypatch):
    """Past a slab the ranked diff goes slab by slab, each of whole tasks (a slab set below
    a task is taken as one), with the ranks and runs of one pass, a run across a slab's
    end counted once."""
    rng = np.random.default_rng(7)
    task = native.TASK
    old = weights(5 * task + 100, "bfloat16", rng)
    new = changed(old, 0.05, rng)
    new[2 * task - 3 : 2 * task + 3] = old[2 * task - 3 : 2 * task + 3] ^ 1  # a run across
    for slab in (2 * task, task // 2):
        monkeypatch.setattr(native, "SLAB", slab)
        plain, ranked, (ranks, adjacent), _ = ranked_and_counted(old, new, "bfloat16", 116, 9, True)
        assert np.array_equal(plain[0][0], ranked[0][0])
        assert np.array_equal(ranked[2].ranks, ranks) and ranked[2].adjacent == adjacent


def test_the_encoder_takes_the_diff_s_ranks_only_for_its_own_classes():
    """Given the ranks of the classes it chooses, the encoder makes the same stream without
    the rank pass; given another choice's, it counts them itself; ranks that do not match
    the positions are refused; rows that do not fit drop them."""
    rng = np.random.default_rng(3)
    old = weights(200_000, "bfloat16", rng)
    new = changed(old, 0.02, rng)
    positions = np.flatnonzero(old != new).astype(np.int64)
    xor, rows = (old ^ new)[positions], classed.exponent_rows(old, "bfloat16")
    want = classed.encode_classed_counted(positions, new, "bfloat16", xor=xor, rows=rows)
    base, count = want.classes
    starts = classed.class_starts(rows, base, count)
    _, ranks, adjacent = kernels.class_ranks(
        old, positions, old[positions], SHIFT, MASK, base, count, starts
    )

    def encoded(ranked, rows=rows):
        code = classed.encode_classed_counted(
            positions, new, "bfloat16", xor=xor, rows=rows, ranked=ranked
        )
        assert np.array_equal(code.rows, want.rows)
        return code.stream, code.runs, code.classes

    calls = collections.Counter()
    counting = kernels.class_ranks

    def counted(*args, **kwargs):
        calls["rank pass"] += 1
        return counting(*args, **kwargs)

    expected = (want.stream, want.runs, want.classes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "class_ranks", counted)
        assert encoded((base, count, ranks, adjacent)) == expected and not calls
        wrong = (base + 1, count, ranks + 1, adjacent)  # another choice's: not used
        assert encoded(wrong) == expected and calls["rank pass"] == 1
        assert encoded((base, count, ranks + 1, adjacent), rows[:, :3]) == expected
    with pytest.raises(ValueError, match="one rank per position"):
        encoded((base, count, ranks[1:], adjacent))


def test_the_plan_is_the_last_classes_with_the_starts_of_the_kept_rows(monkeypatch):
    """The classes a diff ranks in are those kept with the rows; nothing to guess from, rows
    of another tensor, a dtype without classes or no compiled diff: no plan. The numpy
    class starts are the compiled ones."""
    rng = np.random.default_rng(11)
    old = weights(3 * native.TASK + 5, "bfloat16", rng)
    rows = classed.exponent_rows(old, "bfloat16")
    plan = class_plan(KeptClasses(rows, (117, 6)), "bfloat16", old.size)
    assert plan is not None and (plan.shift, plan.mask, plan.base, plan.classes) == (
        SHIFT,
        MASK,
        117,
        6,
    )
    assert np.array_equal(plan.starts, kernels.class_starts(rows, 117, 6))
    assert class_plan(None, "bfloat16", old.size) is None
    assert class_plan(KeptClasses(rows, None), "bfloat16", old.size) is None
    assert class_plan(KeptClasses(rows, (117, 6)), "bfloat16", old.size + 1) is None
    assert class_plan(KeptClasses(rows, (117, 6)), "int16", old.size) is None
    monkeypatch.setattr(classed, "_native", lambda: None)  # the numpy starts
    assert np.array_equal(classed.class_starts(rows, 117, 6), plan.starts)
    monkeypatch.setenv("DCR_KERNELS", "torch")
    assert class_plan(KeptClasses(rows, (117, 6)), "bfloat16", old.size) is None


def states(steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """bf16 exports of fp32 masters taking Adam-like steps (every element moves by about
    1e-4): one tensor past a task, one small one."""
    gen = torch.Generator().manual_seed(seed)
    masters = {
        "big.weight": torch.randn(native.TASK * 2 + 999, generator=gen) * 0.02,
        "small.weight": torch.randn(64, 48, generator=gen) * 0.02,
    }
    out = []
    for _ in range(steps):
        out.append({n: t.to(torch.bfloat16) for n, t in masters.items()})
        for t in masters.values():
            t.add_(torch.randn(t.shape, generator=gen).sign_(), alpha=1e-4)
    return out


def shards_of(root: Path, version: int) -> list[bytes]:
    return [p.read_bytes() for p in sorted(root.glob(f"objects/{version:020d}/*/shard-*"))]


def test_a_writer_ranking_in_its_diff_stores_the_bytes_of_one_that_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long-lived writer ranks each step's changes in its diff, in the classes of the
    tensor's last stream, which it keeps with the rows; its shards are byte for byte
    those of a writer whose diffs rank nothing, step after step."""
    steps = states(6, 0)
    outcome: collections.Counter[str] = collections.Counter()
    encode = delta_module.encode_classed_counted

    def observed(*args, **kwargs):
        code = encode(*args, **kwargs)
        ranked = kwargs.get("ranked")
        outcome[
            "none" if ranked is None else ("used" if ranked[:2] == code.classes else "not")
        ] += 1
        return code

    monkeypatch.setattr(delta_module, "encode_classed_counted", observed)
    ranking = DeltaWriter(tmp_path / "ranking")
    for step, state in enumerate(steps):
        ranking.publish(state, step=step)
    kept = ranking._part._rows  # type: ignore[union-attr]
    assert set(kept) == {"big.weight", "small.weight"}
    assert all(k.classes is not None for k in kept.values())
    assert outcome["used"] >= 4, outcome  # the later steps' diffs ranked their changes
    outcome.clear()
    monkeypatch.setattr(pipeline, "class_plan", lambda *args: None)
    plain = DeltaWriter(tmp_path / "plain")
    for step, state in enumerate(steps):
        plain.publish(state, step=step)
    assert outcome["used"] == 0 and outcome["none"] > 0
    for version in range(len(steps)):
        assert shards_of(tmp_path / "ranking", version) == shards_of(tmp_path / "plain", version)
