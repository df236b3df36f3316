"""Worker processes for tests/test_relay.py (run as ``python relay_workers.py RANK WORLD WORK STORE
LEADER POISON``), and the helpers the in-process relay tests share with them.

Each worker joins a gloo process group through a file in the test's directory,
reads the S3 store through the standard AWS environment with a request-counting
wrapper under its :class:`RelayStore`, and writes what it saw as JSON.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch

from dcr_format import DcrError, DeltaReader, StateDictTarget, Store
from dcr_format.format.dtypes import bits_view
from dcr_format.store.relay import RelayStore


class CountingStore(Store):
    """A store that records the key of every GET it sends (thread-safe)."""

    def __init__(self, url: str, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self.gets: list[str] = []
        self.got_bytes = 0
        self._count_lock = threading.Lock()

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        data = super().get(key, max_size=max_size)
        with self._count_lock:
            self.gets.append(key)
            self.got_bytes += len(data)
        return data


def model(version: int, layers: int = 6) -> dict[str, torch.Tensor]:
    """Tiny canonical tensors every process agrees on for ``version``."""
    gen = torch.Generator().manual_seed(99)
    tensors = {
        f"model.layers.{i}.weight": torch.randn(24, 20, generator=gen).bfloat16()
        for i in range(layers)
    }
    for v in range(1, version + 1):
        for i, tensor in enumerate(tensors.values()):
            start = (v * 29 + i * 13) % 400
            tensor.view(-1)[start : start + 5] += 0.5
    return tensors


def exact(tensors: dict[str, torch.Tensor], version: int) -> bool:
    want = model(version)
    return tensors.keys() == want.keys() and all(
        torch.equal(bits_view(tensors[n]), bits_view(want[n])) for n in want
    )


def reader(rank: int, world: int, work: Path, root: str, leader: int, poison: int) -> dict:
    """Sync a fresh target through the relay, then (if ``poison`` >= 0) fail on one member."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=rank, world_size=world)
    counting = CountingStore(root)
    relay = RelayStore(counting, dist.group.WORLD, leader=leader, chunk_bytes=512)
    tensors: dict[str, torch.Tensor] = {}
    target = StateDictTarget(tensors)
    r = DeltaReader(relay, target, group=dist.group.WORLD)
    out: dict = {"rank": rank, "leader": relay.is_leader, "children": list(relay.children)}
    first = 1 if poison >= 0 else None
    result = r.sync(to=first)
    out["first"] = {
        "version": result.version,
        "exact": exact(tensors, result.version),
        "gets": list(counting.gets),
        "fallbacks": relay.stats.fallbacks,
        "payload_bytes": relay.stats.payload_bytes,
    }
    try:  # a missing object: the same error, with the same text, on every member
        relay.get("objects/no-such-object")
    except DcrError as exc:
        out["missing"] = [type(exc).__name__, str(exc)]
    relay.end_epoch()
    if poison >= 0:
        name = "model.layers.1.weight"
        saved = tensors[name].clone()
        if rank == poison:
            tensors[name].view(-1)[0] += 1.0
        before = {n: t.clone() for n, t in tensors.items()}
        try:  # an edit at a position no delta touches: only an audit reads it (FORMAT.md §11.3)
            r.sync(audit=True)
            out["poisoned"] = None
        except DcrError as exc:
            out["poisoned"] = type(exc).__name__
        out["unchanged"] = all(
            torch.equal(bits_view(before[n]), bits_view(t)) for n, t in tensors.items()
        )
        out["resident_after_failure"] = target.resident().version
        tensors[name].copy_(saved)
        result = r.sync()
        out["second"] = {"version": result.version, "exact": exact(tensors, result.version)}
    out["fallbacks"] = relay.stats.fallbacks
    dist.barrier()
    return out


if __name__ == "__main__":
    rank, world, work, root, leader, poison = sys.argv[1:7]
    result = reader(int(rank), int(world), Path(work), root, int(leader), int(poison))
    Path(work, f"reader-{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    dist.destroy_process_group()
