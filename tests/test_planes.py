"""Byte planes (FORMAT.md §7.1): the fast 2-byte path and the transpose path give the
layout the spec describes, for every width, and join back to the same values."""

from __future__ import annotations

import numpy as np
import pytest

from dcr_format.codings.planes import from_planes, to_planes

UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def reference_planes(values: np.ndarray) -> bytes:
    """Plane j holds byte (w - 1 - j) of every value: most significant first."""
    width = values.dtype.itemsize
    as_int = [int(v) for v in values.view(UNSIGNED[width])]
    return b"".join(
        bytes((v >> (8 * (width - 1 - j))) & 0xFF for v in as_int) for j in range(width)
    )


def test_the_layout_is_most_significant_plane_first():
    values = np.array([0x1234, 0xABCD, 0x00FF], dtype=np.uint16)
    assert to_planes(values) == bytes([0x12, 0xAB, 0x00, 0x34, 0xCD, 0xFF])


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 7, 1000])
def test_planes_round_trip_every_width(width, count):
    rng = np.random.default_rng(width * 1000 + count)
    values = rng.integers(0, np.iinfo(UNSIGNED[width]).max, count, UNSIGNED[width], endpoint=True)
    data = to_planes(values)
    assert data == reference_planes(values)
    back = from_planes(data, count, width)
    assert back.dtype == UNSIGNED[width] and np.array_equal(back, values)
    assert back.flags.writeable and back.flags.c_contiguous


def test_signed_and_strided_inputs_are_read_as_their_bits():
    signed = np.array([-1, 5, -32768, 7], dtype=np.int16)
    assert to_planes(signed[::2]) == reference_planes(np.ascontiguousarray(signed[::2]))


def test_joined_values_do_not_alias_the_stream():
    data = bytes(range(8))
    for width in (1, 2):
        out = from_planes(memoryview(data), 8 // width, width)
        out[0] = 0  # a read-only view would raise here
    assert data == bytes(range(8))
