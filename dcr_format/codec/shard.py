"""The shard container: a safetensors blob of byte streams, as one zstd frame.

Layout of the decoded blob (a valid safetensors file, spec/FORMAT.md "Shards"):

    u64 little-endian N | N bytes of JSON header, space-padded to a multiple of 8 | data

The header maps each stream key to ``{"dtype": "U8", "shape": [n],
"data_offsets": [begin, end]}`` plus ``"__metadata__": {"format": "dcr-shard-1"}``.
Streams are laid out in key order, contiguously, covering the data exactly.
The encoder writes keys sorted and the JSON compact, so output is deterministic.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import zstandard

from dcr_format.errors import ShardError

SHARD_FORMAT = "dcr-shard-1"
ZSTD_LEVEL = 3
MAX_HEADER_BYTES = 64 << 20  # a header beyond this is hostile, whatever the shard size
_LEN = struct.Struct("<Q")


def pack_streams(streams: Mapping[str, bytes]) -> bytes:
    """Lay byte streams out as a safetensors blob (uncompressed)."""
    header: dict[str, object] = {"__metadata__": {"format": SHARD_FORMAT}}
    offset = 0
    keys = sorted(streams)
    for key in keys:
        if key == "__metadata__":
            raise ValueError("stream key '__metadata__' is reserved")
        size = len(streams[key])
        header[key] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([_LEN.pack(len(text)), text, *(bytes(streams[k]) for k in keys)])


def compress(blob: bytes, *, level: int = ZSTD_LEVEL) -> bytes:
    """One zstd frame with the content size in its header (readers require it)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(blob)


def encode_shard(streams: Mapping[str, bytes], *, level: int = ZSTD_LEVEL) -> tuple[bytes, int]:
    """Stored bytes of a shard and its decoded size, for the manifest."""
    blob = pack_streams(streams)
    return compress(blob, level=level), len(blob)


def decompress(stored: bytes | memoryview, *, decoded_size: int) -> bytes:
    """Decompress one frame whose content size MUST equal ``decoded_size``.

    The declared size is checked against the frame header before any output is
    allocated, so a zstd bomb costs nothing; trailing bytes are refused.
    """
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise ShardError(f"shard is not a zstd frame ({exc}); the object is corrupt") from None
    if declared != decoded_size:
        raise ShardError(
            f"shard frame declares {declared} decoded bytes, the manifest {decoded_size}; "
            "the object is corrupt or hostile"
        )
    try:
        blob = zstandard.ZstdDecompressor().decompress(
            stored, max_output_size=decoded_size, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise ShardError(f"shard does not decompress ({exc}); the object is corrupt") from None
    if len(blob) != decoded_size:
        raise ShardError(f"shard decoded to {len(blob)} bytes, expected {decoded_size}")
    return blob


def unpack_streams(blob: bytes | memoryview) -> dict[str, memoryview]:
    """Parse a decoded shard blob strictly; streams are zero-copy views into ``blob``."""
    buf = memoryview(blob)
    if len(buf) < _LEN.size:
        raise ShardError("shard is shorter than its 8-byte header length")
    (header_len,) = _LEN.unpack_from(buf)
    if header_len > MAX_HEADER_BYTES or header_len > len(buf) - _LEN.size or header_len % 8:
        raise ShardError(f"shard header length {header_len} is out of bounds or unaligned")
    try:
        header = json.loads(bytes(buf[_LEN.size : _LEN.size + header_len]))
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, or a huge integer
        raise ShardError(f"shard header is not JSON ({exc!r})") from None
    if not isinstance(header, dict):
        raise ShardError("shard header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or metadata.get("format") != SHARD_FORMAT:
        raise ShardError(f"shard header does not declare format {SHARD_FORMAT!r}")
    data = buf[_LEN.size + header_len :]
    spans: list[tuple[int, int, str]] = []
    for key, spec in header.items():
        if not (
            isinstance(spec, dict)
            and spec.get("dtype") == "U8"
            and isinstance(spec.get("shape"), list)
            and len(spec["shape"]) == 1
            and isinstance(spec.get("data_offsets"), list)
            and len(spec["data_offsets"]) == 2
            and all(type(v) is int for v in (*spec["shape"], *spec["data_offsets"]))
        ):
            raise ShardError(f"shard stream {key!r} has a malformed header entry")
        begin, end = spec["data_offsets"]
        if not 0 <= begin <= end <= len(data) or end - begin != spec["shape"][0]:
            raise ShardError(f"shard stream {key!r} has offsets outside the data or a wrong shape")
        spans.append((begin, end, key))
    spans.sort()
    cursor = 0
    for begin, end, key in spans:
        if begin != cursor:
            raise ShardError(f"shard stream {key!r} overlaps or leaves a hole before it")
        cursor = end
    if cursor != len(data):
        raise ShardError("shard data has bytes no stream covers")
    return {key: data[begin:end] for begin, end, key in spans}


def decode_shard(stored: bytes | memoryview, *, decoded_size: int) -> dict[str, memoryview]:
    """Streams of a stored shard (integrity of ``stored`` is checked by the caller)."""
    return unpack_streams(decompress(stored, decoded_size=decoded_size))
