"""The chain in a store: object keys, the header, commit records and their validation.

Everything read here is treated as hostile: sizes and sha256 are checked against
the referring object before parsing, and every cross-reference (chain id,
version, attempt, rank, parent hash) is checked before anything is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from dcr_format.errors import (
    ChainBrokenError,
    ChecksumMismatchError,
    DcrError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    SchemaError,
    StoreNotInitializedError,
    VersionNotFoundError,
)
from dcr_format.format.features import (
    IMPLICIT_PARENTS_FEATURE,
    POSITIONS_CLASSED_FEATURE,
    VALUES_ULP_FEATURE,
    VALUES_ULP_SHIFT_FEATURE,
)
from dcr_format.format.names import CLASSED, EXPONENT_FIELDS, ULP, ULP_SHIFT
from dcr_format.format.schema import (
    MAX_HEADER_JSON_BYTES,
    MAX_MANIFEST_JSON_BYTES,
    MAX_RECORD_JSON_BYTES,
    PIECES_FEATURE,
    CommitRecord,
    Entry,
    Manifest,
    ManifestRef,
    ShardRef,
    StoreHeader,
    parse,
    parse_manifest,
)
from dcr_format.store.store import Store

HEADER_KEY = "dcr.json"
HEAD_KEY = "HEAD"
MAX_HEAD_BYTES = 20  # the decimal of a version number (at most 2**64 - 1)
COMMITS_PREFIX = "commits/"
OBJECTS_PREFIX = "objects/"
_COMMIT_KEY = re.compile(r"^commits/([0-9]{20})\.json$")
_PAYLOAD_KEY = re.compile(
    r"^(?:objects|bases)/([0-9]{20})/[0-9a-f]{32}/"
    r"(?:manifest-[0-9]{5}\.json|shard-[0-9]{5}-[0-9]{5}\.dcrs)$"
)
MAX_MANIFEST_BYTES = MAX_MANIFEST_JSON_BYTES  # 64 MiB: ~200,000 entries of one rank
MAX_VERSION_MANIFEST_BYTES = 128 << 20  # all manifests of one version: ~400,000 entries
MAX_RECORD_BYTES = MAX_RECORD_JSON_BYTES  # 1 MiB: ~5,000 writer ranks
MAX_HEADER_BYTES = MAX_HEADER_JSON_BYTES  # 64 KiB (dcr.json is ~200 bytes)


def commit_key(version: int, *, under: str = COMMITS_PREFIX) -> str:
    """Key of version ``version``'s commit record (``under`` ``bases/``: of its alternative
    base)."""
    return f"{under}{version:020d}.json"


def attempt_prefix(version: int, attempt: str, *, under: str = OBJECTS_PREFIX) -> str:
    """Prefix under which one publish attempt of a version writes its objects (``under``
    ``bases/``: one compaction attempt)."""
    return f"{under}{version:020d}/{attempt}/"


def manifest_key(version: int, attempt: str, rank: int, *, under: str = OBJECTS_PREFIX) -> str:
    """Key of one writer rank's manifest."""
    return f"{attempt_prefix(version, attempt, under=under)}manifest-{rank:05d}.json"


def shard_key(
    version: int, attempt: str, rank: int, index: int, *, under: str = OBJECTS_PREFIX
) -> str:
    """Key of one writer rank's ``index``-th shard."""
    return f"{attempt_prefix(version, attempt, under=under)}shard-{rank:05d}-{index:05d}.dcrs"


def payload_version(key: str) -> int | None:
    """The version whose manifest or shard (of an attempt, or of an alternative base) ``key``
    is: the objects whose sizes a commit record's ``payload_bytes`` adds up; None for any
    other key."""
    match = _PAYLOAD_KEY.match(key)
    return int(match.group(1)) if match else None


def sha256_hex(data: bytes | memoryview) -> str:
    """Hex sha256 of stored bytes."""
    return hashlib.sha256(data).hexdigest()


def utc_now() -> datetime:
    """The default clock."""
    return datetime.now(timezone.utc)


