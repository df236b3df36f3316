"""Compiled (numba) kernels of the ``classed`` position coding (:mod:`dcr_format.codings.classed`).

Private, imported on first use (:func:`dcr_format.kernels.native.compiled`; numba missing or
``DCR_KERNELS=torch``: the numpy reference in :mod:`~dcr_format.codings.classed` runs); they
reproduce the reference exactly (``tests/test_codec_classed.py``).

Both ends make two passes over the tensor's old bits (the first only where its rows are
not kept), in tasks of :data:`~dcr_format.kernels.numba_kernels.TASK` elements that run in
parallel (through :func:`~dcr_format.kernels._launch._launch`, with serial twins):

1. :func:`histograms`: each task's histogram of the exponent field (four interleaved
   counter rows, so that equal neighbours do not wait on one counter). The writer picks
   ``base`` and ``K`` from their sum; each task's count per class, and so the class counts
   before it, follow from its own row. These are the *exponent rows* of
   :func:`dcr_format.codings.classed.exponent_rows`: a long-lived writer or reader keeps
   them and moves only the changed elements (:func:`move_rows`), so in steady state this
   pass is not made.
2. :func:`class_ranks` (writer) and :func:`positions_of_ranks` (reader): each task takes
   its elements 64 at a time and makes the group's *members*, a word per class whose bit
   q says whether element q is of that class (:func:`_group_members`: one load of the
   group, its classes narrowed to bytes and one byte compare per class,
   :mod:`~dcr_format.kernels._native_bits`), so a class's count in the group is one
   population count. A changed element's rank is the members of its class before the
   group plus those below it in the group. The reader keeps, per class, how many members
   are left before its next wanted rank, takes each group's counts off all classes at
   once (a branch-free loop), and looks only at the classes that ran out in the group:
   the wanted element is the matching set bit of the class's members, whose old bits it
   hands over as it writes the position. Where changes are dense (:func:`dense_wins`)
   and the machine has a fast bit deposit, the *dense* pass runs instead: each task sets
   a bit per wanted rank of each class, and a group deposits each class's next bits onto
   its members, with no branch per class; its classes must end where the next task's
   start, which also catches rows of other bits.

Classes are ``clamp(((bits >> shift) & mask) - base, 0, count - 1)``; a writer whose diff
advanced its baseline passes the new bits and the XOR bits at the positions (the old bits
there are their XOR).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from dcr_format.kernels._launch import _launch, parallel_kernel
from dcr_format.kernels._native_bits import (
    CLASSES,
    TRAILING_ZEROS,
    class_masks,
    deposit,
    deposit_select,
    fast_deposit,
    has_deposit,
    popcount,
)
from dcr_format.kernels.numba_kernels import TASK, _class_at, tasks_of

_GROUP = 64
_ZERO, _ONE = np.uint64(0), np.uint64(1)


@njit(cache=True, inline="always")
def _exponent(value, shift, mask):  # type: ignore[no-untyped-def]
    return (np.int64(value) >> shift) & mask


@njit(cache=True, inline="always")
def _class_of(value, shift, mask, base, count):  # type: ignore[no-untyped-def]
    return _class_at(value, shift, mask, base, count - 1)  # the fused diff's, for K classes


# --- pass 1: exponent histograms per task -----------------------------------------------


@njit(cache=True, inline="always")
def _histogram_task(t, bits, shift, mask, out):  # type: ignore[no-untyped-def]
    lo = t * TASK
    hi = min(lo + TASK, bits.shape[0])
    width = np.uint64(mask + 1)
    rows = np.zeros(4 * (mask + 1), dtype=np.int64)
    ushift, umask = np.uint64(shift), np.uint64(mask)
    i = lo
    while i + 4 <= hi:
        u = np.uint64(i)
        rows[(np.uint64(bits[u]) >> ushift) & umask] += 1
        rows[width + ((np.uint64(bits[u + _ONE]) >> ushift) & umask)] += 1
        rows[np.uint64(2) * width + ((np.uint64(bits[u + np.uint64(2)]) >> ushift) & umask)] += 1
        rows[np.uint64(3) * width + ((np.uint64(bits[u + np.uint64(3)]) >> ushift) & umask)] += 1
        i += 4
    while i < hi:
        rows[(np.uint64(bits[np.uint64(i)]) >> ushift) & umask] += 1
        i += 1
    for e in range(mask + 1):
        out[t, e] = (
            rows[e] + rows[e + mask + 1] + rows[e + 2 * (mask + 1)] + rows[e + 3 * (mask + 1)]
        )


@parallel_kernel
def _histograms(bits, shift, mask, out):  # type: ignore[no-untyped-def]
    for t in prange(out.shape[0]):
        _histogram_task(t, bits, shift, mask, out)


@njit(cache=True, nogil=True)
def _flip_histograms(bits, positions, xor, after, shift, mask, out, changed):  # type: ignore[no-untyped-def]
    """Move each changed element from its new exponent to its old one (``bits ^ xor``) in
    its task's row of ``out``, and count the old exponents of the changed elements.
    ``after``, where not empty, holds ``bits`` at the positions (read in order, not at
    positions spread over the tensor: at 1% change each of those misses the cache)."""
    flip = xor.size > 0
    given = after.size > 0
    for j in range(positions.size):
        p = positions[j]
        value = after[j] if given else bits[p]
        if flip:
            t = p // TASK
            out[t, _exponent(value, shift, mask)] -= 1
            value ^= xor[j]
            out[t, _exponent(value, shift, mask)] += 1
        changed[_exponent(value, shift, mask)] += 1


def histograms(
    bits: np.ndarray,
    positions: np.ndarray,
    xor: np.ndarray,
    shift: int,
    mask: int,
    after: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Each task's histogram of the old exponents (rows, ``tasks x (mask + 1)``) and the
    histogram over the changed elements (old bits: ``bits``, or ``bits ^ xor`` at the
    positions where ``xor`` is not empty). ``after``: ``bits`` at the positions, where the
    caller has them in order (the writer's diff can write them)."""
    out = np.zeros((tasks_of(bits.shape[0]), mask + 1), dtype=np.int64)
    _launch(_histograms, out.shape[0], bits, shift, mask, out)
    changed = np.zeros(mask + 1, dtype=np.int64)
    given = (
        bits[:0] if after is None else np.ascontiguousarray(after).astype(bits.dtype, copy=False)
    )
    _flip_histograms(bits, positions, xor, given, shift, mask, out, changed)
    return out, changed


