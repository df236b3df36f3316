"""Compiled (numba) kernels of the ``classed`` position coding's class parts
(:mod:`dcr_format.codings.classed`, FORMAT.md §6.5): each class's ranks Rice-coded, on one
thread or a few, and read back.

Private, imported on first use like :mod:`dcr_format.codings._classed_kernels` (which makes
the ranks); they reproduce the reference exactly (``tests/test_codec_classed.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange

from dcr_format.codings._rans_kernels import _put_varint, _varint_len
from dcr_format.codings._rice_kernels import _add_shifted, _rice_decode, _rice_encode
from dcr_format.kernels._launch import _launch, parallel_kernel

# --- the classes' Rice parts: on one thread, or a few ------------------------------------

_PARALLEL_RANKS = 1 << 16  # changes below which a tensor's classes are coded in this thread


def _class_tasks(counts: np.ndarray) -> tuple[int, np.ndarray]:
    """How many threads code the classes of a stream whose classes have ``counts`` ranks,
    and each class's task (:func:`_owners`): one task below :data:`_PARALLEL_RANKS` (a
    parallel launch costs more than it saves), else one per thread numba runs, at most one
    per class with ranks."""
    tasks = 1
    if int(counts.sum()) >= _PARALLEL_RANKS:
        tasks = max(1, min(int(np.count_nonzero(counts)), numba.get_num_threads()))
    if tasks == 1:
        return 1, np.zeros(counts.size, dtype=np.int64)
    return tasks, _owners(counts, tasks)


@njit(cache=True, nogil=True)
def _owners(counts, tasks):  # type: ignore[no-untyped-def]
    """Each part's task: the largest parts first, each to the task with the least ranks so
    far (classes differ in size, so parts split by index would leave a core idle)."""
    owner = np.zeros(counts.size, dtype=np.int64)
    load = np.zeros(tasks, dtype=np.int64)
    placed = np.zeros(counts.size, dtype=np.bool_)
    for _ in range(counts.size):  # at most 16 parts: the largest left (the first on ties)
        j = -1
        for i in range(counts.size):
            if not placed[i] and (j < 0 or counts[i] > counts[j]):
                j = i
        placed[j] = True
        t = np.argmin(load)
        owner[j] = t
        load[t] += counts[j]
    return owner


# --- every class's Rice part in a few calls ----------------------------------------------
# (a tensor has up to 16 classes; one compiled call per class, with its checks and arrays,
# cost ~40 us each: 0.15 s of a 254-tensor publish). Classes are coded and decoded
# independently, so past _PARALLEL_RANKS changes each thread takes whole classes, the
# largest first (balanced by their ranks, as class sizes differ).


@njit(cache=True, inline="always")
def _rice_plan(c, ranks, ends, guesses, max_k, ks, unary):  # type: ignore[no-untyped-def]
    """Class ``c``'s Rice parameter and unary byte length (FORMAT.md §6.2's choice, as
    :class:`dcr_format.codings.positions._Plan` makes it): its ranks are
    ``ranks[ends[c]:ends[c + 1]]``, its k searched in ``[guess - 2, guess + 3]``."""
    n = ends[c + 1] - ends[c]
    if n == 0:
        return
    low = max(0, guesses[c] - 2)
    high = min(max_k, guesses[c] + 3)
    # sum(gap >> (low + j)) for j in 0..5; those past ``high`` are not looked at
    sums = (0, 0, 0, 0, 0, 0)
    prev = -1
    for i in range(ends[c], ends[c + 1]):
        sums = _add_shifted(sums, (ranks[i] - prev - 1) >> low)
        prev = ranks[i]
    best, best_bits = low, sums[0] + n * (1 + low)
    for k in range(low + 1, high + 1):
        bits = sums[k - low] + n * (1 + k)
        if bits < best_bits:
            best, best_bits = k, bits
    ks[c] = best
    unary[c] = (sums[best - low] + n + 7) // 8


@njit(cache=True, inline="always")
def _class_part(c, ranks, ends, ks, unary, at, out):  # type: ignore[no-untyped-def]
    """Class ``c``'s part of a ``classed`` stream (its ``k``, varint ``U`` and Rice body)
    into ``out`` from ``at[c]`` (``out`` zeroed there)."""
    n = ends[c + 1] - ends[c]
    if n == 0:
        return
    here = at[c]
    out[here] = np.uint8(ks[c])
    here = _put_varint(out, here + 1, np.uint64(unary[c]))
    body = unary[c] + (n * ks[c] + 7) // 8
    _rice_encode(ranks[ends[c] : ends[c + 1]], ks[c], unary[c], out[here : here + body])


@parallel_kernel
def _plans(ranks, ends, guesses, max_k, owner, ks, unary):  # type: ignore[no-untyped-def]
    for t in prange(owner.max() + 1):
        for c in range(owner.size):
            if owner[c] == t:
                _rice_plan(c, ranks, ends, guesses, max_k, ks, unary)


@parallel_kernel
def _parts(ranks, ends, ks, unary, owner, at, out):  # type: ignore[no-untyped-def]
    for t in prange(owner.max() + 1):
        for c in range(owner.size):
            if owner[c] == t:
                _class_part(c, ranks, ends, ks, unary, at, out)


_plans_one, _parts_one = _plans.serial, _parts.serial  # compiled code calls plain names


@njit(cache=True, inline="always")
def _tally_chunk(t, classes, ranks, bounds, counts, last):  # type: ignore[no-untyped-def]
    """Chunk ``t``'s counts, kept in the task's own arrays until the end (rows of one
    small array written by two threads share cache lines)."""
    count = counts.shape[1]
    mine = np.zeros(count, dtype=np.int64)
    latest = np.full(count, -1, dtype=np.int64)
    for j in range(bounds[t], bounds[t + 1]):
        c = classes[j]
        mine[c] += 1
        latest[c] = ranks[j]
    counts[t] = mine
    last[t] = latest


@parallel_kernel
def _tallies(classes, ranks, bounds, counts, last):  # type: ignore[no-untyped-def]
    for t in prange(counts.shape[0]):
        _tally_chunk(t, classes, ranks, bounds, counts, last)


@njit(cache=True, inline="always")
def _scatter_chunk(t, classes, ranks, bounds, cursor, out):  # type: ignore[no-untyped-def]
    at = cursor[t].copy()  # the task's own (see _tally_chunk)
    for j in range(bounds[t], bounds[t + 1]):
        c = classes[j]
        out[at[c]] = ranks[j]
        at[c] += 1


@parallel_kernel
def _scatter(classes, ranks, bounds, cursor, out):  # type: ignore[no-untyped-def]
    for t in prange(cursor.shape[0]):
        _scatter_chunk(t, classes, ranks, bounds, cursor, out)


class Tallies(NamedTuple):
    """What :func:`class_tallies` counts of the changes' classes, in position order."""

    sizes: np.ndarray  # the changes of each class
    last: np.ndarray  # the rank of each class's last change (0 where it has none)
    chunks: np.ndarray  # the changes' bounds of the chunks counted apart (chunks + 1)
    counts: np.ndarray  # each chunk's changes of each class (chunks x classes)


