"""The relay tree (dcr_format/store/relay.py): members in threads over real gloo links, and
a reader group of 8 processes on the moto S3 server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, Store
from dcr_format.errors import (
    InvalidKeyError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreError,
)
from dcr_format.store.relay import RelayStore

sys.path.insert(0, str(Path(__file__).parent))
from relay_workers import CountingStore, exact, model

pytestmark = [pytest.mark.s3, pytest.mark.multiprocess]

WORKER = Path(__file__).with_name("relay_workers.py")


def _publish(root: str, versions: int, **kwargs) -> None:
    writer = DeltaWriter(Store(root, **kwargs))
    for version in range(versions):
        writer.publish(model(version), step=version)


def _links(world: int):
    """One gloo process group of ``world`` members, each member a thread of this process."""
    store = dist.HashStore()
    return lambda rank: dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))


def _solo_gets(root: str) -> list[str]:
    counting = CountingStore(root)
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(counting, StateDictTarget(tensors)).sync()
    return counting.gets


@pytest.mark.parametrize(("world", "leader", "fanout"), [(5, 0, 2), (4, 2, 1)])
def test_members_get_exact_bits_and_the_store_one_request_per_object(
    tmp_path, world, leader, fanout
):
    root = str(tmp_path / "store")
    _publish(root, 4)
    group = _links(world)
    counters = [CountingStore(root) for _ in range(world)]

    def member(rank: int):
        relay = RelayStore(
            counters[rank], group(rank), leader=leader, fanout=fanout, chunk_bytes=300
        )
        tensors: dict[str, torch.Tensor] = {}
        result = DeltaReader(relay, StateDictTarget(tensors)).sync()
        return relay, tensors, result

    results, errors = run_ranks(world, member)
    assert errors == [None] * world
    solo = _solo_gets(root)
    for rank, (relay, tensors, result) in enumerate(results):
        assert result.version == 3 and exact(tensors, 3)
        assert relay.stats.fallbacks == 0
        if rank == leader:
            # each object once: a repeated read within an epoch comes from memory
            assert sorted(counters[rank].gets) == sorted(set(solo))
            assert relay.stats.memo_hits == len(solo) - len(set(solo))
        else:
            assert counters[rank].gets == []
            assert relay.stats.payload_bytes == results[leader][0].stats.payload_bytes
    shard_bytes = max(os.path.getsize(p) for p in Path(root).rglob("*.dcrs"))
    assert shard_bytes > 300  # a shard crossed the tree in several chunks


def test_errors_and_answers_are_the_same_on_every_member(tmp_path):
    root = str(tmp_path / "store")
    _publish(root, 2)
    group = _links(3)

    def member(rank: int):
        relay = RelayStore(Store(root), group(rank), chunk_bytes=64)
        seen = []
        try:
            relay.get("objects/missing.json")
        except ObjectNotFoundError as exc:
            seen.append(str(exc))
        keys = relay.list("commits")
        seen += [keys, relay.exists(keys[0]), relay.exists("nope"), relay.size(keys[0])]
        relay.end_epoch()
        with pytest.raises(StoreError, match="read-only"):
            relay.put("x", b"1")
        return seen

    results, errors = run_ranks(3, member)
    assert errors == [None] * 3
    assert results[0] == results[1] == results[2]
    assert "objects/missing.json" in results[0][0]
    assert results[0][1] == Store(root).list("commits")


def test_a_relay_is_a_store_over_the_relay_backend(tmp_path):
    """Keys, limits and refusals are the Store's own; the inner store is wrapped, not copied."""
    inner = Store(str(tmp_path / "store"))
    inner.put("a/b", b"12345")
    group = _links(2)

    def member(rank: int):
        relay = RelayStore(inner, group(rank), chunk_bytes=64)
        assert isinstance(relay, Store) and relay.inner is inner and relay.url == inner.url
        assert (relay.kind, relay.local_root, relay.single_writer) == ("relay", None, False)
        with pytest.raises(InvalidKeyError):
            relay.get("../escape")
        with pytest.raises(ObjectTooLargeError, match="5 bytes, larger than the 4-byte limit"):
            relay.get("a/b", max_size=4)
        assert relay.get("a/b", max_size=5) == b"12345"  # the memo answers, the limit holds
        assert relay.list("a") == ["a/b"]
        relay.end_epoch()
        refused = []
        for write in (
            lambda: relay.put("x", b"1"),
            lambda: relay.put_if_absent("x", b"1"),
            lambda: relay.delete("a/b"),
            lambda: relay.delete_many(["a/b"]),
        ):
            with pytest.raises(StoreError, match="read-only") as info:
                write()
            refused.append(str(info.value))
        return refused, relay.stats.epochs

    results, errors = run_ranks(2, member)
    assert errors == [None] * 2
    assert all(epochs == 1 for _, epochs in results)
    assert all(len(refused) == 4 for refused, _ in results)
    assert inner.list() == ["a/b"] and not (tmp_path / "store" / "x").exists()


