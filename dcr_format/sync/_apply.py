"""The apply: the target's transaction, the changes staged and applied, and the apply
that overlaps the fetch.

A sync opens the transaction (:meth:`Applying._open`: claim the target, check it holds what
the plan started from, run the baseline checks), applies each version's changes
(:meth:`Applying._change_step`), and on any failure undoes every change
(:meth:`Applying._rolled_back`). :meth:`DeltaReader.prepare` reads a one-version plan's
changes against the live tensors first (:meth:`Applying._stage`), so the apply only writes.
A reader on its own overlaps the apply with the fetch (:class:`EarlyApply`): it completes
each change against the live tensors as it is decoded and applies it once every object is
verified (:meth:`Applying._resolver`),
writes a base as it is decoded (:meth:`Applying._streamer`), and applies a plan of several
versions one version after the other (:meth:`Applying._fetch_and_apply`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dcr_format.delta.classed_change import rows_after
from dcr_format.delta.delta import (
    FULL,
    XOR,
    DecodedDelta,
    Delta,
    PendingDelta,
    resolve,
    stage_change,
)
from dcr_format.delta.fingerprint import apply_lane_deltas, lanes_after_change
from dcr_format.delta.staged import StagedChange, batch_staged
from dcr_format.errors import (
    ApplyError,
    ArgumentError,
    DcrError,
    FingerprintMismatchError,
    GroupAbortError,
    IntegrityError,
    StalePreparedError,
    TargetBusyError,
    TargetError,
)
from dcr_format.format.budget import DecodeBudget
from dcr_format.format.dtypes import info_for
from dcr_format.format.schema import Entry
from dcr_format.kernels.native import compiled, serial_kernels
from dcr_format.sync._audit import Auditing
from dcr_format.sync._diagnose import fingerprint_of
from dcr_format.sync._fetch import Early, FetchedStep, SyncBudget, fetch_step
from dcr_format.sync._plan import StepPlan, SyncPlan
from dcr_format.sync._state import ApplyState, PreparedVersion
from dcr_format.system.memory import give_back_freed
from dcr_format.system.pools import ONE_THREAD_ELEMENTS, kept_pool
from dcr_format.targets.change import Applied, Change, Resident
from dcr_format.targets.claim import claim_mark, claim_target, claims_since
from dcr_format.targets.protocol import Target, Transaction
from dcr_format.targets.reader_side import Staged


@dataclass
class EarlyApply:
    """A sync's taking of its changes as they are decoded (:meth:`Applying._resolver`).

    ``alone``, a reader on its own, opens the transaction once everything is verified and
    from then on applies each change as it is given (:meth:`start`, :meth:`give`,
    :meth:`finish`) on the process's apply pool (it waits for its own changes only, so
    readers may share the pool); the first failure there stops the rest and is raised.
    A small tensor's change is not given but applied after the fetch
    (:func:`applies_later`).

    A change given before the transaction opens (its objects still arriving) is held, and
    ``ahead``, where set, completes it against the live tensor meanwhile (read only: the
    ``classed`` select pass, the ``ulp-shift`` join), so that the transaction only writes
    it. What was completed is used only where no sync claimed any target from before the
    first completion until this one's own claim (:func:`claim_mark`): else the tensors may
    have changed under it, and the change as decoded is applied instead. Completed changes
    hold their positions and old bits (about 12 bytes a changed element, against one or two
    decoded): they are held up to ``ahead_bytes``, the later ones as decoded."""

    alone: bool
    audit: bool  # the sync was asked to audit
    # changes decoded before the transaction opened, to apply as it opens: each as decoded,
    # and as completed ahead (None: not completed)
    ready: list[tuple[Entry, Delta, Delta | None]] = field(default_factory=list)
    ahead: Callable[[Entry, Delta], Delta | None] | None = None
    reads: Target | None = None  # the target ``ahead`` reads
    ahead_bytes: int = 0  # at most this many bytes of changes completed ahead held at once
    _mark: int | None = None  # claim_mark before the first change completed ahead
    _held: int = 0  # bytes of the changes completed ahead so far
    sync: ApplyState | None = None  # the transaction's apply, once open
    threads: int = 1  # the pool's
    # a sync writing whole tensors (a base, versions in turn): the memory of each change
    # applied goes back to the system at once, not held in an arena until the next one
    gives_back: bool = False
    _apply: Callable[[Entry, Delta], None] | None = None
    _applying: ThreadPoolExecutor | None = None
    _given: list[Future[None]] = field(default_factory=list)
    _failed: list[BaseException] = field(default_factory=list)

    def start(self, sync: ApplyState, apply: Callable[[Entry, Delta], None]) -> None:
        """The transaction is open: apply the changes held so far, and each one given (a
        large tensor's on a pool kept for the process: its threads keep their memory from
        sync to sync)."""
        self.sync, self._apply = sync, apply
        self._applying = kept_pool("dcr-apply", self.threads)
        ready, self.ready = self.ready, []
        # this sync's claim is the only one since the first completion ahead
        fresh = self._mark is not None and claims_since(self._mark) == 1
        for entry, delta, done in ready:
            self.give(entry, done if fresh and done is not None else delta)

    def give(self, entry: Entry, delta: Delta) -> None:
        """Apply one change on the pool once the transaction is open (else hold it);
        raises an earlier change's failure instead. A sync that writes with one thread
        only (``threads`` 1: device tensors, a base streamed in, versions in turn) keeps
        every change on that pool thread."""
        if self._failed:
            raise self._failed[0]
        if self._applying is None:
            self.ready.append((entry, delta, self._ahead(entry, delta)))
            return
        self._given.append(self._applying.submit(self._run, entry, [delta]))

    def _ahead(self, entry: Entry, delta: Delta) -> Delta | None:
        """``delta`` completed ahead of the transaction (None where it is not: no
        ``ahead``, nothing to complete, ``ahead_bytes`` held already, a sync holding the
        target at the first, or a change that does not complete, left for the transaction
        to refuse as usual)."""
        if self.ahead is None or self.reads is None or not delta.needs_target:
            return None
        if self._held >= self.ahead_bytes:
            return None
        if self._mark is None:
            self._mark = claim_mark(self.reads)
            if self._mark is None:  # another sync is changing the target: none ahead
                self.ahead = None
                return None
        done = self.ahead(entry, delta)
        if isinstance(done, DecodedDelta):
            self._held += done.nbytes
        return done

    def _run(self, entry: Entry, box: list[Delta]) -> None:
        delta = box.pop()  # held by nothing else once applied
        if self._failed:
            return  # the sync fails: the rest is not applied
        assert self._apply is not None
        try:
            # several of the pool's threads fill the cores already
            with serial_kernels() if self.threads > 1 else contextlib.nullcontext():
                self._apply(entry, delta)
        except BaseException as exc:
            self._failed.append(exc)
        if self.gives_back and entry.op == FULL:  # its decoded bits, freed: back to the system
            del delta
            give_back_freed()

    def failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the failure of a change given (not of the fetch)."""
        return bool(self._failed) and exc is self._failed[0]

    def finish(self) -> None:
        """Wait for every change given; raise the first that failed."""
        wait(self._given)
        if self._failed:
            raise self._failed[0]


