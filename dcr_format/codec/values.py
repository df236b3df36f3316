"""Value streams: the exact bits of changed (or all) elements.

Two codings (spec/FORMAT.md §7):

- ``planes``: for ``n`` values of ``w`` bytes, ``w`` planes of ``n`` bytes each, the most
  significant byte of every value first. High bytes of XOR deltas and of neighbouring
  weights repeat, so the shard's zstd frame packs them tightly. Every reader has it.
- ``rans`` (feature ``values-rans``, :mod:`dcr_format.codec.rans`): the values entropy-coded
  with a static model carried in the stream. Written only where the writer was allowed the
  feature (:mod:`dcr_format.codec.features`), and only where it is smaller.

:func:`encode_values` keeps ``planes`` unless another coding is allowed and wins on exact
sizes; what is allowed comes from its ``codings`` argument or, by default, from the
innermost :func:`~dcr_format.codec.features.allowed_codings` block of the calling thread.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import zstandard

from dcr_format.codec import features, rans
from dcr_format.codec.dtypes import UNSIGNED_NP
from dcr_format.codec.planes import from_planes, to_planes
from dcr_format.errors import ArgumentError, ValuesError

PLANES = "planes"
RANS = rans.RANS
VALUE_CODINGS = (PLANES, RANS)
_ESTIMATE_LEVEL = 1  # zstd level of the planes estimate a rans stream is compared with


def encode_values(bits: np.ndarray, *, codings: Iterable[str] | None = None) -> tuple[str, bytes]:
    """Encode an unsigned integer array (the exact bits); returns (coding, stream).

    ``codings``: the codings allowed (default: ``planes`` and the value codings of the
    current :func:`~dcr_format.codec.features.allowed_codings` block). With ``rans``
    allowed, the rANS stream is kept when it is at most half the raw planes, or else
    smaller than the raw planes and than the planes compressed at zstd level 1 (FORMAT.md
    §7.4).
    """
    if codings is None:
        allowed = frozenset((PLANES,)) | (features.allowed() & frozenset(VALUE_CODINGS))
    else:
        allowed = frozenset(codings)
    unknown = allowed - set(VALUE_CODINGS)
    if unknown:
        raise ArgumentError(f"unknown value codings {sorted(unknown)}; use {VALUE_CODINGS}")
    width = bits.dtype.itemsize
    if width not in UNSIGNED_NP:
        raise ArgumentError(f"value width {width} is not one of 1, 2, 4, 8")
    bits = np.ascontiguousarray(bits).reshape(-1).view(UNSIGNED_NP[width])
    planes = to_planes(bits)
    if RANS in allowed and rans.worth_trying(bits):
        model, estimate = rans.choose_model(bits)
        if estimate < len(planes):
            coded = rans.encode_rans(bits, model)
            if 2 * len(coded) <= len(planes) or (
                len(coded) < len(planes) and len(coded) < _zstd_estimate(planes)
            ):
                return RANS, coded
    return PLANES, planes


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
