"""Ranks of a reader group that prepare each on its own (``prepare(alone=True)``, what a
tensor-parallel engine's background threads do) and apply together: no collective call
while preparing, every rank must have prepared the same version from the same version,
else every rank refuses it with nothing changed."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_bits, snapshot

from dcr_format import DeltaReader, DeltaWriter, RelayStore, StateDictTarget, Store
from dcr_format.delta.fingerprint import LANE_PRIMES
from dcr_format.errors import ArgumentError, GroupAbortError, StalePreparedError, StoreError
from dcr_format.sync.group import ReaderGroup
from dcr_format.testing.processes import in_threads

WORLD = 2


def _chain(root: str, versions: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    state = {f"layer.{i}.weight": torch.randn(64, 48, generator=gen).bfloat16() for i in range(6)}
    writer = DeltaWriter(root)
    states = []
    for version in range(versions):
        if version:
            for tensor in state.values():
                hit = torch.rand(tensor.shape, generator=gen) < 0.03
                tensor[hit] = (tensor[hit].float() * 1.02 + 1e-3).bfloat16()
        writer.publish(state, step=version)
        states.append(snapshot(state))
    return states


def _mine(rank: int, names: list[str]) -> set[str]:
    return {n for i, n in enumerate(sorted(names)) if i % WORLD == rank}


def test_ranks_prepare_alone_at_their_own_time_then_apply_together(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    states = _chain(root, 4)
    links = dist.HashStore()
    both_prepared = threading.Barrier(WORLD)
    rank1_may_prepare = threading.Event()

    def rank(r: int) -> list[object]:
        group = dist.ProcessGroupGloo(links, r, WORLD, timedelta(seconds=30))
        mine = _mine(r, list(states[0]))
        held = {n: torch.zeros_like(t) for n, t in states[0].items() if n in mine}
        reader = DeltaReader(root, StateDictTarget(held), select=mine, group=group)
        assert reader.sync(1).version == 1  # together
        # rank 1 prepares only once rank 0 has finished: a collective call would hang
        if r == 0:
            prepared = reader.prepare(2, alone=True)
            rank1_may_prepare.set()
        else:
            assert rank1_may_prepare.wait(30)
            prepared = reader.prepare(2, alone=True)
        both_prepared.wait(30)
        applied = reader.apply(prepared)
        assert_same_bits(held, {n: states[2][n] for n in mine})
        # the ranks prepared different versions: every rank refuses, nothing changes
        other = reader.prepare(3 if r == 0 else 2, alone=True)
        with pytest.raises(StalePreparedError, match="prepared different versions"):
            reader.apply(other)
        assert_same_bits(held, {n: states[2][n] for n in mine})
        again = reader.apply(reader.prepare(3))  # together
        assert_same_bits(held, {n: states[3][n] for n in mine})
        return [applied.version, applied.previous, again.version]

    assert in_threads(rank, WORLD, timeout=120) == [[2, 1, 3]] * WORLD


@pytest.mark.parametrize(
    ("rank1_raises", "want"),
    [
        (None, (StalePreparedError, StalePreparedError)),
        (ValueError("rank 1's own"), (GroupAbortError, ValueError)),
    ],
)
def test_ranks_prepare_again_only_where_every_failure_was_a_moved_target(
    rank1_raises: Exception | None, want: tuple[type, type]
) -> None:
    """Rank 0 finds its target moved since it prepared: every rank raises
    StalePreparedError (and prepares again) only where no rank failed otherwise."""
    links = dist.HashStore()

    def rank(r: int) -> type:
        group = ReaderGroup(dist.ProcessGroupGloo(links, r, WORLD, timedelta(seconds=30)))
        try:
            with group.stage("checking its target"):
                if r == 0:
                    raise StalePreparedError("moved")
                if rank1_raises is not None:
                    raise rank1_raises
        except Exception as exc:
            return type(exc)
        return type(None)

    assert tuple(in_threads(rank, WORLD, timeout=60)) == want


def test_a_reader_over_a_relay_store_prepares_with_its_group(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    _chain(root, 1)
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
    reader = DeltaReader(RelayStore(Store(root), group), StateDictTarget({}), group=group)
    with pytest.raises(ArgumentError, match="relay store prepares with its group"):
        reader.prepare(alone=True)


# --- a tensor-parallel engine's workers: each prepares in the background ------------------

from test_module_shards import TP, Shards, bits_of, checkpoint, dense, step  # noqa: E402

from dcr_format.integrations.vllm import DcrInitInfo, DcrUpdateInfo, _Syncer  # noqa: E402
from dcr_format.store.host_cache import HostCache  # noqa: E402


def _prepared(syncer: _Syncer, version: int) -> bool:
    """Whether the worker's background thread holds ``version`` prepared (waits 30 s)."""
    for _ in range(600):
        with syncer._lock:
            held = syncer._prepared
        if held is not None and held.version == version:
            return True
        threading.Event().wait(0.05)
    return False


