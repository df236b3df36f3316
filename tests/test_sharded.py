"""Publishing from sharded trainers: a tiny Llama trained with AdamW on gloo ranks (FSDP2 with
a vocabulary that does not divide, FSDP2 over tensor parallelism on a 2 x 2 mesh, HSDP),
each rank publishing its own DTensor shards; a reader holding the full model is bit-exact
to the gathered model after every step, and nothing inside publish gathers.

The worker processes (tests/sharded_workers.py) run every check of one mesh in one job;
the 2-rank and 4-rank jobs run side by side.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, ThreadCoordinator
from dcr_format.chain.chain import Chain
from dcr_format.chain.layout import Layout
from dcr_format.chain.placement import placed, sharded
from dcr_format.errors import UnsupportedPlacementError
from dcr_format.store.store import open_store

WORKER = Path(__file__).with_name("sharded_workers.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(role: str, world: int, work: Path) -> list[subprocess.Popen[bytes]]:
    port = _port()
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), role, str(rank), str(world), str(port), str(work)],
            stderr=subprocess.DEVNULL,
        )
        for rank in range(world)
    ]


def _results(role: str, procs: list[subprocess.Popen[bytes]], work: Path) -> list[Any]:
    codes = [p.wait(timeout=400) for p in procs]
    out: list[Any] = []
    for rank, code in enumerate(codes):
        path = work / f"{role}-{rank}.json"
        out.append(json.loads(path.read_text()) if path.exists() else {"exit": code})
    errors = [f"rank {r}: {result['error']}" for r, result in enumerate(out) if "error" in result]
    assert not errors, "\n".join(errors)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("sharded")
    started: list[subprocess.Popen[bytes]] = []
    try:
        mesh = _start("mesh", 4, work)
        started += mesh
        fsdp = _start("fsdp", 2, work)
        started += fsdp
        fsdp_results = _results("fsdp", fsdp, work)
        restart = _start("restart", 2, work)
        started += restart
        yield {
            "work": work,
            "fsdp": fsdp_results,
            "restart": _results("restart", restart, work),
            "mesh": _results("mesh", mesh, work),
        }
    finally:
        for proc in started:  # after a failure: no worker outlives the tests
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _no_gather(result: dict[str, Any]) -> None:
    """Inside publish only the commit protocol's object broadcasts crossed ranks."""
    for seen in result["collectives"]:
        assert set(seen["calls"]) <= {"broadcast"}, seen
        assert seen["bytes"] < 1024, seen
        assert set(seen["functional"]) <= {"c10d.broadcast_.default"}, seen


@pytest.mark.multiprocess
def test_fsdp2_with_an_uneven_vocabulary_publishes_exactly(runs: dict[str, Any]) -> None:
    rank0, rank1 = runs["fsdp"]
    assert rank0["wrong"] == [[], [], []]  # the reader equals the gathered model every step
    for result in (rank0, rank1):
        _no_gather(result)
        # the baseline is the rank's shard (both ranks hold a region of every tensor; the
        # plain tensor is owned by one of them)
        assert result["baseline_bytes"] <= 1.1 * result["shard_bytes"]
    assert "partial sum" in rank0["partial"] and "partial sum" in rank1["partial"]
    assert "began with plain tensors" in rank0["mixed"] and "began with" in rank1["mixed"]
    assert "sharded over 2 ranks but the writer has world_size 1" in rank0["solo"]
    assert rank1["cached"] == (
        "ArgumentError: a writer publishing DTensor shards keeps no baseline cache (a "
        "restarted rank rebuilds its shards from the store); leave cache_dir unset"
    )
    assert rank0["cached"].startswith("IncompleteVersionError: a writer rank abandoned")
    # the deltas of Shard(0) shards went through the fused diff, rank 1's at canonical
    # offsets past its tensors' first rows
    assert rank0["fused"] > 0 and rank1["fused"] > 0 and rank1["fused_offset"] > 0


