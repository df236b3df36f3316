"""The rollout side: plan, fetch, verify, stage, and only then apply.

A sync has three parts: a plan from metadata only (readers/_plan.py: the versions, the
objects with their sizes and sha256, each target tensor's change, the checks), the fetch
(readers/_fetch.py: parallel verified gets, inflated and decoded within a budget), and the
apply here, through the target's transaction, which keeps the undo of every change until
it commits or rolls back (readers/targets.py). A reader on its own overlaps the last two
once every object is verified (:meth:`DeltaReader._resolver`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from dcr_format.chain.bases import alternative_bases, load_base, read_base_record
from dcr_format.chain.chain import (
    Chain,
    LoadedRecord,
    TensorState,
    get_verified,
    sha256_hex,
    state_table,
    timestamp,
    utc_now,
)
from dcr_format.delta.delta import FULL, XOR, DecodedDelta, resolve, rows_after, stage_change
from dcr_format.delta.fingerprint import (
    apply_lane_deltas,
    fingerprint_from_lanes,
    lanes_after_change,
)
from dcr_format.errors import (
    ApplyError,
    ArgumentError,
    BaselineMismatchError,
    ChainBrokenError,
    DcrError,
    FingerprintMismatchError,
    GroupAbortError,
    IntegrityError,
    StalePreparedError,
    StoreError,
    TargetBusyError,
    TargetChangedError,
    TargetError,
    VersionNotFoundError,
)
from dcr_format.format.budget import DecodeBudget
from dcr_format.format.dtypes import info_for
from dcr_format.format.schema import Entry, Manifest, ReaderRecord
from dcr_format.kernels.native import compiled, serial_kernels
from dcr_format.store.store import Store, open_store
from dcr_format.sync._fetch import (
    Early,
    FetchedStep,
    fetch_changes,
    fetch_step,
)
from dcr_format.sync._fetch import _decode_entry as _decode_entry  # tools/_diff.py
from dcr_format.sync._plan import (
    StepPlan,
    SyncPlan,
    check_version,
    choose_versions,
    plan_checks,
    plan_fetch,
    plan_step,
)
from dcr_format.sync._plan import _check_continuity as _check_continuity  # tools/_verify.py
from dcr_format.sync.group import ReaderGroup
from dcr_format.system.pools import kept_pool
from dcr_format.targets.targets import (
    Applied,
    Change,
    Resident,
    Staged,
    Target,
    Transaction,
    claim_target,
)

MAX_SHARD_DECODED_BYTES = 16 << 30  # refuse to inflate a single shard past this
AUDIT_EVERY = 100  # syncs between full audits of the resident bits (FORMAT.md §11.3)
AUDIT_SECONDS = 3600.0  # and at least this often
_READER_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_log = logging.getLogger(__name__)


class SyncResult(BaseModel):
    """What one :meth:`DeltaReader.sync` (or :meth:`DeltaReader.apply`) did.

    ``fetch_seconds`` is the preparation (fetch, verify, decode: the engine may keep
    generating meanwhile), ``apply_seconds`` the pause (checking and changing the target).
    A :meth:`DeltaReader.sync` on its own (no group) starts changing the target once every
    object is fetched and verified, while the last changes are still decoded, and applies a
    base or a plan of several versions as it fetches them: that time counts in
    ``fetch_seconds``.
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
    _steps: tuple[FetchedStep, ...] = field(repr=False, default=())
    _sync_plan: SyncPlan | None = field(repr=False, default=None)
    # changes of a one-step plan read against the live tensors (Target.staging), by name
    _staged: Mapping[str, Staged] = field(repr=False, default_factory=dict)
    # a sync's apply, opened while the fetch still decoded (DeltaReader._resolver): its
    # changes so far are applied, and DeltaReader.apply goes on with it
    _open: _Sync | None = field(repr=False, default=None)
    # the goal's checkpoint files for a target that keeps them (None: it keeps none)
    _files: _Files | None = field(repr=False, default=None)
    # made by a sync, which applies it once: each change's decoded bits are dropped as soon
    # as it is applied (the steps then no longer hold the version: not applied again)
    _spend: bool = field(repr=False, default=False)

    @property
    def _incremental(self) -> bool:
        return self._sync_plan is not None and self._sync_plan.incremental

    @property
    def _parent_table(self) -> dict[str, TensorState] | None:
        return None if self._sync_plan is None else self._sync_plan.parent_table


@dataclass(frozen=True)
class _Files:
    """A version's checkpoint files (FORMAT.md §3.5.6) for a target that keeps them: every
    file's sha256 by name, and the verified bytes of those the target does not hold."""

    listed: Mapping[str, str]
    fetched: Mapping[str, bytes]


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


