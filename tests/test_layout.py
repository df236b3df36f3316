"""Layouts and the projection writer: publishing from sharded local tensors gives exactly the
canonical version that publishing the gathered canonical tensors gives (FORMAT.md §4.8)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_format import (
    DeltaReader,
    DeltaWriter,
    ProjectionWriter,
    StateDictTarget,
    ThreadCoordinator,
)
from dcr_format.chain.chain import Chain
from dcr_format.chain.layout import (
    Layout,
    Piece,
    View,
    converted,
    experts,
    fused,
    interleaved_qkv,
    shard,
    transposed,
    whole,
)
from dcr_format.errors import (
    ChainBrokenError,
    IncompleteVersionError,
    SchemaError,
    UnsupportedFeatureError,
)
from dcr_format.format import schema
from dcr_format.store.store import open_store
from dcr_format.testing.processes import in_threads

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "layout_bench.py"

# --- views -----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    perm_seed=st.integers(0, 100),
    offset=st.integers(0, 7),
    pad=st.integers(0, 2),
)
def test_nested_views_invert_exactly(sizes, perm_seed, offset, pad):
    # a permuted, padded sub-block of a row-major tensor: nested by construction
    order = list(range(len(sizes)))
    torch.manual_seed(perm_seed)
    order = [order[i] for i in torch.randperm(len(order)).tolist()]
    strides = [0] * len(sizes)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= sizes[d] + pad
    view = View(offset, tuple(sizes), tuple(strides))
    assert view.nested
    elements = view.elements()
    assert torch.unique(elements).numel() == view.numel
    k = torch.arange(view.numel)
    assert torch.equal(view.elements(k), elements)
    probe = torch.arange(view.end + 5)
    inside, found = view.locate(probe)
    assert int(inside.sum()) == view.numel
    assert torch.equal(view.elements(found[inside]), probe[inside])


def test_views_that_reach_an_element_twice_are_not_placements():
    assert not View(0, (2, 3), (1, 1)).nested
    assert not View(0, (4,), (0,)).nested
    with pytest.raises(ValueError, match="twice"):
        Piece("l", (4,), "c", (4,), View(0, (4,), (0,)), View(0, (4,), (1,)))


# --- one layout covering every constructor -------------------------------------------------

HID, HEADS, KV, HEAD_DIM, FF, EXPERTS = 8, 8, 4, 2, 16, 4
QKV = [("q", (HEADS * HEAD_DIM, HID)), ("k", (KV * HEAD_DIM, HID)), ("v", (KV * HEAD_DIM, HID))]
SHAPES = {
    "q": (HEADS * HEAD_DIM, HID),
    "k": (KV * HEAD_DIM, HID),
    "v": (KV * HEAD_DIM, HID),
    "mq": (HEADS * HEAD_DIM, HID),
    "mk": (KV * HEAD_DIM, HID),
    "mv": (KV * HEAD_DIM, HID),
    "mq.bias": (HEADS * HEAD_DIM,),
    "mk.bias": (KV * HEAD_DIM,),
    "mv.bias": (KV * HEAD_DIM,),
    "gate": (FF, HID),
    "up": (FF, HID),
    "o": (HID, HEADS * HEAD_DIM),
    "down": (HID, FF),
    "tied_t": (FF, HID),
    "tcol": (HID, FF),
    "norm": (HID,),
    "cast": (HID,),
    **{f"e{i}": (FF, HID) for i in range(EXPERTS)},
}


def layout_for(rank: int, tp: int, replica: int = 0, replicas: int = 1) -> Layout:
    return Layout(
        [
            *fused("qkv", QKV, dim=0, rank=rank, size=tp),
            *interleaved_qkv(
                "mqkv",
                "mq",
                "mk",
                "mv",
                num_heads=HEADS,
                num_kv_heads=KV,
                head_dim=HEAD_DIM,
                inner=(HID,),
                rank=rank,
                size=tp,
            ),
            *interleaved_qkv(
                "mqkv.bias",
                "mq.bias",
                "mk.bias",
                "mv.bias",
                num_heads=HEADS,
                num_kv_heads=KV,
                head_dim=HEAD_DIM,
                rank=rank,
                size=tp,
            ),
            *fused("gate_up", [("gate", (FF, HID)), ("up", (FF, HID))], rank=rank, size=tp),
            *shard("o", SHAPES["o"], dim=1, rank=rank, size=tp),  # row-parallel
            *shard("down", SHAPES["down"], dim=-1, rank=rank, size=tp),
            *transposed("tied_t", SHAPES["tied_t"], dim=0, rank=rank, size=tp),
            *transposed("tcol", SHAPES["tcol"], local="tcol_t", replica=rank, replicas=tp),
            *whole("norm", SHAPES["norm"], replica=rank, replicas=tp),
            *converted(
                "cast",
                SHAPES["cast"],
                inputs=("cast_master",),
                fn=lambda t: t.bfloat16(),
                replica=rank,
                replicas=tp,
            ),
            *experts(
                "experts",
                [f"e{i}" for i in range(EXPERTS)],
                (FF, HID),
                rank=rank,
                size=tp,
                transpose=True,
            ),
        ],
        replica=replica,
        replicas=replicas,
    )


def canonical_state(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {n: torch.randn(s, generator=gen).bfloat16() for n, s in SHAPES.items()}
    master = torch.randn(SHAPES["cast"], generator=gen)
    state["cast"] = master.bfloat16()
    return state, master


def advance(state, master, k: int):  # type: ignore[no-untyped-def]
    """A sparse step; every few steps one tensor does not change at all."""
    new = {}
    for i, (name, tensor) in enumerate(state.items()):
        t = tensor.clone()
        if (i + k) % 5:
            t.view(-1)[(k + i) % 3 :: 7] += 0.0625 * (k + 1)
        new[name] = t
    master = master.clone()
    master[k % HID] += 1.0
    new["cast"] = master.bfloat16()
    return new, master


def locals_for(layout: Layout, state, master) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    placed = layout.scatter(state)
    out = {n: t for n, t in placed.items() if not n.startswith("converted:")}
    out["cast_master"] = master
    return out


def decoded(store: str, version: int) -> dict[str, list[tuple[str, list[int], list[int]]]]:
    """Each tensor's change as readers decode it (pieces merged): op, positions, values."""
    chain = Chain(open_store(store))
    manifests = chain.manifests(chain.record(version))
    reader = DeltaReader(store, StateDictTarget({}))
    with ThreadPoolExecutor(2) as pool:
        changes, _ = reader._decode_version(manifests, pool)
    out: dict[str, list] = {}
    for entry, delta in changes:
        positions = [] if delta.positions is None else delta.positions.tolist()
        out.setdefault(entry.name, []).append((entry.op, positions, delta.values.tolist()))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_publish_equals_the_gathered_canonical_publish(tmp_path, tp):
    sharded, gathered = str(tmp_path / "sharded"), str(tmp_path / "gathered")
    coordinator = ThreadCoordinator(tp) if tp > 1 else None
    layouts = [layout_for(r, tp) for r in range(tp)]
    writers = [
        ProjectionWriter(
            sharded, layouts[r], rank=r, world_size=tp, coordinator=coordinator, features=()
        )
        for r in range(tp)
    ]
    # the projection writer never switches a delta to full by size, nor codes against the
    # old bits: compare like with like (the plain codings, plain manifests)
    reference = DeltaWriter(gathered, ops=dict.fromkeys(SHAPES, "xor"), features=())
    state, master = canonical_state(0)
    versions = 5
    for k in range(versions):
        if k:
            state, master = advance(state, master, k)
        in_threads(
            lambda r, s=state, m=master: writers[r].publish(locals_for(layouts[r], s, m)), tp
        )
        reference.publish(state)
    chain_a, chain_b = Chain(open_store(sharded)), Chain(open_store(gathered))
    for version in range(versions):
        a, b = chain_a.record(version).record, chain_b.record(version).record
        assert a.state_fingerprint == b.state_fingerprint
        assert a.stats.tensors == b.stats.tensors == len(SHAPES)
        assert a.stats.changed_elements == b.stats.changed_elements
        assert a.required_features == (("pieces",) if tp > 1 else ())
        assert decoded(sharded, version) == decoded(gathered, version)
    target = StateDictTarget({})
    DeltaReader(sharded, target, verify="all").sync()
    assert_same_bits(target.tensors, state)
    # ranks each hold their part, and the pieces of one tensor come from several ranks
    if tp > 1:
        manifests = chain_a.manifests(chain_a.record(versions - 1))
        ranks_of_q = {m.rank for m in manifests for e in m.entries if e.name == "q"}
        assert ranks_of_q == set(range(tp))


