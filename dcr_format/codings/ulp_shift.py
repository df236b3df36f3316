"""The ``ulp-shift`` value coding (feature ``values-ulp-shift``, spec/FORMAT.md §7.6).

The ulp distance of an update doubles for every exponent its old value lies below the one
where most changes are one ulp: the same step in value is twice as many units in the last
place of a number half as large. ``ulp-shift`` sends each changed element's signed ulp
difference ``d_k`` (§7.5) split in two: ``s_k = min(cap, max(0, e0 - e_k))`` low bits raw
(``e_k`` the exponent field of the old value, ``e0`` the stream's *shift origin*, ``cap``
the mantissa width plus one), and the rest, ``d_k >> s_k`` (arithmetic), zigzagged and
rANS-coded (§7.3). Both ends hold the old bits, so both know every ``s_k``.

Layout: ``u16 LE e0``, a varint ``L``, ``L`` bytes of a §7.3 stream of the ``y_k =
zigzag(d_k >> s_k)``, then the low bits of every element in element order, least significant
first, packed from bit 0 of the first byte on (exactly ``ceil(sum(s_k) / 8)`` bytes, the
padding bits 0).

This module holds both ends (:func:`split`, :func:`join`: one compiled loop each, in
:mod:`dcr_format.codings._ulp_kernels`, with their numpy references here, which the tests
compare them with) and the writer's choice of ``e0`` (:func:`choose_origin`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from dcr_format.codings.rans import length_bytes, read_length
from dcr_format.errors import ValuesError
from dcr_format.format.names import EXPONENT_FIELDS
from dcr_format.kernels.native import compiled

_HEADER = struct.Struct("<H")
_KINDS: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def shift_cap(dtype: str) -> int:
    """The largest shift of ``dtype``: its mantissa width plus one (bfloat16: 8)."""
    return EXPONENT_FIELDS[dtype][0] + 1


def exponents_of(old: np.ndarray, dtype: str) -> np.ndarray:
    """The exponent fields (int64) of the old bits ``old`` (unsigned, one per change)."""
    shift, mask = EXPONENT_FIELDS[dtype]
    wide = old.astype(np.uint64, copy=False)
    out: np.ndarray = ((wide >> np.uint64(shift)) & np.uint64(mask)).astype(np.int64)
    return out


def _native() -> ModuleType | None:
    return compiled("dcr_format.codings._ulp_kernels")


def choose_origin(old: np.ndarray, z: np.ndarray, dtype: str) -> int | None:
    """The writer's shift origin (FORMAT.md §7.6) for changes of old bits ``old`` and zigzag
    ulp differences ``z``: with ``n_e`` the changes whose old exponent is ``e`` and
    ``ones_e`` those of them one ulp away (``z`` 1 or 2), the smallest ``e0`` in ``1 ..
    mask + 1`` that maximises ``G(e0) = sum over e < e0 of (n_e - 2 ones_e)``; None where
    that maximum is not positive (no shift pays)."""
    shift, mask = EXPONENT_FIELDS[dtype]
    native = _native()
    if native is not None:  # counts, gains and their maximum in one call
        return int(native.best_origin(old, z, shift, mask)) or None
    exponents = exponents_of(old, dtype)
    n = np.bincount(exponents, minlength=mask + 1)
    ones = np.bincount(exponents[(z == 1) | (z == 2)], minlength=mask + 1)
    gain = np.cumsum(n - 2 * ones)  # gain[i] = G(i + 1)
    best = int(np.argmax(gain))
    return best + 1 if gain[best] > 0 else None


def shifts_of(exponents: np.ndarray, origin: int, dtype: str) -> np.ndarray:
    """``s_k = min(cap, max(0, e0 - e_k))`` (int64)."""
    out: np.ndarray = np.clip(origin - exponents, 0, shift_cap(dtype))
    return out


def split(old: np.ndarray, z: np.ndarray, origin: int, dtype: str) -> tuple[np.ndarray, bytes]:
    """The writer's side: the ``y_k = zigzag(d_k >> s_k)`` (unsigned, of the width of ``z``)
    of the zigzag ulp differences ``z`` of changes of old bits ``old``, and the packed low
    bits; one compiled loop where numba is usable, else :func:`_split_reference`."""
    native = _native()
    if native is None:
        return _split_reference(z, shifts_of(exponents_of(old, dtype), origin, dtype), z.itemsize)
    shift, mask = EXPONENT_FIELDS[dtype]
    cap = shift_cap(dtype)
    y = np.empty(z.shape, dtype=z.dtype)
    low = np.empty((z.size * cap + 7) // 8, dtype=np.uint8)
    used = native.split_low(old, z, origin, shift, mask, cap, y, low)
    return y, low[:used].tobytes()


_JOIN_ERRORS = {
    1: "has a value too large for its shift",
    2: "ends inside its low bits",
    3: "has bytes or padding bits after its low bits",
}


def join(
    old: np.ndarray, y: np.ndarray, origin: int, low: bytes | memoryview, dtype: str
) -> np.ndarray:
    """The reader's side: the zigzag ulp differences of ``y`` and the packed low bits against
    the old bits ``old``, refusing (:class:`ValuesError`) a ``y_k`` that no ``d_k`` gives
    (``y_k >= 2^(8w - s_k)``) and low bits that are not exactly the shifts' bytes with zero
    padding; one compiled loop where numba is usable, else :func:`_join_reference`."""
    native = _native()
    if native is None:
        shifts = shifts_of(exponents_of(old, dtype), origin, dtype)
        return _join_reference(y, shifts, low, y.itemsize)
    shift, mask = EXPONENT_FIELDS[dtype]
    z = np.empty(y.shape, dtype=y.dtype)
    packed = np.frombuffer(low, dtype=np.uint8)
    error = native.join_low(old, y, origin, shift, mask, shift_cap(dtype), packed, z)
    if error:
        raise ValuesError(f"ulp-shift stream {_JOIN_ERRORS[error]}; the object is corrupt")
    return z


def _signed(z: np.ndarray) -> np.ndarray:
    """The signed values (int64; two's complement of 64 bits) of zigzags (unsigned)."""
    wide = z.astype(np.uint64, copy=False)
    magnitude = (wide >> np.uint64(1)).view(np.int64)
    out: np.ndarray = np.where(wide & np.uint64(1), -magnitude - 1, magnitude)
    return out


def _zigzag(d: np.ndarray, width: int) -> np.ndarray:
    """The zigzag (unsigned, ``width`` bytes) of signed ``d`` (int64) that fit the width."""
    with np.errstate(over="ignore"):
        out = ((d << np.int64(1)) ^ (d >> np.int64(63))).view(np.uint64)
    result: np.ndarray = out.astype(_KINDS[width])
    return result


def _pack(low: np.ndarray, shifts: np.ndarray) -> bytes:
    """The low bits, ``shifts[k]`` of ``low[k]`` each, least significant first, packed from
    bit 0 of the first byte (the last byte's unused high bits 0)."""
    total = int(shifts.sum())
    bits = np.zeros(total, dtype=np.uint8)
    offsets = np.cumsum(shifts) - shifts
    wide = low.view(np.uint64)
    for j in range(int(shifts.max(initial=0))):
        here = shifts > j
        bits[offsets[here] + j] = (wide[here] >> np.uint64(j)) & np.uint64(1)
    return np.packbits(bits, bitorder="little").tobytes()


def _unpack(data: bytes | memoryview, shifts: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_pack` (uint64), refusing a byte count other than
    ``ceil(sum(shifts) / 8)`` and padding bits that are not 0."""
    total = int(shifts.sum())
    if len(data) < (total + 7) // 8:
        raise ValuesError(f"ulp-shift stream {_JOIN_ERRORS[2]}; the object is corrupt")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if len(data) > (total + 7) // 8 or bits[total:].any():
        raise ValuesError(f"ulp-shift stream {_JOIN_ERRORS[3]}; the object is corrupt")
    low = np.zeros(shifts.size, dtype=np.uint64)
    offsets = np.cumsum(shifts) - shifts
    for j in range(int(shifts.max(initial=0))):
        here = shifts > j
        low[here] |= bits[offsets[here] + j].astype(np.uint64) << np.uint64(j)
    return low


def _split_reference(z: np.ndarray, shifts: np.ndarray, width: int) -> tuple[np.ndarray, bytes]:
    """:func:`split` in numpy, given the shifts (the reference of the compiled loop)."""
    d = _signed(z)  # a zigzag of w bits: the signed w-bit difference itself
    y = _zigzag(d >> shifts, width)
    low = d & ((np.int64(1) << shifts) - 1)
    return y, _pack(low, shifts)


def _join_reference(
    y: np.ndarray, shifts: np.ndarray, low: bytes | memoryview, width: int
) -> np.ndarray:
    """:func:`join` in numpy, given the shifts (the reference of the compiled loop)."""
    wide = y.astype(np.uint64, copy=False)
    limit = 8 * width - shifts
    beyond = np.where(limit < 64, wide >> np.minimum(limit, 63).astype(np.uint64), 0)
    if np.any(beyond != 0):
        raise ValuesError(f"ulp-shift stream {_JOIN_ERRORS[1]}; the object is corrupt")
    bits = _unpack(low, shifts)
    with np.errstate(over="ignore"):
        d = (_signed(wide) << shifts) | bits.view(np.int64)
    return _zigzag(d, width)


@dataclass(frozen=True)
class ShiftStream:
    """A parsed ``ulp-shift`` stream: its origin, rANS part and low bits."""

    origin: int
    coded: memoryview
    low: memoryview


def parse(data: bytes | memoryview, *, count: int, width: int, dtype: str) -> ShiftStream:
    """Split a stream into its parts, refusing what §7.6 refuses before the old bits are read:
    a stream not shorter than ``count`` values of ``width`` bytes, a header or length past
    its end or a non-minimal length, an origin above ``mask + 1``."""
    view = memoryview(data).cast("B")
    if len(view) >= count * width:
        raise ValuesError(
            f"ulp-shift stream of {len(view)} bytes is not shorter than its {count} values; "
            "the object is corrupt"
        )
    if len(view) < _HEADER.size:
        raise ValuesError("ulp-shift stream ends inside its header; the object is corrupt")
    (origin,) = _HEADER.unpack_from(view, 0)
    if origin > EXPONENT_FIELDS[dtype][1] + 1:
        raise ValuesError(
            f"ulp-shift origin {origin} is past the exponents of {dtype}; the object is corrupt"
        )
    length, offset = read_length(view, _HEADER.size)
    if offset + length > len(view):
        raise ValuesError("ulp-shift stream ends inside its rANS part; the object is corrupt")
    return ShiftStream(origin, view[offset : offset + length], view[offset + length :])


def assemble(origin: int, coded: bytes, low: bytes) -> bytes:
    """The stream of an origin, a §7.3 stream of the ``y_k`` and the packed low bits."""
    return _HEADER.pack(origin) + length_bytes(len(coded)) + coded + low


__all__ = [
    "ShiftStream",
    "assemble",
    "choose_origin",
    "exponents_of",
    "join",
    "parse",
    "shift_cap",
    "shifts_of",
    "split",
]
