"""Compiled (numba) kernels of the ``ulp`` value coding (:mod:`dcr_format.codings.ulp`).

Private, imported on first use (:func:`dcr_format.kernels.native.compiled`). One loop over
the changed elements each way, in place of numpy's half a dozen temporaries: the zigzag ulp
differences of new bits against old ones, and back. Arithmetic is on uint64 with every
operand typed (numba turns mixed signed/unsigned arithmetic into float64), masked to the
width. The step from old bits by a zigzag difference is
:func:`~dcr_format.kernels.numba_kernels.ulp_stepped`, which the fused apply of
:mod:`dcr_format.kernels.numba_kernels` shares; the ``ulp-shift`` loops
(:mod:`dcr_format.codings.ulp_shift`) are below, one pass each way in this thread up to
:data:`ULP_SERIAL` changes and tasks of :data:`ULP_TASK` on numba's threads past it
(:func:`split_low`, :func:`join_low`: the same bytes and errors). Both take the changes 64
at a time: a change whose old exponent is at or above the origin has no shift and ``y_k =
z_k``, so a vector loop copies the group and masks the shifted changes, and only those are
visited (:func:`_shifted`). On the synthetic trainer's 5% step of a 2.9M-element tensor
(145,000 changes, a fifth of a low bit each on average) the join went from 375 to 89 us and
the split from 401 to 114 us; with every change shifted (about 5 low bits each) they cost
8-20% more than one loop.
``tests/test_values_ulp.py`` and ``tests/test_values_ulp_shift.py`` check them against the
numpy references.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from dcr_format.kernels._launch import _launch, parallel_kernel
from dcr_format.kernels._native_bits import TRAILING_ZEROS as _TRAILING_ZEROS
from dcr_format.kernels.numba_kernels import ulp_limits, ulp_order, ulp_stepped

_GROUP = 64  # changes a 64-bit mask of the shifted ones covers

_ONE = np.uint64(1)
_ZERO = np.uint64(0)


@njit(cache=True, nogil=True, inline="always")
def _zigzag(
    before: np.uint64, after: np.uint64, top: np.uint64, ones: np.uint64
) -> np.uint64:  # pragma: no cover - compiled
    """The zigzag of ``u(after) - u(before)`` (FORMAT.md §7.5)."""
    d = (ulp_order(after, top, ones) - ulp_order(before, top, ones)) & ones
    return ((d << _ONE) ^ (ones if d & top else _ZERO)) & ones


@njit(cache=True, nogil=True)
def to_ulp(old: np.ndarray, new: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[k]`` = the zigzag of ``u(new[k]) - u(old[k])`` (FORMAT.md §7.5), all three
    unsigned arrays of one width."""
    top, ones = ulp_limits(old.itemsize)
    for k in range(old.size):
        out[k] = _zigzag(np.uint64(old[k]), np.uint64(new[k]), top, ones)


