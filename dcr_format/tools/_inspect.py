"""``dcr log`` and ``dcr show``: what the chain holds, from commit records and manifests."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from dcr_format.chain.bases import alternative_bases
from dcr_format.chain.chain import Chain, LoadedRecord
from dcr_format.publish._info import CommitInfo
from dcr_format.store.store import Store, open_store
from dcr_format.system.options import whole
from dcr_format.tools._common import Row

M = TypeVar("M", bound=BaseModel)


class LogRow(Row):
    """One committed version, as ``dcr log`` prints it."""

    version: int
    kind: str
    parent: int | None
    step: int | None
    created: str
    change_rate: float
    changed_elements: int
    total_elements: int
    payload_bytes: int
    dense_bytes: int
    ratio: float
    writer_ranks: int
    compacted: bool = False
    """Whether an alternative base of this version exists (``dcr compact``)."""


def row_from(model: type[M], source: object, **given: Any) -> M:
    """A ``model`` made from a summary that exists already (a commit's :class:`CommitInfo`,
    a manifest entry): each field ``source`` has too comes from it, the others from
    ``given`` (which wins where both have one)."""
    shared = {name: getattr(source, name) for name in model.model_fields if hasattr(source, name)}
    return model(**(shared | given))


def log_row(loaded: LoadedRecord, *, compacted: bool = False) -> LogRow:
    """Summarise one commit record: its :class:`CommitInfo`, its parent and writer ranks."""
    record = loaded.record
    return row_from(
        LogRow,
        CommitInfo.from_record(record),
        parent=record.parent,
        writer_ranks=record.world_size,
        compacted=compacted,
    )


def records(chain: Chain, *, since: int | None, limit: int | None) -> list[LoadedRecord]:
    """The commit records of the committed versions ``>= since``, then of the newest
    ``limit`` of those, oldest first (one small GET each, 8 at a time)."""
    versions = [v for v in chain.versions() if since is None or v >= since]
    if limit is not None:
        versions = versions[-limit:] if limit > 0 else []
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(chain.record, versions))


def log(
    store: Store | str | os.PathLike[str], *, limit: int | None = None, since: int | None = None
) -> list[LogRow]:
    """One row per committed version, oldest first.

    ``since`` keeps versions ``>= since``; ``limit`` then keeps the newest ``limit`` rows.
    """
    chain = Chain(open_store(store))
    chain.header  # noqa: B018  # a store without a chain is an error, not an empty log
    loaded = records(chain, since=since, limit=limit)
    compacted = set(alternative_bases(chain.store)) if loaded else set()
    return [log_row(r, compacted=r.record.version in compacted) for r in loaded]


class TensorRow(Row):
    """One tensor of a version, as ``dcr show`` prints it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    op: str
    changed: int
    encoded_bytes: int
    share: float
    """This tensor's share of the version's encoded bytes."""
    rank: int
    """The writer rank that published it (the first, for a tensor in pieces)."""
    pieces: int = 1
    """Entries the tensor came in: several when writer ranks published it in pieces."""
    positions_coding: str | None = None
    """How its changed positions are coded (FORMAT.md §6: ``rice``, ``ranges``,
    ``classed``); None where it has none (no change, ``full``); pieces coded differently
    are joined with ``+``."""
    values_coding: str | None = None
    """How its values are coded (§7: ``planes``, ``rans``, ``ulp``, ``ulp-shift``)."""


class VersionDetail(Row):
    """A version's commit record summary and its tensors."""

    version: LogRow
    state_fingerprint: str
    attempt: str
    required_features: tuple[str, ...]
    """What a reader must support to apply the version (FORMAT.md §12), sorted."""
    files: dict[str, int] = Field(default_factory=dict)
    """The checkpoint files the version carries (config, tokenizer, ...): size by name."""
    tensors: list[TensorRow]


ShowSort = Literal["bytes", "changed", "name"]
_SORT_KEYS = {
    "bytes": lambda r: (-r.encoded_bytes, r.name),
    "changed": lambda r: (-r.changed, r.name),
    "name": lambda r: r.name,
}


def show(
    store: Store | str | os.PathLike[str],
    version: int,
    *,
    sort: ShowSort = "bytes",
    top: int | None = None,
) -> VersionDetail:
    """The commit record of ``version`` and a row per tensor.

    Rows are sorted by encoded bytes (largest first), changed elements, or name;
    ``top`` keeps the first ``top`` rows.
    """
    if sort not in _SORT_KEYS:
        raise ValueError(f"sort must be one of {', '.join(_SORT_KEYS)}, not {sort!r}")
    version = whole(version, "version", low=0)
    chain = Chain(open_store(store))
    chain.header  # noqa: B018  # refuse a store without a chain
    loaded = chain.record(version)
    manifests = chain.manifests(loaded)
    total = sum(e.encoded_bytes for m in manifests for e in m.entries) or 1
    merged: dict[str, TensorRow] = {}
    for manifest in manifests:
        for e in manifest.entries:
            seen = merged.get(e.name)
            positions = None if e.positions is None else e.positions.coding
            values = None if e.values is None else e.values.coding
            if seen is not None:  # another piece of the tensor (FORMAT.md §4.8): add it up
                merged[e.name] = seen.model_copy(
                    update={
                        "changed": seen.changed + e.changed,
                        "encoded_bytes": seen.encoded_bytes + e.encoded_bytes,
                        "share": (seen.encoded_bytes + e.encoded_bytes) / total,
                        "pieces": seen.pieces + 1,
                        "positions_coding": _joined(seen.positions_coding, positions),
                        "values_coding": _joined(seen.values_coding, values),
                    }
                )
                continue
            merged[e.name] = row_from(
                TensorRow,
                e,
                share=e.encoded_bytes / total,
                rank=manifest.rank,
                positions_coding=positions,
                values_coding=values,
            )
    rows = list(merged.values())
    rows.sort(key=_SORT_KEYS[sort])
    if top is not None:
        rows = rows[: max(top, 0)]
    compacted = version in set(alternative_bases(chain.store))
    return VersionDetail(
        version=log_row(loaded, compacted=compacted),
        state_fingerprint=loaded.record.state_fingerprint,
        attempt=loaded.record.attempt,
        required_features=tuple(
            sorted(
                {*loaded.record.required_features}.union(*(m.required_features for m in manifests))
            )
        ),
        files={f.name: f.size for m in manifests for f in m.files},
        tensors=rows,
    )


def _joined(held: str | None, more: str | None) -> str | None:
    """The codings of a tensor's pieces so far and of one more piece: each once, ``+``."""
    names = sorted({*(held or "").split("+"), more or ""} - {""})
    return "+".join(names) or None
