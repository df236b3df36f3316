"""Subprocess side of test_sync_memory.py: the peak memory a sync adds, as JSON.

``python tests/sync_memory_workers.py publish <store> <mib> <versions> <shard-kib> [<base-at>
[<per-mille>]]``: a chain of ``versions`` versions of a model of ``mib`` MiB (8 bf16 tensors)
in shards of at most ``shard-kib`` KiB, each version changing ``per-mille`` (default 1) of
every 1000 elements; ``base-at``: also an alternative base at that version.
``python tests/sync_memory_workers.py sync <store> <from> [<to>]``: sync a dict target to
``from`` (or start empty: ``-``), warm up, then measure a sync to ``to`` (default: the
newest). Prints ``{"peak": <bytes>, "model": <bytes>, "plan": [...], ...}``: ``peak`` is
the resident memory the measured sync added (see ``memory_workers.measure``).
"""

from __future__ import annotations

import json
import sys

import torch
from memory_workers import measure


def _model(mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    numel = (mib << 20) // 2 // 8
    return {
        f"model.layers.{i}.weight": torch.randn(numel, generator=gen).bfloat16() for i in range(8)
    }


def publish(
    store: str, mib: int, versions: int, shard_kib: int, base_at: int | None, per_mille: int
) -> None:
    from dcr_format import DeltaWriter
    from dcr_format.tools import compact

    state = _model(mib)
    gen = torch.Generator().manual_seed(1)
    writer = DeltaWriter(store, reader_records=False, shard_bytes=shard_kib << 10)
    for version in range(versions):
        if version:
            for tensor in state.values():
                index = torch.randint(
                    0, tensor.numel(), (tensor.numel() * per_mille // 1000,), generator=gen
                )
                tensor[index] = tensor[index] * 1.01 + 0.5
        writer.publish(state)
    if base_at is not None:
        compact(store, base_at, shard_bytes=shard_kib << 10)


def sync(store: str, start: str, goal: int | None) -> dict:
    from dcr_format import DeltaReader, StateDictTarget

    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(store, StateDictTarget(tensors))
    reader.sync(0)  # compiles what a sync runs (the measure is of memory, not of numba)
    if start == "-":
        tensors.clear()
        reader = DeltaReader(store, StateDictTarget(tensors))
    elif int(start) > 0:
        reader.sync(int(start))
    found: dict = {}

    def run() -> None:
        found["result"] = reader.sync(goal)

    report = measure(run)
    report["model"] = sum(t.numel() * t.element_size() for t in tensors.values())
    result = found.get("result")
    report["plan"] = [] if result is None else list(result.applied_versions)
    return report


def main(argv: list[str]) -> None:
    if argv[0] == "publish":
        base_at = int(argv[5]) if len(argv) > 5 else None
        per_mille = int(argv[6]) if len(argv) > 6 else 1
        publish(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), base_at, per_mille)
        return
    if argv[0] == "sync":
        print(json.dumps(sync(argv[1], argv[2], int(argv[3]) if len(argv) > 3 else None)))
        return
    raise SystemExit(f"unknown worker command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
