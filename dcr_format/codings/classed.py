"""The ``classed`` position coding (feature ``positions-classed``, spec/FORMAT.md §6.5).

Both ends hold the baseline, and whether an element changes in an optimizer step depends
strongly on its old value: a step moves a weight by about the learning rate, so a weight
whose bf16 spacing (set by its exponent) is small changes far more often than one whose
spacing is large. This coding splits a tensor's elements into ``K <= 16`` *classes* by the
exponent field of their **old** bits (``clamp(e - base, 0, K - 1)``, ``base`` and ``K`` in
the stream) and codes, per class, the changed elements' ranks in that class's own index
sequence as Rice gaps with the class's own parameter. Decoding needs the old bits (the
reader's resident tensor, which an ``xor`` entry requires to be exact anyway).

Only float dtypes have classes (bfloat16, float16, float32, float64). The numpy code here
is the reference the compiled passes (:mod:`dcr_format.codings._classed_kernels`) are
tested against; it makes a pass over the tensor's elements per class.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import NamedTuple

import numpy as np

from dcr_format.codings import positions as _positions
from dcr_format.errors import PositionsError
from dcr_format.format.names import EXPONENT_FIELDS
from dcr_format.kernels.native import compiled

MAX_CLASSES = 16
_HEADER = struct.Struct("<BH")  # K, base
_RICE_HEADER = struct.Struct("<BQQ")  # the §6.2 header a class's body is decoded under


def exponents(old_bits: np.ndarray, dtype: str) -> np.ndarray:
    """The exponent field of every old element (unsigned bits of a float dtype), as int64."""
    fields = EXPONENT_FIELDS.get(dtype)
    if fields is None:
        raise PositionsError(f"classed positions need a float dtype, not {dtype!r}")
    shift, mask = fields
    wide = old_bits.reshape(-1).astype(np.uint64)
    out: np.ndarray = ((wide >> np.uint64(shift)) & np.uint64(mask)).astype(np.int64)
    return out


def classes_of(old_bits: np.ndarray, dtype: str, base: int, count: int) -> np.ndarray:
    """Each element's class: ``clamp(exponent - base, 0, count - 1)`` (uint8)."""
    out: np.ndarray = np.clip(exponents(old_bits, dtype) - base, 0, count - 1).astype(np.uint8)
    return out


ROW_ELEMENTS = 1 << 18
"""Elements per row of a tensor's *exponent rows* (:func:`exponent_rows`): the compiled
passes' task, so that each task's class counts before it follow from the rows."""


