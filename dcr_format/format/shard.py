"""The shard container: a safetensors blob of byte streams, as one zstd frame.

Layout of the decoded blob (a valid safetensors file, spec/FORMAT.md "Shards"):

    u64 little-endian N | N bytes of JSON header, space-padded to a multiple of 8 | data

The header maps each stream key to ``{"dtype": "U8", "shape": [n],
"data_offsets": [begin, end]}`` plus ``"__metadata__": {"format": "dcr-shard-1"}``.
Streams are laid out in key order, contiguously, covering the data exactly.
The encoder writes keys sorted and the JSON compact, so output is deterministic.

Decoding never inflates more than the manifest's entries can need: given the
streams its entries name (:func:`stream_limits`), :func:`decode_shard` refuses a
declared decoded size over their bound before inflating anything, and reads and
checks the header through a streaming decompressor before inflating the rest.
:class:`~dcr_format.format.budget.DecodeBudget` caps what parallel decoders hold.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping

import zstandard

from dcr_format.errors import FormatError, ShardError
from dcr_format.format.jsonscan import scan

SHARD_FORMAT = "dcr-shard-1"
ZSTD_LEVEL = 3
ZSTD_MIN_LEVEL = -(1 << 17)  # zstd's fastest (ZSTD_minCLevel); level 0 stands for its default
ZSTD_MAX_LEVEL = zstandard.MAX_COMPRESSION_LEVEL  # its smallest (22)
MAX_HEADER_BYTES = 64 << 20  # a header beyond this is hostile, whatever the shard size
MAX_UNREFERENCED_BYTES = 1 << 20
"""Room a shard may hold beyond what its manifest's entries need: streams no entry names
(FORMAT.md §4.3 rule 4), their header members, and further ``__metadata__`` members."""
HEADER_BASE_BYTES = 64  # the 8-byte length, ``{"__metadata__":{"format":"dcr-shard-1"}}``, padding
HEADER_MEMBER_BYTES = 112  # one stream's member, its key aside (three 20-digit integers)
_HEADER_DEPTH = 3  # header object, stream member, shape / data_offsets array
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


def frame_size(stored: bytes | memoryview, *, what: str, error: type[FormatError]) -> int:
    """The content size a zstd frame declares in its header (-1: none), read before anything
    is inflated; ``error`` (naming the object ``what``) where ``stored`` is no zstd frame."""
    try:
        return int(zstandard.frame_content_size(stored))
    except zstandard.ZstdError as exc:
        raise error(f"{what} is not a zstd frame ({exc}); the object is corrupt") from None


def inflate(stored: bytes | memoryview, size: int, *, what: str, error: type[FormatError]) -> bytes:
    """The ``size`` bytes a zstd frame that declares that size decodes to (no more are
    inflated, trailing bytes are refused); ``error`` (naming the object ``what``) where it
    does not decompress to them."""
    try:
        blob = zstandard.ZstdDecompressor().decompress(
            stored, max_output_size=size, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise error(f"{what} does not decompress ({exc}); the object is corrupt") from None
    if len(blob) != size:
        raise error(f"{what} decoded to {len(blob)} bytes, not the {size} it declares")
    return blob


def _check_frame(stored: bytes | memoryview, decoded_size: int) -> None:
    """The frame's declared content size MUST equal ``decoded_size`` (checked unallocated)."""
    declared = frame_size(stored, what="shard", error=ShardError)
    if declared != decoded_size:
        raise ShardError(
            f"shard frame declares {declared} decoded bytes, the manifest {decoded_size}; "
            "the object is corrupt or hostile"
        )


def decompress(stored: bytes | memoryview, *, decoded_size: int) -> bytes:
    """Decompress one frame whose content size MUST equal ``decoded_size``.

    The declared size is checked against the frame header before any output is
    allocated, so a zstd bomb costs nothing; trailing bytes are refused.
    """
    _check_frame(stored, decoded_size)
    return inflate(stored, decoded_size, what="shard", error=ShardError)