AHEAD_SHARE = 0.25
"""A sync on its own holds changes completed before its transaction opens up to this share
of the model's bytes (:class:`EarlyApply`): a change of about 4% of the elements."""


def applies_later(entry: Entry) -> bool:
    """Whether a sync on its own leaves ``entry``'s change to after the fetch instead of
    taking it as it is decoded: a small tensor's
    (:data:`~dcr_format.system.pools.ONE_THREAD_ELEMENTS`). Its apply is mostly Python
    between short compiled calls, and so is the decoding of the changes after it: taken
    meanwhile, the two would only pass the interpreter's lock back and forth (2,000
    tensors of 16K elements at 1%: 0.54 s a sync, against 0.41 s kept)."""
    return math.prod(entry.shape) <= ONE_THREAD_ELEMENTS


class Applying(Auditing):
    """The reader's transaction and changes."""

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

    def _rolled_back(
        self, exc: BaseException, txn: Transaction, sync: ApplyState | None, *, as_is: bool = False
    ) -> BaseException:
        """Roll ``txn`` back after ``exc``; returns what to raise (a failure that is not an
        integrity, target, group or argument error becomes an :class:`ApplyError`, unless
        ``as_is``)."""
        self._rows.clear()  # counted again next time, whatever went wrong
        for step in () if sync is None else sync.steps:  # a prepared version may be retried
            for index, (entry, delta) in enumerate(step.changes):
                if delta.rows is not None:
                    step.changes[index] = (entry, replace(delta, rows=None))
        staged = None if sync is None else sync.prepared._staged
        if isinstance(staged, dict):  # the rows they were read against are counted again too
            for name in list(staged):
                staged[name] = replace(staged[name], rows=None)
        try:
            txn.undo()
            if isinstance(exc, FingerprintMismatchError) and sync is not None:
                exc = self._diagnose(exc, sync)  # reads the restored bits
            txn.abort()
        finally:
            if sync is not None:
                sync.release()  # the target is as it was: the next sync may check it
        if as_is or isinstance(
            exc, (IntegrityError, TargetError, GroupAbortError, StalePreparedError, ArgumentError)
        ):
            return exc
        if isinstance(exc, Exception):
            error = ApplyError(f"applying failed and was rolled back: {exc}")
            error.__cause__, error.__suppress_context__ = exc, True  # raise ... from exc
            return error
        return exc

    def _open(
        self, prepared: PreparedVersion, asked: bool, *, prepare: bool = True, wait: bool = True
    ) -> ApplyState:
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
        sync = ApplyState(prepared, txn, audited, known, release)
        try:
            self._check_target(sync)
            if prepare:
                txn.prepare(_changes(sync, lambda name: True))
        except BaseException as exc:
            raise self._rolled_back(exc, txn, sync)  # noqa: B904 (its own cause, or none)
        return sync

    def _change_step(self, sync: ApplyState, step: FetchedStep) -> None:
        """Apply one version's changes (a base first drops the selected names it lacks);
        those applied while the fetch still decoded are done already."""
        txn = sync.txn
        if step.base or not sync.prepared._incremental:
            for name in txn.names():
                if self.select(name) and name not in step.table:
                    txn.drop(name)
        changes = step.changes
        put = self._put_batches(sync, step) if sync.prepared._staged else set()
        for index, (entry, delta) in enumerate(changes):
            if entry.name not in sync.applied and entry.name not in put:
                self._change_entry(sync, entry, delta)
            if sync.prepared._spend:  # its memory goes now, not with the whole version
                changes[index] = (entry, SPENT)

    def _put_batches(self, sync: ApplyState, step: FetchedStep) -> set[str]:
        """Write each batch of changes staged together (:meth:`_stage`) in one pass
        (:meth:`Transaction.put_batch`) where every change of it is still to apply and
        takes the write; returns the names written (the rest are applied one by one)."""
        staged = sync.prepared._staged
        pending = {
            e.name: e
            for e, _ in step.changes
            if e.op != FULL and e.changed and e.name not in sync.applied
        }
        batches = {id(s.batch): s for s in staged.values() if s.batch is not None}
        done: set[str] = set()
        for first in batches.values():
            names = first.names
            if not all(name in pending for name in names):
                continue
            ones = [staged[name] for name in names]
            if not sync.txn.put_batch(names, ones):
                continue
            for name, one in zip(names, ones, strict=True):
                _follow_staged(sync, pending[name], one)
            done.update(names)
        return done

    def _change_entry(
        self, sync: ApplyState, entry: Entry, delta: Delta, *, owned: bool = False
    ) -> None:
        """Apply one tensor's change and follow its fingerprint lanes and exponent rows
        (``owned``: see :meth:`Transaction.change`)."""
        if entry.op != FULL and entry.changed == 0:
            return
        info = info_for(entry.dtype)
        delta = self._give_rows(entry, delta, sync.rows)
        change = Change(entry.name, info.torch_dtype, tuple(entry.shape), delta)
        applied = sync.txn.change(change, sync.prepared._staged.get(entry.name), owned=owned)
        self._follow(sync, entry, applied)

    def _follow(
        self,
        sync: ApplyState,
        entry: Entry,
        applied: Applied,
        ready: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        rows: np.ndarray | None = None,
    ) -> None:
        """Follow one applied change's fingerprint lanes and exponent rows (``ready``: the
        lanes before and after it, computed when it was staged: taken where the lanes
        before are still those; ``rows``: the exponent rows it leaves, computed then)."""
        _follow_rows(sync, entry, applied, rows)
        if entry.op == FULL:
            sync.lanes[entry.name] = applied.lanes
            if entry.changed == 0:
                return
        else:
            # the fingerprint follows the change (O(changed)), from the bits read back
            before = sync.lanes.get(entry.name)
            if ready is not None and before is not None and before == ready[0]:
                sync.lanes[entry.name] = ready[1]
            else:
                sync.lanes[entry.name] = _lanes_after(before, applied)
        sync.touched.add(entry.name)

    def _resolver(
        self, plan: SyncPlan, early: EarlyApply, resident: Resident | None, pool: ThreadPoolExecutor
    ) -> Early | None:
        """For a one-step plan, what takes each change decoded while the fetch workers
        decode the changes after it, for a tensor the target offers for reading
        (:meth:`Target.staging`); None where there is no such change.

        Until every object is fetched and verified, a change coded against the old bits is
        completed (:func:`resolve`: ``classed`` positions found, ``ulp-shift`` values
        joined) against the live tensor, so that the apply only writes it; a change that
        does not complete is left as it was, for the apply to refuse with the usual error.
        A reader on its own (``early.alone``) opens the transaction then (:meth:`_open`, as
        :meth:`DeltaReader.apply` would) and applies each change as it comes, those decoded
        before first, completed while the objects arrived where no other sync claimed a
        target meanwhile (:class:`EarlyApply`); any failure from there rolls it back.
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

        def take(entry: Entry, delta: Delta) -> Delta:
            tensor = tensors.get(entry.name)
            if tensor is None:
                return delta
            if early.alone:  # applied as soon as the transaction is open
                early.give(entry, delta)
                return delta
            done = self._resolved_live(entry, delta, tensor) if delta.needs_target else None
            return delta if done is None else done  # with its rows (_follow_rows)

        def ahead(entry: Entry, delta: Delta) -> Delta | None:
            # applied next, under the claim, with nothing written in between
            return self._resolved_live(entry, delta, tensors[entry.name], keep_before=True)

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
        cores = kernel_threads()
        on_host = all(t.device.type == "cpu" for t in tensors.values())
        early.threads = cores if on_host else 1
        early.ahead, early.reads = ahead, self.target
        early.ahead_bytes = int(self._model_bytes(plan) * AHEAD_SHARE)
        return Early(pool, take, verified, max(1, cores - 1), applies_later)

    def _streamer(
        self, plan: SyncPlan, early: EarlyApply, resident: Resident | None, pool: ThreadPoolExecutor
    ) -> Early | None:
        """For a one-step plan of a base, by a reader on its own into a target of canonical
        tensors: what writes each tensor into the target as soon as it is decoded, so that
        the sync holds the model once, not once more decoded (None otherwise).

        The transaction opens before the fetch (:meth:`_open`: the checks of
        :meth:`DeltaReader.apply`); a failure from there, of the fetch too, rolls it back."""
        if not early.alone or not self.target.reads_baseline():
            return None
        preliminary = PreparedVersion(
            plan.goal, plan.previous, plan.versions, 0, 0.0, id(self), resident, (), plan
        )
        sync = self._open(preliminary, early.audit, prepare=False)
        early.threads = 1  # one writer: a target's new tensors are made one at a time
        early.gives_back = True
        early.start(sync, lambda entry, delta: self._change_now(sync, entry, delta))

        def take(entry: Entry, delta: Delta) -> Delta:
            early.give(entry, delta)
            return SPENT  # the version keeps no copy: the target holds it

        return Early(pool, take, lambda: None, max(1, kernel_threads() - 1))

    def _change_now(self, sync: ApplyState, entry: Entry, delta: Delta) -> None:
        """Apply one change while the fetch still decodes others (refused first, as
        :meth:`Transaction.prepare` would refuse it with the rest)."""
        info = info_for(entry.dtype)
        sync.txn.prepare([Change(entry.name, info.torch_dtype, tuple(entry.shape), delta)])
        self._change_entry(sync, entry, delta, owned=True)  # given: the step keeps none
        sync.applied.add(entry.name)

    def _resolved_live(
        self, entry: Entry, delta: Delta, tensor: torch.Tensor, *, keep_before: bool = False
    ) -> Delta | None:
        """``delta`` completed against the live ``tensor`` it lands in (read only), with the
        rows this reader kept; None where it does not fit that tensor or does not complete
        (left to :meth:`DeltaReader.apply`, which refuses it with the usual error).
        ``keep_before``: see :func:`resolve`."""
        spec = (info_for(entry.dtype).torch_dtype, tuple(entry.shape))
        if (tensor.dtype, tuple(tensor.shape)) != spec:
            return None
        try:
            return resolve(self._give_rows(entry, delta, {}), tensor, keep_before=keep_before)
        except (IndexError, DcrError):
            return None

    def _stage(self, step: FetchedStep) -> dict[str, Staged]:
        """Read each xor/overwrite change against the live tensor it lands in (nothing is
        written); a change that does not fit its tensor is left to :meth:`DeltaReader.apply`, which
        refuses it with the usual error."""
        wanted = {e.name: (e, d) for e, d in step.changes if e.op != FULL and e.changed}
        staged: dict[str, _Read] = {}
        trusted = {} if self._verified is None else self._verified.lanes
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
                    bits = stage_change(tensor, done)
                except (IndexError, DcrError):
                    continue
                staged[name] = (
                    tensor,
                    bits,
                    done.rows,
                    _lanes_staged(entry, trusted.get(name), bits),
                    _rows_staged(entry, done.rows, bits),
                    False,
                )
            # shards and other names the target holds in its own storage (their positions
            # there are not canonical: no exponent rows follow them)
            rest = {
                name: Change(name, info_for(e.dtype).torch_dtype, tuple(e.shape), d)
                for name, (e, d) in wanted.items()
                if name not in staged
            }
            placed = self.target.stage_placed(rest) if rest else {}
            for name, (tensor, bits) in placed.items():
                entry = wanted[name][0]
                lanes = _lanes_staged(entry, trusted.get(name), bits)
                staged[name] = (tensor, bits, None, lanes, None, True)
        finally:
            release()
        return _batched(staged)

    def _give_rows(
        self, entry: Entry, delta: Delta, pending: dict[str, tuple[str, np.ndarray]]
    ) -> Delta:
        """``delta`` with the exponent rows of its parent's bits where it is a ``classed``
        change without them and this reader kept them (``pending``: those of this sync's
        earlier versions, else the committed ones), so that :func:`resolve` need not count
        them."""
        if not isinstance(delta, PendingDelta) or delta.classed is None or delta.rows is not None:
            return delta
        kept = pending.get(entry.name) or self._rows.get(entry.name)
        if kept is not None and kept[0] == entry.parent_fingerprint:
            return replace(delta, rows=kept[1])
        return delta

    def _in_turn(self, plan: SyncPlan, early: EarlyApply) -> bool:
        """Whether a sync applies ``plan`` version by version as each is fetched (a reader on
        its own, a plan of several versions)."""
        return early.alone and len(plan.steps) > 1

    def _fetch_and_apply(
        self,
        plan: SyncPlan,
        early: EarlyApply,
        resident: Resident | None,
        pool: ThreadPoolExecutor,
        budget: DecodeBudget,
    ) -> tuple[FetchedStep, ...]:
        """Fetch each version of ``plan`` and apply it before fetching the next, so that a
        sync far behind holds one version decoded, not all of them.

        The transaction opens first (:meth:`_open`: the checks of :meth:`DeltaReader.apply`),
        then :meth:`_apply_in_turn`. Any failure rolls back every version applied so far."""
        preliminary = PreparedVersion(
            plan.goal, plan.previous, plan.versions, 0, 0.0, id(self), resident, (), plan,
            _spend=True,
        )  # fmt: skip
        sync = self._open(preliminary, early.audit, prepare=False)
        early.sync = sync  # a failure of a fetch rolls it back (:meth:`DeltaReader._prepare_for`)
        self._bound_undo(sync, plan)
        try:
            return tuple(self._apply_in_turn(sync, plan.steps, early, pool, budget))
        except BaseException as exc:
            if exc is sync.fetch_failure:
                raise  # rolled back by :meth:`DeltaReader._prepare_for`, raised as it is
            early.sync = None  # rolled back here, as :meth:`DeltaReader.apply` does
            raise self._rolled_back(exc, sync.txn, sync)  # noqa: B904

    def _apply_deferred(self, sync: ApplyState, asked: bool) -> None:
        """Fetch and apply, version by version, the steps :meth:`DeltaReader.prepare` left
        for the apply (a plan of several versions that decode to more than a share of the
        model, :meth:`DeltaReader._held_steps`); ``sync`` has applied those before them."""
        plan = sync.prepared._sync_plan
        assert plan is not None
        deferred = sync.prepared._deferred
        sync.prepared = replace(sync.prepared, _spend=True)  # the prepared steps stay as they were
        sync.done = len(sync.steps)
        budget = SyncBudget(self.decode_budget, self._model_bytes(plan) // 8)
        with ThreadPoolExecutor(self.max_workers) as pool:
            self._apply_in_turn(sync, deferred, EarlyApply(self.group.alone, asked), pool, budget)

    def _bound_undo(self, sync: ApplyState, plan: SyncPlan) -> None:
        """Where the undo of each change of ``plan`` would hold more than half the model,
        keep the undo of each tensor as its bits before the sync first changed it
        (:meth:`Transaction.keep_whole_undo`; a target without canonical tensors, such as a
        module, gives the storage to keep: :meth:`Target.held_storage`), so the undo too is
        bounded by the model, not the plan. Before any change."""
        if _undo_bytes(plan) <= self._model_bytes(plan) // 2:
            return  # the undo of each change is smaller
        storage = None if self.target.reads_baseline() else self.target.held_storage()
        if storage is None:
            sync.txn.keep_whole_undo()
        else:
            sync.txn.keep_whole_undo(storage)

    def _apply_in_turn(
        self,
        sync: ApplyState,
        steps: Sequence[StepPlan],
        early: EarlyApply,
        pool: ThreadPoolExecutor,
        budget: DecodeBudget,
    ) -> list[FetchedStep]:
        """Fetch each of ``steps`` and apply it before fetching the next; a base's tensors
        are written as they are decoded (one writer). A failure to fetch or decode is kept
        as ``sync.fetch_failure``; the caller rolls back."""
        early.threads, early.gives_back = 1, True
        early.start(sync, lambda entry, delta: self._change_now(sync, entry, delta))

        def take(entry: Entry, delta: Delta) -> Delta:
            early.give(entry, delta)
            return SPENT

        streaming = Early(pool, take, lambda: None, max(1, kernel_threads() - 1))
        fetched_steps: list[FetchedStep] = []
        try:
            for step in steps:
                try:
                    fetched = fetch_step(
                        self.store, step, pool.map, budget, early=streaming if step.base else None
                    )
                except BaseException as exc:
                    if not early.failed(exc):
                        sync.fetch_failure = exc
                    raise
                early.finish()  # the changes given are applied before the rest of the version
                sync.txn.prepare([c for c in step_changes(fetched) if c.delta is not SPENT])
                sync.prepared = replace(sync.prepared, _steps=(*sync.prepared._steps, fetched))
                self._change_step(sync, fetched)
                sync.applied.clear()  # the next version changes the same names again
                fetched_steps.append(fetched)
                sync.done += 1
        except BaseException:
            with contextlib.suppress(BaseException):
                early.finish()  # nothing is applied any more when the caller rolls back
            raise
        return fetched_steps

    def _model_bytes(self, plan: SyncPlan) -> int:
        """Bytes of the tensors the goal holds in this reader's target (selected, taken)."""
        return sum(
            math.prod(row.shape) * info_for(row.dtype).width
            for name, row in plan.steps[-1].table.items()
            if self._wants(name, row.dtype, row.shape)
        )


