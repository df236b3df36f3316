"""Peak memory of a publish and of a sync, beyond the caller's own tensors.

A writer and a reader each run in a process of their own, one after the other, on one
local store: the writer publishes a base and two deltas of a Llama-shaped bf16 model at
the given change rate, the reader syncs a fresh dict target to the base, the first delta
and the second. For each step the process's peak resident memory is reset
(``/proc/self/clear_refs``) right before the call, and what the call added is its peak
(``VmHWM``) less what was resident before it: the memory dcr itself needs, with native
allocations (zstd, numba, torch) counted. "Held after" is what the process keeps resident
after the call beyond what it held before its first call (its own tensors): the baseline,
pools, caches, compiled kernels, and freed memory the allocator keeps for the next step.
The first delta warms up (kernels compile, pools start), so the second is the steady step.

    .venv/bin/python benchmarks/memory_bench.py [--mb 256] [--rate 0.01] [--features LIST]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from refit_bench import SyntheticTrainer, lr_for, model_shapes

MiB = 1 << 20


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}: this benchmark needs Linux")


def added_peak(call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()``'s result and the bytes its peak resident memory rose above what was
    resident before it (the peak is reset first, so earlier calls do not count)."""
    gc.collect()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak to the current size
    result = call()
    return result, max(0, _status_bytes("VmHWM") - before)


def resident() -> int:
    """The process's resident memory now, in bytes."""
    return _status_bytes("VmRSS")


def writer_role(store: str, mb: float, rate: float, features: Sequence[str]) -> dict[str, Any]:
    """Publish a base and two deltas; each step's added peak."""
    from dcr_format import DeltaWriter

    trainer = SyntheticTrainer(model_shapes(mb))
    writer = DeltaWriter(store, features=features)
    versions = []
    for step in range(3):  # every version's weights first: nothing but dcr runs between calls
        if step:
            trainer.step(lr_for(rate))
        versions.append(trainer.export())
    del trainer
    gc.collect()
    start = resident()
    rows = []
    for step, weights in enumerate(versions):
        info, peak = added_peak(functools.partial(writer.publish, weights, step=step))
        rows.append(
            {
                "step": ("base", "delta (warm-up)", "delta")[step],
                "dense_bytes": info.dense_bytes,
                "changed_elements": info.changed_elements,
                "payload_bytes": info.payload_bytes,
                "added_peak_bytes": peak,
                "held_after_bytes": resident() - start,
            }
        )
    return {"role": "writer", "rows": rows}


def reader_role(store: str, mb: float) -> dict[str, Any]:
    """Sync a fresh dict target to versions 0, 1 and 2; each sync's added peak."""
    from dcr_format import DeltaReader, StateDictTarget

    target = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in model_shapes(mb).items()}
    reader = DeltaReader(store, StateDictTarget(target))
    gc.collect()
    start = resident()
    rows = []
    for version in range(3):
        result, peak = added_peak(functools.partial(reader.sync, to=version))
        rows.append(
            {
                "step": ("base", "delta (warm-up)", "delta")[version],
                "payload_bytes": result.payload_bytes,
                "added_peak_bytes": peak,
                "held_after_bytes": resident() - start,
            }
        )
    return {"role": "reader", "rows": rows}


def _child(role: str, store: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--store", store]
    command += ["--mb", str(args.mb), "--rate", str(args.rate), "--features", args.features]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def format_table(writer: dict[str, Any], reader: dict[str, Any]) -> str:
    """One row per step and role: payload, changed elements, added peak."""
    lines = [
        f"{'role':<7} {'step':<16} {'payload':>10} {'changed':>12} {'added peak':>11} "
        f"{'per changed element':>20} {'held after':>11}"
    ]
    for side in (writer, reader):
        for row, w in zip(side["rows"], writer["rows"], strict=True):
            changed = w["changed_elements"]
            per = f"{row['added_peak_bytes'] / changed:.1f} B" if w["step"] != "base" else "-"
            lines.append(
                f"{side['role']:<7} {row['step']:<16} {row['payload_bytes'] / MiB:>6.1f} MiB "
                f"{changed:>12,} {row['added_peak_bytes'] / MiB:>7.1f} MiB {per:>20} "
                f"{row['held_after_bytes'] / MiB:>7.1f} MiB"
            )
    dense = writer["rows"][0]["dense_bytes"]
    lines.append(f"model: {dense / MiB:.0f} MiB of bf16 (the caller's tensors, not counted)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=256.0, help="model size in MB of bf16")
    parser.add_argument("--rate", type=float, default=0.01, help="change rate of each delta")
    parser.add_argument(
        "--features", default="", help="the writer's features, comma-separated (FORMAT.md §12)"
    )
    parser.add_argument("--json", type=Path, help="also write both roles' rows here")
    parser.add_argument("--role", choices=("writer", "reader"), help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    features = [f for f in args.features.split(",") if f and f != "none"]
    if args.role == "writer":
        print(json.dumps(writer_role(args.store, args.mb, args.rate, features)))
        return 0
    if args.role == "reader":
        print(json.dumps(reader_role(args.store, args.mb)))
        return 0
    with tempfile.TemporaryDirectory(prefix="dcr-memory-") as work:
        store = str(Path(work) / "store")
        writer = _child("writer", store, args)
        reader = _child("reader", store, args)
    print(format_table(writer, reader))
    if args.json:
        args.json.write_text(json.dumps({"writer": writer, "reader": reader}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
