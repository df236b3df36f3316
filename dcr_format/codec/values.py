"""Value streams: the exact bits of changed (or all) elements, split into byte planes.

``planes``: for ``n`` values of ``w`` bytes, ``w`` planes of ``n`` bytes each, the
most significant byte of every value first. High bytes of XOR deltas and of
neighbouring weights repeat, so the shard's zstd frame packs them tightly.
"""

from __future__ import annotations

import numpy as np

from dcr_format.codec.dtypes import UNSIGNED_NP
from dcr_format.errors import ValuesError

PLANES = "planes"
VALUE_CODINGS = (PLANES,)


def encode_values(bits: np.ndarray) -> tuple[str, bytes]:
    """Encode an unsigned integer array (the exact bits) as byte planes."""
    width = bits.dtype.itemsize
    as_bytes = np.ascontiguousarray(bits, dtype=UNSIGNED_NP[width]).view(np.uint8)
    planes = as_bytes.reshape(-1, width)[:, ::-1].T
    return PLANES, np.ascontiguousarray(planes).tobytes()


def decode_values(coding: str, data: bytes | memoryview, *, count: int, width: int) -> np.ndarray:
    """Decode a value stream into ``count`` unsigned integers of ``width`` bytes."""
    if coding != PLANES:
        raise ValuesError(f"unknown value coding {coding!r}; upgrade dcr-format")
    if width not in UNSIGNED_NP:
        raise ValuesError(f"value width {width} is not one of 1, 2, 4, 8")
    if len(data) != count * width:
        raise ValuesError(
            f"value stream holds {len(data)} bytes, expected {count} values of {width} bytes"
        )
    planes = np.frombuffer(data, dtype=np.uint8).reshape(width, count)
    # np.array copies: for width 1 a contiguous view would alias the (read-only) input
    return np.array(planes[::-1].T, order="C").view(UNSIGNED_NP[width]).reshape(count)
