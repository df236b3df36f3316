"""Compiled (numba) kernels of the ``rice`` position coding (:mod:`dcr_format.codings.positions`):
the statistics that choose its parameter, its encoder and its decoder.

Private, imported on first use (:func:`dcr_format.kernels.native.compiled`; numba missing or
``DCR_KERNELS=torch``: the numpy reference in :mod:`~dcr_format.codings.positions` runs). They
reproduce the reference byte for byte (``tests/test_native.py``); the ``classed`` coding
codes each class's ranks with the same encoder and decoder
(:mod:`dcr_format.codings._classed_rice_kernels`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange
from numba.cpython.unsafe.numbers import leading_zeros as _leading_zeros

from dcr_format.kernels._launch import _launch, parallel_kernel
from dcr_format.kernels._native_bits import load_be64

_ONE = np.uint64(1)
_ZERO = np.uint64(0)
_LEADING_ZEROS: Any = _leading_zeros  # an intrinsic: callable in kernels only

_STATS_CHUNK = 1 << 18  # positions per parallel task of the Rice statistics


@njit(cache=True, inline="always")
def _add_shifted(sums, g):  # type: ignore[no-untyped-def]
    """``sums[j] + (g >> j)`` for the six ``j`` from 0 (the sums of gaps a Rice parameter
    is chosen from, kept in registers: a loop over ``j`` into an array was 3.3 ns a gap)."""
    s0, s1, s2, s3, s4, s5 = sums
    return s0 + g, s1 + (g >> 1), s2 + (g >> 2), s3 + (g >> 3), s4 + (g >> 4), s5 + (g >> 5)


@njit(cache=True, inline="always")
def _stats_task(t, pos, klo, part, runs_t, widest_t, head_t, tail_t, best_t):  # type: ignore[no-untyped-def]
    """Task ``t`` of the Rice statistics: its ``_STATS_CHUNK`` positions."""
    n = pos.shape[0]
    lo = t * _STATS_CHUNK
    hi = min(lo + _STATS_CHUNK, n)
    prev = pos[lo - 1] if lo > 0 else -1
    i = lo
    head = 0
    while lo > 0 and i < hi and pos[i] == prev + 1:  # the run open before the task
        prev = pos[i]
        head += 1
        i += 1
    sums = (0, 0, 0, 0, 0, 0)
    runs = 0
    run = 0
    best = 0  # may include the task's last run: the merge takes maxima, so that is safe
    widest = 0
    for j in range(i, hi):  # branch-free: runs start at random places
        gap = pos[j] - prev - 1
        prev = pos[j]
        sums = _add_shifted(sums, gap >> klo)
        start = (gap != 0) | (j == 0)
        runs += start
        run = 1 if start else run + 1
        best = max(best, run)
        widest = max(widest, gap)
    for j in range(6):
        part[t, j] = sums[j]
    runs_t[t] = runs
    widest_t[t] = widest
    head_t[t] = head
    best_t[t] = best
    tail_t[t] = run


@parallel_kernel
def _rice_stats(pos, klo, part, runs_t, widest_t, head_t, tail_t, best_t):  # type: ignore[no-untyped-def]
    """One pass over sorted positions, a task per ``_STATS_CHUNK`` of them in parallel:
    each task's sum(gap >> k) for k in [klo, klo + 5] (summed in registers), runs, largest
    gap, the zero-gap elements it starts with (``head_t``: they continue the run open
    before it), its last run's length and its longest run (merged by :func:`_longest_run`).

    Nothing else in here is an array expression: under the ``workqueue`` threading layer
    each parallel region costs ~0.15 ms to launch, so allocations and reductions are the
    caller's (they were fourteen regions, 2 ms a call).
    """
    for t in prange(part.shape[0]):
        _stats_task(t, pos, klo, part, runs_t, widest_t, head_t, tail_t, best_t)


@njit(cache=True, nogil=True)
def _longest_run(runs_t, head_t, tail_t, best_t):  # type: ignore[no-untyped-def]
    """The longest run over all tasks: a run open at a task's end goes on through the next
    tasks' heads (and through whole tasks that start no run)."""
    longest = 0
    carry = 0  # length of the run open at the end of the tasks so far
    for t in range(runs_t.shape[0]):
        if runs_t[t]:
            longest = max(longest, max(carry + head_t[t], best_t[t]))
            carry = tail_t[t]
        else:
            carry += head_t[t]
    return max(longest, carry)


