"""Compiled (numba) kernels of the ``classed`` position coding (:mod:`dcr_format.codec.classed`).

Private, imported on first use like :mod:`dcr_format.codec._native` (numba missing or
``DCR_KERNELS=torch``: the numpy reference in :mod:`~dcr_format.codec.classed` runs). Each
kernel is one sequential pass over the tensor's old bits with a counter per class, so no
temporary as large as the tensor is made; they reproduce the reference exactly
(``tests/test_codec_classed.py``). Classes are ``clamp(((bits >> shift) & mask) - base, 0,
count - 1)``; arithmetic is int64 (the bits arrive as uint64-compatible unsigned arrays).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def exponent_histograms(
    bits: np.ndarray, positions: np.ndarray, xor: np.ndarray, shift: int, mask: int
) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Counts of every old exponent value over all elements and over the changed ones. The
    old bits are ``bits``, or with a non-empty ``xor`` (one per position) ``bits ^ xor`` at
    the positions (``bits`` then being the new bits)."""
    everything = np.zeros(mask + 1, dtype=np.int64)
    changed = np.zeros(mask + 1, dtype=np.int64)
    for i in range(bits.size):
        everything[(np.int64(bits[i]) >> shift) & mask] += 1
    flip = xor.size > 0
    for j in range(positions.size):
        value = bits[positions[j]]
        if flip:
            everything[(np.int64(value) >> shift) & mask] -= 1
            value ^= xor[j]
            everything[(np.int64(value) >> shift) & mask] += 1
        changed[(np.int64(value) >> shift) & mask] += 1
    return everything, changed


@njit(cache=True, nogil=True)
def class_ranks(
    bits: np.ndarray,
    positions: np.ndarray,
    xor: np.ndarray,
    shift: int,
    mask: int,
    base: int,
    count: int,
) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Each changed position's class and its rank among the elements of that class (old
    bits as in :func:`exponent_histograms`)."""
    seen = np.zeros(count, dtype=np.int64)
    classes = np.empty(positions.size, dtype=np.int64)
    ranks = np.empty(positions.size, dtype=np.int64)
    flip = xor.size > 0
    j = 0
    end = positions[positions.size - 1] + 1 if positions.size else 0
    for i in range(end):
        value = bits[i]
        hit = j < positions.size and positions[j] == i
        if hit and flip:
            value ^= xor[j]
        c = int((np.int64(value) >> shift) & mask) - base
        c = 0 if c < 0 else (count - 1 if c > count - 1 else c)
        if hit:
            classes[j] = c
            ranks[j] = seen[c]
            j += 1
        seen[c] += 1
    return classes, ranks


@njit(cache=True, nogil=True)
def class_sizes(
    bits: np.ndarray, shift: int, mask: int, base: int, count: int
) -> np.ndarray:  # pragma: no cover - compiled
    """How many elements each class has."""
    sizes = np.zeros(count, dtype=np.int64)
    for i in range(bits.size):
        c = int((np.int64(bits[i]) >> shift) & mask) - base
        c = 0 if c < 0 else (count - 1 if c > count - 1 else c)
        sizes[c] += 1
    return sizes


@njit(cache=True, nogil=True)
def positions_of_ranks(
    bits: np.ndarray,
    shift: int,
    mask: int,
    base: int,
    count: int,
    ranks: np.ndarray,
    starts: np.ndarray,
    total: int,
) -> np.ndarray:  # pragma: no cover - compiled
    """Flat positions, increasing, of the listed ranks: class ``c``'s ranks are
    ``ranks[starts[c]:starts[c + 1]]`` (strictly increasing, each below the class size)."""
    out = np.empty(total, dtype=np.int64)
    seen = np.zeros(count, dtype=np.int64)
    cursor = starts[:count].copy()
    k = 0
    for i in range(bits.size):
        if k == total:
            break
        c = int((np.int64(bits[i]) >> shift) & mask) - base
        c = 0 if c < 0 else (count - 1 if c > count - 1 else c)
        if cursor[c] < starts[c + 1] and ranks[cursor[c]] == seen[c]:
            out[k] = i
            k += 1
            cursor[c] += 1
        seen[c] += 1
    return out[:k]
