"""One-off kernel calls that choose their backend themselves: each function here picks
:func:`~dcr_format.delta.backends.backend_for` its tensors (reading ``DCR_KERNELS``) and
calls that backend's method of the same name, for a caller that holds no
:class:`~dcr_format.delta.backend.Backend` (a test, a benchmark, a single call). Code that
works on one tensor several times chooses the backend once and calls it directly.
"""

from __future__ import annotations

import torch

from dcr_format.delta.backends import backend_for
from dcr_format.kernels.reference import Diff


def diff(
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    want_new: bool = True,
    want_xor: bool = True,
    base: int = 0,
) -> Diff:
    """:meth:`~dcr_format.delta.backend.Backend.diff` on the backend of ``old`` and ``new``."""
    return backend_for(old, new).diff(old, new, want_new=want_new, want_xor=want_xor, base=base)


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted int64 flat indices where the bits of two views differ."""
    return backend_for(old, new).changed_positions(old, new)


def diff_with_lanes(
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    want_new: bool = True,
    want_xor: bool = True,
    base: int = 0,
    lanes: bool = True,
    advance: bool = False,
) -> tuple[Diff, tuple[int, ...]]:
    """:meth:`~dcr_format.delta.backend.Backend.diff_with_lanes` on the backend of ``old``
    and ``new``."""
    return backend_for(old, new).diff_with_lanes(
        old, new, want_new=want_new, want_xor=want_xor, base=base, lanes=lanes, advance=advance
    )


def scatter(
    flat: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    op: str,
    save: bool = False,
    base: int = 0,
) -> torch.Tensor | None:
    """:meth:`~dcr_format.delta.backend.Backend.scatter` on the backend of the tensors."""
    return backend_for(flat, positions, values).scatter(
        flat, positions, values, op=op, save=save, base=base
    )


def apply_with_lanes(
    flat: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    op: str,
    base: int = 0,
    lanes: bool = True,
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """:meth:`~dcr_format.delta.backend.Backend.apply_with_lanes` on the backend of the
    tensors."""
    return backend_for(flat, positions, values).apply_with_lanes(
        flat, positions, values, op=op, base=base, lanes=lanes
    )


def apply_ulp_with_lanes(
    flat: torch.Tensor,
    positions: torch.Tensor,
    z: torch.Tensor,
    *,
    lanes: bool = True,
    before: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """:meth:`~dcr_format.delta.backend.Backend.apply_ulp_with_lanes` on the backend of
    ``flat``."""
    return backend_for(flat).apply_ulp_with_lanes(flat, positions, z, lanes=lanes, before=before)


def stage_change(
    flat: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    op: str,
    base: int = 0,
    lanes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """:meth:`~dcr_format.delta.backend.Backend.stage_change` on the backend of ``flat``."""
    return backend_for(flat).stage_change(flat, positions, values, op=op, base=base, lanes=lanes)


def fuses_ulp(flat: torch.Tensor, positions: torch.Tensor) -> bool:
    """:meth:`~dcr_format.delta.backend.Backend.fuses_ulp` on the backend of ``flat``."""
    return backend_for(flat).fuses_ulp(flat, positions)


def ulp_on_device(flat: torch.Tensor) -> bool:
    """:meth:`~dcr_format.delta.backend.Backend.ulp_on_device` on the backend of ``flat``."""
    return backend_for(flat).ulp_on_device(flat)


__all__ = [
    "apply_ulp_with_lanes",
    "apply_with_lanes",
    "changed_positions",
    "diff",
    "diff_with_lanes",
    "fuses_ulp",
    "scatter",
    "stage_change",
    "ulp_on_device",
]
