"""One tensor's kernels behind one interface: :class:`Backend`, the torch reference.

A backend diffs two bit views (positions and new/XOR bits, with the change's fingerprint
lane deltas, optionally advancing the old view), applies and stages a change (``xor``,
``overwrite``, or ``ulp`` differences stepped from the old bits), and runs the ``classed``
coding's class passes. :class:`Backend` does all of it with the torch reference of
:mod:`dcr_format.kernels.reference` on the tensors' own device; the compiled CPU loops
(:class:`~dcr_format.delta.backend_numba.NumbaBackend`) and the Triton kernels
(:class:`~dcr_format.delta.backend_triton.TritonBackend`) subclass it and override what
their kernels take, with the same bits. :func:`dcr_format.delta.backends.backend_for` picks
one from ``DCR_KERNELS``.

Every method takes flat integer bit views (see ``dcr_format.format.dtypes.bits_view``).
:meth:`Backend.diff_with_lanes` and :meth:`Backend.apply_with_lanes` also return the
fingerprint lane deltas of the change (``sum (g(new) - g(old)) * r`` per lane, see
:mod:`dcr_format.delta.fingerprint`), computed in the same pass on the CPU, so a writer or
reader never reads the changed elements a second time to update a fingerprint.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from dcr_format.errors import ArgumentError, DcrError
from dcr_format.format.dtypes import bits_view, flat
from dcr_format.kernels import reference
from dcr_format.kernels.reference import OVERWRITE, XOR, ClassPlan, Diff
from dcr_format.system.environ import getenv

ENV = "DCR_KERNELS"
MODES = ("auto", "triton", "torch")
TRITON = "triton"
TORCH = "torch"
NUMBA = "numba"

ULP = "ulp"
"""The op of a change whose values are zigzag ulp differences from the old bits (FORMAT.md
§7.5): the compiled CPU kernels apply it (reading the old bits, writing the new ones and
summing the lane deltas in one pass), or the Triton kernels on the tensor's device
(:meth:`Backend.fuses_ulp`)."""


class KernelsUnavailableError(DcrError, RuntimeError):
    """``DCR_KERNELS=triton`` was asked for where the Triton kernels cannot run."""


def kernels_mode() -> str:
    """The ``DCR_KERNELS`` setting: ``auto``, ``triton`` or ``torch``."""
    raw = getenv(ENV)
    if raw is None:
        return "auto"
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        raise ArgumentError(
            f"{ENV}={raw!r} is not one of {', '.join(MODES)}; set it to one of those, or unset it"
        )
    return mode


@lru_cache(maxsize=1)
def triton_installed() -> bool:
    """Whether Triton can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def lane_count(width: int) -> int:
    """Fingerprint lanes of a dtype of ``width`` bytes (FORMAT.md §9.1)."""
    return 3 if width == 8 else 2


def change_lanes(
    positions: torch.Tensor, before: torch.Tensor, after: torch.Tensor
) -> tuple[int, ...]:
    """Lane deltas ``sum (g(after) - g(before)) * r`` on any device (the reference path)."""
    from dcr_format.delta.fingerprint import lanes_after_change

    zero = (0,) * lane_count(before.element_size())
    if positions.numel() == 0:
        return zero
    return lanes_after_change(zero, positions, before, after)


def check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    """Refuse two bit views that cannot be diffed (dtype, size or device differ)."""
    if old.dtype != new.dtype or old.numel() != new.numel():
        raise ValueError(
            f"cannot diff {old.dtype}[{old.numel()}] against {new.dtype}[{new.numel()}]"
        )
    if not (old.is_cpu and new.is_cpu) and old.device != new.device:  # no device objects
        raise ValueError(f"cannot diff tensors on {old.device} and {new.device}")


def check_op(op: str) -> None:
    """Refuse an op that is not ``xor``, ``overwrite`` or ``ulp``."""
    if op not in (XOR, OVERWRITE, ULP):
        raise ValueError(f"scatter op must be {XOR!r} or {OVERWRITE!r}, not {op!r}")


