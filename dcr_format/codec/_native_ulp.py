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
def _limits(itemsize: int) -> tuple[np.uint64, np.uint64]:  # pragma: no cover - compiled
    """The top bit and all bits of an unsigned integer of ``itemsize`` bytes (as uint64)."""
    top = _ONE << (np.uint64(8 * itemsize) - _ONE)
    return top, (top - _ONE) | top


@njit(cache=True, nogil=True, inline="always")
def _order(x: np.uint64, top: np.uint64, ones: np.uint64) -> np.uint64:  # pragma: no cover
    if x & top:
        return x ^ ones
    return x ^ top


@njit(cache=True, nogil=True, inline="always")
def _zigzag(
    before: np.uint64, after: np.uint64, top: np.uint64, ones: np.uint64
) -> np.uint64:  # pragma: no cover - compiled
    """The zigzag of ``u(after) - u(before)`` (FORMAT.md §7.5)."""
    d = (_order(after, top, ones) - _order(before, top, ones)) & ones
    return ((d << _ONE) ^ (ones if d & top else _ZERO)) & ones


@njit(cache=True, nogil=True, inline="always")
def _stepped(
    before: np.uint64, z: np.uint64, top: np.uint64, ones: np.uint64
) -> np.uint64:  # pragma: no cover - compiled
    """The bits whose zigzag difference from ``before`` is ``z`` (the inverse of
    :func:`_zigzag`)."""
    d = (z >> _ONE) ^ (ones if z & _ONE else _ZERO)
    y = (_order(before, top, ones) + d) & ones
    return y ^ (top if y & top else ones)


@njit(cache=True, nogil=True)
def to_ulp(old: np.ndarray, new: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[k]`` = the zigzag of ``u(new[k]) - u(old[k])`` (FORMAT.md §7.5), all three
    unsigned arrays of one width."""
    top, ones = _limits(old.itemsize)
    for k in range(old.size):
        out[k] = _zigzag(np.uint64(old[k]), np.uint64(new[k]), top, ones)


@njit(cache=True, nogil=True)
def from_ulp(old: np.ndarray, z: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[k]`` = the new bits whose zigzag ulp difference from ``old[k]`` is ``z[k]``
    (the inverse of :func:`to_ulp`)."""
    top, ones = _limits(old.itemsize)
    for k in range(old.size):
        out[k] = _stepped(np.uint64(old[k]), np.uint64(z[k]), top, ones)


@njit(cache=True, nogil=True)
def ulp_of_change(
    new: np.ndarray, positions: np.ndarray, xor: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The writer's side in one loop: ``out[k]`` = :func:`to_ulp` of the old bits
    ``new[p] ^ xor[k]`` and the new bits ``new[p]`` at ``p = positions[k]`` (no gathered
    copy of either)."""
    top, ones = _limits(new.itemsize)
    for k in range(positions.size):
        after = np.uint64(new[positions[k]])
        out[k] = _zigzag(after ^ np.uint64(xor[k]), after, top, ones)


@njit(cache=True, nogil=True)
def xor_of_ulp(
    old: np.ndarray, positions: np.ndarray, z: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The reader's side in one loop: ``out[k]`` = the XOR bits that take ``old[p]`` to
    :func:`from_ulp` of it and ``z[k]``, at ``p = positions[k]`` (each below ``old.size``)."""
    top, ones = _limits(old.itemsize)
    for k in range(positions.size):
        before = np.uint64(old[positions[k]])
        out[k] = before ^ _stepped(before, np.uint64(z[k]), top, ones)
