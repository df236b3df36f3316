"""Compiled (numba) rANS decoder of the ``rans`` value coding (:mod:`dcr_format.codings.rans`).

Private, imported on first use (:func:`dcr_format.kernels.native.compiled`). It decodes exactly
what ``constriction``'s ``AnsCoder`` decodes (FORMAT.md §7.3: 64-bit state, 32-bit words,
24-bit probabilities), with a lookup table of the ``2**Q`` quantiles instead of a search,
so one symbol costs a few integer operations; two streams can decode in one loop
(:func:`decode_pair`), their chains of dependent steps side by side. Arithmetic is uint64
throughout (numba turns mixed signed/unsigned 64-bit arithmetic into float64, so every
operand is typed).
``tests/test_codec_rans.py`` checks it against constriction and the pure-Python reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from dcr_format.kernels._native_bits import mul_high

_LOW = np.uint64(1 << 32)
_MASK24 = np.uint64((1 << 24) - 1)
_S24 = np.uint64(24)
_S32 = np.uint64(32)
_S40 = np.uint64(40)
_MASK32 = np.uint64(0xFFFFFFFF)
_ZERO64 = np.uint64(0)
_S28 = np.uint64(28)
_MASK28 = np.uint64((1 << 28) - 1)


@njit(cache=True, nogil=True, inline="always")
def _varint_at(
    buf: np.ndarray, pos: int, limit: int
) -> tuple[np.uint64, int, int]:  # pragma: no cover - compiled
    """One varint at ``pos``: (value, next position, error as in :func:`read_varints`)."""
    value = np.uint64(0)
    length = 0
    while True:
        if pos >= buf.size:
            return value, pos, 1
        if length == limit:
            return value, pos, 2
        byte = np.uint64(buf[pos])
        part = byte & np.uint64(0x7F)
        if length == 9 and part > np.uint64(1):
            return value, pos, 4
        value |= part << np.uint64(7 * length)
        pos += 1
        length += 1
        if byte < np.uint64(0x80):
            if byte == np.uint64(0) and length > 1:
                return value, pos, 3
            return value, pos, 0


@njit(cache=True, nogil=True)
def read_varints(
    buf: np.ndarray, offset: int, count: int, limit: int
) -> tuple[np.ndarray, int, int]:  # pragma: no cover - compiled
    """``count`` varints from ``offset``: (values, end offset, error), error 0 when well
    formed, 1 truncated, 2 longer than ``limit`` bytes, 3 not minimal, 4 over 64 bits."""
    out = np.zeros(count, dtype=np.uint64)
    pos = offset
    for j in range(count):
        value, pos, err = _varint_at(buf, pos, limit)
        if err:
            return out, pos, err
        out[j] = value
    return out, pos, 0


@njit(cache=True, nogil=True)
def _varint_len(value: np.uint64) -> int:  # pragma: no cover - compiled
    """The bytes of the varint of ``value`` (uint64)."""
    length = 1
    while value >= np.uint64(128):
        value >>= np.uint64(7)
        length += 1
    return length


@njit(cache=True, nogil=True, inline="always")
def _quantized(
    counts: np.ndarray, size: int, total: int, q: int
) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The counts of the first ``size`` table values and, last, of the escape (what is left
    of ``total``), and their frequencies at precision ``q`` as
    :func:`dcr_format.codings.rans.quantize` makes them (the remainder to the first largest)."""
    one = np.int64(1) << q
    free = one - (size + 1)
    all_counts = np.empty(size + 1, dtype=np.int64)
    table_sum = np.int64(0)
    for j in range(size):
        all_counts[j] = counts[j]
        table_sum += counts[j]
    all_counts[size] = total - table_sum
    freqs = np.empty(size + 1, dtype=np.int64)
    fsum = np.int64(0)
    for j in range(size + 1):
        freqs[j] = 1 + (all_counts[j] * free) // total
        fsum += freqs[j]
    freqs[np.argmax(all_counts)] += one - fsum
    return all_counts, freqs


@njit(cache=True, nogil=True)
def _ascending(order: np.ndarray, n: int) -> np.ndarray:  # pragma: no cover - compiled
    """The stable argsort of ``order[:n]`` (values from 0 to below 2**28, ``n`` at most
    2**28; ties by index) as a sort of uint64 keys (the value, then the index): numba then
    compiles one sort for the whole module, where an argsort compiles two more."""
    keys = np.empty(n, dtype=np.uint64)
    for j in range(n):
        keys[j] = (np.uint64(order[j]) << _S28) | np.uint64(j)
    keys = np.sort(keys)
    ranks = np.empty(n, dtype=np.int64)
    for j in range(n):
        ranks[j] = np.int64(keys[j] & _MASK28)
    return ranks


