"""Position streams decoded onto a device: the host parses, the device expands.

``rice``: the host does the entropy decoding (unary quotients, remainders) into
gaps, which travel in the narrowest integer width that holds them; the device
turns them into positions with a cumulative sum. ``ranges``: the host parses and
checks the runs (O(runs)), the device expands them into positions with the
range-expansion kernel. The parsing and its checks are the host codec's own
(:func:`~dcr_format.codings.positions.rice_gaps`,
:func:`~dcr_format.codings.positions.ranges_runs`; the stream is hostile input);
the checks that need the running sum of gaps run on the device before the
positions are returned. The result equals ``decode_positions`` bit for bit, and both
refuse the same streams with :class:`~dcr_format.errors.PositionsError`.

:func:`dcr_format.delta.delta.decode_delta` decodes an entry onto a device through
:func:`decode_positions_to` (a reader whose target lives on a GPU).
"""

from __future__ import annotations

import numpy as np
import torch

from dcr_format.codings.positions import (
    decode_positions,
    ranges_runs,
    rice_gaps,
)
from dcr_format.delta.backend import to_device
from dcr_format.delta.backends import backend_on
from dcr_format.errors import PositionsError
from dcr_format.format.names import RANGES, RICE


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
    backend = backend_on(device)
    if coding == RANGES:
        starts, lengths = ranges_runs(data, count=count, numel=numel)
        return backend.expand_ranges(
            to_device(torch.from_numpy(starts), device),
            to_device(torch.from_numpy(lengths), device),
            count,
        )
    gaps = rice_gaps(data, count=count, numel=numel)
    if gaps.size == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if int(gaps.max()) >= numel:  # p >= gap: out of range (and gap + 1 fits in int64)
        raise PositionsError(
            f"a rice gap of {int(gaps.max())} is out of range for a tensor of {numel} elements"
        )
    positions = backend.prefix_positions(to_device(torch.from_numpy(_narrow(gaps)), device))
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


__all__ = [
    "decode_positions_split",
    "decode_positions_to",
]
