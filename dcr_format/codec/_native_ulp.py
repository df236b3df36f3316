"""Compiled (numba) kernels of the ``ulp`` value coding (:mod:`dcr_format.codec.ulp`).

Private, imported on first use like :mod:`dcr_format.codec._native`. One loop over the
changed elements each way, in place of numpy's half a dozen temporaries: the zigzag ulp
differences of new bits against old ones, and back. Arithmetic is on uint64 with every
operand typed (numba turns mixed signed/unsigned arithmetic into float64), masked to the
width. The fused apply of :mod:`dcr_format.codec._native` steps the old bits with
:func:`stepped`; the ``ulp-shift`` loops (:mod:`dcr_format.codec.ulp_shift`) are below.
``tests/test_values_ulp.py`` and ``tests/test_values_ulp_shift.py`` check them against the
numpy references.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_ONE = np.uint64(1)
_ZERO = np.uint64(0)


@njit(cache=True, nogil=True, inline="always")
def limits(itemsize: int) -> tuple[np.uint64, np.uint64]:  # pragma: no cover - compiled
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
def stepped(
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
    top, ones = limits(old.itemsize)
    for k in range(old.size):
        out[k] = _zigzag(np.uint64(old[k]), np.uint64(new[k]), top, ones)


@njit(cache=True, nogil=True)
def from_ulp(old: np.ndarray, z: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[k]`` = the new bits whose zigzag ulp difference from ``old[k]`` is ``z[k]``
    (the inverse of :func:`to_ulp`)."""
    top, ones = limits(old.itemsize)
    for k in range(old.size):
        out[k] = stepped(np.uint64(old[k]), np.uint64(z[k]), top, ones)


@njit(cache=True, nogil=True)
def ulp_of_change(
    new: np.ndarray, positions: np.ndarray, xor: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled
    """The writer's side in one loop: ``out[k]`` = :func:`to_ulp` of the old bits
    ``new[p] ^ xor[k]`` and the new bits ``new[p]`` at ``p = positions[k]`` (no gathered
    copy of either)."""
    top, ones = limits(new.itemsize)
    for k in range(positions.size):
        after = np.uint64(new[positions[k]])
        out[k] = _zigzag(after ^ np.uint64(xor[k]), after, top, ones)


# --- ulp-shift (FORMAT.md §7.6): the writer's counts and split, the reader's join ---


@njit(cache=True, nogil=True)
def origin_counts(
    old: np.ndarray, z: np.ndarray, shift: int, mask: int, n: np.ndarray, ones: np.ndarray
) -> None:  # pragma: no cover - compiled
    """``n[e]``/``ones[e]`` += the changes whose old exponent field is ``e`` / of them those
    one ulp away (``z`` 1 or 2); both int64 arrays of ``mask + 1`` zeros on entry."""
    for k in range(old.size):
        e = (np.uint64(old[k]) >> np.uint64(shift)) & np.uint64(mask)
        n[e] += 1
        if z[k] == 1 or z[k] == 2:
            ones[e] += 1


@njit(cache=True, nogil=True, inline="always")
def _shift_of(
    x: np.uint64, origin: int, shift: int, mask: int, cap: int
) -> np.uint64:  # pragma: no cover - compiled
    e = np.int64((x >> np.uint64(shift)) & np.uint64(mask))
    s = origin - e
    if s <= 0:
        return _ZERO
    if s > cap:
        return np.uint64(cap)
    return np.uint64(s)


@njit(cache=True, nogil=True)
def split_shifted(
    old: np.ndarray,
    z: np.ndarray,
    origin: int,
    shift: int,
    mask: int,
    cap: int,
    y: np.ndarray,
    low: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """``y[k] = zigzag(d_k >> s_k)`` and the ``s_k`` low bits of every ``d_k`` packed into
    ``low`` (uint8, at least ``ceil(sum(s_k) / 8)`` bytes) from the zigzag ulp differences
    ``z`` of the old bits ``old``; returns the bytes of ``low`` used."""
    top, ones = limits(old.itemsize)
    acc, held, used = _ZERO, _ZERO, 0
    for k in range(old.size):
        s = _shift_of(np.uint64(old[k]), origin, shift, mask, cap)
        zk = np.uint64(z[k])
        d = (zk >> _ONE) ^ (ones if zk & _ONE else _ZERO)  # the w-bit pattern of d
        if d & top:
            d |= ~ones  # sign-extended to 64 bits
        q = d >> s
        if d >> np.uint64(63):
            q |= ~(~_ZERO >> s)  # arithmetic shift
        y[k] = ((q << _ONE) ^ (_ZERO - (q >> np.uint64(63)))) & ones
        if s:
            acc |= (d & ((_ONE << s) - _ONE)) << held
            held += s
            while held >= 8:
                low[used] = acc & np.uint64(0xFF)
                used += 1
                acc >>= np.uint64(8)
                held -= np.uint64(8)
    if held:
        low[used] = acc & np.uint64(0xFF)
        used += 1
    return used


@njit(cache=True, nogil=True)
def join_shifted(
    old: np.ndarray,
    y: np.ndarray,
    origin: int,
    shift: int,
    mask: int,
    cap: int,
    low: np.ndarray,
    z: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """The inverse of :func:`split_shifted`: ``z[k]`` the zigzag ulp differences. Returns 0,
    or 1 for a ``y_k`` too large for its shift, 2 for low bits that end early, 3 for bytes
    or nonzero padding bits after them (FORMAT.md §7.6)."""
    top, ones = limits(old.itemsize)
    width = np.uint64(8 * old.itemsize)
    acc, held, used = _ZERO, _ZERO, 0
    for k in range(old.size):
        s = _shift_of(np.uint64(old[k]), origin, shift, mask, cap)
        yk = np.uint64(y[k])
        if width - s < np.uint64(64) and yk >> (width - s):
            return 1
        while held < s:
            if used >= low.size:
                return 2
            acc |= np.uint64(low[used]) << held
            used += 1
            held += np.uint64(8)
        bits = acc & ((_ONE << s) - _ONE)
        acc >>= s
        held -= s
        q = (yk >> _ONE) ^ (_ZERO - (yk & _ONE))
        d = ((q << s) | bits) & ones
        z[k] = ((d << _ONE) ^ (ones if d & top else _ZERO)) & ones
    if used != low.size or acc:
        return 3
    return 0