@pytest.mark.multiprocess
def test_a_rank_killed_mid_publish_leaves_no_commit_and_restarted_ranks_publish_exactly(
    runs: dict[str, Any],
) -> None:
    rank0, rank1 = runs["fsdp"]
    assert rank0["killed"] == "incomplete" and "killed" not in rank1  # rank 1 died in it
    restarted = runs["restart"]
    assert [r["reopened_at"] for r in restarted] == [2, 2]  # version 3 never committed
    assert restarted[0]["wrong"] == [[], []]
    assert [r["sync_version"] for r in restarted] == [4, 4]  # through DcrWeightSync
    for result in restarted:
        _no_gather(result)
    chain = Chain(open_store(runs["work"] / "fsdp"))
    assert chain.versions() == [0, 1, 2, 3, 4]
    # the restarted ranks replayed their baselines: their first version is a delta of changes
    ops = {e.op for m in chain.manifests(chain.record(3)) for e in m.entries}
    assert ops == {"xor"}


@pytest.mark.multiprocess
def test_fsdp2_over_tensor_parallelism_and_hsdp_publish_exactly(runs: dict[str, Any]) -> None:
    ranks = runs["mesh"]
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in ranks[0]["tp_placements"]
    # the last step came as a stream: no earlier tensor of it was held when the next was asked
    assert [r["tp"]["held"] for r in ranks] == [0, 0, 0, 0]
    for kind in ("tp", "hsdp"):
        assert ranks[0][kind]["wrong"] == [[], [], []]
        for result in ranks:
            _no_gather(result[kind])
    # HSDP: the two replicas of each shard split its tensors between them (balanced)
    for result in ranks:
        assert result["tp"]["baseline_bytes"] <= 1.1 * result["tp_shard_bytes"]
        assert result["hsdp"]["baseline_bytes"] < 0.75 * result["hsdp_shard_bytes"]
    replicas = [r["hsdp"]["baseline_bytes"] for r in ranks]
    assert sum(replicas) == pytest.approx(sum(r["hsdp_shard_bytes"] for r in ranks) / 2, rel=0.1)
    # a fresh reader of the whole chain is exact too
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(runs["work"] / "tp", StateDictTarget(tensors)).sync()
    assert "model.layers.0.self_attn.q_proj.weight" in tensors


def _torch_indices(size: int, placements: list[Any], mesh_shape: Any, coordinate: Any) -> list[int]:
    """Torch's own offsets of a dimension's local shard (Shard and _StridedShard)."""
    from torch.distributed.tensor.placement_types import (
        Shard,
        _StridedShard,
        _StridedShardOffsetMode,
    )

    index = list(range(size))
    for mesh_dim, placement in enumerate(placements):
        if placement is None:
            continue
        dim, split_factor = placement
        chunks, at = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if split_factor == 1:
            n, offset = Shard(dim)._local_shard_size_and_offset(len(index), chunks, at)
            kept = list(range(offset, offset + n))
        else:
            n, offsets = _StridedShard(dim, split_factor=split_factor).local_shard_size_and_offset(
                len(index), chunks, at, _StridedShardOffsetMode.ALL
            )
            kept = list(offsets) if n else []
        index = [index[k] for k in kept]
    return index


