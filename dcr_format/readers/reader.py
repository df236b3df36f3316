"""The rollout side: plan, fetch, verify, stage, and only then apply."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from dcr_format.bases import alternative_bases, load_base
from dcr_format.chain import (
    Chain,
    LoadedRecord,
    TensorState,
    get_verified,
    sha256_hex,
    state_table,
    table_fingerprint,
    tensor_changes,
    timestamp,
    utc_now,
)
from dcr_format.codec.budget import DecodeBudget
from dcr_format.codec.delta import FULL, OVERWRITE, XOR, DecodedDelta, decode_delta
from dcr_format.codec.dtypes import info_for
from dcr_format.codec.shard import decode_shard, shard_decoded_bound, stream_limits
from dcr_format.errors import (
    ApplyError,
    ArgumentError,
    BaselineMismatchError,
    ChainBrokenError,
    DcrError,
    FingerprintMismatchError,
    GroupAbortError,
    IntegrityError,
    SchemaError,
    ShardError,
    StalePreparedError,
    StoreError,
    TargetChangedError,
    TargetError,
    VersionNotFoundError,
)
from dcr_format.fingerprint import (
    apply_lane_deltas,
    fingerprint_from_lanes,
    lanes_after_change,
)
from dcr_format.readers.group import ReaderGroup
from dcr_format.readers.targets import Applied, Change, Resident, Target, Transaction
from dcr_format.schema import Entry, Manifest, ReaderRecord
from dcr_format.store import Store, open_store

MAX_SHARD_DECODED_BYTES = 16 << 30  # refuse to inflate a single shard past this
AUDIT_EVERY = 100  # syncs between full audits of the resident bits (FORMAT.md §11.3)
AUDIT_SECONDS = 3600.0  # and at least this often
_READER_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_log = logging.getLogger(__name__)


class SyncResult(BaseModel):
    """What one :meth:`DeltaReader.sync` (or :meth:`DeltaReader.apply`) did.

    ``fetch_seconds`` is the preparation (fetch, verify, decode: the engine may keep
    generating meanwhile), ``apply_seconds`` the pause (checking and changing the target).
    ``audited``: the sync read every selected resident tensor in full before applying
    (FORMAT.md §11.3) instead of relying on the lanes it verified at its previous sync.
    ``unverified``: tensors the sync changed (or, with ``verify="all"``, held) whose
    fingerprints the target could not check because it cannot read them back in
    canonical coordinates (a module whose loader transforms them, FORMAT.md §8.4).
    """

    model_config = ConfigDict(frozen=True)

    version: int
    previous: int | None
    applied_versions: tuple[int, ...]
    payload_bytes: int
    fetch_seconds: float
    apply_seconds: float
    audited: bool = False
    unverified: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Step:
    """One version of a plan, fetched and decoded."""

    loaded: LoadedRecord
    table: dict[str, TensorState]
    changes: list[tuple[Entry, DecodedDelta]]
    base: bool  # a full snapshot: a base version, or the alternative base of a delta version


@dataclass(frozen=True)
class PreparedVersion:
    """A version fetched, verified and decoded for one reader's target, not yet applied.

    Made by :meth:`DeltaReader.prepare` without touching the target; applied by
    :meth:`DeltaReader.apply`, or simply dropped. ``version`` is the version it
    reaches, ``previous`` the resident version it was prepared against.
    """

    version: int
    previous: int | None
    plan: tuple[int, ...]
    payload_bytes: int
    fetch_seconds: float
    _reader: int = field(repr=False)  # id() of the reader that made it
    _resident: Resident | None = field(repr=False)
    _steps: tuple[_Step, ...] = field(repr=False, default=())
    _incremental: bool = field(repr=False, default=False)
    _parent_table: dict[str, TensorState] | None = field(repr=False, default=None)


@dataclass
class _Verified:
    """Lanes the reader verified when it committed its last version (FORMAT.md §11.3).

    Valid while the target still reports ``resident``: the reader then trusts them as
    the resident bits' lanes instead of reading every changed tensor again.
    """

    resident: Resident
    lanes: dict[str, tuple[int, ...]]  # as the target reads them (its part, for a TP rank)
    syncs: int = 0  # syncs since the last full audit
    audited: float = field(default_factory=time.monotonic)


class DeltaReader:
    """Keeps a target at a version of the chain in ``store``, bit-exact.

    ``select`` limits the reader to the canonical names it returns True for (a
    partial target, such as one writer rank's baseline). ``verify`` is
    ``"touched"`` (check fingerprints of tensors a sync changes, before and after)
    or ``"all"`` (read every selected tensor in full at every sync). With
    ``"touched"`` a long-lived reader checks the bits before a change against the
    lanes it verified when it committed the resident version, so a sync costs
    O(changed elements); it reads every selected resident tensor in full (an audit)
    at its first sync, every ``audit_every`` syncs, after ``audit_seconds``, and
    when asked (``sync(audit=True)``, :meth:`audit`). FORMAT.md §11.3 and the README
    say what each mode detects.

    ``decode_budget`` caps the bytes of inflated shards a sync holds at once (a
    :class:`~dcr_format.codec.budget.DecodeBudget`, shareable between readers; an int
    makes one of that many bytes; default a quarter of memory, at most 2 GiB).

    ``reader_id`` names the reader record (``readers/<reader_id>.json``) in which the
    reader tells writers the tensors its target can take only as ``overwrite`` (a
    module whose loader casts or scales them); without it such a record is named
    after its content.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        target: Target,
        *,
        select: Callable[[str], bool] | None = None,
        verify: Literal["touched", "all"] = "touched",
        max_workers: int = 8,
        max_shard_bytes: int = MAX_SHARD_DECODED_BYTES,
        group: Any = None,
        reader_id: str | None = None,
        audit_every: int | None = AUDIT_EVERY,
        audit_seconds: float | None = AUDIT_SECONDS,
        decode_budget: DecodeBudget | int | None = None,
    ) -> None:
        if verify not in ("touched", "all"):
            raise ArgumentError("verify must be 'touched' or 'all'")
        if reader_id is not None and not _READER_ID.match(reader_id):
            raise ArgumentError(f"reader_id {reader_id!r} must match {_READER_ID.pattern}")
        if audit_every is not None and audit_every < 1:
            raise ArgumentError("audit_every must be a positive number of syncs (or None)")
        if audit_seconds is not None and audit_seconds < 0:
            raise ArgumentError("audit_seconds must be zero or more (or None)")
        self.store = open_store(store)
        self.chain = Chain(self.store)
        self.target = target
        self.select = select or (lambda name: True)
        self.verify = verify
        self.max_workers = max_workers
        self.max_shard_bytes = max_shard_bytes
        self.audit_every = audit_every
        self.audit_seconds = audit_seconds
        # bytes of inflated shards held at once (share one DecodeBudget to cap many readers)
        self.decode_budget = (
            decode_budget
            if isinstance(decode_budget, DecodeBudget)
            else DecodeBudget(decode_budget)
        )
        # ranks sharing the target stage, verify and apply together (all or none)
        # a RelayStore (readers/relay.py) closes its epoch wherever the ranks agree
        epoch = getattr(self.store, "end_epoch", None)
        self.group = (
            ReaderGroup.solo(before_agreeing=epoch)
            if group is None
            else ReaderGroup(group, before_agreeing=epoch)
        )
        self._last_table: tuple[str, dict[str, TensorState]] | None = None  # (record sha, table)
        self._verified: _Verified | None = None
        self.reader_id = reader_id
        self._recorded: tuple[str, frozenset[str]] | None = None  # last reader record written

    def versions(self) -> list[int]:
        """Committed versions of the chain, ascending."""
        return self.chain.versions()

    # --- planning --------------------------------------------------------------------------

    def _plan(
        self, resident: Resident | None, goal: int, committed: list[int]
    ) -> tuple[list[int], int | None]:
        """The versions to apply; the second item is the first version when it starts from
        that version's alternative base (None otherwise)."""
        have = set(committed)
        if resident is not None and all(v in have for v in range(resident.version, goal + 1)):
            return list(range(resident.version + 1, goal + 1)), None
        # the newest base at or before the goal with every version after it committed: a
        # base version, or a delta version with an alternative base (FORMAT.md §14)
        alternatives = set(alternative_bases(self.store))
        version = goal
        while version in have:
            if version in alternatives:
                return list(range(version, goal + 1)), version
            if self.chain.record(version).record.kind == "base":
                return list(range(version, goal + 1)), None
            version -= 1
        raise VersionNotFoundError(
            f"no base at or before version {goal} is left in {self.store.url}; "
            "compact the chain or pick a newer version"
        )

    def sync(self, to: int | None = None, *, audit: bool = False) -> SyncResult:
        """Bring the target to version ``to`` (default: the newest committed version).

        :meth:`prepare` then :meth:`apply`: everything is fetched and verified before
        the target is touched; a failure during the apply rolls every change back. In
        a reader group every rank syncs to the same version, and all ranks apply it or
        none does. ``audit`` reads every selected resident tensor in full first.
        """
        for attempt in range(3 if self.group.alone else 1):
            try:
                return self.apply(self.prepare(to), audit=audit)
            except (StalePreparedError, TargetChangedError):
                # another sync moved the target between planning and applying: plan again
                if attempt == 2 or not self.group.alone:
                    raise
        raise AssertionError("unreachable")

    def prepare(self, to: int | None = None) -> PreparedVersion:
        """Fetch, verify and decode everything for version ``to`` (default: the newest)
        without touching the target; :meth:`apply` then makes the change (the pause).

        A rollout engine keeps generating while this runs. A prepared version that is not
        applied is simply dropped. In a reader group every rank prepares together.
        """
        committed = self.chain.versions()
        latest = committed[-1] if committed else -1
        goal = self.group.min(latest if to is None else to)
        started = time.perf_counter()
        with self.group.stage("fetching and verifying"):
            prepared = self._prepare(goal, committed, started)
            self._record_overwrites()  # what the target learnt while staging (FORMAT.md §3.6)
        return prepared

    def apply(self, prepared: PreparedVersion, *, audit: bool = False) -> SyncResult:
        """Apply a version made by :meth:`prepare`: check the target, change it, verify.

        Raises :class:`StalePreparedError` (nothing changed) when the target no longer
        holds the version it was prepared against. ``audit`` as in :meth:`sync`.
        """
        if prepared._reader != id(self):
            raise StalePreparedError(
                "this version was prepared by another DeltaReader; prepare it with this one"
            )
        if not prepared._steps:  # already there; still take part in the group's stages
            with self.group.stage("checking its target"):
                self._check_fresh(prepared)
            with self.group.stage("applying"):
                pass
            return SyncResult(
                version=prepared.version,
                previous=prepared.previous,
                applied_versions=(),
                payload_bytes=0,
                fetch_seconds=prepared.fetch_seconds,
                apply_seconds=0.0,
            )
        started = time.perf_counter()
        unverified, audited = self._apply(prepared, audit)
        return SyncResult(
            version=prepared.version,
            previous=prepared.previous,
            applied_versions=prepared.plan,
            payload_bytes=prepared.payload_bytes,
            fetch_seconds=prepared.fetch_seconds,
            apply_seconds=time.perf_counter() - started,
            audited=audited,
            unverified=tuple(sorted(unverified)),
        )

    def audit(self) -> tuple[str, ...]:
        """Read every selected resident tensor in full and check it against the resident
        version's fingerprints, without changing anything; refreshes the lanes later syncs
        rely on. Raises :class:`BaselineMismatchError` naming the first tensor changed
        outside dcr. Returns the names the target cannot read back (unverified).
        """
        resident = self._resident()
        if resident is None:
            raise VersionNotFoundError("the target holds no version yet; sync it first")
        loaded = self._resident_record(resident)
        table = self._table_of(loaded)
        txn = self._begin()
        try:
            with self.group.stage("auditing its target"):
                names = sorted(
                    n
                    for n, row in table.items()
                    if self._wants(n, row.dtype, row.shape) and n in txn.names()
                )
                raw, unverified = self._read_and_check(txn, names, table, resident.version)
        finally:
            txn.abort()
        self._verified = _Verified(resident, raw)
        return tuple(sorted(unverified))

    def prewarm(self, version: int | None = None) -> frozenset[str]:
        """Learn how the target takes every tensor of ``version`` (default: the newest)
        without changing it, and record the names it needs as ``overwrite``.

        Run it before the trainer publishes its first delta, so that writers send
        ``overwrite`` for those names from the start. Returns the names.
        """
        committed = self.chain.versions()
        if not committed:
            raise VersionNotFoundError(f"{self.store.url} has no committed version yet")
        loaded = self.chain.record(committed[-1] if version is None else version)
        for name, row in state_table(self.chain.manifests(loaded)).items():
            self._wants(name, row.dtype, row.shape)
        self._record_overwrites()
        return self.target.overwrite_names()

    def _wants(self, name: str, dtype: str, shape: tuple[int, ...]) -> bool:
        """Selected, and a tensor the target takes at all (not another rank's shard)."""
        return self.select(name) and self.target.accepts(
            name, info_for(dtype).torch_dtype, tuple(shape)
        )

    def _record_overwrites(self) -> None:
        """Tell writers which tensors the target needs as ``overwrite`` (``readers/<id>.json``).

        Written when the set changes (an explicit ``reader_id`` also records an empty
        set once, so a stale list is cleared); without a ``reader_id`` the record is named
        after its content, so readers that need the same names share one record.
        """
        names = self.target.overwrite_names()
        if self.reader_id is None and not names:
            return
        reader_id = self.reader_id or "auto-" + sha256_hex("\n".join(sorted(names)).encode())[:16]
        if self._recorded == (reader_id, names):
            return
        record = ReaderRecord(
            reader_id=reader_id, updated=timestamp(utc_now()), overwrite=tuple(sorted(names))
        )
        try:
            self.store.put(f"readers/{reader_id}.json", record.to_json())
        except StoreError as exc:  # a read-only reader: writers then cannot be told
            _log.warning("could not write reader record readers/%s.json: %s", reader_id, exc)
            return
        self._recorded = (reader_id, names)

    def _resident(self) -> Resident | None:
        """The target's resident version; any failure to read it is a :class:`TargetError`."""
        try:
            return self.target.resident()
        except DcrError:
            raise
        except Exception as exc:
            raise TargetError(
                f"could not read the target's resident version ({exc}); "
                "repair or remove the target and pull again"
            ) from exc

    def _begin(self) -> Transaction:
        """Open a transaction; any failure to open it is a :class:`TargetError`."""
        try:
            return self.target.begin()
        except DcrError:
            raise
        except Exception as exc:
            raise TargetError(
                f"could not open the target ({exc}); repair or remove the target and pull again"
            ) from exc

    def _resident_record(self, resident: Resident) -> LoadedRecord:
        """The resident version's commit record, checked against the one the target applied."""
        loaded = self.chain.record(resident.version)
        if resident.record_sha256 is not None and resident.record_sha256 != loaded.sha256:
            raise ChainBrokenError(
                f"the commit record of version {resident.version} is not the one the target "
                "applied (was it rewritten by a second writer?); run `dcr verify` on the "
                "store and pull into a fresh target"
            )
        return loaded

    def _table_of(self, loaded: LoadedRecord) -> dict[str, TensorState]:
        if self._last_table is not None and self._last_table[0] == loaded.sha256:
            return self._last_table[1]
        return state_table(self.chain.manifests(loaded))

    def _prepare(self, goal: int, committed: list[int], started: float) -> PreparedVersion:
        """Plan and fetch everything for ``goal`` (nothing when the target is already there)."""
        header = self.chain.header
        resident = self._resident()
        if resident is not None and resident.chain_id != header.chain_id:
            raise TargetError(
                f"the target holds chain {resident.chain_id}, the store {header.chain_id}; "
                "use a fresh target for this store"
            )
        if not committed:
            raise VersionNotFoundError(f"{self.store.url} has no committed version yet")
        if goal not in committed:
            raise VersionNotFoundError(f"version {goal} is not committed in {self.store.url}")
        previous = resident.version if resident is not None else None
        if previous == goal:
            return PreparedVersion(goal, previous, (), 0, 0.0, id(self), resident)
        if previous is not None and previous > goal:
            raise TargetError(
                f"the target is at version {previous}, newer than {goal}; "
                "replay older versions into a fresh target"
            )
        plan, alternative = self._plan(resident, goal, committed)
        # incremental: the plan continues from the resident version (else it starts at a base)
        incremental = (
            resident is not None
            and plan[0] == resident.version + 1
            and resident.version in set(committed)
        )
        steps, payload, parent_table = self._fetch(
            plan, resident if incremental else None, alternative
        )
        return PreparedVersion(
            goal,
            previous,
            tuple(plan),
            payload,
            time.perf_counter() - started,
            id(self),
            resident,
            tuple(steps),
            incremental,
            parent_table,
        )

    # --- fetch and stage ---------------------------------------------------------------------

    def _fetch(
        self, plan: list[int], resident: Resident | None, alternative: int | None = None
    ) -> tuple[list[_Step], int, dict[str, TensorState] | None]:
        """Fetch, validate and decode every version of the plan; the third item is the
        resident version's table (incremental plans), which audits check against."""
        parent: LoadedRecord | None = None
        parent_table: dict[str, TensorState] | None = None
        if resident is not None and plan[0] == resident.version + 1:
            parent = self._resident_record(resident)
            parent_table = self._table_of(parent)
        resident_table = parent_table
        steps: list[_Step] = []
        payload = 0
        with ThreadPoolExecutor(self.max_workers) as pool:
            for version in plan:
                loaded = self.chain.record(version)
                if parent is not None:
                    self.chain.check_link(parent, loaded)
                if version == alternative:  # validated like a commit base (FORMAT.md §14)
                    snapshot = load_base(self.chain, loaded, map_fn=pool.map)
                    manifests, table = snapshot.manifests, snapshot.table
                    payload += sum(ref.size for ref in snapshot.record.manifests)
                else:
                    manifests = list(
                        pool.map(
                            lambda ref, ld=loaded: self.chain.manifest(ld, ref),
                            sorted(loaded.record.manifests, key=lambda r: r.rank),
                        )
                    )
                    table = state_table(manifests)
                    if table_fingerprint(table) != loaded.record.state_fingerprint:
                        raise ChainBrokenError(
                            f"the manifests of version {version} do not add up to its state "
                            "fingerprint; "
                            "the store is corrupt: run `dcr verify`"
                        )
                    if loaded.record.kind == "delta" and parent_table is not None:
                        _check_continuity(parent_table, manifests, version)
                    payload += sum(ref.size for ref in loaded.record.manifests)
                changes, nbytes = self._decode_version(manifests, pool)
                payload += nbytes
                is_base = version == alternative or loaded.record.kind == "base"
                steps.append(_Step(loaded, table, changes, is_base))
                parent, parent_table = loaded, table
        return steps, payload, resident_table

    def _decode_version(
        self, manifests: list[Manifest], pool: ThreadPoolExecutor
    ) -> tuple[list[tuple[Entry, DecodedDelta]], int]:
        """Fetch, verify and decode the shards of one version in parallel.

        A job is a set of shards that entries link (an entry's positions and values may
        sit in two shards, FORMAT.md §4.3; writers put both in one): a worker checks each
        shard's declared size against what its entries can need, fetches and verifies it,
        inflates it within the reader's decode budget, decodes the job's entries and drops
        the shards, so only decoded deltas outlive the job.
        """
        wanted: list[tuple[Manifest, Entry]] = [
            (m, e) for m in manifests for e in m.entries if self._wants(e.name, e.dtype, e.shape)
        ]
        # (rank, first shard) -> (indices into ``wanted`` of the job's entries, its shards)
        jobs = {
            (rank, min(members)): (indices, members)
            for rank, group in _linked_shards(wanted).items()
            for indices, members in group
        }
        ranks = {m.rank: m for m in manifests}
        limits = {m.rank: stream_limits(m) for m in manifests}

        def load(key: tuple[int, int]) -> tuple[dict[int, DecodedDelta], int]:
            rank = key[0]
            manifest = ranks[rank]
            entries, shards = jobs[key]
            indices = sorted(shards)
            refs = [manifest.shards[i] for i in indices]
            for index, ref in zip(indices, refs, strict=True):
                if ref.decoded_size > self.max_shard_bytes:
                    raise ShardError(
                        f"{ref.path} declares {ref.decoded_size} decoded bytes, over the "
                        f"{self.max_shard_bytes} limit; the manifest is hostile or raise the limit"
                    )
                bound = shard_decoded_bound(limits[rank].get(index, {}))
                if ref.decoded_size > bound:  # before fetching it
                    raise ShardError(
                        f"{ref.path} declares {ref.decoded_size} decoded bytes but its entries "
                        f"need at most {bound}; the manifest is corrupt or hostile"
                    )
            with self.decode_budget.hold(sum(ref.decoded_size for ref in refs)):
                streams: dict[tuple[int, int], dict[str, memoryview]] = {}
                for index, ref in zip(indices, refs, strict=True):
                    stored = get_verified(self.store, ref.path, size=ref.size, sha256=ref.sha256)
                    streams[(rank, index)] = decode_shard(
                        stored, decoded_size=ref.decoded_size, limits=limits[rank].get(index, {})
                    )
                    del stored
                decoded = {i: _decode_entry(wanted[i][1], manifest, streams) for i in entries}
                del streams  # decoded deltas are copies: the shards go before the budget
            return decoded, sum(ref.size for ref in refs)

        decoded: dict[int, DecodedDelta] = {}
        nbytes = 0
        for part, size in pool.map(load, sorted(jobs)):
            decoded.update(part)
            nbytes += size
        changes = [
            (entry, decoded[i] if i in decoded else _decode_entry(entry, manifest, {}))
            for i, (manifest, entry) in enumerate(wanted)
        ]
        return _merge_pieces(changes, manifests), nbytes

    # --- verify and apply ---------------------------------------------------------------------

    def _audit_due(self, resident: Resident | None, asked: bool) -> bool:
        """Whether this sync reads the resident bits in full instead of trusting the lanes
        verified at the previous sync (FORMAT.md §11.3)."""
        known = self._verified
        if asked or self.verify == "all" or known is None:
            return True
        if _version_of(known.resident) != _version_of(resident):
            return True
        if self.audit_every is not None and known.syncs + 1 >= self.audit_every:
            return True
        return (
            self.audit_seconds is not None
            and time.monotonic() - known.audited >= self.audit_seconds
        )

    def _check_fresh(self, prepared: PreparedVersion) -> Resident | None:
        """The target still holds what ``prepared`` was planned from (else nothing changes)."""
        resident = self._resident()
        if _version_of(resident) != _version_of(prepared._resident):
            raise StalePreparedError(
                f"the target moved from version {prepared.previous} to "
                f"{_version_of(resident)[1]} since version {prepared.version} was prepared; "
                "prepare it again"
            )
        return resident

    def _apply(self, prepared: PreparedVersion, asked: bool) -> tuple[set[str], bool]:
        """Apply the staged steps; returns the names the target could not verify, and
        whether the sync audited the resident bits."""
        steps = list(prepared._steps)
        incremental = prepared._incremental
        txn: Transaction | None = None
        undo: list[Callable[[], None]] = []
        trusted: set[str] = set()  # names whose resident lanes came from the last sync
        known: _Verified | None = None
        try:
            # inside the stage: a target this rank cannot open fails every rank's sync
            with self.group.stage("checking its target"):
                audited = self._audit_due(self._check_fresh(prepared), asked)
                known = None if audited else self._verified
                self._verified = None  # dropped on any failure; set again only on commit
                txn = self._begin()
                lanes, unverified, trusted = self._check_baseline(
                    steps, txn, incremental, prepared._parent_table if audited else None, known
                )
                txn.prepare(
                    [
                        Change(e.name, info_for(e.dtype).torch_dtype, tuple(e.shape), d)
                        for step in steps
                        for e, d in step.changes
                    ]
                )
            touched = set(lanes)  # the names deltas change (their lanes follow the change)
            with self.group.stage("applying"):
                for step in steps:
                    if step.base or not incremental:
                        for name in txn.names():
                            if self.select(name) and name not in step.table:
                                txn.drop(name)
                    for entry, delta in step.changes:
                        if entry.op != FULL and entry.changed == 0:
                            continue
                        info = info_for(entry.dtype)
                        applied = txn.apply(
                            Change(entry.name, info.torch_dtype, tuple(entry.shape), delta)
                        )
                        undo.append(applied.undo)
                        if entry.op == FULL:
                            lanes[entry.name] = applied.lanes
                            if entry.changed == 0:
                                continue
                        else:
                            # the fingerprint follows the change (O(changed)), from the bits
                            # read back from the target
                            lanes[entry.name] = _lanes_after(lanes.get(entry.name), applied)
                        touched.add(entry.name)
                found = self._verify_goal(steps, txn, lanes, touched, unverified)
            last = steps[-1].loaded
            final = steps[-1].table
            txn.commit(Resident(last.record.chain_id, last.record.version, last.sha256))
        except BaseException as exc:
            if txn is None:  # nothing was opened, so nothing to undo
                raise
            for undo_change in reversed(undo):
                undo_change()
            if isinstance(exc, FingerprintMismatchError) and trusted:
                exc = self._diagnose(exc, txn, trusted, prepared)
            txn.abort()
            if isinstance(exc, (IntegrityError, TargetError, GroupAbortError)):
                raise exc
            if isinstance(exc, Exception):
                raise ApplyError(f"applying failed and was rolled back: {exc}") from exc
            raise
        self._last_table = (last.sha256, final)
        self._remember(prepared, final, found, touched, known)
        return unverified, audited

    def _verify_goal(
        self,
        steps: list[_Step],
        txn: Transaction,
        lanes: dict[str, tuple[int, ...] | None],
        touched: set[str],
        unverified: set[str],
    ) -> dict[str, tuple[int, ...]]:
        """Check the goal's fingerprints (§11.4 step 3); returns the lanes it verified, as
        the target reads them."""
        final = steps[-1].table
        version = steps[-1].loaded.record.version
        # tensors a later base removed are gone, not checked
        selected = {n for n, row in final.items() if self._wants(n, row.dtype, row.shape)}
        check = selected if self.verify == "all" else touched & selected
        mismatch = "after applying; the target was rolled back: run `dcr verify` on the store"
        found: dict[str, tuple[int, ...]] = {}
        for name in sorted(check):
            row = final[name]
            if txn.spec(name) != (info_for(row.dtype).torch_dtype, row.shape):
                raise FingerprintMismatchError(
                    f"tensor {name!r} does not match version {version} {mismatch}"
                )
            raw = txn.lanes(name) if self.verify == "all" else lanes.get(name)
            if raw is None:
                unverified.add(name)  # the target cannot read it back (FORMAT.md §8.4)
            else:
                found[name] = raw
        bad, incomplete = _mismatches(txn, found, lambda n: _expected(final[n]))
        if bad:
            raise FingerprintMismatchError(
                f"tensor {bad[0]!r} does not match version {version} {mismatch}"
            )
        unverified |= incomplete
        for name in incomplete:
            del found[name]
        extra = sorted(n for n in txn.names() if self.select(n) and n not in final)
        if extra:  # FORMAT.md 11.4.3: the target holds exactly the goal's selected names
            raise TargetError(
                f"the target holds {len(extra)} tensors that version {version} lacks "
                f"(first: {extra[0]!r}); remove them, pass select= to leave them alone, or "
                "pull into a fresh target"
            )
        return found

    def _remember(
        self,
        prepared: PreparedVersion,
        final: dict[str, TensorState],
        found: dict[str, tuple[int, ...]],
        touched: set[str],
        known: _Verified | None,
    ) -> None:
        """After a commit: the lanes the next sync may trust (FORMAT.md §11.3)."""
        last = prepared._steps[-1].loaded
        resident = Resident(last.record.chain_id, last.record.version, last.sha256)
        if known is not None and prepared._incremental:
            lanes = {n: v for n, v in known.lanes.items() if n in final and n not in touched}
            self._verified = _Verified(resident, {**lanes, **found}, known.syncs + 1, known.audited)
        else:  # an audit, or a plan from a base: everything held was read or written in full
            self._verified = _Verified(resident, dict(found))

    def _diagnose(
        self,
        exc: FingerprintMismatchError,
        txn: Transaction,
        trusted: set[str],
        prepared: PreparedVersion,
    ) -> IntegrityError:
        """A mismatch after applying onto trusted lanes: was the target edited outside dcr?

        The target is rolled back already; a solo reader reads the trusted tensors in full
        and blames the target when they differ from the resident version.
        """
        table = prepared._parent_table
        if not self.group.alone or table is None:
            return FingerprintMismatchError(
                f"{exc} (or the target was changed outside dcr since the last sync: "
                "sync(audit=True) tells which)"
            )
        raw: dict[str, tuple[int, ...]] = {}
        for name in sorted(trusted):
            value = txn.lanes(name)
            if value is not None:
                raw[name] = value
        bad, _ = _mismatches(txn, raw, lambda n: _expected(table[n]) if n in table else None)
        if bad:
            return BaselineMismatchError(
                f"tensor {bad[0]!r} in the target is not the bits of version "
                f"{prepared.previous}; it was changed outside dcr since the last sync "
                "(nothing was applied): pull into a fresh target"
            )
        return exc

    def _read_and_check(
        self,
        txn: Transaction,
        names: list[str],
        table: dict[str, TensorState],
        version: int,
    ) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """Read ``names`` in full and check them against ``table`` (the resident version's
        fingerprints); returns the lanes as the target read them and the unreadable names."""
        raw: dict[str, tuple[int, ...]] = {}
        unverified: set[str] = set()
        for name in names:
            row = table[name]
            if txn.spec(name) != (info_for(row.dtype).torch_dtype, tuple(row.shape)):
                raise BaselineMismatchError(
                    f"the target lacks tensor {name!r} as {row.dtype}{list(row.shape)}; "
                    "pull into a fresh target"
                )
            value = txn.lanes(name)
            if value is None:
                unverified.add(name)
            else:
                raw[name] = value
        bad, incomplete = _mismatches(txn, raw, lambda n: _expected(table[n]))
        if bad:
            raise BaselineMismatchError(
                f"tensor {bad[0]!r} in the target is not the bits of version {version}; "
                "it was changed outside dcr: pull into a fresh target"
            )
        unverified |= incomplete
        for name in incomplete:
            del raw[name]
        return raw, unverified

    def _check_baseline(
        self,
        steps: list[_Step],
        txn: Transaction,
        incremental: bool,
        audit_table: dict[str, TensorState] | None,
        known: _Verified | None,
    ) -> tuple[dict[str, tuple[int, ...] | None], set[str], set[str]]:
        """Before mutating: every delta lands on exactly the bits it was made against.

        Returns the fingerprint lanes of every resident tensor a delta changes, as the
        target read them (None where it cannot), the names it could not check, and the
        names whose lanes it took from the previous sync (``known``) instead of reading.
        ``audit_table`` (the resident version's table): also read and check every other
        selected tensor the target holds.
        """
        first_seen: dict[str, Entry] = {}
        changing = _changing(steps)
        for step in steps:
            for entry, _ in step.changes:
                first_seen.setdefault(entry.name, entry)
        raw: dict[str, tuple[int, ...]] = {}
        unverified: set[str] = set()
        trusted: set[str] = set()
        for name, entry in first_seen.items():
            if entry.op == FULL:
                continue
            info = info_for(entry.dtype)
            if txn.spec(name) != (info.torch_dtype, tuple(entry.shape)):
                raise BaselineMismatchError(
                    f"the target lacks tensor {name!r} as {entry.dtype}{list(entry.shape)}; "
                    "pull into a fresh target"
                )
            if name not in changing and self.verify != "all":
                continue
            cached = None if known is None else known.lanes.get(name)
            if cached is not None:
                raw[name] = cached
                trusted.add(name)
                continue
            resident = txn.lanes(name)
            if resident is None:
                unverified.add(name)
            else:
                raw[name] = resident
        bad, incomplete = _mismatches(
            txn,
            raw,
            lambda n: (first_seen[n].dtype, first_seen[n].shape, first_seen[n].parent_fingerprint),
        )
        if bad:
            raise BaselineMismatchError(
                f"tensor {bad[0]!r} in the target is not the bits of version "
                f"{steps[0].loaded.record.version - 1}; it was changed outside dcr: "
                "pull into a fresh target"
            )
        unverified |= incomplete
        if audit_table is not None and incremental:
            held = txn.names()
            rest = sorted(
                n
                for n, row in audit_table.items()
                if n not in first_seen and n in held and self._wants(n, row.dtype, row.shape)
            )
            self._read_and_check(txn, rest, audit_table, steps[0].loaded.record.version - 1)
        checked: dict[str, tuple[int, ...] | None] = {n: raw.get(n) for n in changing}
        return checked, unverified, trusted & changing


