"""One sync at a time per target in a process (:func:`claim_target`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from dcr_format.errors import TargetBusyError
from dcr_format.targets.protocol import Target


class _Claim:
    """The turn of the syncs of one target in this process: ``users`` waiting or holding."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.owner: int | None = None  # the thread holding it


_CLAIMS: dict[Hashable, _Claim] = {}  # by Target.claim_key; an entry lives while used
_CLAIMS_LOCK = threading.Lock()


def claim_target(target: Target, timeout: float | None) -> Callable[[], None]:
    """Wait until no other sync in this process holds ``target`` (the state it names,
    :meth:`Target.claim_key`), and hold it: from a sync's check that the target is at the
    version it planned from until its commit or rollback. Returns the release (idempotent).

    Raises :class:`TargetBusyError` after ``timeout`` seconds (None: waits for ever).
    Across processes, a directory target also takes its lock file (:meth:`Target.begin`).
    """
    key = target.claim_key()
    with _CLAIMS_LOCK:
        claim = _CLAIMS.setdefault(key, _Claim())
        if claim.owner == threading.get_ident():
            raise TargetBusyError(
                "this thread is already syncing this target; a sync cannot start another "
                "sync of its own target (from a hook or a callback)"
            )
        claim.users += 1

    def leave() -> None:
        with _CLAIMS_LOCK:
            claim.users -= 1
            if claim.users == 0 and _CLAIMS.get(key) is claim:
                del _CLAIMS[key]

    if not claim.lock.acquire(timeout=-1 if timeout is None else timeout):
        leave()
        raise TargetBusyError(
            f"another sync in this process has been applying to this target for over "
            f"{timeout:g} s; wait for it to finish, or sync one target from one thread"
        )
    claim.owner = threading.get_ident()
    released = False

    def release() -> None:
        nonlocal released
        with _CLAIMS_LOCK:
            if released:
                return
            released = True
            claim.owner = None
        claim.lock.release()
        leave()

    return release
