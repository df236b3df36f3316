"""Chain tooling shared by Python callers and the ``dcr`` command: log, show, verify."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

from dcr_format.chain import Chain, LoadedRecord, get_verified, state_table, table_fingerprint
from dcr_format.errors import DcrError
from dcr_format.store import Store, open_store


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True)


class LogRow(_Row):
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


def _log_row(loaded: LoadedRecord) -> LogRow:
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
    )


def log(
    store: Store | str | os.PathLike[str], *, limit: int | None = None, since: int | None = None
) -> list[LogRow]:
    """One row per committed version, oldest first; ``limit`` keeps the newest rows."""
    chain = Chain(open_store(store))
    versions = [v for v in chain.versions() if since is None or v >= since]
    if limit is not None:
        versions = versions[-limit:] if limit > 0 else []
    return [_log_row(chain.record(v)) for v in versions]


class TensorRow(_Row):
    """One tensor of a version, as ``dcr show`` prints it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    op: str
    changed: int
    encoded_bytes: int
    share: float
    rank: int


class VersionDetail(_Row):
    """A version's commit record summary and its tensors."""

    version: LogRow
    state_fingerprint: str
    attempt: str
    tensors: list[TensorRow]


def show(store: Store | str | os.PathLike[str], version: int) -> VersionDetail:
    """The commit record of ``version`` and a row per tensor (largest payload first)."""
    chain = Chain(open_store(store))
    loaded = chain.record(version)
    rows = []
    manifests = chain.manifests(loaded)
    total = sum(e.encoded_bytes for m in manifests for e in m.entries) or 1
    for manifest in manifests:
        for e in manifest.entries:
            rows.append(
                TensorRow(
                    name=e.name,
                    dtype=e.dtype,
                    shape=tuple(e.shape),
                    op=e.op,
                    changed=e.changed,
                    encoded_bytes=e.encoded_bytes,
                    share=e.encoded_bytes / total,
                    rank=manifest.rank,
                )
            )
    rows.sort(key=lambda row: (-row.encoded_bytes, row.name))
    return VersionDetail(
        version=_log_row(loaded),
        state_fingerprint=loaded.record.state_fingerprint,
        attempt=loaded.record.attempt,
        tensors=rows,
    )


class Problem(_Row):
    """One broken object or link found by :func:`verify`."""

    version: int
    key: str
    error: str
    message: str


class VerifyReport(_Row):
    """Result of :func:`verify`: ``ok`` is True iff no problem was found."""

    ok: bool
    versions_checked: int
    objects_checked: int
    problems: list[Problem]

    @property
    def first_broken_version(self) -> int | None:
        """The lowest version with a problem."""
        return min((p.version for p in self.problems), default=None)


def verify(
    store: Store | str | os.PathLike[str], *, start: int | None = None, end: int | None = None
) -> VerifyReport:
    """Shallow check: every referenced object exists with its size and sha256, links hold.

    Checks each commit record, the hash chain between consecutive versions, every
    manifest (sha256, schema, membership) and every shard (size, sha256), and that
    each version's manifests add up to its state fingerprint.
    """
    chain = Chain(open_store(store))
    problems: list[Problem] = []
    checked = 0
    versions = [
        v for v in chain.versions() if (start is None or v >= start) and (end is None or v <= end)
    ]
    previous: LoadedRecord | None = None
    for version in versions:
        key = f"commits/{version:020d}.json"
        try:
            loaded = chain.record(version)
            checked += 1
        except DcrError as exc:
            problems.append(
                Problem(version=version, key=key, error=type(exc).__name__, message=str(exc))
            )
            previous = None
            continue
        if previous is not None and previous.record.version == version - 1:
            try:
                chain.check_link(previous, loaded)
            except DcrError as exc:
                problems.append(
                    Problem(version=version, key=key, error=type(exc).__name__, message=str(exc))
                )
        previous = loaded
        manifests = []
        for ref in loaded.record.manifests:
            try:
                manifests.append(chain.manifest(loaded, ref))
                checked += 1
            except DcrError as exc:
                problems.append(
                    Problem(
                        version=version, key=ref.path, error=type(exc).__name__, message=str(exc)
                    )
                )
        for manifest in manifests:
            for shard in manifest.shards:
                try:
                    get_verified(chain.store, shard.path, size=shard.size, sha256=shard.sha256)
                    checked += 1
                except DcrError as exc:
                    problems.append(
                        Problem(
                            version=version,
                            key=shard.path,
                            error=type(exc).__name__,
                            message=str(exc),
                        )
                    )
        if len(manifests) == len(loaded.record.manifests):
            try:
                if table_fingerprint(state_table(manifests)) != loaded.record.state_fingerprint:
                    problems.append(
                        Problem(
                            version=version,
                            key=key,
                            error="ChainBrokenError",
                            message="manifests do not add up to the state fingerprint",
                        )
                    )
            except DcrError as exc:
                problems.append(
                    Problem(version=version, key=key, error=type(exc).__name__, message=str(exc))
                )
    return VerifyReport(
        ok=not problems, versions_checked=len(versions), objects_checked=checked, problems=problems
    )
