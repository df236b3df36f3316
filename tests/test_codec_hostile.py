"""Hostile bytes: every malformed stream, shard or dtype is refused with a named error."""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard

from dcr_format.codings import positions as pos_codec
from dcr_format.codings.values import decode_values
from dcr_format.delta.delta import encode_tensor
from dcr_format.delta.fingerprint import tensor_fingerprint
from dcr_format.errors import (
    DcrError,
    PositionsError,
    SchemaError,
    ShardError,
    UnsupportedDtypeError,
    ValuesError,
)
from dcr_format.format.dtypes import bits_view, info_for
from dcr_format.format.names import PLANES, RANGES, RICE
from dcr_format.format.shard import (
    MAX_HEADER_BYTES,
    compress,
    decode_shard,
    decompress,
    encode_shard,
    pack_streams,
    unpack_streams,
)


def refused(error: type[Exception], call, *args, **kwargs) -> Exception:
    """Assert ``call`` raises exactly ``error`` (a DcrError), and return it."""
    with pytest.raises(DcrError) as info:
        call(*args, **kwargs)
    assert type(info.value) is error, f"got {type(info.value).__name__}: {info.value}"
    return info.value


# --- crafted position streams ---------------------------------------------------------


def rice_stream(gaps: list[int], k: int, *, count: int | None = None) -> bytes:
    """A rice stream of exactly these zero-based gaps (no validation: may be hostile)."""
    unary_bits: list[int] = []
    rem_bits: list[int] = []
    for gap in gaps:
        unary_bits += [0] * (gap >> k) + [1]
        rem_bits += [(gap >> s) & 1 for s in range(k - 1, -1, -1)]
    unary = np.packbits(np.array(unary_bits, dtype=np.uint8)).tobytes()
    rem = np.packbits(np.array(rem_bits, dtype=np.uint8)).tobytes()
    header = struct.pack("<BQQ", k, len(gaps) if count is None else count, len(unary))
    return header + unary + rem


def ranges_stream(gaps: list[int], lengths_m1: list[int], gap_w: int = 8, len_w: int = 8) -> bytes:
    header = struct.pack("<BBQ", gap_w, len_w, len(gaps))
    return (
        header
        + np.array(gaps, dtype=np.uint64).astype(f"<u{gap_w}").tobytes()
        + np.array(lengths_m1, dtype=np.uint64).astype(f"<u{len_w}").tobytes()
    )


def test_crafted_streams_match_the_encoder():
    """The hand-built streams below use the real layout (so their refusals mean something)."""
    positions = np.array([3, 4, 5, 9, 40], dtype=np.int64)
    gaps = [3, 0, 0, 3, 30]
    k = pos_codec._best_rice_k(np.array(gaps, dtype=np.uint64))
    assert rice_stream(gaps, k) == pos_codec.encode_rice(positions)
    assert ranges_stream([3, 3, 30], [2, 0, 0], 1, 1) == pos_codec.encode_ranges(positions)
    for coding, data in (
        (RICE, rice_stream(gaps, 5)),
        (RANGES, ranges_stream([3, 3, 30], [2, 0, 0])),
    ):
        got = pos_codec.decode_positions(coding, data, count=5, numel=41)
        assert got.tolist() == positions.tolist()


VALID = np.array([0, 1, 2, 7, 100, 101, 999], dtype=np.int64)


@pytest.mark.parametrize("coding", [RICE, RANGES])
def test_positions_truncated_header(coding):
    data = pos_codec.encode_positions(VALID, coding=coding)[1]
    for cut in (0, 1, 5, 9):
        refused(PositionsError, pos_codec.decode_positions, coding, data[:cut], count=7, numel=1000)


@pytest.mark.parametrize("coding", [RICE, RANGES])
def test_positions_truncated_body(coding):
    data = pos_codec.encode_positions(VALID, coding=coding)[1]
    header = 17 if coding == RICE else 10
    for cut in range(header, len(data)):
        refused(PositionsError, pos_codec.decode_positions, coding, data[:cut], count=7, numel=1000)