def class_tallies(classes: np.ndarray, ranks: np.ndarray, count: int) -> Tallies:
    """Per class, how many changes it has and the rank of its last one (its largest);
    counted in chunks of the changes on several threads past :data:`_PARALLEL_RANKS`
    changes, each chunk's counts kept for :func:`by_class`."""
    n = classes.size
    chunks = 1 if n < _PARALLEL_RANKS else max(1, numba.get_num_threads())
    if chunks == 1:  # one compiled call (the numpy steps below cost more than the count)
        return Tallies(*_tally_one(classes, ranks, count))
    bounds = np.arange(chunks + 1, dtype=np.int64) * n // chunks
    counts = np.zeros((chunks, count), dtype=np.int64)
    last = np.full((chunks, count), -1, dtype=np.int64)
    _launch(_tallies, chunks, classes, ranks, bounds, counts, last)
    sizes = counts.sum(axis=0)
    final = last.max(axis=0)  # ranks grow along each class: the last chunk's is the largest
    return Tallies(sizes, np.maximum(final, 0), bounds, counts)


def tallies_of(classes: np.ndarray, ranks: np.ndarray, sizes: np.ndarray) -> Tallies:
    """:func:`class_tallies` where each class's changes are known (``sizes``: a writer has
    them from its histogram of the changes' old exponents), so that only each class's
    last rank is looked for, from the end of the changes back (a few changes at most
    where every class has many): one chunk."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    chunks = np.array([0, classes.size], dtype=np.int64)
    return Tallies(sizes, _last_ranks(classes, ranks, sizes), chunks, sizes[None, :].copy())


@njit(cache=True, nogil=True)
def _last_ranks(classes, ranks, sizes):  # type: ignore[no-untyped-def]
    """The rank of each class's last change (0 where it has none), met walking back from
    the last change until every class with changes is."""
    last = np.zeros(sizes.size, dtype=np.int64)
    met = np.zeros(sizes.size, dtype=np.bool_)
    left = 0
    for c in range(sizes.size):
        left += sizes[c] > 0
    j = classes.size - 1
    while left > 0 and j >= 0:
        c = classes[j]
        if not met[c]:
            met[c] = True
            last[c] = ranks[j]
            left -= 1
        j -= 1
    return last


@njit(cache=True, nogil=True)
def _tally_one(classes, ranks, count):  # type: ignore[no-untyped-def]
    """:func:`class_tallies` as one chunk."""
    bounds = np.array([0, classes.size], dtype=np.int64)
    counts = np.zeros((1, count), dtype=np.int64)
    last = np.full((1, count), -1, dtype=np.int64)
    _tally_chunk(0, classes, ranks, bounds, counts, last)
    return counts[0].copy(), np.maximum(last[0], 0), bounds, counts


@njit(cache=True, nogil=True)
def _by_class_one(classes, ranks, sizes):  # type: ignore[no-untyped-def]
    """:func:`by_class` of one chunk."""
    cursor = np.zeros((1, sizes.size), dtype=np.int64)
    for c in range(1, sizes.size):
        cursor[0, c] = cursor[0, c - 1] + sizes[c - 1]
    out = np.empty(ranks.size, dtype=np.int64)
    bounds = np.array([0, classes.size], dtype=np.int64)
    _scatter_chunk(0, classes, ranks, bounds, cursor, out)
    return out


def by_class(classes: np.ndarray, ranks: np.ndarray, tallies: Tallies) -> np.ndarray:
    """The ranks grouped by class, each class's in their order (the scatter of a counting
    sort, each chunk of :func:`class_tallies` from where its classes' ranks go)."""
    if tallies.counts.shape[0] == 1:
        return _by_class_one(classes, ranks, tallies.sizes)  # type: ignore[no-any-return]
    ends = np.zeros(tallies.sizes.size + 1, dtype=np.int64)
    np.cumsum(tallies.sizes, out=ends[1:])
    cursor = np.cumsum(tallies.counts, axis=0) - tallies.counts + ends[None, :-1]
    out = np.empty(ranks.size, dtype=np.int64)
    args = (classes, ranks, tallies.chunks, cursor, out)
    _launch(_scatter, cursor.shape[0], *args)
    return out