def _linked_shards(
    wanted: list[tuple[Manifest, Entry]],
) -> dict[int, list[tuple[list[int], set[int]]]]:
    """Per writer rank: groups of shards that the changed entries link (an entry's two
    streams in two shards join them), each with the indices (into ``wanted``) of its
    entries."""
    out: dict[int, list[tuple[list[int], set[int]]]] = {}
    by_rank: dict[int, list[tuple[int, set[int]]]] = {}
    for index, (manifest, entry) in enumerate(wanted):
        if entry.changed == 0:
            continue
        shards = {ref.shard for ref in (entry.positions, entry.values) if ref is not None}
        if shards:
            by_rank.setdefault(manifest.rank, []).append((index, shards))
    for rank, items in by_rank.items():
        groups: list[tuple[list[int], set[int]]] = []
        for index, shards in items:
            joined = [g for g in groups if g[1] & shards]
            merged: tuple[list[int], set[int]] = ([index], set(shards))
            for group in joined:
                groups.remove(group)
                merged[0].extend(group[0])
                merged[1].update(group[1])
            groups.append(merged)
        out[rank] = [(sorted(indices), members) for indices, members in groups]
    return out


def _expected(row: TensorState) -> tuple[str, tuple[int, ...], str | None]:
    return row.dtype, row.shape, row.fingerprint