@pytest.mark.parametrize("coding", [RICE, RANGES])
@pytest.mark.parametrize("extra", [b"\x00", b"\x01", b"\xff" * 9])
def test_positions_trailing_bytes(coding, extra):
    data = pos_codec.encode_positions(VALID, coding=coding)[1]
    refused(PositionsError, pos_codec.decode_positions, coding, data + extra, count=7, numel=1000)


@pytest.mark.parametrize("coding", [RICE, RANGES])
def test_positions_declared_count_mismatch(coding):
    data = pos_codec.encode_positions(VALID, coding=coding)[1]
    for count in (0, 6, 8, 100):
        refused(PositionsError, pos_codec.decode_positions, coding, data, count=count, numel=1000)


def test_rice_header_count_differs_from_entry():
    data = rice_stream([0, 0, 0], 0, count=4)
    refused(PositionsError, pos_codec.decode_positions, RICE, data, count=3, numel=10)
    refused(PositionsError, pos_codec.decode_positions, RICE, data, count=4, numel=10)


@pytest.mark.parametrize("coding", [RICE, RANGES])
def test_positions_count_beyond_numel(coding):
    data = pos_codec.encode_positions(VALID, coding=coding)[1]
    refused(PositionsError, pos_codec.decode_positions, coding, data, count=7, numel=6)
    refused(PositionsError, pos_codec.decode_positions, coding, data, count=-1, numel=1000)


def test_positions_numel_beyond_int64():
    data = pos_codec.encode_positions(VALID, coding=RICE)[1]
    refused(PositionsError, pos_codec.decode_positions, RICE, data, count=7, numel=1 << 63)


def test_ranges_adjacent_or_overlapping_runs():
    # zero gap between runs: [0, 1] then [2]: the runs should have been one
    refused(
        PositionsError,
        pos_codec.decode_positions,
        RANGES,
        ranges_stream([0, 0], [1, 0], 1, 1),
        count=3,
        numel=10,
    )
    # overlapping: second run starts 2**64 - 1 after the first ends, wrapping onto it
    refused(
        PositionsError,
        pos_codec.decode_positions,
        RANGES,
        ranges_stream([5, 2**64 - 1], [3, 0]),
        count=5,
        numel=10,
    )


def test_ranges_run_length_overflow():
    # an 8-byte length-1 of 2**64 - 1 is a run of 2**64 that wraps to an empty run
    refused(
        PositionsError,
        pos_codec.decode_positions,
        RANGES,
        ranges_stream([0, 1], [2, 2**64 - 1]),
        count=3,
        numel=10,
    )


def test_positions_duplicates():
    # rice k=62: four gaps of 2**62 - 1 add 2**64, so the fifth position repeats the first
    data = rice_stream([0, 2**62 - 1, 2**62 - 1, 2**62 - 1, 2**62 - 1], 62)
    refused(PositionsError, pos_codec.decode_positions, RICE, data, count=5, numel=100)


def test_positions_unsorted_by_wrap_around():
    # gaps wrap past 2**64 to land back inside a 100-element tensor, out of order
    data = rice_stream([2**62 - 1] * 4 + [5], 62)
    refused(PositionsError, pos_codec.decode_positions, RICE, data, count=5, numel=100)


@pytest.mark.parametrize("coding", [RICE, RANGES])
def test_positions_out_of_range(coding):
    data = pos_codec.encode_positions(np.array([0, 5], dtype=np.int64), coding=coding)[1]
    assert pos_codec.decode_positions(coding, data, count=2, numel=6).tolist() == [0, 5]
    refused(PositionsError, pos_codec.decode_positions, coding, data, count=2, numel=5)


def test_ranges_gap_or_length_beyond_numel():
    refused(
        PositionsError,
        pos_codec.decode_positions,
        RANGES,
        ranges_stream([11], [0], 1, 1),
        count=1,
        numel=10,
    )
    refused(
        PositionsError,
        pos_codec.decode_positions,
        RANGES,
        ranges_stream([0], [10], 1, 1),
        count=10,
        numel=10,
    )


