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
