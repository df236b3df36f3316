"""Per-byte and per-object costs, measured on this machine, that the projection is built from.

:func:`derive_costs` turns the suite's measurements into a :class:`Costs` record
(written by ``dcr bench --save-costs FILE``); the micro-measurements here fill in
what the refit rows do not give directly: request latency and throughput of a
store, the relay's cost per hop, sha256. :func:`quick_costs` is the short
measurement ``dcr project`` runs when it is given no file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from dcr_format.store.store import Store

COSTS_FORMAT = "dcr-bench-costs-1"


class RateCosts(BaseModel):
    """Costs at one change rate, per byte of the dense bf16 checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rate: float
    """The measured share of elements that changed."""
    bytes_per_changed: float
    """Stored delta bytes (shards) per changed element."""
    publish_s_per_byte: float
    """Writer: diff, encode, fingerprints and local writes, per dense byte (local store)."""
    sync_s_per_byte: float
    """Reader: fetch from local disk, sha256, decode, verify and apply, per dense byte."""


class Costs(BaseModel):
    """What the projection needs, every number measured by the suite (or a short run)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: str = COSTS_FORMAT
    source: str
    created: str
    machine: dict[str, Any]
    model_bytes: int
    """Dense bytes of the model the per-byte costs were measured on."""
    rates: tuple[RateCosts, ...]
    dense_serialise_s_per_byte: float
    dense_load_s_per_byte: float
    """Deserialise and copy into the resident tensors, per byte."""
    request_s: float
    """Latency of one small GET from the store below."""
    request_store: str
    get_bytes_per_s: float
    put_bytes_per_s: float
    sha256_bytes_per_s: float
    relay_hop_bytes_per_s: float
    """One relay hop (leader to one member through gloo on 127.0.0.1), large object."""
    relay_round_s: float
    """One relay round of a tiny object (header plus one chunk), per hop."""
    shard_bytes: int
    chunk_bytes: int

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Costs:
        data = json.loads(Path(path).read_text())
        if data.get("format") != COSTS_FORMAT:
            raise ValueError(f"{path} is not a {COSTS_FORMAT} file (dcr bench --save-costs)")
        return cls.model_validate(data)


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
    from dcr_format.bench.fanout import relay_hop

    return relay_hop(nbytes=nbytes, chunk_bytes=chunk_bytes)


def _rate_costs(rows: Sequence[dict[str, Any]]) -> list[RateCosts]:
    by_rate: dict[float, list[dict[str, Any]]] = {}
    for row in rows:
        by_rate.setdefault(row["target_rate"], []).append(row)
    out = []
    for _, group in sorted(by_rate.items()):
        out.append(
            RateCosts(
                rate=statistics.mean(r["change_rate"] for r in group),
                bytes_per_changed=statistics.mean(
                    r["delta_bytes"] / max(r["changed"], 1) for r in group
                ),
                publish_s_per_byte=statistics.mean(
                    r["publish_s"] / r["dense_bytes"] for r in group
                ),
                sync_s_per_byte=statistics.mean(r["sync_s"] / r["dense_bytes"] for r in group),
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
) -> Costs:
    """Costs from refit rows over a local store and the micro-measurements.

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
        rates=tuple(_rate_costs(rows)),
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
    """The short measurement ``dcr project`` runs without a costs file (about half a minute):
    a small model refit over a local store, the local store's requests, one relay hop."""
    import tempfile

    from dcr_format.bench.refit import model_shapes, refit_series
    from dcr_format.publish.writer import DEFAULT_SHARD_BYTES
    from dcr_format.store.relay import DEFAULT_CHUNK_BYTES

    with tempfile.TemporaryDirectory(prefix="dcr-costs-") as work:
        store = Store(Path(work) / "store")
        rows = refit_series(store, model_shapes(mb), rates, label="local", progress=progress)
        progress("store requests, sha256, relay hop")
        measured = store_costs(store, large_bytes=16 << 20)
    return derive_costs(
        rows,
        source=f"dcr project: short measurement ({mb:g} MB model, local store)",
        store=measured,
        request_store="local",
        relay=relay_costs(nbytes=hop_bytes),
        sha256_bytes_per_s=sha256_rate(32 << 20),
        shard_bytes=DEFAULT_SHARD_BYTES,
        chunk_bytes=DEFAULT_CHUNK_BYTES,
    )