@njit(cache=True, inline="always")
def _moved(old, new, j, size, field):  # type: ignore[no-untyped-def]
    """Bit ``q`` set where change ``j + q`` (``q < size <= 64``) leaves its exponent field
    (``field``: the field's bits in place, of the bits' dtype); a loop the compiler turns
    into vector compares, at the bits' own width."""
    word = _ZERO
    for q in range(size):
        word |= np.uint64(((old[j + q] ^ new[j + q]) & field) != 0) << np.uint64(q)
    return word


@njit(cache=True, nogil=True)
def _moves(rows, positions, old, new, shift, mask, field, forward, changed):  # type: ignore[no-untyped-def]
    """:func:`move_rows` in this thread, the old exponents counted into ``changed`` unless
    it is empty. The changes that leave their exponent (few) are found 64 at a time by one
    mask, and only they touch a row: the row of the first, and of the first past each
    row's last change (a search of the positions). (A branch per change on its exponent,
    its row taken from its position, cost 40 ns each that moved: the count was written at
    an address that waited on a missed load. Masks taken row by row, with each row's end
    in the loop bound, did not compile to vector compares; nor did these, compiled through
    numba's parallel pipeline as a parallel kernel or its twin: 7M changes took 11 ms on
    each of two threads against 3 ms here.)"""
    if changed.size:
        _tally_old(old, shift, mask, changed)
    step = 1 if forward else -1
    n = positions.size
    t, row_end = 0, 0
    j = 0
    while j < n:
        word = _moved(old, new, j, min(_GROUP, n - j), field)
        while word != _ZERO:
            k = j + np.int64(TRAILING_ZEROS(word))
            word &= word - _ONE
            if k >= row_end:  # the first change of another row
                t = positions[k] // TASK
                row_end = k + np.searchsorted(positions[k:], (t + 1) * TASK)
            rows[t, _exponent(old[k], shift, mask)] -= step
            rows[t, _exponent(new[k], shift, mask)] += step
        j += _GROUP


@njit(cache=True, inline="always")
def _tally_old(old, shift, mask, changed):  # type: ignore[no-untyped-def]
    """``changed[e]`` += the changes whose old exponent is ``e``, on four interleaved rows
    of counters (equal neighbours do not wait on one counter)."""
    width = mask + 1
    tallies = np.zeros(4 * width, dtype=np.int64)
    n = old.size
    j = 0
    while j + 4 <= n:
        for r in range(4):
            tallies[r * width + _exponent(old[j + r], shift, mask)] += 1
        j += 4
    while j < n:
        tallies[_exponent(old[j], shift, mask)] += 1
        j += 1
    for e in range(width):
        for r in range(4):
            changed[e] += tallies[r * width + e]