@njit(cache=True, nogil=True, inline="always")
def _estimate_of(
    distinct: np.ndarray,
    counts: np.ndarray,
    by_value: np.ndarray,
    total: int,
    width: int,
    size: int,
    q: int,
) -> np.int64:  # pragma: no cover - compiled
    """The estimated stream size in bytes of the table of the first ``size`` values of
    ``distinct`` (table order) at precision ``q`` (FORMAT.md §7.4); ``by_value`` holds the
    indices into the table order of (at least) those values, in value order: the table
    steps come from one walk of them that skips the values past ``size``."""
    all_counts, freqs = _quantized(counts, size, total, q)
    coded = 0.0
    for j in range(size + 1):
        if all_counts[j] > 0:
            coded += all_counts[j] * (q - np.log2(np.float64(freqs[j])))
    words = np.int64(np.ceil(coded / 32)) + 1
    freq_bytes = 0
    for j in range(size):
        freq_bytes += _varint_len(np.uint64(freqs[j]))
    table_bytes = 0
    first = True
    previous = np.uint64(0)
    for j in range(by_value.size):
        at = by_value[j]
        if at >= size:  # not among this candidate's values
            continue
        value = distinct[at]
        table_bytes += _varint_len(value if first else value - previous - np.uint64(1))
        previous = value
        first = False
    return np.int64(
        2
        + table_bytes
        + freq_bytes
        + _varint_len(np.uint64(words))
        + 4 * words
        + width * all_counts[size]
    )


@njit(cache=True, nogil=True)
def estimates(
    distinct: np.ndarray,
    counts: np.ndarray,
    order: np.ndarray,
    total: int,
    width: int,
    sizes: np.ndarray,
    bits: np.ndarray,
) -> np.ndarray:  # pragma: no cover - compiled
    """The estimated stream size in bytes of every candidate table size (FORMAT.md §7.4),
    as :func:`dcr_format.codings.rans.choose_model` computes them with arrays. ``distinct``
    is in table order (most frequent first), ``order`` holds the values' ranks by value
    (any increasing numbering), and a candidate's table is its first ``size`` values: the
    values of the largest candidate are sorted once, and each candidate's table steps come
    from one walk of them that skips the values past its size (:func:`_estimate_of`)."""
    out = np.empty(sizes.size, dtype=np.int64)
    most = 0
    for r in range(sizes.size):
        most = max(most, sizes[r])
    by_value = _ascending(order, most)  # indices into the table order, values increasing
    for r in range(sizes.size):
        out[r] = _estimate_of(distinct, counts, by_value, total, width, sizes[r], bits[r])
    return out