def exponent_rows(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The *exponent rows* of a tensor's bits: per run of :data:`ROW_ELEMENTS` elements, the
    histogram of their exponent field (``runs x (mask + 1)``, int64). Both ends count them
    from the old bits before a ``classed`` stream can be coded or decoded (one pass over
    every element); a long-lived writer or reader keeps them and moves only the changed
    elements (:func:`move_rows`), so that the pass is not made again every step."""
    fields = EXPONENT_FIELDS.get(dtype)
    if fields is None:
        raise PositionsError(f"classed positions need a float dtype, not {dtype!r}")
    shift, mask = fields
    flat = np.ascontiguousarray(bits).reshape(-1)
    native = _native()
    if native is not None:
        none = np.zeros(0, dtype=np.int64)
        rows, _ = native.histograms(flat, none, none.astype(flat.dtype), shift, mask)
        return rows  # type: ignore[no-any-return]
    runs = -(-flat.size // ROW_ELEMENTS)
    run = np.arange(flat.size, dtype=np.int64) // ROW_ELEMENTS
    keys = run * (mask + 1) + exponents(flat, dtype)
    counts = np.bincount(keys, minlength=runs * (mask + 1))
    return counts.reshape(runs, mask + 1).astype(np.int64)


def rows_fit(rows: np.ndarray | None, numel: int, dtype: str) -> bool:
    """Whether ``rows`` have the shape and run totals of a tensor of ``numel`` elements of
    ``dtype`` (a cheap check that they belong to it, not that they match its bits)."""
    if rows is None or dtype not in EXPONENT_FIELDS:
        return False
    runs = -(-numel // ROW_ELEMENTS)
    if rows.shape != (runs, EXPONENT_FIELDS[dtype][1] + 1) or rows.dtype != np.int64:
        return False
    native = _native()
    if native is not None:  # one compiled call: this runs up to three times a tensor
        return bool(native.rows_add_up(rows, numel, ROW_ELEMENTS))
    totals = np.full(runs, ROW_ELEMENTS, dtype=np.int64)
    if runs:
        totals[-1] = numel - (runs - 1) * ROW_ELEMENTS
    return bool(np.array_equal(rows.sum(axis=1), totals))


def move_rows(
    rows: np.ndarray,
    positions: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    dtype: str,
    *,
    forward: bool = True,
    tally: bool = True,
) -> np.ndarray:
    """Move each changed element between its old and new exponent in its run's row of
    ``rows``, in place (``forward``: old to new, so the rows of the old bits become those of
    the new; else back). ``old`` and ``new`` are the bits at the sorted ``positions``.
    Returns the histogram of the changed elements' old exponents (``mask + 1``), or an
    empty array without ``tally`` (a reader, which only moves the rows, saves the count)."""
    shift, mask = EXPONENT_FIELDS[dtype]
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    old = np.ascontiguousarray(old).reshape(-1)
    new = np.ascontiguousarray(new).reshape(-1).astype(old.dtype, copy=False)
    native = _native()
    if native is not None:
        return native.move_rows(  # type: ignore[no-any-return]
            rows, positions, old, new, shift, mask, forward=forward, tally=tally
        )
    was, now = exponents(old, dtype), exponents(new, dtype)
    run = positions // ROW_ELEMENTS
    np.add.at(rows, (run, was), -1 if forward else 1)
    np.add.at(rows, (run, now), 1 if forward else -1)
    if not tally:
        return np.zeros(0, dtype=np.int64)
    return np.bincount(was, minlength=mask + 1).astype(np.int64)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _read_varint(buf: memoryview, offset: int) -> tuple[int, int]:
    value = 0
    for i in range(10):
        if offset + i >= len(buf):
            raise PositionsError("classed positions stream is truncated; the shard is corrupt")
        byte = buf[offset + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if byte == 0 and i:
                raise PositionsError("classed positions stream has an overlong varint")
            return value, offset + i + 1
    raise PositionsError("classed positions stream has a varint over 10 bytes; shard is corrupt")


def _rice_bits(total: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """About the bits Rice coding takes for ``changed`` of ``total`` ranks (an estimate)."""
    t = np.maximum(total.astype(np.float64), 1.0)
    p = np.clip(changed / t, 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    entropy = -(p * np.log2(p) + q * np.log2(q)) * t
    partial = 1.03 * entropy + 24.0
    return np.where(changed == 0, 0.0, np.where(changed == total, 8.0, partial))


CLASS_HEADER_BITS = 8.0
"""What the writer's estimate counts for each class besides its Rice part: its count's varint
(one byte below 128 changes), so a class that buys less than that is merged away."""


def choose_classes(everything: np.ndarray, changed: np.ndarray) -> tuple[int, int]:
    """The reference writer's ``(base, K)`` (FORMAT.md §6.5) from the histograms of the old
    exponents over all elements and over the changed ones: over the exponents present
    (``low`` to ``top``), every ``K`` from 1 to ``min(16, top - low + 1)`` and every
    ``base`` in ``[low, top - K + 1]``, the one of least estimate (each class's
    :func:`_rice_bits` plus :data:`CLASS_HEADER_BITS`), the smaller ``K`` and then the
    smaller ``base`` on ties.

    A class is one of three kinds of exponent interval: the first takes every exponent up to
    the base, a middle one a single exponent, the last every one from its own up. Each
    kind's estimate is evaluated once per exponent (three vectors), and a candidate's
    estimate is the sum of its classes' in class order."""
    native = _native()
    if native is not None:  # compiled but the logarithms (numpy's, as below: the same doubles)
        low, width, totals, changes, odds = native.class_odds(
            np.ascontiguousarray(everything, dtype=np.int64),
            np.ascontiguousarray(changed, dtype=np.int64),
        )
        count, index = native.least_classes(
            totals, changes, odds, np.log2(odds), CLASS_HEADER_BITS, width, min(MAX_CLASSES, width)
        )
        return low + int(index), int(count)
    present = np.flatnonzero(everything)
    low, top = int(present[0]), int(present[-1])
    most = min(MAX_CLASSES, top - low + 1)
    width = top - low + 1
    all_cum = np.concatenate(([0], np.cumsum(everything)))
    chg_cum = np.concatenate(([0], np.cumsum(changed)))
    end = everything.size
    at = low + np.arange(width)  # exponents low .. top
    zero, ends = np.zeros_like(at), np.full_like(at, end)
    # the intervals of every first class (exponents up to b, index b - low), middle class
    # (exponent e alone) and last class (exponents from e up), and of the one class of K = 1
    lo = np.concatenate((zero, at, at, [0]))
    hi = np.concatenate((at + 1, at + 1, ends, [end]))
    costs = _rice_bits(all_cum[hi] - all_cum[lo], chg_cum[hi] - chg_cum[lo]) + CLASS_HEADER_BITS
    first, single, last = costs[:width], costs[width : 2 * width], costs[2 * width : 3 * width]
    whole = float(costs[-1])
    totals = np.full((most, width), np.inf)
    totals[0] = whole  # K = 1: every base gives the same class (argmin takes base low)
    partial = first  # per base: its first class plus its middle ones so far, in order
    for count in range(2, most + 1):
        bases = width - count + 1  # base in low .. top - K + 1
        partial = partial[:bases]
        totals[count - 1, :bases] = partial + last[count - 1 : count - 1 + bases]
        partial = partial + single[count - 1 : count - 1 + bases]  # class K - 1 of K + 1
    k, b = np.unravel_index(int(np.argmin(totals)), totals.shape)  # smaller K, then base
    return low + int(b), int(k) + 1


def class_starts(rows: np.ndarray, base: int, count: int) -> np.ndarray:
    """Per task of ``rows`` (:func:`exponent_rows`) and class of ``base`` and ``count``, how
    many elements of the class come before the task (``(tasks + 1, count)`` int64; the
    last row holds the class sizes)."""
    native = _native()
    if native is not None:
        return np.asarray(native.class_starts(rows, base, count))
    per_task = np.zeros((rows.shape[0], count), dtype=np.int64)
    for e in range(rows.shape[1]):
        per_task[:, min(max(e - base, 0), count - 1)] += rows[:, e]
    starts = np.zeros((rows.shape[0] + 1, count), dtype=np.int64)
    np.cumsum(per_task, axis=0, out=starts[1:])
    return starts


def _native() -> ModuleType | None:
    """The compiled class passes (:mod:`dcr_format.codings._classed_kernels`), or None where
    the reference runs."""
    return compiled("dcr_format.codings._classed_kernels")


def _native_parts() -> ModuleType | None:
    """The compiled class parts (:mod:`dcr_format.codings._classed_rice_kernels`), or None
    where the reference runs."""
    return compiled("dcr_format.codings._classed_rice_kernels")


def old_bits_of(bits: np.ndarray, positions: np.ndarray, xor: np.ndarray | None) -> np.ndarray:
    """The old bits of a tensor: ``bits`` itself, or (``xor`` given: ``bits`` are the new
    bits) the new bits with ``xor`` applied back at ``positions`` (a copy)."""
    if xor is None:
        return bits
    old = bits.copy()
    old[positions] ^= xor.astype(old.dtype, copy=False)
    return old


def encode_classed(
    positions: np.ndarray,
    bits: np.ndarray,
    dtype: str,
    *,
    xor: np.ndarray | None = None,
    after: np.ndarray | None = None,
) -> bytes:
    """The ``classed`` stream of sorted unique ``positions`` (at least one) against the old
    bits of the tensor (its unsigned bits, flat). With ``xor`` (the XOR bits at
    ``positions``), ``bits`` are the **new** bits and the old ones are ``bits ^ xor`` at the
    positions (a writer whose diff already advanced its baseline holds only those).
    ``after``, optional: ``bits`` at ``positions`` (the compiled passes then read them in
    order instead of at the positions)."""
    return encode_classed_counted(positions, bits, dtype, xor=xor, after=after).stream


class ClassedCode(NamedTuple):
    """What :func:`encode_classed_counted` gives a writer."""

    stream: bytes
    rows: np.ndarray
    """The exponent rows of the bits given (with ``xor``: the new bits, the rows a writer
    keeps for its next step)."""
    runs: int
    """How many runs of consecutive elements the positions make (a writer bounds the plain
    codings' sizes from it, :func:`dcr_format.codings.positions.plain_size_floor`)."""
    classes: tuple[int, int]
    """The stream's classes (``base``, ``K``): what a writer's next diff may rank against."""


def encode_classed_counted(
    positions: np.ndarray,
    bits: np.ndarray,
    dtype: str,
    *,
    xor: np.ndarray | None = None,
    after: np.ndarray | None = None,
    rows: np.ndarray | None = None,
    before: np.ndarray | None = None,
    ranked: tuple[int, int, np.ndarray, int] | None = None,
) -> ClassedCode:
    """:func:`encode_classed` for a writer that keeps the exponent rows of its baseline:
    ``rows`` (where known, else None) are those of the **old** bits; the result carries the
    rows of ``bits`` (with ``xor``: the new bits, the rows a writer keeps for its next
    step). Given rows skip the pass that counts them (:func:`exponent_rows`); they must be
    the old bits' own (rows that do not fit the tensor, :func:`rows_fit`, are counted
    again). ``before``, optional with ``xor`` and ``after``: the old bits at the positions
    (``after ^ xor``), where the caller has them already. ``ranked``, optional with
    ``rows``: ``(base, K, ranks, adjacent)``, each position's rank among the old elements
    of its class under classes ``base`` and ``K`` and how many positions directly follow
    the one before them, as a writer's diff counted them while it read the old bits: where
    the classes chosen here are those, the pass over the tensor that counts the ranks is
    not made."""
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    bits = np.ascontiguousarray(bits).reshape(-1)
    if dtype not in EXPONENT_FIELDS:
        raise PositionsError(f"classed positions need a float dtype, not {dtype!r}")
    if positions.size == 0:
        raise PositionsError("a classed positions stream codes at least one position")
    shift, mask = EXPONENT_FIELDS[dtype]
    native = _native()
    if xor is not None:  # the old and new bits at the positions, in order
        new_at = bits[positions] if after is None else np.ascontiguousarray(after).reshape(-1)
        new_at = new_at.astype(bits.dtype, copy=False)
        if before is not None and after is not None and before.dtype == bits.dtype:
            old_at = np.ascontiguousarray(before).reshape(-1)
        else:
            xor_at = np.ascontiguousarray(xor).reshape(-1).astype(bits.dtype, copy=False)
            old_at = new_at ^ xor_at
    if not rows_fit(rows, bits.size, dtype):
        rows = ranked = None  # (ranks counted from other rows would not be these bits')
    if rows is None:  # counted here: the bits given are the new ones where xor is given
        rows = exponent_rows(bits, dtype)
        after_rows = rows
        if xor is not None:
            after_rows = rows.copy()
            changed = move_rows(rows, positions, old_at, new_at, dtype, forward=False)
        else:
            changed = np.bincount(exponents(bits[positions], dtype), minlength=mask + 1)
    elif xor is not None:
        after_rows = rows.copy()
        changed = move_rows(after_rows, positions, old_at, new_at, dtype)
    else:
        after_rows = rows
        changed = np.bincount(exponents(bits[positions], dtype), minlength=mask + 1)
    # the histogram over every element: one row (a tensor of one task) is its own sum
    base, count = choose_classes(rows[0] if rows.shape[0] == 1 else rows.sum(axis=0), changed)
    if native is not None and ranked is not None and ranked[:2] == (base, count):
        old_bits_at = bits[positions] if xor is None else old_at
        changed_classes = native.classes_at(old_bits_at, shift, mask, base, count)
        all_ranks, adjacent = ranked[2], ranked[3]
        if all_ranks.size != positions.size:
            raise ValueError("ranked must hold one rank per position")
    elif native is not None:
        starts = native.class_starts(rows, base, count)
        if xor is None:
            changed_classes, all_ranks, adjacent = native.class_ranks(
                bits, positions, bits[positions], shift, mask, base, count, starts
            )
        else:
            changed_classes, all_ranks, adjacent = native.class_ranks(
                bits, positions, old_at, shift, mask, base, count, starts, new_at
            )
    else:
        adjacent = int(np.count_nonzero(np.diff(positions) == 1))
        exps = exponents(old_bits_of(bits, positions, xor), dtype)
        classes = np.clip(exps - base, 0, count - 1)
        changed_classes = classes[positions]
        all_ranks = np.empty(positions.size, dtype=np.int64)
        for c in range(count):
            chosen = changed_classes == c
            if chosen.any():
                cums = np.cumsum(classes == c, dtype=np.int64) - 1
                all_ranks[chosen] = cums[positions[chosen]]
    if native is not None:  # the changes' class sizes: the class starts of their one row
        sizes = native.class_starts(changed.reshape(1, -1), base, count)[1]
    else:
        sizes = class_sizes(changed, base, count)
    stream = classed_stream(base, count, changed_classes, all_ranks, sizes=sizes)
    return ClassedCode(stream, after_rows, int(positions.size) - adjacent, (base, count))


def class_sizes(changed: np.ndarray, base: int, count: int) -> np.ndarray:
    """How many changes each of the ``count`` classes from ``base`` holds, from
    ``changed``, the histogram of the changes' old exponents (int64)."""
    ends = np.cumsum(changed).tolist()  # ends[e]: the changes of exponent e or below
    top = len(ends) - 1
    below = [ends[min(base + c, top)] if base + c >= 0 else 0 for c in range(count - 1)]
    bounds = [0, *below, ends[-1]]  # at most 17 Python ints: no array until the result
    return np.array([bounds[c + 1] - bounds[c] for c in range(count)], dtype=np.int64)


def classed_stream(
    base: int,
    count: int,
    classes: np.ndarray,
    ranks: np.ndarray,
    *,
    sizes: np.ndarray | None = None,
) -> bytes:
    """The ``classed`` stream of changed positions given as their classes and ranks (in
    position order; as :func:`encode_classed` finds them, or a device kernel does).
    ``sizes``, where the caller has them: how many of the changes each class holds
    (:func:`class_sizes`), so that they are not counted again."""
    classes = np.ascontiguousarray(classes)  # any integer dtype (a byte from the CPU pass)
    ranks = np.ascontiguousarray(ranks, dtype=np.int64)
    head = _HEADER.pack(count, base)
    native = _native_parts()
    if native is not None:  # the counts and every class's part in compiled calls
        if sizes is None:
            tallies = native.class_tallies(classes, ranks, count)
        else:
            tallies = native.tallies_of(classes, ranks, sizes)
        guesses = np.empty(count, dtype=np.int64)
        if native.rice_guesses(tallies.sizes, tallies.last, guesses):  # near a power of two
            guesses = _positions.rice_k_guesses(tallies.sizes, tallies.last)
        body: np.ndarray = native.classed_body(
            classes, ranks, tallies, guesses, _positions.MAX_RICE_K
        )
        return head + body.tobytes()
    counts = np.bincount(classes, minlength=count)
    by_class = ranks[np.argsort(classes, kind="stable")]  # each class's ranks, increasing
    ends = np.cumsum(counts)
    out = [head, *(_varint(int(c)) for c in counts)]
    for c in range(count):
        if not counts[c]:
            continue
        rice = _positions.encode_rice(by_class[ends[c] - counts[c] : ends[c]])
        k, _, unary_len = _RICE_HEADER.unpack_from(rice)
        out += [bytes([k]), _varint(unary_len), rice[_RICE_HEADER.size :]]
    return b"".join(out)


@dataclass(frozen=True)
class ClassedStream:
    """The layout of a ``classed`` stream, checked as far as it can be without the old bits
    (:func:`parse_classed`): header, counts and each class's Rice part."""

    data: bytes
    classes: int  # K
    base: int
    counts: tuple[int, ...]  # changed positions per class
    parts: tuple[tuple[int, int, int, int], ...]  # per class with positions: (class, k, U, offset)
    # every class's ranks, decoded before the old bits are at hand (:func:`with_ranks`);
    # :func:`class_ranks_of` takes them once the class sizes bound them
    ranks: np.ndarray | None = field(default=None, compare=False, repr=False)


def parse_classed(data: bytes | memoryview, *, count: int, dtype: str) -> ClassedStream:
    """Check a ``classed`` stream's layout for ``count`` changed positions (FORMAT.md §6.5:
    every rule that does not need the old bits); a malformed stream is a
    :class:`PositionsError`. The result keeps a copy of the bytes."""
    buf = memoryview(data)
    if dtype not in EXPONENT_FIELDS:
        raise PositionsError(f"classed positions need a float dtype, not {dtype!r}")
    if count < 1:
        raise PositionsError(f"a classed positions stream codes at least one position, not {count}")
    if len(buf) < _HEADER.size:
        raise PositionsError("classed positions stream is truncated (no header)")
    classes_count, base = _HEADER.unpack_from(buf)
    if not 1 <= classes_count <= MAX_CLASSES:
        raise PositionsError(f"classed positions stream declares {classes_count} classes")
    offset = _HEADER.size
    counts = []
    for _ in range(classes_count):
        value, offset = _read_varint(buf, offset)
        counts.append(value)
    if sum(counts) != count:
        raise PositionsError(f"classed positions stream codes {sum(counts)} positions, not {count}")
    parts = []
    for c, wanted in enumerate(counts):
        if not wanted:
            continue
        if offset >= len(buf):
            raise PositionsError("classed positions stream is truncated; the shard is corrupt")
        k = buf[offset]
        unary_len, offset = _read_varint(buf, offset + 1)
        body_len = unary_len + (wanted * k + 7) // 8
        if k > _positions.MAX_RICE_K or offset + body_len > len(buf):
            raise PositionsError("classed positions stream is truncated; the shard is corrupt")
        parts.append((c, k, unary_len, offset))
        offset += body_len
    if offset != len(buf):
        raise PositionsError("classed positions stream has trailing bytes; the shard is corrupt")
    return ClassedStream(bytes(buf), classes_count, base, tuple(counts), tuple(parts))


def decode_classed(
    data: bytes | memoryview | ClassedStream,
    old_bits: np.ndarray,
    dtype: str,
    *,
    count: int,
    numel: int,
    rows: np.ndarray | None = None,
    old_at: np.ndarray | None = None,
    rows_fit_known: bool = False,
) -> np.ndarray:
    """Decode a ``classed`` stream (or its :func:`parse_classed` layout) against the old bits
    into ``count`` strictly increasing positions in ``[0, numel)``; every malformed stream
    is a :class:`PositionsError`, as is one that does not decode against these bits.
    ``rows``: the old bits' :func:`exponent_rows` where the caller keeps them (a long-lived
    reader), so that they are not counted again; rows that do not fit the tensor are
    ignored, and rows of other bits make the decode fail or find other positions (which
    the fingerprint check after applying catches). ``old_at`` (``count`` elements of the old
    bits' dtype), where given, takes the old bits at the positions (the select pass reads
    them anyway; a caller that needs them saves a read at positions spread over the
    tensor). ``rows_fit_known``: the caller checked ``rows`` with :func:`rows_fit` (or
    counted them from these bits), so they are not checked again."""
    if old_bits.size != numel:
        raise PositionsError(f"classed positions need the {numel} old elements of the tensor")
    if count < 1 or count > numel:
        raise PositionsError(f"entry declares {count} changed positions for {numel} elements")
    stream = (
        data if isinstance(data, ClassedStream) else parse_classed(data, count=count, dtype=dtype)
    )
    if sum(stream.counts) != count:
        raise PositionsError(
            f"classed positions stream codes {sum(stream.counts)} positions, not {count}"
        )
    shift, mask = EXPONENT_FIELDS[dtype]
    old_bits = np.ascontiguousarray(old_bits).reshape(-1)
    if old_at is not None and (old_at.shape != (count,) or old_at.dtype != old_bits.dtype):
        raise ValueError("old_at must have one element of the old bits' dtype per position")
    native = _native()
    classes_count, base, counts = stream.classes, stream.base, stream.counts
    classes = None
    if native is not None:
        if rows is None or not (rows_fit_known or rows_fit(rows, numel, dtype)):
            rows = exponent_rows(old_bits, dtype)
        assert rows is not None
        starts = native.class_starts(rows, base, classes_count)
        sizes = starts[-1]
    else:
        classes = classes_of(old_bits, dtype, base, classes_count)
        sizes = np.bincount(classes, minlength=classes_count)
    found = class_ranks_of(stream, sizes)
    if native is not None:
        first = np.array((0, *itertools.accumulate(counts)), dtype=np.int64)  # a short tuple
        out: np.ndarray | None = native.positions_of_ranks(
            old_bits, shift, mask, base, classes_count, starts, found, first, old_at
        )
        if out is None:
            raise PositionsError(
                "classed positions stream does not decode against the old bits held"
            )
        return out
    assert classes is not None
    picked = [np.flatnonzero(classes == c) for c, n in enumerate(counts) if n]
    ends = np.cumsum([n for n in counts if n])
    positions = np.sort(
        np.concatenate(
            [members[r] for members, r in zip(picked, np.split(found, ends[:-1]), strict=True)]
        )
    )
    if old_at is not None:
        old_at[:] = old_bits[positions]
    return positions


def with_ranks(stream: ClassedStream, numel: int) -> ClassedStream:
    """``stream`` with its ranks decoded ahead, where they decode against ``numel`` (the
    tensor's size, which bounds every class's): the Rice parts need the class sizes only as
    the range a rank must lie in, so a reader decodes them while it still fetches, and
    :func:`class_ranks_of` then checks each class's last rank against its size. A stream
    whose parts do not decode so comes back as it was (decoded, and refused, against the
    class sizes later)."""
    if not stream.parts or stream.ranks is not None:
        return stream
    try:  # on a fetch worker: the others and the select fill the other cores
        sizes = np.full(stream.classes, numel, dtype=np.int64)
        ranks = class_ranks_of(stream, sizes, serial=True)
    except PositionsError:
        return stream
    ranks.flags.writeable = False  # shared by every resolve of the change
    return replace(stream, ranks=ranks)


def _ranks_within(stream: ClassedStream, ranks: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether every class's ranks (increasing, from :func:`with_ranks`) lie below its size
    in ``sizes``: then the Rice parts decode against the sizes too, to the same ranks (a
    part breaks §6.2 against a smaller range only where a rank reaches past it)."""
    end = 0
    for c, _, _, _ in stream.parts:
        end += stream.counts[c]
        if int(ranks[end - 1]) >= int(sizes[c]):
            return False
    return True


def class_ranks_of(stream: ClassedStream, sizes: np.ndarray, *, serial: bool = False) -> np.ndarray:
    """The ranks every class with changes codes, one class after the other in class order,
    each decoded from its Rice part with the class's size (``sizes``, from the old bits) as
    the range (or taken from :func:`with_ranks` where they lie in it); a class coded with
    more positions than it holds is a :class:`PositionsError`. ``serial``: the compiled
    parts decode in this thread only (a caller whose threads already fill the cores)."""
    if stream.ranks is not None and _ranks_within(stream, stream.ranks, sizes):
        return stream.ranks
    native = _native_parts()
    if native is not None and stream.parts:  # every class at once; the loop below on errors
        out = np.empty(sum(stream.counts), dtype=np.int64)
        found = native.part_ranks(
            np.frombuffer(stream.data, dtype=np.uint8),
            np.array(stream.parts, dtype=np.int64),
            np.array(stream.counts, dtype=np.int64),
            np.ascontiguousarray(sizes, dtype=np.int64),
            out,
            serial=serial,
        )
        if found == -1:
            return out
    found = []
    for c, k, unary_len, offset in stream.parts:
        wanted = stream.counts[c]
        if wanted > int(sizes[c]):
            raise PositionsError("classed positions stream codes more positions than a class has")
        body_len = unary_len + (wanted * k + 7) // 8
        header = _RICE_HEADER.pack(k, wanted, unary_len)
        ranks = _positions.decode_rice(
            header + stream.data[offset : offset + body_len], count=wanted, numel=int(sizes[c])
        )
        found.append(ranks)
    return np.concatenate(found)


def classed_bound(changed: int, numel: int) -> int:
    """The most bytes a ``classed`` stream of ``changed`` of ``numel`` positions can hold
    and still decode: header and counts, and per class its parameter, unary length and a
    Rice body (unary bits at most the class's size, remainders at most 62 bits a rank)."""
    return _HEADER.size + MAX_CLASSES * (10 + 1 + 10 + 2) + (numel + 62 * changed + 7) // 8


__all__ = [
    "CLASS_HEADER_BITS",
    "EXPONENT_FIELDS",
    "MAX_CLASSES",
    "ROW_ELEMENTS",
    "ClassedCode",
    "ClassedStream",
    "choose_classes",
    "class_ranks_of",
    "class_sizes",
    "class_starts",
    "classed_bound",
    "classed_stream",
    "classes_of",
    "decode_classed",
    "encode_classed",
    "encode_classed_counted",
    "exponent_rows",
    "move_rows",
    "old_bits_of",
    "parse_classed",
    "rows_fit",
    "with_ranks",
]
