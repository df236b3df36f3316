"""Triton kernels of the device path (imported only by :mod:`dcr_format.delta.backend_triton`).

Importing this module imports Triton and defines the kernels; whether they are
compiled for the GPU or run by Triton's interpreter (CPU tensors) is fixed at
that moment by ``TRITON_INTERPRET``, which therefore has to be set before
Triton is first imported (the Triton backend does that for ``DCR_KERNELS=triton``
on a machine without CUDA).

Kernels (each has a torch reference in :mod:`dcr_format.kernels.reference`):

- ``_count_kernel``: per block of :data:`BLOCK` elements, how many differ.
- ``_compact_kernel``: with the exclusive prefix sum of those counts (a torch
  cumsum over one int32 per block), writes int64 positions and the new and/or
  XOR bits of the differing elements densely, in order.
- ``_scatter_kernel``: ``target[p] ^= v`` or ``target[p] = v`` at unique
  positions, optionally saving the old bits first (for rollback).
- ``_expand_kernel``: positions of runs (range coding): every output element
  binary-searches its run among the run's first output indices.
- ``_ulp_diff_kernel`` and ``_ulp_apply_kernel``: the ``ulp`` value coding (FORMAT.md
  §7.5) on the device. The writer's kernel takes each change's new bits (or gathers them
  at its positions) and XOR bits and writes the zigzag difference of the two in value
  order (and the old bits, where asked); the reader's reads the old bits at each
  position, steps them by the difference and writes the new bits (or, staging, only
  returns them). Both compute in int64 lanes modulo ``2**(8*width)``.
- ``_class_count_kernel``, ``_class_rank_kernel`` and ``_class_select_kernel``: the
  ``classed`` position coding (FORMAT.md §6.5) on the device. Per block, how many
  elements of each class it has (``tl.histogram``); with the prefix sums of those over
  the blocks (torch), the writer's kernel has each block rank its own changed positions
  (the count of the position's class before the block plus the elements of that class
  before it in the block), and the reader's finds each wanted rank's block (a torch
  searchsorted) and selects the element there (a ``tl.cumsum`` of the class's members).

All index arithmetic is int64 (the program id is widened before it is
multiplied), and every kernel takes a ``base``: the flat index of element 0 of
the views it is given.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from dcr_format.kernels.reference import BLOCK, OVERWRITE, XOR, Diff

SCATTER_BLOCK = 1024
EXPAND_BLOCK = 1024
_WARPS = 4


@triton.jit
def _block(n, BLOCK: tl.constexpr):
    """This program's block: its id, its ``BLOCK`` int64 element indices, and which are < n."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    return pid, offs, offs < n


@triton.jit
def _load_pair(old_ptr, new_ptr, n, BLOCK: tl.constexpr):
    """:func:`_block`, and the old and new bits of its elements (0 past ``n``)."""
    pid, offs, inside = _block(n, BLOCK)
    a = tl.load(old_ptr + offs, mask=inside, other=0)
    b = tl.load(new_ptr + offs, mask=inside, other=0)
    return pid, offs, a, b


