"""Worker processes for tests/test_multiprocess.py (run as ``python mp_workers.py ROLE ...``).

Each worker joins a gloo process group through a file in the test's directory,
reaches the S3 store through the standard AWS environment, and writes what it
saw as JSON to its result file.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from dcr_format import (
    DcrError,
    DeltaReader,
    DeltaWriter,
    StateDictTarget,
    TorchDistributedCoordinator,
)
from dcr_format.format.dtypes import bits_view


def model(version: int) -> dict[str, torch.Tensor]:
    """The canonical tensors every test process agrees on for ``version``."""
    gen = torch.Generator().manual_seed(1234)
    tensors = {f"layer.{i}.weight": torch.randn(48, 40, generator=gen).bfloat16() for i in range(8)}
    for v in range(1, version + 1):
        for i, tensor in enumerate(tensors.values()):
            flat = tensor.view(-1)
            flat[(v * 37 + i * 11) % 1900 : (v * 37 + i * 11) % 1900 + 7] += 0.25
    return tensors


def _digest(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {n: bits_view(t).reshape(-1).tolist()[:8] for n, t in sorted(tensors.items())}


def writer(rank: int, world: int, work: Path, store: str, versions: int, die_at: int) -> dict:
    """Publish ``versions`` versions; the last rank dies before its manifest of ``die_at``."""
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=rank, world_size=world)
    w = DeltaWriter(
        store,
        rank=rank,
        world_size=world,
        coordinator=TorchDistributedCoordinator(),
        commit_timeout=4.0,
    )
    start = 0 if w.version is None else w.version + 1
    out: dict = {"rank": rank, "committed": [], "errors": []}
    for version in range(start, start + versions):
        if version == die_at and rank == world - 1:
            import dcr_format.publish._part as part_module

            def die(*args, **kwargs):
                os._exit(17)  # as a SIGKILL: no cleanup, no ABORTED marker

            part_module.Manifest = die  # dies right after its shards, before its manifest
        try:
            info = w.publish(model(version), step=version)
            out["committed"].append(info.version)
        except DcrError as exc:
            out["errors"].append(type(exc).__name__)
            break
    out["version"] = w.version
    return out


def _sync(
    r: DeltaReader,
    target: StateDictTarget,
    tensors: dict[str, torch.Tensor],
    goal: int,
    mine: Callable[[str], bool],
) -> dict:
    """One audited group sync to ``goal``: what it applied or the error it raised, and
    whether this rank's share is then exactly that of ``goal`` or untouched."""
    before = _digest(tensors)
    out: dict = {"error": None}
    try:  # an edit may sit where no delta lands: only an audit reads it (FORMAT.md §11.3)
        result = r.sync(to=goal, audit=True)
        out["applied"] = list(result.applied_versions)
    except DcrError as exc:
        out["error"] = type(exc).__name__
    expected = {n: t for n, t in model(goal).items() if mine(n)}
    out["exact"] = tensors.keys() == expected.keys() and all(
        torch.equal(bits_view(tensors[n]), bits_view(expected[n])) for n in expected
    )
    out["unchanged"] = _digest(tensors) == before
    out["resident"] = target.resident().version
    return out


def reader(rank: int, world: int, work: Path, store: str, goal: int, poison: int) -> dict:
    """Hold this rank's share of the tensors and sync the group to ``goal`` twice: first with
    rank ``poison`` holding an edited share (it refuses, and so the whole group), then with
    the edit undone (every rank applies)."""
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=rank, world_size=world)
    mine = lambda name: int(name.split(".")[1]) % world == rank  # noqa: E731
    tensors: dict[str, torch.Tensor] = {}
    target = StateDictTarget(tensors)
    r = DeltaReader(store, target, select=mine, group=dist.group.WORLD)
    r.sync(to=1)
    edited = next(iter(tensors.values()))
    saved = edited.clone()
    if rank == poison:
        edited.view(-1)[0] += 1.0
    out = {"rank": rank, "poisoned": _sync(r, target, tensors, goal, mine)}
    edited.copy_(saved)  # the bits of version 1 again
    out["intact"] = _sync(r, target, tensors, goal, mine)
    dist.barrier()
    return out


if __name__ == "__main__":
    role, rank, world, work, store = sys.argv[1:6]
    args = [int(rank), int(world), Path(work), store]
    if role == "writer":
        result = writer(*args, versions=int(sys.argv[6]), die_at=int(sys.argv[7]))
    else:
        result = reader(*args, goal=int(sys.argv[6]), poison=int(sys.argv[7]))
    Path(work, f"{role}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