SPENT = DecodedDelta(FULL, None, torch.empty(0, dtype=torch.uint8))  # a change applied


def kernel_threads() -> int:
    """How many threads the host kernels run on (numba's, else torch's)."""
    launch = compiled("_launch")
    return torch.get_num_threads() if launch is None else int(launch.kernel_threads())


def _changes(sync: ApplyState, which: Callable[[str], bool]) -> list[Change]:
    """The changes of ``sync``'s steps to the names ``which`` takes, for
    :meth:`Transaction.prepare`."""
    return [
        Change(e.name, info_for(e.dtype).torch_dtype, tuple(e.shape), d)
        for step in sync.steps
        for e, d in step.changes
        if which(e.name)
    ]


def _lanes_staged(
    entry: Entry, before: tuple[int, ...] | None, bits: StagedChange
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A staged change's lanes before (``before``: those the reader trusts now) and after,
    and the fingerprints of both computed (:func:`fingerprint_of` keeps them), so that the
    checks of the apply compare them without computing them again; None without
    ``before``."""
    if before is None:
        return None
    after = apply_lane_deltas(before, bits.lane_deltas)
    shape = tuple(entry.shape)
    fingerprint_of(entry.dtype, shape, tuple(before))
    fingerprint_of(entry.dtype, shape, after)
    return before, after


def _rows_staged(entry: Entry, rows: np.ndarray | None, bits: StagedChange) -> np.ndarray | None:
    """The exponent rows a staged ``classed`` change leaves (:func:`_follow_rows` reads the
    same bits when it is written), or None where that would not take them."""
    if rows is None or entry.op != XOR or bits.positions.device.type != "cpu":
        return None
    if int(bits.positions.numel()) != entry.changed:
        return None
    return rows_after(
        rows, bits.positions, bits.before, bits.after, info_for(entry.dtype).torch_dtype
    )


_Read = tuple[
    torch.Tensor,
    StagedChange,
    np.ndarray | None,
    tuple[tuple[int, ...], tuple[int, ...]] | None,
    np.ndarray | None,
    bool,
]
"""A change read against its live tensor while staging: the tensor, its bits, the exponent
rows it was resolved against, its lanes before and after, the rows it leaves, and whether
it was read against placed storage (the fields of :class:`Staged` but its batch)."""


def _batched(read: dict[str, _Read]) -> dict[str, Staged]:
    """The changes ``read`` while staging, those of each device and bit width end to end in
    one batch (:func:`batch_staged`), each change a view of its batch, so the apply writes
    each batch in one pass (:meth:`Transaction.put_batch`)."""
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, one in read.items():
        after = one[1].after
        groups.setdefault((after.device, after.dtype), []).append(name)
    out: dict[str, Staged] = {}
    for names in groups.values():
        batch, views = batch_staged([read[n][1] for n in names])
        members = tuple(names)  # one tuple the batch's changes share
        for name, view in zip(members, views, strict=True):
            tensor, _, rows, lanes, rows_after, placed = read[name]
            out[name] = Staged(
                tensor,
                view,
                rows,
                batch=batch,
                names=members,
                lanes=lanes,
                rows_after=rows_after,
                placed=placed,
            )
    return {name: out[name] for name in read}  # in the order they were read


def _undo_bytes(plan: SyncPlan) -> int:
    """About what the undo of each change of ``plan`` would hold (its positions and bits)."""
    total = 0
    for step in plan.steps:
        for _, entry in step.fetch.wanted:
            width = info_for(entry.dtype).width
            total += entry.changed * (width if entry.op == FULL else 8 + width)
    return total


def step_changes(step: FetchedStep) -> list[Change]:
    """The changes of one fetched version, for :meth:`Transaction.prepare`."""
    return [
        Change(e.name, info_for(e.dtype).torch_dtype, tuple(e.shape), d) for e, d in step.changes
    ]


def _follow_rows(
    sync: ApplyState, entry: Entry, applied: Applied, ready: np.ndarray | None = None
) -> None:
    """After a ``classed`` change applied on the host: the exponent rows of the bits it left,
    from those it was resolved against (:attr:`Applied.rows`) and the bits it read and
    wrote at every position (``ready``: those rows, worked out when it was staged from the
    same bits)."""
    sync.rows.pop(entry.name, None)
    if (
        applied.rows is None
        or entry.op != XOR
        or applied.positions is None
        or applied.before is None
        or applied.after is None
        or applied.positions.device.type != "cpu"
        or int(applied.positions.numel()) != entry.changed
    ):
        return
    if ready is None:
        ready = rows_after(
            applied.rows,
            applied.positions,
            applied.before,
            applied.after,
            info_for(entry.dtype).torch_dtype,
        )
    sync.rows[entry.name] = (entry.fingerprint, ready)


def _follow_staged(sync: ApplyState, entry: Entry, staged: Staged) -> None:
    """:meth:`Applying._follow` of a change written as it was staged (its positions, bits
    and lane deltas are those read then; its exponent rows after, and its lanes before
    and after, were worked out then from the same bits)."""
    name = entry.name
    if staged.rows_after is None:  # what _follow_rows finds it cannot follow
        sync.rows.pop(name, None)
    else:
        sync.rows[name] = (entry.fingerprint, staged.rows_after)
    before = sync.lanes.get(name)
    ready = staged.lanes
    if ready is not None and before is not None and before == ready[0]:
        sync.lanes[name] = ready[1]
    elif before is None:
        sync.lanes[name] = None
    else:
        sync.lanes[name] = apply_lane_deltas(before, staged.bits.lane_deltas)
    sync.touched.add(name)


def _lanes_after(before: tuple[int, ...] | None, applied: Applied) -> tuple[int, ...] | None:
    """A tensor's lanes after a change, from its lanes before and what the apply read back
    (None when either is unknown: the tensor is then unverified)."""
    if before is None or applied.positions is None:
        return None
    if applied.lane_deltas is not None:
        return apply_lane_deltas(before, applied.lane_deltas)
    assert applied.before is not None and applied.after is not None
    return lanes_after_change(before, applied.positions, applied.before, applied.after)
