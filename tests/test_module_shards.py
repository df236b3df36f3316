"""Tensor-parallel shards applied straight into their placements, bit-equal to the loader.

The runtime below places each rank's share of a canonical tensor like vLLM and SGLang do:
blocks of rows (fused ``qkv``, a vocab-parallel embedding), blocks of columns (row-parallel
projections), and a few placements a shard can also take (a share placed in two pieces in
the other order, a column block written transposed, a share placed twice). Every change goes
through the placements learned once; the loader itself (``direct=False``) is the reference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
import torch
from test_module_target import LaneSum, in_threads
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget
from dcr_format.chain.chain import Chain
from dcr_format.delta.delta import OVERWRITE, XOR
from dcr_format.delta.fingerprint import apply_lane_deltas, lanes_after_change
from dcr_format.errors import BaselineMismatchError
from dcr_format.format.dtypes import bits_view
from dcr_format.store.store import open_store
from dcr_format.targets import module_apply
from dcr_format.targets.module_apply import _apply_placed

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "module_tp_bench.py"
TP = 2
SPECS = {
    "q.weight": (8, 6),  # rows of a fused parameter
    "k.weight": (4, 6),
    "o.weight": (6, 8),  # columns
    "embed.weight": (16, 6),  # rows (vocab-parallel)
    "split.weight": (8, 6),  # the rank's rows, placed in two pieces, the second first
    "halves.weight": (6, 8),  # the rank's columns, placed in two pieces, the second first
    "transposed.weight": (6, 8),  # the rank's columns, placed transposed
    "twice.weight": (4, 6),  # the rank's rows, placed in two parameters
}


class Shards(nn.Module):
    """Rank ``rank`` of ``tp``: a loader that narrows each canonical tensor to its share."""

    def __init__(self, rank: int, tp: int = TP) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16), requires_grad=False)

        self.qk = param(12 // tp, 6)
        self.o = param(6, 8 // tp)
        self.embed = param(16 // tp, 6)
        self.split = param(8 // tp, 6)
        self.halves = param(6, 8 // tp)
        self.transposed = param(8 // tp, 6)
        self.twice = param(2, 4 // tp, 6)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        r, tp = self.rank, self.tp
        for name, w in weights:
            rows, cols = w.shape[0] // tp, w.shape[1] // tp
            mine_rows = w.narrow(0, r * rows, rows)
            mine_cols = w.narrow(1, r * cols, cols)
            if name in ("q.weight", "k.weight"):
                at = 0 if name == "q.weight" else 8 // tp
                self.qk.data.narrow(0, at, rows).copy_(mine_rows)
            elif name == "o.weight":
                self.o.data.copy_(mine_cols)
            elif name == "embed.weight":
                self.embed.data.copy_(mine_rows)
            elif name == "split.weight":
                half = rows // 2
                self.split.data[half:].copy_(mine_rows[:half])
                self.split.data[:half].copy_(mine_rows[half:])
            elif name == "halves.weight":
                half = cols // 2
                self.halves.data[:, half:].copy_(mine_cols[:, :half])
                self.halves.data[:, :half].copy_(mine_cols[:, half:])
            elif name == "transposed.weight":
                self.transposed.data.copy_(mine_cols.t())
            elif name == "twice.weight":
                self.twice.data[0].copy_(mine_rows)
                self.twice.data[1].copy_(mine_rows)
            else:
                raise KeyError(name)


def checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(*s, generator=gen).bfloat16() for n, s in SPECS.items()}


def step(state: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        new = tensor.clone()
        new.view(-1)[k % 3 :: 4] += 0.125 * (k + 1)
        out[name] = new
    return out


def bits_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().reshape(-1).view(torch.uint8).clone() for n, p in module.state_dict().items()
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def dense(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    module = Shards(rank)
    module.load_weights(state.items())
    return bits_of(module)


def test_every_shard_is_placed_and_verified(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    modules = {d: [Shards(r) for r in range(TP)] for d in (True, False)}
    lanes = {d: LaneSum(TP) for d in (True, False)}
    readers = {
        d: [
            DeltaReader(
                store,
                ModuleTarget(
                    m, load_weights=m.load_weights, reduce_lanes=lanes[d].rank(r), direct=d
                ),
                reader_id=f"rank-{r}-{d}",
            )
            for r, m in enumerate(modules[d])
        ]
        for d in (True, False)
    }
    for d in (True, False):
        in_threads(lambda r, d=d: readers[d][r].sync(), TP)
    plans = readers[True][0].target.prewarm({n: (torch.bfloat16, s) for n, s in SPECS.items()})  # type: ignore[attr-defined]
    assert {n for n, p in plans.items() if p.kind == "xor"} == set(SPECS)
    assert [n for n, p in plans.items() if p.duplicated] == ["twice.weight"]
    for k in range(3):
        state = step(state, k)
        writer.publish(state)
        for d in (True, False):
            results = in_threads(lambda r, d=d: readers[d][r].sync(), TP)
            assert all(not result.unverified for result in results)
        for r in range(TP):
            want = dense(state, r)
            assert same(bits_of(modules[True][r]), want)
            assert same(bits_of(modules[False][r]), want)


@pytest.mark.parametrize("op", [XOR, OVERWRITE])
@pytest.mark.parametrize("rank", range(TP))
def test_the_placed_apply_moves_what_the_copy_by_copy_apply_moves(op, rank):
    state = checkpoint()
    fast, slow = Shards(rank), Shards(rank)
    fast.load_weights(state.items())
    slow.load_weights(state.items())
    start = bits_of(fast)
    targets = [ModuleTarget(m, load_weights=m.load_weights) for m in (fast, slow)]
    gen = torch.Generator().manual_seed(rank)
    for name, shape in SPECS.items():
        if name == "twice.weight":
            continue  # placed twice: the apply goes copy by copy
        plans = [t.plan(name, torch.bfloat16, shape) for t in targets]
        numel = shape[0] * shape[1]
        positions = torch.sort(torch.randperm(numel, generator=gen)[: numel // 3]).values
        values = torch.randint(-(1 << 15), 1 << 15, (positions.numel(),), generator=gen)
        values = values.to(torch.int16)
        if op == XOR:
            values |= 1  # every position changes
        done = _apply_placed(targets[0], plans[0], op, positions, values)
        txn = targets[1].begin()
        reference = txn._apply_each(plans[1], op, positions, values)  # type: ignore[attr-defined]
        assert done.positions is not None and reference.positions is not None
        assert torch.equal(done.positions, reference.positions), name
        assert torch.equal(done.before, reference.before), name  # type: ignore[arg-type]
        assert torch.equal(done.after, reference.after), name  # type: ignore[arg-type]
        assert same(bits_of(fast), bits_of(slow)), name
        if done.lane_deltas is not None:  # summed by the kernel at the canonical positions
            lanes = (1, 2)
            assert apply_lane_deltas(lanes, done.lane_deltas) == lanes_after_change(
                lanes,
                done.positions,
                done.before,
                done.after,  # type: ignore[arg-type]
            )
        done.undo()
        reference.undo()
        assert same(bits_of(fast), start) and same(bits_of(slow), start), name
    row_runs = {"q.weight", "k.weight", "embed.weight", "split.weight"}
    for name in row_runs:  # placed as runs of rows: the lanes come from the apply itself
        plan = targets[0].plan(name, torch.bfloat16, SPECS[name])
        numel = SPECS[name][0] * SPECS[name][1]
        every = torch.arange(numel)
        done = _apply_placed(targets[0], plan, op, every, torch.ones(numel, dtype=torch.int16))
        assert done.lane_deltas is not None
        done.undo()


def test_a_failed_verification_rolls_every_rank_back(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    modules = [Shards(r) for r in range(TP)]
    lanes = LaneSum(TP)
    targets = [
        ModuleTarget(m, load_weights=m.load_weights, reduce_lanes=lanes.rank(r))
        for r, m in enumerate(modules)
    ]
    readers = [DeltaReader(store, t, reader_id=f"rank-{r}") for r, t in enumerate(targets)]
    in_threads(lambda r: readers[r].sync(), TP)
    state = step(state, 0)
    state = step(state, 1)
    writer.publish(state)
    in_threads(lambda r: readers[r].sync(), TP)
    writer.publish(step(state, 2))
    for name, edit in (("o.weight", lambda m: m.o), ("embed.weight", lambda m: m.embed)):
        with torch.no_grad():  # changed outside dcr at a position the delta changes (0 % 4)
            bits_view(edit(modules[0])).view(-1)[2] ^= 1
        before = [bits_of(m) for m in modules]
        with pytest.raises(BaselineMismatchError, match=re.escape(repr(name))):
            in_threads(lambda r: readers[r].sync(), TP)
        for r, m in enumerate(modules):
            assert same(bits_of(m), before[r])  # every placed change undone, on both ranks
            assert targets[r].resident().version == 1  # type: ignore[union-attr]
        with torch.no_grad():
            bits_view(edit(modules[0])).view(-1)[2] ^= 1
    in_threads(lambda r: readers[r].sync(), TP)
    for r, m in enumerate(modules):
        assert same(bits_of(m), dense(step(state, 2), r))


PLACED_ONCE = set(SPECS) - {"twice.weight"}  # placed twice: applied copy by copy


def _published(tmp_path: Path) -> tuple[DeltaWriter, dict, list[Shards], list[DeltaReader]]:
    """A writer at a base of :func:`checkpoint` and the ranks synced to it."""
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    return (writer, state, *_ranks(store))


def _ranks(store: str) -> tuple[list[Shards], list[DeltaReader]]:
    modules = [Shards(r) for r in range(TP)]
    lanes = LaneSum(TP)
    readers = [
        DeltaReader(
            store,
            ModuleTarget(m, load_weights=m.load_weights, reduce_lanes=lanes.rank(r)),
            reader_id=f"rank-{r}",
        )
        for r, m in enumerate(modules)
    ]
    in_threads(lambda r: readers[r].sync(), TP)
    return modules, readers


def test_a_prepared_version_writes_every_shard_as_staged(tmp_path, monkeypatch):
    writer, state, modules, readers = _published(tmp_path)
    for k in range(2):
        state = step(state, k)
        writer.publish(state)
        prepared = in_threads(lambda r: readers[r].prepare(), TP)
        for one in prepared:  # every shard placed once is read ahead against its storage
            assert {n for n, s in one._staged.items() if s.placed} == PLACED_ONCE
        with monkeypatch.context() as patched:  # so the pause only writes what was staged
            patched.setattr(module_apply, "_apply_placed", _never)
            patched.setattr(module_apply, "_stage_placed", _never)
            results = in_threads(lambda r, p=prepared: readers[r].apply(p[r]), TP)
        assert all(not result.unverified for result in results)
        for r, module in enumerate(modules):
            assert same(bits_of(module), dense(state, r))


def test_a_shard_with_no_change_on_one_rank_is_staged_empty_there(tmp_path):
    writer, state, modules, readers = _published(tmp_path)
    state = dict(state)
    embed = state["embed.weight"].clone()
    embed[:2] += 1.0  # rows of rank 0's share only
    state["embed.weight"] = embed
    writer.publish(state)
    prepared = in_threads(lambda r: readers[r].prepare(), TP)
    sizes = [int(one._staged["embed.weight"].bits.positions.numel()) for one in prepared]
    assert sizes[0] > 0 and sizes[1] == 0
    results = in_threads(lambda r: readers[r].apply(prepared[r]), TP)
    assert all(not result.unverified for result in results)
    for r, module in enumerate(modules):
        assert same(bits_of(module), dense(state, r))


def _never(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise AssertionError("the pause read a shard again")


def test_a_shard_whose_storage_moved_after_staging_is_applied_again(tmp_path, monkeypatch):
    applied: list[str] = []

    def spy(target, plan, *args):  # type: ignore[no-untyped-def]
        applied.append(plan.name)
        return _apply_placed(target, plan, *args)

    monkeypatch.setattr(module_apply, "_apply_placed", spy)
    writer, state, modules, readers = _published(tmp_path)
    state = step(state, 0)
    writer.publish(state)
    prepared = in_threads(lambda r: readers[r].prepare(), TP)
    with torch.no_grad():  # the runtime re-creates one rank's weight after the staging read
        modules[0].o.data = modules[0].o.data.clone()
        modules[1].qk.data = modules[1].qk.data.clone()
    applied.clear()
    results = in_threads(lambda r: readers[r].apply(prepared[r]), TP)
    # a batch is written whole or not at all: on each rank (a storage of each moved) every
    # shard staged with it is applied again, against the storage it holds now
    assert sorted(applied) == sorted([*PLACED_ONCE, *PLACED_ONCE])
    assert all(not result.unverified for result in results)
    for r, module in enumerate(modules):
        assert same(bits_of(module), dense(state, r))


def test_a_staged_shard_that_does_not_verify_rolls_every_rank_back(tmp_path):
    writer, state, modules, readers = _published(tmp_path)
    writer.publish(step(state, 0))
    with torch.no_grad():  # changed outside dcr at a position the delta changes (0 % 4)
        bits_view(modules[1].o).view(-1)[0] ^= 1
    before = [bits_of(m) for m in modules]
    prepared = in_threads(lambda r: readers[r].prepare(), TP)
    assert all("o.weight" in one._staged and one._staged["o.weight"].placed for one in prepared)
    with pytest.raises(BaselineMismatchError, match=re.escape(repr("o.weight"))):
        in_threads(lambda r: readers[r].apply(prepared[r]), TP)
    for r, module in enumerate(modules):
        assert same(bits_of(module), before[r])  # every staged write undone, on both ranks
        assert readers[r].target.resident().version == 0  # type: ignore[union-attr]


def test_shards_take_ulp_values_their_ranks_complete_at_the_elements_they_hold(tmp_path):
    """A rank holds part of each sharded tensor, so its record asks writers for no coding
    that needs the whole tensor's old bits (``classed``, ``ulp-shift``) but says it reads
    the old bits of each changed element it holds (``reads_changed``): the shards' values
    come as ulp differences, which each rank completes at its own elements, prepared
    (staged against its storage) and in a plain sync alike."""
    gen = torch.Generator().manual_seed(5)
    # (a tensor placed twice is read back copy by copy: a module holding one reads the old
    # bits of whole tensors only, so this one holds none)
    masters = {n: torch.randn(*SPECS[n], generator=gen) * 0.02 for n in sorted(PLACED_ONCE)}

    def stepped() -> dict[str, torch.Tensor]:
        for master in masters.values():  # one or two ulps of most elements
            master += 1e-4 * torch.sign(torch.randn(master.shape, generator=gen))
        return {n: m.bfloat16() for n, m in masters.items()}

    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    writer.publish({n: m.bfloat16() for n, m in masters.items()})
    modules, readers = _ranks(store)
    for key in ("readers/rank-0.json", "readers/rank-1.json"):
        record = json.loads(open_store(store).get(key))
        assert (record["reads_baseline"], record["reads_changed"]) == (False, True)
    twice = Shards(0)  # a name placed twice is read back copy by copy: not said
    target = ModuleTarget(twice, load_weights=twice.load_weights)
    target.prewarm({n: (torch.bfloat16, s) for n, s in SPECS.items()})
    assert not target.reads_changed()
    for version in (1, 2):
        state = stepped()
        writer.publish(state)
        codings = _codings(store, version)
        assert all(not c & {"classed", "ulp-shift"} for c in codings.values()), codings
        assert {n for n, c in codings.items() if "ulp" in c} >= {"q.weight", "o.weight"}
        if version == 1:
            prepared = in_threads(lambda r: readers[r].prepare(), TP)
            for one in prepared:  # (an unchanged shard has nothing to stage)
                assert {n for n, s in one._staged.items() if s.placed} == set(codings)
            results = in_threads(lambda r, p=prepared: readers[r].apply(p[r]), TP)
        else:
            results = in_threads(lambda r: readers[r].sync(), TP)
        assert all(not result.unverified for result in results)
        for r, module in enumerate(modules):
            assert same(bits_of(module), dense(state, r)), version


def _codings(store: str, version: int) -> dict[str, set[str | None]]:
    """The position and value codings of each changed ``xor``/``overwrite`` entry of
    ``version``."""
    chain = Chain(open_store(store))
    return {
        e.name: {e.positions and e.positions.coding, e.values and e.values.coding}
        for m in chain.manifests(chain.record(version))
        for e in m.entries
        if e.changed and e.op != "full"  # (a tensor this small may go whole)
    }


def test_module_tp_bench_quick_runs():
    spec = importlib.util.spec_from_file_location("module_tp_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--hidden", "32", "--layers", "1", "--steps", "1", "--json"]) == 0
    result = json.loads(out.getvalue())
    assert result["tp2"]["pause_s"] > 0 and result["ratio_per_changed"] > 0
