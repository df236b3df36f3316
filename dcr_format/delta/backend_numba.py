"""The compiled CPU backend: numba loops that diff and apply a change in one pass each.

:class:`NumbaBackend` runs the loops of :mod:`dcr_format.codings._native` on CPU tensors
with a bit-view dtype: one fused compare-and-compact pass for a diff (per block, in
parallel: count the differing elements and note their in-block indices; a prefix sum; then
per block gather the noted elements only), which also sums the change's fingerprint lane
deltas and can advance the old tensor, and one pass over the changed positions for an apply
(old bits read, new ones written, lanes summed; ``ulp`` differences stepped in the same
pass). Other tensors, and the class passes, run the torch reference of
:class:`~dcr_format.delta.backend.Backend`, which these loops match bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from dcr_format.delta.backend import NUMBA, ULP, Backend, check_op, check_segments, lane_count
from dcr_format.delta.fingerprint import native_table
from dcr_format.format.dtypes import flat
from dcr_format.kernels.reference import OVERWRITE, XOR, ClassPlan, ClassRanks, Diff

# bit-view dtypes the compiled loops take (``bits_view`` gives these)
_NATIVE_DTYPES = {
    torch.uint8: np.uint8,
    torch.int8: np.uint8,
    torch.int16: np.uint16,
    torch.int32: np.uint32,
    torch.int64: np.uint64,
}
_MODES = {OVERWRITE: 0, XOR: 1, ULP: 2}  # the compiled kernels' modes (codings/_native.py)


def _unsigned(tensor: torch.Tensor) -> np.ndarray:
    """The numpy unsigned view of a contiguous CPU bit view (shares its memory)."""
    held = tensor.detach() if tensor.requires_grad else tensor  # .numpy() refuses grad
    return held.numpy().view(_NATIVE_DTYPES[tensor.dtype])


def _line(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous 1-d tensor: itself where it is one (no new view)."""
    if tensor.dim() == 1 and tensor.is_contiguous():
        return tensor
    return tensor.reshape(-1).contiguous()


