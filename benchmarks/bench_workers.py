"""Processes of the benchmark suite (``python benchmarks/bench_workers.py ROLE RANK WORLD
WORK [ROOT]``): they join a gloo group through ``WORK/pg`` and write ``WORK/ROLE-RANK.json``.

- ``fanout``: every member syncs fresh targets from the store at ROOT (reached through the
  AWS environment) as an independent reader and through a relay tree, for the base version
  and then for the delta after it, and reports time and store bytes of each phase.
- ``hop``: two members measure one relay hop (a large object, then tiny ones).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dcr_format.store.relay import RelayStore
from dcr_format.store.store import Store
from dcr_format.sync.reader import DeltaReader
from dcr_format.targets.dict import StateDictTarget


class CountingStore(Store):
    """A store that counts the GET requests it sends and the bytes they return."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.requests = 0
        self.bytes = 0
        self._count_lock = threading.Lock()

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        data = super().get(key, max_size=max_size)
        with self._count_lock:
            self.requests += 1
            self.bytes += len(data)
        return data


def _phase(counting: CountingStore, fn: Callable[[], object]) -> dict[str, float]:
    """Run ``fn`` on every member at once: the slowest member's time, all members' GETs."""
    dist.barrier()
    requests, nbytes = counting.requests, counting.bytes
    started = time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    box = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    sums = torch.tensor([counting.requests - requests, counting.bytes - nbytes], dtype=torch.int64)
    dist.all_reduce(sums)
    return {"seconds": float(box.item()), "requests": int(sums[0]), "bytes": int(sums[1])}


def _bits(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16) for n, t in tensors.items()}


def fanout(rank: int, world: int, root: str, chunk_bytes: int) -> dict[str, Any]:
    counting = CountingStore(root)
    independent: dict[str, torch.Tensor] = {}
    relayed: dict[str, torch.Tensor] = {}
    alone = DeltaReader(counting, StateDictTarget(independent))
    relay = RelayStore(counting, dist.group.WORLD, chunk_bytes=chunk_bytes)
    together = DeltaReader(relay, StateDictTarget(relayed), group=dist.group.WORLD)
    phases = {
        "independent_base": _phase(counting, lambda: alone.sync(to=0)),
        "relay_base": _phase(counting, lambda: together.sync(to=0)),
        "independent_delta": _phase(counting, lambda: alone.sync(to=1)),
        "relay_delta": _phase(counting, lambda: together.sync(to=1)),
    }
    a, b = _bits(independent), _bits(relayed)
    same = a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    box = torch.tensor([0 if same else 1], dtype=torch.int64)
    dist.all_reduce(box)
    return {
        "members": world,
        "phases": phases,
        "bit_exact": int(box.item()) == 0,
        "relay_payload_bytes": relay.stats.payload_bytes,
        "relay_fallbacks": relay.stats.fallbacks,
    }


def hop(rank: int, world: int, nbytes: int, chunk_bytes: int, rounds: int) -> dict[str, Any]:
    inner = Store("memory://dcr-bench-hop")
    if rank == 0:
        inner.put("large", os.urandom(nbytes))
        inner.put("tiny", b"x")
    relay = RelayStore(inner, dist.group.WORLD, chunk_bytes=chunk_bytes, memo_bytes=0)
    timings = []
    for fn in (lambda: relay.get("large"), lambda: [relay.get("tiny") for _ in range(rounds)]):
        dist.barrier()
        started = time.perf_counter()
        fn()
        timings.append(time.perf_counter() - started)
        relay.end_epoch()
    return {"relay_hop_bytes_per_s": nbytes / timings[0], "relay_round_s": timings[1] / rounds}


def main(argv: list[str]) -> None:
    role, rank, world, work = argv[0], int(argv[1]), int(argv[2]), Path(argv[3])
    # many members share this machine's cores: spinning intra-op threads would starve them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=rank, world_size=world)
    if role == "fanout":
        result = fanout(rank, world, argv[4], int(argv[5]))
    else:
        result = hop(rank, world, int(argv[4]), int(argv[5]), int(argv[6]))
    dist.barrier()
    if rank == world - 1:  # a member: it had everything when its last read returned
        (work / f"{role}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