@njit(cache=True, nogil=True)
def _layout(sizes, ks, unary):  # type: ignore[no-untyped-def]
    """A ``classed`` stream's bytes after its ``K`` and ``base``, zeroed, with the counts
    written, and where each class's part starts in it."""
    count = sizes.size
    size = 0
    for c in range(count):
        size += _varint_len(np.uint64(sizes[c]))
    at = np.zeros(count, dtype=np.int64)
    for c in range(count):
        at[c] = size
        n = sizes[c]
        if n:
            size += 1 + _varint_len(np.uint64(unary[c])) + unary[c] + (n * ks[c] + 7) // 8
    out = np.zeros(size, dtype=np.uint8)
    here = 0
    for c in range(count):
        here = _put_varint(out, here, np.uint64(sizes[c]))
    return out, at


@njit(cache=True, nogil=True)
def _body_one(classes, ranks, sizes, guesses, max_k):  # type: ignore[no-untyped-def]
    """:func:`classed_body` in one compiled call, for the changes of one tally chunk."""
    ends = np.zeros(sizes.size + 1, dtype=np.int64)
    for c in range(sizes.size):
        ends[c + 1] = ends[c] + sizes[c]
    ordered = _by_class_one(classes, ranks, sizes)
    owner = np.zeros(sizes.size, dtype=np.int64)
    ks = np.zeros(sizes.size, dtype=np.int64)
    unary = np.zeros(sizes.size, dtype=np.int64)
    _plans_one(ordered, ends, guesses, max_k, owner, ks, unary)
    out, at = _layout(sizes, ks, unary)
    _parts_one(ordered, ends, ks, unary, owner, at, out)
    return out