@triton.jit(do_not_specialize=["n"])
def _count_kernel(old_ptr, new_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    pid, _, a, b = _load_pair(old_ptr, new_ptr, n, BLOCK)
    count = tl.sum((a != b).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid, count)


@triton.jit(do_not_specialize=["n", "base"])
def _compact_kernel(
    old_ptr,
    new_ptr,
    starts_ptr,
    pos_ptr,
    newv_ptr,
    xorv_ptr,
    n,
    base,
    BLOCK: tl.constexpr,
    WRITE_NEW: tl.constexpr,
    WRITE_XOR: tl.constexpr,
):
    pid, offs, a, b = _load_pair(old_ptr, new_ptr, n, BLOCK)
    changed = a != b
    flags = changed.to(tl.int32)
    dest = tl.load(starts_ptr + pid) + (tl.cumsum(flags, axis=0) - flags).to(tl.int64)
    tl.store(pos_ptr + dest, offs + base, mask=changed)
    if WRITE_NEW:
        tl.store(newv_ptr + dest, b, mask=changed)
    if WRITE_XOR:
        tl.store(xorv_ptr + dest, a ^ b, mask=changed)


@triton.jit(do_not_specialize=["m", "base"])
def _scatter_kernel(
    target_ptr,
    pos_ptr,
    val_ptr,
    saved_ptr,
    m,
    base,
    BLOCK: tl.constexpr,
    IS_XOR: tl.constexpr,
    SAVE: tl.constexpr,
):
    _, offs, inside = _block(m, BLOCK)
    index = tl.load(pos_ptr + offs, mask=inside, other=0) - base
    values = tl.load(val_ptr + offs, mask=inside, other=0)
    if IS_XOR or SAVE:
        old = tl.load(target_ptr + index, mask=inside, other=0)
        if SAVE:
            tl.store(saved_ptr + offs, old, mask=inside)
        if IS_XOR:
            values = old ^ values
    tl.store(target_ptr + index, values, mask=inside)


@triton.jit(do_not_specialize=["count", "runs", "steps"])
def _expand_kernel(starts_ptr, firsts_ptr, out_ptr, count, runs, steps, BLOCK: tl.constexpr):
    _, i, inside = _block(count, BLOCK)
    # the run of output i: the last r with firsts[r] <= i (firsts[0] == 0), by binary search
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + runs
    for _ in range(steps):
        active = inside & (lo < hi)
        mid = (lo + hi) >> 1
        first = tl.load(firsts_ptr + mid, mask=active, other=0)
        lo = tl.where(active & (first <= i), mid + 1, lo)
        hi = tl.where(active & (first > i), mid, hi)
    run = lo - 1
    start = tl.load(starts_ptr + run, mask=inside, other=0)
    first = tl.load(firsts_ptr + run, mask=inside, other=0)
    tl.store(out_ptr + i, start + (i - first), mask=inside)


# whether Triton was imported with TRITON_INTERPRET=1 (kernels then run on CPU tensors)
INTERPRETED = "Interpreted" in type(_count_kernel).__name__
# the interpreter patches triton.language while a kernel runs: one kernel at a time
_LAUNCH = threading.Lock() if INTERPRETED else contextlib.nullcontext()


@triton.jit
def _classes_of(x, shift, mask, base, count):
    """Classes ``clamp(((x >> shift) & mask) - base, 0, count - 1)`` of integer bits."""
    e = (x.to(tl.int64) >> shift) & mask
    return tl.minimum(tl.maximum(e - base, 0), count - 1)


@triton.jit(do_not_specialize=["n", "shift", "mask", "base", "count"])
def _class_count_kernel(
    old_ptr, counts_ptr, n, shift, mask, base, count, BLOCK: tl.constexpr, CLASSES: tl.constexpr
):
    pid, offs, inside = _block(n, BLOCK)
    x = tl.load(old_ptr + offs, mask=inside, other=0)
    c = _classes_of(x, shift, mask, base, count)
    hist = tl.histogram(c.to(tl.int32), CLASSES, mask=inside)  # past the end: not counted
    tl.store(counts_ptr + pid * CLASSES + tl.arange(0, CLASSES), hist.to(tl.int64))


@triton.jit(do_not_specialize=["n", "shift", "mask", "base", "count"])
def _class_rank_kernel(
    old_ptr,
    pos_ptr,
    firsts_ptr,
    before_ptr,
    classes_ptr,
    ranks_ptr,
    n,
    shift,
    mask,
    base,
    count,
    BLOCK: tl.constexpr,
    CLASSES: tl.constexpr,
):
    pid, offs, inside = _block(n, BLOCK)
    x = tl.load(old_ptr + offs, mask=inside, other=0)
    c = tl.where(inside, _classes_of(x, shift, mask, base, count), -1)
    start = tl.load(firsts_ptr + pid)
    end = tl.load(firsts_ptr + pid + 1)
    for j in range(start, end):
        p = tl.load(pos_ptr + j)
        cp = _classes_of(tl.load(old_ptr + p), shift, mask, base, count)
        below = tl.sum(((c == cp) & (offs < p)).to(tl.int64), axis=0)
        prior = tl.load(before_ptr + pid * CLASSES + cp)
        tl.store(classes_ptr + j, cp)
        tl.store(ranks_ptr + j, prior + below)


@triton.jit(do_not_specialize=["m", "shift", "mask", "base", "count"])
def _class_select_kernel(
    old_ptr,
    blocks_ptr,
    skips_ptr,
    classes_ptr,
    out_ptr,
    m,
    shift,
    mask,
    base,
    count,
    BLOCK: tl.constexpr,
):
    """Wanted element ``j``: the ``skips[j]``-th (from 0) element of class ``classes[j]`` in
    block ``blocks[j]``."""
    j = tl.program_id(0).to(tl.int64)
    if j < m:
        b = tl.load(blocks_ptr + j)
        k = tl.load(skips_ptr + j)
        cj = tl.load(classes_ptr + j)
        offs = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = offs < tl.load(blocks_ptr + m)  # the tensor's size, after the last block
        x = tl.load(old_ptr + offs, mask=inside, other=0)
        member = (_classes_of(x, shift, mask, base, count) == cj) & inside
        seen = tl.cumsum(member.to(tl.int64), axis=0)
        hit = member & (seen == k + 1)
        tl.store(out_ptr + j, tl.max(tl.where(hit, offs, -1), axis=0))


@triton.jit
def _ulp_consts(BITS: tl.constexpr):
    """The top bit and all ``BITS`` bits set, as int64 (``-1`` for 64 bits)."""
    top = tl.full([1], 1, tl.int64) << (BITS - 1)
    return top, top | (top - 1)


@triton.jit
def _ulp_order(x, top, ones):
    """FORMAT.md §7.5's order map of ``BITS``-bit patterns held in int64 lanes."""
    return x ^ tl.where((x & top) != 0, ones, top)


@triton.jit(do_not_specialize=["m", "base"])
def _ulp_diff_kernel(
    src_ptr,
    pos_ptr,
    xor_ptr,
    z_ptr,
    old_ptr,
    m,
    base,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    GATHER: tl.constexpr,
    WRITE_OLD: tl.constexpr,
):
    _, offs, inside = _block(m, BLOCK)
    top, ones = _ulp_consts(BITS)
    if GATHER:
        index = tl.load(pos_ptr + offs, mask=inside, other=0) - base
        raw = tl.load(src_ptr + index, mask=inside, other=0)
    else:
        raw = tl.load(src_ptr + offs, mask=inside, other=0)
    flips = tl.load(xor_ptr + offs, mask=inside, other=0)
    if WRITE_OLD:
        tl.store(old_ptr + offs, raw ^ flips, mask=inside)
    after = raw.to(tl.int64) & ones
    before = (raw ^ flips).to(tl.int64) & ones
    d = (_ulp_order(after, top, ones) - _ulp_order(before, top, ones)) & ones
    z = ((d << 1) & ones) ^ tl.where((d & top) != 0, ones, 0)
    tl.store(z_ptr + offs, z.to(raw.dtype), mask=inside)


@triton.jit(do_not_specialize=["m", "base"])
def _ulp_apply_kernel(
    target_ptr,
    pos_ptr,
    z_ptr,
    before_ptr,
    after_ptr,
    m,
    base,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    WRITE: tl.constexpr,
):
    _, offs, inside = _block(m, BLOCK)
    top, ones = _ulp_consts(BITS)
    index = tl.load(pos_ptr + offs, mask=inside, other=0) - base
    raw = tl.load(target_ptr + index, mask=inside, other=0)
    z = tl.load(z_ptr + offs, mask=inside, other=0).to(tl.int64) & ones
    d = ((z >> 1) & (ones ^ top)) ^ tl.where((z & 1) != 0, ones, 0)
    ordered = (_ulp_order(raw.to(tl.int64) & ones, top, ones) + d) & ones
    new = (ordered ^ tl.where((ordered & top) != 0, top, ones)).to(raw.dtype)
    tl.store(before_ptr + offs, raw, mask=inside)
    tl.store(after_ptr + offs, new, mask=inside)
    if WRITE:
        tl.store(target_ptr + index, new, mask=inside)


def _launch(kernel: Any, n: int, block: int, *args: Any, **meta: Any) -> None:
    with _LAUNCH:
        kernel[(triton.cdiv(n, block),)](*args, BLOCK=block, num_warps=_WARPS, **meta)


def block_counts(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """int32 changed-element count per block of :data:`BLOCK` (``old``/``new`` contiguous)."""
    n = old.numel()
    counts = torch.empty(triton.cdiv(n, BLOCK), dtype=torch.int32, device=old.device)
    if n:
        _launch(_count_kernel, n, BLOCK, old, new, counts, n)
    return counts


@dataclass
class Scan:
    """The first pass of a diff: per-block counts and their inclusive prefix sum (launched)."""

    old: torch.Tensor
    new: torch.Tensor
    counts: torch.Tensor  # int32 per block
    ends: torch.Tensor  # int64 inclusive prefix sum of counts
    total: torch.Tensor  # ends[-1:] (or a zero), possibly already on its way to the host


def scan(old: torch.Tensor, new: torch.Tensor) -> Scan:
    """Launch the counting pass and the prefix sum; nothing waits for the device."""
    counts = block_counts(old, new)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    total = ends[-1:] if ends.numel() else torch.zeros(1, dtype=torch.int64, device=old.device)
    return Scan(old, new, counts, ends, total)


def compact(scanned: Scan, total: int, *, want_new: bool, want_xor: bool, base: int = 0) -> Diff:
    """Second pass: write positions (+ ``base``) and the new / XOR bits of ``total`` changes."""
    old, new = scanned.old, scanned.new
    device = old.device
    positions = torch.empty(total, dtype=torch.int64, device=device)
    new_values = torch.empty(total, dtype=new.dtype, device=device) if want_new else None
    xor_values = torch.empty(total, dtype=new.dtype, device=device) if want_xor else None
    if total:
        starts = scanned.ends - scanned.counts
        _launch(
            _compact_kernel,
            old.numel(),
            BLOCK,
            old,
            new,
            starts,
            positions,
            new_values if want_new else positions,  # an unused pointer still needs a tensor
            xor_values if want_xor else positions,
            old.numel(),
            base,
            WRITE_NEW=want_new,
            WRITE_XOR=want_xor,
        )
    return Diff(positions, new_values, xor_values)


def scatter(
    flat: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    op: str,
    save: bool,
    base: int = 0,
) -> torch.Tensor | None:
    """In place ``flat[p - base] ^= v`` or ``= v`` at unique positions; old bits if ``save``."""
    if op not in (XOR, OVERWRITE):
        raise ValueError(f"scatter op must be {XOR!r} or {OVERWRITE!r}, not {op!r}")
    m = positions.numel()
    saved = torch.empty(m, dtype=flat.dtype, device=flat.device) if save else None
    if m:
        _launch(
            _scatter_kernel,
            m,
            SCATTER_BLOCK,
            flat,
            positions,
            values,
            saved if saved is not None else values,
            m,
            base,
            IS_XOR=op == XOR,
            SAVE=save,
        )
    return saved


ULP_BLOCK = 1024


def ulp_of_change(
    flat: torch.Tensor,
    positions: torch.Tensor,
    xor_values: torch.Tensor,
    new_values: torch.Tensor | None,
    *,
    want_old: bool,
    base: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The zigzag ulp differences of a change (new bits ``new_values``, else ``flat`` at
    ``positions``; XOR bits ``xor_values``) and, ``want_old``, its old bits; as the
    reference computes them."""
    m = xor_values.numel()
    z = torch.empty(m, dtype=xor_values.dtype, device=xor_values.device)
    old = torch.empty_like(z) if want_old else None
    if m:
        src = new_values if new_values is not None else flat
        _launch(
            _ulp_diff_kernel,
            m,
            ULP_BLOCK,
            src,
            positions,
            xor_values,
            z,
            old if old is not None else z,  # an unused pointer still needs a tensor
            m,
            base,
            BITS=8 * z.element_size(),
            GATHER=new_values is None,
            WRITE_OLD=want_old,
        )
    return z, old


def apply_ulp(
    flat: torch.Tensor, positions: torch.Tensor, z: torch.Tensor, *, write: bool, base: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bits at ``positions`` of ``flat`` before and after stepping them by the zigzag
    ulp differences ``z``; ``write``: the new bits are written there too."""
    m = positions.numel()
    before = torch.empty(m, dtype=flat.dtype, device=flat.device)
    after = torch.empty_like(before)
    if m:
        args = (flat, positions, z, before, after, m, base)
        _launch(_ulp_apply_kernel, m, ULP_BLOCK, *args, BITS=8 * flat.element_size(), WRITE=write)
    return before, after


CLASS_BLOCK = 1024
MAX_CLASSES = 16  # the coding's K <= 16 (FORMAT.md §6.5)


def class_ranks(
    old: torch.Tensor, positions: torch.Tensor, shift: int, mask: int, base: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's class and its rank in that class (``old`` contiguous flat integer
    bits, ``positions`` sorted int64 on its device), as the reference computes them."""
    n, m = old.numel(), positions.numel()
    classes = torch.empty(m, dtype=torch.int64, device=old.device)
    ranks = torch.empty(m, dtype=torch.int64, device=old.device)
    if m == 0:
        return classes, ranks
    blocks = triton.cdiv(n, CLASS_BLOCK)
    counts = torch.empty((blocks, MAX_CLASSES), dtype=torch.int64, device=old.device)
    meta = {"CLASSES": MAX_CLASSES}
    _launch(_class_count_kernel, n, CLASS_BLOCK, old, counts, n, shift, mask, base, count, **meta)
    before = torch.cumsum(counts, 0) - counts  # exclusive, per class
    edges = torch.arange(blocks + 1, dtype=torch.int64, device=old.device) * CLASS_BLOCK
    firsts = torch.searchsorted(positions, edges)
    args = (old, positions, firsts, before, classes, ranks, n, shift, mask, base, count)
    _launch(_class_rank_kernel, n, CLASS_BLOCK, *args, **meta)
    return classes, ranks


def _class_counts(old: torch.Tensor, shift: int, mask: int, base: int, count: int) -> torch.Tensor:
    """Per block of :data:`CLASS_BLOCK` elements, how many of each class (int64)."""
    n = old.numel()
    counts = torch.empty(
        (triton.cdiv(n, CLASS_BLOCK), MAX_CLASSES), dtype=torch.int64, device=old.device
    )
    if n:
        args = (old, counts, n, shift, mask, base, count)
        _launch(_class_count_kernel, n, CLASS_BLOCK, *args, CLASSES=MAX_CLASSES)
    return counts


def class_sizes(old: torch.Tensor, shift: int, mask: int, base: int, count: int) -> torch.Tensor:
    """How many elements of ``old`` (contiguous) each class has."""
    return _class_counts(old, shift, mask, base, count).sum(0)[:count]


def class_positions(
    old: torch.Tensor,
    shift: int,
    mask: int,
    base: int,
    count: int,
    classes: torch.Tensor,
    ranks: torch.Tensor,
) -> torch.Tensor:
    """:func:`dcr_format.kernels.reference.class_positions` with the blocks' class counts and
    one select per wanted element on the device (then one sort)."""
    m = ranks.numel()
    if m == 0:
        return torch.empty(0, dtype=torch.int64, device=old.device)
    counts = _class_counts(old, shift, mask, base, count)
    ends = torch.cumsum(counts, 0).T.contiguous()  # [class, block]: inclusive
    blocks = torch.empty(m + 1, dtype=torch.int64, device=old.device)
    skips = torch.empty(m, dtype=torch.int64, device=old.device)
    for c in range(count):
        chosen = torch.nonzero(classes == c).reshape(-1)
        if chosen.numel():
            wanted = ranks[chosen]
            where = torch.searchsorted(ends[c], wanted, right=True)
            blocks[chosen] = where
            skips[chosen] = wanted - (ends[c][where] - counts[where, c])
    blocks[m] = old.numel()
    out = torch.empty(m, dtype=torch.int64, device=old.device)
    with _LAUNCH:
        _class_select_kernel[(m,)](
            old, blocks, skips, classes, out, m, shift, mask, base, count,
            BLOCK=CLASS_BLOCK, num_warps=_WARPS,
        )  # fmt: skip
    return torch.sort(out).values


def expand_ranges(starts: torch.Tensor, lengths: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of runs ``[starts[r], starts[r] + lengths[r])``; ``count`` is their total."""
    out = torch.empty(count, dtype=torch.int64, device=starts.device)
    runs = starts.numel()
    if count:
        firsts = torch.cumsum(lengths, 0) - lengths
        steps = runs.bit_length() + 1
        _launch(_expand_kernel, count, EXPAND_BLOCK, starts, firsts, out, count, runs, steps)
    return out


__all__ = [
    "BLOCK",
    "EXPAND_BLOCK",
    "INTERPRETED",
    "SCATTER_BLOCK",
    "ULP_BLOCK",
    "Scan",
    "apply_ulp",
    "block_counts",
    "compact",
    "expand_ranges",
    "scan",
    "scatter",
    "ulp_of_change",
]
