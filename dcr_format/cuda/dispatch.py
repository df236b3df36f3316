"""Pick the Triton kernels or their torch reference for each call.

Rules (``DCR_KERNELS``, read at every call):

- ``auto`` (default): Triton for CUDA tensors when Triton is installed, torch
  otherwise (CPU tensors, other accelerators, no Triton).
- ``torch``: always the torch reference.
- ``triton``: always Triton. On CPU tensors that means Triton's interpreter,
  which Triton only enables if ``TRITON_INTERPRET=1`` is in the environment
  when Triton is first imported: the dispatcher sets it itself before its first
  import of Triton when the machine has no CUDA, but a process that imported
  Triton earlier (or has CUDA and wants the interpreter) must set
  ``TRITON_INTERPRET=1`` itself, before anything imports Triton.

Triton is imported lazily, so ``import dcr_format`` works without it. Every
function takes flat integer bit views (see ``dcr_format.codec.dtypes.bits_view``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from functools import lru_cache
from types import ModuleType

import torch

from dcr_format.cuda import reference
from dcr_format.cuda.reference import OVERWRITE, XOR, Diff
from dcr_format.errors import DcrError

ENV = "DCR_KERNELS"
MODES = ("auto", "triton", "torch")
TRITON = "triton"
TORCH = "torch"


class KernelsUnavailableError(DcrError, RuntimeError):
    """``DCR_KERNELS=triton`` was asked for where the Triton kernels cannot run."""


def kernels_mode() -> str:
    """The ``DCR_KERNELS`` setting: ``auto``, ``triton`` or ``torch``."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


@lru_cache(maxsize=1)
def triton_installed() -> bool:
    """Whether Triton can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _kernels() -> ModuleType:
    """The Triton kernels module, imported on first use."""
    module = sys.modules.get("dcr_format.cuda.triton_kernels")
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
    from dcr_format.cuda import triton_kernels

    return triton_kernels


def backend_for(*tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for an operation on ``tensors`` (see the module's rules)."""
    mode = kernels_mode()
    if mode == TORCH:
        return TORCH
    on_cuda = all(t.device.type == "cuda" for t in tensors)
    if mode == TRITON:
        kernels = _kernels()
        if not on_cuda and not kernels.INTERPRETED:
            raise KernelsUnavailableError(
                f"{ENV}=triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "in the environment before anything imports triton"
            )
        return TRITON
    return TRITON if on_cuda and triton_installed() else TORCH


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.dtype != new.dtype or old.numel() != new.numel():
        raise ValueError(
            f"cannot diff {old.dtype}[{old.numel()}] against {new.dtype}[{new.numel()}]"
        )
    if old.device != new.device:
        raise ValueError(f"cannot diff tensors on {old.device} and {new.device}")


class PendingDiff:
    """A diff whose first pass is launched; :meth:`finish` compacts it.

    With Triton on CUDA the counting pass, the prefix sum and the copy of the
    changed-element total to pinned host memory are queued on the current stream
    and nothing waits; :meth:`total` waits for that copy only. With torch
    everything happens in :meth:`finish`.
    """

    def __init__(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        *,
        want_new: bool = True,
        want_xor: bool = True,
        base: int = 0,
    ) -> None:
        _check_pair(old, new)
        self.old, self.new = old.reshape(-1), new.reshape(-1)
        self.want_new, self.want_xor, self.base = want_new, want_xor, base
        self.backend = backend_for(self.old, self.new)
        self._total: int | None = None
        self._host_total: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if self.backend == TRITON:
            self.old, self.new = self.old.contiguous(), self.new.contiguous()
            self._scan = _kernels().scan(self.old, self.new)
            if self.old.device.type == "cuda":
                self._host_total = torch.empty(1, dtype=torch.int64, pin_memory=True)
                self._host_total.copy_(self._scan.total, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()

    def total(self) -> int:
        """The number of changed elements (waits for the first pass on a device)."""
        if self._total is None:
            if self.backend == TORCH:
                self._diff = self._torch_diff()
                self._total = self._diff.changed
            elif self._event is not None:
                assert self._host_total is not None
                self._event.synchronize()
                self._total = int(self._host_total[0])
            else:
                self._total = int(self._scan.total[0])
        return self._total

    def _torch_diff(self) -> Diff:
        return reference.diff(
            self.old, self.new, want_new=self.want_new, want_xor=self.want_xor, base=self.base
        )

    def finish(self) -> Diff:
        """Compact the change (queued on the current stream for Triton on CUDA)."""
        total = self.total()
        if self.backend == TORCH:
            return self._diff
        return _kernels().compact(
            self._scan, total, want_new=self.want_new, want_xor=self.want_xor, base=self.base
        )


def diff(
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    want_new: bool = True,
    want_xor: bool = True,
    base: int = 0,
) -> Diff:
    """Positions (+ ``base``) where ``old`` and ``new`` differ, with the new and/or XOR bits."""
    return PendingDiff(old, new, want_new=want_new, want_xor=want_xor, base=base).finish()


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted int64 flat indices where the bits of two views differ."""
    return diff(old, new, want_new=False, want_xor=False).positions


def scatter(
    flat: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    op: str,
    save: bool = False,
    base: int = 0,
) -> torch.Tensor | None:
    """In place ``flat[p - base] ^= v`` (``xor``) or ``= v`` (``overwrite``) at unique positions.

    Returns the old bits at the positions when ``save`` (else None). ``flat`` must be a
    contiguous flat view; ``positions`` and ``values`` on its device.
    """
    if op not in (XOR, OVERWRITE):
        raise ValueError(f"scatter op must be {XOR!r} or {OVERWRITE!r}, not {op!r}")
    if backend_for(flat, positions, values) == TORCH:
        return reference.scatter(flat, positions, values, op=op, save=save, base=base)
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
    return _kernels().scatter(flat, positions, values, op=op, save=save, base=base)


def expand_ranges(starts: torch.Tensor, lengths: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of runs ``[starts[r], starts[r] + lengths[r])`` (int64, ``count`` in all)."""
    if backend_for(starts, lengths) == TORCH:
        return reference.expand_ranges(starts, lengths, count)
    return _kernels().expand_ranges(starts.contiguous(), lengths.contiguous(), count)


def prefix_positions(gaps: torch.Tensor) -> torch.Tensor:
    """Positions from zero-based gaps (a torch cumulative sum on every backend)."""
    return reference.prefix_positions(gaps)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with the same bits (through pinned memory from CUDA; waits for the copy)."""
    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type != "cuda":
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; host tensors go to CUDA through pinned memory, asynchronously."""
    device = torch.device(device)
    if tensor.device == device or device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    staged = tensor if tensor.is_pinned() else tensor.pin_memory()
    return staged.to(device, non_blocking=True)


__all__ = [
    "ENV",
    "MODES",
    "KernelsUnavailableError",
    "PendingDiff",
    "backend_for",
    "changed_positions",
    "diff",
    "expand_ranges",
    "kernels_mode",
    "prefix_positions",
    "scatter",
    "to_device",
    "to_host",
]
