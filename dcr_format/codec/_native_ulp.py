"""Compiled (numba) kernels of the ``ulp`` value coding (:mod:`dcr_format.codec.ulp`).

Private, imported on first use like :mod:`dcr_format.codec._native`. One loop over the
changed elements each way, in place of numpy's half a dozen temporaries: the zigzag ulp
differences of new bits against old ones, and back. Arithmetic is on uint64 with every
operand typed (numba turns mixed signed/unsigned arithmetic into float64), masked to the
width. ``tests/test_values_ulp.py`` checks both against the numpy reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_ONE = np.uint64(1)
_ZERO = np.uint64(0)


@njit(cache=True, nogil=True, inline="always")
def _order(x: np.uint64, top: np.uint64, ones: np.uint64) -> np.uint64:  # pragma: no cover
    if x & top:
        return x ^ ones
    return x ^ top


@njit(cache=True, nogil=True)
def to_ulp(old: np.ndarray, new: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[k]`` = the zigzag of ``u(new[k]) - u(old[k])`` (FORMAT.md §7.5), all three
    unsigned arrays of one width."""
    width = np.uint64(8 * old.itemsize)
    top = _ONE << (width - _ONE)
    ones = (top - _ONE) | top
    for k in range(old.size):
        d = (_order(np.uint64(new[k]), top, ones) - _order(np.uint64(old[k]), top, ones)) & ones
        flip = ones if d & top else _ZERO
        out[k] = ((d << _ONE) ^ flip) & ones


@njit(cache=True, nogil=True)
def from_ulp(old: np.ndarray, z: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[k]`` = the new bits whose zigzag ulp difference from ``old[k]`` is ``z[k]``
    (the inverse of :func:`to_ulp`)."""
    width = np.uint64(8 * old.itemsize)
    top = _ONE << (width - _ONE)
    ones = (top - _ONE) | top
    for k in range(old.size):
        zk = np.uint64(z[k])
        d = (zk >> _ONE) ^ (ones if zk & _ONE else _ZERO)
        y = (_order(np.uint64(old[k]), top, ones) + d) & ones
        out[k] = y ^ (top if y & top else ones)


@njit(cache=True, nogil=True)
def ulp_of_change(
    new: np.ndarray, positions: np.ndarray, xor: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The writer's side in one loop: ``out[k]`` = :func:`to_ulp` of the old bits
    ``new[p] ^ xor[k]`` and the new bits ``new[p]`` at ``p = positions[k]`` (no gathered
    copy of either)."""
    width = np.uint64(8 * new.itemsize)
    top = _ONE << (width - _ONE)
    ones = (top - _ONE) | top
    for k in range(positions.size):
        after = np.uint64(new[positions[k]])
        before = after ^ np.uint64(xor[k])
        d = (_order(after, top, ones) - _order(before, top, ones)) & ones
        flip = ones if d & top else _ZERO
        out[k] = ((d << _ONE) ^ flip) & ones


@njit(cache=True, nogil=True)
def xor_of_ulp(
    old: np.ndarray, positions: np.ndarray, z: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The reader's side in one loop: ``out[k]`` = the XOR bits that take ``old[p]`` to
    :func:`from_ulp` of it and ``z[k]``, at ``p = positions[k]`` (each below ``old.size``)."""
    width = np.uint64(8 * old.itemsize)
    top = _ONE << (width - _ONE)
    ones = (top - _ONE) | top
    for k in range(positions.size):
        before = np.uint64(old[positions[k]])
        zk = np.uint64(z[k])
        d = (zk >> _ONE) ^ (ones if zk & _ONE else _ZERO)
        y = (_order(before, top, ones) + d) & ones
        out[k] = before ^ y ^ (top if y & top else ones)