def _mismatches(
    txn: Transaction,
    raw: dict[str, tuple[int, ...]],
    expected: Callable[[str], tuple[str, tuple[int, ...], str | None] | None],
) -> tuple[list[str], set[str]]:
    """Complete the lanes the target read (a rank's part summed with its peers') and
    compare each tensor's fingerprint with ``expected(name)`` (dtype, shape, fingerprint;
    None: nothing to compare). Returns the mismatching names, sorted, and the names whose
    lanes could not be completed (unverified)."""
    complete = txn.complete_lanes(raw)
    bad: list[str] = []
    incomplete: set[str] = set()
    for name in sorted(raw):
        whole = complete.get(name)
        want = expected(name)
        if whole is None:
            incomplete.add(name)
        elif want is not None:
            dtype, shape, fingerprint = want
            found = fingerprint_from_lanes(info_for(dtype).torch_dtype, tuple(shape), whole)
            if found != fingerprint:
                bad.append(name)
    return bad, incomplete


def _lanes_after(before: tuple[int, ...] | None, applied: Applied) -> tuple[int, ...] | None:
    """A tensor's lanes after a change, from its lanes before and what the apply read back
    (None when either is unknown: the tensor is then unverified)."""
    if before is None or applied.positions is None:
        return None
    if applied.lane_deltas is not None:
        return apply_lane_deltas(before, applied.lane_deltas)
    assert applied.before is not None and applied.after is not None
    return lanes_after_change(before, applied.positions, applied.before, applied.after)


