"""Position streams decoded onto a device: the host parses, the device expands.

``rice``: the host does the entropy decoding (unary quotients, remainders) into
gaps, which travel in the narrowest integer width that holds them; the device
turns them into positions with a cumulative sum. ``ranges``: the host parses and
checks the runs (O(runs)), the device expands them into positions with the
range-expansion kernel. Every check of :mod:`dcr_format.codec.positions` is
kept (the stream is hostile input): O(runs) and O(count) checks on the host,
the ones that need the running sum of gaps on the device, before the positions
are returned. The result equals ``decode_positions`` bit for bit, and both
refuse the same streams with :class:`~dcr_format.errors.PositionsError`.

:func:`decode_delta_to` is :func:`dcr_format.codec.delta.decode_delta` with the
change decoded straight onto a device (a reader whose target lives on a GPU).
"""

from __future__ import annotations

import numpy as np
import torch

from dcr_format.codec.delta import FULL, DecodedDelta
from dcr_format.codec.dtypes import DtypeInfo, numpy_to_bits
from dcr_format.codec.positions import (
    _RANGES_HEADER,
    _RICE_HEADER,
    _WIDTHS,
    MAX_RICE_K,
    RANGES,
    RICE,
    decode_positions,
)
from dcr_format.codec.values import decode_values
from dcr_format.cuda import dispatch
from dcr_format.errors import PositionsError


def rice_gaps(data: bytes | memoryview, *, count: int, numel: int) -> np.ndarray:
    """The zero-based gaps of a ``rice`` stream (uint64), checked as ``decode_rice`` does."""
    buf = memoryview(data)
    if len(buf) < _RICE_HEADER.size:
        raise PositionsError("rice positions stream is truncated (no header); the shard is corrupt")
    k, declared, unary_len = _RICE_HEADER.unpack_from(buf)
    if declared != count:
        raise PositionsError(
            f"rice positions stream holds {declared} positions but the entry declares {count}"
        )
    if k > MAX_RICE_K:
        raise PositionsError(f"rice parameter k={k} exceeds {MAX_RICE_K}; the shard is corrupt")
    body = buf[_RICE_HEADER.size :]
    rem_len = (count * k + 7) // 8
    if unary_len > len(body) or len(body) - unary_len != rem_len:
        raise PositionsError(
            "rice positions stream sizes do not add up (truncated or padded); the shard is corrupt"
        )
    if count == 0:
        if unary_len:
            raise PositionsError("rice positions stream has bits but declares no positions")
        return np.empty(0, dtype=np.uint64)
    if unary_len * 8 < count:
        raise PositionsError("rice unary stream is too short for the declared count")
    unary_bits = np.unpackbits(np.frombuffer(body[:unary_len], dtype=np.uint8))
    ones = np.flatnonzero(unary_bits)
    if ones.size != count:
        raise PositionsError(
            f"rice unary stream holds {ones.size} terminators, expected {count}; shard is corrupt"
        )
    if unary_len != int(ones[-1]) // 8 + 1:
        raise PositionsError("rice unary stream has trailing bytes after the last position")
    quotients = np.diff(ones, prepend=-1).astype(np.uint64) - np.uint64(1)
    if not k:
        return quotients
    if int(quotients.max()) > (numel >> k):
        raise PositionsError("rice positions gap exceeds the tensor size; the shard is corrupt")
    rem_bits = np.unpackbits(np.frombuffer(body[unary_len:], dtype=np.uint8))[: count * k]
    weights = np.uint64(1) << np.arange(k - 1, -1, -1, dtype=np.uint64)
    remainders = (rem_bits.reshape(count, k).astype(np.uint64) * weights).sum(
        axis=1, dtype=np.uint64
    )
    return (quotients << np.uint64(k)) | remainders


def ranges_runs(
    data: bytes | memoryview, *, count: int, numel: int
) -> tuple[np.ndarray, np.ndarray]:
    """Run starts and lengths (int64) of a ``ranges`` stream, checked as ``decode_ranges`` does."""
    buf = memoryview(data)
    if len(buf) < _RANGES_HEADER.size:
        raise PositionsError("ranges positions stream is truncated (no header); shard is corrupt")
    gap_w, len_w, runs = _RANGES_HEADER.unpack_from(buf)
    if gap_w not in _WIDTHS or len_w not in _WIDTHS:
        raise PositionsError(f"ranges stream declares widths {gap_w}/{len_w}; expected 1, 2, 4, 8")
    body = buf[_RANGES_HEADER.size :]
    if runs > count or len(body) != runs * (gap_w + len_w):
        raise PositionsError("ranges positions stream size does not match its run count")
    gaps = np.frombuffer(body[: runs * gap_w], dtype=f"<u{gap_w}").astype(np.uint64)
    lengths = np.frombuffer(body[runs * gap_w :], dtype=f"<u{len_w}").astype(np.uint64)
    lengths += np.uint64(1)
    if runs and int(lengths.min()) == 0:
        raise PositionsError("ranges stream has a run length that overflows; shard is corrupt")
    if runs and (int(gaps.max()) > numel or int(lengths.max()) > numel):
        raise PositionsError("ranges stream has a run beyond the tensor size; shard is corrupt")
    if runs > 1 and not bool(np.all(gaps[1:] > 0)):
        raise PositionsError("ranges stream has adjacent or overlapping runs; shard is corrupt")
    if int(lengths.sum(dtype=np.uint64)) != count:
        raise PositionsError(f"ranges stream covers a different number of positions than {count}")
    if runs == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    ends = np.cumsum(gaps + lengths, dtype=np.uint64)
    if runs > 1 and not bool(np.all(ends[1:] > ends[:-1])):
        raise PositionsError("ranges stream overflows; the shard is corrupt")
    if int(ends[-1]) > numel:
        raise PositionsError(f"ranges stream reaches past the tensor's {numel} elements")
    return (ends - lengths).view(np.int64), lengths.view(np.int64)


