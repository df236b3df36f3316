"""Exponent rows (codec/classed.exponent_rows): both ends of a ``positions-classed`` chain
count, per run of ROW_ELEMENTS elements, the exponent histogram of the old bits before a
stream can be coded or decoded. A long-lived writer and reader keep those rows and move only
the changed elements, so that a step does not read every element twice. These tests pin the
compiled rows to the numpy reference, show that a kept row set gives byte-identical streams
and positions, that writers and readers keep exactly the rows of the bits they hold, that the
pass is not made again in steady state, and that rows of other bits never turn into a wrong
apply (refused, or counted again)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.codings import classed
from dcr_format.codings.classed import (
    ROW_ELEMENTS,
    decode_classed,
    encode_classed,
    encode_classed_counted,
    exponent_rows,
    move_rows,
    rows_fit,
)
from dcr_format.codings.values import encode_values
from dcr_format.delta import classed_change
from dcr_format.delta.classed_change import decode_classed_at
from dcr_format.delta.delta import (
    DecodedDelta,
    PendingDelta,
    apply_change,
    decode_delta,
    resolve,
)
from dcr_format.errors import BaselineMismatchError, PositionsError
from dcr_format.format.dtypes import info_for

FEATURE = "positions-classed"
DTYPES = {
    "bfloat16": (torch.bfloat16, np.uint16),
    "float16": (torch.float16, np.uint16),
    "float32": (torch.float32, np.uint32),
    "float64": (torch.float64, np.uint64),
}


@pytest.fixture(params=["native", "reference"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "reference":
        monkeypatch.setenv("DCR_KERNELS", "torch")
    return str(request.param)


def weights(n: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Unsigned bits of ``n`` weights of about 0.02, with some zeros and large values."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen, dtype=torch.float64) * 0.02
    values[::97] = 0.0
    values[::1013] *= 1e4
    torch_dtype, bits = DTYPES[dtype]
    signed = {2: torch.int16, 4: torch.int32, 8: torch.int64}[np.dtype(bits).itemsize]
    return values.to(torch_dtype).view(signed).numpy().view(bits).copy()


def step(old: np.ndarray, dtype: str, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """New bits (about ``rate`` of the elements moved by an ulp or so, small ones more
    often, as in a real step) and their positions."""
    rng = np.random.default_rng(seed)
    shift, mask = classed.EXPONENT_FIELDS[dtype]
    e = (old.astype(np.uint64) >> np.uint64(shift)) & np.uint64(mask)
    odds = np.where(e < np.median(e), 1.8, 0.2) * rate
    positions = np.flatnonzero(rng.random(old.size) < odds).astype(np.int64)
    new = old.copy()
    new[positions] = old[positions] + old.dtype.type(1) + (rng.random(positions.size) < 0.2)
    return new, positions


def counted(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The rows as the definition says, one run at a time."""
    shift, mask = classed.EXPONENT_FIELDS[dtype]
    runs = -(-bits.size // ROW_ELEMENTS)
    out = np.zeros((runs, mask + 1), dtype=np.int64)
    for r in range(runs):
        chunk = bits[r * ROW_ELEMENTS : (r + 1) * ROW_ELEMENTS].astype(np.uint64)
        e = (chunk >> np.uint64(shift)) & np.uint64(mask)
        out[r] = np.bincount(e.astype(np.int64), minlength=mask + 1)
    return out


@pytest.mark.parametrize("rate", [0.02, 0.1])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rows_and_their_moves_match_the_definition(kernels: str, dtype: str, rate: float) -> None:
    old = weights(2 * ROW_ELEMENTS + 4321, dtype)
    rows = exponent_rows(old, dtype)
    assert np.array_equal(rows, counted(old, dtype)) and rows_fit(rows, old.size, dtype)
    new, positions = step(old, dtype, rate, 1)
    moved = rows.copy()
    changed = move_rows(moved, positions, old[positions], new[positions], dtype)
    assert np.array_equal(moved, counted(new, dtype))
    shift, mask = classed.EXPONENT_FIELDS[dtype]
    e = ((old[positions].astype(np.uint64) >> np.uint64(shift)) & np.uint64(mask)).astype(int)
    assert np.array_equal(changed, np.bincount(e, minlength=mask + 1))
    move_rows(moved, positions, old[positions], new[positions], dtype, forward=False)
    assert np.array_equal(moved, rows)
    untallied = move_rows(moved, positions, old[positions], new[positions], dtype, tally=False)
    assert untallied.size == 0 and np.array_equal(moved, counted(new, dtype))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dense_moves_across_rows_land_in_each_changes_row(kernels: str, dtype: str) -> None:
    """Every change leaves its exponent, and groups of 64 changes span row ends: each move
    goes to the row of its own position (the kernel looks a row up only at a row's first
    moving change)."""
    old = weights(3 * ROW_ELEMENTS + 77, dtype)
    rng = np.random.default_rng(5)
    shift, _ = classed.EXPONENT_FIELDS[dtype]
    # runs of changes that straddle each row end, and a few far apart
    ends = [ROW_ELEMENTS * r for r in (1, 2, 3)]
    near = np.concatenate([np.arange(e - 70, e + 70) for e in ends])
    positions = np.unique(np.concatenate([near, rng.choice(old.size, 500, replace=False)]))
    new = old.copy()
    one = np.array(1, dtype=old.dtype) << np.array(shift, dtype=old.dtype)
    new[positions] ^= one  # the exponent's lowest bit: every change moves
    for moving in (positions, positions[positions % 3 == 0]):  # all, or every third moves
        after = old.copy()
        after[moving] = new[moving]
        rows = exponent_rows(old, dtype)
        move_rows(rows, positions, old[positions], after[positions], dtype, tally=False)
        assert np.array_equal(rows, counted(after, dtype))


def test_rows_that_do_not_fit_the_tensor_are_not_taken(kernels: str) -> None:
    bits = weights(2 * ROW_ELEMENTS + 10, "bfloat16")
    rows = exponent_rows(bits, "bfloat16")
    assert rows_fit(rows, bits.size, "bfloat16")
    for run in range(rows.shape[0]):  # any run's total off by one, the last one's too
        wrong = rows.copy()
        wrong[run, 5] += 1
        assert not rows_fit(wrong, bits.size, "bfloat16")
        wrong[run, 6] -= 1  # the same total, other counts: only the totals are checked
        assert rows_fit(wrong, bits.size, "bfloat16")
    assert not rows_fit(None, bits.size, "bfloat16")
    assert not rows_fit(rows, bits.size + 1, "bfloat16")  # run totals differ
    assert not rows_fit(rows[:1], bits.size, "bfloat16")  # too few runs
    assert not rows_fit(rows, bits.size, "float16")  # another exponent field
    assert not rows_fit(rows.astype(np.int32), bits.size, "bfloat16")
    assert not rows_fit(rows, bits.size, "int16")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kept_rows_give_the_same_stream_and_positions(kernels: str, dtype: str) -> None:
    old = weights(ROW_ELEMENTS + 999, dtype, seed=3)
    new, positions = step(old, dtype, 0.01, 4)
    xor = old[positions] ^ new[positions]
    want = encode_classed(positions, old, dtype)
    assert encode_classed(positions, new, dtype, xor=xor) == want
    for rows in (None, exponent_rows(old, dtype)):  # counted here, or kept by the writer
        for after in (None, new[positions]):
            stream, after_rows, _, _ = encode_classed_counted(
                positions, new, dtype, xor=xor, after=after, rows=rows
            )
            assert stream == want
            assert np.array_equal(after_rows, counted(new, dtype))
    kept = exponent_rows(old, dtype)
    found = decode_classed(want, old, dtype, count=positions.size, numel=old.size, rows=kept)
    assert np.array_equal(found, positions)


def test_rows_of_other_bits_are_refused_or_counted_again() -> None:
    old = weights(3 * ROW_ELEMENTS, "bfloat16", seed=5)
    _, positions = step(old, "bfloat16", 0.01, 6)
    stream = encode_classed(positions, old, "bfloat16")
    other = weights(old.size, "bfloat16", seed=7)
    other[: ROW_ELEMENTS // 2] = 0  # many elements in another class than in ``old``
    wrong = exponent_rows(other, "bfloat16")
    assert rows_fit(wrong, old.size, "bfloat16")
    # decoded with rows of other bits: refused (never a crash or a write past the output)
    with pytest.raises(PositionsError):
        decode_classed(stream, old, "bfloat16", count=positions.size, numel=old.size, rows=wrong)
    # the right class sizes but not per run (two runs' rows swapped): each run of the select
    # pass finds more or fewer of its ranks than the rows place in it, and says so
    skewed = weights(3 * ROW_ELEMENTS, "bfloat16", seed=8)
    skewed[: ROW_ELEMENTS // 2] = 0
    _, at = step(skewed, "bfloat16", 0.01, 9)
    code = encode_classed(at, skewed, "bfloat16")
    swapped = exponent_rows(skewed, "bfloat16")[[1, 0, 2]]
    assert classed.parse_classed(code, count=at.size, dtype="bfloat16").classes > 1
    with pytest.raises(PositionsError, match="does not decode"):
        decode_classed(code, skewed, "bfloat16", count=at.size, numel=skewed.size, rows=swapped)
    # the resolve path counts the held bits' rows again before refusing, and keeps them
    parsed = classed.parse_classed(stream, count=positions.size, dtype="bfloat16")
    found, used = decode_classed_at(parsed, wrong, old, "bfloat16")
    assert np.array_equal(found, positions)
    assert np.array_equal(used, counted(old, "bfloat16"))
    # and without rows given it gives back those it counted
    found, fresh = decode_classed_at(parsed, None, old, "bfloat16")
    assert np.array_equal(found, positions) and np.array_equal(fresh, used)
    # against bits that are not the parent's, counted afresh, the stream is still refused
    with pytest.raises(PositionsError):
        decode_classed_at(parsed, None, other, "bfloat16")


def test_a_pending_change_takes_kept_rows_and_its_resolved_form_gives_them_back() -> None:
    """A ``classed`` change decodes as a :class:`PendingDelta`, which does not apply as it
    is; :func:`resolve` gives a :class:`DecodedDelta` that carries the rows it decoded with:
    the ones handed in where they fit (the same array), else those it counted. Resolving
    changes nothing in the pending change, and a resolved change resolves to itself."""
    old = weights(3 * ROW_ELEMENTS, "bfloat16", seed=4)
    new, positions = step(old, "bfloat16", 0.02, 5)
    code = encode_classed(positions, old, "bfloat16")
    pending = decode_delta(
        "xor",
        info_for(torch.bfloat16),
        old.size,
        positions.size,
        positions=("classed", code),
        values=encode_values(old[positions] ^ new[positions]),
    )
    assert isinstance(pending, PendingDelta) and pending.rows is None
    target = torch.from_numpy(old.view(np.int16).copy()).view(torch.bfloat16)
    with pytest.raises(ValueError, match="resolve"):
        apply_change(target, pending)
    counted_here = resolve(pending, target)
    assert isinstance(counted_here, DecodedDelta) and counted_here.positions is not None
    assert np.array_equal(counted_here.positions.numpy(), positions)
    assert counted_here.rows is not None
    assert np.array_equal(counted_here.rows, counted(old, "bfloat16"))
    kept = exponent_rows(old, "bfloat16")
    given = resolve(replace(pending, rows=kept), target)
    assert given.rows is kept and pending.rows is None
    assert given.positions is not None and torch.equal(given.positions, counted_here.positions)
    assert resolve(given, target) is given
    apply_change(target, given)
    assert np.array_equal(target.view(torch.int16).numpy().view(np.uint16), new)


class Trainer:
    """fp32 masters published as bf16, each step moving every master by about ``lr``."""

    def __init__(self, seed: int, shapes: dict[str, tuple[int, ...]]) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.masters = {n: torch.randn(*s, generator=self.gen) * 0.02 for n, s in shapes.items()}

    def state(self) -> dict[str, torch.Tensor]:
        return {n: m.to(torch.bfloat16) for n, m in self.masters.items()}

    def step(self) -> dict[str, torch.Tensor]:
        for master in self.masters.values():
            master += 2e-6 * torch.sign(torch.randn(master.shape, generator=self.gen))
        return self.state()


SHAPES = {"a.weight": (600, 1024), "b.weight": (128, 256), "norm.weight": (512,)}


def rows_of(tensor: torch.Tensor) -> np.ndarray:
    return counted(tensor.reshape(-1).view(torch.int16).numpy().view(np.uint16), "bfloat16")


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the full passes that count rows (the classed module's and the resolve path's)."""
    calls: list[int] = []
    real = classed.exponent_rows

    def spy(bits: np.ndarray, dtype: str) -> np.ndarray:
        calls.append(int(bits.size))
        return real(bits, dtype)

    monkeypatch.setattr(classed, "exponent_rows", spy)
    monkeypatch.setattr(classed_change, "exponent_rows", spy)
    return calls


def started(
    tmp_path: Path, seed: int
) -> tuple[Path, DeltaWriter, Trainer, StateDictTarget, DeltaReader]:
    """A classed chain's writer with its base published, and a reader synced to it."""
    store = tmp_path / "store"
    writer = DeltaWriter(store, features=[FEATURE])
    trainer = Trainer(seed, SHAPES)
    writer.publish(trainer.state())
    target = StateDictTarget({})
    reader = DeltaReader(store, target)
    reader.sync()
    return store, writer, trainer, target, reader


def classed_names(store: Path, version: int) -> set[str]:
    from dcr_format.chain.chain import Chain
    from dcr_format.store.store import open_store

    chain = Chain(open_store(store))
    return {
        e.name
        for m in chain.manifests(chain.record(version))
        for e in m.entries
        if e.positions is not None and e.positions.coding == "classed"
    }


def test_a_long_lived_writer_and_reader_keep_the_rows_of_their_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, writer, trainer, target, reader = started(tmp_path, 1)
    calls = counting(monkeypatch)
    states = []
    for version in range(1, 6):
        states.append(trainer.step())
        writer.publish(states[-1])
        names = classed_names(store, version)
        assert "a.weight" in names
        if version == 3:  # staged while preparing, then written
            prepared = reader.prepare()
            assert prepared._staged
            reader.apply(prepared)
        else:
            reader.sync()
        for name, tensor in states[-1].items():
            assert torch.equal(target.tensors[name].view(torch.int16), tensor.view(torch.int16))
        part = writer._part
        kept = part._rows  # type: ignore[union-attr]
        for name in names:  # each end holds the rows of the bits it now holds
            assert np.array_equal(kept[name].rows, rows_of(part.baseline[name]))
            fingerprint, rows = reader._rows[name]  # keyed by the bits' fingerprint
            assert fingerprint == part._fingerprints[name]  # type: ignore[union-attr]
            assert np.array_equal(rows, rows_of(target.tensors[name]))
        if version == 1:  # counted once at each end (the writer from its new bits)
            assert calls and sum(calls) == 2 * sum(states[-1][n].numel() for n in names)
            calls.clear()
    assert calls == []  # not again while the rows are kept


def test_several_versions_in_one_sync_follow_the_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, writer, trainer, target, reader = started(tmp_path, 2)
    for _ in range(3):
        writer.publish(trainer.step())
    calls = counting(monkeypatch)
    result = reader.sync()
    assert result.applied_versions == (1, 2, 3)
    names = classed_names(store, 1)
    # counted for the first version's parents only; the next two take the moved rows
    assert sum(calls) == sum(target.tensors[n].numel() for n in names)
    for name in names:
        assert np.array_equal(reader._rows[name][1], rows_of(target.tensors[name]))


def test_an_edited_target_with_kept_rows_is_refused_and_the_rows_dropped(
    tmp_path: Path,
) -> None:
    _, writer, trainer, target, reader = started(tmp_path, 3)
    writer.publish(trainer.step())
    reader.sync()
    assert "a.weight" in reader._rows  # kept from version 1
    writer.publish(trainer.step())
    tensor = target.tensors["a.weight"]
    tensor.view(-1)[:8192] *= 2  # outside dcr: moves elements between classes
    edited = tensor.clone()
    with pytest.raises(BaselineMismatchError):
        reader.sync()
    assert torch.equal(target.tensors["a.weight"].view(torch.int16), edited.view(torch.int16))
    assert target.resident().version == 1
    assert reader._rows == {}  # counted again after any failure