def _changing(steps: list[_Step]) -> set[str]:
    """Names a delta changes before any full write of them in the plan: those deltas land
    on the resident bits (not only when the first step that lists the tensor does)."""
    changing: set[str] = set()
    rewritten: set[str] = set()
    for step in steps:
        for entry, _ in step.changes:
            if entry.op == FULL:
                rewritten.add(entry.name)
            elif entry.changed > 0 and entry.name not in rewritten:
                changing.add(entry.name)
    return changing


def _version_of(resident: Resident | None) -> tuple[str | None, int | None]:
    return (None, None) if resident is None else (resident.chain_id, resident.version)


def _merge_pieces(
    changes: list[tuple[Entry, DecodedDelta]], manifests: list[Manifest]
) -> list[tuple[Entry, DecodedDelta]]:
    """The pieces of one tensor (FORMAT.md §4.8) as whole-tensor changes, one per op.

    Full pieces must partition the tensor; the positions of changed pieces must not
    overlap (their unchanged parts are checked by the fingerprints, whose lanes add up).
    """
    if not any(entry.piece is not None for entry, _ in changes):
        return changes
    combined = tensor_changes(manifests)
    out: list[tuple[Entry, DecodedDelta] | str] = []
    pieces: dict[str, list[tuple[Entry, DecodedDelta]]] = {}
    for entry, delta in changes:
        if entry.piece is None:
            out.append((entry, delta))
        else:
            if entry.name not in pieces:
                out.append(entry.name)  # keeps the order of first appearance
            pieces.setdefault(entry.name, []).append((entry, delta))
    merged: list[tuple[Entry, DecodedDelta]] = []
    for item in out:
        if not isinstance(item, str):
            merged.append(item)
            continue
        change = combined[item]
        parts = pieces[item]
        numel = 1
        for dim in change.shape:
            numel *= dim
        info = info_for(change.dtype)
        positions = torch.cat([d.positions for _, d in parts if d.positions is not None])
        values = torch.cat([d.values for _, d in parts])
        order = torch.argsort(positions)
        positions, values = positions[order], values[order]
        if change.full:
            if positions.numel() != numel or not torch.equal(
                positions, torch.arange(numel, dtype=positions.dtype)
            ):
                raise SchemaError(f"the full pieces of tensor {item!r} do not cover it exactly")
            entry = Entry(
                name=item,
                dtype=change.dtype,
                shape=change.shape,
                op=FULL,
                changed=numel,
                fingerprint=change.fingerprint,
            )
            merged.append((entry, DecodedDelta(FULL, None, values.to(info.bits_dtype))))
            continue
        if positions.numel() > 1 and bool((positions[1:] == positions[:-1]).any()):
            raise SchemaError(f"pieces of tensor {item!r} change the same element twice")
        ops = sorted({e.op for e, d in parts if e.changed > 0}) or [XOR]
        for op in ops:
            mine = torch.cat(
                [d.positions for e, d in parts if e.op == op and d.positions is not None]
                or [torch.empty(0, dtype=torch.int64)]
            )
            keep = torch.isin(positions, mine)
            entry = Entry(
                name=item,
                dtype=change.dtype,
                shape=change.shape,
                op=op,
                changed=int(keep.sum()),
                fingerprint=change.fingerprint,
                parent_fingerprint=change.parent_fingerprint,
            )
            merged.append((entry, DecodedDelta(op, positions[keep], values[keep])))
    return merged


