"""Audit policy: when a sync reads the resident bits in full, and which lanes it trusts.

With ``verify="touched"`` a long-lived reader checks the bits before a change against the
lanes it verified when it committed the resident version (FORMAT.md §11.3); it reads every
selected resident tensor in full (an audit) at its first sync, every ``audit_every`` syncs,
after ``audit_seconds``, when the resident version is not the one it committed, and when
asked.
"""

from __future__ import annotations

import time

from dcr_format.sync._diagnose import Diagnosing
from dcr_format.sync._state import ApplyState, VerifiedLanes, version_of
from dcr_format.targets.change import Resident

AUDIT_EVERY = 100  # syncs between full audits of the resident bits (FORMAT.md §11.3)
AUDIT_SECONDS = 3600.0  # and at least this often


class Auditing(Diagnosing):
    """Whether a sync audits, and the lanes the next sync may trust."""

    def _audit_due(self, resident: Resident | None, asked: bool) -> bool:
        """Whether this sync reads the resident bits in full instead of trusting the lanes
        verified at the previous sync (FORMAT.md §11.3)."""
        known = self._verified
        if asked or self.verify == "all" or known is None:
            return True
        if version_of(known.resident) != version_of(resident):
            return True
        if self.audit_every is not None and known.syncs + 1 >= self.audit_every:
            return True
        return (
            self.audit_seconds is not None
            and time.monotonic() - known.audited >= self.audit_seconds
        )

    def _remember(self, sync: ApplyState, found: dict[str, tuple[int, ...]]) -> None:
        """After a commit: the lanes the next sync may trust (FORMAT.md §11.3)."""
        known, final = sync.known, sync.goal.table
        if known is not None and sync.prepared._incremental:
            kept = {n: v for n, v in known.lanes.items() if n in final and n not in sync.touched}
            self._verified = VerifiedLanes(
                sync.resident, {**kept, **found}, known.syncs + 1, known.audited
            )
        else:  # an audit, or a plan from a base: everything held was read or written in full
            self._verified = VerifiedLanes(sync.resident, dict(found))
