"""The rollout side: :class:`DeltaReader` runs a sync as plan, fetch and verify, apply,
commit, each phase in its own module of :mod:`dcr_format.sync`.

1. Plan (``_plan.py``): from metadata only, the versions to apply, the objects with their
   sizes and sha256, each target tensor's change, and the checks.
2. Fetch and verify (``_fetch.py``): parallel verified gets, inflated and decoded within a
   budget; nothing touches the target.
3. Apply (``_apply.py``): through the target's transaction, which keeps the undo of every
   change until it commits or rolls back; the baseline checks first and the goal's
   fingerprints last (``_diagnose.py``), reading the resident bits in full when the audit
   policy says so (``_audit.py``). A reader on its own overlaps this with the fetch once
   every object is verified.
4. Commit: the target records the goal as its resident version, and the reader keeps what
   the next sync trusts (``_commit.py``, which also writes the reader records).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from dcr_format.chain.chain import Chain, state_table
from dcr_format.delta.delta import Delta
from dcr_format.errors import (
    ArgumentError,
    DcrError,
    ObjectNotFoundError,
    StalePreparedError,
    TargetChangedError,
    VersionNotFoundError,
)
from dcr_format.format.budget import DecodeBudget
from dcr_format.format.schema import Entry, Manifest
from dcr_format.store.relay import RelayStore
from dcr_format.store.store import Store, open_store
from dcr_format.sync._apply import Applying, EarlyApply, step_changes
from dcr_format.sync._audit import AUDIT_EVERY, AUDIT_SECONDS
from dcr_format.sync._commit import Committing, check_reader_id
from dcr_format.sync._diagnose import reserve_fingerprints
from dcr_format.sync._fetch import SyncBudget, fetch_changes, fetch_files, fetch_step
from dcr_format.sync._plan import SyncPlan, check_goal, plan_fetch, read_plan, resident_record
from dcr_format.sync._state import PreparedVersion, VerifiedLanes
from dcr_format.sync.group import Agreement, ReaderGroup
from dcr_format.system.collector import collector_off
from dcr_format.system.options import whole
from dcr_format.targets.protocol import Target

MAX_SHARD_DECODED_BYTES = 16 << 30  # refuse to inflate a single shard past this
# a preparation of several versions holds at most this share of the model decoded
HELD_SHARE = 0.25


class SyncResult(BaseModel):
    """What one :meth:`DeltaReader.sync` (or :meth:`DeltaReader.apply`) did.

    ``fetch_seconds`` is the preparation (fetch, verify, decode: the engine may keep
    generating meanwhile), ``apply_seconds`` the pause (checking and changing the target).
    A :meth:`DeltaReader.sync` on its own (no group) starts changing the target once every
    object is fetched and verified, while the last changes are still decoded, and applies a
    base or a plan of several versions as it fetches them: that time counts in
    ``fetch_seconds``. The versions of a plan that :meth:`DeltaReader.prepare` leaves to
    the apply (a reader far behind) are fetched in ``apply_seconds``.
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


def _selector(select: Callable[[str], bool] | Collection[str] | None) -> Callable[[str], bool]:
    """``select`` as a predicate on canonical names: itself, or membership in a collection
    of names; None keeps every name."""
    if select is None:
        return lambda name: True
    if callable(select):
        return select
    if isinstance(select, Collection) and not isinstance(select, (str, bytes)):
        names = frozenset(select)
        odd = next((name for name in names if not isinstance(name, str)), None)
        if odd is None:
            return names.__contains__
        raise ArgumentError(f"select's names must be strings, not {type(odd).__name__}")
    raise ArgumentError(
        f"select takes a function of a tensor's name or a collection of names, not "
        f"{type(select).__name__} (e.g. select={{'lm_head.weight'}})"
    )


def _agreed(prepared: PreparedVersion) -> tuple[int, int]:
    """What the ranks of a group must have prepared alike to apply it together: the version
    and the version it was prepared from (ranks that prepared alone may differ)."""
    return prepared.version, -1 if prepared.previous is None else prepared.previous