@dataclass
class _Early:
    """A sync's taking of its changes as they are decoded (:meth:`DeltaReader._resolver`).

    ``alone``, a reader on its own, opens the transaction once everything is verified and
    from then on applies each change on the process's apply pool (:meth:`start`,
    :meth:`give`, :meth:`finish`; it waits for its own changes only, so readers may share
    the pool); the first failure there stops the rest and is raised."""

    alone: bool
    audit: bool  # the sync was asked to audit
    # changes decoded before the transaction opened, to apply as it opens
    ready: list[tuple[Entry, DecodedDelta]] = field(default_factory=list)
    sync: _Sync | None = None  # the transaction's apply, once open
    threads: int = 1  # the pool's
    _apply: Callable[[Entry, DecodedDelta], None] | None = None
    _applying: ThreadPoolExecutor | None = None
    _given: list[Future[None]] = field(default_factory=list)
    _failed: list[BaseException] = field(default_factory=list)

    def start(self, sync: _Sync, apply: Callable[[Entry, DecodedDelta], None]) -> None:
        """The transaction is open: apply the changes held so far, and each one given (on
        a pool kept for the process: its threads keep their memory from sync to sync)."""
        self.sync, self._apply = sync, apply
        self._applying = kept_pool("dcr-apply", self.threads)
        ready, self.ready = self.ready, []
        for entry, delta in ready:
            self.give(entry, delta)

    def give(self, entry: Entry, delta: DecodedDelta) -> None:
        """Apply one change on the pool once the transaction is open (else hold it); raises
        an earlier change's failure instead."""
        if self._failed:
            raise self._failed[0]
        if self._applying is None:
            self.ready.append((entry, delta))
        else:
            self._given.append(self._applying.submit(self._run, entry, delta))

    def _run(self, entry: Entry, delta: DecodedDelta) -> None:
        if self._failed:
            return  # the sync fails: the rest is not applied
        assert self._apply is not None
        try:
            # several of the pool's threads fill the cores already
            with serial_kernels() if self.threads > 1 else contextlib.nullcontext():
                self._apply(entry, delta)
        except BaseException as exc:
            self._failed.append(exc)

    def failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the failure of a change given (not of the fetch)."""
        return bool(self._failed) and exc is self._failed[0]

    def finish(self) -> None:
        """Wait for every change given; raise the first that failed."""
        wait(self._given)
        if self._failed:
            raise self._failed[0]


@dataclass
class _Sync:
    """One apply in progress: its transaction and what the checks and changes found."""

    prepared: PreparedVersion
    txn: Transaction
    audited: bool
    known: _Verified | None  # the lanes trusted instead of read (None: an audit)
    release: Callable[[], None]  # the target's claim (claim_target), held until the end
    # fingerprint lanes of each tensor a delta changes, followed through the changes (as the
    # target reads them; None where it cannot)
    lanes: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)  # the names the changes reach
    unverified: set[str] = field(default_factory=set)
    trusted: set[str] = field(default_factory=set)  # resident lanes taken from ``known``
    # exponent rows of the bits a classed change left, by name: (fingerprint, rows)
    rows: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)
    applied: set[str] = field(default_factory=set)  # the names changed while fetching
    done: int = 0  # the steps applied while fetching (all of their changes)

    @property
    def steps(self) -> tuple[FetchedStep, ...]:
        return self.prepared._steps

    @property
    def goal(self) -> FetchedStep:
        return self.prepared._steps[-1]

    @property
    def resident(self) -> Resident:
        """The resident version the commit records."""
        last = self.goal.plan.loaded
        return Resident(last.record.chain_id, last.record.version, last.sha256)


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
    when asked (``sync(audit=True)``, :meth:`audit`). FORMAT.md §11.3 and docs/pull.md
    say what each mode detects.

    ``decode_budget`` caps the bytes of inflated shards, and of the arrays their entries
    decode to, that a sync's decoders hold at once (a
    :class:`~dcr_format.format.budget.DecodeBudget`, shareable between readers; an int
    makes one of that many bytes; default a quarter of memory, at most 2 GiB); past its
    ``ceiling`` (default: physical memory) a version is refused. ``max_shard_bytes`` bounds
    one shard's inflated bytes plus what the entries whose values it holds decode to. Both
    are checked from the manifests before anything is fetched
    (:class:`~dcr_format.errors.DecodeLimitError`).

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
        # the store's end_epoch hook runs wherever the ranks agree (a RelayStore closes its
        # relay epoch there, readers/relay.py; a plain store does nothing)
        epoch = self.store.end_epoch
        self.group = (
            ReaderGroup.solo(before_agreeing=epoch)
            if group is None
            else ReaderGroup(group, before_agreeing=epoch)
        )
        self._last_table: tuple[str, dict[str, TensorState]] | None = None  # (record sha, table)
        self._verified: _Verified | None = None
        # exponent rows of the resident bits of tensors the last classed change reached, by
        # name: (fingerprint, rows), so that the next one need not count them (one pass over
        # the tensor); keyed by the fingerprint of the bits they describe
        self._rows: dict[str, tuple[str, np.ndarray]] = {}
        self.reader_id = reader_id
        # the last reader record written: (reader id, overwrite names, reads_baseline)
        self._recorded: tuple[str, frozenset[str], bool] | None = None

    def versions(self) -> list[int]:
        """Committed versions of the chain, ascending."""
        return self.chain.versions()

    # --- planning (metadata only: readers/_plan.py) -----------------------------------------

    def _plan(
        self, resident: Resident | None, goal: int, committed: list[int]
    ) -> tuple[list[int], int | None]:
        """The versions to apply; the second item is the first version when it starts from
        that version's alternative base (None otherwise)."""
        return choose_versions(
            None if resident is None else resident.version,
            goal,
            committed,
            kind=lambda version: self.chain.record(version).record.kind,
            alternatives=lambda: alternative_bases(self.store),
            where=self.store.url,
            cost=self._cost,
        )

    def _cost(self, version: int, alternative: bool) -> int:
        """Bytes a version's objects (or its alternative base's) take to fetch, as its
        record states them (a planning estimate: what is fetched is checked as always);
        an alternative base that cannot be read counts as never cheaper."""
        if not alternative:
            return self.chain.record(version).record.stats.payload_bytes
        try:
            return read_base_record(self.chain, version)[0].stats.payload_bytes
        except DcrError:
            return sys.maxsize

    def sync(self, to: int | None = None, *, audit: bool = False) -> SyncResult:
        """Bring the target to version ``to`` (default: the newest committed version).

        :meth:`prepare` then :meth:`apply`: every object is fetched and verified before
        the target is touched; a failure during the apply rolls every change back. A
        reader on its own (no group) applies a one-version plan into a target that
        offers its tensors (:meth:`Target.staging`) while the fetch workers still decode
        the last changes, so a stream that fails its decoder is then raised after the
        changes so far are rolled back (FORMAT.md §11.4, "Applying while decoding"). On
        its own into a target of canonical tensors it also writes a base as it is
        decoded, and applies a plan of several versions one version after the other
        (FORMAT.md §11.4, "Applying version by version"): it then holds about the model
        once more, however far behind, and any failure still rolls every change back. In
        a reader group every rank syncs to the same version, and all ranks apply it or
        none does. ``audit`` reads every selected resident tensor in full first.

        One sync at a time applies to a target (in this process; across processes too
        for a directory): a second waits for the first to end, then plans again from
        where it left the target.
        """
        for attempt in range(3 if self.group.alone else 1):
            try:
                return self.apply(self._prepare_for(to, stage=False, audit=audit), audit=audit)
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

        For a single version, the changes to tensors the target offers for staging
        (:meth:`Target.staging`: a dict target's own tensors) are also read against the
        live tensors now (the bits before and after, and their fingerprint lane deltas), so
        that :meth:`apply` only writes them.
        """
        return self._prepare_for(to, stage=True)

    def _prepare_for(self, to: int | None, *, stage: bool, audit: bool = False) -> PreparedVersion:
        """:meth:`prepare` (``stage``) or a sync's preparation (``audit``: as asked of it)."""
        committed = self.chain.versions()
        latest = committed[-1] if committed else -1
        goal = self.group.min(latest if to is None else to)
        started = time.perf_counter()
        # a sync applies right after: its changes are completed as they are decoded (and
        # applied from when everything is verified, on its own)
        early = None if stage else _Early(self.group.alone, audit)
        try:
            with self.group.stage("fetching and verifying"):
                prepared = self._prepare(goal, committed, started, early=early)
                if stage and len(prepared._steps) == 1 and not prepared._steps[0].base:
                    staged = self._stage(prepared._steps[0])
                    prepared = replace(
                        prepared, _staged=staged, fetch_seconds=time.perf_counter() - started
                    )
                self._record_overwrites()  # what the target learnt (FORMAT.md §3.6)
        except BaseException as exc:
            # a transaction opened during the fetch (a sync on its own) is rolled back here
            if early is None or early.sync is None:
                raise
            with contextlib.suppress(BaseException):
                early.finish()  # every change given has ended: nothing is applied any more
            # a failure to fetch or decode (or after the fetch) is raised as it is
            fetching = not early.failed(exc)
            raise self._rolled_back(exc, early.sync.txn, early.sync, as_is=fetching)  # noqa: B904
        return prepared

    def _resolver(
        self, plan: SyncPlan, early: _Early, resident: Resident | None, pool: ThreadPoolExecutor
    ) -> Early | None:
        """For a one-step plan, what takes each change decoded while the fetch workers
        decode the changes after it, for a tensor the target offers for reading
        (:meth:`Target.staging`); None where there is no such change.

        Until every object is fetched and verified, a change coded against the old bits is
        completed (:func:`resolve`: ``classed`` positions found, ``ulp-shift`` values
        joined) against the live tensor, so that the apply only writes it; a change that
        does not complete is left as it was, for the apply to refuse with the usual error.
        A reader on its own (``early.alone``) completes nothing before: it opens the
        transaction then (:meth:`_open`, as :meth:`apply` would) and applies each change
        as it comes, those decoded before first; any failure from there rolls it back.
        """
        if len(plan.steps) != 1:
            return None  # a later step's old bits are those the earlier steps leave
        if plan.steps[0].base:
            return self._streamer(plan, early, resident, pool)
        names = {
            entry.name
            for _, entry in plan.steps[0].fetch.wanted
            if entry.op != FULL and entry.changed and entry.piece is None
        }
        tensors = self.target.staging(names) if names else {}
        if not tensors:
            return None

        def take(entry: Entry, delta: DecodedDelta) -> DecodedDelta:
            tensor = tensors.get(entry.name)
            if tensor is None:
                return delta
            if early.alone:  # applied as soon as the transaction is open
                early.give(entry, delta)
                return delta
            done = self._resolved_live(entry, delta, tensor) if delta.needs_target else None
            if done is None:
                return delta
            return replace(done, rows=delta.rows)  # the rows follow the change (_follow_rows)

        def verified() -> None:
            preliminary = PreparedVersion(
                plan.goal, plan.previous, plan.versions, 0, 0.0, id(self), resident, (), plan
            )
            try:  # another sync of the target applies now: this one applies after the fetch
                sync = self._open(preliminary, early.audit, prepare=False, wait=False)
            except TargetBusyError:
                return
            early.start(sync, lambda entry, delta: self._change_now(sync, entry, delta))

        if not early.alone:
            return Early(pool, take)
        # host tensors take changes on every core at once (each on one); the fetch workers
        # decode on all but one meanwhile
        cores = _kernel_threads()
        on_host = all(t.device.type == "cpu" for t in tensors.values())
        early.threads = cores if on_host else 1
        return Early(pool, take, verified, max(1, cores - 1))

    def _streamer(
        self, plan: SyncPlan, early: _Early, resident: Resident | None, pool: ThreadPoolExecutor
    ) -> Early | None:
        """For a one-step plan of a base, by a reader on its own into a target of canonical
        tensors: what writes each tensor into the target as soon as it is decoded, so that
        the sync holds the model once, not once more decoded (None otherwise).

        The transaction opens before the fetch (:meth:`_open`: the checks of
        :meth:`apply`); a failure from there, of the fetch too, rolls it back."""
        if not early.alone or not self.target.reads_baseline():
            return None
        preliminary = PreparedVersion(
            plan.goal, plan.previous, plan.versions, 0, 0.0, id(self), resident, (), plan
        )
        sync = self._open(preliminary, early.audit, prepare=False)
        early.threads = 1  # one writer: a target's new tensors are made one at a time
        early.start(sync, lambda entry, delta: self._change_now(sync, entry, delta))

        def take(entry: Entry, delta: DecodedDelta) -> DecodedDelta:
            early.give(entry, delta)
            return _SPENT  # the version keeps no copy: the target holds it

        return Early(pool, take, lambda: None, max(1, _kernel_threads() - 1))

    def _change_now(self, sync: _Sync, entry: Entry, delta: DecodedDelta) -> None:
        """Apply one change while the fetch still decodes others (refused first, as
        :meth:`Transaction.prepare` would refuse it with the rest)."""
        info = info_for(entry.dtype)
        sync.txn.prepare([Change(entry.name, info.torch_dtype, tuple(entry.shape), delta)])
        self._change_entry(sync, entry, delta)
        sync.applied.add(entry.name)

    def _resolved_live(
        self, entry: Entry, delta: DecodedDelta, tensor: torch.Tensor
    ) -> DecodedDelta | None:
        """``delta`` completed against the live ``tensor`` it lands in (read only), with the
        rows this reader kept; None where it does not fit that tensor or does not complete
        (left to :meth:`apply`, which refuses it with the usual error)."""
        spec = (info_for(entry.dtype).torch_dtype, tuple(entry.shape))
        if (tensor.dtype, tuple(tensor.shape)) != spec:
            return None
        self._give_rows(entry, delta, {})
        try:
            return resolve(delta, tensor)
        except (IndexError, DcrError):
            return None

    def _stage(self, step: FetchedStep) -> dict[str, Staged]:
        """Read each xor/overwrite change against the live tensor it lands in (nothing is
        written); a change that does not fit its tensor is left to :meth:`apply`, which
        refuses it with the usual error."""
        wanted = {e.name: (e, d) for e, d in step.changes if e.op != FULL and e.changed}
        staged: dict[str, Staged] = {}
        # read while no other sync changes the tensors (a rollback would restore other bits)
        release = claim_target(self.target, self.target.claim_timeout())
        try:
            for name, tensor in self.target.staging(wanted).items():
                entry, delta = wanted[name]
                # codings against the old bits are completed against the live tensor first
                done = self._resolved_live(entry, delta, tensor)
                if done is None:
                    continue
                try:
                    staged[name] = Staged(tensor, stage_change(tensor, done))
                except (IndexError, DcrError):
                    continue
        finally:
            release()
        return staged

    def _give_rows(
        self, entry: Entry, delta: DecodedDelta, pending: dict[str, tuple[str, np.ndarray]]
    ) -> None:
        """Hand a ``classed`` change the exponent rows of its parent's bits where this reader
        kept them (``pending``: those of this sync's earlier versions, else the committed
        ones), so that :func:`resolve` need not count them."""
        slot = delta.rows
        if slot is None or slot.rows is not None:
            return
        kept = pending.get(entry.name) or self._rows.get(entry.name)
        if kept is not None and kept[0] == entry.parent_fingerprint:
            slot.rows = kept[1]

    def apply(self, prepared: PreparedVersion, *, audit: bool = False) -> SyncResult:
        """Apply a version made by :meth:`prepare`: check the target, change it, verify.

        Raises :class:`StalePreparedError` (nothing changed) when the target no longer
        holds the version it was prepared against. ``audit`` as in :meth:`sync`.
        """
        if prepared._reader != id(self):
            raise StalePreparedError(
                "this version was prepared by another DeltaReader; prepare it with this one"
            )
        started = time.perf_counter()
        if prepared._steps:
            unverified, audited = self._apply(prepared, audit)
        else:  # already there (no versions, no bytes); still take part in the group's stages
            with self.group.stage("checking its target"):
                self._check_fresh(prepared)
            with self.group.stage("applying"):
                pass
            unverified, audited = set(), False
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
        txn, release = self._begin()  # no other sync moves the target meanwhile
        try:
            resident = self._resident()
            if resident is None:
                raise VersionNotFoundError("the target holds no version yet; sync it first")
            loaded = self._resident_record(resident)
            table = self._table_of(loaded)
            with self.group.stage("auditing its target"):
                names = sorted(
                    n
                    for n, row in table.items()
                    if self._wants(n, row.dtype, row.shape) and n in txn.names()
                )
                raw, unverified = self._read_and_check(txn, names, table, resident.version)
        finally:
            try:
                txn.abort()
            finally:
                release()
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
        after its content, so readers that need the same names share one record. A target
        that cannot read its old bits (:meth:`Target.reads_baseline`) always has a record
        (``reads_baseline`` false: writers then code nothing against the old bits).
        """
        names = self.target.overwrite_names()
        reads_baseline = self.target.reads_baseline()
        if self.reader_id is None and not names and reads_baseline:
            return
        content = "\n".join(sorted(names)) + ("" if reads_baseline else "\n(no baseline)")
        reader_id = self.reader_id or "auto-" + sha256_hex(content.encode())[:16]
        if self._recorded == (reader_id, names, reads_baseline):
            return
        record = ReaderRecord(
            reader_id=reader_id,
            updated=timestamp(utc_now()),
            overwrite=tuple(sorted(names)),
            reads_baseline=reads_baseline,
        )
        try:
            self.store.put(f"readers/{reader_id}.json", record.to_json())
        except StoreError as exc:  # a read-only reader: writers then cannot be told
            _log.warning("could not write reader record readers/%s.json: %s", reader_id, exc)
            return
        self._recorded = (reader_id, names, reads_baseline)

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

    def _begin(self, *, wait: bool = True) -> tuple[Transaction, Callable[[], None]]:
        """Claim the target (no other sync of it in this process until the release;
        ``wait``: for the target's time, else refuse at once with :class:`TargetBusyError`)
        and open a transaction; any failure to open it is a :class:`TargetError`."""
        release = claim_target(self.target, self.target.claim_timeout() if wait else 0)
        try:
            return self.target.begin(), release
        except DcrError:
            release()
            raise
        except Exception as exc:
            release()
            raise TargetError(
                f"could not open the target ({exc}); repair or remove the target and pull again"
            ) from exc
        except BaseException:
            release()
            raise

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

    def _prepare(
        self, goal: int, committed: list[int], started: float, *, early: _Early | None = None
    ) -> PreparedVersion:
        """Plan and fetch everything for ``goal`` (nothing when the target is already there).
        ``early``: a sync's, see :meth:`_resolver`."""
        resident = self._resident()
        previous = self._check_goal(resident, goal, committed)
        if previous == goal:
            return PreparedVersion(goal, previous, (), 0, 0.0, id(self), resident)
        with ThreadPoolExecutor(self.max_workers) as pool:
            plan = self._make_plan(resident, goal, committed, pool)
            # checked before any shard, so before a sync on its own may open the transaction
            files = self._fetch_files(plan.steps[-1].fetch.manifests, pool)
            budget: DecodeBudget = self.decode_budget
            if len(plan.steps) > 1 or plan.steps[0].base:  # decodes up to the model, or more
                budget = _SyncBudget(self.decode_budget, self._model_bytes(plan) // 8)
            if early is not None and self._in_turn(plan, early):
                steps = self._fetch_and_apply(plan, early, resident, pool, budget)
            else:
                taking = None if early is None else self._resolver(plan, early, resident, pool)
                steps = tuple(
                    fetch_step(self.store, step, pool.map, budget, early=taking)
                    for step in plan.steps
                )
            if early is not None:
                early.finish()
        return PreparedVersion(
            goal,
            previous,
            plan.versions,
            plan.payload_bytes,
            time.perf_counter() - started,
            id(self),
            resident,
            steps,
            plan,
            _open=None if early is None else early.sync,
            _files=files,
            _spend=early is not None,
        )

    def _in_turn(self, plan: SyncPlan, early: _Early) -> bool:
        """Whether a sync applies ``plan`` version by version as each is fetched (a reader on
        its own, a plan of several versions, a target of canonical tensors)."""
        return early.alone and len(plan.steps) > 1 and self.target.reads_baseline()

    def _fetch_and_apply(
        self,
        plan: SyncPlan,
        early: _Early,
        resident: Resident | None,
        pool: ThreadPoolExecutor,
        budget: DecodeBudget,
    ) -> tuple[FetchedStep, ...]:
        """Fetch each version of ``plan`` and apply it before fetching the next, so that a
        sync far behind holds one version decoded, not all of them.

        The transaction opens first (:meth:`_open`: the checks of :meth:`apply`); where the
        undo of each change would hold more than half the model, it keeps the undo of each
        tensor as its bits before the sync first changed it instead
        (:meth:`Transaction.keep_whole_undo`), so the undo too is bounded by the model, not
        the plan; a base's tensors are written as they are decoded. Any failure rolls back
        every version applied so far."""
        preliminary = PreparedVersion(
            plan.goal, plan.previous, plan.versions, 0, 0.0, id(self), resident, (), plan,
            _spend=True,
        )  # fmt: skip
        sync = self._open(preliminary, early.audit, prepare=False)
        early.sync = sync  # a failure of a fetch rolls it back (:meth:`_prepare_for`)
        if _undo_bytes(plan) > self._model_bytes(plan) // 2:  # else the undo of each change
            sync.txn.keep_whole_undo()
        # a base's tensors are written as they are decoded (one writer), as in :meth:`_streamer`
        early.threads = 1
        early.start(sync, lambda entry, delta: self._change_now(sync, entry, delta))

        def take(entry: Entry, delta: DecodedDelta) -> DecodedDelta:
            early.give(entry, delta)
            return _SPENT

        streaming = Early(pool, take, lambda: None, max(1, _kernel_threads() - 1))
        steps: list[FetchedStep] = []
        for step in plan.steps:
            fetched = fetch_step(
                self.store, step, pool.map, budget, early=streaming if step.base else None
            )
            early.finish()  # the changes given are applied before the rest of the version
            try:
                sync.txn.prepare([c for c in _step_changes(fetched) if c.delta is not _SPENT])
                self._change_step(sync, fetched)
            except BaseException as exc:
                early.sync = None  # rolled back here, as :meth:`apply` does
                raise self._rolled_back(exc, sync.txn, sync)  # noqa: B904
            sync.applied.clear()  # the next version changes the same names again
            steps.append(fetched)
            sync.done += 1
        return tuple(steps)

    def _model_bytes(self, plan: SyncPlan) -> int:
        """Bytes of the tensors the goal holds in this reader's target (selected, taken)."""
        return sum(
            math.prod(row.shape) * info_for(row.dtype).width
            for name, row in plan.steps[-1].table.items()
            if self._wants(name, row.dtype, row.shape)
        )

    def _fetch_files(
        self, manifests: tuple[Manifest, ...], pool: ThreadPoolExecutor
    ) -> _Files | None:
        """The goal's checkpoint files, for a target that keeps them: each one it does not
        hold with the same sha256 is fetched and checked (size, then sha256)."""
        held = self.target.checkpoint_files()
        if held is None:
            return None
        refs = [ref for manifest in manifests if manifest.rank == 0 for ref in manifest.files]
        wanted = [ref for ref in refs if held.get(ref.name) != ref.sha256]
        found = pool.map(
            lambda ref: get_verified(self.store, ref.key, size=ref.size, sha256=ref.sha256),
            wanted,
        )
        fetched = {ref.name: data for ref, data in zip(wanted, found, strict=True)}
        return _Files({ref.name: ref.sha256 for ref in refs}, fetched)

    def _check_goal(self, resident: Resident | None, goal: int, committed: list[int]) -> int | None:
        """The resident version, once the target's chain and the goal are checked."""
        header = self.chain.header
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
        if previous is not None and previous > goal:
            raise TargetError(
                f"the target is at version {previous}, newer than {goal}; "
                "replay older versions into a fresh target"
            )
        return previous

    def _make_plan(
        self,
        resident: Resident | None,
        goal: int,
        committed: list[int],
        pool: ThreadPoolExecutor,
    ) -> SyncPlan:
        """Read and validate the metadata of every version to apply, and plan from it."""
        versions, alternative = self._plan(resident, goal, committed)
        # incremental: the plan continues from the resident version (else it starts at a base)
        incremental = (
            resident is not None
            and versions[0] == resident.version + 1
            and resident.version in set(committed)
        )
        parent: LoadedRecord | None = None
        parent_table: dict[str, TensorState] | None = None
        if incremental:
            assert resident is not None
            parent = self._resident_record(resident)
            parent_table = self._table_of(parent)
        resident_table = parent_table
        steps: list[StepPlan] = []
        for version in versions:
            loaded = self.chain.record(version)
            if parent is not None:
                self.chain.check_link(parent, loaded)
            step = self._plan_version(loaded, version == alternative, parent_table, pool)
            steps.append(step)
            parent, parent_table = loaded, step.table
        return SyncPlan(
            goal,
            None if resident is None else resident.version,
            tuple(steps),
            incremental,
            resident_table,
            plan_checks(steps),
        )

    def _plan_version(
        self,
        loaded: LoadedRecord,
        alternative: bool,
        parent_table: dict[str, TensorState] | None,
        pool: ThreadPoolExecutor,
    ) -> StepPlan:
        """Read one version's manifests (or its alternative base), check them, plan it."""
        if alternative:  # validated like a commit base (FORMAT.md §14)
            snapshot = load_base(self.chain, loaded, map_fn=pool.map)
            manifests, table = snapshot.manifests, snapshot.table
            metadata = sum(ref.size for ref in snapshot.record.manifests)
        else:
            manifests = self.chain.manifests(loaded, map_fn=pool.map)
            table = state_table(manifests)
            manifests = check_version(loaded, manifests, table, parent_table)
            metadata = sum(ref.size for ref in loaded.record.manifests)
        return plan_step(
            loaded,
            manifests,
            table,
            base=alternative or loaded.record.kind == "base",
            wants=self._wants,
            max_shard_bytes=self.max_shard_bytes,
            metadata_bytes=metadata,
        )

    def _decode_version(
        self, manifests: list[Manifest], pool: ThreadPoolExecutor
    ) -> tuple[list[tuple[Entry, DecodedDelta]], int]:
        """Fetch, verify and decode the shards of one version's ``manifests`` for this
        reader's target; returns the changes (pieces merged) and the shard bytes fetched."""
        plan = plan_fetch(manifests, wants=self._wants, max_shard_bytes=self.max_shard_bytes)
        changes = fetch_changes(self.store, plan, pool.map, self.decode_budget)
        return changes, plan.stored_bytes

    # --- check, change, verify, commit (the target's transaction owns the undo) -------------

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
        whether the sync audited the resident bits. Any failure after the transaction is
        open rolls it back (:meth:`Transaction.rollback`) before it propagates."""
        sync = prepared._open  # opened while the fetch decoded (a sync on its own)
        txn = None if sync is None else sync.txn
        try:
            # inside the stage: a target this rank cannot open fails every rank's sync
            with self.group.stage("checking its target"):
                if sync is None:
                    sync = self._open(prepared, asked)
                    txn = sync.txn
                else:  # the changes not applied yet are refused now, if at all
                    sync.prepared = replace(prepared, _open=None)
                    sync.txn.prepare(
                        [
                            c
                            for step in sync.steps[sync.done :]
                            for c in _step_changes(step)
                            if c.name not in sync.applied
                        ]
                    )
            with self.group.stage("applying"):
                for step in sync.steps[sync.done :]:
                    self._change_step(sync, step)
                found = self._verify_goal(sync)
                files = sync.prepared._files
                if files is not None:
                    sync.txn.put_files(files.listed, files.fetched)
            assert txn is not None
            txn.commit(sync.resident)
        except BaseException as exc:
            if txn is None:  # nothing was opened (or :meth:`_open` rolled it back)
                raise
            raise self._rolled_back(exc, txn, sync)  # noqa: B904 (its own cause, or none)
        try:
            self._last_table = (sync.goal.plan.loaded.sha256, sync.goal.table)
            self._remember(sync, found)
            for name in sync.touched:  # rows of bits that changed otherwise are stale: dropped
                if name in sync.rows:
                    self._rows[name] = sync.rows[name]
                else:
                    self._rows.pop(name, None)
        finally:
            sync.release()
        return sync.unverified, sync.audited

    def _rolled_back(
        self, exc: BaseException, txn: Transaction, sync: _Sync | None, *, as_is: bool = False
    ) -> BaseException:
        """Roll ``txn`` back after ``exc``; returns what to raise (a failure that is not an
        integrity, target or group error becomes an :class:`ApplyError`, unless ``as_is``)."""
        self._rows.clear()  # counted again next time, whatever went wrong
        for step in () if sync is None else sync.steps:  # a prepared version may be retried
            for _, delta in step.changes:
                if delta.rows is not None:
                    delta.rows.rows = None
        try:
            txn.undo()
            if isinstance(exc, FingerprintMismatchError) and sync is not None and sync.trusted:
                exc = self._diagnose(exc, sync)  # reads the restored bits
            txn.abort()
        finally:
            if sync is not None:
                sync.release()  # the target is as it was: the next sync may check it
        if as_is or isinstance(exc, (IntegrityError, TargetError, GroupAbortError)):
            return exc
        if isinstance(exc, Exception):
            error = ApplyError(f"applying failed and was rolled back: {exc}")
            error.__cause__, error.__suppress_context__ = exc, True  # raise ... from exc
            return error
        return exc

    def _open(
        self, prepared: PreparedVersion, asked: bool, *, prepare: bool = True, wait: bool = True
    ) -> _Sync:
        """Claim the target and open the transaction that applies ``prepared``, then check
        the target before anything changes (``prepare``: also let the target refuse every
        change now, where they are all decoded); a failure once it is open rolls it back.

        The target holds what ``prepared`` was planned from (else :class:`StalePreparedError`)
        is checked under the claim, so no other sync moves it until this one ends.
        ``wait``: see :meth:`_begin`."""
        txn, release = self._begin(wait=wait)
        try:
            resident = self._check_fresh(prepared)
        except BaseException:
            try:
                txn.abort()
            finally:
                release()
            raise
        audited = self._audit_due(resident, asked)
        known = None if audited else self._verified
        self._verified = None  # dropped on any failure; set again only on commit
        sync = _Sync(prepared, txn, audited, known, release)
        try:
            self._check_target(sync)
            if prepare:
                txn.prepare(_changes(sync, lambda name: True))
        except BaseException as exc:
            raise self._rolled_back(exc, txn, sync)  # noqa: B904 (its own cause, or none)
        return sync

    def _check_target(self, sync: _Sync) -> None:
        """Before mutating: the baseline checks."""
        plan = sync.prepared._sync_plan
        assert plan is not None
        self._check_baseline(sync, plan, plan.parent_table if sync.audited else None)
        sync.touched = set(sync.lanes)  # the names deltas change (their lanes follow them)

    def _change_step(self, sync: _Sync, step: FetchedStep) -> None:
        """Apply one version's changes (a base first drops the selected names it lacks);
        those applied while the fetch still decoded are done already."""
        txn = sync.txn
        if step.base or not sync.prepared._incremental:
            for name in txn.names():
                if self.select(name) and name not in step.table:
                    txn.drop(name)
        changes = step.changes
        for index, (entry, delta) in enumerate(changes):
            if entry.name not in sync.applied:
                self._change_entry(sync, entry, delta)
            if sync.prepared._spend:  # its memory goes now, not with the whole version
                changes[index] = (entry, _SPENT)

    def _change_entry(self, sync: _Sync, entry: Entry, delta: DecodedDelta) -> None:
        """Apply one tensor's change and follow its fingerprint lanes and exponent rows."""
        if entry.op != FULL and entry.changed == 0:
            return
        info = info_for(entry.dtype)
        change = Change(entry.name, info.torch_dtype, tuple(entry.shape), delta)
        self._give_rows(entry, delta, sync.rows)
        applied = sync.txn.change(change, sync.prepared._staged.get(entry.name))
        _follow_rows(sync, entry, delta, applied)
        if entry.op == FULL:
            sync.lanes[entry.name] = applied.lanes
            if entry.changed == 0:
                return
        else:
            # the fingerprint follows the change (O(changed)), from the bits read back
            sync.lanes[entry.name] = _lanes_after(sync.lanes.get(entry.name), applied)
        sync.touched.add(entry.name)

    def _verify_goal(self, sync: _Sync) -> dict[str, tuple[int, ...]]:
        """Check the goal's fingerprints (§11.4 step 3); returns the lanes it verified, as
        the target reads them."""
        txn, final = sync.txn, sync.goal.table
        version = sync.goal.plan.version
        # tensors a later base removed are gone, not checked
        selected = {n for n, row in final.items() if self._wants(n, row.dtype, row.shape)}
        check = selected if self.verify == "all" else sync.touched & selected

        def mismatch(name: str) -> FingerprintMismatchError:
            return FingerprintMismatchError(
                f"tensor {name!r} does not match version {version} after applying; the target "
                "was rolled back: run `dcr verify` on the store"
            )

        found: dict[str, tuple[int, ...]] = {}
        for name in sorted(check):
            row = final[name]
            if txn.spec(name) != (info_for(row.dtype).torch_dtype, row.shape):
                raise mismatch(name)
            raw = txn.lanes(name) if self.verify == "all" else sync.lanes.get(name)
            if raw is None:
                sync.unverified.add(name)  # the target cannot read it back (FORMAT.md §8.4)
            else:
                found[name] = raw
        sync.unverified |= _check_lanes(txn, found, final, mismatch)
        self._check_no_extra(txn, final, version)
        return found

    def _check_no_extra(
        self, txn: Transaction, final: dict[str, TensorState], version: int
    ) -> None:
        """FORMAT.md 11.4.3: the target holds exactly the goal's selected names."""
        extra = sorted(n for n in txn.names() if self.select(n) and n not in final)
        if extra:
            raise TargetError(
                f"the target holds {len(extra)} tensors that version {version} lacks "
                f"(first: {extra[0]!r}); remove them, pass select= to leave them alone, or "
                "pull into a fresh target"
            )

    def _remember(self, sync: _Sync, found: dict[str, tuple[int, ...]]) -> None:
        """After a commit: the lanes the next sync may trust (FORMAT.md §11.3)."""
        known, final = sync.known, sync.goal.table
        if known is not None and sync.prepared._incremental:
            kept = {n: v for n, v in known.lanes.items() if n in final and n not in sync.touched}
            self._verified = _Verified(
                sync.resident, {**kept, **found}, known.syncs + 1, known.audited
            )
        else:  # an audit, or a plan from a base: everything held was read or written in full
            self._verified = _Verified(sync.resident, dict(found))

    def _diagnose(self, exc: FingerprintMismatchError, sync: _Sync) -> IntegrityError:
        """A mismatch after applying onto trusted lanes: was the target edited outside dcr?

        The in-place changes are undone already; a solo reader reads the trusted tensors in
        full and blames the target when they differ from the resident version.
        """
        table = sync.prepared._parent_table
        if not self.group.alone or table is None:
            return FingerprintMismatchError(
                f"{exc} (or the target was changed outside dcr since the last sync: "
                "sync(audit=True) tells which)"
            )
        raw: dict[str, tuple[int, ...]] = {}
        for name in sorted(sync.trusted):
            value = sync.txn.lanes(name)
            if value is not None:
                raw[name] = value
        bad, _ = _mismatches(sync.txn, raw, lambda n: _expected(table[n]) if n in table else None)
        if bad:
            return BaselineMismatchError(
                f"tensor {bad[0]!r} in the target is not the bits of version "
                f"{sync.prepared.previous}; it was changed outside dcr since the last sync "
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
            _check_spec(txn, name, row.dtype, row.shape)
            value = txn.lanes(name)
            if value is None:
                unverified.add(name)
            else:
                raw[name] = value
        unverified |= _check_lanes(txn, raw, table, lambda name: _not_resident(name, version))
        return raw, unverified

    def _check_baseline(
        self, sync: _Sync, plan: SyncPlan, audit_table: dict[str, TensorState] | None
    ) -> None:
        """Before mutating: every delta lands on exactly the bits it was made against.

        Fills ``sync.lanes`` with the fingerprint lanes of every resident tensor a delta
        changes, as the target read them (None where it cannot), ``sync.unverified`` with
        the names it could not check, and ``sync.trusted`` with the names whose lanes it
        took from the previous sync instead of reading. ``audit_table`` (the resident
        version's table): also read and check every other selected tensor the target holds.
        """
        baseline, changing = plan.checks.baseline, plan.checks.changing
        raw: dict[str, tuple[int, ...]] = {}
        for name, tensor in baseline.items():
            _check_spec(sync.txn, name, tensor.dtype, tensor.shape)
            if name in changing or self.verify == "all":
                self._resident_lanes(sync, name, raw)
        bad, incomplete = _mismatches(
            sync.txn,
            raw,
            lambda n: (baseline[n].dtype, baseline[n].shape, baseline[n].parent_fingerprint),
        )
        first = plan.steps[0].version
        if bad:
            raise _not_resident(bad[0], first - 1)
        sync.unverified |= incomplete
        if audit_table is not None and plan.incremental:
            held = sync.txn.names()
            rest = sorted(
                n
                for n, row in audit_table.items()
                if n not in baseline and n in held and self._wants(n, row.dtype, row.shape)
            )
            self._read_and_check(sync.txn, rest, audit_table, first - 1)
        sync.lanes = {n: raw.get(n) for n in changing}
        sync.trusted &= changing

    def _resident_lanes(self, sync: _Sync, name: str, raw: dict[str, tuple[int, ...]]) -> None:
        """One resident tensor's lanes: trusted from the previous sync, or read in full."""
        cached = None if sync.known is None else sync.known.lanes.get(name)
        if cached is not None:
            raw[name] = cached
            sync.trusted.add(name)
            return
        lanes = sync.txn.lanes(name)
        if lanes is None:
            sync.unverified.add(name)
        else:
            raw[name] = lanes


_SPENT = DecodedDelta(FULL, None, torch.empty(0, dtype=torch.uint8))  # a change applied


class _SyncBudget(DecodeBudget):
    """One sync's share of the reader's decode budget: at most ``limit`` bytes of its
    inflated shards at once (an eighth of the model: a base's shards are as big as the
    model, and decoding all of them at once would hold it twice), within ``shared``; each
    job gives back the heap pages it freed."""

    gives_back = True

    def __init__(self, shared: DecodeBudget, limit: int) -> None:
        super().__init__(max(1, limit))
        self.shared = shared

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        with super().hold(nbytes), self.shared.hold(nbytes):
            yield


def _kernel_threads() -> int:
    """How many threads the host kernels run on (numba's, else torch's)."""
    launch = compiled("_launch")
    return torch.get_num_threads() if launch is None else int(launch.kernel_threads())


def _changes(sync: _Sync, which: Callable[[str], bool]) -> list[Change]:
    """The changes of ``sync``'s steps to the names ``which`` takes, for
    :meth:`Transaction.prepare`."""
    return [
        Change(e.name, info_for(e.dtype).torch_dtype, tuple(e.shape), d)
        for step in sync.steps
        for e, d in step.changes
        if which(e.name)
    ]


def _undo_bytes(plan: SyncPlan) -> int:
    """About what the undo of each change of ``plan`` would hold (its positions and bits)."""
    total = 0
    for step in plan.steps:
        for _, entry in step.fetch.wanted:
            width = info_for(entry.dtype).width
            total += entry.changed * (width if entry.op == FULL else 8 + width)
    return total


def _step_changes(step: FetchedStep) -> list[Change]:
    """The changes of one fetched version, for :meth:`Transaction.prepare`."""
    return [
        Change(e.name, info_for(e.dtype).torch_dtype, tuple(e.shape), d) for e, d in step.changes
    ]


def _check_spec(txn: Transaction, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    """The target holds ``name`` with this dtype and shape (else it is not that version)."""
    if txn.spec(name) != (info_for(dtype).torch_dtype, tuple(shape)):
        raise BaselineMismatchError(
            f"the target lacks tensor {name!r} as {dtype}{list(shape)}; pull into a fresh target"
        )


def _expected(row: TensorState) -> tuple[str, tuple[int, ...], str | None]:
    return row.dtype, row.shape, row.fingerprint


def _not_resident(name: str, version: int) -> BaselineMismatchError:
    """Tensor ``name`` in the target differs from resident version ``version``."""
    return BaselineMismatchError(
        f"tensor {name!r} in the target is not the bits of version {version}; "
        "it was changed outside dcr: pull into a fresh target"
    )


def _check_lanes(
    txn: Transaction,
    raw: dict[str, tuple[int, ...]],
    table: dict[str, TensorState],
    mismatch: Callable[[str], IntegrityError],
) -> set[str]:
    """Check the lanes the target read (``raw``) against the fingerprints of ``table``;
    raises ``mismatch(name)`` for the first tensor that differs. The names whose lanes
    could not be completed are dropped from ``raw`` and returned (unverified)."""
    bad, incomplete = _mismatches(txn, raw, lambda n: _expected(table[n]))
    if bad:
        raise mismatch(bad[0])
    for name in incomplete:
        del raw[name]
    return incomplete


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


def _follow_rows(sync: _Sync, entry: Entry, delta: DecodedDelta, applied: Applied) -> None:
    """After a ``classed`` change applied on the host: the exponent rows of the bits it left,
    from those it decoded against and the bits it read and wrote at every position."""
    slot = delta.rows
    sync.rows.pop(entry.name, None)
    if (
        slot is None
        or slot.rows is None
        or entry.op != XOR
        or applied.positions is None
        or applied.before is None
        or applied.after is None
        or applied.positions.device.type != "cpu"
        or int(applied.positions.numel()) != entry.changed
    ):
        return
    rows = rows_after(
        slot.rows,
        applied.positions,
        applied.before,
        applied.after,
        info_for(entry.dtype).torch_dtype,
    )
    sync.rows[entry.name] = (entry.fingerprint, rows)


def _lanes_after(before: tuple[int, ...] | None, applied: Applied) -> tuple[int, ...] | None:
    """A tensor's lanes after a change, from its lanes before and what the apply read back
    (None when either is unknown: the tensor is then unverified)."""
    if before is None or applied.positions is None:
        return None
    if applied.lane_deltas is not None:
        return apply_lane_deltas(before, applied.lane_deltas)
    assert applied.before is not None and applied.after is not None
    return lanes_after_change(before, applied.positions, applied.before, applied.after)


def _version_of(resident: Resident | None) -> tuple[str | None, int | None]:
    return (None, None) if resident is None else (resident.chain_id, resident.version)