def _narrow(gaps: np.ndarray) -> np.ndarray:
    """The gaps (all below 2^63) in the narrowest integer dtype torch can take from numpy."""
    top = int(gaps.max()) if gaps.size else 0
    for limit, dtype in ((1 << 8, np.uint8), (1 << 15, np.int16), (1 << 31, np.int32)):
        if top < limit:
            return gaps.astype(dtype)
    return gaps.astype(np.int64)


def decode_positions_split(
    coding: str, data: bytes | memoryview, *, count: int, numel: int, device: torch.device | str
) -> torch.Tensor:
    """Decode a position stream into int64 positions on ``device``: host parse, device expand."""
    if coding not in (RICE, RANGES):
        raise PositionsError(f"unknown position coding {coding!r}; upgrade dcr-format")
    if count < 0 or count > numel or numel >= 1 << 63:
        raise PositionsError(f"entry declares {count} changed positions for {numel} elements")
    device = torch.device(device)
    if coding == RANGES:
        starts, lengths = ranges_runs(data, count=count, numel=numel)
        return dispatch.expand_ranges(
            dispatch.to_device(torch.from_numpy(starts), device),
            dispatch.to_device(torch.from_numpy(lengths), device),
            count,
        )
    gaps = rice_gaps(data, count=count, numel=numel)
    if gaps.size == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if int(gaps.max()) >= numel:  # p >= gap: out of range (and gap + 1 fits in int64)
        raise PositionsError(
            f"a rice gap of {int(gaps.max())} is out of range for a tensor of {numel} elements"
        )
    positions = dispatch.prefix_positions(
        dispatch.to_device(torch.from_numpy(_narrow(gaps)), device)
    )
    # every step is in [1, numel] < 2^63, so a running sum past 2^63 wraps negative: one check
    # of order and of the last position covers duplicates, wrap-around and range
    wrapped = positions.numel() > 1 and bool((positions[1:] <= positions[:-1]).any())
    if wrapped:
        raise PositionsError("positions are not strictly increasing; the shard is corrupt")
    last = int(positions[-1])
    if last >= numel:
        raise PositionsError(f"position {last} is out of range for a tensor of {numel} elements")
    return positions


def decode_positions_to(
    coding: str, data: bytes | memoryview, *, count: int, numel: int, device: torch.device | str
) -> torch.Tensor:
    """Positions on ``device``: decoded on the host for CPU, split host/device otherwise."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.from_numpy(decode_positions(coding, data, count=count, numel=numel))
    return decode_positions_split(coding, data, count=count, numel=numel, device=device)


def decode_delta_to(
    device: torch.device | str,
    op: str,
    info: DtypeInfo,
    numel: int,
    changed: int,
    *,
    positions: tuple[str, bytes | memoryview] | None,
    values: tuple[str, bytes | memoryview] | None,
) -> DecodedDelta:
    """:func:`~dcr_format.codec.delta.decode_delta` with positions and values on ``device``.

    The value planes are decoded on the host and copied over (pinned, asynchronously
    on CUDA); positions are expanded on the device (see the module docstring).
    """
    device = torch.device(device)
    if changed == 0:
        empty = torch.empty(0, dtype=info.bits_dtype, device=device)
        return DecodedDelta(op, torch.empty(0, dtype=torch.int64, device=device), empty)
    assert values is not None
    host = numpy_to_bits(decode_values(values[0], values[1], count=changed, width=info.width), info)
    vals = dispatch.to_device(host, device)
    if op == FULL:
        return DecodedDelta(op, None, vals)
    assert positions is not None
    pos = decode_positions_to(positions[0], positions[1], count=changed, numel=numel, device=device)
    return DecodedDelta(op, pos, vals)


__all__ = [
    "decode_delta_to",
    "decode_positions_split",
    "decode_positions_to",
    "ranges_runs",
    "rice_gaps",
]