_NEAR_POWER = 2.0**-40  # relative distance to a power of two under which a guess is unsure


@njit(cache=True, nogil=True)
def rice_guesses(sizes: np.ndarray, last: np.ndarray, out: np.ndarray) -> int:  # pragma: no cover
    """Each class's Rice guess (:func:`dcr_format.codings.positions.rice_k_guesses`, from
    its count and last rank) into ``out`` without a logarithm where that is exact: with
    ``y = max(mean * 0.6931, 1) = m * 2^e`` (``m`` in ``[0.5, 1)``), ``floor(log2(y))`` is
    ``e - 1`` unless ``y`` lies within ``2^-40`` (relative) of a power of two, where a
    logarithm correct to within a few ulps may round to either side; those classes get -1
    and are counted (the caller takes numpy's logarithm, the reference's, for them).
    ``y = 1`` (a mean gap under 1.44) is 0 exactly."""
    unsure = 0
    for c in range(sizes.size):
        n = sizes[c]
        if n == 0:
            out[c] = 0
            continue
        mean = np.float64(last[c] - (n - 1)) / np.float64(n)
        y = max(mean * 0.6931, 1.0)
        if y == 1.0:
            out[c] = 0
            continue
        m, e = math.frexp(y)
        if m < 0.5 + _NEAR_POWER or m > 1.0 - _NEAR_POWER:
            out[c] = -1
            unsure += 1
        else:
            out[c] = e - 1
    return unsure


def classed_body(
    classes: np.ndarray, ranks: np.ndarray, tallies: Tallies, guesses: np.ndarray, max_k: int
) -> np.ndarray:
    """A ``classed`` stream after its ``K`` and ``base`` (FORMAT.md §6.5): the count of
    every class, then each class's ``k``, varint ``U`` and Rice body, from the changes'
    classes and ranks in position order (``tallies``: :func:`class_tallies` of them;
    ``guesses``: each class's §6.2 guess of ``k``). The ranks are grouped by class
    (:func:`by_class`); past :data:`_PARALLEL_RANKS` changes the classes' plans and parts
    are then made on several threads, each class by one."""
    sizes = tallies.sizes
    if tallies.counts.shape[0] == 1 and classes.size < _PARALLEL_RANKS:
        return _body_one(classes, ranks, sizes, guesses, max_k)  # type: ignore[no-any-return]
    ends = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=ends[1:])
    ordered = by_class(classes, ranks, tallies)
    tasks, owner = _class_tasks(sizes)
    ks = np.zeros(sizes.size, dtype=np.int64)
    unary = np.zeros(sizes.size, dtype=np.int64)
    _launch(_plans, tasks, ordered, ends, guesses, max_k, owner, ks, unary)
    out: np.ndarray
    out, at = _layout(sizes, ks, unary)
    _launch(_parts, tasks, ordered, ends, ks, unary, owner, at, out)
    return out