class PendingDiff:
    """A diff whose first pass is launched; :meth:`finish` compacts it.

    With Triton on CUDA the counting pass, the prefix sum and the copy of the
    changed-element total to pinned host memory are queued on the current stream
    and nothing waits; :meth:`total` waits for that copy only. Elsewhere everything
    happens in :meth:`total` (this class: the backend's one-pass diff).
    """

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
        self.backend = backend
        self.old, self.new = old, new
        self.want_new, self.want_xor, self.base = want_new, want_xor, base
        self._diff: Diff | None = None

    def total(self) -> int:
        """The number of changed elements (waits for the first pass on a device)."""
        if self._diff is None:
            backend, old, new = self.backend, self.old, self.new
            fused = backend._fused_diff(old, new, self.want_new, self.want_xor, self.base)
            self._diff = (
                fused[0]
                if fused is not None
                else backend._diff_once(
                    old, new, want_new=self.want_new, want_xor=self.want_xor, base=self.base
                )
            )
        return self._diff.changed

    def finish(self) -> Diff:
        """Compact the change (queued on the current stream for Triton on CUDA)."""
        self.total()
        assert self._diff is not None
        return self._diff


def check_segments(positions: torch.Tensor, starts: np.ndarray, sizes: Sequence[int]) -> None:
    """Raise :class:`IndexError` unless ``starts`` bounds one segment of ``positions`` per
    size and each segment's first and last position lie below its size (the positions of a
    segment are strictly increasing: all of them do then)."""
    where = np.asarray(starts, dtype=np.int64)
    if where.shape != (len(sizes) + 1,) or where[0] != 0 or where[-1] != positions.numel():
        raise IndexError("the segments do not cover the positions once per tensor")
    counts = np.diff(where)
    if (counts < 0).any():
        raise IndexError("the segments do not cover the positions once per tensor")
    full = counts > 0
    if not full.any():
        return
    flat = positions.reshape(-1)
    ends = np.stack([where[:-1][full], where[1:][full] - 1])
    if flat.is_cpu:  # numpy's gather: torch's costs milliseconds at thousands of tensors
        firsts, lasts = flat.numpy()[ends]
    else:
        firsts, lasts = flat[torch.from_numpy(ends).to(flat.device)].cpu().numpy()
    bound = np.asarray(sizes, dtype=np.int64)[full]
    if (firsts < 0).any() or (lasts >= bound).any():
        raise IndexError("positions are out of range: pass the positions of a verified decoder")


