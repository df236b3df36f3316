"""Torch implementations of every device kernel: the CPU path and the reference for Triton.

Every function works on flat integer bit views (``uint8``, ``int16``, ``int32``,
``int64``: see :func:`dcr_format.format.dtypes.bits_view`) on any device, and is
what the Triton kernels in :mod:`dcr_format.kernels.triton_kernels` must reproduce
bit for bit. ``base`` is the flat index of element 0 of the views: positions are
written and read as ``base + local index`` in int64, so a slice of a huge tensor
(or a test of positions past 2^31) needs no 2^31-element allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

# Elements per program of the compare/compact kernels (and of the reference's block counts).
BLOCK = 2048
XOR = "xor"
OVERWRITE = "overwrite"


class ClassPlan(NamedTuple):
    """Classes a diff may rank each change in while it reads the old bits (FORMAT.md §6.5):
    ``clamp(((old >> shift) & mask) - base, 0, classes - 1)``, counted from ``starts``, the
    members of each class before each task of the compiled diff (``(tasks + 1, classes)``
    int64: the class starts of the old bits' exponent rows)."""

    shift: int
    mask: int
    base: int
    classes: int
    starts: np.ndarray


class ClassRanks(NamedTuple):
    """What a diff that ranked its changes adds: the classes (``base``, ``classes``), each
    change's rank among the old elements of its class (int64, beside its position), and
    how many positions directly follow the one before them."""

    base: int
    classes: int
    ranks: np.ndarray
    adjacent: int


@dataclass(frozen=True)
class Diff:
    """The compacted change between two bit views, on their device."""

    positions: torch.Tensor  # int64, strictly increasing, ``base`` added
    new_values: torch.Tensor | None  # the new bits at ``positions`` (None if not asked for)
    xor_values: torch.Tensor | None  # old ^ new at ``positions`` (None if not asked for)
    ranked: ClassRanks | None = None  # the changes' class ranks, where the diff counted them

    @property
    def changed(self) -> int:
        """Number of changed elements."""
        return int(self.positions.numel())


def block_counts(old: torch.Tensor, new: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """int32 number of differing elements in each block of ``block`` elements."""
    n = old.numel()
    blocks = -(-n // block)
    mask = old != new
    padded = torch.zeros(blocks * block, dtype=torch.int32, device=old.device)
    padded[:n] = mask.to(torch.int32)
    return padded.view(blocks, block).sum(dim=1, dtype=torch.int32)


def diff(
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    want_new: bool = True,
    want_xor: bool = True,
    base: int = 0,
) -> Diff:
    """Positions where the bits of ``old`` and ``new`` differ, and the new / XOR bits there."""
    positions = torch.nonzero(old != new).reshape(-1)
    new_values = new[positions] if want_new or want_xor else None
    xor_values = new_values ^ old[positions] if want_xor and new_values is not None else None
    if base:
        positions = positions + base
    return Diff(positions, new_values if want_new else None, xor_values)


def scatter(
    flat: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    op: str,
    save: bool,
    base: int = 0,
) -> torch.Tensor | None:
    """In place: ``flat[p - base] ^= v`` (xor) or ``= v`` (overwrite); the old bits if ``save``."""
    index = positions - base if base else positions
    old = flat[index] if save else None
    if op == XOR:
        flat[index] ^= values
    elif op == OVERWRITE:
        flat[index] = values
    else:
        raise ValueError(f"scatter op must be {XOR!r} or {OVERWRITE!r}, not {op!r}")
    return old


def expand_ranges(starts: torch.Tensor, lengths: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of runs ``[starts[r], starts[r] + lengths[r])`` (int64, ``count`` in all)."""
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=starts.device)
    firsts = torch.cumsum(lengths, 0) - lengths
    shifts = torch.repeat_interleave(starts - firsts, lengths, output_size=count)
    return shifts + torch.arange(count, dtype=torch.int64, device=starts.device)


_EXPONENT_CHUNK = 1 << 26  # elements whose exponents are widened to int64 at a time


def _exponents(bits: torch.Tensor, shift: int, mask: int) -> torch.Tensor:
    """The exponent field ``(x >> shift) & mask`` of integer bits (int64; the arithmetic
    shift of a negative value only sets bits the mask clears)."""
    return (bits.to(torch.int64) >> shift) & mask


def _classes(bits: torch.Tensor, shift: int, mask: int, base: int, count: int) -> torch.Tensor:
    """Each element's class ``clamp(e - base, 0, count - 1)`` of its exponent ``e``."""
    return (_exponents(bits, shift, mask) - base).clamp(0, count - 1)


def exponent_histograms(
    old: torch.Tensor, positions: torch.Tensor, shift: int, mask: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of every exponent value over all elements of ``old`` (flat integer bits) and
    over those at ``positions``, on ``old``'s device (widened a chunk at a time)."""
    everything = torch.zeros(mask + 1, dtype=torch.int64, device=old.device)
    for start in range(0, old.numel(), _EXPONENT_CHUNK):
        part = _exponents(old[start : start + _EXPONENT_CHUNK], shift, mask)
        everything += torch.bincount(part, minlength=mask + 1)
    changed = torch.bincount(_exponents(old[positions], shift, mask), minlength=mask + 1)
    return everything, changed


def class_ranks(
    old: torch.Tensor, positions: torch.Tensor, shift: int, mask: int, base: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's class ``clamp(e - base, 0, count - 1)`` of its old exponent ``e`` and
    its rank among the elements of that class (int64, on ``old``'s device)."""
    members = _classes(old, shift, mask, base, count)
    classes = members[positions]
    ranks = torch.empty_like(positions)
    for c in range(count):
        chosen = classes == c
        if bool(chosen.any()):
            ranks[chosen] = torch.cumsum(members == c, 0)[positions[chosen]] - 1
    return classes, ranks


def class_sizes(old: torch.Tensor, shift: int, mask: int, base: int, count: int) -> torch.Tensor:
    """How many elements of ``old`` each class has (int64, on its device)."""
    return torch.bincount(_classes(old, shift, mask, base, count), minlength=count)


def class_positions(
    old: torch.Tensor,
    shift: int,
    mask: int,
    base: int,
    count: int,
    classes: torch.Tensor,
    ranks: torch.Tensor,
) -> torch.Tensor:
    """The flat positions, increasing, of the elements of rank ``ranks[j]`` in class
    ``classes[j]`` (each rank below its class's size, none twice), on ``old``'s device."""
    members = _classes(old, shift, mask, base, count)
    found = torch.empty_like(ranks)
    for c in range(count):
        chosen = classes == c
        if bool(chosen.any()):
            found[chosen] = torch.nonzero(members == c).reshape(-1)[ranks[chosen]]
    return torch.sort(found).values


def prefix_positions(gaps: torch.Tensor) -> torch.Tensor:
    """Positions from zero-based gaps: ``p[i] = sum(g[:i+1] + 1) - 1`` (int64 cumulative sum)."""
    return torch.cumsum(gaps.to(torch.int64) + 1, 0) - 1


def _order(bits: torch.Tensor) -> torch.Tensor:
    """The ulp order map of FORMAT.md §7.5 on signed bit views: a set sign bit flips every
    bit, a clear one only the sign bit (integer order is then the order of the values)."""
    top = torch.iinfo(bits.dtype).min
    return bits ^ torch.where(bits < 0, torch.full_like(bits, -1), torch.full_like(bits, top))


def _unorder(ordered: torch.Tensor) -> torch.Tensor:
    top = torch.iinfo(ordered.dtype).min
    flips = torch.where(ordered < 0, torch.full_like(ordered, top), torch.full_like(ordered, -1))
    return ordered ^ flips


def ulp_of_change(
    flat: torch.Tensor,
    positions: torch.Tensor,
    xor_values: torch.Tensor,
    new_values: torch.Tensor | None = None,
    *,
    base: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The zigzag ulp differences (FORMAT.md §7.5) of a change and its old bits: the new
    bits are ``new_values`` where given, else ``flat`` at ``positions``; the old ones
    those XOR ``xor_values`` (signed bit views of 2, 4 or 8 bytes; arithmetic wraps)."""
    after = new_values if new_values is not None else flat[positions - base]
    before = after ^ xor_values
    d = _order(after) - _order(before)
    z = (d << 1) ^ (d >> (8 * d.element_size() - 1))
    return z, before


def ulp_step(before: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The bits ``z`` zigzag ulp differences away from ``before`` (inverse of
    :func:`ulp_of_change`)."""
    d = ((z >> 1) & torch.iinfo(z.dtype).max) ^ -(z & 1)
    return _unorder(_order(before) + d)


def apply_ulp(
    flat: torch.Tensor, positions: torch.Tensor, z: torch.Tensor, *, write: bool, base: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bits at ``positions`` before and after stepping them by ``z``; ``write``: the
    new bits are written there too."""
    index = positions - base if base else positions
    before = flat[index]
    after = ulp_step(before, z)
    if write:
        flat[index] = after
    return before, after


__all__ = [
    "BLOCK",
    "OVERWRITE",
    "XOR",
    "ClassPlan",
    "ClassRanks",
    "Diff",
    "apply_ulp",
    "block_counts",
    "class_positions",
    "class_ranks",
    "class_sizes",
    "diff",
    "expand_ranges",
    "exponent_histograms",
    "prefix_positions",
    "scatter",
    "ulp_of_change",
    "ulp_step",
]
