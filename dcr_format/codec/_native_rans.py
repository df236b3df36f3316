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