@njit(cache=True, inline="always")
def _rice_part(j, data, ks, unary, offsets, counts, sizes, at, out, failed):  # type: ignore[no-untyped-def]
    """Decode Rice part ``j`` into ``out[at[j]:]``; ``failed[j]`` set where it breaks §6.2."""
    n, k, u = counts[j], ks[j], unary[j]
    if u * 8 < n:
        failed[j] = 1
        return
    body = data[offsets[j] : offsets[j] + u + (n * k + 7) // 8]
    none = np.empty(0, dtype=np.uint64)
    if _rice_decode(body, u, n, k, sizes[j], out[at[j] : at[j] + n], none, True):
        failed[j] = 1


@parallel_kernel
def _rice_parts(data, ks, unary, offsets, counts, sizes, at, owner, out, failed):  # type: ignore[no-untyped-def]
    for t in prange(owner.max() + 1):
        for j in range(ks.size):
            if owner[j] == t:
                _rice_part(j, data, ks, unary, offsets, counts, sizes, at, out, failed)


@njit(cache=True, nogil=True)
def _part_ranks_one(data, parts, counts, sizes, out):  # type: ignore[no-untyped-def]
    """:func:`part_ranks` in this thread, its columns taken from ``parts`` here."""
    n = parts.shape[0]
    ks = parts[:, 1].copy()
    unary = parts[:, 2].copy()
    offsets = parts[:, 3].copy()
    want = np.empty(n, dtype=np.int64)
    limits = np.empty(n, dtype=np.int64)
    at = np.empty(n, dtype=np.int64)
    total = 0
    for j in range(n):
        c = parts[j, 0]
        want[j], limits[j], at[j] = counts[c], sizes[c], total
        if want[j] > limits[j]:
            return -2
        total += want[j]
    if total != out.size:
        return -2
    failed = np.zeros(n, dtype=np.uint8)
    for j in range(n):
        _rice_part(j, data, ks, unary, offsets, want, limits, at, out, failed)
        if failed[j]:
            return j
    return -1


def part_ranks(
    data: np.ndarray,
    parts: np.ndarray,
    counts: np.ndarray,
    sizes: np.ndarray,
    out: np.ndarray,
    *,
    serial: bool = False,
) -> int:
    """The ranks of every class with positions of a ``classed`` stream, class after class,
    into ``out`` (as many as the counts add up to): ``parts`` holds a row ``(class, k, U,
    offset)`` per class with positions, ``counts`` and ``sizes`` the positions and the
    elements of every class. -1 when all decode; else -2 where a class codes more positions
    than it has, or the first part that breaks §6.2 (the caller decodes again for the
    error). Below :data:`_PARALLEL_RANKS` one compiled call; past it :func:`rice_ranks`
    (``serial``: in this thread)."""
    if out.size < _PARALLEL_RANKS:
        return int(_part_ranks_one(data, parts, counts, sizes, out))
    classes = parts[:, 0]
    want, limits = counts[classes], sizes[classes]
    if not bool((want <= limits).all()) or int(want.sum()) != out.size:
        return -2
    ks, unary, offsets = (np.ascontiguousarray(parts[:, i]) for i in (1, 2, 3))
    return rice_ranks(data, ks, unary, offsets, want, limits, out, serial=serial)


def rice_ranks(
    data: np.ndarray,
    ks: np.ndarray,
    unary: np.ndarray,
    offsets: np.ndarray,
    counts: np.ndarray,
    sizes: np.ndarray,
    out: np.ndarray,
    *,
    serial: bool = False,
) -> int:
    """Decode the Rice part of every class with positions (part ``j``: ``counts[j]`` ranks
    below ``sizes[j]``, body at ``offsets[j]``) into ``out``, one after the other; -1, or
    the first part that breaks a rule of §6.2 (the caller decodes it again for the error).
    The parts decode in parallel where there are enough ranks (each writes only its own
    slice of ``out``), unless ``serial``."""
    at = np.zeros(ks.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=at[1:])
    failed = np.zeros(ks.size, dtype=np.uint8)
    tasks, owner = _class_tasks(counts)
    args = (data, ks, unary, offsets, counts, sizes, at, owner, out, failed)
    _launch(_rice_parts, tasks, *args, serial=serial)
    bad = np.flatnonzero(failed)
    return int(bad[0]) if bad.size else -1
