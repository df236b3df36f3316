"""Per-byte and per-object costs, measured on this machine, that ``dcr project`` is built from.

:func:`derive_costs` turns the suite's measurements into a
:class:`~dcr_format.cli.costs.Costs` record (``bench_suite.py --save-costs FILE``);
the micro-measurements here fill in what the refit rows do not give directly:
request latency and throughput of a store, the relay's cost per hop, sha256.
:func:`quick_costs` is the short measurement (about half a minute); run as a
script it writes a costs file for ``dcr project --costs FILE``. The file the package ships
(``dcr_format/cli/costs.json``) is ``steady_bench.py --save-costs`` of a 1 GB model on an
idle 2-vCPU machine, the longer measurement:

    .venv/bin/python benchmarks/bench_costs.py [--out FILE] [--mb 24]
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dcr_format.cli.costs import SHIPPED, Costs, RateCosts
from dcr_format.store.store import Store


def machine() -> dict[str, Any]:
    """What the measurements ran on (the load average says how shared it was)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": [round(x, 2) for x in load],
    }


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def store_costs(store: Store, *, small: int = 24, large_bytes: int = 32 << 20) -> dict[str, float]:
    """Latency of small GETs and throughput of one large PUT and GET on ``store``."""
    prefix = f"bench-{uuid.uuid4().hex[:12]}"
    keys = [f"{prefix}/small-{i:04d}" for i in range(small)]
    for key in keys:
        store.put(key, b"x" * 1024)
    latency = statistics.median(_timed(functools.partial(store.get, key)) for key in keys)
    blob = os.urandom(large_bytes)
    put_s = _timed(lambda: store.put(f"{prefix}/large", blob))
    get_s = _timed(lambda: store.get(f"{prefix}/large"))
    for key in [*keys, f"{prefix}/large"]:
        store.delete(key)
    return {
        "request_s": latency,
        "get_bytes_per_s": large_bytes / get_s,
        "put_bytes_per_s": large_bytes / put_s,
    }


def sha256_rate(nbytes: int = 64 << 20) -> float:
    """Bytes per second of hashlib's sha256."""
    data = os.urandom(nbytes)
    return nbytes / min(_timed(lambda: hashlib.sha256(data).digest()) for _ in range(2))


def relay_costs(*, nbytes: int = 64 << 20, chunk_bytes: int = 4 << 20) -> dict[str, float]:
    """One relay hop between two processes through gloo on 127.0.0.1 (large, then tiny)."""
    from bench_fanout import relay_hop

    return relay_hop(nbytes=nbytes, chunk_bytes=chunk_bytes)


def _rate_costs(
    rows: Sequence[dict[str, Any]], tails: dict[float, list[float]] | None = None
) -> list[RateCosts]:
    """One record per target rate of ``rows``; ``tails``: by target rate, the part of a sync
    after its last object per dense byte, of each step measured (median kept)."""
    by_rate: dict[float, list[dict[str, Any]]] = {}
    for row in rows:
        by_rate.setdefault(row["target_rate"], []).append(row)
    out = []
    for target, group in sorted(by_rate.items()):
        tail = (tails or {}).get(target)
        out.append(
            RateCosts(
                rate=statistics.mean(r["change_rate"] for r in group),
                bytes_per_changed=statistics.mean(
                    r["delta_bytes"] / max(r["changed"], 1) for r in group
                ),
                # medians of the steps, as the benchmark's tables: a step that also did a
                # one-off (memory touched for the first time) says nothing of the others
                publish_s_per_byte=statistics.median(
                    r["publish_s"] / r["dense_bytes"] for r in group
                ),
                sync_s_per_byte=statistics.median(r["sync_s"] / r["dense_bytes"] for r in group),
                sync_tail_s_per_byte=statistics.median(tail) if tail else None,
            )
        )
    return out


def derive_costs(
    local_rows: Sequence[dict[str, Any]],
    *,
    source: str,
    store: dict[str, float],
    request_store: str,
    relay: dict[str, float],
    sha256_bytes_per_s: float,
    shard_bytes: int,
    chunk_bytes: int,
    tails: dict[float, list[float]] | None = None,
) -> Costs:
    """Costs from refit rows over a local store and the micro-measurements (``tails``: the
    part of a sync after its last object, by target rate; see ``_rate_costs``).

    Only the largest model measured counts for the per-byte costs: fixed overheads
    (commit records, thread pools, process start) weigh least there.
    """
    from dcr_format.chain.chain import timestamp, utc_now

    largest = max(r["dense_bytes"] for r in local_rows)
    rows = [r for r in local_rows if r["dense_bytes"] == largest]
    return Costs(
        source=source,
        created=timestamp(utc_now()),
        machine=machine(),
        model_bytes=int(largest),
        rates=tuple(_rate_costs(rows, tails)),
        dense_serialise_s_per_byte=statistics.mean(
            r["dense_serialise_s"] / r["dense_bytes"] for r in rows
        ),
        dense_load_s_per_byte=statistics.mean(r["dense_load_s"] / r["dense_bytes"] for r in rows),
        request_s=store["request_s"],
        request_store=request_store,
        get_bytes_per_s=store["get_bytes_per_s"],
        put_bytes_per_s=store["put_bytes_per_s"],
        sha256_bytes_per_s=sha256_bytes_per_s,
        relay_hop_bytes_per_s=relay["relay_hop_bytes_per_s"],
        relay_round_s=relay["relay_round_s"],
        shard_bytes=shard_bytes,
        chunk_bytes=chunk_bytes,
    )


def quick_costs(
    *,
    mb: float = 24.0,
    hop_bytes: int = 32 << 20,
    rates: Sequence[float] = (0.005, 0.01, 0.03, 0.05),
    progress: Callable[[str], None] = lambda message: None,
) -> Costs:
    """The short measurement (about half a minute): a small model refit over a local store,
    the local store's requests, one relay hop."""
    import tempfile

    from refit_bench import model_shapes, refit_series

    from dcr_format.publish.writer import DEFAULT_SHARD_BYTES
    from dcr_format.store.relay import DEFAULT_CHUNK_BYTES

    with tempfile.TemporaryDirectory(prefix="dcr-costs-") as work:
        store = Store(Path(work) / "store")
        rows = refit_series(store, model_shapes(mb), rates, label="local", progress=progress)
        progress("store requests, sha256, relay hop")
        measured = store_costs(store, large_bytes=16 << 20)
    return derive_costs(
        rows,
        source=f"benchmarks/bench_costs.py: short measurement ({mb:g} MB model, local store)",
        store=measured,
        request_store="local",
        relay=relay_costs(nbytes=hop_bytes),
        sha256_bytes_per_s=sha256_rate(32 << 20),
        shard_bytes=DEFAULT_SHARD_BYTES,
        chunk_bytes=DEFAULT_CHUNK_BYTES,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the short costs and write them (default: the file the package ships)."""
    import argparse

    import dcr_format.cli.costs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(dcr_format.cli.costs.__file__).with_name(SHIPPED)
    parser.add_argument("--out", default=str(default), help="costs file to write")
    parser.add_argument("--mb", type=float, default=24.0, help="model size in MB of bf16")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)

    costs = quick_costs(mb=args.mb, progress=say)
    Path(args.out).write_text(costs.to_json() + "\n")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
