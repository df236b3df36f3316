"""Value streams: the exact bits of changed (or all) elements.

Two codings (spec/FORMAT.md §7):

- ``planes``: for ``n`` values of ``w`` bytes, ``w`` planes of ``n`` bytes each, the most
  significant byte of every value first. High bytes of XOR deltas and of neighbouring
  weights repeat, so the shard's zstd frame packs them tightly. Every reader has it.
- ``rans`` (feature ``values-rans``, :mod:`dcr_format.codings.rans`): the values entropy-coded
  with a static model carried in the stream. Written only where the writer was allowed the
  feature (:mod:`dcr_format.format.features`), and only where it is smaller.

:func:`encode_values` keeps ``planes`` unless another coding is allowed and wins on exact
sizes; what is allowed is its ``codings`` argument (``planes`` alone by default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import zstandard

from dcr_format.codings import rans, ulp_shift
from dcr_format.codings.planes import from_planes, to_planes
from dcr_format.errors import ArgumentError, ValuesError
from dcr_format.format.names import (
    PLANES,
    RANS,
    ULP,
    ULP_SHIFT,
    VALUE_CODINGS,
)
from dcr_format.format.npviews import UNSIGNED_NP

_ESTIMATE_LEVEL = 1  # zstd level of the planes estimate a rans stream is compared with


def encode_values(bits: np.ndarray, *, codings: Iterable[str] = (PLANES,)) -> tuple[str, bytes]:
    """Encode an unsigned integer array (the exact bits); returns (coding, stream).

    ``codings``: the value codings allowed (``planes`` and ``rans``; default: ``planes``
    alone). With ``rans`` allowed, the rANS stream is kept when it is at most half the raw
    planes, or else smaller than the raw planes and than the planes compressed at zstd
    level 1 (FORMAT.md §7.4).
    """
    bits = _unsigned(bits)
    return _encoded(bits, _rans_model(bits, _allowed(codings)))


def encode_xor_values(
    xor: np.ndarray,
    differences: np.ndarray,
    *,
    old: np.ndarray | None = None,
    dtype: str | None = None,
    codings: Iterable[str] = (),
) -> tuple[str, bytes]:
    """The values of an ``xor`` entry of a float tensor where the writer may use ``ulp`` or
    ``ulp-shift`` (FORMAT.md §7.5-7.6): ``xor`` the XOR bits, ``differences`` the zigzag ulp
    differences of the same elements (:func:`dcr_format.codings.ulp.to_ulp`), ``old`` their
    old bits and ``dtype`` the tensor's dtype name (both needed for ``ulp-shift``). Returns
    (coding, stream): ``ulp``, ``ulp-shift`` or what :func:`encode_values` chooses for the
    XOR bits. ``codings``: the codings the writer is allowed beyond ``planes``
    (:attr:`~dcr_format.format.features.EncodeOptions.codings`; of those, ``rans``,
    ``ulp`` and ``ulp-shift`` play a part here).

    The models of every allowed coding are built (§7.4 steps 1-2) and only the one of least
    estimate is encoded (the XOR bits, then ``ulp``, then ``ulp-shift`` on ties): the
    estimates are exact to within a word, and coding each cost a step its rANS time again.
    Where the XOR bits have no model (they would be ``planes``), a ``ulp`` or ``ulp-shift``
    stream must also beat those planes compressed at zstd level 1.
    """
    xor, differences = _unsigned(xor), _unsigned(differences)
    allowed = frozenset(codings)
    xor_model = _rans_model(xor, _PLANES_ONLY | (allowed & _VALUE_CODINGS))
    best: tuple[float, str, Callable[[], bytes]] | None = None
    if ULP in allowed:
        ulp_model = _rans_model(differences, _RANS_ONLY)
        if ulp_model is not None:
            model = ulp_model[0]
            best = (ulp_model[1], ULP, lambda: rans.encode_rans(differences, model))
    if ULP_SHIFT in allowed and old is not None and dtype is not None:
        shifted = _shift_candidate(differences, _unsigned(old), dtype)
        if shifted is not None and (best is None or shifted[0] < best[0]):
            best = shifted
    if best is None or (xor_model is not None and xor_model[1] <= best[0]):
        return _encoded(xor, xor_model)
    coded = best[2]()
    if len(coded) < xor.size * xor.dtype.itemsize and (
        xor_model is not None or len(coded) < _zstd_estimate(to_planes(xor))
    ):
        return best[1], coded
    return _encoded(xor, xor_model)


def _shift_candidate(
    differences: np.ndarray, old: np.ndarray, dtype: str
) -> tuple[float, str, Callable[[], bytes]] | None:
    """The ``ulp-shift`` candidate (FORMAT.md §7.6): its estimate and its encoder, or None
    where no origin pays or the shifted differences have no model."""
    origin = ulp_shift.choose_origin(old, differences, dtype)
    if origin is None:
        return None
    y, low = ulp_shift.split(old, differences, origin, dtype)
    model = _rans_model(y, _RANS_ONLY)
    if model is None:
        return None
    estimate = 2 + len(rans.length_bytes(math.ceil(model[1]))) + model[1] + len(low)
    chosen = model[0]
    return (
        estimate,
        ULP_SHIFT,
        lambda: ulp_shift.assemble(origin, rans.encode_rans(y, chosen), low),
    )


def _allowed(codings: Iterable[str]) -> frozenset[str]:
    allowed = frozenset(codings)
    unknown = allowed - set(VALUE_CODINGS)
    if unknown:
        raise ArgumentError(f"unknown value codings {sorted(unknown)}; use {VALUE_CODINGS}")
    return allowed


def _unsigned(bits: np.ndarray) -> np.ndarray:
    width = bits.dtype.itemsize
    if width not in UNSIGNED_NP:
        raise ArgumentError(f"value width {width} is not one of 1, 2, 4, 8")
    kind = UNSIGNED_NP[width]
    if bits.dtype == kind and bits.ndim == 1 and bits.flags.c_contiguous:  # most callers'
        return bits
    return np.ascontiguousarray(bits).reshape(-1).view(kind)


_PLANES_ONLY = frozenset((PLANES,))
_RANS_ONLY = frozenset((RANS,))
_VALUE_CODINGS = frozenset(VALUE_CODINGS)


def _rans_model(bits: np.ndarray, allowed: frozenset[str]) -> tuple[rans.Model, float] | None:
    """§7.4 steps 1-2: the model of ``bits`` and its estimate, where ``rans`` is allowed, the
    sample (if any) says it may pay and the estimate is below the raw planes; else None."""
    if RANS not in allowed or not rans.worth_trying(bits):
        return None
    model, estimate = rans.choose_model(bits)
    return (model, estimate) if estimate < bits.size * bits.dtype.itemsize else None


def _encoded(bits: np.ndarray, model: tuple[rans.Model, float] | None) -> tuple[str, bytes]:
    """§7.4 step 3: the rANS stream under ``model`` where it is kept, else ``planes``."""
    if model is not None:
        coded = rans.encode_rans(bits, model[0])
        raw = bits.size * bits.dtype.itemsize  # the planes' length, before they are made
        if 2 * len(coded) <= raw:
            return RANS, coded
        planes = to_planes(bits)
        if len(coded) < raw and len(coded) < _zstd_estimate(planes):
            return RANS, coded
        return PLANES, planes
    return PLANES, to_planes(bits)


def _zstd_estimate(data: bytes) -> int:
    return len(zstandard.ZstdCompressor(level=_ESTIMATE_LEVEL).compress(data))


def decode_values(coding: str, data: bytes | memoryview, *, count: int, width: int) -> np.ndarray:
    """Decode a value stream into ``count`` unsigned integers of ``width`` bytes."""
    if coding not in VALUE_CODINGS:
        raise ValuesError(f"unknown value coding {coding!r}; upgrade dcr-format")
    if width not in UNSIGNED_NP:
        raise ValuesError(f"value width {width} is not one of 1, 2, 4, 8")
    if coding == RANS:
        return rans.decode_rans(data, count=count, width=width)
    if len(data) != count * width:
        raise ValuesError(
            f"value stream holds {len(data)} bytes, expected {count} values of {width} bytes"
        )
    return from_planes(data, count, width)