def test_rice_gap_overflow_large_quotient():
    # k=62, quotient 2: a gap of 2**63, far past a 100-element tensor
    data = rice_stream([2 << 62], 62)
    assert len(data) < 64  # the quotient costs bits, not memory
    refused(PositionsError, pos_codec.decode_positions, RICE, data, count=1, numel=100)
    data = rice_stream([0, 3 << 62], 62)
    refused(PositionsError, pos_codec.decode_positions, RICE, data, count=2, numel=2**62)


def test_ranges_gap_overflow_past_2_64():
    numel = 2**62
    gaps = [2**62 - 1, 2**62, 2**62, 2**62]  # each fits the tensor, the sum wraps to 3
    data = ranges_stream(gaps, [0, 0, 0, 0])
    refused(PositionsError, pos_codec.decode_positions, RANGES, data, count=4, numel=numel)


def test_positions_unknown_coding():
    data = pos_codec.encode_positions(VALID)[1]
    for coding in ("bitmap", "", "RICE"):
        refused(PositionsError, pos_codec.decode_positions, coding, data, count=7, numel=1000)


def test_rice_k_beyond_62():
    data = bytearray(rice_stream([1], 62))
    data[0] = 63
    refused(PositionsError, pos_codec.decode_positions, RICE, bytes(data), count=1, numel=100)
    data[0] = 255
    refused(PositionsError, pos_codec.decode_positions, RICE, bytes(data), count=1, numel=100)


def test_rice_malformed_unary():
    # count 0 but unary bytes present
    refused(
        PositionsError,
        pos_codec.decode_positions,
        RICE,
        struct.pack("<BQQ", 0, 0, 1) + b"\x80",
        count=0,
        numel=10,
    )
    # too few terminators for the count
    refused(
        PositionsError,
        pos_codec.decode_positions,
        RICE,
        struct.pack("<BQQ", 0, 3, 1) + b"\xc0",
        count=3,
        numel=10,
    )
    # a zero byte after the last terminator
    refused(
        PositionsError,
        pos_codec.decode_positions,
        RICE,
        struct.pack("<BQQ", 0, 1, 2) + b"\x80\x00",
        count=1,
        numel=10,
    )
    # huge declared unary length in a tiny stream
    refused(
        PositionsError,
        pos_codec.decode_positions,
        RICE,
        struct.pack("<BQQ", 0, 1, 2**64 - 1) + b"\x80",
        count=1,
        numel=10,
    )


def test_ranges_bad_widths_and_run_counts():
    good = ranges_stream([1], [0], 1, 1)
    for gap_w, len_w in ((3, 1), (1, 0), (16, 1), (0, 0)):
        data = struct.pack("<BB", gap_w, len_w) + good[2:]
        refused(PositionsError, pos_codec.decode_positions, RANGES, data, count=1, numel=10)
    # more runs than positions, and a run count the body cannot hold
    huge = struct.pack("<BBQ", 1, 1, 2**64 - 1) + b"\x00\x00"
    refused(PositionsError, pos_codec.decode_positions, RANGES, huge, count=1, numel=10)
    refused(PositionsError, pos_codec.decode_positions, RANGES, good, count=0, numel=10)


# --- values -----------------------------------------------------------------------------


def test_values_wrong_length():
    for data, count, width in ((b"\x00" * 7, 4, 2), (b"\x00" * 9, 4, 2), (b"", 1, 1), (b"x", 0, 1)):
        refused(ValuesError, decode_values, PLANES, data, count=count, width=width)


def test_values_unknown_coding():
    refused(ValuesError, decode_values, "zigzag", b"\x00\x00", count=1, width=2)


@pytest.mark.parametrize("width", [0, 3, 5, 16, -1])
def test_values_bad_width(width):
    refused(ValuesError, decode_values, PLANES, b"\x00" * 48, count=3, width=width)


# --- shard container ---------------------------------------------------------------------

STREAMS = {"a.positions": b"\x01\x02\x03", "a.values": b"xyz" * 5, "b.values": b""}


