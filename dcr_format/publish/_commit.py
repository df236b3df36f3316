"""The commit protocol (FORMAT.md §10, §14): how a version, or an alternative base, becomes
visible to readers.

Writer ranks upload their manifests; the committer (rank 0) waits for all of them,
checks them and creates the record with create-if-absent; the other ranks wait for
the record (or for the ``ABORTED`` marker of an abandoned attempt). Record creation
is shared with ``dcr compact``, which publishes ``bases/<V>.json`` the same way. Reader
records (``readers/*.json``, §3.6) are read here too: they are requests to the writers.

Plain functions over a :class:`~dcr_format.store.store.Store`; no writer state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from dcr_format.chain.chain import (
    HEAD_KEY,
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    Chain,
    LoadedRecord,
    ManifestAllowance,
    attempt_prefix,
    check_manifest,
    commit_key,
    manifest_key,
    sha256_hex,
)
from dcr_format.chain.readers import READERS_PREFIX, honoured_record
from dcr_format.errors import (
    CapabilityError,
    CommitConflictError,
    CommitStateUnknownError,
    IncompleteVersionError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
)
from dcr_format.format.features import WRITER_FEATURES, Readable, publish_features
from dcr_format.format.schema import (
    Manifest,
    ManifestRef,
    ReaderRecord,
    manifest_json_size,
    parse_manifest,
)
from dcr_format.publish._part import Attempt
from dcr_format.store.store import Capabilities, Store

ABORT_MARKER = "ABORTED"

T = TypeVar("T")
ManifestCheck = Callable[[Manifest, int, str], None]
"""Called with each manifest read back, its rank and its key; raises to refuse it."""


def require_atomic_create(store: Store, refusal: str) -> Capabilities:
    """The store's capabilities; raises :class:`CapabilityError` with ``refusal`` unless
    ``store`` creates records atomically (or was opened ``single_writer``): two writers
    must never both win one record."""
    capabilities = store.capabilities
    if not capabilities.writable:
        raise StoreError(f"cannot write to {store.url}: {capabilities.read_only}")
    if not capabilities.atomic_create and not store.single_writer:
        raise CapabilityError(refusal)
    return capabilities


def wait_for(ready: Callable[[], T | None], what: str, timeout: float) -> T:
    """Poll ``ready`` (backing off from 2 ms to 200 ms) until it returns a value.

    Raises :class:`IncompleteVersionError` after ``timeout`` seconds; an exception
    ``ready`` raises ends the wait.
    """
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        result = ready()
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            raise IncompleteVersionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def abort_key(version: int, attempt: str) -> str:
    """The marker that says attempt ``attempt`` of ``version`` will never be committed."""
    return attempt_prefix(version, attempt) + ABORT_MARKER


def abort(store: Store, version: int, attempt: str) -> None:
    """Mark the attempt abandoned, so the other ranks stop waiting (best effort)."""
    try:
        store.put(abort_key(version, attempt), b"")
    except StoreError:
        pass


def gather_manifests(
    attempt: Attempt,
    *,
    own: bytes,
    timeout: float,
    check: ManifestCheck,
    own_manifest: Manifest | None = None,
) -> list[tuple[Manifest, ManifestRef]]:
    """Wait for every rank's manifest of the attempt and validate each; in rank order.

    ``own``: the bytes of this rank's (``attempt.rank``) manifest as uploaded. A manifest
    read back is what the record's sha256 will name, so bytes altered in transit (an S3
    ranged GET carries no checksum) must not be taken: ours must equal ``own``, another
    rank's must read the same twice; otherwise it is read again. ``own_manifest``: the
    manifest ``own`` was made from, taken for this rank's instead of parsing ``own`` back
    (on a model of many tensors the parse was most of the commit's time: about 12 us a
    tensor). Raises :class:`IncompleteVersionError` when a rank abandoned the attempt or
    the wait timed out.
    """
    store, version, world_size = attempt.store, attempt.version, attempt.world_size
    found: dict[int, tuple[Manifest, ManifestRef]] = {}
    allowance = ManifestAllowance(f"version {version}", ())  # what readers will accept
    marker = abort_key(version, attempt.id)

    def read(other: int, key: str) -> bytes | None:
        try:
            data = store.get(key, max_size=MAX_MANIFEST_BYTES)
            again = own if other == attempt.rank else store.get(key, max_size=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            if store.exists(marker):
                raise IncompleteVersionError(
                    f"a writer rank abandoned version {version} before its manifest; "
                    "see that rank's error, then publish again"
                ) from None
            return None
        return data if data == again else None  # altered in transit: read it again

    def all_manifests() -> bool | None:
        for other in range(world_size):
            if other in found:
                continue
            key = manifest_key(version, attempt.id, other)
            data = read(other, key)
            if data is None:
                return None
            allowance.take(max(len(data), manifest_json_size(data)), key)
            mine = other == attempt.rank and own_manifest is not None  # data equals own here
            manifest = own_manifest if mine else parse_manifest(data, what=key)
            assert manifest is not None
            check_manifest(
                manifest,
                attempt.chain_id,
                version,
                attempt.kind,
                attempt.id,
                other,
                world_size,
                key,
            )
            check(manifest, other, key)
            found[other] = (
                manifest,
                ManifestRef(rank=other, path=key, sha256=sha256_hex(data), size=len(data)),
            )
        return True

    wait_for(all_manifests, f"all {world_size} manifests of version {version}", timeout)
    return [found[r] for r in range(world_size)]


def create_if_absent(store: Store, key: str, data: bytes, *, retry: str) -> bool:
    """Create ``key`` holding ``data`` unless it exists: True when ``data`` is there now
    (created by this call or by an earlier try whose answer was lost), False when another
    writer's bytes are.

    A put whose outcome is unknown is tried once more, then the key is read back. Raises
    :class:`CommitStateUnknownError` (its message ending in ``retry``) when the outcome
    cannot be told: the caller must then keep every object the record would name.
    """
    for _ in range(2):
        try:
            store.put_if_absent(key, data)
            return True
        except ObjectExistsError:
            break
        except StoreError:
            continue  # outcome unknown: re-read below
    try:
        landed = store.get(key, max_size=MAX_RECORD_BYTES)
    except ObjectNotFoundError:
        raise CommitStateUnknownError(
            f"could not create {key} and cannot tell whether it landed; {retry}"
        ) from None
    except StoreError as exc:
        raise CommitStateUnknownError(
            f"could not create or re-read {key} ({exc}); {retry}"
        ) from None
    return landed == data


def create_commit(store: Store, version: int, data: bytes) -> None:
    """Create the commit record of ``version`` (the commit point), then point HEAD at it.

    Raises :class:`CommitConflictError` when another writer committed the version first.
    """
    if not create_if_absent(
        store,
        commit_key(version),
        data,
        retry="keep this attempt's objects and retry the publish later",
    ):
        raise CommitConflictError(
            f"version {version} was committed by another writer; reopen the writer to "
            "continue from the chain's newest version"
        )
    try:
        store.put(HEAD_KEY, str(version).encode())
    except StoreError:
        pass  # HEAD is only a hint


def await_commit(chain: Chain, version: int, attempt: str, timeout: float) -> LoadedRecord:
    """Wait for the committer's outcome of attempt ``attempt``: its commit record.

    Raises :class:`IncompleteVersionError` when the committer abandoned the attempt (or the
    wait timed out) and :class:`CommitConflictError` when another attempt was committed.
    """
    store = chain.store
    marker = abort_key(version, attempt)

    def outcome() -> LoadedRecord | None:
        if store.exists(commit_key(version)):
            return chain.record(version)
        if store.exists(marker):
            raise IncompleteVersionError(
                f"the committer abandoned version {version}; see rank 0's error"
            )
        return None

    loaded = wait_for(outcome, f"the commit record of version {version}", timeout)
    if loaded.record.attempt != attempt:
        raise CommitConflictError(
            f"version {version} was committed by another writer; reopen the writer"
        )
    return loaded


@dataclass(frozen=True)
class ReaderWishes:
    """What the reader records ask of writers, together (FORMAT.md §3.6)."""

    overwrite: frozenset[str] = frozenset()  # the union of their ``overwrite`` lists
    baseline_names: frozenset[str] | None = None
    """The tensors every record's reader reads the old bits of (the intersection of the
    ``baseline_names`` of the records with ``reads_baseline`` false), but for those of
    ``baseline_except``; None: every tensor but those."""
    baseline_except: frozenset[str] = frozenset()
    """The tensors some record's reader reads every tensor's old bits but (the union of the
    records' ``baseline_except``)."""
    features: frozenset[str] = WRITER_FEATURES  # the writer features every record's reader reads
    limiting: tuple[str, ...] = ()
    """The readers (sorted ids) whose records leave out a writer feature: they lack it, or
    cannot read the old bits of every tensor."""
    changed_names: frozenset[str] | None = None
    changed_except: frozenset[str] = frozenset()
    """As ``baseline_names`` and ``baseline_except``, of the tensors every record's reader
    reads the old bits of each changed element of (those of the tensors it reads the old
    bits of, and of every tensor where it says ``reads_changed``)."""

    @property
    def baseline(self) -> Readable:
        """The tensors every record reads the old bits of."""
        return self.baseline_names, self.baseline_except

    @property
    def changed(self) -> Readable:
        """The tensors every record reads the old bits of each changed element of."""
        return self.changed_names, self.changed_except

    @property
    def reads_baseline(self) -> bool:
        """Whether every record's reader reads the old bits of every tensor."""
        return self.baseline_names is None and not self.baseline_except

    def features_for(self, allowed: frozenset[str] | None) -> frozenset[str]:
        """The features a publish uses given the writer's explicit set (None: its default)."""
        return publish_features(
            allowed, self.features, self.baseline_names, changed_names=self.changed_names
        )


def read_reader_records(store: Store) -> ReaderWishes:
    """The union of the ``overwrite`` lists of every reader record (FORMAT.md §3.6), the
    tensors all of them read the old bits of (``reads_baseline``, else ``baseline_names``
    or every tensor but ``baseline_except``) and the writer features all of them read (a
    record without ``features`` reads every one).

    One listing plus one small get per record. A record that cannot be read, is larger
    than its size limit (1 MiB) or does not validate (or names another reader than its
    key) is skipped: records are requests, never requirements. A reader whose names do
    not fit one record writes them in parts (``<id>.part<k>.json``), each a record of its
    own, so the union holds them all.
    """
    try:
        keys = store.list(READERS_PREFIX)
    except StoreError:
        return ReaderWishes()
    names: set[str] = set()
    whole, changed = _Reads(), _Reads()
    features = WRITER_FEATURES
    limiting: set[str] = set()
    for key in sorted(keys):
        _, record, _ = honoured_record(store, key)  # past its size limit: skipped unread
        if record is None:
            continue
        names.update(record.overwrite)
        whole.add(record)
        if not record.reads_changed:  # else it reads every tensor's changed elements
            changed.add(record)
        lacks = set() if record.features is None else WRITER_FEATURES - set(record.features)
        features -= lacks
        if lacks or not record.reads_baseline:
            limiting.add(record.reader_id)
    baseline, excluded = whole.readable()
    return ReaderWishes(
        frozenset(names),
        baseline,
        excluded,
        features,
        tuple(sorted(limiting)),
        *changed.readable(),
    )


class _Reads:
    """The tensors every record added reads the old bits of (FORMAT.md §3.6)."""

    def __init__(self) -> None:
        self.names: frozenset[str] | None = None  # the intersection of the lists of names
        self.excluded: set[str] = set()  # the union of the lists of exceptions

    def add(self, record: ReaderRecord) -> None:
        if record.baseline_except is not None:  # every tensor's old bits but these
            self.excluded.update(record.baseline_except)
        elif not record.reads_baseline:
            reads = frozenset(record.baseline_names or ())
            self.names = reads if self.names is None else self.names & reads

    def readable(self) -> Readable:
        names = None if self.names is None else self.names - self.excluded
        return names, frozenset(self.excluded)