def _empty_bits(count: int, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A new bit-view tensor of ``count`` elements of ``dtype`` and its numpy unsigned view
    (allocated by numpy: one view each way, not a tensor's allocation and then its view)."""
    held = np.empty(count, dtype=_NATIVE_DTYPES[dtype])
    return torch.from_numpy(held).view(dtype), held


def _takes(*tensors: torch.Tensor) -> bool:
    """Whether the loops take these tensors: all on the CPU with a bit-view dtype."""
    return all(t.is_cpu and t.dtype in _NATIVE_DTYPES for t in tensors)


def _applies(flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the loops can apply this change in place."""
    return (
        _takes(flat, positions, values)
        and positions.dtype == torch.int64
        and values.dtype == flat.dtype
        and flat.is_contiguous()
        and flat.dim() == 1
        and values.numel() == positions.numel()
    )


def _check_bounds(positions: np.ndarray, base: int, numel: int) -> None:
    """Sorted positions (a verified decoder's; the host array of the kernels) are bounded by
    the first and last; the kernels still skip, and report, any index out of range: they
    never write there."""
    if positions.size:
        first, last = int(positions[0]), int(positions[-1])
        if first < base or last >= base + numel:
            bad = first if first < base else last
            raise IndexError(
                f"position {bad} is out of range for {numel} elements at offset {base}"
            )


class NumbaBackend(Backend):
    """The compiled CPU loops (``native``: :mod:`dcr_format.codings._native`), the torch
    reference for what they do not take."""

    name = NUMBA

    def __init__(self, native: ModuleType) -> None:
        self.native = native

    def _fused_diff(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        want_new: bool,
        want_xor: bool,
        base: int,
        lanes: bool = False,
        advance: bool = False,
        ranking: ClassPlan | None = None,
    ) -> tuple[Diff, tuple[int, ...]] | None:
        """The fused CPU diff: positions, new and xor bits, and lane deltas from one pass
        (``advance``: ``old``, contiguous, takes the new bits in that pass; ``ranking``: the
        changes' class ranks too, counted from the old bits in that pass)."""
        if not (old.is_cpu and new.is_cpu and old.dtype in _NATIVE_DTYPES):  # _takes(old, new)
            return None  # (the caller checked that the dtypes are the same)
        old, new = flat(old).contiguous(), flat(new).contiguous()
        width = old.element_size()
        args = (
            _unsigned(old),
            _unsigned(new),
            base,
            (want_new, want_xor),
            native_table(width),
            lane_count(width) if lanes else 0,
        )
        ranked = None
        if ranking is None:
            (positions, new_bits, xor_bits), deltas = self.native.diff(*args, advance)
        else:
            shift, mask, first, count, starts = ranking
            low = min(first, mask + 1)  # the same classes, a base that fits an element
            plan = self.native.Ranking(shift, mask, low, count, starts)
            found_bits, deltas, counted = self.native.ranked_diff(*args, plan, advance)
            positions, new_bits, xor_bits = found_bits
            ranked = ClassRanks(first, count, counted.ranks, counted.adjacent)
        new_values = torch.from_numpy(new_bits).view(old.dtype)
        xor_values = torch.from_numpy(xor_bits).view(old.dtype)
        found = Diff(
            torch.from_numpy(positions),
            new_values if want_new else None,
            xor_values if want_xor else None,
            ranked,
        )
        return found, deltas

    def _apply(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        values: torch.Tensor,
        *,
        op: str,
        base: int,
        lanes: bool,
        before: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
        """The fused CPU apply: old bits read (unless ``before`` holds them: read from
        ``flat`` at the positions by the caller, nothing written there since), new bits
        written (returned too for ``ulp``) and lane deltas, one pass."""
        native = self.native
        positions, values = _line(positions), _line(values)
        target, where = _unsigned(flat), positions.numpy()
        count = where.shape[0]
        _check_bounds(where, base, flat.numel())
        gathered = (
            before is not None
            and before.device.type == "cpu"
            and before.dtype == flat.dtype
            and before.shape == (count,)
        )
        if before is None or not gathered:
            before, before_bits = _empty_bits(count, flat.dtype)
        else:
            before = before.contiguous()
            before_bits = _unsigned(before)
        after, after_bits = _empty_bits(count if op == ULP else 0, flat.dtype)
        width = flat.element_size()
        in_range, deltas = native.apply(
            target,
            where,
            _unsigned(values),
            base,
            _MODES[op],
            (before_bits, after_bits),
            native_table(width),
            lane_count(width) if lanes else 0,
            gathered=gathered,
        )
        if not in_range:
            # undo the in-range part (the kernel skips the same positions again): xor is its
            # own inverse, overwrite (and ulp) put back the bits it read
            undo, mode = (values, _MODES[XOR]) if op == XOR else (before, _MODES[OVERWRITE])
            scratch = (_unsigned(before.clone()), _unsigned(after[:0]))
            native.apply(
                target, where, _unsigned(undo), base, mode, scratch, native_table(width), 0
            )
            raise IndexError(
                "positions are not strictly increasing and some are out of range; nothing was "
                "applied: pass the positions of a verified decoder"
            )
        return before, (after if op == ULP else None), deltas

    def scatter(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        values: torch.Tensor,
        *,
        op: str,
        save: bool = False,
        base: int = 0,
    ) -> torch.Tensor | None:
        check_op(op)
        if op == ULP or not _applies(flat, positions, values):
            return super().scatter(flat, positions, values, op=op, save=save, base=base)
        old = self._apply(flat, positions, values, op=op, base=base, lanes=False)[0]
        return old if save else None

    def put(
        self, flat: torch.Tensor, positions: torch.Tensor, bits: torch.Tensor, *, keep: bool = False
    ) -> torch.Tensor | None:
        if not _applies(flat, positions, bits):
            return super().put(flat, positions, bits, keep=keep)
        where = positions.reshape(-1).contiguous().numpy()
        _check_bounds(where, 0, flat.numel())
        replaced = torch.empty(where.shape[0], dtype=flat.dtype) if keep else None
        kept = None if replaced is None else _unsigned(replaced)
        if not self.native.put(
            _unsigned(flat), where, _unsigned(bits.reshape(-1).contiguous()), kept
        ):
            raise IndexError(
                "positions are not strictly increasing and some are out of range: pass the "
                "positions of a verified decoder"
            )
        return replaced

    def put_segments(
        self,
        targets: Sequence[torch.Tensor],
        positions: torch.Tensor,
        bits: torch.Tensor,
        starts: np.ndarray,
        *,
        keep: bool = False,
    ) -> torch.Tensor | None:
        """As :meth:`Backend.put_segments`, in one launch over every segment (the tensors'
        memory passed by address: each is checked here to be a contiguous CPU tensor of
        ``bits``'s width, and its size is read now)."""
        width = bits.element_size()
        fits = (
            _takes(positions, bits)
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and bits.is_contiguous()
            and all(t.is_cpu and t.element_size() == width and t.is_contiguous() for t in targets)
        )
        if not fits:
            return super().put_segments(targets, positions, bits, starts, keep=keep)
        sizes = [t.numel() for t in targets]
        check_segments(positions, starts, sizes)
        addresses = np.array([t.data_ptr() for t in targets], dtype=np.int64)
        # the replaced bits are kept even when not asked for: a position out of range
        # found in the loop (unsorted positions) puts back what the write changed
        replaced = torch.empty_like(bits)
        args = (
            addresses,
            np.array(sizes, dtype=np.int64),
            np.asarray(starts, dtype=np.int64),
            positions.numpy(),
        )
        if not self.native.put_all(*args, _unsigned(bits.reshape(-1)), _unsigned(replaced)):
            self.native.put_all(*args, _unsigned(replaced))  # skips the same positions
            raise IndexError("positions are out of range: pass the positions of a verified decoder")
        return replaced if keep else None

    def apply_with_lanes(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        values: torch.Tensor,
        *,
        op: str,
        base: int = 0,
        lanes: bool = True,
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        check_op(op)
        if op == ULP or not _applies(flat, positions, values):
            return super().apply_with_lanes(flat, positions, values, op=op, base=base, lanes=lanes)
        old, _, deltas = self._apply(flat, positions, values, op=op, base=base, lanes=lanes)
        return old, deltas

    def fuses_ulp(self, flat: torch.Tensor, positions: torch.Tensor) -> bool:
        return (
            positions.dtype == torch.int64
            and flat.is_contiguous()
            and flat.dim() == 1
            and _takes(flat, positions)
        )

    def apply_ulp_with_lanes(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        z: torch.Tensor,
        *,
        lanes: bool = True,
        before: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        if not _applies(flat, positions, z):
            return super().apply_ulp_with_lanes(flat, positions, z, lanes=lanes, before=before)
        before, after, deltas = self._apply(
            flat, positions, z, op=ULP, base=0, lanes=lanes, before=before
        )
        assert after is not None
        return before, after, deltas

    def stage_change(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        values: torch.Tensor,
        *,
        op: str,
        base: int = 0,
        lanes: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        check_op(op)
        if not _applies(flat, positions, values):
            return super().stage_change(flat, positions, values, op=op, base=base, lanes=lanes)
        positions, values = _line(positions), _line(values)
        where = positions.numpy()
        _check_bounds(where, base, flat.numel())
        count = where.shape[0]
        before, before_bits = _empty_bits(count, flat.dtype)
        after, after_bits = _empty_bits(count, flat.dtype)
        width = flat.element_size()
        in_range, deltas = self.native.stage(
            _unsigned(flat),
            where,
            _unsigned(values),
            base,
            _MODES[op],
            (before_bits, after_bits),
            native_table(width),
            lane_count(width) if lanes else 0,
        )
        if not in_range:
            raise IndexError(
                "positions are not strictly increasing and some are out of range: pass the "
                "positions of a verified decoder"
            )
        return before, after, deltas


_BACKENDS: dict[int, NumbaBackend] = {}  # by the id of the loaded loops' module


def numba_backend() -> NumbaBackend | None:
    """The compiled CPU backend, or None where numba cannot load the loops."""
    from dcr_format.kernels.native import compiled_kernels

    native = compiled_kernels()
    if native is None:
        return None
    backend = _BACKENDS.get(id(native))
    if backend is None:
        backend = _BACKENDS.setdefault(id(native), NumbaBackend(native))
    return backend


__all__ = ["NumbaBackend", "numba_backend"]