def move_rows(
    rows: np.ndarray,
    positions: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    shift: int,
    mask: int,
    *,
    forward: bool,
    tally: bool = True,
) -> np.ndarray:
    """Move each changed element between its old and new exponent in its task's row of
    ``rows`` (in place; ``forward``: from old to new), where ``old`` and ``new`` are the bits
    at ``positions`` (increasing); returns the histogram of the old exponents of the changed
    elements (with ``tally``; else an empty array)."""
    changed = np.zeros(mask + 1 if tally else 0, dtype=np.int64)
    field = old.dtype.type(mask << shift)  # the exponent field in place, at the bits' width
    _moves(rows, positions, old, new, shift, mask, field, forward, changed)
    return changed


@njit(cache=True, nogil=True)
def rows_add_up(rows: np.ndarray, numel: int, run: int) -> bool:  # pragma: no cover - compiled
    """Whether each row of ``rows`` counts ``run`` elements, the last the rest of
    ``numel`` (the totals :func:`dcr_format.codings.classed.rows_fit` checks)."""
    runs = rows.shape[0]
    for r in range(runs):
        total = 0
        for e in range(rows.shape[1]):
            total += rows[r, e]
        if total != (run if r < runs - 1 else numel - (runs - 1) * run):
            return False
    return True


@njit(cache=True, nogil=True)
def class_starts(
    rows: np.ndarray, base: int, count: int
) -> np.ndarray:  # pragma: no cover - compiled
    """Per task and class, how many elements of the class come before the task
    (``(tasks + 1) x count``; the last row holds the class sizes)."""
    tasks, exponents = rows.shape
    starts = np.zeros((tasks + 1, count), dtype=np.int64)
    for t in range(tasks):
        for c in range(count):
            starts[t + 1, c] = starts[t, c]
        for e in range(exponents):
            starts[t + 1, min(max(e - base, 0), count - 1)] += rows[t, e]
    return starts


# --- the writer's choice of classes (classed.choose_classes) ----------------------------


