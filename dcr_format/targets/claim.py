"""One sync at a time per target in a process (:func:`claim_target`), and a mark that
tells whether any claim was made since (:func:`claim_mark`, :func:`claims_since`)."""

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
_MADE = [0]  # claims taken in this process so far, of any target (under _CLAIMS_LOCK)


def claim_mark(target: Target) -> int | None:
    """A mark of the claims taken in this process so far, where no sync holds ``target``
    now (None where one does). A read of the target's tensors made after the mark saw bits
    no sync was changing, as long as :func:`claims_since` of it is 0 (or 1 once the reader
    itself holds the claim): a sync changes the tensors only after it took its claim."""
    with _CLAIMS_LOCK:
        claim = _CLAIMS.get(target.claim_key())
        if claim is not None and claim.owner is not None:
            return None
        return _MADE[0]


def claims_since(mark: int) -> int:
    """How many claims of any target this process took since :func:`claim_mark` gave
    ``mark``."""
    with _CLAIMS_LOCK:
        return _MADE[0] - mark


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
    with _CLAIMS_LOCK:
        claim.owner = threading.get_ident()
        _MADE[0] += 1
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