@njit(cache=True, nogil=True)
def from_ulp(old: np.ndarray, z: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[k]`` = the new bits whose zigzag ulp difference from ``old[k]`` is ``z[k]``
    (the inverse of :func:`to_ulp`)."""
    top, ones = ulp_limits(old.itemsize)
    for k in range(old.size):
        out[k] = ulp_stepped(np.uint64(old[k]), np.uint64(z[k]), top, ones)


@njit(cache=True, nogil=True)
def ulp_of_change(
    new: np.ndarray, positions: np.ndarray, xor: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The writer's side in one loop: ``out[k]`` = :func:`to_ulp` of the old bits
    ``new[p] ^ xor[k]`` and the new bits ``new[p]`` at ``p = positions[k]`` (no gathered
    copy of either)."""
    top, ones = ulp_limits(new.itemsize)
    for k in range(positions.size):
        after = np.uint64(new[positions[k]])
        out[k] = _zigzag(after ^ np.uint64(xor[k]), after, top, ones)


# --- ulp-shift (FORMAT.md §7.6): the writer's counts and split, the reader's join ---


# Each loop below has no branch on the data besides its errors and a flush or refill of 32
# bits every few elements: a branch on the sign of each difference, on its shift and on each
# byte of low bits mispredicted about once an element (split 6.3 to 2.8 ns a change,
# join 3.4 to 2.8).


@njit(cache=True, nogil=True)
def origin_counts(
    old: np.ndarray, z: np.ndarray, shift: int, mask: int, n: np.ndarray, ones: np.ndarray
) -> None:  # pragma: no cover - compiled
    """``n[e]``/``ones[e]`` += the changes whose old exponent field is ``e`` / of them those
    one ulp away (``z`` 1 or 2); both int64 arrays of ``mask + 1`` zeros on entry."""
    for k in range(old.size):
        e = (np.uint64(old[k]) >> np.uint64(shift)) & np.uint64(mask)
        n[e] += 1
        ones[e] += np.int64(np.uint64(z[k]) - _ONE < np.uint64(2))  # z 1 or 2


@njit(cache=True, nogil=True)
def best_origin(
    old: np.ndarray, z: np.ndarray, shift: int, mask: int
) -> int:  # pragma: no cover - compiled
    """:func:`dcr_format.codings.ulp_shift.choose_origin` in one call: the smallest ``e0``
    of greatest gain (integer sums, as the reference's cumsum and argmax), or 0 where no
    gain is positive."""
    n = np.zeros(mask + 1, dtype=np.int64)
    ones = np.zeros(mask + 1, dtype=np.int64)
    origin_counts(old, z, shift, mask, n, ones)
    gain = best = 0
    running = 0
    for e in range(mask + 1):
        running += n[e] - 2 * ones[e]
        if e == 0 or running > gain:  # the first of the greatest, as argmax
            gain, best = running, e
    return best + 1 if gain > 0 else 0


@njit(cache=True, nogil=True, inline="always")
def _shift_of(
    x: np.uint64, origin: int, shift: int, mask: int, cap: int
) -> np.uint64:  # pragma: no cover - compiled
    e = np.int64((x >> np.uint64(shift)) & np.uint64(mask))
    s = max(np.int64(origin) - e, np.int64(0))  # a select, not a branch
    return np.uint64(min(s, np.int64(cap)))


@njit(cache=True, nogil=True, inline="always")
def _signed_pattern(
    zk: np.uint64, top: np.uint64, ones: np.uint64
) -> np.uint64:  # pragma: no cover
    """The difference ``d`` of a zigzag ``zk`` (``width`` bits), sign-extended to 64 bits."""
    d = (zk >> _ONE) ^ (ones & (_ZERO - (zk & _ONE)))
    negative = _ZERO - np.uint64((d & top) != _ZERO)
    return d | (~ones & negative)


ULP_TASK = 1 << 14
"""Changes per task of the ``ulp-shift`` split and join: a tensor with more is split and
joined on several threads, each task's low bits placed from the sum of the shifts before
it (:func:`split_low`, :func:`join_low`)."""

ULP_SERIAL = 1 << 20
"""Changes up to which the split and join are one pass in the calling thread. The tasks
cost more CPU than they save time: with the pass over the shifts that places their low
bits, a change took 4.0-4.3 ns of CPU in tasks on two vCPUs against 2.6-2.8 ns in one pass,
and only 0.75-0.8x the time (150,000 to 2,000,000 changes, OpenMP with a passive wait;
measured before the passes visited only the shifted changes, which made one pass the
cheaper still). A reader's and a writer's other work fills the second core, so the tasks
pay only past a million changes, where one tensor's pass is long enough to hold up a
step."""


@njit(cache=True, nogil=True, inline="always")
def _task_span(t: int, n: int) -> tuple[int, int]:  # pragma: no cover - compiled
    lo = t * ULP_TASK
    return lo, min(lo + ULP_TASK, n)


@njit(cache=True, nogil=True, inline="always")
def _shift_sum(t, old, origin, shift, mask, cap, sums):  # type: ignore[no-untyped-def]
    lo, hi = _task_span(t, old.size)
    total = _ZERO
    for k in range(lo, hi):
        total += _shift_of(np.uint64(old[k]), origin, shift, mask, cap)
    sums[t] = np.int64(total)


@parallel_kernel
def _shift_sums(old, origin, shift, mask, cap, sums):  # type: ignore[no-untyped-def]
    for t in prange(sums.size):
        _shift_sum(t, old, origin, shift, mask, cap, sums)


@njit(cache=True, nogil=True, inline="always")
def _copy_masked(old, src, dst, k0, span, origin, shift, mask, cap):  # type: ignore[no-untyped-def]
    m = _ZERO
    for q in range(span):
        e = np.uint64(k0 + q)  # unsigned: no wrap-around check
        dst[e] = src[e]
        s = _shift_of(np.uint64(old[e]), origin, shift, mask, cap)
        m |= np.uint64(s != _ZERO) << np.uint64(q)
    return m


@njit(cache=True, nogil=True, inline="always")
def _shifted(old, src, dst, k0, hi, origin, shift, mask, cap):  # type: ignore[no-untyped-def]
    """Copies ``src`` to ``dst`` for the changes from ``k0`` (64 of them, or those up to
    ``hi``) and returns the mask of those with a shift (bit ``q``: change ``k0 + q``): a
    change without one has ``y_k = z_k``, so only the mask's set bits are visited after
    this branch-free loop, which the compiler turns into vector operations (most changes
    of a stream have no shift: its origin is chosen so)."""
    if k0 + _GROUP <= hi:  # a whole group: a loop of fixed length
        return _copy_masked(old, src, dst, k0, _GROUP, origin, shift, mask, cap)
    return _copy_masked(old, src, dst, k0, hi - k0, origin, shift, mask, cap)


@njit(cache=True, nogil=True, inline="always")
def _put(low, heads, t, first, at, value):  # type: ignore[no-untyped-def]
    """Byte ``at`` of task ``t``'s low bits: its first byte where that is shared with the
    task before (``first``) goes to ``heads[t]`` (ORed in after every task is done), any
    other byte straight into ``low``, which no other task writes."""
    if at == first:
        heads[t] = value
    else:
        low[at] = value


@njit(cache=True, nogil=True, inline="always")
def _split_task(t, lo, hi, old, z, origin, shift, mask, cap, y, low, starts, heads):  # type: ignore[no-untyped-def]
    """Task ``t`` of :func:`split_shifted`, changes ``lo`` to ``hi``: their ``y`` and low
    bits, the low bits from bit ``starts[t]`` of ``low`` on (the bits of the tasks before
    it below); returns the byte after its last."""
    top, ones = ulp_limits(old.itemsize)
    wide = cap > 32
    start = starts[t]
    used = start >> 3
    held = np.uint64(start & 7)  # the bits of the task before, zero in ``acc``
    first = used if held else -1
    acc = _ZERO
    k0 = lo
    while k0 < hi:  # 64 changes at a time: only those with a shift are visited
        m = _shifted(old, z, y, k0, hi, origin, shift, mask, cap)
        while m != _ZERO:
            k = np.uint64(k0) + np.uint64(_TRAILING_ZEROS(m))
            m &= m - _ONE
            s = _shift_of(np.uint64(old[k]), origin, shift, mask, cap)
            d = _signed_pattern(np.uint64(z[k]), top, ones)
            sign = _ZERO - (d >> np.uint64(63))
            q = (d >> s) | (~(~_ZERO >> s) & sign)  # arithmetic shift
            y[k] = ((q << _ONE) ^ (_ZERO - (q >> np.uint64(63)))) & ones
            acc |= (d & ((_ONE << s) - _ONE)) << held  # held < 32 (or < 8 where wide)
            held += s
            if wide:
                while held >= 8:
                    _put(low, heads, t, first, used, acc & np.uint64(0xFF))
                    used += 1
                    acc >>= np.uint64(8)
                    held -= np.uint64(8)
            elif held >= 32:
                if used == first:  # the first word only: its first byte is shared
                    for b in range(4):
                        word = (acc >> np.uint64(8 * b)) & np.uint64(0xFF)
                        _put(low, heads, t, first, used + b, word)
                else:  # four plain stores, which the compiler merges into one
                    for b in range(4):
                        low[used + b] = (acc >> np.uint64(8 * b)) & np.uint64(0xFF)
                used += 4
                acc >>= np.uint64(32)
                held -= np.uint64(32)
        k0 += _GROUP
    while held > _ZERO:
        _put(low, heads, t, first, used, acc & np.uint64(0xFF))
        used += 1
        acc >>= np.uint64(8)
        held -= min(held, np.uint64(8))
    return used


@parallel_kernel
def _split(old, z, origin, shift, mask, cap, y, low, starts, heads):  # type: ignore[no-untyped-def]
    for t in prange(starts.size):
        lo, hi = _task_span(t, old.size)
        _split_task(t, lo, hi, old, z, origin, shift, mask, cap, y, low, starts, heads)


@njit(cache=True, nogil=True)
def split_shifted(
    old: np.ndarray,
    z: np.ndarray,
    origin: int,
    shift: int,
    mask: int,
    cap: int,
    y: np.ndarray,
    low: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """``y[k] = zigzag(d_k >> s_k)`` and the ``s_k`` low bits of every ``d_k`` packed into
    ``low`` (uint8, at least ``ceil(sum(s_k) / 8)`` bytes) from the zigzag ulp differences
    ``z`` of the old bits ``old``, in this thread; returns the bytes of ``low`` used. The
    low bits gather in a word and go out 32 at a time where a shift is at most 32 bits
    (every float but float64), else a byte at a time."""
    starts = np.zeros(1, dtype=np.int64)
    heads = np.zeros(1, dtype=np.uint8)
    used = _split_task(0, 0, old.size, old, z, origin, shift, mask, cap, y, low, starts, heads)
    return int(used)


def _starts(
    old: np.ndarray, origin: int, shift: int, mask: int, cap: int
) -> tuple[np.ndarray, int]:
    """Each task's first bit of the low bits, and the bits of all of them."""
    tasks = -(-old.size // ULP_TASK)
    sums = np.empty(tasks, dtype=np.int64)
    _launch(_shift_sums, tasks, old, origin, shift, mask, cap, sums)
    starts = np.zeros(tasks, dtype=np.int64)
    np.cumsum(sums[:-1], out=starts[1:])
    return starts, int(starts[-1] + sums[-1])


def split_low(
    old: np.ndarray,
    z: np.ndarray,
    origin: int,
    shift: int,
    mask: int,
    cap: int,
    y: np.ndarray,
    low: np.ndarray,
) -> int:
    """:func:`split_shifted`, past :data:`ULP_SERIAL` changes on several threads (the same
    bytes)."""
    if old.size <= ULP_SERIAL:
        return int(split_shifted(old, z, origin, shift, mask, cap, y, low))
    starts, total = _starts(old, origin, shift, mask, cap)
    heads = np.zeros(starts.size, dtype=np.uint8)
    args = (old, z, origin, shift, mask, cap, y, low, starts, heads)
    _launch(_split, starts.size, *args)
    for t in np.flatnonzero(starts & 7).tolist():  # bytes two tasks share
        low[starts[t] >> 3] |= heads[t]
    return (total + 7) // 8


@njit(cache=True, nogil=True, inline="always")
def _join_task(t, lo, hi, old, y, origin, shift, mask, cap, low, z, starts, errors):  # type: ignore[no-untyped-def]
    """Task ``t`` of :func:`join_shifted`, changes ``lo`` to ``hi``: their ``z`` from ``y``
    and the low bits from bit ``starts[t]`` on; ``errors[t]`` its first error (0: none), and
    for the last task the check of what follows the low bits. The changes go 64 at a time
    (:func:`_shifted`); only those with a shift take low bits, and only they can fail."""
    top, ones = ulp_limits(old.itemsize)
    width = np.uint64(8 * old.itemsize)
    size = low.size
    start = starts[t]
    used = start >> 3
    acc, held = _ZERO, _ZERO
    skip = np.uint64(start & 7)
    if skip and used < size:  # the rest of a byte the task before began
        acc = np.uint64(low[used]) >> skip
        held = np.uint64(8) - skip
        used += 1
    errors[t] = 0
    k0 = lo
    while k0 < hi:
        m = _shifted(old, y, z, k0, hi, origin, shift, mask, cap)
        while m != _ZERO:
            k = np.uint64(k0) + np.uint64(_TRAILING_ZEROS(m))
            m &= m - _ONE
            s = _shift_of(np.uint64(old[k]), origin, shift, mask, cap)
            yk = np.uint64(y[k])
            if width - s < np.uint64(64) and yk >> (width - s):
                errors[t] = 1
                return
            # held < 32 here (a refill leaves fewer than 32 once the shift is taken, the
            # byte loop fewer than 8), so the 32 bits read fit the word above it
            if held < s and used + 4 <= size:
                word = _ZERO
                for b in range(4):
                    word |= np.uint64(low[used + b]) << np.uint64(8 * b)
                acc |= word << held
                used += 4
                held += np.uint64(32)
            while held < s:
                if used >= size:
                    errors[t] = 2
                    return
                acc |= np.uint64(low[used]) << held
                used += 1
                held += np.uint64(8)
            bits = acc & ((_ONE << s) - _ONE)
            acc >>= s
            held -= s
            q = (yk >> _ONE) ^ (_ZERO - (yk & _ONE))
            d = ((q << s) | bits) & ones
            z[k] = ((d << _ONE) ^ (ones & (_ZERO - ((d & top) >> (width - _ONE))))) & ones
        k0 += _GROUP
    # after the last task every byte given must hold bits of the shifts, the last one's
    # padding zero
    if t == starts.size - 1 and (used != size or acc or held >= np.uint64(8)):
        errors[t] = 3


@parallel_kernel
def _join(old, y, origin, shift, mask, cap, low, z, starts, errors):  # type: ignore[no-untyped-def]
    for t in prange(starts.size):
        lo, hi = _task_span(t, old.size)
        _join_task(t, lo, hi, old, y, origin, shift, mask, cap, low, z, starts, errors)


@njit(cache=True, nogil=True)
def join_shifted(
    old: np.ndarray,
    y: np.ndarray,
    origin: int,
    shift: int,
    mask: int,
    cap: int,
    low: np.ndarray,
    z: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """The inverse of :func:`split_shifted`, in this thread: ``z[k]`` the zigzag ulp
    differences. Returns 0, or 1 for a ``y_k`` too large for its shift, 2 for low bits that
    end early, 3 for bytes or nonzero padding bits after them (FORMAT.md §7.6). The low bits
    come into a word 32 at a time while 4 bytes are left, then byte by byte; an element's
    errors are checked in the same order as byte by byte throughout (the read ahead never
    fails)."""
    starts = np.zeros(1, dtype=np.int64)
    errors = np.zeros(1, dtype=np.int64)
    _join_task(0, 0, old.size, old, y, origin, shift, mask, cap, low, z, starts, errors)
    return int(errors[0])


def join_low(
    old: np.ndarray,
    y: np.ndarray,
    origin: int,
    shift: int,
    mask: int,
    cap: int,
    low: np.ndarray,
    z: np.ndarray,
) -> int:
    """:func:`join_shifted`, past :data:`ULP_SERIAL` changes on several threads: the same
    ``z`` and the same error (each task stops at its first; the first task's with one
    decides, as one pass in order would)."""
    if old.size <= ULP_SERIAL:
        return int(join_shifted(old, y, origin, shift, mask, cap, low, z))
    starts, _ = _starts(old, origin, shift, mask, cap)
    errors = np.zeros(starts.size, dtype=np.int64)
    args = (old, y, origin, shift, mask, cap, low, z, starts, errors)
    _launch(_join, starts.size, *args)
    failed = np.flatnonzero(errors)
    return int(errors[failed[0]]) if failed.size else 0