def _parse_header(text: bytes, data_len: int) -> list[tuple[int, int, str]]:
    """Check a shard header against ``data_len`` bytes of data: (begin, end, key) spans,
    sorted, contiguous and covering the data exactly."""
    problem = scan(text, max_depth=_HEADER_DEPTH)
    if problem is not None:
        raise ShardError(f"shard header is refused unparsed: {problem}; the shard is corrupt")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, or a huge integer
        problem = str(exc)[:200]  # raised below, so the error keeps nothing of the header
    if problem is not None:
        raise ShardError(f"shard header is not JSON ({problem!r})")
    if not isinstance(header, dict):
        raise ShardError("shard header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or metadata.get("format") != SHARD_FORMAT:
        raise ShardError(f"shard header does not declare format {SHARD_FORMAT!r}")
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
            raise ShardError(f"shard stream {key[:256]!r} has a malformed header entry")
        begin, end = spec["data_offsets"]
        if not 0 <= begin <= end <= data_len or end - begin != spec["shape"][0]:
            raise ShardError(
                f"shard stream {key[:256]!r} has offsets outside the data or a wrong shape"
            )
        spans.append((begin, end, key))
    spans.sort()
    cursor = 0
    for begin, end, key in spans:
        if begin != cursor:
            raise ShardError(f"shard stream {key[:256]!r} overlaps or leaves a hole before it")
        cursor = end
    if cursor != data_len:
        raise ShardError("shard data has bytes no stream covers")
    return spans


def _header_length(buf: memoryview | bytes, blob_len: int, max_header: int) -> int:
    (header_len,) = _LEN.unpack_from(buf)
    if header_len > max_header or header_len > blob_len - _LEN.size or header_len % 8:
        raise ShardError(
            f"shard header length {header_len} is out of bounds (at most {max_header}) "
            "or unaligned; the shard is corrupt or hostile"
        )
    return int(header_len)


def unpack_streams(blob: bytes | memoryview) -> dict[str, memoryview]:
    """Parse a decoded shard blob strictly; streams are zero-copy views into ``blob``."""
    buf = memoryview(blob)
    if len(buf) < _LEN.size:
        raise ShardError("shard is shorter than its 8-byte header length")
    header_len = _header_length(buf, len(buf), MAX_HEADER_BYTES)
    data = buf[_LEN.size + header_len :]
    spans = _parse_header(bytes(buf[_LEN.size : _LEN.size + header_len]), len(data))
    return {key: data[begin:end] for begin, end, key in spans}


def header_allowance(keys: Iterable[str]) -> int:
    """The most bytes a canonical shard header (with its 8-byte length) takes for ``keys``:
    every character of a key may need a 12-character ``\\u`` escape pair."""
    return HEADER_BASE_BYTES + sum(HEADER_MEMBER_BYTES + 12 * len(key) for key in keys)


def shard_decoded_bound(limits: Mapping[str, int]) -> int:
    """The largest ``decoded_size`` a shard holding streams within ``limits`` may declare:
    the header, the streams, and :data:`MAX_UNREFERENCED_BYTES`."""
    return header_allowance(limits) + sum(limits.values()) + MAX_UNREFERENCED_BYTES


def _read_prefix(stored: bytes | memoryview, size: int) -> bytes:
    """The first ``size`` decoded bytes of a frame, inflating no more than that (a streaming
    decompressor; the rest of the frame is not read)."""
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(stored) as reader:
            while len(out) < size:
                chunk = reader.read(size - len(out))
                if not chunk:
                    break
                out += chunk
    except zstandard.ZstdError as exc:
        raise ShardError(f"shard does not decompress ({exc}); the object is corrupt") from None
    if len(out) < size:
        raise ShardError(f"shard decoded to fewer than {size} bytes; the object is corrupt")
    return bytes(out)


def decode_shard(
    stored: bytes | memoryview,
    *,
    decoded_size: int,
    limits: Mapping[str, int] | None = None,
) -> dict[str, memoryview]:
    """Streams of a stored shard (integrity of ``stored`` is checked by the caller).

    ``limits`` maps every stream key the manifest's entries name in this shard to the most
    bytes it may hold (:func:`stream_limits`). With it, before inflating: a
    ``decoded_size`` over :func:`shard_decoded_bound` is refused; then the header alone is
    inflated (streaming) and checked, and a named stream that is missing or over its limit
    is refused. Only then is the frame inflated, into one buffer of ``decoded_size`` bytes.
    Without ``limits`` (tools that read any shard) only the header-first check applies.
    """
    _check_frame(stored, decoded_size)
    max_header = MAX_HEADER_BYTES
    if limits is not None:
        bound = shard_decoded_bound(limits)
        if decoded_size > bound:
            raise ShardError(
                f"shard declares {decoded_size} decoded bytes but its manifest's entries need "
                f"at most {bound}; the shard or manifest is corrupt or hostile"
            )
        max_header = min(max_header, header_allowance(limits) + MAX_UNREFERENCED_BYTES)
    if decoded_size < _LEN.size:
        raise ShardError("shard is shorter than its 8-byte header length")
    header_len = _header_length(_read_prefix(stored, _LEN.size), decoded_size, max_header)
    text = _read_prefix(stored, _LEN.size + header_len)[_LEN.size :]
    data_len = decoded_size - _LEN.size - header_len
    spans = _parse_header(text, data_len)
    if limits is not None:
        sizes = {key: end - begin for begin, end, key in spans}
        for key, limit in limits.items():
            size = sizes.get(key)
            if size is None:
                raise ShardError(
                    f"shard lacks stream {key[:256]!r} that its manifest names; "
                    "the shard or manifest is corrupt"
                )
            if size > limit:
                raise ShardError(
                    f"shard stream {key[:256]!r} holds {size} bytes, more than the {limit} its "
                    "entry can need; the shard or manifest is corrupt or hostile"
                )
    blob = memoryview(decompress(stored, decoded_size=decoded_size))
    if blob[_LEN.size : _LEN.size + header_len] != text:  # one frame decodes one way
        raise ShardError("shard header changed between two reads; the object is corrupt")
    data = blob[_LEN.size + header_len :]
    return {key: data[begin:end] for begin, end, key in spans}