def blob_with_header(header: object, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def entry(begin: int, end: int, **override) -> dict:
    spec = {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}
    spec.update(override)
    return spec


META = {"format": "dcr-shard-1"}


def assert_blob_refused(blob: bytes) -> None:
    refused(ShardError, unpack_streams, blob)
    refused(ShardError, decode_shard, compress(blob), decoded_size=len(blob))


def test_a_valid_handmade_blob_passes():
    blob = blob_with_header({"__metadata__": META, "x": entry(0, 2), "y": entry(2, 5)}, b"ab123")
    assert {k: bytes(v) for k, v in unpack_streams(blob).items()} == {"x": b"ab", "y": b"123"}


@pytest.mark.parametrize("stored", [b"", b"hello world, not zstd", b"\x28\xb5\x2f", b"\x00" * 64])
def test_shard_not_zstd(stored):
    refused(ShardError, decode_shard, stored, decoded_size=64)


def test_shard_truncated_frame():
    stored, size = encode_shard(STREAMS)
    for cut in (len(stored) - 1, len(stored) // 2, 5):
        refused(ShardError, decode_shard, stored[:cut], decoded_size=size)


def test_shard_frame_without_content_size():
    blob = pack_streams(STREAMS)
    stored = zstandard.ZstdCompressor(write_content_size=False).compress(blob)
    refused(ShardError, decode_shard, stored, decoded_size=len(blob))


@pytest.mark.parametrize("delta", [-1, 1, -8, 1 << 20])
def test_shard_content_size_differs_from_declared(delta):
    stored, size = encode_shard(STREAMS)
    refused(ShardError, decode_shard, stored, decoded_size=size + delta)


def _zero_bomb(size: int) -> bytes:
    """A frame of ``size`` zero bytes, built in chunks so the test never holds ``size``."""
    compressor = zstandard.ZstdCompressor(write_content_size=True).compressobj(size=size)
    chunk = bytes(1 << 20)
    parts = [compressor.compress(chunk) for _ in range(size >> 20)]
    return b"".join([*parts, compressor.flush()])


def _peak_bytes(call) -> int:
    tracemalloc.start()
    try:
        call()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def test_shard_zstd_bomb_fails_fast_without_allocating():
    bomb = _zero_bomb(100 << 20)
    assert zstandard.frame_content_size(bomb) == 100 << 20 and len(bomb) < 64 << 10

    def declared_small():
        refused(ShardError, decode_shard, bomb, decoded_size=1024)

    assert _peak_bytes(declared_small) < 4 << 20

    # a lying frame header: content size patched to 1 KiB over 100 MB of blocks
    params = zstandard.get_frame_parameters(bomb)
    assert params.content_size == 100 << 20 and not params.has_checksum
    assert bomb[4] >> 6 == 2  # 4-byte frame content size field, after a window descriptor
    lying = bomb[:6] + struct.pack("<I", 1024) + bomb[10:]
    assert zstandard.frame_content_size(lying) == 1024

    def lying_header():
        refused(ShardError, decode_shard, lying, decoded_size=1024)

    assert _peak_bytes(lying_header) < 4 << 20


@pytest.mark.parametrize("extra", [b"\x00", b"garbage", "frame"])
def test_shard_trailing_bytes_after_frame(extra):
    stored, size = encode_shard(STREAMS)
    tail = stored if extra == "frame" else extra
    refused(ShardError, decode_shard, stored + tail, decoded_size=size)
    refused(ShardError, decompress, stored + tail, decoded_size=size)


def test_shard_shorter_than_length_prefix():
    for blob in (b"", b"\x08\x00\x00"):
        assert_blob_refused(blob)


def test_shard_header_length_beyond_buffer():
    blob = blob_with_header({"__metadata__": META})
    too_long = struct.pack("<Q", len(blob)) + blob[8:]
    assert_blob_refused(too_long)
    assert_blob_refused(struct.pack("<Q", 2**64 - 8) + blob[8:])


def test_shard_unaligned_header_length():
    text = json.dumps({"__metadata__": META}).encode() + b"   "
    assert len(text) % 8
    assert_blob_refused(struct.pack("<Q", len(text)) + text)


def test_shard_huge_header_length():
    # the buffer is large enough to hold it: only the 64 MiB cap refuses it
    header_len = MAX_HEADER_BYTES + 8
    blob = struct.pack("<Q", header_len) + b" " * (header_len + 8)
    refused(ShardError, unpack_streams, blob)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe\xfd\xfc",  # not UTF-8 (and a bogus UTF-16 byte order mark)
        b'{"\xff": 1}',  # not UTF-8
        b"{not json",
        b'{"__metadata__": {"format": "dcr-shard-1"}} trailing',
        b"[" * 100_000,  # nested beyond the parser's recursion limit
    ],
)
def test_shard_header_not_json(raw):
    assert_blob_refused(blob_with_header(None, raw=raw))


