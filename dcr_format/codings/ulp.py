"""The ``ulp`` value coding (feature ``values-ulp``, spec/FORMAT.md §7.5).

An optimizer step moves most changed weights by one or two units in the last place. Their
XOR bits are not small (a step that carries through the mantissa flips many bits), but the
difference of the elements in the order of their values is: this coding sends, for each
changed element of an ``xor`` entry of a float tensor, the *zigzag* of that difference,
rANS-coded exactly like ``rans`` values (§7.3). The reader, which holds the old bits (an
``xor`` entry requires it), turns each back into the new bits and so into the XOR bits.

The order map is a bijection of the ``w``-bit patterns (NaN payloads, ``-0.0`` and
infinities included): ``u(x) = x ^ 0x80..0`` when the sign bit of ``x`` is clear, else
``x ^ 0xff..f``; ``d = u(new) - u(old)`` modulo ``2**w``; ``z = zigzag(d)`` (``2d`` for a
non-negative ``d`` read as a signed ``w``-bit integer, ``-2d - 1`` for a negative one).
Everything is elementwise over the changed elements only (O(changed)).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np

from dcr_format.errors import ValuesError
from dcr_format.kernels.native import compiled

FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


_KINDS: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _consts(width: int) -> tuple[type[np.unsignedinteger], np.unsignedinteger, np.unsignedinteger]:
    """The unsigned type of ``width`` bytes, its top bit and all its bits set."""
    kind = _KINDS.get(width)
    if kind is None:
        raise ValuesError(f"ulp values need a float width of 2, 4 or 8 bytes, not {width}")
    top = kind(1) << kind(8 * width - 1)
    return kind, top, ~kind(0)


def _order(bits: np.ndarray, width: int) -> np.ndarray:
    kind, top, ones = _consts(width)
    flips = np.where(bits & top, ones, top).astype(kind)
    out: np.ndarray = bits ^ flips
    return out


def _unorder(ordered: np.ndarray, width: int) -> np.ndarray:
    kind, top, ones = _consts(width)
    flips = np.where(ordered & top, top, ones).astype(kind)
    out: np.ndarray = ordered ^ flips
    return out


def _native() -> ModuleType | None:
    return compiled("dcr_format.codings._ulp_kernels")


def to_ulp(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The zigzag ulp differences of ``new`` against ``old`` (unsigned arrays of one width):
    one compiled loop where numba is usable, else :func:`_to_ulp_reference`."""
    return _elementwise("to_ulp", _to_ulp_reference, old, new)


def from_ulp(old: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The new bits from the old bits and their zigzag ulp differences (:func:`to_ulp`)."""
    return _elementwise("from_ulp", _from_ulp_reference, old, z)


def _elementwise(
    kernel: str,
    reference: Callable[[np.ndarray, np.ndarray], np.ndarray],
    a: np.ndarray,
    b: np.ndarray,
) -> np.ndarray:
    """``kernel`` of the compiled module over ``a`` and ``b`` (same width), else ``reference``."""
    kind = _consts(a.dtype.itemsize)[0]
    native = _native()
    if native is None:
        return reference(a, b)
    out = np.empty(a.shape, dtype=kind)
    getattr(native, kernel)(
        np.ascontiguousarray(a).view(kind), np.ascontiguousarray(b).view(kind), out
    )
    return out


def ulp_of_change(new: np.ndarray, positions: np.ndarray, xor: np.ndarray) -> np.ndarray:
    """The zigzag ulp differences of a change the writer found: ``new`` the tensor's new bits
    (flat, unsigned), ``positions`` the changed positions, ``xor`` their XOR bits (the old
    bits are ``new ^ xor`` there)."""
    kind = _consts(new.dtype.itemsize)[0]
    native = _native()
    if native is None:
        after = new[positions]
        return to_ulp(after ^ xor, after)
    out = np.empty(positions.shape, dtype=kind)
    native.ulp_of_change(new.view(kind), positions, np.ascontiguousarray(xor).view(kind), out)
    return out


def _to_ulp_reference(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """:func:`to_ulp` in numpy (the reference the tests compare the compiled loop with)."""
    width = old.dtype.itemsize
    kind, top, ones = _consts(width)
    with np.errstate(over="ignore"):
        d = (_order(new.astype(kind, copy=False), width) - _order(old.astype(kind), width)).astype(
            kind
        )
        negative = (d & top) != 0
        z: np.ndarray = ((d << kind(1)) ^ np.where(negative, ones, kind(0))).astype(kind)
    return z


def _from_ulp_reference(old: np.ndarray, z: np.ndarray) -> np.ndarray:
    """:func:`from_ulp` in numpy (the reference)."""
    width = old.dtype.itemsize
    kind, _, ones = _consts(width)
    z = z.astype(kind, copy=False)
    with np.errstate(over="ignore"):
        d = (z >> kind(1)) ^ np.where(z & kind(1), ones, kind(0)).astype(kind)
        ordered = (_order(old.astype(kind), width) + d).astype(kind)
    return _unorder(ordered, width)


__all__ = ["FLOAT_DTYPES", "from_ulp", "to_ulp", "ulp_of_change"]
