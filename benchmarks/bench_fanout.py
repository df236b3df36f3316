"""Relay fan-out against independent readers, with real processes (``bench_workers.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def launch(
    role: str, world: int, args: list[str], *, env: dict[str, str] | None = None, timeout: float
) -> dict[str, Any]:
    """Run ``world`` worker processes of ``role`` in one gloo group; the result they report."""
    with tempfile.TemporaryDirectory(prefix=f"dcr-bench-{role}-") as work:
        command = [sys.executable, str(Path(__file__).with_name("bench_workers.py")), role]
        procs = [
            subprocess.Popen(
                [*command, str(rank), str(world), work, *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for rank in range(world)
        ]
        failures = []
        for rank, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                raise RuntimeError(
                    f"{role} worker {rank} did not finish in {timeout:.0f} s"
                ) from None
            if proc.returncode:
                failures.append(f"rank {rank}: exit {proc.returncode}: {err.decode()[-400:]}")
        if failures:
            raise RuntimeError(f"{role} workers failed: " + "; ".join(failures))
        result: dict[str, Any] = json.loads((Path(work) / f"{role}.json").read_text())
        return result


def relay_hop(
    *, nbytes: int = 64 << 20, chunk_bytes: int = 4 << 20, rounds: int = 50
) -> dict[str, Any]:
    """One relay hop between two processes through gloo on 127.0.0.1."""
    return launch("hop", 2, [str(nbytes), str(chunk_bytes), str(rounds)], timeout=300)


def relay_fanout(
    root: str, env: dict[str, str], *, members: int, chunk_bytes: int = 4 << 20
) -> dict[str, Any]:
    """``members`` processes read versions 0 and 1 of ``root`` alone and through a relay tree.

    ``env`` reaches the store (the AWS variables of an S3 server). The store must hold
    a base as version 0 and a delta as version 1.
    """
    return launch(
        "fanout", members, [root, str(chunk_bytes)], env={**os.environ, **env}, timeout=900
    )