def test_data_parallel_replicas_publish_each_element_once(tmp_path):
    tp, dp = 2, 2
    store = str(tmp_path / "store")
    coordinator = ThreadCoordinator(tp * dp)
    layouts = [layout_for(r % tp, tp, replica=r // tp, replicas=dp) for r in range(tp * dp)]
    writers = [
        ProjectionWriter(store, layouts[r], rank=r, world_size=tp * dp, coordinator=coordinator)
        for r in range(tp * dp)
    ]
    state, master = canonical_state(1)
    for k in range(3):
        if k:
            state, master = advance(state, master, k)
        in_threads(
            lambda r, s=state, m=master: writers[r].publish(locals_for(layouts[r], s, m)), tp * dp
        )
    chain = Chain(open_store(store))
    manifests = chain.manifests(chain.record(2))
    listed = [(e.name, e.piece.index if e.piece else 0) for m in manifests for e in m.entries]
    assert len(listed) == len(set(listed))  # no region twice
    assert all(m.entries for m in manifests)  # the replicas share the work
    target = StateDictTarget({})
    DeltaReader(store, target).sync()
    assert_same_bits(target.tensors, state)


def test_a_reopened_projection_writer_continues_the_chain(tmp_path):
    tp = 2
    store = str(tmp_path / "store")
    layouts = [layout_for(r, tp) for r in range(tp)]
    state, master = canonical_state(2)

    def publish_all(s, m):  # type: ignore[no-untyped-def]
        coordinator = ThreadCoordinator(tp)
        writers = [
            ProjectionWriter(store, layouts[r], rank=r, world_size=tp, coordinator=coordinator)
            for r in range(tp)
        ]
        in_threads(lambda r: writers[r].publish(locals_for(layouts[r], s, m)), tp)
        return writers

    publish_all(state, master)
    for k in (1, 2):
        state, master = advance(state, master, k)
        writers = publish_all(state, master)  # fresh writers: baselines from the store
    assert writers[0].version == 2
    chain = Chain(open_store(store))
    assert {e.op for m in chain.manifests(chain.record(2)) for e in m.entries} == {"xor"}
    target = StateDictTarget({})
    DeltaReader(store, target, verify="all").sync()
    assert_same_bits(target.tensors, state)


# --- the pieces feature in the format -------------------------------------------------------


@pytest.fixture
def pieces_store(tmp_path) -> str:
    tp = 2
    store = str(tmp_path / "store")
    coordinator = ThreadCoordinator(tp)
    layouts = [layout_for(r, tp) for r in range(tp)]
    writers = [
        ProjectionWriter(store, layouts[r], rank=r, world_size=tp, coordinator=coordinator)
        for r in range(tp)
    ]
    state, master = canonical_state(3)
    in_threads(lambda r: writers[r].publish(locals_for(layouts[r], state, master)), tp)
    state, master = advance(state, master, 1)
    in_threads(lambda r: writers[r].publish(locals_for(layouts[r], state, master)), tp)
    return store


def test_a_reader_without_the_feature_refuses_cleanly(pieces_store, monkeypatch):
    monkeypatch.setattr(schema, "KNOWN_FEATURES", frozenset())
    target = StateDictTarget({})
    with pytest.raises(UnsupportedFeatureError, match="pieces"):
        DeltaReader(pieces_store, target).sync()
    assert target.tensors == {}


def test_piece_entries_carry_consistent_lanes(pieces_store):
    chain = Chain(open_store(pieces_store))
    record = chain.record(1)
    manifests = chain.manifests(record)
    pieces = [e for m in manifests for e in m.entries if e.piece is not None]
    # pieces listed, beside the manifest features the writer uses by default
    lean = {"manifest-zstd", "implicit-parents"}
    assert pieces and all(
        "pieces" in m.required_features and set(m.required_features) <= {"pieces", *lean}
        for m in manifests
        if m.entries
    )
    q = sorted((e for e in pieces if e.name == "q"), key=lambda e: e.piece.index)
    assert [e.piece.index for e in q] == [0, 1] and {e.piece.count for e in q} == {2}
    assert all(e.piece.lanes_before is not None for e in q)  # a delta


def test_missing_or_inconsistent_pieces_are_refused(pieces_store):
    from dcr_format.chain.chain import tensor_changes

    chain = Chain(open_store(pieces_store))
    manifests = chain.manifests(chain.record(1))
    with pytest.raises(SchemaError, match="lacks pieces"):
        tensor_changes(manifests[:1])
    doubled = [manifests[0], manifests[0]]
    with pytest.raises(SchemaError, match=r"listed twice|more than one rank"):
        tensor_changes(doubled)


def test_a_layout_missing_a_piece_is_not_committed(tmp_path):
    tp = 2
    store = str(tmp_path / "store")
    coordinator = ThreadCoordinator(tp)
    full = layout_for(1, tp)
    without_o = [p for p in full.pieces if p.canonical != "o"]
    layouts = [layout_for(0, tp), Layout([*without_o, *full.conversions.values()])]
    writers = [
        ProjectionWriter(
            store, layouts[r], rank=r, world_size=tp, coordinator=coordinator, commit_timeout=20
        )
        for r in range(tp)
    ]
    state, master = canonical_state(4)
    with pytest.raises((SchemaError, IncompleteVersionError)):
        in_threads(
            lambda r: writers[r].publish(
                {
                    n: t
                    for n, t in locals_for(layout_for(r, tp), state, master).items()
                    if n in layouts[r].inputs()
                }
            ),
            tp,
        )
    assert Chain(open_store(store)).versions() == []


def test_pieces_that_do_not_add_up_are_not_committed(tmp_path):
    tp = 2
    store = str(tmp_path / "store")
    coordinator = ThreadCoordinator(tp)
    layouts = [layout_for(r, tp) for r in range(tp)]
    writers = [
        ProjectionWriter(
            store, layouts[r], rank=r, world_size=tp, coordinator=coordinator, commit_timeout=20
        )
        for r in range(tp)
    ]
    state, master = canonical_state(5)
    in_threads(lambda r: writers[r].publish(locals_for(layouts[r], state, master)), tp)
    writers[1]._part._region_lanes[("q", 1)] = (1, 2)  # a rank whose baseline drifted
    state, master = advance(state, master, 1)
    with pytest.raises((ChainBrokenError, IncompleteVersionError)):
        in_threads(lambda r: writers[r].publish(locals_for(layouts[r], state, master)), tp)
    assert Chain(open_store(store)).versions() == [0]


def test_layout_refuses_unknown_and_missing_local_tensors(tmp_path):
    layout = Layout(whole("a", (2, 2)))
    writer = ProjectionWriter(str(tmp_path / "s"), layout)
    with pytest.raises(ValueError, match="not in the layout"):
        writer.publish({"a": torch.zeros(2, 2), "b": torch.zeros(1)})
    from dcr_format.errors import MissingTensorError

    with pytest.raises(MissingTensorError):
        writer.publish({})
    half = Piece("a", (1, 2), "a", (2, 2), View(0, (1, 2), (2, 1)), View(0, (1, 2), (2, 1)))
    with pytest.raises(ValueError, match="covers 2 of the 4"):
        ProjectionWriter(str(tmp_path / "t"), Layout([half])).publish({"a": torch.zeros(1, 2)})


def test_a_delta_writer_given_a_layout_publishes_local_tensors(tmp_path):
    """The projection is a part the writer is given: DeltaWriter(layout=...) is what
    ProjectionWriter builds; it keeps no baseline cache."""
    from dcr_format.errors import ArgumentError

    store = str(tmp_path / "store")
    layout = layout_for(0, 1)
    state, master = canonical_state(3)
    writer = DeltaWriter(store, layout=layout)
    assert writer.layout is layout and writer.owns("q") and not writer.owns("nothing")
    for k in range(2):
        if k:
            state, master = advance(state, master, k)
        writer.publish(locals_for(layout, state, master))
    assert writer.version == 1 and "qkv" in writer.baseline and "q" not in writer.baseline
    reopened = ProjectionWriter(store, layout)
    assert type(reopened) is DeltaWriter and reopened.version == 1
    state, master = advance(state, master, 2)
    assert reopened.publish(locals_for(layout, state, master)).kind == "delta"
    target = StateDictTarget({})
    DeltaReader(store, target, verify="all").sync()
    assert_same_bits(target.tensors, state)
    with pytest.raises(ArgumentError, match="keeps no baseline cache"):
        DeltaWriter(store, layout=layout, cache_dir=tmp_path / "cache")


# --- benchmark smoke test ----------------------------------------------------------------------


def test_layout_bench_quick_runs():
    spec = importlib.util.spec_from_file_location("layout_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--quick", "--json"]) == 0
    result = json.loads(out.getvalue())
    assert result["projection"]["changed"] > 0
    assert result["apply"]["bit_equal"] is True
    for key in ("projection_seconds", "materialised_seconds"):
        assert result["projection"][key] > 0
    for key in ("module_target_apply_seconds", "dense_load_weights_seconds"):
        assert result["apply"][key] > 0
