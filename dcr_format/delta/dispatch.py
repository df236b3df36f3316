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

CPU tensors under ``auto`` (where :func:`backend_for` says ``torch``) go through the
compiled numba loops of :mod:`dcr_format.kernels.numba_kernels` when numba imports: one fused
compare-and-compact pass for :func:`diff` (per block, in parallel: count the differing
elements and note their in-block indices; a prefix sum; then per block gather the
noted elements only) and one pass over the changed positions for :func:`scatter`.
``DCR_KERNELS=torch`` forces the torch reference (:mod:`dcr_format.kernels.reference`),
which the compiled loops match bit for bit; ``DCR_KERNELS=triton`` keeps Triton (its
interpreter on CPU tensors). The same ``torch`` setting turns off the compiled Rice
coding and fingerprint loops (:func:`dcr_format.kernels.native.native_kernels`).

:func:`diff_with_lanes` and :func:`apply_with_lanes` also return the fingerprint lane
deltas of the change (``sum (g(new) - g(old)) * r`` per lane, see
:mod:`dcr_format.delta.fingerprint`), computed in the same pass on the CPU, so a writer or
reader never reads the changed elements a second time to update a fingerprint.

Triton and numba are imported lazily, so ``import dcr_format`` works without them.
Every function takes flat integer bit views (see ``dcr_format.format.dtypes.bits_view``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from functools import lru_cache
from types import ModuleType

import numpy as np
import torch

from dcr_format.errors import DcrError
from dcr_format.kernels import reference
from dcr_format.kernels.reference import OVERWRITE, XOR, Diff
from dcr_format.system.environ import getenv

ENV = "DCR_KERNELS"
MODES = ("auto", "triton", "torch")
TRITON = "triton"
TORCH = "torch"


class KernelsUnavailableError(DcrError, RuntimeError):
    """``DCR_KERNELS=triton`` was asked for where the Triton kernels cannot run."""


def kernels_mode() -> str:
    """The ``DCR_KERNELS`` setting: ``auto``, ``triton`` or ``torch``."""
    raw = getenv(ENV)
    if raw is None:  # the common case, a dozen times a tensor
        return "auto"
    mode = raw.strip().lower() or "auto"
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


# bit-view dtypes the compiled loops take (``bits_view`` gives these)
_NATIVE_DTYPES = {
    torch.uint8: np.uint8,
    torch.int8: np.uint8,
    torch.int16: np.uint16,
    torch.int32: np.uint32,
    torch.int64: np.uint64,
}


def _native_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled CPU kernels, where ``auto`` applies them to these tensors; else None.

    Every tensor must be on the CPU with a bit-view dtype (positions: int64).
    """
    return _compiled_for(tensors) if kernels_mode() == "auto" else None


def _torch_native(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled CPU kernels where :func:`backend_for` these tensors is torch and
    :func:`_native_for` takes them (what the two say together, from one read of
    ``DCR_KERNELS``: this runs several times a tensor)."""
    mode = kernels_mode()
    if mode == "auto":
        return _compiled_for(tensors)
    if mode == TRITON:
        backend_for(*tensors)  # refuses CPU tensors where Triton cannot run
    return None


def _compiled_for(tensors: tuple[torch.Tensor, ...]) -> ModuleType | None:
    """The compiled CPU kernels for ``tensors`` once ``DCR_KERNELS`` is known to be ``auto``:
    None unless every tensor is on the CPU with a bit-view dtype, or where numba is
    unusable."""
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.dtype not in _NATIVE_DTYPES:
            return None
    from dcr_format.kernels.native import compiled_kernels

    return compiled_kernels()


def _unsigned(tensor: torch.Tensor) -> np.ndarray:
    """The numpy unsigned view of a contiguous CPU bit view (shares its memory)."""
    return tensor.detach().numpy().view(_NATIVE_DTYPES[tensor.dtype])


def _lane_count(width: int) -> int:
    return 3 if width == 8 else 2


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
        native = _native_for(self.old, self.new)
        if native is not None:
            return _native_diff(
                native,
                self.old,
                self.new,
                want_new=self.want_new,
                want_xor=self.want_xor,
                base=self.base,
                lanes=False,
            )[0]
        return reference.diff(
            self.old, self.new, want_new=self.want_new, want_xor=self.want_xor, base=self.base
        )

    def finish(self) -> Diff:
        """Compact the change (queued on the current stream for Triton on CUDA)."""
        total = self.total()
        if self.backend == TORCH:
            return self._diff
        found: Diff = _kernels().compact(
            self._scan, total, want_new=self.want_new, want_xor=self.want_xor, base=self.base
        )
        return found


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


def _native_diff(
    native: ModuleType,
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    want_new: bool,
    want_xor: bool,
    base: int,
    lanes: bool,
    advance: bool = False,
) -> tuple[Diff, tuple[int, ...]]:
    """The fused CPU diff: positions, new and xor bits, and lane deltas from one pass
    (``advance``: ``old``, contiguous, takes the new bits in that pass)."""
    from dcr_format.delta.fingerprint import native_table

    old, new = old.reshape(-1).contiguous(), new.reshape(-1).contiguous()
    width = old.element_size()
    (positions, new_bits, xor_bits), deltas = native.diff(
        _unsigned(old),
        _unsigned(new),
        base,
        (want_new, want_xor),
        native_table(width),
        _lane_count(width) if lanes else 0,
        advance,
    )
    new_values = torch.from_numpy(new_bits).view(old.dtype)
    xor_values = torch.from_numpy(xor_bits).view(old.dtype)
    positions = torch.from_numpy(positions)
    found = Diff(positions, new_values if want_new else None, xor_values if want_xor else None)
    return found, deltas


def _change_lanes(
    positions: torch.Tensor, before: torch.Tensor, after: torch.Tensor
) -> tuple[int, ...]:
    """Lane deltas ``sum (g(after) - g(before)) * r`` on any device (the reference path)."""
    from dcr_format.delta.fingerprint import lanes_after_change

    zero = (0,) * _lane_count(before.element_size())
    if positions.numel() == 0:
        return zero
    return lanes_after_change(zero, positions, before, after)


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
    """:func:`diff`, and the fingerprint lane deltas of changing ``old`` into ``new``.

    The deltas are ``sum (g(new) - g(old)) * r(p)`` modulo each lane prime over the
    changed positions ``p`` (``base`` added, so a slice of a tensor gives its share), two
    lanes for widths up to 4 bytes, three for 8: the tensor's new lanes are
    ``apply_lane_deltas(old_lanes, deltas)`` (:mod:`dcr_format.delta.fingerprint`). On the CPU
    both come from one fused pass; elsewhere the lanes are summed over the changed
    elements after the diff. ``lanes=False`` skips them (returns ``()``).

    ``advance``: ``old`` (contiguous) is brought to ``new`` at the changed positions (on
    the CPU in the same pass), so a writer's baseline needs no second pass; undoing that
    is the caller's (``old ^= xor`` at the positions, or the old bits put back).
    """
    _check_pair(old, new)
    if advance and not old.is_contiguous():
        raise ValueError("advance needs a contiguous old tensor (it is written in place)")
    old, new = old.reshape(-1), new.reshape(-1)
    native = _torch_native(old, new)
    if native is not None:
        return _native_diff(
            native,
            old,
            new,
            want_new=want_new,
            want_xor=want_xor,
            base=base,
            lanes=lanes,
            advance=advance,
        )
    found = diff(old, new, want_new=want_new or lanes or advance, want_xor=want_xor, base=base)
    deltas: tuple[int, ...] = ()
    if lanes:
        assert found.new_values is not None
        index = found.positions - base if base else found.positions
        deltas = _change_lanes(found.positions, old[index], found.new_values)
    if advance:
        assert found.new_values is not None
        scatter(old, found.positions, found.new_values, op=OVERWRITE, base=base)
    if not want_new and found.new_values is not None:
        found = Diff(found.positions, None, found.xor_values)
    return found, deltas


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
    if op == ULP:
        raise ValueError(f"scatter op must be {XOR!r} or {OVERWRITE!r}, not {op!r}")
    native = _native_apply_for(flat, positions, values, op)
    if native is not None:
        old = _native_apply(native, flat, positions, values, op=op, base=base, lanes=False)[0]
        return old if save else None
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
    saved: torch.Tensor | None = _kernels().scatter(
        flat, positions, values, op=op, save=save, base=base
    )
    return saved


def _native_apply_for(
    flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, op: str
) -> ModuleType | None:
    """The compiled kernels where they can apply this change in place, else None (the
    backend is Triton, or the tensors are not theirs); ``ValueError`` for an unknown op, or
    for ``ulp`` where they cannot apply it (:func:`fuses_ulp`)."""
    if op not in (XOR, OVERWRITE, ULP):
        raise ValueError(f"scatter op must be {XOR!r} or {OVERWRITE!r}, not {op!r}")
    native = _native_apply_candidate(flat, positions, values)
    if op == ULP and native is None:
        raise ValueError("ulp changes apply only through the compiled CPU kernels (fuses_ulp)")
    return native


def _native_apply_candidate(
    flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor
) -> ModuleType | None:
    native = _torch_native(flat, positions, values)
    if native is None or positions.dtype != torch.int64 or values.dtype != flat.dtype:
        return None
    if not flat.is_contiguous() or flat.dim() != 1 or values.numel() != positions.numel():
        return None
    return native


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


ULP = "ulp"
"""The op of a change whose values are zigzag ulp differences from the old bits (FORMAT.md
§7.5): the compiled CPU kernels apply it (reading the old bits, writing the new ones and
summing the lane deltas in one pass), or the Triton kernels on the tensor's device
(:func:`fuses_ulp`)."""
_MODES = {OVERWRITE: 0, XOR: 1, ULP: 2}  # the compiled kernels' modes (codec/_native.py)


def fuses_ulp(flat: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether :func:`apply_ulp_with_lanes` and :func:`stage_change` (``op="ulp"``) take a
    change of these tensors (the compiled CPU kernels apply it: the conditions of
    :func:`_native_apply_candidate`; or the Triton kernels, :func:`ulp_on_device`, with the
    positions moved to ``flat``'s device), so a reader need not turn ulp differences into
    XOR bits first (a second pass over the positions)."""
    return (
        positions.dtype == torch.int64
        and flat.is_contiguous()
        and flat.dim() == 1
        and (ulp_on_device(flat) or _torch_native(flat, positions) is not None)
    )


_ULP_DTYPES = (torch.int16, torch.int32, torch.int64)  # bit views of the float widths


def ulp_on_device(flat: torch.Tensor) -> bool:
    """Whether the ``ulp`` coding's passes over a change of ``flat`` (a flat bit view) run
    as Triton kernels on its device (:func:`ulp_of_change`, :func:`apply_ulp_with_lanes`):
    CUDA tensors with Triton, or any under ``DCR_KERNELS=triton`` (the interpreter on CPU)."""
    if flat.dtype not in _ULP_DTYPES:
        return False
    mode = kernels_mode()
    if mode == TORCH or (mode == "auto" and flat.device.type != "cuda"):
        return False
    return backend_for(flat) == TRITON


def ulp_of_change(
    flat: torch.Tensor,
    positions: torch.Tensor,
    xor_values: torch.Tensor,
    new_values: torch.Tensor | None = None,
    *,
    want_old: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The zigzag ulp differences (FORMAT.md §7.5) of a change found on ``flat``'s device,
    computed there: its new bits are ``new_values`` where the diff kept them, else ``flat``
    at ``positions`` (``flat`` holds the new bits); its old bits those XOR ``xor_values``,
    returned too where ``want_old``. Triton kernels where :func:`ulp_on_device`, else the
    torch reference; signed bit views of 2, 4 or 8 bytes."""
    if not ulp_on_device(flat):
        z, old = reference.ulp_of_change(flat, positions, xor_values, new_values)
        return z, (old if want_old else None)
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


def ulp_step(before: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The bits ``z`` zigzag ulp differences away from ``before``, elementwise on their
    device (torch; signed bit views of 2, 4 or 8 bytes)."""
    return reference.ulp_step(before, z.to(before.device))


def _device_ulp(
    flat: torch.Tensor, positions: torch.Tensor, z: torch.Tensor, *, write: bool, lanes: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """The Triton ``ulp`` apply (``write``) or stage of a change: the bits before and after
    at the positions, and the lane deltas (``lanes``)."""
    positions = to_device(positions, flat.device).reshape(-1).contiguous()
    z = to_device(z, flat.device).reshape(-1).contiguous()
    if z.dtype != flat.dtype or z.numel() != positions.numel():
        raise ValueError(f"{z.numel()} {z.dtype} differences for {positions.numel()} positions")
    if positions.numel():  # the kernel does not check bounds: torch indexing would
        low, high = (int(v) for v in torch.aminmax(positions))
        if low < 0 or high >= flat.numel():
            raise IndexError(
                f"position {low if low < 0 else high} is out of range for {flat.numel()} elements"
            )
    before, after = _kernels().apply_ulp(flat, positions, z, write=write)
    return before, after, (_change_lanes(positions, before, after) if lanes else ())


def _native_apply(
    native: ModuleType,
    flat: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    op: str,
    base: int,
    lanes: bool,
    before: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    """The fused CPU apply: old bits read (unless ``before`` holds them: read from ``flat``
    at the positions by the caller, nothing written there since), new bits written
    (returned too for ``ulp``) and lane deltas, one pass."""
    from dcr_format.delta.fingerprint import native_table

    positions, values = positions.reshape(-1).contiguous(), values.reshape(-1).contiguous()
    count = positions.numel()
    target, where = _unsigned(flat), positions.numpy()
    _check_bounds(where, base, flat.numel())
    gathered = (
        before is not None
        and before.device.type == "cpu"
        and before.dtype == flat.dtype
        and before.shape == (count,)
    )
    if before is None or not gathered:
        before = torch.empty(count, dtype=flat.dtype)
    else:
        before = before.contiguous()
    after = torch.empty(count if op == ULP else 0, dtype=flat.dtype)
    width = flat.element_size()
    in_range, deltas = native.apply(
        target,
        where,
        _unsigned(values),
        base,
        _MODES[op],
        (_unsigned(before), _unsigned(after)),
        native_table(width),
        _lane_count(width) if lanes else 0,
        gathered=gathered,
    )
    if not in_range:
        # undo the in-range part (the kernel skips the same positions again): xor is its
        # own inverse, overwrite (and ulp) put back the bits it read
        undo, mode = (values, _MODES[XOR]) if op == XOR else (before, _MODES[OVERWRITE])
        scratch = (_unsigned(before.clone()), _unsigned(after[:0]))
        native.apply(target, where, _unsigned(undo), base, mode, scratch, native_table(width), 0)
        raise IndexError(
            "positions are not strictly increasing and some are out of range; nothing was "
            "applied: pass the positions of a verified decoder"
        )
    return before, (after if op == ULP else None), deltas


def apply_with_lanes(
    flat: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    op: str,
    base: int = 0,
    lanes: bool = True,
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """In place ``flat[p - base] ^= v`` (``xor``) or ``= v`` (``overwrite``), with lane deltas.

    Returns the bits at the positions before the change (undo: ``xor`` applies the same
    values again, ``overwrite`` applies the returned bits) and the fingerprint lane deltas
    ``sum (g(after) - g(before)) * r(p)`` of the bits actually read and written (see
    :func:`diff_with_lanes`; ``lanes=False``: ``()``). ``positions`` must be unique and
    strictly increasing (a verified decoder's output), int64, on ``flat``'s device;
    ``flat`` a contiguous flat bit view. On the CPU this is one pass over the positions;
    out-of-range positions raise :class:`IndexError`.
    """
    if op == ULP:
        raise ValueError("apply ulp changes with apply_ulp_with_lanes")
    native = _native_apply_for(flat, positions, values, op)
    if native is not None:
        old, _, deltas = _native_apply(
            native, flat, positions, values, op=op, base=base, lanes=lanes
        )
        return old, deltas
    before = scatter(flat, positions, values, op=op, save=True, base=base)
    assert before is not None
    if not lanes:
        return before, ()
    after = before ^ values if op == XOR else values
    return before, _change_lanes(positions, before, after)


def apply_ulp_with_lanes(
    flat: torch.Tensor,
    positions: torch.Tensor,
    z: torch.Tensor,
    *,
    lanes: bool = True,
    before: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """In place: each element at ``positions`` moved by its zigzag ulp difference ``z``
    (FORMAT.md §7.5), in one pass that also sums the lane deltas. Returns the bits before
    and after the change and its lane deltas (undo: put ``before`` back). ``before``, where
    given (a host tensor of ``flat``'s dtype, one element per position): the bits at the
    positions, read from ``flat`` by the caller with nothing written there since, so the
    pass does not read them again. Only where :func:`fuses_ulp` (else ``ValueError``); the
    input rules of :func:`apply_with_lanes`."""
    if ulp_on_device(flat):
        return _device_ulp(flat, positions, z, write=True, lanes=lanes)
    native = _native_apply_for(flat, positions, z, ULP)
    assert native is not None
    before, after, deltas = _native_apply(
        native, flat, positions, z, op=ULP, base=0, lanes=lanes, before=before
    )
    assert after is not None
    return before, after, deltas


def stage_change(
    flat: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    op: str,
    base: int = 0,
    lanes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """What :func:`apply_with_lanes` would do, without writing: the bits at the positions
    now (``before``), the bits the change puts there (``after``: ``before ^ v`` for
    ``xor``, ``v`` for ``overwrite``, ``v`` ulps from ``before`` for ``ulp``, where
    :func:`fuses_ulp`) and the lane deltas of that change.

    ``flat`` is only read, so it can stay in use; writing ``after`` later (an
    ``overwrite`` of the same positions) makes the change. Same input rules and errors as
    :func:`apply_with_lanes`.
    """
    if op == ULP and base == 0 and ulp_on_device(flat):
        return _device_ulp(flat, positions, values, write=False, lanes=lanes)
    native = _native_apply_for(flat, positions, values, op)
    if native is None:
        count = positions.numel()
        if count and (int(positions.min()) < base or int(positions.max()) >= base + flat.numel()):
            raise IndexError(f"positions are out of range for {flat.numel()} elements at {base}")
        before = flat[positions - base] if base else flat[positions]
        after = before ^ values if op == XOR else values.clone()
        return before, after, (_change_lanes(positions, before, after) if lanes else ())
    from dcr_format.delta.fingerprint import native_table

    positions, values = positions.reshape(-1).contiguous(), values.reshape(-1).contiguous()
    _check_bounds(positions.numpy(), base, flat.numel())
    before = torch.empty(positions.numel(), dtype=flat.dtype)
    after = torch.empty(positions.numel(), dtype=flat.dtype)
    width = flat.element_size()
    in_range, deltas = native.stage(
        _unsigned(flat),
        positions.numpy(),
        _unsigned(values),
        base,
        _MODES[op],
        (_unsigned(before), _unsigned(after)),
        native_table(width),
        _lane_count(width) if lanes else 0,
    )
    if not in_range:
        raise IndexError(
            "positions are not strictly increasing and some are out of range: pass the "
            "positions of a verified decoder"
        )
    return before, after, deltas


def expand_ranges(starts: torch.Tensor, lengths: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of runs ``[starts[r], starts[r] + lengths[r])`` (int64, ``count`` in all)."""
    if backend_for(starts, lengths) == TORCH:
        return reference.expand_ranges(starts, lengths, count)
    expanded: torch.Tensor = _kernels().expand_ranges(
        starts.contiguous(), lengths.contiguous(), count
    )
    return expanded


def exponent_histograms(
    old: torch.Tensor, positions: torch.Tensor, shift: int, mask: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exponent histograms of flat integer bits over all elements and over ``positions``
    (torch's bincount on the tensors' own device, every backend)."""
    return reference.exponent_histograms(old, positions, shift, mask)


def class_ranks(
    old: torch.Tensor, positions: torch.Tensor, shift: int, mask: int, base: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's class and rank for the ``classed`` coding (FORMAT.md §6.5), on the
    tensors' device: Triton kernels for CUDA tensors, the torch reference elsewhere."""
    if backend_for(old, positions) == TORCH:
        return reference.class_ranks(old, positions, shift, mask, base, count)
    found: tuple[torch.Tensor, torch.Tensor] = _kernels().class_ranks(
        old.contiguous(), positions.contiguous(), shift, mask, base, count
    )
    return found


def class_sizes(old: torch.Tensor, shift: int, mask: int, base: int, count: int) -> torch.Tensor:
    """How many elements of flat integer bits ``old`` each ``classed`` class has (§6.5)."""
    if backend_for(old) == TORCH:
        return reference.class_sizes(old, shift, mask, base, count)
    sizes: torch.Tensor = _kernels().class_sizes(old.contiguous(), shift, mask, base, count)
    return sizes


def class_positions(
    old: torch.Tensor,
    shift: int,
    mask: int,
    base: int,
    count: int,
    classes: torch.Tensor,
    ranks: torch.Tensor,
) -> torch.Tensor:
    """The positions, increasing, of the given (class, rank) elements of ``old`` (§6.5),
    on its device: Triton kernels for CUDA tensors, the torch reference elsewhere."""
    if backend_for(old, classes, ranks) == TORCH:
        return reference.class_positions(old, shift, mask, base, count, classes, ranks)
    found: torch.Tensor = _kernels().class_positions(
        old.contiguous(), shift, mask, base, count, classes.contiguous(), ranks.contiguous()
    )
    return found


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
    "apply_with_lanes",
    "backend_for",
    "changed_positions",
    "diff",
    "diff_with_lanes",
    "expand_ranges",
    "kernels_mode",
    "prefix_positions",
    "scatter",
    "to_device",
    "to_host",
    "ulp_of_change",
    "ulp_on_device",
    "ulp_step",
]
