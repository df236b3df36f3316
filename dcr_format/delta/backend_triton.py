"""The Triton backend: the kernels of :mod:`dcr_format.kernels.triton_kernels` on a device.

:class:`TritonBackend` runs a diff as two passes (count and prefix sum, queued without a
wait; then compaction once the total is on the host), applies and stages changes, steps
``ulp`` differences and runs the ``classed`` class passes on the tensors' device. Chosen by
``DCR_KERNELS=auto`` for CUDA tensors, it runs the torch reference of
:class:`~dcr_format.delta.backend.Backend` for any call whose tensors are not all on CUDA;
forced (``DCR_KERNELS=triton``) it runs the kernels on any tensors (on CPU ones, Triton's
interpreter). Triton is imported on the first choice of this backend, by one thread.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType

import torch

from dcr_format.delta.backend import (
    ENV,
    TRITON,
    ULP,
    Backend,
    KernelsUnavailableError,
    PendingDiff,
    change_lanes,
    check_pair,
    to_device,
    triton_installed,
)
from dcr_format.kernels.reference import OVERWRITE, XOR, Diff

_ULP_DTYPES = (torch.int16, torch.int32, torch.int64)  # bit views of the float widths


def _kernels() -> ModuleType:
    """The Triton kernels module, imported on first use (by one thread: another thread that
    asks meanwhile waits for the whole module, never takes it half imported)."""
    module = _TRITON_KERNELS[0]
    if module is not None:
        return module
    with _TRITON_IMPORT:
        module = _TRITON_KERNELS[0]
        if module is not None:
            return module
        if not triton_installed():
            raise KernelsUnavailableError(
                f"{ENV}=triton needs Triton: pip install triton (Linux x86_64), or use {ENV}=auto"
            )
        if "triton" not in sys.modules and not torch.cuda.is_available():
            # no GPU: the kernels can only run in Triton's interpreter, which Triton reads from
            # the environment at its import (and at each kernel's definition)
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from dcr_format.kernels import triton_kernels

        _TRITON_KERNELS[0] = triton_kernels
        return triton_kernels


# the Triton kernels module once wholly imported; the lock its first import holds
_TRITON_KERNELS: list[ModuleType | None] = [None]
_TRITON_IMPORT = threading.Lock()


class TritonPendingDiff(PendingDiff):
    """A diff whose counting pass, prefix sum and copy of the changed-element total to
    pinned host memory (on CUDA) are queued on the current stream."""

    def __init__(
        self,
        backend: Backend,
        old: torch.Tensor,
        new: torch.Tensor,
        *,
        want_new: bool = True,
        want_xor: bool = True,
        base: int = 0,
    ) -> None:
        old, new = old.contiguous(), new.contiguous()
        super().__init__(backend, old, new, want_new=want_new, want_xor=want_xor, base=base)
        self._total: int | None = None
        self._host_total: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._scan = _kernels().scan(old, new)
        if old.device.type == "cuda":
            self._host_total = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self._host_total.copy_(self._scan.total, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def total(self) -> int:
        if self._total is None:
            if self._event is not None:
                assert self._host_total is not None
                self._event.synchronize()
                self._total = int(self._host_total[0])
            else:
                self._total = int(self._scan.total[0])
        return self._total

    def finish(self) -> Diff:
        found: Diff = _kernels().compact(
            self._scan,
            self.total(),
            want_new=self.want_new,
            want_xor=self.want_xor,
            base=self.base,
        )
        return found


class TritonBackend(Backend):
    """The Triton kernels; ``forced`` (``DCR_KERNELS=triton``): for any tensors, else for
    calls whose tensors are all on CUDA (the torch reference for the others)."""

    name = TRITON

    def __init__(self, *, forced: bool) -> None:
        self.forced = forced

    def _takes(self, *tensors: torch.Tensor) -> bool:
        return self.forced or all(t.device.type == "cuda" for t in tensors)

    def start_diff(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        *,
        want_new: bool = True,
        want_xor: bool = True,
        base: int = 0,
    ) -> PendingDiff:
        check_pair(old, new)
        if not self._takes(old, new):
            return super().start_diff(old, new, want_new=want_new, want_xor=want_xor, base=base)
        old, new = old.reshape(-1), new.reshape(-1)
        return TritonPendingDiff(self, old, new, want_new=want_new, want_xor=want_xor, base=base)

    def _diff_once(
        self, old: torch.Tensor, new: torch.Tensor, *, want_new: bool, want_xor: bool, base: int
    ) -> Diff:
        if not self._takes(old, new):
            return super()._diff_once(old, new, want_new=want_new, want_xor=want_xor, base=base)
        return TritonPendingDiff(
            self, old, new, want_new=want_new, want_xor=want_xor, base=base
        ).finish()

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
        if op == ULP or not self._takes(flat, positions, values):
            return super().scatter(flat, positions, values, op=op, save=save, base=base)
        if op not in (XOR, OVERWRITE):
            raise ValueError(f"scatter op must be {XOR!r} or {OVERWRITE!r}, not {op!r}")
        if not flat.is_contiguous():
            raise ValueError("the scatter target must be contiguous")
        if positions.dtype != torch.int64 or values.dtype != flat.dtype:
            raise ValueError(
                f"scatter needs int64 positions and {flat.dtype} values, "
                f"not {positions.dtype} and {values.dtype}"
            )
        if values.numel() != positions.numel():
            raise ValueError(f"{values.numel()} values for {positions.numel()} positions")
        positions, values = positions.reshape(-1).contiguous(), values.reshape(-1).contiguous()
        if positions.numel():  # the kernel does not check bounds: torch indexing would
            low, high = (int(v) for v in torch.aminmax(positions))
            if low < base or high >= base + flat.numel():
                raise IndexError(
                    f"position {low if low < base else high} is out of range for "
                    f"{flat.numel()} elements at offset {base}"
                )
        saved: torch.Tensor | None = _kernels().scatter(
            flat, positions, values, op=op, save=save, base=base
        )
        return saved

    def ulp_on_device(self, flat: torch.Tensor) -> bool:
        return flat.dtype in _ULP_DTYPES and self._takes(flat)

    def fuses_ulp(self, flat: torch.Tensor, positions: torch.Tensor) -> bool:
        return (
            positions.dtype == torch.int64
            and flat.is_contiguous()
            and flat.dim() == 1
            and self.ulp_on_device(flat)
        )

    def ulp_of_change(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        xor_values: torch.Tensor,
        new_values: torch.Tensor | None = None,
        *,
        want_old: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.ulp_on_device(flat):
            return super().ulp_of_change(flat, positions, xor_values, new_values, want_old=want_old)
        if new_values is not None:
            new_values = new_values.reshape(-1).contiguous()
        found: tuple[torch.Tensor, torch.Tensor | None] = _kernels().ulp_of_change(
            flat.reshape(-1).contiguous(),
            positions.reshape(-1).contiguous(),
            xor_values.reshape(-1).contiguous(),
            new_values,
            want_old=want_old,
        )
        return found

    def _device_ulp(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        z: torch.Tensor,
        *,
        write: bool,
        lanes: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """The Triton ``ulp`` apply (``write``) or stage of a change: the bits before and
        after at the positions, and the lane deltas (``lanes``)."""
        positions = to_device(positions, flat.device).reshape(-1).contiguous()
        z = to_device(z, flat.device).reshape(-1).contiguous()
        if z.dtype != flat.dtype or z.numel() != positions.numel():
            raise ValueError(f"{z.numel()} {z.dtype} differences for {positions.numel()} positions")
        if positions.numel():  # the kernel does not check bounds: torch indexing would
            low, high = (int(v) for v in torch.aminmax(positions))
            if low < 0 or high >= flat.numel():
                raise IndexError(
                    f"position {low if low < 0 else high} is out of range for "
                    f"{flat.numel()} elements"
                )
        before, after = _kernels().apply_ulp(flat, positions, z, write=write)
        return before, after, (change_lanes(positions, before, after) if lanes else ())

    def apply_ulp_with_lanes(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        z: torch.Tensor,
        *,
        lanes: bool = True,
        before: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        if not self.ulp_on_device(flat):
            return super().apply_ulp_with_lanes(flat, positions, z, lanes=lanes, before=before)
        return self._device_ulp(flat, positions, z, write=True, lanes=lanes)

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
        if op == ULP and base == 0 and self.ulp_on_device(flat):
            return self._device_ulp(flat, positions, values, write=False, lanes=lanes)
        return super().stage_change(flat, positions, values, op=op, base=base, lanes=lanes)

    def expand_ranges(
        self, starts: torch.Tensor, lengths: torch.Tensor, count: int
    ) -> torch.Tensor:
        if not self._takes(starts, lengths):
            return super().expand_ranges(starts, lengths, count)
        expanded: torch.Tensor = _kernels().expand_ranges(
            starts.contiguous(), lengths.contiguous(), count
        )
        return expanded

    def class_ranks(
        self,
        old: torch.Tensor,
        positions: torch.Tensor,
        shift: int,
        mask: int,
        base: int,
        count: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._takes(old, positions):
            return super().class_ranks(old, positions, shift, mask, base, count)
        found: tuple[torch.Tensor, torch.Tensor] = _kernels().class_ranks(
            old.contiguous(), positions.contiguous(), shift, mask, base, count
        )
        return found

    def class_sizes(
        self, old: torch.Tensor, shift: int, mask: int, base: int, count: int
    ) -> torch.Tensor:
        if not self._takes(old):
            return super().class_sizes(old, shift, mask, base, count)
        sizes: torch.Tensor = _kernels().class_sizes(old.contiguous(), shift, mask, base, count)
        return sizes

    def class_positions(
        self,
        old: torch.Tensor,
        shift: int,
        mask: int,
        base: int,
        count: int,
        classes: torch.Tensor,
        ranks: torch.Tensor,
    ) -> torch.Tensor:
        if not self._takes(old, classes, ranks):
            return super().class_positions(old, shift, mask, base, count, classes, ranks)
        found: torch.Tensor = _kernels().class_positions(
            old.contiguous(), shift, mask, base, count, classes.contiguous(), ranks.contiguous()
        )
        return found


_FORCED = TritonBackend(forced=True)
_AUTO = TritonBackend(forced=False)


def forced_triton(on_cuda: bool) -> TritonBackend:
    """The backend of ``DCR_KERNELS=triton`` for tensors on CUDA (``on_cuda``) or not: Triton
    imported, and its interpreter where the tensors are not on CUDA; else
    :class:`KernelsUnavailableError`."""
    if not on_cuda and not _kernels().INTERPRETED:
        raise KernelsUnavailableError(
            f"{ENV}=triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before anything imports triton"
        )
    _kernels()
    return _FORCED


def auto_triton() -> TritonBackend:
    """The backend of ``DCR_KERNELS=auto`` for CUDA tensors where Triton is installed."""
    return _AUTO


__all__ = ["TritonBackend", "TritonPendingDiff", "auto_triton", "forced_triton"]
