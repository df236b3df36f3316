"""Compiled (numba) CPU kernels of one tensor's change: fingerprint lanes, the fused diff
and the fused apply (and the ``ulp`` step that apply and the ``ulp`` coding share).

Private. Nothing imports this module eagerly: :func:`dcr_format.kernels.native.native_kernels`
imports it on first use (and ``DCR_KERNELS=torch`` never does), so ``import dcr_format``
works, and starts fast, without numba. Every kernel is compiled on its first call for
the array types it sees and cached on disk (``cache=True``: next to this file, or in
numba's user cache directory where that is read-only), so a new process loads
machine code instead of recompiling. The codings' own kernels live with their codings
(:mod:`dcr_format.codings`, modules ``_<coding>_kernels``).

The torch code in :mod:`dcr_format.delta.fingerprint` and :mod:`dcr_format.kernels.reference`
stays the reference; these kernels reproduce it bit for bit (``tests/test_native.py``).
Arithmetic is uint64 or int64 throughout (numba turns mixed signed/unsigned 64-bit
arithmetic into float64, so every constant is typed), and every fingerprint sum is reduced
before it can reach 2^64.

Every kernel releases the GIL (``nogil``), so reader threads decode streams at the same
time. numba picks its threading layer as usual (TBB, else OpenMP, else its own
``workqueue``). Each parallel kernel is one body compiled in parallel and serially
(:func:`~dcr_format.kernels._launch.parallel_kernel`), and
:func:`~dcr_format.kernels._launch._launch` chooses between the two.
"""

from __future__ import annotations

import mmap
import threading
from typing import Any, NamedTuple

import numpy as np
from numba import njit, prange
from numba.np.numpy_support import carray  # numba.carray, which its stubs do not export

from dcr_format.kernels._launch import _launch, parallel_kernel, renamed
from dcr_format.kernels._native_bits import (
    CLASSES,
    class_masks,
    pointer_to,
    popcount,
    prefetch_write,
)
from dcr_format.kernels._native_bits import TRAILING_ZEROS as _TRAILING_ZEROS

# --- fingerprint constants (dcr_format.delta.fingerprint: _PRIMES, _C) ------------------------
_P0 = np.uint64(2147483647)
_P1 = np.uint64(2147483629)
_P2 = np.uint64(2147483587)
_C0 = np.uint64(1013904223)
_C1 = np.uint64(22695477)
_C2 = np.uint64(134775813)
_M0 = np.uint64((1 << 32) % 2147483647)  # 2^32 mod p: the high half of an 8-byte symbol
_M1 = np.uint64((1 << 32) % 2147483629)
_M2 = np.uint64((1 << 32) % 2147483587)
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_ONE = np.uint64(1)
_ZERO = np.uint64(0)
_MASK30 = (1 << 30) - 1  # r = (i mod 2^30) + 1 = (i & _MASK30) + 1 for any int64 i
_ROW = 1 << 16  # full pass: rows aligned to multiples of 2^16 never straddle 2^30
# Positions per parallel task of the position-driven kernels. At 1% a tensor under 2^16 / 0.01
# elements (most of a model's) gave one task at 2^16 and ran on one core; at 2^13 a 1 GB step
# applies in about 0.08 s against 0.11 (2 cores).
_CHUNK = 1 << 13
_GATHER_BLOCK = 1 << 10  # positions whose old bits a change reads ahead of changing them


# --- g = (s + c)^5 mod p --------------------------------------------------------------


@njit(cache=True, inline="always")
def _pow5(s, p, c):  # type: ignore[no-untyped-def]
    x = (s + c) % p
    x2 = x * x % p
    return x2 * x2 % p * x % p


@njit(cache=True, inline="always")
def _residue(v, p, m):  # type: ignore[no-untyped-def]
    """v mod p of a uint64 as ((hi mod p) * (2^32 mod p) + lo) mod p."""
    return ((v >> _S32) % p * m + (v & _LO32)) % p


@njit(cache=True, inline="always")
def _g(v, lane, table):  # type: ignore[no-untyped-def]
    """g of lane ``lane`` of the uint64 symbol ``v``; ``table`` non-empty for widths 1, 2."""
    if table.shape[0] != 0:
        return np.uint64(table[v, lane])  # an unsigned index: no wrap-around check
    if lane == 0:
        return _pow5(_residue(v, _P0, _M0), _P0, _C0)
    if lane == 1:
        return _pow5(_residue(v, _P1, _M1), _P1, _C1)
    return _pow5(_residue(v, _P2, _M2), _P2, _C2)


@njit(cache=True, inline="always")
def _prime(lane):  # type: ignore[no-untyped-def]
    if lane == 0:
        return _P0
    if lane == 1:
        return _P1
    return _P2


@njit(cache=True, inline="always")
def _combine(s0, s1, start, p):  # type: ignore[no-untyped-def]
    """sum g*r of a row from sum g and sum g*col; ``start`` is the row's first flat index."""
    base = np.uint64((start & _MASK30) + 1)
    return (s1 % p + (base % p) * (s0 % p)) % p


# --- full fingerprint pass --------------------------------------------------------------