@pytest.mark.parametrize(
    ("mesh_shape", "placements"),
    [
        ((2,), [(0, 1)]),
        ((4,), [(0, 1)]),  # 7 rows over 4 ranks: 2, 2, 2, 1
        ((2, 2), [(0, 2), (0, 1)]),  # FSDP2 over a column-parallel shard
        ((2, 2), [(0, 1), (1, 1)]),  # FSDP2 over a row-parallel shard
        ((2, 2), [None, (0, 1)]),  # HSDP
        ((3, 2), [(1, 2), (1, 1)]),  # strided and uneven: 5 columns
        ((2, 3), [(0, 3), (0, 1)]),  # a rank with an empty shard
    ],
)
def test_shards_place_elements_as_torch_does(mesh_shape: Any, placements: Any) -> None:
    """Each rank's pieces hold the elements torch puts in its local shard, and the owned
    regions of all ranks place every element exactly once."""
    shape = (7, 5)
    full = torch.arange(35, dtype=torch.int32).reshape(shape)
    owned = torch.zeros(35, dtype=torch.int64)
    grid = torch.cartesian_prod(*[torch.arange(n) for n in mesh_shape]).reshape(-1, len(mesh_shape))
    for coordinate in (tuple(c) for c in grid.tolist()):
        pieces = sharded(
            "w", shape, mesh_shape=mesh_shape, coordinate=coordinate, placements=placements
        )
        rows, cols = (
            _torch_indices(
                shape[d],
                [p if p is None or p[0] == d else None for p in placements],
                mesh_shape,
                coordinate,
            )
            for d in (0, 1)
        )
        expected = full[rows][:, cols]
        layout = Layout(pieces)
        assert torch.equal(layout.scatter({"w": full})["w"], expected)
        for piece in pieces:
            if layout.owns(piece):
                owned[piece.region()[1]] += 1
    assert torch.equal(owned, torch.ones(35, dtype=torch.int64))


def test_placed_refuses_what_is_not_a_dtensor() -> None:
    with pytest.raises(TypeError):
        placed("w", torch.zeros(2))
    assert issubclass(UnsupportedPlacementError, ValueError)


def test_layouts_from_placements_publish_exactly_with_an_empty_shard(tmp_path: Path) -> None:
    """Ranks of a (2, 3) mesh holding a (7, 5) tensor strided over both dimensions (one rank's
    shard is empty) and a replicated one publish, as layouts, what a reader rebuilds exactly."""
    from concurrent.futures import ThreadPoolExecutor

    mesh_shape = (2, 3)
    specs = {"w": ((7, 5), [(0, 3), (0, 1)]), "b": ((5,), [None, None])}
    grid = [(i, j) for i in range(2) for j in range(3)]
    layouts = [
        Layout(
            [
                piece
                for name, (shape, placements) in specs.items()
                for piece in sharded(
                    name, shape, mesh_shape=mesh_shape, coordinate=c, placements=placements
                )
            ]
        )
        for c in grid
    ]
    writers = _thread_writers(tmp_path, layouts)
    generator = torch.Generator().manual_seed(0)
    full = {
        "w": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "b": torch.randn(5, generator=generator).to(torch.bfloat16),
    }
    target = StateDictTarget({})
    reader = DeltaReader(tmp_path, target)
    for step in range(3):
        if step:
            full = {
                k: (v.float() + (torch.rand(v.shape, generator=generator) < 0.3)).to(v.dtype)
                for k, v in full.items()
            }
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda r, f=full: writers[r].publish(layouts[r].scatter(f)), range(6)))
        reader.sync()
        for name, tensor in full.items():
            assert torch.equal(target.tensors[name].view(torch.int16), tensor.view(torch.int16))


def _thread_writers(path: Path, layouts: list[Layout]) -> list[DeltaWriter]:
    """A writer per layout, its rank its index, all joined by one ThreadCoordinator."""
    coordinator = ThreadCoordinator(len(layouts))
    return [
        DeltaWriter(path, layout=layout, rank=r, world_size=len(layouts), coordinator=coordinator)
        for r, layout in enumerate(layouts)
    ]


def _mesh_layouts(specs: dict[str, Any], mesh_shape: tuple[int, ...]) -> list[Layout]:
    grid = torch.cartesian_prod(*[torch.arange(n) for n in mesh_shape]).reshape(-1, len(mesh_shape))
    return [
        Layout(
            [
                piece
                for name, (shape, placements) in specs.items()
                for piece in sharded(
                    name, shape, mesh_shape=mesh_shape, coordinate=tuple(c), placements=placements
                )
            ]
        )
        for c in grid.tolist()
    ]