def test_members_that_read_different_objects_fall_back_to_the_store(tmp_path):
    # ranks 0 and 2 select half the tensors (a tensor-parallel share), rank 1 all of them and it
    # lists versions once more on its own: what the leader never read, rank 1 reads from the
    # store itself, and nobody waits on anybody
    root = str(tmp_path / "store")
    writer = DeltaWriter(Store(root), shard_bytes=1)  # one shard per tensor
    for version in range(3):
        writer.publish(model(version), step=version)
    group = _links(3)
    counters = [CountingStore(root) for _ in range(3)]
    even = lambda name: int(name.split(".")[2]) % 2 == 0  # noqa: E731

    def member(rank: int):
        relay = RelayStore(counters[rank], group(rank), chunk_bytes=128)
        tensors: dict[str, torch.Tensor] = {}
        reader = DeltaReader(relay, StateDictTarget(tensors), select=None if rank == 1 else even)
        if rank == 1:
            reader.versions()
        reader.sync()
        return relay, tensors

    results, errors = run_ranks(3, member)
    assert errors == [None] * 3
    want = model(2)
    relay, tensors = results[1]
    assert exact(tensors, 2)
    odd_shards = [k for k in counters[1].gets if k.endswith(".dcrs")]
    assert odd_shards and relay.stats.fallbacks == len(counters[1].gets) + 1  # + the listing
    for rank in (0, 2):
        relay, tensors = results[rank]
        assert sorted(tensors) == sorted(n for n in want if even(n))
        assert all(
            torch.equal(tensors[n].view(torch.int16), want[n].view(torch.int16)) for n in tensors
        )
    assert results[2][0].stats.fallbacks == 0 and not counters[2].gets


def test_large_payload_streams_through_a_deep_chain(tmp_path):
    store = Store(str(tmp_path / "store"))
    blob = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes()
    store.put("big.bin", blob)
    group = _links(4)

    def member(rank: int):
        relay = RelayStore(store, group(rank), fanout=1, chunk_bytes=64 << 10)
        data = relay.get("big.bin", max_size=len(blob))
        relay.end_epoch()
        return data == blob, relay.stats.rounds

    results, errors = run_ranks(4, member)
    assert errors == [None] * 4
    assert all(ok for ok, _ in results)


# --- real processes ---------------------------------------------------------------------------


def _run(world: int, work: Path, root: str, server, leader: int, poison: int) -> list[dict]:
    from test_multiprocess import _env

    work.mkdir(parents=True, exist_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *map(str, (rank, world, work, root, leader, poison))],
            env=_env(server),
        )
        for rank in range(world)
    ]
    codes = [p.wait(timeout=180) for p in procs]
    results = []
    for rank, code in enumerate(codes):
        path = work / f"reader-{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"exit": code})
    return results


def _check_first_sync(results: list[dict], root: str, server, leader: int, version: int) -> None:
    solo = CountingStore(root, storage_options=server.storage_options())
    DeltaReader(solo, StateDictTarget({})).sync(to=version)
    for r in results:
        assert r["first"]["exact"] and r["first"]["version"] == version
        assert r["first"]["fallbacks"] == 0 and r["fallbacks"] == 0
        assert r["missing"] == results[leader]["missing"]
        assert r["missing"][0] == "ObjectNotFoundError"
        if r["rank"] == leader:
            assert r["leader"] and sorted(r["first"]["gets"]) == sorted(set(solo.gets))
        else:
            assert not r["leader"] and r["first"]["gets"] == []


def test_eight_processes_read_each_object_once_and_refuse_together(
    moto_server, moto_root, tmp_path
):
    _publish(moto_root, 4, storage_options=moto_server.storage_options())
    # leader 2 forwards to ranks 3 and 4, they to 5, 6 and 7, 0, rank 5 to rank 1 (three levels
    # below the leader); rank 3, an inner node, is poisoned
    results = _run(8, tmp_path, moto_root, moto_server, leader=2, poison=3)
    assert [r.get("exit") for r in results] == [None] * 8, results
    _check_first_sync(results, moto_root, moto_server, leader=2, version=1)
    assert [r["children"] for r in results] == [
        [], [], [3, 4], [5, 6], [7, 0], [1], [], []
    ]  # fmt: skip
    for r in results:
        assert r["poisoned"] == ("BaselineMismatchError" if r["rank"] == 3 else "GroupAbortError")
        assert r["unchanged"] and r["resident_after_failure"] == 1
        assert r["second"] == {"version": 3, "exact": True}


def test_a_relay_refuses_listings_with_sizes_and_times(tmp_path):
    """Operator listings (gc, doctor) go to the store itself; a relay says so in one line."""
    script = f"""
import torch.distributed as dist
from dcr_format import RelayStore, Store
from dcr_format.errors import StoreError
dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
relay = RelayStore(Store("{tmp_path}/store"))
try:
    relay.list_info("objects/")
except StoreError as exc:
    print("refused:", exc)
dist.destroy_process_group()
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "refused: cannot list 'objects/' with sizes and times through a relay" in out.stdout
