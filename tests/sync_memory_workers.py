"""Subprocess side of test_sync_memory.py: the peak memory a sync adds, as JSON.

``python tests/sync_memory_workers.py publish <store> <mib> <versions> <shard-kib> [<base-at>
[<per-mille>]]``: a chain of ``versions`` versions of a model of ``mib`` MiB (8 bf16 tensors)
in shards of at most ``shard-kib`` KiB, each version changing ``per-mille`` (default 1) of
every 1000 elements; ``base-at``: also an alternative base at that version (``-``: none).
``python tests/sync_memory_workers.py sync <store> <from> [<to> [<how>]]``: sync a target to
``from`` (or start empty: ``-``), warm up, then measure a sync to ``to`` (default, or ``-``:
the newest). ``how``: ``sync`` (default: ``DeltaReader.sync`` into a dict target),
``prepare`` (:meth:`DeltaReader.prepare` then :meth:`DeltaReader.apply`), ``group`` (a
reader in a group of one gloo rank) or ``module`` (a sync into a ``ModuleTarget``). Prints
``{"peak": <bytes>, "model": <bytes>, "plan": [...], ...}``: ``peak`` is the resident memory
the measured sync added (see ``memory_workers.measure``).
"""

from __future__ import annotations

import json
import sys
import tempfile

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


class _Layer(torch.nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.zeros(numel, dtype=torch.bfloat16), requires_grad=False
        )


class _Stack(torch.nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(numel) for _ in range(8))


class _Model(torch.nn.Module):
    """A module whose parameters are the canonical names of :func:`_model`."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.model = _Stack(numel)


def _reader(store: str, how: str, tensors: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    from dcr_format import DeltaReader, ModuleTarget, StateDictTarget

    if how == "module":
        numel = next(iter(tensors.values())).numel()
        module = _Model(numel)
        tensors.clear()
        tensors.update(module.state_dict())  # its parameters, for the model's size
        return DeltaReader(store, ModuleTarget(module))
    if how == "group":
        import torch.distributed as dist

        if not dist.is_initialized():
            rendezvous = tempfile.mktemp(prefix="dcr-group-")
            dist.init_process_group(
                "gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1
            )
        return DeltaReader(store, StateDictTarget(tensors), group=dist.group.WORLD)
    return DeltaReader(store, StateDictTarget(tensors))


def sync(store: str, start: str, goal: int | None, how: str = "sync") -> dict:
    from dcr_format import DeltaReader, StateDictTarget

    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(store, StateDictTarget(tensors))
    reader.sync(0)  # compiles what a sync runs (the measure is of memory, not of numba)
    if start == "-" or how in ("module", "group"):
        if start == "-" and how != "module":
            tensors.clear()
        reader = _reader(store, how, tensors)
        if start != "-":
            reader.sync(0)
    if start != "-" and int(start) > 0:
        reader.sync(int(start))
    found: dict = {}

    def run() -> None:
        if how == "prepare":
            found["result"] = reader.apply(reader.prepare(goal))
        else:
            found["result"] = reader.sync(goal)

    report = measure(run)
    report["model"] = sum(t.numel() * t.element_size() for t in tensors.values())
    # the bits it reached are the goal's, as a fresh reader syncs them
    expected: dict[str, torch.Tensor] = {}
    DeltaReader(store, StateDictTarget(expected)).sync(goal)
    report["exact"] = expected.keys() == tensors.keys() and all(
        torch.equal(t.view(torch.int16), expected[n].view(torch.int16)) for n, t in tensors.items()
    )
    result = found.get("result")
    report["plan"] = [] if result is None else list(result.applied_versions)
    return report


def main(argv: list[str]) -> None:
    if argv[0] == "publish":
        base_at = int(argv[5]) if len(argv) > 5 and argv[5] != "-" else None
        per_mille = int(argv[6]) if len(argv) > 6 else 1
        publish(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), base_at, per_mille)
        return
    if argv[0] == "sync":
        goal = int(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
        print(json.dumps(sync(argv[1], argv[2], goal, *argv[4:5])))
        return
    raise SystemExit(f"unknown worker command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