@pytest.mark.filterwarnings("ignore:You are using a Backend")  # a group in threads
def test_tensor_parallel_workers_prepare_in_the_background_and_apply_together(
    tmp_path: Path,
) -> None:
    """Every rank prepares the newest version on its own: an update where every rank holds
    it only applies (``prefetched`` on both); one whose target moved since (here, a sync
    outside the update) prepares again on every rank; one where a rank holds nothing
    prepares together. Each rank's shards equal its loader's placement every time."""
    root = str(tmp_path / "store")
    writer = DeltaWriter(root)
    states = [checkpoint()]
    for version in (1, 2, 3):
        states.append(step(states[-1], version))
    writer.publish(states[0])
    links = dist.HashStore()
    published = {v: threading.Barrier(TP) for v in (1, 2, 3)}

    def rank(r: int) -> list[tuple[int, bool]]:
        group = dist.ProcessGroupGloo(links, r, TP, timedelta(seconds=30))
        module = Shards(r)
        module.load_weights(states[0].items())  # the engine's checkpoint: version 0
        info = DcrInitInfo(
            store=root,
            version=0,
            poll_seconds=0.02,
            reader_id=f"tp-{r}",
            host_cache_dir=str(tmp_path / "host"),
        )
        syncer = _Syncer(module, info, model_dir=None, group=group)
        cache = syncer.reader.store.host_cache
        assert cache is not None
        caches.append(cache)
        seen = []
        try:
            for version in (1, 2, 3):
                if r == 0:
                    writer.publish(states[version])
                if version == 3 and r == 1:
                    syncer.close()  # rank 1 stops preparing: the update prepares together
                published[version].wait(30)
                if not (version == 3 and r == 1):
                    assert _prepared(syncer, version)
                if version == 2:  # the target moves after the preparation
                    with syncer._lock:
                        syncer.reader.sync(2)
                report = syncer.update(DcrUpdateInfo())
                want = dense(states[version], r)
                got = bits_of(module)
                assert got.keys() == want.keys()
                assert all(torch.equal(got[n], t) for n, t in want.items())
                seen.append((report.version, report.prefetched))
                assert (report.store_reads, report.host_cache_hits) == (cache.reads, cache.hits)
        finally:
            syncer.close()
        return seen

    caches: list[HostCache] = []
    assert in_threads(rank, TP, timeout=120) == [[(1, True), (2, False), (3, False)]] * TP
    # the two ranks share the host's cache: each object read from the store once
    read = sum(c.reads for c in caches)
    assert len(caches) == TP and read > 0
    assert sum(c.hits for c in caches) >= read


