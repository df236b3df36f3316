"""Per-tensor deltas: choose an op, encode its streams, decode and apply them.

Ops (spec/FORMAT.md, "Ops"):

- ``xor``: positions of changed elements and ``old ^ new`` bits there. Smallest;
  the receiver must hold exactly the parent's bits.
- ``overwrite``: the same positions and the new bits. Safe to re-apply.
- ``full``: every element's bits, no positions.

Diffing and applying run in torch on the tensors' own device; stream coding runs
on the host over the compacted payload only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import zstandard

from dcr_format.codec.dtypes import DtypeInfo, bits_to_numpy, bits_view, info_for, numpy_to_bits
from dcr_format.codec.positions import decode_positions, encode_positions
from dcr_format.codec.values import decode_values, encode_values
from dcr_format.errors import TargetError

XOR = "xor"
OVERWRITE = "overwrite"
FULL = "full"
OPS = (XOR, OVERWRITE, FULL)

# Above this change rate the encoder also tries ``full`` and keeps the smaller.
FULL_CANDIDATE_RATE = 0.2


@dataclass(frozen=True)
class DecodedDelta:
    """One tensor's decoded change, ready to apply on the host (``positions`` None for full)."""

    op: str
    positions: torch.Tensor | None  # int64, strictly increasing
    values: torch.Tensor  # the dtype's integer bits view


@dataclass(frozen=True)
class EncodedTensor:
    """The streams of one tensor's entry, before they go into a shard."""

    op: str
    changed: int
    positions_coding: str | None
    positions: bytes | None
    values_coding: str | None
    values: bytes | None
    # the change as new bits (overwrite or full), to advance a writer's baseline
    advance: DecodedDelta | None = None

    @property
    def nbytes(self) -> int:
        """Encoded bytes before the shard's compression."""
        return len(self.positions or b"") + len(self.values or b"")


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices (sorted) where the bits of ``old`` and ``new`` differ."""
    return torch.nonzero(bits_view(old).reshape(-1) != bits_view(new).reshape(-1)).reshape(-1)


def _estimate(values: bytes) -> int:
    return len(zstandard.ZstdCompressor(level=1).compress(values))


def encode_tensor(
    new: torch.Tensor, old: torch.Tensor | None = None, *, op: str | None = None
) -> EncodedTensor:
    """Encode the change from ``old`` to ``new``.

    ``op=None`` chooses by size: ``full`` when there is no comparable ``old``
    (absent, other dtype or shape), else ``xor``, or ``full`` when the change rate
    is high and ``full`` encodes smaller. ``xor`` and ``overwrite`` need ``old``.
    """
    info_for(new.dtype)  # refuses dtypes the format cannot carry
    comparable = old is not None and old.dtype == new.dtype and old.shape == new.shape
    if op is not None and op not in OPS:
        raise ValueError(f"unknown op {op!r}; use one of {', '.join(OPS)}")
    if op in (XOR, OVERWRITE) and not comparable:
        raise ValueError(f"op {op!r} needs a baseline of the same dtype and shape")
    if not comparable or op == FULL:
        return _encode_full(new)
    assert old is not None
    new_bits = bits_view(new).reshape(-1)
    old_bits = bits_view(old).reshape(-1)
    positions = torch.nonzero(old_bits != new_bits).reshape(-1)
    changed = int(positions.numel())
    if changed == 0:
        return EncodedTensor(op or XOR, 0, None, None, None, None)
    new_values = new_bits[positions]
    picked = new_values if op == OVERWRITE else new_values ^ old_bits[positions]
    pos_coding, pos_bytes = encode_positions(positions.cpu().numpy())
    val_coding, val_bytes = encode_values(bits_to_numpy(picked))
    advance = DecodedDelta(OVERWRITE, positions, new_values)
    delta = EncodedTensor(op or XOR, changed, pos_coding, pos_bytes, val_coding, val_bytes, advance)
    if op is None and changed > FULL_CANDIDATE_RATE * new.numel():
        full = _encode_full(new)
        assert full.values is not None and val_bytes is not None
        if _estimate(full.values) < len(pos_bytes) + _estimate(val_bytes):
            return full
    return delta


def _encode_full(new: torch.Tensor) -> EncodedTensor:
    bits = bits_view(new).reshape(-1)
    advance = DecodedDelta(FULL, None, bits.clone())
    if new.numel() == 0:  # a full entry of no elements carries no streams
        return EncodedTensor(FULL, 0, None, None, None, None, advance)
    coding, data = encode_values(bits_to_numpy(bits))
    return EncodedTensor(FULL, new.numel(), None, None, coding, data, advance)


def decode_delta(
    op: str,
    info: DtypeInfo,
    numel: int,
    changed: int,
    *,
    positions: tuple[str, bytes | memoryview] | None,
    values: tuple[str, bytes | memoryview] | None,
) -> DecodedDelta:
    """Decode an entry's streams (both already checked to exist); hostile input is refused."""
    if changed == 0:
        empty = torch.empty(0, dtype=info.bits_dtype)
        return DecodedDelta(op, torch.empty(0, dtype=torch.int64), empty)
    assert values is not None
    vals = numpy_to_bits(decode_values(values[0], values[1], count=changed, width=info.width), info)
    if op == FULL:
        return DecodedDelta(op, None, vals)
    assert positions is not None
    pos = decode_positions(positions[0], positions[1], count=changed, numel=numel)
    return DecodedDelta(op, torch.from_numpy(pos), vals)


def apply_delta(target: torch.Tensor, delta: DecodedDelta) -> torch.Tensor | None:
    """Apply in place; returns what :func:`undo_delta` needs (old bits for overwrite/full)."""
    if not target.is_contiguous():
        raise TargetError("target tensor is not contiguous; pass contiguous tensors")
    flat = bits_view(target).reshape(-1)
    values = delta.values.to(flat.device, non_blocking=True)
    if delta.op == FULL:
        if values.numel() != flat.numel():
            raise TargetError(f"full value count {values.numel()} != tensor size {flat.numel()}")
        old = flat.clone()
        flat.copy_(values)
        return old
    assert delta.positions is not None
    positions = delta.positions.to(flat.device, non_blocking=True)
    if delta.op == XOR:
        flat[positions] ^= values
        return None
    old = flat[positions]
    flat[positions] = values
    return old


def undo_delta(target: torch.Tensor, delta: DecodedDelta, saved: torch.Tensor | None) -> None:
    """Revert :func:`apply_delta` (xor is its own inverse; the others restore saved bits)."""
    flat = bits_view(target).reshape(-1)
    if delta.op == FULL:
        assert saved is not None
        flat.copy_(saved)
    elif delta.op == XOR:
        assert delta.positions is not None
        flat[delta.positions.to(flat.device)] ^= delta.values.to(flat.device)
    else:
        assert delta.positions is not None and saved is not None
        flat[delta.positions.to(flat.device)] = saved


__all__ = [
    "FULL",
    "OPS",
    "OVERWRITE",
    "XOR",
    "DecodedDelta",
    "EncodedTensor",
    "apply_delta",
    "changed_positions",
    "decode_delta",
    "encode_tensor",
    "undo_delta",
]