@pytest.mark.parametrize("header", [[], "text", 5, None, [{"__metadata__": META}]])
def test_shard_header_not_an_object(header):
    assert_blob_refused(blob_with_header(header))


@pytest.mark.parametrize(
    "metadata",
    ["absent", None, "dcr-shard-1", {}, {"format": "dcr-shard-2"}, {"format": 1}, []],
)
def test_shard_missing_or_wrong_metadata(metadata):
    header: dict = {"x": entry(0, 2)}
    if metadata != "absent":
        header["__metadata__"] = metadata
    assert_blob_refused(blob_with_header(header, b"ab"))


@pytest.mark.parametrize(
    "spec",
    [
        entry(0, 4, dtype="F32"),
        entry(0, 4, dtype="u8"),
        entry(0, 4, shape=[2, 2]),
        entry(0, 4, shape=[3]),
        entry(0, 4, shape=[]),
        entry(0, 4, shape=[4.0]),
        entry(0, 4, shape=[True]),
        entry(0, 4, shape=4),
        entry(0, 4, data_offsets=[0, 4, 4]),
        entry(0, 4, data_offsets=[0.0, 4]),
        entry(0, 4, data_offsets="0,4"),
        {"dtype": "U8", "shape": [4]},
        {"dtype": "U8", "data_offsets": [0, 4]},
        "U8",
        None,
    ],
)
def test_shard_malformed_stream_entry(spec):
    assert_blob_refused(blob_with_header({"__metadata__": META, "x": spec}, b"abcd"))


@pytest.mark.parametrize(
    "streams",
    [
        {"x": entry(0, 5)},  # end past the data
        {"x": entry(-1, 4)},  # begin before the data
        {"x": entry(3, 1, shape=[-2])},  # reversed
        {"x": entry(0, 2**64)},
        {"x": entry(0, 3), "y": entry(2, 4)},  # overlapping
        {"x": entry(0, 4), "y": entry(0, 4)},  # the same bytes twice
        {"x": entry(0, 1), "y": entry(2, 4)},  # a hole
        {"x": entry(1, 4)},  # a hole at the start
        {"x": entry(0, 3)},  # a byte no stream covers
        {},  # no stream at all over 4 bytes
    ],
)
def test_shard_offsets_out_of_bounds_overlapping_or_not_covering(streams):
    assert_blob_refused(blob_with_header({"__metadata__": META, **streams}, b"abcd"))


def test_pack_streams_refuses_the_metadata_key():
    with pytest.raises(ValueError):
        pack_streams({"__metadata__": b""})


# --- dtypes ------------------------------------------------------------------------------

UNSUPPORTED = [torch.complex64, torch.complex128, torch.float8_e4m3fnuz] + [
    getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)
]


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
def test_unsupported_torch_dtype(dtype):
    error = refused(UnsupportedDtypeError, info_for, dtype)
    assert isinstance(error, TypeError)
    tensor = torch.zeros(4, dtype=dtype)
    refused(UnsupportedDtypeError, bits_view, tensor)
    refused(UnsupportedDtypeError, encode_tensor, tensor)
    refused(UnsupportedDtypeError, encode_tensor, tensor, tensor.clone())
    refused(UnsupportedDtypeError, tensor_fingerprint, tensor)


@pytest.mark.parametrize("name", ["float128", "complex64", "F32", "Float32", "", "uint16"])
def test_unknown_dtype_string(name):
    error = refused(SchemaError, info_for, name)
    assert isinstance(error, ValueError)
