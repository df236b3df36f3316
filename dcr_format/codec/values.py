"""Value streams: the exact bits of changed (or all) elements.

Two codings (spec/FORMAT.md §7):

- ``planes``: for ``n`` values of ``w`` bytes, ``w`` planes of ``n`` bytes each, the most
  significant byte of every value first. High bytes of XOR deltas and of neighbouring
  weights repeat, so the shard's zstd frame packs them tightly. Every reader has it.
- ``rans`` (feature ``values-rans``, :mod:`dcr_format.codec.rans`): the values entropy-coded
  with a static model carried in the stream. Written only where the writer was allowed the
  feature (:func:`allowed_codings`), and only where it is smaller.

:func:`encode_values` keeps ``planes`` unless another coding is allowed and wins on exact
sizes; what is allowed comes from its ``codings`` argument or, by default, from the
innermost :func:`allowed_codings` block of the calling thread (so a writer enables a
feature around its encoding loop without every layer in between passing it down).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import TypeVar

import numpy as np
import zstandard

from dcr_format.codec import rans
from dcr_format.codec.dtypes import UNSIGNED_NP
from dcr_format.codec.planes import from_planes, to_planes
from dcr_format.errors import ArgumentError, ValuesError

PLANES = "planes"
RANS = rans.RANS
VALUE_CODINGS = (PLANES, RANS)
CODING_FEATURES: dict[str, str] = {RANS: rans.VALUES_RANS_FEATURE}
"""The ``required_features`` entry each value coding beyond ``planes`` needs (FORMAT.md §12)."""
FEATURE_CODINGS: dict[str, str] = {feature: coding for coding, feature in CODING_FEATURES.items()}
T = TypeVar("T")
_ESTIMATE_LEVEL = 1  # zstd level of the planes estimate a rans stream is compared with

_ALLOWED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "dcr_value_codings", default=frozenset((PLANES,))
)


@contextlib.contextmanager
def allowed_codings(features: Iterable[str]) -> Iterator[None]:
    """Within the block (this thread, or this context), :func:`encode_values` may use the
    value codings of ``features`` (e.g. ``("values-rans",)``) besides ``planes``.

    Features that name no value coding are ignored (a writer passes all its features)."""
    codings = frozenset((PLANES, *(FEATURE_CODINGS[f] for f in features if f in FEATURE_CODINGS)))
    token = _ALLOWED.set(codings)
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def within_codings(features: Iterable[str], items: Iterable[T]) -> Iterator[T]:
    """Iterate ``items`` with :func:`allowed_codings` of ``features`` active while each item
    is produced (not while the caller handles it): a writer wraps its encoding generator
    (``for x in within_codings(self.features, encode_stream(...))``) without re-indenting."""
    iterator = iter(items)
    while True:
        with allowed_codings(features):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


def writer_features(features: Iterable[str]) -> frozenset[str]:
    """Check the codec features a writer is allowed (FORMAT.md §12): each must name a coding
    of this module (today ``values-rans``); raises :class:`ArgumentError` otherwise."""
    chosen = frozenset(features)
    unknown = sorted(chosen - set(FEATURE_CODINGS))
    if unknown:
        raise ArgumentError(
            f"writer features {unknown} are not codec features; "
            f"use any of {sorted(FEATURE_CODINGS)}"
        )
    return chosen


def features_for(codings: Iterable[str | None]) -> tuple[str, ...]:
    """The sorted ``required_features`` that streams of ``codings`` need (for a manifest)."""
    return tuple(sorted({CODING_FEATURES[c] for c in codings if c in CODING_FEATURES}))


def encode_values(bits: np.ndarray, *, codings: Iterable[str] | None = None) -> tuple[str, bytes]:
    """Encode an unsigned integer array (the exact bits); returns (coding, stream).

    ``codings``: the codings allowed (default: those of the current :func:`allowed_codings`
    block, else ``planes`` alone). With ``rans`` allowed, the rANS stream is kept when it is
    at most half the raw planes, or else smaller than the raw planes and than the planes
    compressed at zstd level 1 (FORMAT.md §7.4).
    """
    allowed = _ALLOWED.get() if codings is None else frozenset(codings)
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
