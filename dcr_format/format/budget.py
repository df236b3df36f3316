"""A byte budget for decoded shards: parallel decoders wait instead of exceeding it.

A reader inflates several shards at once (one per worker). Each shard's decoded size is
bounded by what its manifest's entries need (:func:`dcr_format.format.shard.stream_limits`),
but a version of many large shards, inflated by many workers, could still hold far more
than the machine has. :class:`DecodeBudget` counts the bytes held: a decoder acquires a
shard's ``decoded_size`` before inflating it and releases it once the decoded streams are
no longer needed, and waits (first come, first served) while the budget is full.

A single shard larger than the whole budget is let through alone, once nothing else is
held, rather than refused: a tensor larger than the budget is legitimate (one shard holds
at least one whole entry) and already passed the reader's per-shard limit.

Decoded arrays count too: an entry's streams may decode to far more bytes than they hold
(a ``rans`` stream of one symbol codes any count in a few bytes, a ``ranges`` run any
length), so :func:`decoded_bytes` of every entry a job decodes is acquired with its shards,
before anything is fetched. Past the budget's ``ceiling`` (default: the machine's physical
memory, which no decode could hold) a request is refused with
:class:`~dcr_format.errors.DecodeLimitError` instead of waiting.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator

from dcr_format.errors import ArgumentError, DecodeLimitError

DEFAULT_DECODE_BUDGET_BYTES = 2 << 30
"""Default cap of decoded shard bytes held at once: 2 GiB, or a quarter of physical memory
on a machine with less than 8 GiB (never under 256 MiB)."""


DEFAULT_CEILING_BYTES = 64 << 30
"""The ceiling where physical memory is unknown (not POSIX)."""

POSITION_BYTES = 8
"""Bytes of one decoded position (int64)."""


def physical_memory() -> int | None:
    """The machine's physical memory in bytes, or None where it is unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def default_budget_bytes() -> int:
    """:data:`DEFAULT_DECODE_BUDGET_BYTES`, lowered to a quarter of physical memory."""
    physical = physical_memory()
    if physical is None:
        return DEFAULT_DECODE_BUDGET_BYTES
    return max(256 << 20, min(DEFAULT_DECODE_BUDGET_BYTES, physical // 4))


def default_ceiling_bytes() -> int:
    """The machine's physical memory (:data:`DEFAULT_CEILING_BYTES` where it is unknown)."""
    physical = physical_memory()
    return DEFAULT_CEILING_BYTES if physical is None else physical


def decoded_bytes(changed: int, width: int, *, positions: bool) -> int:
    """The bytes an entry's streams decode to: ``changed`` values of ``width`` bytes, and
    ``changed`` positions where it has a positions stream."""
    return changed * (width + (POSITION_BYTES if positions else 0))


class DecodeBudget:
    """Thread-safe count of decoded bytes held, capped at ``limit`` bytes.

    ``acquire(n)`` waits until ``n`` more bytes fit (or nothing is held at all: a request
    larger than the limit then goes alone); waiters are served in arrival order, so a large
    request is not starved by small ones. ``hold(n)`` is the context manager form. Share
    one budget between readers of a process to cap them together.

    ``ceiling`` (default :func:`default_ceiling_bytes`): the most bytes one request, or
    what one version of a sync decodes (:meth:`refuse_over`), may ask for; more is refused
    with :class:`~dcr_format.errors.DecodeLimitError`, before anything is allocated.
    """

    gives_back = False
    """Whether a decode job that ends gives the heap pages it freed back to the system: for
    syncs that decode up to the model (a base, a plan of several versions), not for the
    steady state, whose next sync would fault the pages in again."""

    def __init__(self, limit: int | None = None, *, ceiling: int | None = None) -> None:
        limit = default_budget_bytes() if limit is None else limit
        if limit <= 0:
            raise ArgumentError(f"decode budget must be a positive number of bytes, not {limit}")
        ceiling = max(limit, default_ceiling_bytes()) if ceiling is None else ceiling
        if ceiling < limit:
            raise ArgumentError(
                f"decode ceiling ({ceiling} bytes) must be at least the budget ({limit} bytes)"
            )
        self.limit = limit
        self.ceiling = ceiling
        self._cond = threading.Condition()
        self._in_use = 0
        self._peak = 0
        self._queue: deque[int] = deque()
        self._tickets = 0

    @property
    def in_use(self) -> int:
        """Bytes acquired and not yet released."""
        with self._cond:
            return self._in_use

    @property
    def peak(self) -> int:
        """The most bytes held at once since the budget was made."""
        with self._cond:
            return self._peak

    def _fits(self, nbytes: int) -> bool:
        return self._in_use == 0 or self._in_use + nbytes <= self.limit

    def refuse_over(self, nbytes: int, what: str) -> None:
        """Refuse ``what`` (its decoded ``nbytes``) past the ceiling, naming it."""
        if nbytes > self.ceiling:
            raise DecodeLimitError(
                f"{what} would decode to {nbytes} bytes, over the reader's {self.ceiling}-byte "
                "decode ceiling; the manifest is hostile, or raise the ceiling "
                "(DecodeBudget(ceiling=...))"
            )

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> bool:
        """Wait until ``nbytes`` fit, then count them; False if ``timeout`` passed first.
        More than the ceiling is refused (:meth:`refuse_over`)."""
        if nbytes < 0:
            raise ArgumentError(f"cannot acquire {nbytes} bytes")
        self.refuse_over(nbytes, "a decode request")
        with self._cond:
            ticket = self._tickets
            self._tickets += 1
            self._queue.append(ticket)
            try:
                done = self._cond.wait_for(
                    lambda: self._queue[0] == ticket and self._fits(nbytes), timeout
                )
            except BaseException:
                self._queue.remove(ticket)
                self._cond.notify_all()
                raise
            self._queue.remove(ticket)
            if done:
                self._in_use += nbytes
                self._peak = max(self._peak, self._in_use)
            self._cond.notify_all()  # the next in line may fit too
            return bool(done)

    def release(self, nbytes: int) -> None:
        """Give back bytes of an earlier :meth:`acquire`."""
        with self._cond:
            if nbytes < 0 or nbytes > self._in_use:
                raise ValueError(f"releasing {nbytes} bytes, but {self._in_use} are held")
            self._in_use -= nbytes
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` for the ``with`` block (acquired on entry, released on exit)."""
        self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)


__all__ = [
    "DEFAULT_CEILING_BYTES",
    "DEFAULT_DECODE_BUDGET_BYTES",
    "POSITION_BYTES",
    "DecodeBudget",
    "decoded_bytes",
    "default_budget_bytes",
    "default_ceiling_bytes",
    "physical_memory",
]