def rice_stats(pos: np.ndarray, klo: int, khi: int) -> tuple[np.ndarray, int, int, int]:
    """(sum of gap >> k for k in [klo, khi], runs, largest gap, longest run) of positions;
    at most six values of k."""
    if not 0 <= khi - klo <= 5:
        raise ValueError(f"rice_stats sums at most six values of k, not [{klo}, {khi}]")
    tasks = -(-pos.shape[0] // _STATS_CHUNK)
    if tasks == 0:
        return np.zeros(khi - klo + 1, dtype=np.int64), 0, 0, 0
    part = np.zeros((tasks, 6), dtype=np.int64)
    runs_t, widest_t, head_t, tail_t, best_t = np.zeros((5, tasks), dtype=np.int64)
    _launch(
        _rice_stats,
        tasks,
        pos,
        klo,
        part,
        runs_t,
        widest_t,
        head_t,
        tail_t,
        best_t,
    )
    longest = _longest_run(runs_t, head_t, tail_t, best_t)
    if tasks == 1:  # most calls (a small tensor's positions): the task's own row
        return part[0, : khi - klo + 1], int(runs_t[0]), int(widest_t[0]), int(longest)
    sums = part.sum(axis=0)[: khi - klo + 1]
    return sums, int(runs_t.sum()), int(widest_t.max()), int(longest)


@njit(cache=True, inline="always")
def _put(out, at, acc, held, value, bits):  # type: ignore[no-untyped-def]
    """Append ``bits`` (<= 32) bits of ``value`` MSB first; flush whole bytes."""
    acc = (acc << np.uint64(bits)) | np.uint64(value)
    held += bits
    while held >= 8:
        held -= 8
        out[at] = np.uint8((acc >> np.uint64(held)) & np.uint64(0xFF))
        at += 1
    return at, acc, held


@njit(cache=True, nogil=True)
def _rice_encode(pos, k, unary_len, out):  # type: ignore[no-untyped-def]
    n = pos.shape[0]
    prev = -1
    cursor = 0
    for i in range(n):
        gap = pos[i] - prev - 1
        prev = pos[i]
        cursor += gap >> k
        out[cursor >> 3] |= np.uint8(0x80 >> (cursor & 7))
        cursor += 1
    if k == 0:
        return
    mask = (1 << k) - 1
    at = unary_len
    acc = _ZERO
    held = 0
    prev = -1
    for i in range(n):
        gap = pos[i] - prev - 1
        prev = pos[i]
        rem = gap & mask
        if k > 32:
            at, acc, held = _put(out, at, acc, held, rem >> 32, k - 32)
            at, acc, held = _put(out, at, acc, held, rem & 0xFFFFFFFF, 32)
        else:
            at, acc, held = _put(out, at, acc, held, rem, k)
    if held:
        out[at] = np.uint8((acc << np.uint64(8 - held)) & np.uint64(0xFF))


def rice_encode(pos: np.ndarray, k: int, unary_len: int, rem_len: int) -> bytes:
    """Unary bytes then remainder bytes of sorted positions (the header is the caller's)."""
    out = np.zeros(unary_len + rem_len, dtype=np.uint8)
    if pos.shape[0]:
        _rice_encode(pos, k, unary_len, out)
    return out.tobytes()


_TOP = np.uint64(1) << np.uint64(63)
_WINDOW_K = 56  # the widest remainder a word read at any bit offset of its byte holds


@njit(cache=True, inline="always")
def _unary_word(body, at, unary_len):  # type: ignore[no-untyped-def]
    """The unary bytes from ``at`` (at most 8, none past ``unary_len``) as the top of a
    big-endian word, the bits after them zero."""
    size = body.shape[0]
    if at + 8 <= size:
        word = load_be64(body, at)
    else:
        word = _ZERO
        for b in range(8):
            word <<= np.uint64(8)
            if at + b < size:
                word |= np.uint64(body[at + b])
    held = unary_len - at
    if held < 8:
        word &= ~((_ONE << np.uint64(64 - 8 * held)) - _ONE)
    return word


@njit(cache=True, inline="always")
def _remainder(body, rbit, k):  # type: ignore[no-untyped-def]
    """The ``k`` bits of ``body`` from bit ``rbit`` (MSB first): one word read where it fits
    in the array, else bit runs byte by byte."""
    at = rbit >> 3
    if at + 8 <= body.shape[0] and k <= _WINDOW_K:
        word = load_be64(body, at)
        return np.int64((word << np.uint64(rbit & 7)) >> np.uint64(64 - k))
    rem = 0
    need = k
    while need > 0:
        avail = 8 - (rbit & 7)
        take = min(avail, need)
        bits = (np.int64(body[rbit >> 3]) >> (avail - take)) & ((1 << take) - 1)
        rem = (rem << take) | bits
        need -= take
        rbit += take
    return rem


@njit(cache=True, nogil=True)
def _rice_decode(body, unary_len, count, k, numel, out_pos, out_gaps, cumulative):  # type: ignore[no-untyped-def]
    """Decode ``count`` gaps; 0 when the stream is valid, else a non-zero code.

    The codes cover every check of ``rice_gaps`` after its header checks (terminator
    count, trailing bytes, quotient bound) and, with ``cumulative``, those of ``_finish``
    (strictly increasing, no wrap-around, in range). The unary bits go a word (8 bytes) at
    a time, each terminator found by its leading zeros, and each remainder is one shift
    of a word read at its byte (a loop over bytes and bits mispredicted its exits about
    every other position: 4-5 ns a position, against 2.7).
    """
    qmax = numel >> k
    unumel = np.uint64(numel)
    prev_one = np.int64(-1)
    i = 0
    rbit = unary_len * 8
    prev_end = _ZERO
    for at in range(0, unary_len, 8):
        word = _unary_word(body, at, unary_len)
        while word != _ZERO:
            lz = _LEADING_ZEROS(word)
            word ^= _TOP >> np.uint64(lz)
            t = at * 8 + np.int64(lz)
            q = t - prev_one - 1
            prev_one = t
            if i == count:
                return 1
            if k:
                if q > qmax:
                    return 3
                gap = (q << k) | _remainder(body, rbit, k)  # <= 2^63 - 1: q <= numel >> k
                rbit += k
            else:
                gap = q
            if cumulative:
                end = prev_end + np.uint64(gap) + _ONE
                if end <= prev_end or end > unumel:
                    return 4
                out_pos[i] = np.int64(end - _ONE)
                prev_end = end
            else:
                out_gaps[i] = gap
            i += 1
    if i != count:
        return 1
    if unary_len != prev_one // 8 + 1:
        return 2
    return 0


def rice_decode(
    body: np.ndarray, unary_len: int, count: int, k: int, numel: int, *, positions: bool
) -> np.ndarray | None:
    """Positions (int64, ``positions``) or gaps (uint64) of a Rice body; None if invalid."""
    out_pos = np.empty(count if positions else 0, dtype=np.int64)
    out_gaps = np.empty(0 if positions else count, dtype=np.uint64)
    code = _rice_decode(body, unary_len, count, k, numel, out_pos, out_gaps, positions)
    if code:
        return None
    return out_pos if positions else out_gaps
