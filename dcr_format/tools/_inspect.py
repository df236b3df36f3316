"""``dcr log`` and ``dcr show``: what the chain holds, from commit records and manifests."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from dcr_format.bases import alternative_bases
from dcr_format.chain import Chain, LoadedRecord
from dcr_format.store import Store, open_store
from dcr_format.tools._common import Row


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


def log_row(loaded: LoadedRecord, *, compacted: bool = False) -> LogRow:
    """Summarise one commit record."""
    r = loaded.record
    s = r.stats
    return LogRow(
        version=r.version,
        kind=r.kind,
        parent=r.parent,
        step=r.step,
        created=r.created,
        change_rate=s.changed_elements / s.total_elements if s.total_elements else 0.0,
        changed_elements=s.changed_elements,
        total_elements=s.total_elements,
        payload_bytes=s.payload_bytes,
        dense_bytes=s.dense_bytes,
        ratio=s.payload_bytes / s.dense_bytes if s.dense_bytes else 0.0,
        writer_ranks=r.world_size,
        compacted=compacted,
    )


def log(
    store: Store | str | os.PathLike[str], *, limit: int | None = None, since: int | None = None
) -> list[LogRow]:
    """One row per committed version, oldest first.

    ``since`` keeps versions ``>= since``; ``limit`` then keeps the newest ``limit`` rows.
    """
    chain = Chain(open_store(store))
    chain.header  # noqa: B018  # a store without a chain is an error, not an empty log
    versions = [v for v in chain.versions() if since is None or v >= since]
    if limit is not None:
        versions = versions[-limit:] if limit > 0 else []
    compacted = set(alternative_bases(chain.store)) if versions else set()
    with ThreadPoolExecutor(8) as pool:  # one small GET per version
        records = list(pool.map(chain.record, versions))
    return [log_row(r, compacted=r.record.version in compacted) for r in records]


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


class VersionDetail(Row):
    """A version's commit record summary and its tensors."""

    version: LogRow
    state_fingerprint: str
    attempt: str
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
    chain = Chain(open_store(store))
    chain.header  # noqa: B018  # refuse a store without a chain
    loaded = chain.record(version)
    manifests = chain.manifests(loaded)
    total = sum(e.encoded_bytes for m in manifests for e in m.entries) or 1
    merged: dict[str, TensorRow] = {}
    for manifest in manifests:
        for e in manifest.entries:
            seen = merged.get(e.name)
            if seen is not None:  # another piece of the tensor (FORMAT.md §4.8): add it up
                merged[e.name] = seen.model_copy(
                    update={
                        "changed": seen.changed + e.changed,
                        "encoded_bytes": seen.encoded_bytes + e.encoded_bytes,
                        "share": (seen.encoded_bytes + e.encoded_bytes) / total,
                        "pieces": seen.pieces + 1,
                    }
                )
                continue
            merged[e.name] = TensorRow(
                name=e.name,
                dtype=e.dtype,
                shape=tuple(e.shape),
                op=e.op,
                changed=e.changed,
                encoded_bytes=e.encoded_bytes,
                share=e.encoded_bytes / total,
                rank=manifest.rank,
                pieces=1,
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
        tensors=rows,
    )