@pytest.mark.filterwarnings("ignore:You are using a Backend")  # a group in threads
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_rank_that_cannot_list_the_versions_fails_every_rank_at_once(
    tmp_path: Path, prefetch: bool
) -> None:
    """An update that names no version lists the committed versions on every rank; where
    one rank cannot (its store failed), it raises that error and every other rank
    :class:`GroupAbortError`, none left waiting in an exchange, nothing applied; the next
    update reaches the newest on every rank."""
    root = str(tmp_path / "store")
    writer = DeltaWriter(root)
    states = [checkpoint(), step(checkpoint(), 1)]
    writer.publish(states[0])
    links = dist.HashStore()
    ready, published = threading.Barrier(TP), threading.Barrier(TP)

    def rank(r: int) -> tuple[str, int]:
        group = dist.ProcessGroupGloo(links, r, TP, timedelta(seconds=10))
        module = Shards(r)
        module.load_weights(states[0].items())
        info = DcrInitInfo(
            store=root, version=0, prefetch=prefetch, poll_seconds=0.02, reader_id=f"tp-{r}"
        )
        syncer = _Syncer(module, info, model_dir=None, group=group)
        try:
            ready.wait(30)  # both readers' records are in: the writer codes for them
            if r == 0:
                writer.publish(states[1])
            published.wait(30)
            if prefetch:
                assert _prepared(syncer, 1)
            listing = syncer.reader.versions
            if r == 1:
                syncer.reader.versions = _unreachable  # type: ignore[method-assign]
            with pytest.raises((StoreError, GroupAbortError)) as failed:
                syncer.update(DcrUpdateInfo())
            assert _same(module, dense(states[0], r))  # nothing applied
            syncer.reader.versions = listing  # type: ignore[method-assign]
            report = syncer.update(DcrUpdateInfo())
            assert _same(module, dense(states[1], r))
            return type(failed.value).__name__ + ": " + str(failed.value), report.version
        finally:
            syncer.close()

    (zero, one) = in_threads(rank, TP, timeout=60)
    assert zero == (
        "GroupAbortError: reader rank(s) [1] failed while listing the versions; no rank "
        "applies this version: see their errors, then sync again",
        1,
    )
    assert one == ("StoreError: the store is unreachable", 1)


def _unreachable() -> list[int]:
    raise StoreError("the store is unreachable")


def _same(module: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    got = bits_of(module)
    return got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())


@pytest.mark.filterwarnings("ignore:You are using a Backend")  # a group in threads
def test_lanes_are_summed_over_the_ranks_whether_or_not_they_hold_the_same_names() -> None:
    """:func:`all_reduce_lanes` sums each name's lanes over the ranks: in one all-reduce of
    integers where every rank passes the same names (a tensor-parallel group), else by
    gathering them; either way every rank gets the same sums."""
    from dcr_format.targets.module import all_reduce_lanes

    links = dist.HashStore()
    cases = [
        # the same names on both ranks (lanes of 2 and 3), then names only one rank holds,
        # then the same names with another count of lanes on one rank, then none at all
        [{"a": (1, 2), "b": (3, 4, 5)}, {"a": (10, 20), "b": (30, 40, 50)}],
        [{"a": (1, 2)}, {"a": (10, 20), "c": (7, 8)}],
        [{"a": (1, 2)}, {"a": (10, 20, 30)}],
        [{}, {}],
    ]
    big = LANE_PRIMES[0] - 1  # the largest residue: sums past 2**31 stay exact
    cases.append([{"x": (big, big)}, {"x": (big, big)}])
    gathered: list[int] = []
    real = dist.all_gather_object

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        gathered.append(1)
        return real(*args, **kwargs)

    def rank(r: int) -> list[dict[str, tuple[int, ...]]]:
        group = dist.ProcessGroupGloo(links, r, TP, timedelta(seconds=10))
        reduce = all_reduce_lanes(group)
        return [reduce(case[r]) for case in cases]

    dist.all_gather_object = counted  # type: ignore[assignment]
    try:
        zero, one = in_threads(rank, TP, timeout=60)
    finally:
        dist.all_gather_object = real  # type: ignore[assignment]
    assert (
        zero
        == one
        == [
            {"a": (11, 22), "b": (33, 44, 55)},
            {"a": (11, 22), "c": (7, 8)},
            {"a": (11, 22, 30)},
            {},
            {"x": (2 * big, 2 * big)},
        ]
    )
    assert len(gathered) == 2 * TP  # only the two cases whose names differ gather