def timestamp(moment: datetime) -> str:
    """ISO 8601 UTC with microseconds and a ``Z``, as every ``created`` field."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_id() -> str:
    """A fresh 32-hex-digit id (chain ids, attempt ids)."""
    return uuid.uuid4().hex


def get_verified(store: Store, key: str, *, size: int, sha256: str) -> bytes:
    """Fetch an object and check it against the size and sha256 recorded for it (through
    the store's host cache where it has one: checked there too)."""
    if store.host_cache is not None:
        return store.host_cache.fetch(
            sha256, size, lambda: _get_checked(store, key, size=size, sha256=sha256)
        )
    return _get_checked(store, key, size=size, sha256=sha256)


def _get_checked(store: Store, key: str, *, size: int, sha256: str) -> bytes:
    data = store.get(key, max_size=size)
    if len(data) != size:
        raise ChecksumMismatchError(
            f"{key} is {len(data)} bytes, expected {size}: the object is corrupt; "
            "run `dcr verify` and restore it"
        )
    if sha256_hex(data) != sha256:
        raise ChecksumMismatchError(
            f"{key} does not match its recorded sha256: the object is corrupt; "
            "run `dcr verify` and restore it"
        )
    return data


@dataclass(frozen=True)
class LoadedRecord:
    """A commit record with the sha256 of its stored bytes (the next version links to it)."""

    record: CommitRecord
    sha256: str
    size: int


@dataclass(frozen=True)
class TensorState:
    """One row of a version's state table."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    fingerprint: str
    rank: int


MapFn = Callable[[Callable[[ManifestRef], Manifest], Iterable[ManifestRef]], Iterable[Manifest]]


class ManifestAllowance:
    """What the manifests of one version may inflate to together
    (:data:`MAX_VERSION_MANIFEST_BYTES`), counted as each is read, before it is inflated;
    thread-safe. More is refused with :class:`~dcr_format.errors.ObjectTooLargeError`
    (one manifest is bounded, but a version may have many ranks, and compressed manifests
    inflate). Refuses at once a version whose manifests' stored sizes add up past it."""

    def __init__(self, what: str, refs: Iterable[ManifestRef], limit: int | None = None) -> None:
        self.what = what
        self.limit = MAX_VERSION_MANIFEST_BYTES if limit is None else limit
        self._lock = threading.Lock()
        self._used = 0
        # a manifest over its own limit is refused as such when it is read
        stored = sum(min(ref.size, MAX_MANIFEST_BYTES) for ref in refs)
        self.take(stored, "its manifests as stored")

    def take(self, nbytes: int, whose: str) -> None:
        """Count ``nbytes`` more (``whose``: the manifest, named in the error)."""
        with self._lock:
            self._used += nbytes
            used = self._used
        if used > self.limit:
            raise ObjectTooLargeError(
                f"the manifests of {self.what} add up to more than the {self.limit}-byte limit "
                f"of one version (at {whose}); the commit record is corrupt or hostile"
            )

    def admitter(self, ref: ManifestRef) -> Callable[[int], None]:
        """What :func:`~dcr_format.format.schema.parse_manifest` tells the JSON size of ``ref``'s
        manifest: what it inflates to beyond its stored size (held already) is counted."""
        return lambda nbytes: self.take(max(0, nbytes - ref.size), ref.path)


@contextlib.contextmanager
def _remedy(what_to_do: str) -> Iterator[None]:
    """A :class:`SchemaError` of the stored object parsed within says ``what_to_do``."""
    try:
        yield
    except SchemaError as exc:
        raise SchemaError(f"{exc}; {what_to_do}") from None


class Chain:
    """Read access to the chain held by one store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._header: StoreHeader | None = None

    # --- header ------------------------------------------------------------------

    @property
    def header(self) -> StoreHeader:
        """The store header (``dcr.json``); raises if the store holds no chain."""
        if self._header is None:
            missing = StoreNotInitializedError(
                f"{self.store.url} holds no dcr chain (no dcr.json); publish to it first "
                "or check the store URL"
            )
            data = self._get(HEADER_KEY, MAX_HEADER_BYTES, missing)
            with _remedy("restore dcr.json from a copy of the store: no version reads without it"):
                self._header = parse(StoreHeader, data, what=f"{self.store.url}/{HEADER_KEY}")
        return self._header

    def _get(self, key: str, max_size: int, missing: DcrError) -> bytes:
        """The bytes of ``key``; ``missing`` is raised when the store has no such object."""
        try:
            return self.store.get(key, max_size=max_size)
        except ObjectNotFoundError:
            raise missing from None

    def exists(self) -> bool:
        """Whether the store holds a chain header."""
        return self.store.exists(HEADER_KEY)

    def create(
        self,
        *,
        clock: Callable[[], datetime] = utc_now,
        chain_id: str | None = None,
        conditional_writes: bool | None = None,
    ) -> StoreHeader:
        """Create the header if absent (racing creators agree on whichever landed first)."""
        header = StoreHeader(
            chain_id=chain_id or new_id(),
            created=timestamp(clock()),
            conditional_writes=conditional_writes,
        )
        try:
            self.store.put_if_absent(HEADER_KEY, header.to_json())
        except ObjectExistsError:
            pass
        self._header = None
        return self.header

    # --- commits -----------------------------------------------------------------

    def head_hint(self) -> int | None:
        """The newest committed version as the committer's ``HEAD`` names it: a hint only
        (FORMAT.md §3), which may lag behind or be missing, so never a reason to take a
        version as committed; one small read, where :meth:`versions` lists every commit
        record. None where ``HEAD`` is missing, unreadable or not a version number."""
        try:
            data = self.store.get(HEAD_KEY, max_size=MAX_HEAD_BYTES)
        except DcrError:
            return None
        text = data.decode("ascii", errors="replace")
        return int(text) if text.isascii() and text.isdigit() else None

    def versions(self) -> list[int]:
        """Committed versions, ascending (from listing ``commits/``)."""
        self.header  # noqa: B018 (a store without a chain is an error, not an empty chain)
        found = []
        for key in self.store.list(COMMITS_PREFIX):
            match = _COMMIT_KEY.match(key)
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def not_committed(self, version: int, committed: list[int]) -> VersionNotFoundError:
        """The error for ``version`` missing from ``committed`` (this chain's versions): the
        range the chain holds, and where to see it."""
        if not committed:
            return VersionNotFoundError(
                f"{self.store.url} has no committed version yet; publish one first"
            )
        return VersionNotFoundError(
            f"version {version} is not committed: the chain of {self.store.url} holds "
            f"versions {committed[0]}..{committed[-1]}; run `dcr log` to see the committed "
            "versions"
        )

    def latest(self) -> int | None:
        """The newest committed version, or None for an empty chain."""
        versions = self.versions()
        return versions[-1] if versions else None

    def record(self, version: int) -> LoadedRecord:
        """Load and validate version ``version``'s commit record."""
        key = commit_key(version)
        missing = VersionNotFoundError(
            f"version {version} is not committed in {self.store.url}; "
            "run `dcr log` to see the committed versions"
        )
        data = self._get(key, MAX_RECORD_BYTES, missing)
        with _remedy("run `dcr verify` on the store and restore the record from a copy"):
            record = parse(CommitRecord, data, what=key)
        self.check_record(record, version)
        return LoadedRecord(record, sha256_hex(data), len(data))

    def check_record(self, record: CommitRecord, version: int) -> None:
        """Semantic checks of a commit record beyond its schema."""
        key = commit_key(version)
        check_owner(
            record,
            key,
            self.header.chain_id,
            version,
            mixed="the store mixes chains; restore it",
            wrong="the store is corrupt",
        )
        if version == 0 and (
            record.kind != "base" or record.parent is not None or record.parent_sha256 is not None
        ):
            raise ChainBrokenError(f"{key}: version 0 must be a base with no parent")
        if version > 0 and (record.parent != version - 1 or record.parent_sha256 is None):
            raise ChainBrokenError(f"{key}: version {version} must link to version {version - 1}")
        check_manifest_refs(record, key, version)

    def check_link(self, parent: LoadedRecord, child: LoadedRecord) -> None:
        """The child's parent hash must be the sha256 of the parent's stored record."""
        if (
            child.record.parent != parent.record.version
            or child.record.parent_sha256 != parent.sha256
        ):
            raise ChainBrokenError(
                f"version {child.record.version} does not link to version "
                f"{parent.record.version} (parent hash differs): the chain is broken; "
                "run `dcr verify`"
            )

    # --- manifests ---------------------------------------------------------------

    def manifest(
        self, loaded: LoadedRecord, ref: ManifestRef, *, allowance: ManifestAllowance | None = None
    ) -> Manifest:
        """Load one manifest of a committed version and check it belongs there (counted
        against ``allowance``, where given, before it is inflated)."""
        record = loaded.record
        if ref.size > MAX_MANIFEST_BYTES:
            raise SchemaError(
                f"{ref.path} is declared as {ref.size} bytes, over the {MAX_MANIFEST_BYTES} byte "
                "manifest limit; the commit record is corrupt or hostile"
            )
        data = get_verified(self.store, ref.path, size=ref.size, sha256=ref.sha256)
        admit = None if allowance is None else allowance.admitter(ref)
        manifest = parse_manifest(data, what=ref.path, admit=admit)
        check_manifest(
            manifest,
            record.chain_id,
            record.version,
            record.kind,
            record.attempt,
            ref.rank,
            record.world_size,
            ref.path,
        )
        return manifest

    def manifests(self, loaded: LoadedRecord, *, map_fn: MapFn | None = None) -> list[Manifest]:
        """All manifests of a committed version, rank order, together within
        :data:`MAX_VERSION_MANIFEST_BYTES` (``map_fn``: a pool's map, to read them at once)."""
        refs = sorted(loaded.record.manifests, key=lambda r: r.rank)
        allowance = ManifestAllowance(f"version {loaded.record.version}", refs)
        load = lambda ref: self.manifest(loaded, ref, allowance=allowance)  # noqa: E731
        return list(map(load, refs) if map_fn is None else map_fn(load, refs))

    def state_table(self, manifests: list[Manifest]) -> dict[str, TensorState]:
        """The full tensor table of a version from its manifests."""
        return state_table(manifests)


class Owned(Protocol):
    """What a commit record and an alternative base record share: whose version they are
    and the manifests they list."""

    @property
    def chain_id(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def attempt(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def manifests(self) -> tuple[ManifestRef, ...]: ...


def check_owner(
    record: Owned, key: str, chain_id: str, version: int, *, mixed: str, wrong: str
) -> None:
    """The record stored at ``key`` must be of chain ``chain_id`` and of ``version``; the
    error says ``mixed`` (another chain) or ``wrong`` (another version) as what to do."""
    if record.chain_id != chain_id:
        raise ChainBrokenError(
            f"{key} belongs to chain {record.chain_id}, not this store's {chain_id}: {mixed}"
        )
    if record.version != version:
        raise ChainBrokenError(f"{key} claims version {record.version}; {wrong}")


def check_manifest_refs(
    record: Owned, key: str, version: int, *, under: str = OBJECTS_PREFIX
) -> None:
    """The record stored at ``key`` must list one manifest per rank of its world size, each
    at its rank's key in the record's own attempt (below ``under``)."""
    ranks = sorted(ref.rank for ref in record.manifests)
    if ranks != list(range(record.world_size)):
        raise SchemaError(f"{key} lists manifest ranks {ranks} for world size {record.world_size}")
    for ref in record.manifests:
        if ref.path != manifest_key(version, record.attempt, ref.rank, under=under):
            raise SchemaError(f"{key} points at {ref.path}, outside its own attempt")


def check_manifest(
    manifest: Manifest,
    chain_id: str,
    version: int,
    kind: str,
    attempt: str,
    rank: int,
    world_size: int,
    where: str,
) -> None:
    """A manifest must agree with the commit (or publish) it belongs to, and be self-consistent."""
    expected = (chain_id, version, kind, attempt, rank, world_size)
    found = (
        manifest.chain_id,
        manifest.version,
        manifest.kind,
        manifest.attempt,
        manifest.rank,
        manifest.world_size,
    )
    if found != expected:
        raise SchemaError(
            f"{where} does not belong to this version (chain/version/attempt/rank differ)"
        )
    for index, shard in enumerate(manifest.shards):
        if shard.path != shard_key(version, attempt, rank, index):
            raise SchemaError(
                f"{where} names shard {shard.path}, not {shard_key(version, attempt, rank, index)}"
            )
    names = set()
    implicit = IMPLICIT_PARENTS_FEATURE in manifest.required_features
    for entry in manifest.entries:
        if entry.name in names:
            raise SchemaError(f"{where} lists tensor {entry.name!r} twice")
        names.add(entry.name)
        numel = 1
        for dim in entry.shape:
            numel *= dim
        if numel > (1 << 62):
            raise SchemaError(f"{where}: tensor {entry.name!r} has an impossible shape")
        whole_full = entry.op == "full" and entry.piece is None  # a full piece covers its region
        if entry.changed > numel or (whole_full and entry.changed != numel):
            raise SchemaError(f"{where}: tensor {entry.name!r} declares {entry.changed} changes")
        if kind == "base" and entry.op != "full":
            raise SchemaError(f"{where}: base versions carry only full entries ({entry.name!r})")
        if entry.piece is not None:
            _check_piece(manifest, entry, where)
        needs_values = entry.changed > 0
        needs_positions = needs_values and not whole_full
        if (entry.values is not None) != needs_values or (
            entry.positions is not None
        ) != needs_positions:
            raise SchemaError(f"{where}: tensor {entry.name!r} has streams that do not fit its op")
        if implicit and entry.piece is None:  # the parent's table holds it (FORMAT.md §3.5.5)
            if entry.parent_fingerprint is not None:
                raise SchemaError(
                    f"{where}: tensor {entry.name!r} has a parent_fingerprint, which a manifest "
                    f"that requires {IMPLICIT_PARENTS_FEATURE!r} leaves null"
                )
        elif entry.op in ("xor", "overwrite") and entry.parent_fingerprint is None:
            raise SchemaError(f"{where}: tensor {entry.name!r} needs a parent_fingerprint")
        elif (
            entry.op != "full"
            and entry.changed == 0
            and entry.fingerprint != entry.parent_fingerprint
        ):
            raise SchemaError(
                f"{where}: tensor {entry.name!r} changes no element but its fingerprint differs"
            )
        if entry.positions is not None and entry.positions.coding == CLASSED:
            _check_against_baseline(manifest, entry, where, POSITIONS_CLASSED_FEATURE, "positions")
        if entry.values is not None and entry.values.coding == ULP:
            _check_against_baseline(manifest, entry, where, VALUES_ULP_FEATURE, "values")
        if entry.values is not None and entry.values.coding == ULP_SHIFT:
            _check_against_baseline(manifest, entry, where, VALUES_ULP_SHIFT_FEATURE, "values")
        for ref in entry.streams:
            if ref.shard >= len(manifest.shards):
                raise SchemaError(f"{where}: tensor {entry.name!r} points at a missing shard")


def _check_against_baseline(
    manifest: Manifest, entry: Entry, where: str, feature: str, stream: str
) -> None:
    """A stream coded against the old bits (``classed`` positions, FORMAT.md §6.5; ``ulp``
    and ``ulp-shift`` values, §7.5-7.6): feature listed, an ``xor`` entry of a whole tensor
    of a float dtype (the reader decodes it against the exact old bits)."""
    name = entry.name
    if feature not in manifest.required_features:
        raise SchemaError(
            f"{where}: tensor {name!r} has {stream} coded against its old bits but the "
            f"manifest does not require the {feature!r} feature"
        )
    if entry.op != "xor" or entry.piece is not None or entry.dtype not in EXPONENT_FIELDS:
        raise SchemaError(
            f"{where}: tensor {name!r} has {stream} coded against its old bits, which only xor "
            "entries of whole float tensors may use"
        )


def _check_piece(manifest: Manifest, entry: Entry, where: str) -> None:
    """A piece entry (FORMAT.md §4.8) on its own: feature listed, lanes well formed and
    consistent with the entry's (partial) fingerprints."""
    from dcr_format.delta.fingerprint import LANE_PRIMES, fingerprint_from_lanes
    from dcr_format.format.dtypes import info_for

    piece = entry.piece
    assert piece is not None
    name = entry.name
    if PIECES_FEATURE not in manifest.required_features:
        raise SchemaError(
            f"{where}: tensor {name!r} is a piece but the manifest does not "
            f"require the {PIECES_FEATURE!r} feature"
        )
    if piece.index >= piece.count:
        raise SchemaError(f"{where}: tensor {name!r} is piece {piece.index} of {piece.count}")
    info = info_for(entry.dtype)
    lanes = 3 if info.width == 8 else 2
    full = entry.op == "full"
    if (piece.lanes_before is None) != full:
        raise SchemaError(f"{where}: piece of {name!r} needs lanes_before iff its op is not full")
    for values in (piece.lanes_after, piece.lanes_before):
        if values is None:
            continue
        if len(values) != lanes or any(v >= LANE_PRIMES[i] for i, v in enumerate(values)):
            raise SchemaError(f"{where}: piece of {name!r} has malformed fingerprint lanes")
    shape = tuple(entry.shape)
    if entry.fingerprint != fingerprint_from_lanes(info.torch_dtype, shape, piece.lanes_after):
        raise SchemaError(f"{where}: piece of {name!r}: fingerprint does not match lanes_after")
    if not full and entry.parent_fingerprint != fingerprint_from_lanes(
        info.torch_dtype, shape, piece.lanes_before or ()
    ):
        raise SchemaError(
            f"{where}: piece of {name!r}: parent_fingerprint does not match lanes_before"
        )


@dataclass(frozen=True)
class TensorChange:
    """One tensor of a version as its manifests give it: a whole entry, or its pieces combined.

    ``fingerprint`` is the whole tensor's (for pieces: from the summed lanes),
    ``parent_fingerprint`` likewise (None when the tensor is written ``full``), ``changed``
    the elements the version writes (summed over pieces).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    full: bool
    changed: int
    fingerprint: str
    parent_fingerprint: str | None
    rank: int
    pieces: tuple[tuple[int, Entry], ...]  # (rank, entry) in piece order; () for a whole entry


def tensor_changes(manifests: list[Manifest]) -> dict[str, TensorChange]:
    """Every tensor of a version, pieces combined (FORMAT.md §4.8); inconsistencies refused.

    A name listed by two ranks as a whole entry, or both whole and in pieces, is an error;
    pieces must agree on dtype, shape, count and fullness, and every index must be present
    exactly once.
    """
    from dcr_format.delta.fingerprint import add_lanes, fingerprint_from_lanes
    from dcr_format.format.dtypes import info_for

    whole: dict[str, TensorChange] = {}
    parts: dict[str, list[tuple[int, Entry]]] = {}
    for manifest in manifests:
        for entry in manifest.entries:
            if entry.name in whole:
                raise SchemaError(f"tensor {entry.name!r} is listed by more than one rank")
            if entry.piece is None:
                if entry.name in parts:
                    raise SchemaError(f"tensor {entry.name!r} is listed whole and in pieces")
                whole[entry.name] = TensorChange(
                    entry.name,
                    entry.dtype,
                    tuple(entry.shape),
                    entry.op == "full",
                    entry.changed,
                    entry.fingerprint,
                    entry.parent_fingerprint if entry.op != "full" else None,
                    manifest.rank,
                    (),
                )
            else:
                parts.setdefault(entry.name, []).append((manifest.rank, entry))
    for name, listed in parts.items():
        first = listed[0][1]
        assert first.piece is not None
        count = first.piece.count
        full = first.op == "full"
        by_index: dict[int, tuple[int, Entry]] = {}
        for rank, entry in listed:
            assert entry.piece is not None
            if (
                entry.dtype != first.dtype
                or tuple(entry.shape) != tuple(first.shape)
                or entry.piece.count != count
                or (entry.op == "full") != full
            ):
                raise SchemaError(
                    f"the pieces of tensor {name!r} disagree on dtype, shape, count or op"
                )
            if entry.piece.index in by_index:
                raise SchemaError(f"piece {entry.piece.index} of tensor {name!r} is listed twice")
            by_index[entry.piece.index] = (rank, entry)
        if len(by_index) != count:
            missing = sorted(set(range(count)) - set(by_index))
            raise SchemaError(
                f"tensor {name!r} lacks pieces {missing[:8]} of {count}; a writer rank's "
                "manifest is missing or its layout disagrees with the others'"
            )
        ordered = tuple(by_index[i] for i in range(count))
        torch_dtype = info_for(first.dtype).torch_dtype
        shape = tuple(first.shape)
        numel = 1
        for dim in shape:
            numel *= dim
        changed = sum(e.changed for _, e in ordered)
        if full and changed != numel:
            raise SchemaError(
                f"the full pieces of tensor {name!r} hold {changed} elements, not its "
                f"{numel}: the writers' regions overlap or leave a gap"
            )
        after = add_lanes(*(e.piece.lanes_after for _, e in ordered if e.piece is not None))
        before = None
        if not full:
            before = fingerprint_from_lanes(
                torch_dtype,
                shape,
                add_lanes(*(e.piece.lanes_before or () for _, e in ordered if e.piece is not None)),
            )
        whole[name] = TensorChange(
            name,
            first.dtype,
            shape,
            full,
            changed,
            fingerprint_from_lanes(torch_dtype, shape, after),
            before,
            ordered[0][0],
            ordered,
        )
    return whole


def resolve_parents(
    manifests: list[Manifest], parent: dict[str, TensorState] | None, version: int
) -> list[Manifest]:
    """``manifests`` of delta version ``version`` with the parent fingerprints that manifests
    requiring ``implicit-parents`` leave null filled in from ``parent``, the state table of
    version ``version - 1`` (FORMAT.md §3.5.5); the others as they are (no copy when no
    manifest requires the feature).

    An entry whose name ``parent`` lacks, or holds with another dtype or shape, stays null:
    the continuity check refuses it. An entry that changes nothing must keep the parent's
    fingerprint (§4.4 rule 9; with explicit parents the manifest's own validation checks it).
    """
    if not any(IMPLICIT_PARENTS_FEATURE in m.required_features for m in manifests):
        return manifests
    if parent is None:
        raise ChainBrokenError(
            f"version {version} leaves its parent fingerprints to version {version - 1}, "
            "whose state table is not at hand; sync or verify from a base before it"
        )
    resolved = []
    for manifest in manifests:
        if IMPLICIT_PARENTS_FEATURE not in manifest.required_features:
            resolved.append(manifest)
            continue
        entries = []
        for entry in manifest.entries:
            row = parent.get(entry.name)
            if (
                entry.piece is not None
                or entry.op == "full"
                or row is None
                or (row.dtype, row.shape) != (entry.dtype, tuple(entry.shape))
            ):
                entries.append(entry)
                continue
            if entry.changed == 0 and entry.fingerprint != row.fingerprint:
                raise ChainBrokenError(
                    f"version {version} changes no element of tensor {entry.name!r} but gives "
                    "it another fingerprint than its parent's; the store is corrupt: run "
                    "`dcr verify`"
                )
            entries.append(entry.model_copy(update={"parent_fingerprint": row.fingerprint}))
        resolved.append(manifest.model_copy(update={"entries": tuple(entries)}))
    return resolved


def state_table(manifests: list[Manifest]) -> dict[str, TensorState]:
    """Union of the manifests' entries, pieces combined; a name listed by two ranks is an error."""
    return {
        name: TensorState(name, change.dtype, change.shape, change.fingerprint, change.rank)
        for name, change in tensor_changes(manifests).items()
    }


def table_fingerprint(table: dict[str, TensorState]) -> str:
    """State fingerprint of a table (see :func:`dcr_format.delta.fingerprint.state_fingerprint`)."""
    from dcr_format.delta.fingerprint import state_fingerprint

    return state_fingerprint((t.name, t.dtype, t.shape, t.fingerprint) for t in table.values())


__all__ = [
    "Chain",
    "LoadedRecord",
    "ShardRef",
    "TensorChange",
    "TensorState",
    "attempt_prefix",
    "commit_key",
    "manifest_key",
    "resolve_parents",
    "shard_key",
    "state_table",
    "tensor_changes",
]