def _check_continuity(
    parent: dict[str, TensorState], manifests: list[Manifest], version: int
) -> None:
    """A delta keeps every tensor of its parent and starts each change from the parent's bits
    (pieces combined: their summed lanes give the parent fingerprint, FORMAT.md §4.8)."""
    listed = tensor_changes(manifests)
    missing = sorted(set(parent) - set(listed))
    if missing:
        raise ChainBrokenError(
            f"delta version {version} drops tensor {missing[0]!r} of its parent; "
            "the store is corrupt: run `dcr verify`"
        )
    for name, entry in listed.items():
        if entry.full:
            continue
        row = parent.get(name)
        if (
            row is None
            or row.dtype != entry.dtype
            or row.shape != tuple(entry.shape)
            or row.fingerprint != entry.parent_fingerprint
        ):
            raise ChainBrokenError(
                f"version {version} changes tensor {name!r} from bits its parent does not "
                "hold; the store is corrupt: run `dcr verify`"
            )


def _decode_entry(
    entry: Entry, manifest: Manifest, streams: dict[tuple[int, int], dict[str, memoryview]]
) -> DecodedDelta:
    info = info_for(entry.dtype)
    numel = 1
    for dim in entry.shape:
        numel *= dim

    def stream(ref) -> tuple[str, memoryview] | None:  # type: ignore[no-untyped-def]
        if ref is None:
            return None
        shard = streams.get((manifest.rank, ref.shard))
        if shard is None or ref.key not in shard:
            raise ShardError(
                f"stream {ref.key!r} of tensor {entry.name!r} is missing from its shard"
            )
        return ref.coding, shard[ref.key]

    return decode_delta(
        OVERWRITE if entry.op == FULL and entry.piece is not None else entry.op,  # a region
        info,
        numel,
        entry.changed,
        positions=stream(entry.positions),
        values=stream(entry.values),
    )