Step = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _two_ranks(
    rows: int, seed: int, rate: float
) -> tuple[dict[str, Any], list[Layout], dict[str, torch.Tensor], Step]:
    """A bf16 ``w`` of ``rows`` x 4 split by rows over two ranks and a replicated ``b``:
    their specs, the ranks' layouts, first values, and a step that changes about ``rate``
    of the elements."""
    specs = {"w": ((rows, 4), [(0, 1)]), "b": ((6,), [None])}
    generator = torch.Generator().manual_seed(seed)
    full = {
        "w": torch.randn(rows, 4, generator=generator).to(torch.bfloat16),
        "b": torch.randn(6, generator=generator).to(torch.bfloat16),
    }

    def step(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            k: (v.float() + (torch.rand(v.shape, generator=generator) < rate)).to(v.dtype)
            for k, v in state.items()
        }

    return specs, _mesh_layouts(specs, (2,)), full, step


def test_a_restarted_rank_restores_its_regions_from_its_own_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reopened writer rebuilds its local shards from the entries of its own regions: it
    reads no other rank's shard and builds no canonical tensor, then publishes exactly. A
    writer of another layout falls back to the canonical tensors."""
    from concurrent.futures import ThreadPoolExecutor

    from dcr_format.store.store import Store

    specs, layouts, full, step = _two_ranks(9, seed=3, rate=0.3)

    def publish_all(writers: list[DeltaWriter], state: dict[str, torch.Tensor]) -> None:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: writers[r].publish(layouts[r].scatter(state)), range(2)))

    writers = _thread_writers(tmp_path, layouts)
    for _ in range(3):
        publish_all(writers, full)
        full = step(full)
    expected = [dict(w.baseline) for w in writers]

    read: list[str] = []
    original = Store.get

    def counted(self: Store, key: str, **kwargs: Any) -> bytes:
        read.append(key)
        return original(self, key, **kwargs)

    monkeypatch.setattr(Store, "get", counted)
    reopened = _thread_writers(tmp_path, layouts)
    for rank, writer in enumerate(reopened):
        read.clear()
        baseline = writer.baseline  # restores now
        other = f"shard-{1 - rank:05d}-"
        assert [k for k in read if other in k] == []
        # rank 0, the committer, reads the newest version's table in full; rank 1 reads
        # no manifest of rank 0
        newest = f"objects/{2:020d}/"
        others = [k for k in read if f"manifest-{1 - rank:05d}" in k]
        assert all(newest in k for k in others) if rank == 0 else others == []
        assert any(f"shard-{rank:05d}-" in k for k in read)
        assert set(baseline) == set(expected[rank])
        for name, tensor in expected[rank].items():
            assert torch.equal(baseline[name].view(torch.int16), tensor.view(torch.int16))
    monkeypatch.undo()
    publish_all(reopened, full)
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(tmp_path, StateDictTarget(tensors)).sync()
    for name, tensor in full.items():
        assert torch.equal(tensors[name].view(torch.int16), tensor.view(torch.int16))

    # one writer holding everything (another layout) reads the canonical tensors instead
    whole_layout = _mesh_layouts(specs, (1,))[0]
    single = DeltaWriter(tmp_path, layout=whole_layout)
    full = step(full)
    single.publish(whole_layout.scatter(full))
    DeltaReader(tmp_path, StateDictTarget(tensors)).sync()
    for name, tensor in full.items():
        assert torch.equal(tensors[name].view(torch.int16), tensor.view(torch.int16))


def test_rank_zero_decides_whether_a_version_is_a_base(tmp_path: Path) -> None:
    """``publish(base=True)`` on rank 0 makes the version a base on every rank (the others
    need not say so): both ranks write their regions in full and the version commits as a
    base, bit-exact at a reader; ``base=True`` on rank 1 alone changes nothing."""
    from concurrent.futures import ThreadPoolExecutor

    specs = {"w": ((6, 4), [(0, 1)]), "b": ((5,), [None])}
    layouts = _mesh_layouts(specs, (2,))
    writers = _thread_writers(tmp_path, layouts)
    generator = torch.Generator().manual_seed(5)
    full = {
        "w": torch.randn(6, 4, generator=generator).to(torch.bfloat16),
        "b": torch.randn(5, generator=generator).to(torch.bfloat16),
    }
    reader = DeltaReader(tmp_path, StateDictTarget({}))
    kinds = []
    for asked in ((False, False), (False, False), (True, False), (False, True)):
        full = {k: (v.float() + 1).to(v.dtype) for k, v in full.items()}
        with ThreadPoolExecutor(2) as pool:
            infos = list(
                pool.map(
                    lambda r, f=full, a=asked: writers[r].publish(layouts[r].scatter(f), base=a[r]),
                    range(2),
                )
            )
        kinds.append({info.kind for info in infos})
        reader.sync()
        for name, tensor in full.items():
            assert torch.equal(reader.target.tensors[name], tensor)  # type: ignore[attr-defined]
    assert kinds == [{"base"}, {"delta"}, {"base"}, {"delta"}]  # version 0 is a base anyway


def test_a_region_sent_whole_again_replays_past_a_history_it_could_not(tmp_path: Path) -> None:
    """A rank's region that its own history cannot replay (here: versions a single writer
    published whole, between versions of pieces) replays again from the version that
    sent it in full, so a restart after that publishes changes, as the other ranks do."""
    from concurrent.futures import ThreadPoolExecutor

    from dcr_format.publish._sharded import _replay_own
    from dcr_format.store.store import Store

    _, layouts, full, step = _two_ranks(66, seed=7, rate=0.1)

    def publish_all(state: dict[str, torch.Tensor], ops: dict[str, str] | None = None) -> None:
        coordinator = ThreadCoordinator(2)
        writers = [
            DeltaWriter(
                tmp_path, layout=layout, rank=r, world_size=2, coordinator=coordinator, ops=ops
            )
            for r, layout in enumerate(layouts)
        ]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: writers[r].publish(layouts[r].scatter(state)), range(2)))

    publish_all(full)  # version 0: pieces
    single = DeltaWriter(tmp_path)
    for _ in range(2):  # versions 1 and 2: whole tensors, from one writer
        full = step(full)
        single.publish(full)
    full = step(full)
    publish_all(full, ops={"w": "full"})  # version 3, a delta: w's pieces in full
    full = step(full)
    publish_all(full)  # version 4: changes

    chain = Chain(open_store(tmp_path))
    w = [  # (op, piece) of w's entries in each version
        {
            (e.op, e.piece is not None)
            for m in chain.manifests(chain.record(v))
            for e in m.entries
            if e.name == "w"
        }
        for v in range(5)
    ]
    assert w[1] == w[2] == {("xor", False)}  # whole, changes across both regions
    assert w[3] == {("full", True)} and w[4] == {("xor", True)}
    assert chain.record(3).record.kind == "delta"
    latest = chain.record(4)
    read: list[str] = []
    original = Store.get

    def counted(self: Store, key: str, **kwargs: Any) -> bytes:
        read.append(key)
        return original(self, key, **kwargs)

    for rank in range(2):
        read.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Store, "get", counted)
            regions = _replay_own(chain, latest, rank)
        manifests = {k.rsplit("/", 1)[1] for k in read if "/manifest-" in k}
        assert manifests == {f"manifest-{rank:05d}.json"}  # its own, of each version
        owned = {
            (m.rank, e.name, e.piece.index if e.piece else 0)
            for m in chain.manifests(latest)
            for e in m.entries
        }
        assert {(rank, *key) for key in regions} == {k for k in owned if k[0] == rank}
        for (name, _), region in regions.items():
            flat = full[name].view(torch.int16).reshape(-1)
            assert torch.equal(region.bits, flat[region.positions])


def test_ranks_that_send_one_tensor_partly_in_full_write_a_base_next(
    tmp_path: Path,
) -> None:
    """A delta whose ranks sent parts of one tensor some in full and some as changes is not
    committed; the error says so, and the next publish is a base, which commits."""
    from concurrent.futures import ThreadPoolExecutor

    from dcr_format.errors import CommitError, IncompleteVersionError

    specs = {"w": ((6, 4), [(0, 1)]), "b": ((5,), [None])}
    layouts = _mesh_layouts(specs, (2,))
    coordinator = ThreadCoordinator(2)
    writers = [  # rank 1 sends its part of w in full every time
        DeltaWriter(
            tmp_path,
            layout=layout,
            rank=r,
            world_size=2,
            coordinator=coordinator,
            ops={"w": "full"} if r == 1 else None,
        )
        for r, layout in enumerate(layouts)
    ]
    full = {"w": torch.ones(6, 4, dtype=torch.bfloat16), "b": torch.ones(5, dtype=torch.bfloat16)}

    def publish_all() -> list[Any]:
        def one(rank: int) -> Any:
            try:
                return writers[rank].publish(layouts[rank].scatter(full))
            except Exception as error:  # each rank's outcome is checked
                return error

        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(one, range(2)))

    assert [info.version for info in publish_all()] == [0, 0]
    full = {k: (v.float() + 1).to(v.dtype) for k, v in full.items()}
    committer, other = publish_all()
    assert isinstance(committer, CommitError) and isinstance(other, IncompleteVersionError)
    assert str(committer) == (
        "writer ranks [1] sent their part of 'w' (and 0 more tensors) in full, the other "
        "ranks as changes: those ranks could not rebuild their part of version 0; the next "
        "publish writes a base, which brings every rank back in step"
    )
    assert Chain(open_store(tmp_path)).versions() == [0]
    assert [info.kind for info in publish_all()] == ["base", "base"]  # rank 0 chose it
    writers[1].ops.clear()  # rank 1 sends changes again: the versions after are deltas
    full = {k: (v.float() + 1).to(v.dtype) for k, v in full.items()}
    assert [info.kind for info in publish_all()] == ["delta", "delta"]
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(tmp_path, StateDictTarget(tensors)).sync()
    for name, tensor in full.items():
        assert torch.equal(tensors[name], tensor)


def test_restarted_ranks_publish_after_gc_removed_the_versions_before_their_base(
    tmp_path: Path,
) -> None:
    """After ``compact`` and ``gc`` the chain starts at an alternative base whose parents are
    gone: a restarted rank cannot rebuild its regions from its own entries, so a layout's
    rank cuts them from the canonical tensors and a rank of DTensor shards sends them
    whole once; the next publishes are deltas again, bit-exact at a reader."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    from dcr_format.publish._sharded import _replay_own
    from dcr_format.tools import compact, gc

    _, layouts, full, step = _two_ranks(12, seed=9, rate=0.2)

    def publish_all(writers: list[DeltaWriter]) -> None:
        nonlocal full
        full = step(full)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: writers[r].publish(layouts[r].scatter(full)), range(2)))

    writers = _thread_writers(tmp_path, layouts)
    for _ in range(4):
        publish_all(writers)
    compact(str(tmp_path), 2)
    gc(str(tmp_path), keep_last=2, grace=timedelta(0), commit_timeout=timedelta(0))
    chain = Chain(open_store(tmp_path))
    assert chain.versions() == [2, 3]
    assert _replay_own(chain, chain.record(3), 0) == {}  # versions 0 and 1 are gone

    reopened = _thread_writers(tmp_path, layouts)
    for _ in range(2):
        publish_all(reopened)
    assert {e.op for m in chain.manifests(chain.record(5)) for e in m.entries} <= {"xor"}
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(tmp_path, StateDictTarget(tensors)).sync()
    for name, tensor in full.items():
        assert torch.equal(tensors[name].view(torch.int16), tensor.view(torch.int16))