def _check_agreed(checked: Agreement) -> None:
    if not checked.same:
        raise StalePreparedError(
            "the ranks of this reader group prepared different versions (each on its own); "
            "prepare again, every rank the same version"
        )


def _not_found(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is a missing object or version."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ObjectNotFoundError, VersionNotFoundError)):
            return True
        seen = seen.__cause__
    return False


class DeltaReader(Applying, Committing):
    """Keeps a target at a version of the chain in ``store``, bit-exact.

    ``select`` limits the reader to the canonical names it returns True for, or to those
    it holds where it is a collection of names (a partial target, such as one rank's
    tensors of the model). ``verify`` is
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
    after its content. In a reader group, rank ``r`` other than 0 names its record
    ``<reader_id>.rank<r>`` (ranks holding different parts ask different things). Names
    past what one record holds (1 MiB) go on in ``<record id>.part<k>.json``, so an id
    must not end in ``.part<k>`` itself. The reader writes its record again every hour it
    syncs, and at once after a sync that failed on a change it cannot take, so a record
    an operator removed (``dcr readers``) comes back while its reader runs.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        target: Target,
        *,
        select: Callable[[str], bool] | Collection[str] | None = None,
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
        if reader_id is not None:
            check_reader_id(reader_id)
        if audit_every is not None and audit_every < 1:
            raise ArgumentError("audit_every must be a positive number of syncs (or None)")
        if audit_seconds is not None and audit_seconds < 0:
            raise ArgumentError("audit_seconds must be zero or more (or None)")
        if not isinstance(target, Target):
            raise ArgumentError(
                f"DeltaReader takes a target, not a {type(target).__name__}: wrap it "
                "(StateDictTarget(tensors), ModuleTarget(module), SafetensorsDirTarget(path))"
            )
        self.store = open_store(store)
        self.chain = Chain(self.store)
        self.target = target
        self.select = _selector(select)
        self.verify = verify
        self.max_workers = whole(max_workers, "max_workers", low=1)
        self.max_shard_bytes = whole(max_shard_bytes, "max_shard_bytes", low=1)
        self.audit_every = audit_every
        self.audit_seconds = audit_seconds
        # bytes of inflated shards held at once (share one DecodeBudget to cap many readers)
        self.decode_budget = (
            decode_budget
            if isinstance(decode_budget, DecodeBudget)
            else DecodeBudget(decode_budget)
        )
        # ranks sharing the target stage, verify and apply together (all or none)
        # a relay closes its epoch wherever the ranks agree (store/relay.py)
        epoch = self.store.end_epoch if isinstance(self.store, RelayStore) else None
        self.group = (
            ReaderGroup.solo(before_agreeing=epoch)
            if group is None
            else ReaderGroup(group, before_agreeing=epoch)
        )
        self._last_table = None
        self._verified = None
        self._rows = {}
        self.reader_id = reader_id
        self._recorded = None
        self._version_names = None
        self._planned_from: int | None = None  # the oldest committed version at planning

    def versions(self) -> list[int]:
        """Committed versions of the chain, ascending."""
        return self.chain.versions()

    def sync(self, to: int | None = None, *, audit: bool = False) -> SyncResult:
        """Bring the target to version ``to`` (default: the newest committed version).

        :meth:`prepare` then :meth:`apply`: every object is fetched and verified before
        the target is touched; a failure during the apply rolls every change back. A
        reader on its own (no group) applies a one-version plan into a target that
        offers its tensors (:meth:`Target.staging`) while the fetch workers still decode
        the last changes, so a stream that fails its decoder is then raised after the
        changes so far are rolled back (FORMAT.md §11.4, "Applying while decoding"). On
        its own into a target of canonical tensors it also writes a base as it is
        decoded, and on its own into any target it applies a plan of several versions
        one version after the other (FORMAT.md §11.4, "Applying version by version"): it
        then holds about the model once more, however far behind, and any failure still
        rolls every change back. In a reader group every rank syncs to the same version,
        and all ranks apply it or none does; a plan of several versions is then applied
        as :meth:`prepare` then :meth:`apply` apply it. ``audit`` reads every selected
        resident tensor in full first.

        One sync at a time applies to a target (in this process; across processes too
        for a directory): a second waits for the first to end, then plans again from
        where it left the target.

        The cyclic collector is held off while it runs (as :meth:`apply`): a sync makes
        and drops a few objects per tensor, none of them in cycles, and the collections
        they would set off walk the whole heap of the process again and again.
        """
        with collector_off():
            for attempt in range(3 if self.group.alone else 1):
                last = attempt == 2 or not self.group.alone
                try:
                    with self._explaining():
                        prepared = self._prepare_for(to, stage=False, audit=audit)
                    return self.apply(prepared, audit=audit)
                except (StalePreparedError, TargetChangedError):
                    # another sync moved the target between planning and applying: plan again
                    if last:
                        raise
                except DcrError as exc:
                    # gc removed versions this sync was reading: plan again, from a base
                    removed = self._removed(exc, self._planned_from)
                    if removed is None:
                        raise
                    if last:
                        raise removed from exc
        raise AssertionError("unreachable")

    def prepare(self, to: int | None = None, *, alone: bool = False) -> PreparedVersion:
        """Fetch, verify and decode everything for version ``to`` (default: the newest)
        without touching the target; :meth:`apply` then makes the change (the pause).

        A rollout engine keeps generating while this runs. A prepared version that is not
        applied is simply dropped. In a reader group every rank prepares together, unless
        ``alone``: the rank then prepares its part without the others (no collective call,
        so each rank may prepare in a background thread at its own time, a failure is its
        own), and :meth:`apply`, which the ranks call together, first checks that every rank
        prepared the same version from the same version (else every rank raises
        :class:`StalePreparedError`, nothing changed). A reader over a relay store prepares
        with its group only.

        A plan of several versions is fetched and decoded here while its versions decode
        to at most a quarter of the model together; :meth:`apply` fetches and applies the
        rest one version after the other (FORMAT.md §11.4, "Applying version by
        version"), so that a reader far behind holds about the model twice at most,
        however far behind, at the cost of a longer pause. Any failure there, of a fetch
        too, rolls every change back, and the prepared version may be applied again.

        For a single version, the changes to tensors the target offers for staging
        (:meth:`Target.staging`: a dict target's own tensors, a module target's names its
        loader places whole in one run of a parameter) are also read against the
        live tensors now (the bits before and after, and their fingerprint lane deltas), so
        that :meth:`apply` only writes them.

        The cyclic collector is held off while it runs (as :meth:`sync`): a prepared
        version keeps a few objects per tensor, and on thousands of tensors the full
        collections they set off would walk the process's heap again and again, each
        stopping every thread of the process (an engine's generation too) while it runs.
        """
        group = self.group
        if alone and not group.alone:
            if isinstance(self.store, RelayStore):
                raise ArgumentError(
                    "a reader over a relay store prepares with its group: call prepare() "
                    "on every rank together"
                )
            group = ReaderGroup.solo()
        with collector_off(), self._explaining():
            for attempt in range(3 if group.alone else 1):
                try:
                    return self._prepare_for(to, stage=True, group=group)
                except DcrError as exc:
                    # gc removed versions this preparation was reading: plan again
                    removed = self._removed(exc, self._planned_from)
                    if removed is None:
                        raise
                    if attempt == 2 or not group.alone:
                        raise removed from exc
        raise AssertionError("unreachable")

    def _prepare_for(
        self,
        to: int | None,
        *,
        stage: bool,
        audit: bool = False,
        group: ReaderGroup | None = None,
    ) -> PreparedVersion:
        """:meth:`prepare` (``stage``) or a sync's preparation (``audit``: as asked of it);
        ``group``: the ranks it agrees with (default the reader's group)."""
        group = self.group if group is None else group
        to = None if to is None else whole(to, "to", low=0)
        committed = self.chain.versions()
        self._planned_from = committed[0] if committed else None
        latest = committed[-1] if committed else -1
        goal = group.min(latest if to is None else to)
        started = time.perf_counter()
        # a sync applies right after: its changes are completed as they are decoded (and
        # applied from when everything is verified, on its own)
        early = None if stage else EarlyApply(self.group.alone, audit)
        try:
            with group.stage("fetching and verifying"):
                prepared = self._prepare(goal, committed, started, early=early)
                if stage and len(prepared.plan) == 1 and not prepared._steps[0].base:
                    staged = self._stage(prepared._steps[0])
                    prepared = replace(
                        prepared, _staged=staged, fetch_seconds=time.perf_counter() - started
                    )
                # what the target learnt (FORMAT.md §3.6), of the goal's names
                plan = prepared._sync_plan
                self._record_overwrites(plan.steps[-1].table if plan and plan.steps else None)
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

    def apply(self, prepared: PreparedVersion, *, audit: bool = False) -> SyncResult:
        """Apply a version made by :meth:`prepare`: check the target, change it, verify.

        Raises :class:`StalePreparedError` (nothing changed) when the target no longer
        holds the version it was prepared against. ``audit`` as in :meth:`sync`. The
        cyclic collector is held off meanwhile (the pause; see :meth:`sync`).
        """
        with collector_off():
            try:
                return self._apply_prepared(prepared, audit)
            except DcrError as exc:  # versions it fetches only now may have been removed
                removed = self._removed(exc, prepared.plan[0] if prepared.plan else None)
                if removed is None:
                    raise
                raise removed from exc

    def _removed(self, exc: DcrError, since: int | None) -> VersionNotFoundError | None:
        """Where ``exc`` is a missing object or version and the chain no longer holds
        version ``since`` (the oldest a sync planned from): gc removed what the sync was
        reading, and the error to raise says so (None otherwise, or where the chain
        cannot be listed now)."""
        if since is None or not _not_found(exc):
            return None
        try:
            now = self.chain.versions()
        except DcrError:
            return None
        if now and now[0] <= since:
            return None
        gone = f"versions {since}..{now[0] - 1}" if now else "every version"
        return VersionNotFoundError(
            f"{gone} of {self.store.url} were removed (dcr gc) while this sync read them; "
            "sync again: a reader whose version is gone starts from the newest base"
        )

    def _apply_prepared(self, prepared: PreparedVersion, audit: bool) -> SyncResult:
        """:meth:`apply`, with the collector held off."""
        if prepared._reader != id(self):
            raise StalePreparedError(
                "this version was prepared by another DeltaReader; prepare it with this one"
            )
        started = time.perf_counter()
        if prepared.plan:
            with self._explaining():
                unverified, audited = self._apply(prepared, audit)
        else:  # already there (no versions, no bytes); still take part in the group's stages
            with self.group.stage("checking its target", agree=_agreed(prepared)) as checked:
                self._check_fresh(prepared)
            _check_agreed(checked)
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
            loaded = resident_record(self.chain, resident)
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
        self._verified = VerifiedLanes(resident, raw)
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
        table = state_table(self.chain.manifests(loaded))
        for name, row in table.items():
            self._wants(name, row.dtype, row.shape)
        self._record_overwrites(table)
        return self.target.overwrite_names()

    # --- the phases in order: plan, fetch and verify (_prepare); apply, commit (_apply) ----

    def _prepare(
        self, goal: int, committed: list[int], started: float, *, early: EarlyApply | None = None
    ) -> PreparedVersion:
        """Plan and fetch everything for ``goal`` (nothing when the target is already there).
        ``early``: a sync's, see :meth:`_resolver`."""
        resident = self._resident()
        previous = check_goal(self.chain, resident, goal, committed)
        if previous == goal:
            return PreparedVersion(goal, previous, (), 0, 0.0, id(self), resident)
        with ThreadPoolExecutor(self.max_workers) as pool:
            plan = read_plan(
                self.chain,
                resident,
                goal,
                committed,
                pool,
                wants=self._wants,
                max_shard_bytes=self.max_shard_bytes,
                table_of=self._table_of,
            )
            # the fingerprints staged now stay until the checks of the pause ask for them
            reserve_fingerprints(len(plan.steps[-1].table))
            # checked before any shard, so before a sync on its own may open the transaction
            files = fetch_files(
                self.store, self.target.checkpoint_files(), plan.steps[-1].fetch.manifests, pool
            )
            budget: DecodeBudget = self.decode_budget
            if len(plan.steps) > 1 or plan.steps[0].base:  # decodes up to the model, or more
                budget = SyncBudget(self.decode_budget, self._model_bytes(plan) // 8)
            if early is not None and self._in_turn(plan, early):
                steps = self._fetch_and_apply(plan, early, resident, pool, budget)
            else:
                taking = None if early is None else self._resolver(plan, early, resident, pool)
                steps = tuple(
                    fetch_step(self.store, step, pool.map, budget, early=taking)
                    for step in plan.steps[: self._held_steps(plan)]
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

    def _apply(self, prepared: PreparedVersion, asked: bool) -> tuple[set[str], bool]:
        """Apply the staged steps; returns the names the target could not verify, and
        whether the sync audited the resident bits. Any failure after the transaction is
        open rolls it back (:meth:`Transaction.rollback`) before it propagates."""
        sync = prepared._open  # opened while the fetch decoded (a sync on its own)
        txn = None if sync is None else sync.txn
        try:
            # inside the stage: a target this rank cannot open fails every rank's sync
            with self.group.stage("checking its target", agree=_agreed(prepared)) as checked:
                if sync is None:
                    sync = self._open(prepared, asked)
                    txn = sync.txn
                    if prepared._deferred and prepared._sync_plan is not None:
                        self._bound_undo(sync, prepared._sync_plan)
                else:  # the changes not applied yet are refused now, if at all
                    sync.prepared = replace(prepared, _open=None)
                    sync.txn.prepare(
                        [
                            c
                            for step in sync.steps[sync.done :]
                            for c in step_changes(step)
                            if c.name not in sync.applied
                        ]
                    )
            _check_agreed(checked)  # in a group nothing is written yet: nothing to roll back
            with self.group.stage("applying"):
                for step in sync.steps[sync.done :]:
                    self._change_step(sync, step)
                if sync.prepared._deferred:
                    self._apply_deferred(sync, asked)
                found = self._verify_goal(sync)
                files = sync.prepared._files
                if files is not None:
                    sync.txn.put_files(files.listed, files.fetched)
            assert txn is not None
            txn.commit(sync.resident)
        except BaseException as exc:
            if txn is None:  # nothing was opened (or :meth:`_open` rolled it back)
                raise
            fetching = sync is not None and exc is sync.fetch_failure  # raised as it is
            raise self._rolled_back(exc, txn, sync, as_is=fetching)  # noqa: B904
        self._committed(sync, found)
        return sync.unverified, sync.audited

    def _held_steps(self, plan: SyncPlan) -> int:
        """How many of ``plan``'s steps a preparation fetches and decodes: every step of a
        one-version plan, else those that decode to at most :data:`HELD_SHARE` of the model
        together (the apply fetches and applies the rest in turn, :meth:`_apply_deferred`)."""
        if len(plan.steps) == 1:
            return 1
        limit = self._model_bytes(plan) * HELD_SHARE
        total = 0
        for held, step in enumerate(plan.steps):
            total += step.fetch.output_bytes
            if total > limit:
                return held
        return len(plan.steps)

    def _decode_version(
        self, manifests: list[Manifest], pool: ThreadPoolExecutor
    ) -> tuple[list[tuple[Entry, Delta]], int]:
        """Fetch, verify and decode the shards of one version's ``manifests`` for this
        reader's target; returns the changes (pieces merged) and the shard bytes fetched."""
        plan = plan_fetch(manifests, wants=self._wants, max_shard_bytes=self.max_shard_bytes)
        changes = fetch_changes(self.store, plan, pool.map, self.decode_budget)
        return changes, plan.stored_bytes

    # --- check, change, verify, commit (the target's transaction owns the undo) -------------
