"""The checks of a sync, and the errors that name what went wrong.

Before anything changes, every delta must land on exactly the bits it was made against
(:meth:`Diagnosing._check_baseline`, FORMAT.md §11.4 step 2); after the changes, the target
must hold the goal's fingerprints and nothing else it selects (:meth:`Diagnosing._verify_goal`,
step 3). A mismatch after applying onto lanes trusted from the previous sync is diagnosed
once the changes are undone (:meth:`Diagnosing._diagnose`): a target edited outside dcr is
named as such (:class:`~dcr_format.errors.BaselineMismatchError`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from dcr_format.chain.chain import TensorState
from dcr_format.delta.fingerprint import fingerprint_from_lanes
from dcr_format.errors import (
    BaselineMismatchError,
    FingerprintMismatchError,
    IntegrityError,
    StalePreparedError,
    TargetError,
)
from dcr_format.format.dtypes import bits_view, info_for
from dcr_format.sync._plan import SyncPlan
from dcr_format.sync._state import ApplyState, PreparedVersion, ReaderState, version_of
from dcr_format.targets.change import Resident
from dcr_format.targets.protocol import Transaction


class Diagnosing(ReaderState):
    """The reader's checks of its target before and after the changes."""

    def _check_fresh(self, prepared: PreparedVersion) -> Resident | None:
        """The target still holds what ``prepared`` was planned from (else nothing changes)."""
        resident = self._resident()
        if version_of(resident) != version_of(prepared._resident):
            raise StalePreparedError(
                f"the target moved from version {prepared.previous} to "
                f"{version_of(resident)[1]} since version {prepared.version} was prepared; "
                "prepare it again"
            )
        return resident

    def _check_target(self, sync: ApplyState) -> None:
        """Before mutating: the baseline checks."""
        plan = sync.prepared._sync_plan
        assert plan is not None
        self._check_baseline(sync, plan, plan.parent_table if sync.audited else None)
        sync.touched = set(sync.lanes)  # the names deltas change (their lanes follow them)

    def _verify_goal(self, sync: ApplyState) -> dict[str, tuple[int, ...]]:
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

    def _diagnose(
        self, exc: FingerprintMismatchError, sync: ApplyState
    ) -> IntegrityError | StalePreparedError:
        """A mismatch after applying: was the target edited outside dcr?

        The in-place changes are undone already. A solo reader with lanes trusted from the
        previous sync reads those tensors in full and blames the target when they differ
        from the resident version. Where the target is not found edited but a change staged
        while preparing read other bits than it holds now (an edit made before the
        preparation and undone since), the preparation is stale
        (:class:`StalePreparedError`: prepare it again).
        """
        table = sync.prepared._parent_table
        solo = self.group.alone and table is not None
        if solo and sync.trusted:
            assert table is not None
            raw: dict[str, tuple[int, ...]] = {}
            for name in sorted(sync.trusted):
                value = sync.txn.lanes(name)
                if value is not None:
                    raw[name] = value
            bad, _ = _mismatches(
                sync.txn, raw, lambda n: _expected(table[n]) if n in table else None
            )
            if bad:
                return BaselineMismatchError(
                    f"tensor {bad[0]!r} in the target is not the bits of version "
                    f"{sync.prepared.previous}; it was changed outside dcr since the last sync "
                    "(nothing was applied): pull into a fresh target"
                )
        stale = _stale_staging(sync.prepared)
        if stale:
            return StalePreparedError(
                f"version {sync.prepared.version} was prepared while tensor {stale[0]!r} held "
                "other bits than it holds now (nothing was applied): prepare it again"
            )
        if not solo:
            return FingerprintMismatchError(
                f"{exc} (or the target was changed outside dcr since the last sync: "
                "sync(audit=True) tells which)"
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
        self, sync: ApplyState, plan: SyncPlan, audit_table: dict[str, TensorState] | None
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

    def _resident_lanes(self, sync: ApplyState, name: str, raw: dict[str, tuple[int, ...]]) -> None:
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


class FingerprintCache:
    """The fingerprints :func:`fingerprint_of` computed, those used most recently kept first:
    ``floor`` of them, and as many more as :meth:`reserve` asks for.

    A preparation computes the fingerprints of each staged tensor's lanes before and
    after its change, for the checks of the pause to find; a cache smaller than those
    (two a tensor) would drop each of them before its check asks for it, so a reader
    reserves room for every tensor of the versions it plans (:meth:`reserve`)."""

    def __init__(self, floor: int) -> None:
        self.floor = self.capacity = floor
        self._held: OrderedDict[tuple[str, tuple[int, ...], tuple[int, ...]], str] = OrderedDict()
        self._lock = threading.Lock()

    def reserve(self, count: int) -> None:
        """Keep ``count`` fingerprints more than the floor from now on (the capacity never
        shrinks)."""
        with self._lock:
            self.capacity = max(self.capacity, self.floor + count)

    def get(self, dtype: str, shape: tuple[int, ...], lanes: tuple[int, ...]) -> str:
        """The fingerprint of a tensor of dtype name ``dtype``, ``shape`` and ``lanes``."""
        key = (dtype, shape, lanes)
        with self._lock:
            found = self._held.get(key)
            if found is not None:
                self._held.move_to_end(key)
                return found
        found = fingerprint_from_lanes(info_for(dtype).torch_dtype, shape, lanes)
        with self._lock:
            self._held[key] = found
            while len(self._held) > self.capacity:
                self._held.popitem(last=False)
        return found

    def __len__(self) -> int:
        return len(self._held)


FINGERPRINTS = FingerprintCache(1 << 14)
"""The process's cache of :func:`fingerprint_of` (every reader's)."""

FINGERPRINTS_PER_TENSOR = 2
"""Fingerprints a reader keeps room for per tensor it plans, above the cache's floor
(:meth:`FingerprintCache.reserve`): those of its lanes before and after a change (the
lanes after are the next version's before). About 370 bytes each."""


def fingerprint_of(dtype: str, shape: tuple[int, ...], lanes: tuple[int, ...]) -> str:
    """:func:`fingerprint_from_lanes` of a tensor of dtype name ``dtype`` (a pure function:
    the fingerprints of the lanes a commit verified, and of the lanes a prepared version
    leaves, are computed once, not again in the pause that checks them; kept in
    :data:`FINGERPRINTS`)."""
    return FINGERPRINTS.get(dtype, shape, lanes)


def reserve_fingerprints(tensors: int) -> None:
    """Keep room in :data:`FINGERPRINTS` for the fingerprints of ``tensors`` tensors."""
    FINGERPRINTS.reserve(FINGERPRINTS_PER_TENSOR * tensors)


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
            if fingerprint_of(dtype, tuple(shape), tuple(whole)) != fingerprint:
                bad.append(name)
    return bad, incomplete


def _stale_staging(prepared: PreparedVersion) -> list[str]:
    """The names whose change staged while preparing read bits (``before``) other than the
    live tensor holds now, sorted."""
    staged = prepared._staged
    if not isinstance(staged, dict):
        return []
    stale = []
    for name, item in staged.items():
        flat = bits_view(item.tensor).reshape(-1)
        positions = item.bits.positions.to(flat.device)
        if not torch.equal(flat[positions], item.bits.before.to(flat.device)):
            stale.append(name)
    return sorted(stale)
