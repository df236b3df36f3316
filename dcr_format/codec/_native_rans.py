"""Compiled (numba) rANS decoder of the ``rans`` value coding (:mod:`dcr_format.codec.rans`).

Private, imported on first use like :mod:`dcr_format.codec._native`. It decodes exactly
what ``constriction``'s ``AnsCoder`` decodes (FORMAT.md §7.3: 64-bit state, 32-bit words,
24-bit probabilities), with a lookup table of the ``2**Q`` quantiles instead of a search,
so one symbol costs a few integer operations. Arithmetic is uint64 throughout (numba
turns mixed signed/unsigned 64-bit arithmetic into float64, so every operand is typed).
``tests/test_codec_rans.py`` checks it against constriction and the pure-Python reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_LOW = np.uint64(1 << 32)
_MASK24 = np.uint64((1 << 24) - 1)
_S24 = np.uint64(24)
_S32 = np.uint64(32)


@njit(cache=True, nogil=True)
def decode(
    words: np.ndarray,
    scaled: np.ndarray,
    starts: np.ndarray,
    lookup: np.ndarray,
    shift: int,
    count: int,
) -> tuple[np.ndarray, int, np.int64]:  # pragma: no cover - compiled
    """``count`` symbols of the words (uint32, read from the end); returns the symbols, the
    number of words left unread and the final state (both 0 for a well-formed stream)."""
    out = np.empty(count, dtype=np.int32)
    nxt = words.size - 1
    x = np.uint64(0)
    if nxt >= 0:
        x = np.uint64(words[nxt])
        nxt -= 1
        if nxt >= 0:
            x = (x << _S32) | np.uint64(words[nxt])
            nxt -= 1
    down = np.uint64(shift)
    for i in range(count):
        q = x & _MASK24
        s = lookup[np.int64(q >> down)]
        x = (x >> _S24) * scaled[s] + q - starts[s]
        if x < _LOW and nxt >= 0:
            x = (x << _S32) | np.uint64(words[nxt])
            nxt -= 1
        out[i] = s
    return out, nxt + 1, np.int64(x != np.uint64(0))


@njit(cache=True, nogil=True)
def read_varints(
    buf: np.ndarray, offset: int, count: int, limit: int
) -> tuple[np.ndarray, int, int]:  # pragma: no cover - compiled
    """``count`` varints from ``offset``: (values, end offset, error), error 0 when well
    formed, 1 truncated, 2 longer than ``limit`` bytes, 3 not minimal, 4 over 64 bits."""
    out = np.zeros(count, dtype=np.uint64)
    pos = offset
    for j in range(count):
        value = np.uint64(0)
        length = 0
        while True:
            if pos >= buf.size:
                return out, pos, 1
            if length == limit:
                return out, pos, 2
            byte = np.uint64(buf[pos])
            part = byte & np.uint64(0x7F)
            if length == 9 and part > np.uint64(1):
                return out, pos, 4
            value |= part << np.uint64(7 * length)
            pos += 1
            length += 1
            if byte < np.uint64(0x80):
                if byte == np.uint64(0) and length > 1:
                    return out, pos, 3
                break
        out[j] = value
    return out, pos, 0


@njit(cache=True, nogil=True)
def _varint_len(value: np.uint64) -> int:  # pragma: no cover - compiled
    length = 1
    while value >= np.uint64(128):
        value >>= np.uint64(7)
        length += 1
    return length


@njit(cache=True, nogil=True)
def estimates(
    distinct: np.ndarray,
    counts: np.ndarray,
    total: int,
    width: int,
    sizes: np.ndarray,
    bits: np.ndarray,
) -> np.ndarray:  # pragma: no cover - compiled
    """The estimated stream size in bytes of every candidate table size (FORMAT.md §7.4),
    as :func:`dcr_format.codec.rans.choose_model` computes them with arrays."""
    out = np.empty(sizes.size, dtype=np.int64)
    for r in range(sizes.size):
        size = sizes[r]
        q = bits[r]
        one = np.int64(1) << q
        free = one - (size + 1)
        all_counts = np.empty(size + 1, dtype=np.int64)
        table_sum = np.int64(0)
        for j in range(size):
            all_counts[j] = counts[j]
            table_sum += counts[j]
        all_counts[size] = total - table_sum
        freqs = np.empty(size + 1, dtype=np.int64)
        first_max = 0
        fsum = np.int64(0)
        for j in range(size + 1):
            freqs[j] = 1 + (all_counts[j] * free) // total
            fsum += freqs[j]
            if all_counts[j] > all_counts[first_max]:
                first_max = j
        freqs[first_max] += one - fsum
        coded = 0.0
        for j in range(size + 1):
            if all_counts[j] > 0:
                coded += all_counts[j] * (q - np.log2(np.float64(freqs[j])))
        words = np.int64(np.ceil(coded / 32)) + 1
        freq_bytes = 0
        for j in range(size):
            freq_bytes += _varint_len(np.uint64(freqs[j]))
        ordered = np.sort(distinct[:size])
        table_bytes = _varint_len(ordered[0])
        for j in range(1, size):
            table_bytes += _varint_len(ordered[j] - ordered[j - 1] - np.uint64(1))
        out[r] = (
            2
            + table_bytes
            + freq_bytes
            + _varint_len(np.uint64(words))
            + 4 * words
            + width * all_counts[size]
        )
    return out
