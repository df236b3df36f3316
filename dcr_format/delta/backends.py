"""The choice of a tensor's :class:`~dcr_format.delta.backend.Backend`, made once.

:func:`backend_for` (or :func:`backend_on` for a device) picks the backend of an operation on
some tensors from ``DCR_KERNELS``, read at that choice only; the caller (an encode, a decode,
an apply of one tensor, a writer's diff pass) keeps it and passes it down:

- ``auto`` (default): Triton (:class:`~dcr_format.delta.backend_triton.TritonBackend`) for
  CUDA tensors when Triton is installed; the compiled numba loops
  (:class:`~dcr_format.delta.backend_numba.NumbaBackend`) for CPU tensors when numba
  imports; the torch reference (:class:`~dcr_format.delta.backend.Backend`) otherwise
  (other accelerators, neither installed).
- ``torch``: always the torch reference (which also turns off the compiled Rice coding and
  fingerprint loops, :func:`dcr_format.codings.positions.native_kernels`).
- ``triton``: always Triton. On CPU tensors that means Triton's interpreter, which Triton
  only enables if ``TRITON_INTERPRET=1`` is in the environment when Triton is first
  imported: the backend sets it itself before its first import of Triton when the machine
  has no CUDA, but a process that imported Triton earlier (or has CUDA and wants the
  interpreter) must set ``TRITON_INTERPRET=1`` itself, before anything imports Triton.
  Where Triton cannot run, the choice raises
  :class:`~dcr_format.delta.backend.KernelsUnavailableError`.

Every backend gives the same bits; a backend takes any tensors, and a method whose tensors
its kernels do not take (another device, a dtype they lack) runs the reference. Triton and
numba are imported lazily, so ``import dcr_format`` works without them.
"""

from __future__ import annotations

import torch

from dcr_format.delta.backend import TORCH, TRITON, Backend, kernels_mode, triton_installed
from dcr_format.delta.backend_numba import numba_backend
from dcr_format.delta.backend_triton import auto_triton, forced_triton

REFERENCE = Backend()
"""The torch reference backend (``DCR_KERNELS=torch``)."""


def backend_for(*tensors: torch.Tensor) -> Backend:
    """The backend of an operation on ``tensors`` (see the module's rules; reads
    ``DCR_KERNELS`` once). Raises :class:`KernelsUnavailableError` for ``triton`` where
    Triton cannot run on these tensors."""
    on_cuda = on_cpu = True  # is_cuda/is_cpu: no device object built per tensor
    for t in tensors:
        on_cuda = on_cuda and t.is_cuda
        on_cpu = on_cpu and t.is_cpu
    return _choose(on_cuda, on_cpu)


def backend_on(device: torch.device | str) -> Backend:
    """:func:`backend_for` tensors on ``device``."""
    kind = torch.device(device).type
    return _choose(kind == "cuda", kind == "cpu")


def _choose(on_cuda: bool, on_cpu: bool) -> Backend:
    mode = kernels_mode()
    if mode == TORCH:
        return REFERENCE
    if mode == TRITON:
        return forced_triton(on_cuda)
    if on_cuda and triton_installed():
        return auto_triton()
    if on_cpu:
        return numba_backend() or REFERENCE
    return REFERENCE


__all__ = ["REFERENCE", "backend_for", "backend_on"]