@njit(cache=True, inline="always")
def _row_span(r, first, n):  # type: ignore[no-untyped-def]
    """Row ``r`` of a symbol run starting at flat index ``first``, ``n`` symbols long.

    Returns the row's first flat index, the run's slice [lo, hi) inside the row and the
    column of the slice's first symbol.
    """
    start = (first // _ROW + r) * _ROW
    lo = max(start - first, 0)
    hi = min(start + _ROW - first, n)
    return start, lo, hi, lo + first - start


@njit(cache=True, inline="always")
def _rows_table_task(r, sym, table, first, out):  # type: ignore[no-untyped-def]
    """Row ``r`` of 2^16 flat indices: both lanes of 1- and 2-byte symbols, by table."""
    start, lo, hi, skip = _row_span(r, first, sym.shape[0])
    seg = sym[lo:hi]  # indices from range(len): numba drops its wrap-around checks
    a0 = a1 = b0 = b1 = _ZERO
    for j in range(seg.shape[0]):
        t = np.uint64(seg[j])
        col = np.uint64(j + skip)
        ga = np.uint64(table[t, 0])
        gb = np.uint64(table[t, 1])
        a0 += ga
        a1 += ga * col  # sum g*col < 2^31 * 2^32 / 2: no overflow
        b0 += gb
        b1 += gb * col
    out[r, 0] = _combine(a0, a1, start, _P0)
    out[r, 1] = _combine(b0, b1, start, _P1)


@parallel_kernel
def _rows_table(sym, table, first, out):  # type: ignore[no-untyped-def]
    for r in prange(out.shape[0]):
        _rows_table_task(r, sym, table, first, out)


@njit(cache=True, inline="always")
def _rows_power_task(r, sym, lanes, first, out):  # type: ignore[no-untyped-def]
    """Row ``r`` of 2^16 flat indices: the lanes of 4- and 8-byte symbols, g computed."""
    start, lo, hi, skip = _row_span(r, first, sym.shape[0])
    seg = sym[lo:hi]
    a0 = a1 = b0 = b1 = c0 = c1 = _ZERO
    for j in range(seg.shape[0]):
        v = np.uint64(seg[j])
        col = np.uint64(j + skip)
        g = _pow5(_residue(v, _P0, _M0), _P0, _C0)
        a0 += g
        a1 += g * col
        g = _pow5(_residue(v, _P1, _M1), _P1, _C1)
        b0 += g
        b1 += g * col
        if lanes == 3:
            g = _pow5(_residue(v, _P2, _M2), _P2, _C2)
            c0 += g
            c1 += g * col
    out[r, 0] = _combine(a0, a1, start, _P0)
    out[r, 1] = _combine(b0, b1, start, _P1)
    if lanes == 3:
        out[r, 2] = _combine(c0, c1, start, _P2)


@parallel_kernel
def _rows_power(sym, lanes, first, out):  # type: ignore[no-untyped-def]
    for r in prange(out.shape[0]):
        _rows_power_task(r, sym, lanes, first, out)


def _row_count(n: int, first: int) -> int:
    if n == 0:
        return 0
    return (first + n - 1) // _ROW - first // _ROW + 1


_PRIMES = (int(_P0), int(_P1), int(_P2))


def _finish_lanes(out: np.ndarray, lanes: int) -> tuple[int, ...]:
    """Sum per-task residues (each below 2^31, so a uint64 sum is exact) modulo each prime."""
    if out.shape[0] == 1:  # one task (most tensors): its residues are the sums
        return tuple(out[0, :lanes].tolist())
    sums = out.sum(axis=0, dtype=np.uint64).tolist()  # one reduction: this runs per tensor
    return tuple(sums[lane] % prime for lane, prime in enumerate(_PRIMES[:lanes]))


def full_lanes(sym: np.ndarray, table: np.ndarray, lanes: int, first: int = 0) -> tuple[int, ...]:
    """Lanes of contiguous unsigned symbols whose element 0 has flat index ``first``.

    ``table`` is the (65536, 2) uint32 g table for 1- and 2-byte symbols; unused otherwise.
    """
    out = np.zeros((_row_count(sym.shape[0], first), 3), dtype=np.uint64)
    if sym.dtype.itemsize <= 2:
        _launch(_rows_table, out.shape[0], sym, table, first, out)
    else:
        _launch(_rows_power, out.shape[0], sym, lanes, first, out)
    return _finish_lanes(out, lanes)


# --- lanes of elements at positions (lanes_at, lanes_after_change, apply) ----------------


@njit(cache=True, inline="always")
def _pair_lanes_task(c, pos, old, new, has_old, lanes, table, out):  # type: ignore[no-untyped-def]
    """Chunk ``c`` of the positions: sum (g(new) - g(old)) * r mod p (g(old) = 0 without
    ``old``)."""
    m = pos.shape[0]
    lo = c * _CHUNK
    hi = min(lo + _CHUNK, m)
    for lane in range(lanes):
        p = _prime(lane)
        acc = _ZERO
        pos_c, old_c, new_c = pos[lo:hi], old[lo:hi], new[lo:hi]
        for j in range(pos_c.shape[0]):
            r = np.uint64(pos_c[j] & _MASK30) + _ONE
            g = _g(np.uint64(new_c[j]), lane, table)
            if has_old:
                g = g + p - _g(np.uint64(old_c[j]), lane, table)  # < 2^32
            acc += g * r % p  # below 2^63 for 2^32 terms
        out[c, lane] = acc % p


@parallel_kernel
def _pair_lanes(pos, old, new, has_old, lanes, table, out):  # type: ignore[no-untyped-def]
    for c in prange(out.shape[0]):
        _pair_lanes_task(c, pos, old, new, has_old, lanes, table, out)


def position_lanes(
    pos: np.ndarray, old: np.ndarray | None, new: np.ndarray, table: np.ndarray, lanes: int
) -> tuple[int, ...]:
    """``sum (g(new) - g(old)) * r`` per lane over int64 ``pos`` (``old`` None: g(old) = 0)."""
    chunks = -(-pos.shape[0] // _CHUNK)
    out = np.zeros((chunks, 3), dtype=np.uint64)
    args = (pos, new if old is None else old, new, old is not None, lanes, table, out)
    _launch(_pair_lanes, chunks, *args)
    return _finish_lanes(out, lanes)


_LOW31 = np.uint64((1 << 31) - 1)
_S31 = np.uint64(31)
# each lane's prime is 2^31 - c (c = 1, 19, 61), so 2^31 = c mod p: a term t < 2^62 folds
# to (t mod 2^31) + c * (t >> 31) < 2^38, the same residue, without a division
_FOLD1 = np.uint64((1 << 31) - int(_P1))
_FOLD2 = np.uint64((1 << 31) - int(_P2))
LANE_TERMS = 1 << 25
"""The most terms :func:`_lane_add` may add to one set of accumulators before they are
reduced (each folded term is below 2^38, so 2^25 of them stay below 2^63)."""


@njit(cache=True, inline="always")
def _lane_add(a0, a1, a2, old, new, r, lanes, table):  # type: ignore[no-untyped-def]
    """The accumulators after adding ``(g(new) - g(old)) * r`` per lane (``r <= 2^30``), each
    term folded below 2^38 without a division (its residue mod p kept): at most
    :data:`LANE_TERMS` terms before the caller reduces them (tasks sum at most 2^18). A
    division per term cost twice the rest of the sum; a branch on the sum instead would be
    taken every few terms, unpredictably."""
    t0 = (_g(new, 0, table) + _P0 - _g(old, 0, table)) * r  # < 2^32 * 2^30
    t1 = (_g(new, 1, table) + _P1 - _g(old, 1, table)) * r
    a0 += (t0 & _LOW31) + (t0 >> _S31)
    a1 += (t1 & _LOW31) + _FOLD1 * (t1 >> _S31)
    if lanes == 3:
        t2 = (_g(new, 2, table) + _P2 - _g(old, 2, table)) * r
        a2 += (t2 & _LOW31) + _FOLD2 * (t2 >> _S31)
    return a0, a1, a2


# --- fused diff ------------------------------------------------------------------------

TASK = 1 << 18  # elements per parallel task of the fused diff (a 1M tensor spans both cores)
_GROUP = 64  # elements compared into one 64-bit mask
_SPARSE_MIN_BYTES = 1 << 22  # numpy's own threshold for huge-page advice (4 MiB)
_POOL_BYTES = 1 << 26  # scratch a thread keeps faulted in between diffs (64 MiB)
_INT64 = np.dtype(np.int64)  # the positions' dtype
_SERIAL_GATHER_BYTES = 1 << 20  # outputs below this are gathered without a parallel region
SLAB = 1 << 26  # elements per pass of the fused diff


@njit(cache=True, inline="always")
def _take(old, new, t, p, k, pos_out, new_out, xor_out, lanes, table, advance, acc):  # type: ignore[no-untyped-def]
    """Output ``k`` of a diff: the change at ``old[t]``/``new[t]`` (flat position ``p``),
    its lane terms added to ``acc``; the baseline takes the new bits with ``advance``."""
    o = old[t]
    w = new[t]
    pos_out[k] = p
    if new_out.shape[0] != 0:
        new_out[k] = w
    if xor_out.shape[0] != 0:
        xor_out[k] = o ^ w
    if advance:
        old[t] = w  # while the line is at hand
    if lanes:
        r = np.uint64(p & _MASK30) + _ONE
        return _lane_add(acc[0], acc[1], acc[2], np.uint64(o), np.uint64(w), r, lanes, table)
    return acc


# _take called rather than inlined: a task's last partial group (at most 63 elements)
# takes its changes through it, so that the task body holds one inlined copy (two made
# the fused diff's first compile about a third longer)
_take_called = njit(cache=True)(renamed(_take.py_func, "_called"))


@njit(cache=True, inline="always")
def _class_at(value, shift, mask, low, top):  # type: ignore[no-untyped-def]
    """The class of one element: ``clamp(((value >> shift) & mask) - low, 0, top)``."""
    c = ((np.int64(value) >> shift) & mask) - low
    return 0 if c < 0 else (top if c > top else c)


@njit(cache=True, inline="always")
def _diff_task(c, old, new, base, outs, lanes, table, advance, counts, lane_out, ranking, adjacent):  # type: ignore[no-untyped-def]
    """Task ``c`` of the fused diff: elements ``c * TASK``.. up to the next task, written
    (see :func:`_take`) from output index ``c * TASK`` of ``outs`` (as long as the input:
    only the pages written are touched); ``counts[c]`` gets how many, ``lane_out[c]`` the
    lane sums.

    The elements go 64 at a time: a branch-free loop, which the compiler turns into
    vector compares, makes a 64-bit mask of those that differ, and only its set bits are
    visited, lowest first (near memory speed when changes are sparse, and no mispredicted
    branch per element when they are not). The last partial group goes element by
    element.

    ``ranking`` (None: no ranks), where given, is ``(shift, mask, low, top, starts,
    ranks)``: each change's rank among the old elements of its class (FORMAT.md §6.5,
    classes ``clamp(((old >> shift) & mask) - low, 0, top)``, counted from ``starts[c]``,
    the members of each class before the task) goes to ``ranks`` beside its position,
    from the group's class members (one load of the old bits the diff reads anyway), and
    ``adjacent[c]`` gets how many of the task's positions directly follow one of the
    task's before them.
    """
    n = old.shape[0]
    pos_out, new_out, xor_out = outs  # unpacked here: inside _take numba lost the writes
    lo = c * TASK
    hi = min(lo + TASK, n)
    k = lo
    acc = (_ZERO, _ZERO, _ZERO)
    groups = (hi - lo) // _GROUP
    old_s, new_s = old[lo : lo + _GROUP * groups], new[lo : lo + _GROUP * groups]
    seen = np.zeros(CLASSES, dtype=np.int64)  # each class's old members before the group
    members = np.zeros(CLASSES, dtype=np.uint64)
    previous = np.int64(-2)
    touching = np.int64(0)
    if ranking is not None:  # unpacked once, here (as ``outs``)
        shift, cmask, low, top, starts, ranks = ranking
        for j in range(top + 1):
            seen[j] = starts[c, j]
    for g in range(groups):
        mask = _ZERO
        for q in range(_GROUP):
            e = np.uint64(_GROUP * g + q)  # unsigned: no wrap-around check
            mask |= np.uint64(old_s[e] != new_s[e]) << np.uint64(q)
        if ranking is not None:  # before any change of the group is written
            class_masks(old, lo + _GROUP * g, shift, cmask, low, top, members)
        while mask != _ZERO:
            bit = np.uint64(_TRAILING_ZEROS(mask))
            t = np.uint64(lo + _GROUP * g) + bit
            mask &= mask - _ONE
            p = base + np.int64(t)
            if ranking is not None:
                own = _class_at(old[t], shift, cmask, low, top)
                ranks[k] = seen[own] + popcount(members[own] & ((_ONE << bit) - _ONE))
                touching += np.int64(p == previous + 1)
                previous = p
            acc = _take(old, new, t, p, k, pos_out, new_out, xor_out, lanes, table, advance, acc)
            k += 1
        if ranking is not None:
            for j in range(CLASSES):
                seen[j] += popcount(members[j])
    for i in range(lo + _GROUP * groups, hi):
        t = np.uint64(i)
        own = 0
        if ranking is not None:
            own = _class_at(old[t], shift, cmask, low, top)
        if old[t] != new[t]:
            if ranking is not None:
                ranks[k] = seen[own]
                touching += np.int64(base + i == previous + 1)
                previous = base + i
            acc = _take_called(
                old, new, t, base + i, k, pos_out, new_out, xor_out, lanes, table, advance, acc
            )
            k += 1
        if ranking is not None:
            seen[own] += 1
    counts[c] = k - lo
    lane_out[c, 0] = acc[0] % _P0
    lane_out[c, 1] = acc[1] % _P1
    lane_out[c, 2] = acc[2] % _P2
    if ranking is not None:
        adjacent[c] = touching


@parallel_kernel
def _diff(old, new, base, outs, lanes, table, advance, counts, lane_out, ranking, adjacent):  # type: ignore[no-untyped-def]
    """The fused diff, its tasks in parallel."""
    for c in prange(counts.shape[0]):
        _diff_task(
            c, old, new, base, outs, lanes, table, advance, counts, lane_out, ranking, adjacent
        )


def _sparse_empty(n: int, dtype: np.dtype[Any]) -> np.ndarray:
    """An uninitialised array for scratch that is written only here and there.

    numpy advises the kernel to back large arrays with 2 MiB huge pages; where the kernel
    honours that (transparent huge pages in ``madvise`` mode, a common default), each
    first write into a 2 MiB region faults in and zeroes a whole huge page, after direct
    compaction if memory is fragmented. The fused diff's tasks write a few KB each at
    offsets a task apart in arrays as long as the tensor: measured on an 8M-element
    tensor at 1% change, 40-137 ms a call with huge pages against 4.5-6 ms without. So
    on POSIX these arrays are private anonymous maps advised against huge pages: only
    the 4 KiB pages written are ever faulted in.
    """
    nbytes = n * dtype.itemsize
    if nbytes < _SPARSE_MIN_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
        return np.empty(n, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # even where huge pages are always on
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(pages, dtype=dtype, count=n)  # keeps the map alive


class _Pool(threading.local):
    """Each thread's diff scratch, kept between calls so that its pages, once faulted in,
    are not faulted in (and zeroed by the kernel) again on every tensor of every step:
    at 5% change that was a third of the diff.

    ``arrays`` maps an output slot (positions, new bits, XOR bits) and its dtype to an
    array at least as long as the longest input seen; ``reach``
    holds, per task, the most outputs any call wrote there (the pages that stay
    resident). Once they pass ``_POOL_BYTES`` the pool is dropped after the call, so a
    rare dense change does not keep its scratch for the life of the process.
    """

    def __init__(self) -> None:
        self.arrays: dict[tuple[int, np.dtype[Any]], np.ndarray] = {}
        self.reach = np.zeros(0, dtype=np.int64)
        self.reached = 0  # the sum of ``reach``
        # the last call's three scratch arrays and their bytes per output, by its (length,
        # dtype, want): a stream of tensors of one shape asks for the same ones every time;
        # dropped whenever an array is replaced or the pool is
        self.last: tuple[Any, tuple[np.ndarray, np.ndarray, np.ndarray], int] | None = None

    def get(self, slot: int, n: int, dtype: np.dtype[Any]) -> np.ndarray:
        held = self.arrays.get((slot, dtype))
        if held is None or held.shape[0] < n:
            self.last = None
            held = self.arrays[slot, dtype] = _sparse_empty(n, dtype)
        return held[:n]

    def scratch(
        self, n: int, dtype: np.dtype[Any], want: tuple[bool, bool]
    ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int]:
        """The three output arrays of a diff of ``n`` elements of ``dtype`` (positions,
        and the new and XOR bits where ``want`` asks for them, else empty) and the bytes
        they take per output."""
        key = (n, dtype, want)
        last = self.last
        if last is not None and last[0] == key:
            return last[1], last[2]
        arrays = (
            self.get(0, n, _INT64),
            self.get(1, n if want[0] else 0, dtype),
            self.get(2, n if want[1] else 0, dtype),
        )
        nbytes = sum(a.itemsize for a in arrays if a.shape[0])
        self.last = (key, arrays, nbytes)
        return arrays, nbytes

    def keep(self, counts: np.ndarray, nbytes: int) -> None:
        """Note the outputs a call wrote (``nbytes`` per output); drop the pool past its cap."""
        if self.reach.shape[0] < counts.shape[0]:
            self.reach = np.concatenate(
                [self.reach, np.zeros(counts.shape[0] - self.reach.shape[0], np.int64)]
            )
        np.maximum(self.reach[: counts.shape[0]], counts, out=self.reach[: counts.shape[0]])
        self.reached = int(self.reach.sum())
        self._cap(nbytes)

    def keep_one(self, count: int, nbytes: int) -> None:
        """:meth:`keep` for a call of one task that wrote ``count`` outputs (no array
        operation unless that task reached further than before)."""
        if self.reach.shape[0] == 0 or count > int(self.reach[0]):
            self.keep(np.array([count], dtype=np.int64), nbytes)
        else:
            self._cap(nbytes)

    def _cap(self, nbytes: int) -> None:
        if self.reached * nbytes > _POOL_BYTES:
            self.last = None
            self.arrays.clear()
            self.reach = np.zeros(0, dtype=np.int64)
            self.reached = 0


_POOL = _Pool()


def diff(
    old: np.ndarray,
    new: np.ndarray,
    base: int,
    want: tuple[bool, bool],
    table: np.ndarray,
    lanes: int,
    advance: bool = False,
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[int, ...]]:
    """Where ``old`` and ``new`` differ: (positions + ``base``, new bits, old ^ new bits),
    the last two empty unless ``want`` (new, xor) asks for them, and the lane deltas
    ``sum (g(new) - g(old)) * r`` (``lanes`` 0: none), all from one pass over the inputs.

    ``advance``: also write the new bits into ``old`` at the changed positions, in the
    same pass (``old`` then equals ``new``).

    Tensors longer than ``SLAB`` elements go a slab at a time (the scratch each pass
    uses is as long as its slab, touched only where changes land).
    """
    found, sums, _ = _diffs(old, new, base, _Asked(want, table, lanes, advance), None)
    return found, sums


class Ranking(NamedTuple):
    """The classes :func:`ranked_diff` ranks each change in (FORMAT.md §6.5): ``clamp(((old
    >> shift) & mask) - low, 0, classes - 1)`` of its old bits (``low`` at most ``mask +
    1``), and ``starts``, the members of each class before each task of :data:`TASK`
    elements (``(tasks + 1, classes)`` int64, the class starts of the old bits' exponent
    rows)."""

    shift: int
    mask: int
    low: int
    classes: int
    starts: np.ndarray


class Ranked(NamedTuple):
    """What :func:`ranked_diff` adds to a diff: each change's rank among the old elements
    of its class, beside its position, and how many positions directly follow the one
    before them."""

    ranks: np.ndarray
    adjacent: int


def ranked_diff(
    old: np.ndarray,
    new: np.ndarray,
    base: int,
    want: tuple[bool, bool],
    table: np.ndarray,
    lanes: int,
    ranking: Ranking,
    advance: bool = False,
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[int, ...], Ranked]:
    """:func:`diff`, and in the same pass the rank of each change among the old elements of
    its class (``ranking``), as a writer's ``classed`` positions need them: the group's
    class members come from the old bits the diff reads anyway, before the baseline takes
    the new ones, so no second pass over the tensor counts them."""
    found, sums, ranked = _diffs(old, new, base, _Asked(want, table, lanes, advance), ranking)
    assert ranked is not None
    return found, sums, ranked


def _diffs(
    old: np.ndarray, new: np.ndarray, base: int, asked: _Asked, ranking: Ranking | None
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[int, ...], Ranked | None]:
    """:func:`diff` or :func:`ranked_diff`, a slab at a time."""
    n = old.shape[0]
    slab = SLAB if ranking is None else max(TASK, SLAB - SLAB % TASK)  # ranks: whole tasks
    if n <= slab:
        return _diff_slab(old, new, base, asked, ranking)
    parts = [
        _diff_slab(
            old[lo : lo + slab],
            new[lo : lo + slab],
            base + lo,
            asked,
            None if ranking is None else ranking._replace(starts=ranking.starts[lo // TASK :]),
        )
        for lo in range(0, n, slab)
    ]
    found = tuple(np.concatenate([part[0][i] for part in parts]) for i in range(3))
    primes = (int(_P0), int(_P1), int(_P2))
    lanes = asked.lanes
    sums = tuple(sum(part[1][lane] for part in parts) % primes[lane] for lane in range(lanes))
    ranked = None
    if ranking is not None:
        sizes = np.array([part[0][0].shape[0] for part in parts], dtype=np.int64)
        adjacent = sum(part[2].adjacent for part in parts if part[2] is not None)
        ranked = Ranked(
            np.concatenate([part[2].ranks for part in parts if part[2] is not None]),
            adjacent + _junctions(found[0], sizes),
        )
    return (found[0], found[1], found[2]), sums, ranked


def _junctions(positions: np.ndarray, sizes: np.ndarray) -> int:
    """How many of the outputs that start a part (parts of ``sizes`` outputs, one after
    another) directly follow the last output of the part before."""
    firsts = np.cumsum(sizes)[:-1][sizes[1:] > 0]
    firsts = firsts[firsts > 0]
    return int(np.count_nonzero(positions[firsts] == positions[firsts - 1] + 1))


class _Asked(NamedTuple):
    """What a diff computes besides the positions (the arguments of :func:`diff`)."""

    want: tuple[bool, bool]
    table: np.ndarray
    lanes: int
    advance: bool


def tasks_of(n: int) -> int:
    """How many tasks of :data:`TASK` elements cover ``n`` elements."""
    return -(-n // TASK)


def _diff_slab(
    old: np.ndarray, new: np.ndarray, base: int, asked: _Asked, ranking: Ranking | None
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[int, ...], Ranked | None]:
    want, table, lanes, advance = asked
    n = old.shape[0]
    tasks = tasks_of(n)
    counts = np.zeros(tasks, dtype=np.int64)
    lane_out = np.zeros((tasks, 3), dtype=np.uint64)
    # as long as the input, but only each task's written prefix is ever touched
    pool = _POOL
    scratch, nbytes = pool.scratch(n, old.dtype, want)
    ranks = None
    task_ranks = None
    # its own argument: written at a task's end from inside ``ranking``, the parallel form
    # lost the writes
    adjacent = np.zeros(0 if ranking is None else tasks, dtype=np.int64)
    if ranking is not None:
        ranks = pool.get(3, n, _INT64)
        nbytes += _INT64.itemsize
        top = ranking.classes - 1
        task_ranks = (ranking.shift, ranking.mask, ranking.low, top, ranking.starts, ranks)
    args = (old, new, base, scratch, lanes, table, advance, counts, lane_out, task_ranks, adjacent)
    _launch(_diff, tasks, *args)
    if tasks == 1:  # most tensors: one task's prefix is the whole output
        total = int(counts[0])
        pool.keep_one(total, nbytes)
        positions, new_bits, xor_bits = scratch
        found = (positions[:total].copy(), new_bits[:total].copy(), xor_bits[:total].copy())
        ranked = None
        if ranks is not None:
            ranked = Ranked(ranks[:total].copy(), int(adjacent[0]))
        return found, _finish_lanes(lane_out, lanes), ranked
    found = _gather_tasks(scratch, counts)
    ranked = None
    if ranks is not None:
        ranked = Ranked(
            _gather_tasks((ranks, ranks[:0], ranks[:0]), counts)[0],
            int(adjacent.sum()) + _junctions(found[0], counts),
        )
    pool.keep(counts, nbytes)
    return found, (_finish_lanes(lane_out, lanes) if lanes else ()), ranked


@njit(cache=True, inline="always")
def _gather_task(c, scratch, out, sizes, at):  # type: ignore[no-untyped-def]
    src, dst = c * TASK, at[c]
    size = sizes[c]
    if out[0].shape[0]:
        out[0][dst : dst + size] = scratch[0][src : src + size]
    if out[1].shape[0]:
        out[1][dst : dst + size] = scratch[1][src : src + size]
    if out[2].shape[0]:
        out[2][dst : dst + size] = scratch[2][src : src + size]


@parallel_kernel
def _gather(scratch, out, sizes, at):  # type: ignore[no-untyped-def]
    """``out[i][at[c] : at[c] + sizes[c]] = scratch[i][c * TASK :][: sizes[c]]`` for each
    of the three arrays that is not empty, the tasks copied in parallel."""
    for c in prange(sizes.shape[0]):
        _gather_task(c, scratch, out, sizes, at)


def _gather_tasks(
    scratch: tuple[np.ndarray, np.ndarray, np.ndarray], counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tasks' outputs, each at its task's first index of ``scratch``, side by side in
    new arrays (the scratch is kept for the next call)."""
    total = int(counts.sum())
    at = np.zeros(counts.shape[0], dtype=np.int64)
    np.cumsum(counts[:-1], out=at[1:])
    out = tuple(np.empty(total if a.shape[0] else 0, dtype=a.dtype) for a in scratch)
    nbytes = total * sum(a.itemsize for a in scratch if a.shape[0])
    if total:
        tasks = counts.shape[0] if nbytes >= _SERIAL_GATHER_BYTES else 1
        _launch(_gather, tasks, scratch, out, counts, at)
    return out[0], out[1], out[2]


# --- ulp steps (the fused apply of ``ulp`` changes, and the ``ulp`` coding's kernels) --------


@njit(cache=True, nogil=True, inline="always")
def ulp_limits(itemsize: int) -> tuple[np.uint64, np.uint64]:  # pragma: no cover - compiled
    """The top bit and all bits of an unsigned integer of ``itemsize`` bytes (as uint64)."""
    top = _ONE << (np.uint64(8 * itemsize) - _ONE)
    return top, (top - _ONE) | top


@njit(cache=True, nogil=True, inline="always")
def ulp_order(x: np.uint64, top: np.uint64, ones: np.uint64) -> np.uint64:  # pragma: no cover
    """The bits as an unsigned integer in the order of the floats they are (FORMAT.md §7.5)."""
    if x & top:
        return x ^ ones
    return x ^ top


@njit(cache=True, nogil=True, inline="always")
def ulp_stepped(
    before: np.uint64, z: np.uint64, top: np.uint64, ones: np.uint64
) -> np.uint64:  # pragma: no cover - compiled
    """The bits whose zigzag difference from ``before`` is ``z`` (the inverse of
    ``_zigzag`` of :mod:`dcr_format.codings._ulp_kernels`)."""
    d = (z >> _ONE) ^ (ones if z & _ONE else _ZERO)
    y = (ulp_order(before, top, ones) + d) & ones
    return y ^ (top if y & top else ones)


# --- fused apply -----------------------------------------------------------------------


_WRITE, _GATHERED = 1, 2  # a change's ``how``: it writes; its old bits are given

OVERWRITE_MODE, XOR_MODE, ULP_MODE = 0, 1, 2
"""How a change's values make the new bits: they are the new bits, ``old ^ v``, or the
zigzag ulp difference from the old bits (``values-ulp``, FORMAT.md §7.5)."""


@njit(cache=True, inline="always")
def _change_task(  # type: ignore[no-untyped-def]
    c, flat, pos, values, base, mode, how, before, after, lanes, table, lane_out, bad
):
    """Chunk ``c`` of the positions: the bits before (into ``before``, unless ``how`` has
    :data:`_GATHERED`) and after (into ``after`` unless it is empty), written into ``flat``
    where ``how`` has :data:`_WRITE`, and the lane sums; ``mode`` says how the values make
    the bits after (:data:`XOR_MODE` ...)."""
    write, gathered = how & _WRITE, how & _GATHERED
    n = flat.shape[0]
    top, ones = ulp_limits(flat.itemsize)
    want_after = after.shape[0] != 0
    lo = c * _CHUNK
    hi = min(lo + _CHUNK, pos.shape[0])
    a0 = _ZERO
    a1 = _ZERO
    a2 = _ZERO
    pos_c, values_c, before_c = pos[lo:hi], values[lo:hi], before[lo:hi]
    after_c = after[lo:hi] if want_after else after
    m = pos_c.shape[0]
    for s in range(0, m, _GATHER_BLOCK):
        # a tight loop reads the old bits first: its cache misses overlap, where the loop
        # below (lanes, ulp steps) keeps few loads in flight; the block's lines then stay
        # in cache for the writes
        e = min(s + _GATHER_BLOCK, m)
        if not gathered:
            for j in range(s, e):
                p = pos_c[j]
                if p - base >= 0 and p - base < n:
                    before_c[j] = flat[np.uint64(p - base)]
        for j in range(s, e):
            p = pos_c[j]
            if p - base < 0 or p - base >= n:  # unsorted input past a checked first/last
                bad[c] = 1  # never written
                continue
            i = np.uint64(p - base)
            b = before_c[j]
            a = _after(b, values_c[j], mode, top, ones)
            if write:
                flat[i] = a
            if want_after:
                after_c[j] = a
            if lanes:
                r = np.uint64(p & _MASK30) + _ONE
                a0, a1, a2 = _lane_add(a0, a1, a2, np.uint64(b), a, r, lanes, table)
    lane_out[c, 0] = a0 % _P0
    lane_out[c, 1] = a1 % _P1
    lane_out[c, 2] = a2 % _P2


@njit(cache=True, inline="always")
def _after(b, v, mode, top, ones):  # type: ignore[no-untyped-def]
    """The bits (uint64) a change of ``mode`` with value ``v`` makes of the bits ``b``."""
    if mode == XOR_MODE:
        return np.uint64(b ^ v)
    if mode == ULP_MODE:
        return ulp_stepped(np.uint64(b), np.uint64(v), top, ones)
    return np.uint64(v)


@parallel_kernel
def _change(flat, pos, values, base, mode, how, before, after, lanes, table, lane_out, bad):  # type: ignore[no-untyped-def]
    """Apply or stage a change, its chunks of positions in parallel."""
    for c in prange(lane_out.shape[0]):
        _change_task(
            c, flat, pos, values, base, mode, how, before, after, lanes, table, lane_out, bad
        )


def apply(
    flat: np.ndarray,
    pos: np.ndarray,
    values: np.ndarray,
    base: int,
    mode: int,
    out: tuple[np.ndarray, np.ndarray],
    table: np.ndarray,
    lanes: int,
    *,
    gathered: bool = False,
) -> tuple[bool, tuple[int, ...]]:
    """In place ``flat[p - base] ^= v``, ``= v`` or one ulp difference ``v`` further
    (``mode``); ``out`` = (the old bits, the new bits where that array is not empty).
    ``gathered``: ``out[0]`` holds the old bits already (read by the caller from this
    ``flat``, nothing written there since), so they are not read again.

    Returns (all positions were in range, lane deltas). Out-of-range positions are
    skipped, never written.
    """
    how = _WRITE | (_GATHERED if gathered else 0)
    return _run_change(flat, pos, values, base, mode, how, out, table, lanes)


def _run_change(
    flat: np.ndarray,
    pos: np.ndarray,
    values: np.ndarray,
    base: int,
    mode: int,
    how: int,
    out: tuple[np.ndarray, np.ndarray],
    table: np.ndarray,
    lanes: int,
) -> tuple[bool, tuple[int, ...]]:
    chunks = -(-pos.shape[0] // _CHUNK)
    lane_out = np.zeros((chunks, 3), dtype=np.uint64)
    bad = np.zeros(chunks, dtype=np.uint8)
    args = (flat, pos, values, base, mode, how, out[0], out[1], lanes, table, lane_out, bad)
    _launch(_change, chunks, *args)
    in_range = not bad[0] if chunks == 1 else not bool(bad.any())  # most changes: one chunk
    return in_range, (_finish_lanes(lane_out, lanes) if lanes else ())


_PUT_CHUNK = _CHUNK  # positions a task of :func:`put` writes (fewer: one serial task)
_AHEAD = 64  # positions a write looks ahead to prefetch the line of


def put(
    flat: np.ndarray, pos: np.ndarray, bits: np.ndarray, replaced: np.ndarray | None = None
) -> bool:
    """In place ``flat[p] = b`` (``flat`` a C-contiguous 1-d array of ``bits``'s dtype): the
    write of a change read before (staged), no lanes summed; ``replaced`` (as long as
    ``pos``): the bits it replaces are kept there, on the cache lines the write touches
    anyway. :func:`put_all` with one segment. Returns whether every position was in range
    (those out of range are skipped)."""
    if not flat.flags.c_contiguous or flat.ndim != 1 or flat.dtype != bits.dtype:
        raise ValueError("put writes a C-contiguous 1-d array of the bits' dtype")
    addresses = np.array([flat.ctypes.data], dtype=np.int64)
    sizes = np.array([flat.shape[0]], dtype=np.int64)
    starts = np.array([0, pos.shape[0]], dtype=np.int64)
    return put_all(addresses, sizes, starts, pos, bits, replaced)


@parallel_kernel
def _put_all(addresses, sizes, starts, pos, bits, replaced, keep, bad):  # type: ignore[no-untyped-def]
    """``flat[p] = b`` into several tensors at once: segment ``t`` (``pos[starts[t]:starts[t
    + 1]]``) into the ``sizes[t]`` elements at ``addresses[t]`` (``keep``: the bits it
    replaces into ``replaced[j]`` first; a position out of range is skipped, never read or
    written, and its chunk marked in ``bad``); chunks of the positions in parallel, each
    walking the segments it spans."""
    total = pos.shape[0]
    for c in prange(bad.shape[0]):
        lo = c * _PUT_CHUNK
        hi = min(lo + _PUT_CHUNK, total)
        t = np.searchsorted(starts, lo, side="right") - 1
        while lo < hi:
            end = min(hi, starts[t + 1])
            n = sizes[t]
            if end > lo:
                flat = carray(pointer_to(addresses[t], bits), (n,))
                for j in range(lo, end):
                    if j + _AHEAD < end:  # the line a later write reaches, asked for now
                        prefetch_write(flat, pos[j + _AHEAD])
                    p = pos[j]
                    if p >= 0 and p < n:
                        if keep:
                            replaced[j] = flat[p]
                        flat[p] = bits[j]
                    else:
                        bad[c] = 1
            lo = end
            t += 1


def put_all(
    addresses: np.ndarray,
    sizes: np.ndarray,
    starts: np.ndarray,
    pos: np.ndarray,
    bits: np.ndarray,
    replaced: np.ndarray | None = None,
) -> bool:
    """:func:`put` into several contiguous tensors in one launch: ``flat_t[pos[j]] = bits[j]``
    for ``j`` in segment ``t`` (``starts[t]`` to ``starts[t + 1]``), ``flat_t`` the
    ``sizes[t]`` elements of ``bits``'s dtype at memory address ``addresses[t]`` (int64;
    the caller checks these are live, contiguous and of that width, and the segments in
    range); ``replaced`` as for :func:`put`. A position out of range is skipped. Returns
    whether every position was in range."""
    chunks = -(-pos.shape[0] // _PUT_CHUNK)
    bad = np.zeros(chunks, dtype=np.uint8)
    keep = replaced is not None
    out = replaced if replaced is not None else bits[:0]
    _launch(_put_all, chunks, addresses, sizes, starts, pos, bits, out, keep, bad)
    return not bool(bad.any())


def stage(
    flat: np.ndarray,
    pos: np.ndarray,
    values: np.ndarray,
    base: int,
    mode: int,
    out: tuple[np.ndarray, np.ndarray],
    table: np.ndarray,
    lanes: int,
) -> tuple[bool, tuple[int, ...]]:
    """Read, never write: ``out`` = (bits of ``flat`` at ``pos - base``, the bits the change
    puts there under ``mode``), and the lane deltas of that change. Returns (all positions
    in range, deltas)."""
    return _run_change(flat, pos, values, base, mode, 0, out, table, lanes)