@njit(cache=True, nogil=True)
def _most_frequent_first(counts: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """The indices of ``counts`` (positive) by decreasing count, ties by index: the order
    of :func:`_ascending` of what each count leaves of their total. Where the counts are
    small next to their number (a step's changes: mostly ones and twos), a counting sort
    by count; else that sort of keys."""
    n = counts.size
    most = np.int64(0)
    for j in range(n):
        most = max(most, counts[j])
    if most > 4 * n + 64:
        total = np.int64(0)
        for j in range(n):
            total += counts[j]
        return _ascending(total - counts, n)
    starts = np.zeros(most + 1, dtype=np.int64)  # by most - count: the largest count first
    for j in range(n):
        starts[most - counts[j]] += 1
    at = np.int64(0)
    for k in range(most + 1):
        held = starts[k]
        starts[k] = at
        at += held
    out = np.empty(n, dtype=np.int64)
    for j in range(n):  # in index order: ties keep it
        k = most - counts[j]
        out[starts[k]] = j
        starts[k] += 1
    return out


@njit(cache=True, nogil=True)
def _by_value(order: np.ndarray, size: int, ranks: int) -> np.ndarray:  # pragma: no cover
    """The indices ``j < size`` ordered by ``order[j]`` (distinct ranks below ``ranks``):
    :func:`_ascending` of ``order[:size]`` without a sort, by placing each index at its
    rank."""
    at_rank = np.full(ranks, -1, dtype=np.int64)
    for j in range(size):
        at_rank[order[j]] = j
    out = np.empty(size, dtype=np.int64)
    k = 0
    for r in range(ranks):
        if at_rank[r] >= 0:
            out[k] = at_rank[r]
            k += 1
    return out


_BOUND_MARGIN = 1e-9  # relative slack of the entropy bound over the estimate's rounding


@njit(cache=True, nogil=True)
def _least(
    distinct: np.ndarray,
    counts: np.ndarray,
    by_value: np.ndarray,
    total: int,
    width: int,
    sizes: np.ndarray,
    bits: np.ndarray,
) -> tuple[int, np.int64]:  # pragma: no cover - compiled
    """The index of the least of :func:`estimates` (the first on ties) and that estimate,
    without computing the estimates that a lower bound already rules out (``sizes``
    increasing; ``by_value`` as :func:`_estimate_of` takes it, for the largest size).

    A candidate's symbols coded under any frequencies that sum to at most ``2**q`` take at
    least their empirical entropy in bits (Gibbs' inequality), here that of its table's
    counts and its escapes, less a margin far above the rounding of either sum; its table
    and frequencies take at least a byte a value. A candidate whose bound exceeds the least
    estimate found so far cannot be the least, nor tie with it; the others (the one of
    least bound first) are estimated exactly, as :func:`estimates` does."""
    n = sizes.size
    bound = np.empty(n, dtype=np.int64)
    whole = total * np.log2(np.float64(total))
    slack = _BOUND_MARGIN * whole + 1e-6
    tallied = np.int64(0)  # the counts of the values before the current one
    weighed = 0.0  # the sum of c * log2(c) over them
    r = 0
    for j in range(sizes[n - 1] + 1):
        while r < n and sizes[r] == j:
            escapes = total - tallied
            entropy = whole - weighed
            if escapes > 1:
                entropy -= escapes * np.log2(np.float64(escapes))
            floor = entropy - slack
            words = np.int64(1)
            if floor > 0:
                words = np.int64(np.ceil(floor / 32)) + 1
            bound[r] = 2 + 2 * j + _varint_len(np.uint64(words)) + 4 * words + width * escapes
            r += 1
        if j < counts.size:
            c = counts[j]
            tallied += c
            if c > 1:
                weighed += c * np.log2(np.float64(c))
    first = int(np.argmin(bound))
    best = first
    least = _estimate_of(distinct, counts, by_value, total, width, sizes[first], bits[first])
    for r in range(n):
        if r == first or bound[r] > least:
            continue
        estimate = _estimate_of(distinct, counts, by_value, total, width, sizes[r], bits[r])
        if estimate < least or (estimate == least and r < best):
            best, least = r, estimate
    return best, least


@njit(cache=True, nogil=True, inline="always")
def _escaped(
    buf: np.ndarray, at: int, count: int, e: int | np.int64, width: int
) -> np.uint64:  # pragma: no cover
    """Escaped value ``e`` of ``count`` in planes at ``at`` (plane t: byte width-1-t)."""
    v = np.uint64(0)
    for t in range(width):
        v |= np.uint64(buf[at + t * count + e]) << np.uint64(8 * (width - 1 - t))
    return v


@njit(cache=True, nogil=True)
def _symbols(  # type: ignore[no-untyped-def]
    buf, words, x, nxt, lookup, scaled, starts, shift, size, values, escapes_at, escape_count,
    width, first, count, out, small, escaped,
):  # pragma: no cover - compiled  # fmt: skip
    """The decode loop of a stream: symbols ``first`` to ``count`` from the state ``x`` and
    the words below ``nxt``, each written to ``out`` as its table value or, for the escape,
    the next escaped value (while there are any; the caller checks their number). A
    state's symbol is looked up in the table of quantiles where ``small``, else searched.
    Returns the state, the index of the next unread word and the number of escapes met
    (``escaped`` before the first). :func:`decode_pair` holds a copy of the body for two
    streams: a call per symbol, even inlined, cost several times the symbol."""
    for i in range(first, count):
        q = x & _MASK24
        if small:
            s = np.int64(lookup[np.int64(q >> shift)])
        else:
            lo, hi = 0, size  # the last j with starts[j] <= q
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if starts[mid] <= q:
                    lo = mid
                else:
                    hi = mid - 1
            s = np.int64(lo)
        x = (x >> _S24) * scaled[s] + q - starts[s]
        if x < _LOW and nxt >= 0:
            x = (x << _S32) | np.uint64(words[nxt])
            nxt -= 1
        out[i] = values[s]
        if s == size:
            if escaped < escape_count:
                out[i] = _escaped(buf, escapes_at, escape_count, escaped, width)
            escaped += 1
    return x, nxt, escaped


@njit(cache=True, nogil=True, inline="always")
def _refused(err, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """What :func:`_parse_stream` returns for a stream that breaks rule ``err``."""
    empty = np.empty(0, dtype=np.uint64)
    return (
        err, np.empty(0, dtype=np.uint32), _ZERO64, -1, np.empty(0, dtype=np.uint8), empty,
        empty, _ZERO64, 0, np.zeros(1, dtype=out.dtype), 0, 0, False,
    )  # fmt: skip


@njit(cache=True, nogil=True)
def _parse_stream(buf, count, width, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The checks and tables of a whole ``rans`` stream (FORMAT.md §7.3) before its
    symbols: (0, or the number of the first rule it breaks, as :func:`decode_stream`
    returns it; the word array, the initial state and next word, the lookup, scaled and
    start tables, the shift, the table size, each symbol's value, where the escapes are
    and how many, and whether the lookup is used)."""
    n = buf.size
    if count < 1:
        return _refused(1, out)
    if n >= count * width:
        return _refused(2, out)
    if n < 2:
        return _refused(3, out)
    size = int(buf[0])
    bits = int(buf[1])
    if size < 1 or size > 255 or bits < 1 or bits > 24 or (np.int64(1) << bits) <= size:
        return _refused(4, out)
    pos = 2
    table = np.empty(size, dtype=np.uint64)
    value = np.uint64(0)
    wide = 0  # whether a running value passed 2**64 (a table step's sum)
    for j in range(size):
        step, pos, err = _varint_at(buf, pos, 10)
        if err:
            return _refused(10 + err, out)
        if j == 0:
            value = step
        else:
            following = value + step + np.uint64(1)
            if following <= value:
                wide = 1
            value = following
        table[j] = value
    if wide or (width < 8 and value >= (np.uint64(1) << np.uint64(8 * width))):
        return _refused(5, out)
    freqs = np.empty(size + 1, dtype=np.uint64)
    total = np.uint64(0)
    for j in range(size):
        f, pos, err = _varint_at(buf, pos, 4)
        if err:
            return _refused(20 + err, out)
        freqs[j] = f
    for j in range(size):
        if freqs[j] == np.uint64(0):
            return _refused(6, out)
        total += freqs[j]
    one = np.uint64(1) << np.uint64(bits)
    if total >= one:
        return _refused(7, out)
    freqs[size] = one - total
    words, pos, err = _varint_at(buf, pos, 4)
    if err:
        return _refused(30 + err, out)
    nwords = int(words)
    if nwords > (24 * count + 64 + 31) // 32 or pos + 4 * nwords > n:
        return _refused(8, out)
    base = pos
    if nwords:
        last = base + 4 * (nwords - 1)
        if buf[last] == 0 and buf[last + 1] == 0 and buf[last + 2] == 0 and buf[last + 3] == 0:
            return _refused(9, out)
    escapes_at = base + 4 * nwords
    rest = n - escapes_at
    if rest % width:
        return _refused(10, out)
    escape_count = rest // width
    if escape_count > count:
        return _refused(11, out)
    # decode
    shift = np.uint64(24 - bits)
    scaled = np.empty(size + 1, dtype=np.uint64)
    starts = np.empty(size + 1, dtype=np.uint64)
    acc = np.uint64(0)
    for j in range(size + 1):
        scaled[j] = freqs[j] << shift
        starts[j] = acc
        acc += scaled[j]
    # a lookup table of the 2**Q quantiles' symbols, one byte each (S <= 255, so the escape
    # is at most 255): 64 KiB at most, mostly in cache; above Q = 16, a search
    small = bits <= 16
    lookup = np.empty(np.int64(one) if small else 1, dtype=np.uint8)
    if small:
        k = 0
        for j in range(size + 1):
            for _ in range(np.int64(freqs[j])):
                lookup[k] = np.uint8(j)
                k += 1
    coded = np.empty(nwords, dtype=np.uint32)  # little-endian; the offset may be unaligned
    for i in range(nwords):
        p = base + 4 * i
        coded[i] = (
            np.uint32(buf[p])
            | (np.uint32(buf[p + 1]) << np.uint32(8))
            | (np.uint32(buf[p + 2]) << np.uint32(16))
            | (np.uint32(buf[p + 3]) << np.uint32(24))
        )
    nxt = nwords - 1
    x = np.uint64(0)
    if nxt >= 0:
        x = np.uint64(coded[nxt])
        nxt -= 1
        if nxt >= 0:
            x = (x << _S32) | np.uint64(coded[nxt])
            nxt -= 1
    values = np.zeros(size + 1, dtype=out.dtype)  # each symbol's value (the escape's: 0)
    for j in range(size):
        values[j] = table[j]
    return (
        0, coded, x, nxt, lookup, scaled, starts, shift, size, values, escapes_at,
        escape_count, small,
    )  # fmt: skip


@njit(cache=True, nogil=True, inline="always")
def _ended(x, nxt, escaped, escape_count):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The checks after a stream's symbols: 0, or the rule its end breaks."""
    if nxt >= 0 or x != np.uint64(0):
        return 12
    if escaped != escape_count:
        return 13
    return 0


@njit(cache=True, nogil=True)
def decode_stream(
    buf: np.ndarray, count: int, width: int, out: np.ndarray
) -> int:  # pragma: no cover - compiled
    """A whole ``rans`` stream (FORMAT.md §7.3) into ``out`` (``count`` unsigned values of
    ``width`` bytes); returns 0, or the number of the rule the stream breaks (the messages
    are in :data:`dcr_format.codings.rans.STREAM_ERRORS`), in the order the numpy parser
    checks them."""
    err, words, x, nxt, lookup, scaled, starts, shift, size, values, at, escapes, small = (
        _parse_stream(buf, count, width, out)
    )
    if err:
        return int(err)
    # typed zeros: a literal 0 would compile the loop once more
    x, nxt, escaped = _symbols(
        buf, words, x, nxt, lookup, scaled, starts, shift, size, values, at, escapes, width,
        np.int64(0), count, out, small, np.int64(0),
    )  # fmt: skip
    return int(_ended(x, nxt, escaped, escapes))


@njit(cache=True, nogil=True)
def decode_pair(
    buf: np.ndarray,
    count: int,
    out: np.ndarray,
    buf2: np.ndarray,
    count2: int,
    out2: np.ndarray,
    width: int,
) -> tuple[int, int]:  # pragma: no cover - compiled
    """Two whole streams at once, as :func:`decode_stream` decodes each (the same values
    and errors): their symbols alternate while both have some, so that the two states'
    chains of dependent loads and multiplies overlap (one stream's symbol waits on the
    one before it: about 4.7 ns a symbol alone, 3.0 ns two at a time)."""
    err, words, x, nxt, lookup, scaled, starts, shift, size, values, at, escapes, small = (
        _parse_stream(buf, count, width, out)
    )
    second = _parse_stream(buf2, count2, width, out2)
    err2, words2, x2, nxt2, lookup2, scaled2, starts2, shift2, size2, values2 = second[:10]
    at2, escapes2, small2 = second[10:]
    if err or err2:  # the one that parses alone (its peer's error is reported)
        if not err:
            err = decode_stream(buf, count, width, out)
        if not err2:
            err2 = decode_stream(buf2, count2, width, out2)
        return err, err2
    escaped = escaped2 = np.int64(0)  # typed: a literal 0 would compile _symbols once more
    both = np.int64(min(count, count2) if small and small2 else 0)  # searched: one at a time
    for i in range(both):  # the body of _symbols, once for each stream
        q = x & _MASK24
        q2 = x2 & _MASK24
        s = np.int64(lookup[np.int64(q >> shift)])
        s2 = np.int64(lookup2[np.int64(q2 >> shift2)])
        x = (x >> _S24) * scaled[s] + q - starts[s]
        x2 = (x2 >> _S24) * scaled2[s2] + q2 - starts2[s2]
        if x < _LOW and nxt >= 0:
            x = (x << _S32) | np.uint64(words[nxt])
            nxt -= 1
        if x2 < _LOW and nxt2 >= 0:
            x2 = (x2 << _S32) | np.uint64(words2[nxt2])
            nxt2 -= 1
        out[i] = values[s]
        out2[i] = values2[s2]
        if s == size:
            if escaped < escapes:
                out[i] = _escaped(buf, at, escapes, escaped, width)
            escaped += 1
        if s2 == size2:
            if escaped2 < escapes2:
                out2[i] = _escaped(buf2, at2, escapes2, escaped2, width)
            escaped2 += 1
    x, nxt, escaped = _symbols(
        buf, words, x, nxt, lookup, scaled, starts, shift, size, values, at, escapes, width,
        both, count, out, small, escaped,
    )  # fmt: skip
    x2, nxt2, escaped2 = _symbols(
        buf2, words2, x2, nxt2, lookup2, scaled2, starts2, shift2, size2, values2, at2,
        escapes2, width, both, count2, out2, small2, escaped2,
    )  # fmt: skip
    return _ended(x, nxt, escaped, escapes), _ended(x2, nxt2, escaped2, escapes2)


@njit(cache=True, nogil=True, inline="always")
def _put_varint(out: np.ndarray, at: int, v: np.uint64) -> int:  # pragma: no cover - compiled
    """Write ``v`` (uint64) as a varint at ``out[at]``; returns the offset after it."""
    while v >= np.uint64(0x80):
        out[at] = np.uint8((v & np.uint64(0x7F)) | np.uint64(0x80))
        v >>= np.uint64(7)
        at += 1
    out[at] = np.uint8(v)
    return at + 1


@njit(cache=True, nogil=True)
def write_varints(values: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """The varints of ``values`` (uint64), concatenated, as bytes (uint8)."""
    out = np.empty(values.size * 10, dtype=np.uint8)
    k = 0
    for j in range(values.size):
        k = _put_varint(out, k, values[j])
    return out[:k]


@njit(cache=True, nogil=True)
def _reciprocal(d: np.uint64) -> tuple[np.uint64, np.uint64]:  # pragma: no cover - compiled
    """The multiplier ``m`` and shift ``L`` that divide by ``d`` (``1 <= d < 2**24``) with a
    multiply: ``L = bitlen(d - 1)`` and ``m = ceil(2**(64 + L) / d) - 2**64`` (below 2**64),
    so that ``X // d == (mul_high(X, m) + X) >> L`` for every ``X`` below ``2**64``
    (Granlund and Montgomery's round-up method; the caller keeps ``X + mul_high(X, m)``
    below 2**64). ``m`` is ``ceil(h * 2**64 / d)`` with ``h = 2**L - d < d``, found as two
    32-bit long-division digits."""
    length = np.uint64(0)
    while (np.uint64(1) << length) < d:
        length += np.uint64(1)
    h = (np.uint64(1) << length) - d
    if h == np.uint64(0):  # a power of two (1 included): a shift alone
        return np.uint64(0), length
    upper = (h << _S32) // d
    rest = (h << _S32) % d
    lower = (rest << _S32) // d
    exact = (rest << _S32) % d == np.uint64(0)
    m = (upper << _S32) + lower
    if not exact:
        m += np.uint64(1)
    return m, length


@njit(cache=True, nogil=True, inline="always")
def _code_dividing(symbols, scaled, starts, out):  # type: ignore[no-untyped-def]
    """:func:`encode_symbols`'s loop with a division (any precision): the state and the
    number of words pushed."""
    k = 0
    x = np.uint64(0)
    for i in range(symbols.size - 1, -1, -1):
        s = symbols[i]
        f = scaled[s]
        if (x >> _S40) >= f:
            out[k] = np.uint32(x & _MASK32)
            k += 1
            x >>= _S32
        x = ((x // f) << _S24) | (starts[s] + x % f)
    return x, k


@njit(cache=True, nogil=True, inline="always")
def _code_multiplying(symbols, scaled, starts, multipliers, lengths, gaps, shift, out):  # type: ignore[no-untyped-def]
    """:func:`encode_symbols`'s loop below 24 bits of precision: the quotient by each
    frequency's :func:`_reciprocal`, and ``(q << 24) | (start + x - q * f)`` (the
    remainder is below ``f``, so the OR is a sum) as ``x + start + q * (2**24 - f)``, one
    multiply after the quotient. The same words as :func:`_code_dividing`."""
    k = 0
    x = np.uint64(0)
    for i in range(symbols.size - 1, -1, -1):
        s = symbols[i]
        if (x >> _S40) >= scaled[s]:
            out[k] = np.uint32(x & _MASK32)
            k += 1
            x >>= _S32
        wide = x >> shift
        q = (mul_high(wide, multipliers[s]) + wide) >> lengths[s]
        x = x + starts[s] + q * gaps[s]
    return x, k


@njit(cache=True, nogil=True)
def encode_symbols(
    symbols: np.ndarray, freqs: np.ndarray, bits: int
) -> np.ndarray:  # pragma: no cover - compiled
    """The words (uint32, in stream order) of ``symbols`` (int32 indices into ``freqs``, the
    model at precision ``bits``), coded last symbol first exactly as FORMAT.md §7.3 (and
    ``constriction``'s ``AnsCoder.encode_reverse``) code them: the state ``x`` is pushed a
    word when ``x >> 40 >= f`` and becomes ``(x // f) << 24 | (start + x % f)`` with the
    frequency ``f`` and its start scaled to 24 bits; the final state follows (one word, or
    two, low first; none when it is 0).

    ``f`` is the frequency shifted left by ``24 - bits``, so ``x // f`` is ``x >> (24 -
    bits)`` divided by the frequency, and below 24 bits of precision that division is a
    multiply by the frequency's :func:`_reciprocal` (a division's latency is most of a
    symbol's; the quotient is the same). The state is below ``f << 40`` at the division,
    so the shifted state is below ``2**(64 - (24 - bits))`` and its sum with the multiply's
    high word stays below 2**64."""
    size = freqs.size
    shift = np.uint64(24 - bits)
    scaled = np.empty(size, dtype=np.uint64)
    starts = np.empty(size, dtype=np.uint64)
    multipliers = np.empty(size, dtype=np.uint64)
    lengths = np.empty(size, dtype=np.uint64)
    gaps = np.empty(size, dtype=np.uint64)
    acc = np.uint64(0)
    for j in range(size):
        scaled[j] = np.uint64(freqs[j]) << shift
        starts[j] = acc
        acc += scaled[j]
        multipliers[j], lengths[j] = _reciprocal(np.uint64(freqs[j]))
        gaps[j] = (np.uint64(1) << _S24) - scaled[j]
    out = np.empty((24 * symbols.size + 64 + 31) // 32, dtype=np.uint32)
    if shift == np.uint64(0):  # 24 bits: the shifted state may need all 64 bits
        x, k = _code_dividing(symbols, scaled, starts, out)
    else:
        x, k = _code_multiplying(symbols, scaled, starts, multipliers, lengths, gaps, shift, out)
    if x >= _LOW:
        out[k] = np.uint32(x & np.uint64(0xFFFFFFFF))
        out[k + 1] = np.uint32(x >> _S32)
        k += 2
    elif x != np.uint64(0):
        out[k] = np.uint32(x)
        k += 1
    return out[:k]


@njit(cache=True, nogil=True)
def histogram(
    values: np.ndarray, bins: int
) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The distinct values (increasing) of ``values`` (each below ``bins``) and their counts."""
    counts = np.zeros(bins, dtype=np.int64)
    seen = np.empty(min(bins, values.size), dtype=np.uint64)  # each value when first met
    used = 0
    for k in range(values.size):
        v = values[k]
        if counts[v] == 0:
            seen[used] = v
            used += 1
        counts[v] += 1
    distinct = np.sort(seen[:used])  # not a scan of every bin: a step has few distinct values
    found = np.empty(used, dtype=np.int64)
    for j in range(used):
        found[j] = counts[distinct[j]]
    return distinct, found


@njit(cache=True, nogil=True)
def _bit_length(value: int) -> int:  # pragma: no cover - compiled
    length = 0
    while value > 0:
        value >>= 1
        length += 1
    return length


_SMALL = 256  # values counted in bins; larger ones are sorted
_LANES = 8  # bins of each small value, one per position mod 8


@njit(cache=True, nogil=True)
def _distinct(values: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """The distinct values (increasing, uint64) of ``values`` and their counts.

    A step's values are mostly small (ulp differences of 1 or 2, short XOR carries), so
    values below :data:`_SMALL` are counted in bins and only the others are sorted and
    their runs counted. Each small value has eight bins, taken by position mod 8: a
    value met many times in a row (most of them) otherwise waits on its one counter's
    last increment (1.3 ns a value on 65,536 bins of int64, 0.35 here), and zeroing
    16 KB instead of 512 KB pays for tensors with few changes. Many values of a narrow
    width (at least 1/8 of its range) that a sample of 64 finds mostly large (a full
    tensor's bits) are all counted in one bin per value (:func:`histogram`) instead, and
    so are the larger values where they turn out that many: sorting them would cost more."""
    if width <= 2 and values.size >= 1 << (8 * width - 3):  # many values of a narrow width
        step = values.size // 64
        large = np.int64(0)
        for k in range(64):
            large += np.int64(np.uint64(values[k * step]) >= _SMALL)
        if large >= 8:  # mostly large (a full tensor's bits): a bin per value at once
            return histogram(values, 1 << (8 * width))
    small = np.zeros(_LANES * _SMALL, dtype=np.int64)
    big = np.empty(values.size, dtype=np.uint64)
    held = 0
    whole = values.size - values.size % _LANES
    for k in range(0, whole, _LANES):
        for lane in range(_LANES):
            v = np.uint64(values[k + lane])
            if v < _SMALL:
                small[lane * _SMALL + v] += 1
            else:
                big[held] = v
                held += 1
    for k in range(whole, values.size):
        v = np.uint64(values[k])
        if v < _SMALL:
            small[v] += 1
        else:
            big[held] = v
            held += 1
    dense = width <= 2 and held >= 1 << (8 * width - 3)
    if dense:
        big_distinct, big_counts = histogram(big[:held], 1 << (8 * width))
        ordered = big[:0]
    else:
        big_distinct, big_counts = big[:0], np.zeros(0, dtype=np.int64)
        ordered = np.sort(big[:held])
    distinct = np.empty(_SMALL + held, dtype=np.uint64)
    counts = np.empty(_SMALL + held, dtype=np.int64)
    used = 0
    for bin_ in range(_SMALL):
        c = 0
        for lane in range(_LANES):
            c += small[lane * _SMALL + bin_]
        if c:
            distinct[used] = bin_
            counts[used] = c
            used += 1
    if dense:
        for j in range(big_distinct.size):
            distinct[used] = big_distinct[j]
            counts[used] = big_counts[j]
            used += 1
    for k in range(ordered.size):
        if k and ordered[k] == ordered[k - 1]:
            counts[used - 1] += 1
        else:
            distinct[used] = ordered[k]
            counts[used] = 1
            used += 1
    return distinct[:used], counts[:used]


@njit(cache=True, nogil=True)
def choose(
    values: np.ndarray, width: int, table_sizes: np.ndarray, max_table: int, max_bits: int
) -> tuple[np.ndarray, np.ndarray, int, np.int64]:  # pragma: no cover - compiled
    """The whole of :func:`dcr_format.codings.rans.choose_model` (FORMAT.md §7.4) in one call:
    the histogram, most frequent first (smaller value on ties), cut at ``max_table``; the
    candidate table sizes (``table_sizes`` up to the number of distinct values, and that
    number); their precisions and the first of least estimate (:func:`estimates`, of which
    :func:`_least` computes only those a bound does not rule out), quantized. Returns the
    table (increasing, uint64), its frequencies (escape last), the precision and the
    estimate. ``values`` must not be empty."""
    distinct, counts = _distinct(values, width)
    # most frequent first, ties by value (the distinct values increase with their index):
    # by what each count leaves of the total, below 2**28
    # (:data:`dcr_format.codings.rans.MAX_VALUES`)
    distinct_count = distinct.size
    order = _most_frequent_first(counts)[:max_table]
    distinct, counts = distinct[order], counts[order]
    n = distinct.size
    total = values.size
    sizes = np.empty(table_sizes.size + 1, dtype=np.int64)
    used = 0
    for s in table_sizes:
        if s <= n:
            sizes[used] = s
            used += 1
    if used == 0 or sizes[used - 1] != n:
        sizes[used] = n
        used += 1
    sizes = sizes[:used]
    total_length = _bit_length(total)
    bits = np.empty(used, dtype=np.int64)
    for r in range(used):
        bits[r] = min(max_bits, max(total_length, _bit_length(sizes[r] + 1) + 1))
    ranks = distinct_count
    by_value = _by_value(order, sizes[used - 1], ranks)  # indices of the largest, by value
    best, least = _least(distinct, counts, by_value, total, width, sizes, bits)
    size, q = sizes[best], bits[best]
    _, freqs = _quantized(counts, size, total, q)
    by_value = _by_value(order, size, ranks)  # the table by value: by index in the histogram
    table = np.empty(size, dtype=np.uint64)
    ordered = np.empty(size + 1, dtype=np.int64)
    for j in range(size):
        at = by_value[j]
        table[j] = distinct[at]
        ordered[j] = freqs[at]
    ordered[size] = freqs[size]
    return table, ordered, q, least


@njit(cache=True, nogil=True)
def encode(
    values: np.ndarray, width: int, table: np.ndarray, freqs: np.ndarray, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The parts of a ``rans`` stream of ``values`` (``width`` bytes each) under the model
    (``table`` increasing, uint64; ``freqs`` escape last; precision ``bits``), FORMAT.md
    §7.3: the varints of the table steps and the table frequencies, the words
    (:func:`encode_symbols`) and the escaped values in order. Each value's symbol is its
    index in the table, or the escape: a lookup table over every value of a narrow width
    where the values are many, else a search."""
    size = table.size
    symbols = np.empty(values.size, dtype=np.int32)
    escaped = np.empty(values.size, dtype=values.dtype)
    escapes = 0
    if width <= 2 and values.size >= 1 << (8 * width - 6):
        lut = np.full(1 << (8 * width), size, dtype=np.int32)
        for j in range(size):
            lut[table[j]] = j
        for i in range(values.size):
            symbol = lut[values[i]]
            symbols[i] = symbol
            if symbol == size:
                escaped[escapes] = values[i]
                escapes += 1
    else:
        for i in range(values.size):
            v = np.uint64(values[i])
            at = np.searchsorted(table, v)
            if at < size and table[at] == v:
                symbols[i] = at
            else:
                symbols[i] = size
                escaped[escapes] = values[i]
                escapes += 1
    header = np.empty(2 * size, dtype=np.uint64)
    previous = np.uint64(0)
    for j in range(size):
        header[j] = table[j] - previous
        previous = table[j] + np.uint64(1)
        header[size + j] = np.uint64(freqs[j])
    return write_varints(header), encode_symbols(symbols, freqs, bits), escaped[:escapes]
