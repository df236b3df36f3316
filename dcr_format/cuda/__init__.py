"""Device kernels: compare/compact, scatter-apply and position expansion, Triton or torch.

- :mod:`dcr_format.cuda.reference`: the torch implementation of every kernel (the
  CPU path, and the reference the Triton kernels are tested against bit for bit).
- :mod:`dcr_format.cuda.triton_kernels`: the Triton kernels (imported lazily; Triton
  is optional).
- :mod:`dcr_format.cuda.dispatch`: picks one per call (``DCR_KERNELS``).
- :mod:`dcr_format.cuda.pipeline`: the writer's overlap of device scans with
  copy-out and host coding.
- :mod:`dcr_format.cuda.positions`: position streams decoded onto a device.

This module imports neither Triton nor the codec, so the codec can import the
dispatcher; see docs/cuda.md.
"""

from dcr_format.cuda.dispatch import (
    ENV,
    MODES,
    KernelsUnavailableError,
    backend_for,
    kernels_mode,
)

__all__ = ["ENV", "MODES", "KernelsUnavailableError", "backend_for", "kernels_mode"]