class Backend:
    """The torch reference (:mod:`dcr_format.kernels.reference`) on the tensors' own device;
    the other backends subclass it and override what their kernels take."""

    name = TORCH
    """``torch``, ``numba`` or ``triton``."""

    def start_diff(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        *,
        want_new: bool = True,
        want_xor: bool = True,
        base: int = 0,
    ) -> PendingDiff:
        """Launch a diff (:class:`PendingDiff`: Triton queues its first pass and waits for
        nothing)."""
        check_pair(old, new)
        old, new = old.reshape(-1), new.reshape(-1)
        return PendingDiff(self, old, new, want_new=want_new, want_xor=want_xor, base=base)

    def diff(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        *,
        want_new: bool = True,
        want_xor: bool = True,
        base: int = 0,
    ) -> Diff:
        """Positions (+ ``base``) where ``old`` and ``new`` differ, with the new and/or XOR
        bits."""
        return self.start_diff(old, new, want_new=want_new, want_xor=want_xor, base=base).finish()

    def changed_positions(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Sorted int64 flat indices where the bits of two views differ."""
        return self.diff(old, new, want_new=False, want_xor=False).positions

    def diff_with_lanes(
        self,
        old: torch.Tensor,
        new: torch.Tensor,
        *,
        want_new: bool = True,
        want_xor: bool = True,
        base: int = 0,
        lanes: bool = True,
        advance: bool = False,
        ranking: ClassPlan | None = None,
    ) -> tuple[Diff, tuple[int, ...]]:
        """:meth:`diff`, and the fingerprint lane deltas of changing ``old`` into ``new``.

        The deltas are ``sum (g(new) - g(old)) * r(p)`` modulo each lane prime over the
        changed positions ``p`` (``base`` added, so a slice of a tensor gives its share), two
        lanes for widths up to 4 bytes, three for 8: the tensor's new lanes are
        ``apply_lane_deltas(old_lanes, deltas)`` (:mod:`dcr_format.delta.fingerprint`). On
        the CPU both come from one fused pass; elsewhere the lanes are summed over the
        changed elements after the diff. ``lanes=False`` skips them (returns ``()``).

        ``advance``: ``old`` (contiguous) is brought to ``new`` at the changed positions (on
        the CPU in the same pass), so a writer's baseline needs no second pass; undoing that
        is the caller's (``old ^= xor`` at the positions, or the old bits put back).

        ``ranking``: the classes a writer's ``classed`` positions will likely use; where the
        fused pass runs, it also ranks each change in its class of ``ranking`` while it
        reads the old bits (:attr:`Diff.ranked`), elsewhere the diff carries no ranks.
        """
        check_pair(old, new)
        if advance and not old.is_contiguous():
            raise ValueError("advance needs a contiguous old tensor (it is written in place)")
        old, new = flat(old), flat(new)
        fused = self._fused_diff(old, new, want_new, want_xor, base, lanes, advance, ranking)
        if fused is not None:
            return fused
        found = self._diff_once(
            old, new, want_new=want_new or lanes or advance, want_xor=want_xor, base=base
        )
        deltas: tuple[int, ...] = ()
        if lanes:
            assert found.new_values is not None
            index = found.positions - base if base else found.positions
            deltas = change_lanes(found.positions, old[index], found.new_values)
        if advance:
            assert found.new_values is not None
            self.scatter(old, found.positions, found.new_values, op=OVERWRITE, base=base)
        if not want_new and found.new_values is not None:
            found = Diff(found.positions, None, found.xor_values)
        return found, deltas

    def _diff_once(
        self, old: torch.Tensor, new: torch.Tensor, *, want_new: bool, want_xor: bool, base: int
    ) -> Diff:
        """The plain diff of flat views (Triton: its two passes)."""
        return reference.diff(old, new, want_new=want_new, want_xor=want_xor, base=base)

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
        """The diff, lanes and advance (and the ranks of ``ranking``, where given) in one
        pass where the backend's kernels take these tensors; None elsewhere."""
        return None

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
        """In place ``flat[p - base] ^= v`` (``xor``) or ``= v`` (``overwrite``) at unique
        positions.

        Returns the old bits at the positions when ``save`` (else None). ``flat`` must be a
        contiguous flat view; ``positions`` and ``values`` on its device.
        """
        if op == ULP:
            raise ValueError(f"scatter op must be {XOR!r} or {OVERWRITE!r}, not {op!r}")
        check_op(op)
        return reference.scatter(flat, positions, values, op=op, save=save, base=base)

    def put(
        self, flat: torch.Tensor, positions: torch.Tensor, bits: torch.Tensor, *, keep: bool = False
    ) -> torch.Tensor | None:
        """In place ``flat[p] = b``: the write of a change whose old bits were read before
        (a staged change's), positions as for :meth:`apply_with_lanes`; ``keep``: returns
        the bits it replaced (else None). The backends with a leaner loop for it than
        :meth:`scatter` override it."""
        return self.scatter(flat, positions, bits, op=OVERWRITE, save=keep)

    def put_segments(
        self,
        targets: Sequence[torch.Tensor],
        positions: torch.Tensor,
        bits: torch.Tensor,
        starts: np.ndarray,
        *,
        keep: bool = False,
    ) -> torch.Tensor | None:
        """:meth:`put` of segment ``t`` of ``positions``/``bits`` (``starts[t]`` to
        ``starts[t + 1]``, int64; positions strictly increasing within a segment) into the
        bits of ``targets[t]`` (contiguous tensors of ``bits``'s width, any dtype) for every
        ``t``, in one pass where the backend can: the write of a version's staged changes.
        ``keep``: returns the bits it replaced, end to end (else None). Whole or nothing:
        every segment is checked to lie in its tensor first (:class:`IndexError`), and a
        write that fails part way puts back what it wrote before raising."""
        flats = [bits_view(t).reshape(-1) for t in targets]
        check_segments(positions, starts, [f.numel() for f in flats])
        replaced = torch.empty_like(bits)
        done = 0
        try:
            for done, flat in enumerate(flats):
                lo, hi = int(starts[done]), int(starts[done + 1])
                old = self.put(flat, positions[lo:hi], bits[lo:hi], keep=True)
                assert old is not None
                replaced[lo:hi] = old
        except BaseException:  # whole or nothing: the segments written are put back
            for t in range(done):
                lo, hi = int(starts[t]), int(starts[t + 1])
                self.put(flats[t], positions[lo:hi], replaced[lo:hi])
            raise
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
        """In place ``flat[p - base] ^= v`` (``xor``) or ``= v`` (``overwrite``), with lane
        deltas.

        Returns the bits at the positions before the change (undo: ``xor`` applies the same
        values again, ``overwrite`` applies the returned bits) and the fingerprint lane
        deltas ``sum (g(after) - g(before)) * r(p)`` of the bits actually read and written
        (see :meth:`diff_with_lanes`; ``lanes=False``: ``()``). ``positions`` must be unique
        and strictly increasing (a verified decoder's output), int64, on ``flat``'s device;
        ``flat`` a contiguous flat bit view. On the CPU this is one pass over the positions;
        out-of-range positions raise :class:`IndexError`.
        """
        if op == ULP:
            raise ValueError("apply ulp changes with apply_ulp_with_lanes")
        check_op(op)
        before = self.scatter(flat, positions, values, op=op, save=True, base=base)
        assert before is not None
        if not lanes:
            return before, ()
        after = before ^ values if op == XOR else values
        return before, change_lanes(positions, before, after)

    def ulp_on_device(self, flat: torch.Tensor) -> bool:
        """Whether the ``ulp`` coding's passes over a change of ``flat`` (a flat bit view)
        run as Triton kernels on its device (:meth:`ulp_of_change`,
        :meth:`apply_ulp_with_lanes`)."""
        return False

    def fuses_ulp(self, flat: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether :meth:`apply_ulp_with_lanes` and :meth:`stage_change` (``op="ulp"``) take
        a change of these tensors (the compiled CPU kernels, or the Triton kernels,
        :meth:`ulp_on_device`, with the positions moved to ``flat``'s device), so a reader
        need not turn ulp differences into XOR bits first (a second pass over the
        positions)."""
        return False

    def ulp_of_change(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        xor_values: torch.Tensor,
        new_values: torch.Tensor | None = None,
        *,
        want_old: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The zigzag ulp differences (FORMAT.md §7.5) of a change found on ``flat``'s
        device, computed there: its new bits are ``new_values`` where the diff kept them,
        else ``flat`` at ``positions`` (``flat`` holds the new bits); its old bits those XOR
        ``xor_values``, returned too where ``want_old``. Signed bit views of 2, 4 or 8
        bytes."""
        z, old = reference.ulp_of_change(flat, positions, xor_values, new_values)
        return z, (old if want_old else None)

    def ulp_step(self, before: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The bits ``z`` zigzag ulp differences away from ``before``, elementwise on their
        device (torch; signed bit views of 2, 4 or 8 bytes)."""
        return reference.ulp_step(before, z.to(before.device))

    def apply_ulp_with_lanes(
        self,
        flat: torch.Tensor,
        positions: torch.Tensor,
        z: torch.Tensor,
        *,
        lanes: bool = True,
        before: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """In place: each element at ``positions`` moved by its zigzag ulp difference ``z``
        (FORMAT.md §7.5), in one pass that also sums the lane deltas. Returns the bits
        before and after the change and its lane deltas (undo: put ``before`` back).
        ``before``, where given (a host tensor of ``flat``'s dtype, one element per
        position): the bits at the positions, read from ``flat`` by the caller with nothing
        written there since, so the pass does not read them again. Only where
        :meth:`fuses_ulp` (else ``ValueError``); the input rules of
        :meth:`apply_with_lanes`."""
        raise ValueError("ulp changes apply only through the compiled CPU kernels (fuses_ulp)")

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
        """What :meth:`apply_with_lanes` would do, without writing: the bits at the
        positions now (``before``), the bits the change puts there (``after``: ``before ^
        v`` for ``xor``, ``v`` for ``overwrite``, ``v`` ulps from ``before`` for ``ulp``,
        where :meth:`fuses_ulp`) and the lane deltas of that change.

        ``flat`` is only read, so it can stay in use; writing ``after`` later (an
        ``overwrite`` of the same positions) makes the change. Same input rules and errors
        as :meth:`apply_with_lanes`.
        """
        check_op(op)
        if op == ULP:
            raise ValueError("ulp changes apply only through the compiled CPU kernels (fuses_ulp)")
        count = positions.numel()
        if count and (int(positions.min()) < base or int(positions.max()) >= base + flat.numel()):
            raise IndexError(f"positions are out of range for {flat.numel()} elements at {base}")
        before = flat[positions - base] if base else flat[positions]
        after = before ^ values if op == XOR else values.clone()
        return before, after, (change_lanes(positions, before, after) if lanes else ())

    def expand_ranges(
        self, starts: torch.Tensor, lengths: torch.Tensor, count: int
    ) -> torch.Tensor:
        """Positions of runs ``[starts[r], starts[r] + lengths[r])`` (int64, ``count`` in
        all)."""
        return reference.expand_ranges(starts, lengths, count)

    def prefix_positions(self, gaps: torch.Tensor) -> torch.Tensor:
        """Positions from zero-based gaps (a torch cumulative sum on every backend)."""
        return reference.prefix_positions(gaps)

    def exponent_histograms(
        self, old: torch.Tensor, positions: torch.Tensor, shift: int, mask: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exponent histograms of flat integer bits over all elements and over
        ``positions`` (torch's bincount on the tensors' own device, every backend)."""
        return reference.exponent_histograms(old, positions, shift, mask)

    def class_ranks(
        self,
        old: torch.Tensor,
        positions: torch.Tensor,
        shift: int,
        mask: int,
        base: int,
        count: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's class and rank for the ``classed`` coding (FORMAT.md §6.5), on
        the tensors' device."""
        return reference.class_ranks(old, positions, shift, mask, base, count)

    def class_sizes(
        self, old: torch.Tensor, shift: int, mask: int, base: int, count: int
    ) -> torch.Tensor:
        """How many elements of flat integer bits ``old`` each ``classed`` class has
        (§6.5)."""
        return reference.class_sizes(old, shift, mask, base, count)

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
        """The positions, increasing, of the given (class, rank) elements of ``old``
        (§6.5), on its device."""
        return reference.class_positions(old, shift, mask, base, count, classes, ranks)


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
    "NUMBA",
    "TORCH",
    "TRITON",
    "ULP",
    "Backend",
    "KernelsUnavailableError",
    "PendingDiff",
    "change_lanes",
    "kernels_mode",
    "lane_count",
    "to_device",
    "to_host",
    "triton_installed",
]
