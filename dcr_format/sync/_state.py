"""What a sync carries from one phase to the next, and the reader state the phases share.

:class:`PreparedVersion` is what the fetch hands to the apply (a version fetched, verified
and decoded, not yet applied); :class:`ApplyState` is one apply in progress (its
transaction, and what the checks and changes found); :class:`VerifiedLanes` are the lanes a
reader verified at its last commit, which the audit policy lets later syncs trust.
:class:`ReaderState` holds the reader's settings and what it keeps between syncs; the phase
modules (``_apply.py``, ``_diagnose.py``, ``_audit.py``, ``_commit.py``) add the
methods that act on it, and :class:`~dcr_format.sync.reader.DeltaReader` runs them in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from dcr_format.chain.chain import Chain, LoadedRecord, TensorState, state_table
from dcr_format.errors import DcrError, TargetError
from dcr_format.format.budget import DecodeBudget
from dcr_format.format.dtypes import info_for
from dcr_format.store.store import Store
from dcr_format.sync._fetch import CheckpointFiles, FetchedStep
from dcr_format.sync._plan import StepPlan, SyncPlan
from dcr_format.sync.group import ReaderGroup
from dcr_format.targets.change import Resident
from dcr_format.targets.protocol import Target, Transaction
from dcr_format.targets.reader_side import Staged


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
    # a sync's apply, opened while the fetch still decoded (Applying._resolver): its
    # changes so far are applied, and DeltaReader.apply goes on with it
    _open: ApplyState | None = field(repr=False, default=None)
    # the goal's checkpoint files for a target that keeps them (None: it keeps none)
    _files: CheckpointFiles | None = field(repr=False, default=None)
    # made by a sync, which applies it once: each change's decoded bits are dropped as soon
    # as it is applied (the steps then no longer hold the version: not applied again)
    _spend: bool = field(repr=False, default=False)

    @property
    def _deferred(self) -> tuple[StepPlan, ...]:
        """The steps of the plan not fetched yet: the apply fetches and applies them in turn
        (:meth:`DeltaReader.prepare` of a plan of several versions that decode to more than
        a share of the model)."""
        if self._sync_plan is None:
            return ()
        return self._sync_plan.steps[len(self._steps) :]

    @property
    def _incremental(self) -> bool:
        return self._sync_plan is not None and self._sync_plan.incremental

    @property
    def _parent_table(self) -> dict[str, TensorState] | None:
        return None if self._sync_plan is None else self._sync_plan.parent_table


@dataclass
class VerifiedLanes:
    """Lanes the reader verified when it committed its last version (FORMAT.md §11.3).

    Valid while the target still reports ``resident``: the reader then trusts them as
    the resident bits' lanes instead of reading every changed tensor again.
    """

    resident: Resident
    lanes: dict[str, tuple[int, ...]]  # as the target reads them (its part, for a TP rank)
    syncs: int = 0  # syncs since the last full audit
    audited: float = field(default_factory=time.monotonic)


@dataclass
class ApplyState:
    """One apply in progress: its transaction and what the checks and changes found."""

    prepared: PreparedVersion
    txn: Transaction
    audited: bool
    known: VerifiedLanes | None  # the lanes trusted instead of read (None: an audit)
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
    # a failure to fetch or decode a version applied in turn (raised as it is)
    fetch_failure: BaseException | None = None

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


class ReaderState:
    """A reader's settings and what it keeps from one sync to the next (set by
    :class:`~dcr_format.sync.reader.DeltaReader`); the phases' methods act on it."""

    store: Store
    chain: Chain
    target: Target
    select: Callable[[str], bool]
    verify: Literal["touched", "all"]
    max_workers: int
    max_shard_bytes: int
    audit_every: int | None
    audit_seconds: float | None
    decode_budget: DecodeBudget
    group: ReaderGroup
    reader_id: str | None
    _last_table: tuple[str, dict[str, TensorState]] | None  # (record sha, table)
    _verified: VerifiedLanes | None
    # exponent rows of the resident bits of tensors the last classed change reached, by
    # name: (fingerprint, rows), so that the next one need not count them (one pass over
    # the tensor); keyed by the fingerprint of the bits they describe
    _rows: dict[str, tuple[str, np.ndarray]]
    # the last reader record written: (reader id, overwrite names, what it says of the old
    # bits read: reads_baseline, baseline_names, baseline_except, reads_changed;
    # time.monotonic() when written)
    _recorded: (
        tuple[
            str,
            frozenset[str],
            tuple[bool, tuple[str, ...] | None, tuple[str, ...] | None, bool],
            float,
        ]
        | None
    )
    # the canonical names of the version last staged (a record's ``baseline_except`` lists
    # those of them whose old bits the target does not read); None: none staged yet
    _version_names: Collection[str] | None

    def _wants(self, name: str, dtype: str, shape: tuple[int, ...]) -> bool:
        """Selected, and a tensor the target takes at all (not another rank's shard)."""
        return self.select(name) and self.target.accepts(
            name, info_for(dtype).torch_dtype, tuple(shape)
        )

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

    def _table_of(self, loaded: LoadedRecord) -> dict[str, TensorState]:
        if self._last_table is not None and self._last_table[0] == loaded.sha256:
            return self._last_table[1]
        return state_table(self.chain.manifests(loaded))


def version_of(resident: Resident | None) -> tuple[str | None, int | None]:
    return (None, None) if resident is None else (resident.chain_id, resident.version)
