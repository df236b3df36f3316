"""The costs ``dcr project`` builds its projection from, and the file that holds them.

A :class:`Costs` record holds per-byte and per-object costs measured by the
benchmark suite of a source checkout (``python benchmarks/bench_suite.py
--save-costs FILE``, or ``python benchmarks/bench_costs.py`` for the short
measurement). The package ships one such file, ``costs.json`` next to this
module (:func:`shipped_costs`); ``dcr project --costs FILE`` takes another.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

SHIPPED = "costs.json"
"""The costs file shipped with the package, next to this module."""
WRITTEN_BY = "python benchmarks/bench_suite.py --save-costs FILE"
"""How a costs file is written (from a source checkout)."""

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
    sync_tail_s_per_byte: float | None = None
    """Reader: of ``sync_s_per_byte``, what comes after the version's last object arrived
    (its changes decoded and completed, the apply, which waits until every object is
    verified, the commit), per dense byte; the rest overlaps the download. None where not
    measured: a projection then overlaps nothing of a sync with its download."""


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
        """The record as a costs file holds it."""
        return self.model_dump_json(indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Costs:
        """Read a costs file; ``ValueError`` if it is not one."""
        data = json.loads(Path(path).read_text())
        if data.get("format") != COSTS_FORMAT:
            raise ValueError(f"{path} is not a {COSTS_FORMAT} file ({WRITTEN_BY})")
        return cls.model_validate(data)


def shipped_costs() -> Costs:
    """The costs shipped with the package (``costs.json`` next to this module), measured by
    the steady benchmark of a source checkout on a 1 GB model."""
    return Costs.load(Path(__file__).with_name(SHIPPED))
