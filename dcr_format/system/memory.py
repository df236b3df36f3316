"""Giving freed memory back to the system while a large transfer goes on.

glibc keeps the memory a thread frees in that thread's arena: buffers of tens of MiB
decoded on one worker and freed, then allocated again on another, add up to several
times their size in resident memory. :func:`give_back_freed` returns the free pages of
every arena (``malloc_trim``); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable

_lock = threading.Lock()
_trim: list[Callable[[int], int] | None] = []


def _malloc_trim() -> Callable[[int], int] | None:
    with _lock:
        if not _trim:
            found = None
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                found = libc.malloc_trim
                found.argtypes, found.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):  # not glibc
                found = None
            _trim.append(found)
        return _trim[0]


def give_back_freed() -> None:
    """Return the free pages of the C heap to the system (glibc; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
