"""Thread pools kept for the life of the process, one per job and size.

A pool made for each call starts its threads again every time, and each new thread's
memory (its malloc arena) is touched afresh: on a 2-core VM a reader's sync at 5% change
took 30,000 more page faults on its second step with a pool per sync than with a kept one
(0.53 against 0.46 s). A kept pool is of no use in a child forked after its threads
started (they are not there, so whatever is queued on it never runs): the child sets its
parent's pools aside and makes its own.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[tuple[str, int], ThreadPoolExecutor] = {}
_LOCK = threading.Lock()
_ORPHANS: list[ThreadPoolExecutor] = []  # a forked child's pools of its parent (_forked)


def _forked() -> None:
    """In a forked child: the parent's pools, whose threads the child does not have, are
    set aside. They are kept, not dropped: an executor's finalizer would wake threads that
    are not there."""
    global _LOCK
    _LOCK = threading.Lock()
    _ORPHANS.extend(_POOLS.values())
    _POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def kept_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` threads for the job ``name`` (its threads' name
    prefix), made on first use and kept for the life of the process."""
    with _LOCK:
        pool = _POOLS.get((name, threads))
        if pool is None:
            pool = _POOLS[(name, threads)] = ThreadPoolExecutor(threads, thread_name_prefix=name)
        return pool


ONE_THREAD_ELEMENTS = 1 << 18
"""A tensor of at most this many elements is coded or applied on one thread, not on a pool:
its work is mostly Python between short compiled calls, so threads that share the
interpreter's lock only hand it to each other. On a 2-vCPU VM, 2,000 tensors of 16K
elements at 1% change published in 1.0 s coded on one thread and in 2.0 s on a pool of
two, and synced in 0.8 s applied on one thread against 1.3 s on two; from about 1M
elements a tensor's compiled work is long enough for the pool to gain. The writer codes
such a tensor on the calling thread itself, in its turn; a sync applies it on its own
thread after the fetch (the fetch jobs keep it meanwhile: handed over as it was decoded,
it woke that thread to take the lock from the decoding)."""


__all__ = ["ONE_THREAD_ELEMENTS", "kept_pool"]