@njit(cache=True, nogil=True)
def class_intervals(
    everything: np.ndarray, changed: np.ndarray
) -> tuple[int, int, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The integer half of :func:`dcr_format.codings.classed.choose_classes`: ``low``, the
    width ``top - low + 1`` of the exponents present, and the elements and changes in each
    interval a class can be (every first class, middle class, last class, then the whole
    range), in the reference's order."""
    low, top = -1, -1
    for e in range(everything.size):
        if everything[e]:
            top = e
            if low < 0:
                low = e
    width = top - low + 1
    all_cum = np.zeros(everything.size + 1, dtype=np.int64)
    chg_cum = np.zeros(everything.size + 1, dtype=np.int64)
    for e in range(everything.size):
        all_cum[e + 1] = all_cum[e] + everything[e]
        chg_cum[e + 1] = chg_cum[e] + changed[e]
    end = everything.size
    totals = np.empty(3 * width + 1, dtype=np.int64)
    changes = np.empty(3 * width + 1, dtype=np.int64)
    for i in range(width):
        e = low + i
        for kind, lo, hi in ((0, 0, e + 1), (1, e, e + 1), (2, e, end)):
            totals[kind * width + i] = all_cum[hi] - all_cum[lo]
            changes[kind * width + i] = chg_cum[hi] - chg_cum[lo]
    totals[3 * width] = all_cum[end]
    changes[3 * width] = chg_cum[end]
    return low, width, totals, changes


@njit(cache=True, nogil=True)
def interval_odds(totals: np.ndarray, changes: np.ndarray) -> np.ndarray:  # pragma: no cover
    """The changed share ``p`` of each interval (first half) and ``1 - p`` (second half),
    each clipped to ``[1e-300, 1]``: the doubles :func:`dcr_format.codings.classed._rice_bits`
    takes the logarithms of (the caller takes them with numpy, whose ``log2`` the
    estimates must use, bit for bit)."""
    n = totals.size
    out = np.empty(2 * n, dtype=np.float64)
    for i in range(n):
        t = max(np.float64(totals[i]), 1.0)
        p = min(max(np.float64(changes[i]) / t, 1e-300), 1.0)
        out[i] = p
        out[n + i] = min(max(1.0 - p, 1e-300), 1.0)
    return out


@njit(cache=True, nogil=True)
def interval_costs(
    totals: np.ndarray, changes: np.ndarray, odds: np.ndarray, logs: np.ndarray, header: float
) -> np.ndarray:  # pragma: no cover - compiled
    """:func:`dcr_format.codings.classed._rice_bits` plus ``header`` from the intervals'
    :func:`interval_odds` and their base-2 logarithms (``logs``): the reference's operations
    in its order (no fused multiply-add), so the same doubles."""
    n = totals.size
    costs = np.empty(n, dtype=np.float64)
    for i in range(n):
        if changes[i] == 0:
            bits = 0.0
        elif changes[i] == totals[i]:
            bits = 8.0
        else:
            t = max(np.float64(totals[i]), 1.0)
            entropy = -(odds[i] * logs[i] + odds[n + i] * logs[n + i]) * t
            bits = 1.03 * entropy + 24.0
        costs[i] = bits + header
    return costs


@njit(cache=True, nogil=True)
def least_estimate(
    costs: np.ndarray, width: int, most: int
) -> tuple[int, int]:  # pragma: no cover - compiled
    """The float half of :func:`dcr_format.codings.classed.choose_classes` over the interval
    ``costs`` (:func:`class_intervals`' order): ``(K, base index)`` of least estimate, the
    smaller ``K`` and then the smaller base on ties, each estimate summed in the
    reference's order (first class, middle classes in turn, last class), so the doubles
    are the reference's, bit for bit."""
    best = costs[3 * width]  # K = 1: one class, whatever the base (the smallest is taken)
    best_k, best_b = 1, 0
    partial = costs[:width].copy()  # per base: its first class and middle ones so far
    for count in range(2, most + 1):
        bases = width - count + 1
        for b in range(bases):
            total = partial[b] + costs[2 * width + count - 1 + b]
            if total < best:
                best, best_k, best_b = total, count, b
        for b in range(bases):
            partial[b] = partial[b] + costs[width + count - 1 + b]
    return best_k, best_b


@njit(cache=True, nogil=True)
def class_odds(
    everything: np.ndarray, changed: np.ndarray
) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """:func:`class_intervals` and their :func:`interval_odds` in one call (the writer makes
    this choice once a tensor; each compiled call costs a few us of its own)."""
    low, width, totals, changes = class_intervals(everything, changed)
    return low, width, totals, changes, interval_odds(totals, changes)


@njit(cache=True, nogil=True)
def least_classes(
    totals: np.ndarray,
    changes: np.ndarray,
    odds: np.ndarray,
    logs: np.ndarray,
    header: float,
    width: int,
    most: int,
) -> tuple[int, int]:  # pragma: no cover - compiled
    """:func:`interval_costs` and their :func:`least_estimate` in one call."""
    return least_estimate(interval_costs(totals, changes, odds, logs, header), width, most)


# --- the k-th set bit of a word ---------------------------------------------------------

_M1 = np.uint64(0x5555555555555555)
_M2 = np.uint64(0x3333333333333333)
_M4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_H01 = np.uint64(0x0101010101010101)
_H80 = np.uint64(0x8080808080808080)
_B8 = np.uint64(0xFF)
# the position of the j-th set bit (j < 8) of each byte value, at [value * 8 + j]
_SELECT8 = np.array(
    [
        [i for i in range(8) if value >> i & 1][j] if j < bin(value).count("1") else 8
        for value in range(256)
        for j in range(8)
    ],
    dtype=np.uint8,
)


@njit(cache=True, inline="always")
def _select_bit(m, k):  # type: ignore[no-untyped-def]
    """The position of the ``k``-th set bit (from 0, ``k`` below the count) of ``m``:
    each byte's count and their running sums (one multiply), the byte the bit is in found
    from those sums at once, then a table within that byte (no loop over the bits)."""
    s = m - ((m >> _ONE) & _M1)
    s = (s & _M2) + ((s >> np.uint64(2)) & _M2)
    s = (s + (s >> np.uint64(4))) & _M4
    sums = s * _H01  # byte i: the set bits of bytes 0 .. i (each at most 64, so no carry)
    # bytes whose running sum exceeds k keep their top bit; the first of them holds the bit
    over = ((sums | _H80) - np.uint64(k + 1) * _H01) & _H80
    byte = np.uint64(TRAILING_ZEROS(over)) & ~np.uint64(7)  # 8 x the byte's index
    before = np.int64(((sums << np.uint64(8)) >> byte) & _B8)  # set bits below the byte
    value = np.int64((m >> byte) & _B8)
    return np.int64(byte) + np.int64(_SELECT8[value * 8 + k - before])


# the select pass's pick of a member: one bit deposit where the machine has a fast one
# (about a fifth less time at 5% change), else the byte table above; a global, so numba
# compiles only the one chosen
_nth_member = deposit_select if fast_deposit() else _select_bit


# --- pass 2: each group's class members --------------------------------------------------
# A group is 64 elements (tasks are whole groups). Its *members* are one word per class: bit
# q of ``members[c]`` is set where element q is of class c. They come from one load of the
# group (:func:`~dcr_format.kernels._native_bits.class_masks`: the group's classes narrowed
# to bytes, then one byte compare per class), so a pass costs about one vector compare and
# ``K`` population counts a group, with no branch per element.


@njit(cache=True, inline="always")
def _group_members(bits, g0, hi, shift, mask, base, count, members):  # type: ignore[no-untyped-def]
    """The members of each class in the group at ``g0`` (elements up to ``hi``, exclusive)
    into ``members`` (16 words; classes from ``count`` on have none). ``base`` at most
    ``mask + 1`` (:func:`_low_base`)."""
    if g0 + _GROUP <= hi:
        class_masks(bits, g0, shift, mask, base, count - 1, members)
    else:  # the tensor's last, partial group, element by element
        members[:] = _ZERO
        for q in range(hi - g0):
            members[_class_of(bits[g0 + q], shift, mask, base, count)] |= _ONE << np.uint64(q)


def _low_base(base: int, mask: int) -> int:
    """A ``base`` that gives the same classes and fits an element (every exponent is at
    most ``mask``, so a larger base puts every element in class 0 either way)."""
    return min(base, mask + 1)


@njit(cache=True, nogil=True)
def _classes_at(values, shift, mask, base, count, out):  # type: ignore[no-untyped-def]
    """The class of each of ``values`` into ``out`` (uint8; a loop the compiler turns into
    vector operations, where a class taken inside the rank pass costs a branch)."""
    for j in range(values.size):
        out[j] = _class_of(values[j], shift, mask, base, count)


def classes_at(values: np.ndarray, shift: int, mask: int, base: int, count: int) -> np.ndarray:
    """The class of each of ``values`` (uint8: ``K <= 16``, a byte, 8x less to write than
    an int64)."""
    out = np.empty(values.size, dtype=np.uint8)
    _classes_at(values, shift, mask, _low_base(base, mask), count, out)
    return out


# --- pass 2, writer: each changed element's class and rank -------------------------------


@njit(cache=True, inline="always")
def _ranks_task(  # type: ignore[no-untyped-def]
    t, bits, positions, classes, moved, shift, mask, base, count, before, bounds, ranks, adjacent
):
    """Task ``t`` of the writer's rank pass: a changed element's rank is the members of its
    class before its group (``seen``) plus those below it in the group. ``classes`` are the
    changed elements' old classes and ``moved`` their classes in ``bits``; where ``bits``
    are the new bits the two differ, and each change's bit is moved back to its old class
    first, in position order (without a branch), so every rank counts old classes.
    ``adjacent[t]``: how many of the task's positions directly follow the position before
    them (so the runs of the positions are counted too, for the writer's size floor of the
    plain codings)."""
    j, end = bounds[t], bounds[t + 1]
    if j == end:
        return
    previous = positions[j - 1] if j > 0 else np.int64(-2)
    touching = np.int64(0)
    n = bits.shape[0]
    last = positions[end - 1]
    seen = np.zeros(CLASSES, dtype=np.int64)
    for c in range(count):
        seen[c] = before[t, c]
    members = np.zeros(CLASSES, dtype=np.uint64)
    g0 = t * TASK
    while g0 <= last:
        _group_members(bits, g0, n, shift, mask, base, count, members)
        while j < end and positions[j] < g0 + _GROUP:
            p = positions[j]
            touching += np.int64(p == previous + 1)
            previous = p
            bit = _ONE << np.uint64(p - g0)
            mine = classes[j]
            members[moved[j]] &= ~bit
            members[mine] |= bit
            ranks[j] = seen[mine] + popcount(members[mine] & (bit - _ONE))
            j += 1
        for c in range(count):
            seen[c] += popcount(members[c])
        g0 += _GROUP
    adjacent[t] = touching


@parallel_kernel
def _ranks(  # type: ignore[no-untyped-def]
    bits, positions, classes, moved, shift, mask, base, count, before, bounds, ranks, adjacent
):
    for t in prange(bounds.shape[0] - 1):
        _ranks_task(
            t,
            bits,
            positions,
            classes,
            moved,
            shift,
            mask,
            base,
            count,
            before,
            bounds,
            ranks,
            adjacent,
        )


def class_ranks(
    bits: np.ndarray,
    positions: np.ndarray,
    old_at: np.ndarray,
    shift: int,
    mask: int,
    base: int,
    count: int,
    starts: np.ndarray,
    new_at: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Each changed position's class and its rank among the elements of that class
    (``starts``: :func:`class_starts` of the tasks' histograms), and how many positions
    follow the one before them directly (``positions.size`` less the runs they make).
    ``old_at``: the old bits at the positions. ``new_at``, where ``bits`` are the new bits:
    ``bits`` at the positions (the old classes are counted from ``old_at``)."""
    tasks = starts.shape[0] - 1
    if old_at.size != positions.size or (new_at is not None and new_at.size != positions.size):
        raise ValueError("old_at and new_at must have one element per position")
    if tasks == 1 and (positions.size == 0 or positions[-1] < TASK):  # one task takes all
        bounds = np.array([0, positions.size], dtype=np.int64)
    else:
        bounds = np.searchsorted(positions, np.arange(tasks + 1, dtype=np.int64) * TASK)
    low = _low_base(base, mask)
    classes = classes_at(old_at, shift, mask, base, count)
    moved = classes if new_at is None else classes_at(new_at, shift, mask, base, count)
    ranks = np.empty(positions.size, dtype=np.int64)
    adjacent = np.zeros(tasks, dtype=np.int64)
    args = (bits, positions, classes, moved, shift, mask, low, count, starts, bounds)
    _launch(_ranks, tasks, *args, ranks, adjacent)
    return classes, ranks, int(adjacent[0] if tasks == 1 else adjacent.sum())


# --- pass 2, reader: the positions of the wanted ranks -----------------------------------

_FAR = np.int64(1) << np.int64(62)  # the distance of a class with no wanted rank left


@njit(cache=True, inline="always")
def _write_hits(hits, g0, j, end, bits, out, old_at):  # type: ignore[no-untyped-def]
    """The set bits of ``hits`` (a word of the group at ``g0``), lowest first, as positions
    into ``out`` from ``j`` on, never at ``end`` or past it; ``old_at``, where not empty,
    takes the bits at each (in cache there)."""
    while hits != _ZERO and j < end:
        q = g0 + np.int64(TRAILING_ZEROS(hits))
        out[j] = q
        if old_at.size > 0:
            old_at[j] = bits[q]
        hits &= hits - _ONE
        j += 1


@njit(cache=True, inline="always")
def _select_span(t, offsets, n):  # type: ignore[no-untyped-def]
    """Task ``t`` of a select pass: where its positions go in the output (``o`` to
    ``share``) and the elements it covers (``lo`` to ``hi`` of ``n``)."""
    lo = t * TASK
    return offsets[t], offsets[t + 1], lo, min(lo + TASK, n)


@njit(cache=True, inline="always")
def _positions_task(  # type: ignore[no-untyped-def]
    t, bits, shift, mask, base, count, before, ranks, cursor, ends, offsets, out, done, old_at
):
    """Task ``t`` of the select pass. ``far[c]``: how many more members of class ``c`` come
    before its next wanted rank; each group takes its members off every class at once
    (a loop without a branch), and only the classes that went below zero hold a
    wanted element in the group (a word of their flags, visited bit by bit), the
    ``far[c] + members``-th member of the class's mask. ``done[t]``: how many positions the
    task found (its share, ``offsets[t + 1] - offsets[t]``, unless the old bits are not
    those the class starts were counted from; nothing is written past its share).
    ``old_at``, where not empty, takes the bits at each position found (in cache there, so a
    caller that needs them does not read the tensor again at positions spread over it)."""
    o, share, lo, hi = _select_span(t, offsets, bits.shape[0])
    done[t] = 0
    if o == share:
        return
    ptr = np.zeros(16, dtype=np.int64)
    far = np.full(16, _FAR, dtype=np.int64)
    for c in range(count):
        ptr[c] = cursor[t, c]
        if ptr[c] < ends[c]:
            far[c] = ranks[ptr[c]] - before[t, c]
    members = np.zeros(CLASSES, dtype=np.uint64)
    g0 = lo
    while g0 < hi and o < share:
        _group_members(bits, g0, hi, shift, mask, base, count, members)
        flags = _ZERO
        # every class, so the loop has a fixed length and compiles to vector operations; a
        # class past the stream's has no members and never runs out
        for c in range(CLASSES):
            far[c] -= popcount(members[c])
            flags |= np.uint64(far[c] < 0) << np.uint64(c)
        if flags != _ZERO:
            hits = _ZERO
            while flags != _ZERO:
                h = np.int64(TRAILING_ZEROS(flags))  # a class that ran out in the group
                flags &= flags - _ONE
                m = members[h]
                size = popcount(m)
                left, at = far[h], ptr[h]
                while left < 0:
                    hits |= _ONE << np.uint64(_nth_member(m, left + size))
                    at += 1
                    left = left + ranks[at] - ranks[at - 1] if at < ends[h] else _FAR
                far[h], ptr[h] = left, at
            _write_hits(hits, g0, o, share, bits, out, old_at)
            o += popcount(hits)
        g0 += _GROUP
    done[t] = o - offsets[t]


@parallel_kernel
def _positions(  # type: ignore[no-untyped-def]
    bits, shift, mask, base, count, before, ranks, cursor, ends, offsets, out, done, kept
):
    for t in prange(offsets.shape[0] - 1):
        _positions_task(
            t, bits, shift, mask, base, count, before, ranks, cursor, ends, offsets, out, done, kept
        )


_DEPOSIT, _DEPOSIT_FAST = has_deposit(), fast_deposit()  # the dense pass needs ``pdep``


def positions_of_ranks(
    bits: np.ndarray,
    shift: int,
    mask: int,
    base: int,
    count: int,
    starts: np.ndarray,
    ranks: np.ndarray,
    first: np.ndarray,
    old_at: np.ndarray | None = None,
    *,
    dense: bool | None = None,
) -> np.ndarray | None:
    """Flat positions, increasing, of the listed ranks: class ``c``'s ranks are
    ``ranks[first[c]:first[c + 1]]``, strictly increasing and each below the class size
    (``starts[-1, c]``); ``starts``: :func:`class_starts` of the tasks' histograms. None
    when ``bits`` do not hold the classes ``starts`` counts (some task finds more or fewer
    of its ranks than they place in it). ``old_at`` (``ranks.size`` elements of ``bits``'
    dtype), where given, takes the bits at the positions found. ``dense``: whether to take
    the dense pass (:func:`_dense_positions_task`); by default where the machine has a
    fast bit deposit and :func:`dense_wins`. Both passes give the same result."""
    tasks = starts.shape[0] - 1
    if old_at is not None and (old_at.size != ranks.size or old_at.dtype != bits.dtype):
        raise ValueError("old_at must have one element of the bits' dtype per rank")
    cursor, offsets = _select_plan(ranks, first, starts, count)
    out = np.empty(ranks.size, dtype=np.int64)
    done = np.zeros(tasks, dtype=np.int64)
    kept = bits[:0] if old_at is None else old_at
    if dense is None:
        dense = _DEPOSIT_FAST and dense_wins(ranks.size, bits.size)
    if offsets[-1] != ranks.size:
        raise ValueError("every class's ranks must lie below its size")
    fields = (bits, shift, mask, _low_base(base, mask), count, starts, ranks, cursor)
    if dense and _DEPOSIT:
        plan = (offsets, out, done, kept)
        _launch(_dense_positions, tasks, *fields, *plan)
    else:
        _launch(_positions, tasks, *fields, first[1:], offsets, out, done, kept)
    return out if _found_all(done, offsets) else None


DENSE_SHARE = 40
"""The dense select pass is taken where at least one element in this many changed: its
cost is the same for every group of 64 elements (about 26 ns with 9 classes), where the
pass that follows each class's next wanted rank costs more the more of them a group holds
(about 24 ns a group at 1% change and 44 ns at 5%; the two meet near 2%)."""


def dense_wins(changed: int, numel: int) -> bool:
    """Whether the dense select pass is the faster for ``changed`` of ``numel`` elements
    (:data:`DENSE_SHARE`)."""
    return changed * DENSE_SHARE >= numel


# --- pass 2, reader, dense: a task's wanted ranks as a bit per member ---------------------
# A task numbers each class's members in it by rank, in a region of bits of the class's own
# (its regions one after the other, each starting on a word), and sets the bits of the
# wanted ranks. A group takes, for every class, the region's next bits, as many as the
# class has members in the group, and deposits them onto the members (one ``pdep``): their
# OR is the group's wanted elements, with no branch per class or per element. Each class
# must end its region exactly: else the bits are not those the class starts were counted
# from.


@njit(cache=True, inline="always")
def _dense_positions_task(  # type: ignore[no-untyped-def]
    t, bits, shift, mask, base, count, starts, ranks, plan, offsets, out, done, old_at
):
    """Task ``t`` of the dense select pass: as :func:`_positions_task` (``done[t]``: the
    positions found, or -1 where a class does not end its region)."""
    o, share, lo, hi = _select_span(t, offsets, bits.shape[0])
    done[t] = 0
    if o == share:
        return
    at = np.zeros(CLASSES + 1, dtype=np.int64)  # where each class's region starts
    for c in range(count):
        at[c + 1] = at[c] + (starts[t + 1, c] - starts[t, c] + 63) // 64 * 64
    words = np.zeros(at[count] // 64 + 2, dtype=np.uint64)  # and a word past the last
    for c in range(count):  # the task's ranks of the class (``plan``: _select_plan's)
        for j in range(plan[t, c], plan[t + 1, c]):
            b = at[c] + ranks[j] - starts[t, c]
            words[b >> 6] |= _ONE << np.uint64(b & 63)
    cursor = np.zeros(CLASSES, dtype=np.int64)  # each class's next bit of ``words``
    for c in range(count):
        cursor[c] = at[c]
    last = words.shape[0] - 2  # the last word a read of two may start at (a cursor run
    # past its region on bits of other classes reads the regions' padding, then fails)
    members = np.zeros(CLASSES, dtype=np.uint64)
    keep_old = old_at.size > 0
    g0 = lo
    while g0 < hi:
        _group_members(bits, g0, hi, shift, mask, base, count, members)
        hits = _ZERO
        for c in range(count):
            m = members[c]
            b = cursor[c]
            w = min(b >> 6, last)
            s = np.uint64(b & 63)
            # the 64 bits from ``b`` on (the second word's shifted in two steps, so that a
            # shift of 64 never happens)
            ahead = (words[w] >> s) | ((words[w + 1] << _ONE) << (np.uint64(63) - s))
            hits |= deposit(ahead, m)
            cursor[c] = b + popcount(m)
        found = popcount(hits)
        if o + max(found, 4) <= share:  # four stores without a branch, then any more
            for j in range(4):  # (a store past ``found`` is overwritten by a later group)
                q = min(g0 + np.int64(TRAILING_ZEROS(hits)), hi - 1)
                out[o + j] = q
                if keep_old:
                    old_at[o + j] = bits[q]
                hits &= hits - _ONE
            _write_hits(hits, g0, o + 4, share, bits, out, old_at)
        else:  # near the end of the task's share: nothing is written past it
            _write_hits(hits, g0, o, share, bits, out, old_at)
        o += found
        g0 += _GROUP
    for c in range(count):
        if cursor[c] != at[c] + starts[t + 1, c] - starts[t, c]:
            o = offsets[t] - 1
    done[t] = o - offsets[t]


@parallel_kernel
def _dense_positions(  # type: ignore[no-untyped-def]
    bits, shift, mask, base, count, starts, ranks, plan, offsets, out, done, old_at
):
    for t in prange(offsets.shape[0] - 1):
        _dense_positions_task(
            t, bits, shift, mask, base, count, starts, ranks, plan, offsets, out, done, old_at
        )


@njit(cache=True, nogil=True)
def _select_plan(ranks, first, starts, count):  # type: ignore[no-untyped-def]
    """Where each task's share of every class's ranks starts (``cursor``: the first rank of
    class ``c`` at or past the class's start in the task, as ``np.searchsorted``), and where
    each task's positions go in the output (``offsets``)."""
    tasks = starts.shape[0] - 1
    cursor = np.empty((tasks + 1, count), dtype=np.int64)
    offsets = np.zeros(tasks + 1, dtype=np.int64)
    for c in range(count):
        j = first[c]
        for t in range(tasks + 1):  # the class's starts grow with t: each search from the last
            j += np.searchsorted(ranks[j : first[c + 1]], starts[t, c])  # (a walk: 1 ns a rank)
            cursor[t, c] = j
            offsets[t] += j - first[c]
    return cursor, offsets


@njit(cache=True, nogil=True)
def _found_all(done, offsets):  # type: ignore[no-untyped-def]
    """Whether every task found exactly its share of the positions."""
    for t in range(done.size):
        if done[t] != offsets[t + 1] - offsets[t]:
            return False
    return True
