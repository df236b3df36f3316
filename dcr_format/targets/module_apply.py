"""Applying one sync's changes to a module (:class:`_ModuleTransaction`).

A change to an ``xor`` name goes straight into the storage its learned placements reach
(the fused apply of a plain tensor where the name is one contiguous run of a parameter, the
same kernels over the rows or columns of a tensor-parallel shard);
any other change, and every ``full`` write, goes through the module's loader with a
scratch holding the change, each intercepted write performed or refused by a
:class:`_Run`, which also keeps its undo and the bits it moved for the read-back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from dcr_format.chain.layout import View
from dcr_format.delta.backend import lane_count
from dcr_format.delta.delta import (
    FULL,
    OVERWRITE,
    XOR,
    DecodedDelta,
    Delta,
    PendingDelta,
    after_bits,
    as_xor,
)
from dcr_format.delta.dispatch import apply_with_lanes, scatter
from dcr_format.delta.fingerprint import LANE_PRIMES, add_lanes, lanes_after_change, tensor_lanes
from dcr_format.delta.staged import StagedChange
from dcr_format.errors import OverwriteRequiredError, TargetError
from dcr_format.targets.change import Applied, Change, Resident
from dcr_format.targets.module_trace import _bits, _Copy, _flat, _Interceptor, _view_of
from dcr_format.targets.placements import LoaderPlan, Placements, _first_of_each
from dcr_format.targets.protocol import Transaction
from dcr_format.targets.reader_side import baseline_coding_error, resolved_against


class _ModuleTransaction(Transaction):
    """One sync into a :class:`~dcr_format.ModuleTarget`: the changes go through the loader."""

    def __init__(self, target: Placements) -> None:
        self.target = target
        self._held = dict(target._held)

    # names and specs come from what was loaded, not from canonical tensors
    def names(self) -> set[str]:
        names = set(self._held)
        if self.target._declared:  # declared at a version: every planned tensor is held
            names |= {p.name for p in self.target._plans.values() if p.kind != "absent"}
        return names

    def tensor(self, name: str) -> torch.Tensor | None:
        """The canonical tensor as a view of the parameter storage, where the loader places
        the whole tensor there contiguously in its own order (a slice of a fused parameter);
        None for any other name (it goes through spec/lanes/apply)."""
        return self._old_bits(name) if self.target.direct else None

    def _old_bits(self, name: str) -> torch.Tensor | None:
        """:meth:`tensor`'s view whether or not the target writes through it (``direct``):
        the bits a change coded against the old bits is completed against."""
        return self.target._view_of_name(name)

    def resolved(self, change: Change) -> Change:
        """As :meth:`Transaction.resolved`, against the canonical view of the name (read
        only, so also where every change goes through the loader); a shard's change whose
        values alone are coded against the old bits, at the elements the module holds
        (:func:`held_elementwise`)."""
        if not change.delta.needs_target:
            return change
        old = self._old_bits(change.name)
        if old is None:
            held = self._held_bits(change)
            if held is None:
                raise baseline_coding_error(change.name)
            plan, bits = held
            assert isinstance(change.delta, PendingDelta)
            return replace(change, delta=_resolved_held(self.target, plan, bits, change.delta))
        done = resolved_against(change, old, keep_before=True)
        if self.target.direct:
            return done
        return replace(done, delta=as_xor(done.delta, old))  # the loader writes XOR bits

    def _held_bits(self, change: Change) -> tuple[LoaderPlan, torch.Tensor] | None:
        """For a change that completes at each element alone (:func:`held_elementwise`) to
        a name placed in one storage, its plan and that storage's bits; else None."""
        if not held_elementwise(change.delta):
            return None
        plan = self.target._plan_of(change.name)
        if plan is None or (plan.dtype, plan.shape) != (change.dtype, change.shape):
            return None
        bits = self.target._placed_bits(plan)
        return None if bits is None else (plan, bits)

    def staged_into(self, name: str) -> torch.Tensor | None:
        """The canonical view of ``name`` (:meth:`tensor`), else the storage its shard's
        changes are staged against (:meth:`ModuleTarget.stage_placed`)."""
        view = self.tensor(name)
        if view is not None or not self.target.direct:
            return view
        plan = self.target._plan_of(name)
        return None if plan is None else self.target._placed_bits(plan)

    def full_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        raise TargetError("a module target writes through its loader, not canonical tensors")

    def drop(self, name: str) -> None:
        self._held.pop(name, None)  # the parameters stay; the name is just no longer tracked

    def commit(self, resident: Resident) -> None:
        if self.target._declared:  # declared at a version: every planned tensor is held,
            for plan in self.target._plans.values():  # not only those this sync changed
                if plan.kind != "absent":
                    self._held.setdefault(plan.name, (plan.dtype, tuple(plan.shape)))
        self.target._held = dict(self._held)
        self.target._resident = resident
        self.target._declared = False

    def abort(self) -> None:
        self._held = dict(self.target._held)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]] | None:
        spec = self._held.get(name)
        if spec is None and self.target._declared:
            plan = self.target._plan_of(name)
            if plan is not None:
                spec = (plan.dtype, plan.shape)
        return spec

    def prepare(self, changes: Sequence[Change]) -> None:
        target = self.target
        for change in changes:
            delta = change.delta
            if delta.op == FULL:
                continue
            if delta.positions is not None and delta.positions.numel() == 0:
                continue
            if delta.needs_target and target._view_of_name(change.name) is None:
                if self._held_bits(change) is None:  # no old bits it completes against
                    raise baseline_coding_error(change.name)
            plan = target.plan(change.name, change.dtype, change.shape)
            if plan.kind == "opaque":
                raise TargetError(
                    f"tensor {change.name!r} reaches this module only through {plan.reason}; "
                    "it can be applied as full only: sync from a base"
                )
            if change.delta.op == XOR and plan.kind != "xor":
                raise OverwriteRequiredError(
                    f"tensor {change.name!r} cannot be applied as xor to this module: "
                    f"{plan.reason}; writers must send it as overwrite (this reader records "
                    "it in readers/<reader-id>.json), or sync from a base"
                )

    def lanes(self, name: str) -> tuple[int, ...] | None:
        view = self.tensor(name)
        return tensor_lanes(view) if view is not None else self.target.read_lanes(name)

    def complete_lanes(
        self, lanes: dict[str, tuple[int, ...]]
    ) -> dict[str, tuple[int, ...] | None]:
        out: dict[str, tuple[int, ...] | None] = {}
        partial: dict[str, tuple[int, ...]] = {}
        plan_of = self.target._plan_of
        for name, values in lanes.items():
            plan = plan_of(name)
            if plan is not None and plan.whole:
                out[name] = values
            else:
                partial[name] = values
                out[name] = None
        if self.target.reduce_lanes is not None:  # every rank calls it, even with nothing
            summed = self.target.reduce_lanes(partial)
            for name in partial:
                if name in summed:
                    out[name] = tuple(v % LANE_PRIMES[i] for i, v in enumerate(summed[name]))
        return out

    def apply(self, change: Change) -> Applied:
        target = self.target
        plan = target.plan(change.name, change.dtype, change.shape)
        delta = change.delta
        if target.direct and plan.kind == "xor" and delta.op != FULL:
            if target._canonical_view(plan) is not None:
                self._held[change.name] = (change.dtype, change.shape)
                return super().apply(change)  # one fused pass, as on a plain tensor
            return self._apply_direct(plan, change)
        scratch = target._scratch_for(change.dtype, change.shape)
        flat = _bits(scratch, change.name).reshape(-1)
        positions = None
        if delta.op == FULL:
            flat.copy_(delta.values.to(flat.device))
        else:
            assert delta.positions is not None
            positions = delta.positions.to(torch.int64).cpu()
            flat[positions.to(flat.device)] = delta.values.to(flat.device)
        values = delta.values.cpu()
        run = _Run(target, plan, delta.op, positions, values)
        mode = _Interceptor(target._module_storages(), scratch, run.write)
        run._mode = mode
        try:
            target._run_loader(change.name, scratch, mode)
            run.finish()
        except BaseException:
            run.undo()
            raise
        finally:
            target._clean_scratch(mode, scratch, positions)
        self._held[change.name] = (change.dtype, change.shape)
        if delta.op == FULL:
            lanes = target.read_lanes(change.name) if plan.kind == "xor" else None
            return Applied(run.undo, lanes=lanes)
        readback = run.readback()
        if readback is None:
            return Applied(run.undo)
        return Applied(run.undo, *readback)

    def _apply_direct(self, plan: LoaderPlan, change: Change) -> Applied:
        """The change scattered straight into the storage the loader placed ``plan`` in."""
        delta = change.delta
        assert delta.positions is not None
        positions = delta.positions.to(torch.int64).cpu()
        values = delta.values.cpu()
        if plan.duplicated:  # a canonical element in several places: each copy on its own
            applied = self._apply_each(plan, delta.op, positions, values)
        else:
            applied = _apply_placed(self.target, plan, delta.op, positions, values)
        self._held[change.name] = (change.dtype, change.shape)
        return applied

    def _apply_each(
        self, plan: LoaderPlan, op: str, positions: torch.Tensor, values: torch.Tensor
    ) -> Applied:
        """Copy by copy, the bits each one moved read back per canonical position."""
        target = self.target
        run = _Run(target, plan, op, positions, values)
        storages = target._storages()
        try:
            for copy in plan.copies:
                if copy.kind != "placement":
                    continue  # constants the loader wrote (padding) stay as they are
                k, index = target._select(copy, positions)
                if k.numel():
                    run._store(copy, target._storage_tensor(copy, storages), None, k, index)
        except BaseException:
            run.undo()
            raise
        readback = run.readback()
        assert readback is not None  # placements only: the bits moved are known
        return Applied(run.undo, *readback)


@dataclass(frozen=True)
class _Held:
    """The changed positions one placement copy of a name holds: where the copy places a
    run of consecutive canonical elements (``run``: its first canonical position and
    length) into consecutive storage, the slice ``span`` of the sorted positions inside
    it; else the copy's logical elements ``k`` holding ``positions[index]``."""

    copy: _Copy
    span: tuple[int, int] | None = None
    run: tuple[int, int] = (0, 0)
    k: torch.Tensor | None = None
    index: torch.Tensor | None = None


def _held_by_copy(
    target: Placements, plan: LoaderPlan, positions: torch.Tensor, host: np.ndarray
) -> Iterator[_Held]:
    """For each placement copy of ``plan`` (the constants a loader writes, such as padding,
    aside), the sorted changed ``positions`` (``host``: the same as an array) it holds: a
    block of rows by a slice of them, a block of columns by arithmetic on them
    (:func:`_column_block`), any other copy through its learned views (O(changed))."""
    for copy in plan.copies:
        if copy.kind != "placement":
            continue
        assert copy.src is not None
        prov, src = copy.src
        if prov.kind == "scratch" and src.contiguous and copy.dst.contiguous:
            lo, hi = np.searchsorted(host, (src.offset, src.offset + src.numel))
            yield _Held(copy, span=(int(lo), int(hi)), run=(src.offset, src.numel))
            continue
        found = _column_block(src, host) if prov.kind == "scratch" else None
        if found is not None:
            index, k = (torch.from_numpy(a) for a in found)
        else:
            k, index = target._select(copy, positions)
        yield _Held(copy, k=k, index=index)


def _apply_placed(
    target: Placements, plan: LoaderPlan, op: str, positions: torch.Tensor, values: torch.Tensor
) -> Applied:
    """A change to a name whose canonical elements each sit in one place (a tensor-parallel
    shard: a block of rows or columns), applied with the kernels of a plain tensor.

    A copy that places a run of consecutive canonical elements into consecutive storage (a
    block of whole rows) takes the slice of the sorted positions that falls in the run, one
    kernel pass over that slice of the storage reading the old bits, writing the new ones and
    summing the lane deltas at the canonical positions. A block of columns locates the
    positions it holds by arithmetic on them (:func:`_column_block`), any other copy through
    its learned views (O(changed)); then one kernel pass per parameter storage. What moved,
    each canonical position once and in canonical order, is read back."""
    storages = target._storages()
    host = positions.numpy()
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []  # bits, at, old, base

    def undo() -> None:
        for bits, where, before, base in reversed(writes):
            scatter(bits, where, before, op=OVERWRITE, base=base)
        writes.clear()

    moved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # positions, old, new
    deltas: list[tuple[int, ...]] = []
    reordered = False  # the storage order of the elements differs from the canonical one
    located: dict[
        tuple[tuple[str, int], torch.dtype], list[tuple[_Copy, torch.Tensor, torch.Tensor]]
    ]
    located = {}

    def write(
        bits: torch.Tensor,
        where: torch.Tensor,
        held: torch.Tensor,
        base: int,
        incoming: torch.Tensor,
        lanes: bool,
    ) -> None:
        at = where.to(bits.device)
        before, lane_deltas = apply_with_lanes(
            bits, at, incoming.to(bits.device), op=op, base=base, lanes=lanes
        )
        writes.append((bits, at, before, base))
        old = before.cpu()
        moved.append((held, old, old ^ incoming if op == XOR else incoming))
        if lanes:
            deltas.append(lane_deltas)

    try:
        for found in _held_by_copy(target, plan, positions, host):
            copy = found.copy
            if found.span is not None:
                lo, hi = found.span
                if hi > lo:
                    offset, numel = found.run
                    bits = _bits(target._storage_tensor(copy, storages), plan.name)
                    run = bits[copy.dst.offset : copy.dst.offset + numel]
                    held = positions[lo:hi]
                    write(run, held, held, offset, values[lo:hi], True)
                continue
            assert found.k is not None and found.index is not None
            if found.k.numel():
                located.setdefault((copy.storage, copy.dst_dtype), []).append(
                    (copy, copy.dst.elements(found.k), found.index)
                )
        for parts in located.values():
            bits = _bits(target._storage_tensor(parts[0][0], storages), plan.name)
            elements = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            index = torch.cat([p[2] for p in parts]) if len(parts) > 1 else parts[0][2]
            if elements.numel() > 1 and not bool((elements[1:] > elements[:-1]).all()):
                order = torch.argsort(elements)  # the kernel takes increasing positions
                elements, index = elements[order], index[order]
                reordered = True
            write(bits, elements, positions[index], 0, values[index], False)
    except BaseException:
        undo()
        raise
    if not moved:
        empty = torch.empty(0, dtype=torch.int64)
        return Applied(undo, empty, values[:0], values[:0])
    summed = add_lanes(*deltas) if len(deltas) == len(moved) else None
    if len(moved) == 1 and not reordered:  # already in canonical order
        return Applied(undo, *moved[0], lane_deltas=summed)
    held = torch.cat([m[0] for m in moved])
    order = torch.argsort(held)
    old = torch.cat([m[1] for m in moved])[order]
    new = torch.cat([m[2] for m in moved])[order]
    return Applied(undo, held[order], old, new, lane_deltas=summed)


def _held_elements(
    target: Placements, plan: LoaderPlan, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the changed canonical ``positions`` (sorted, on the host) the module holds sit
    in the one storage every placement of ``plan`` writes into: their storage positions,
    increasing, and which of ``positions`` each is."""
    host = positions.numpy()
    elements: list[np.ndarray] = []
    index: list[np.ndarray] = []
    for found in _held_by_copy(target, plan, positions, host):
        if found.span is not None:
            lo, hi = found.span
            index.append(np.arange(lo, hi, dtype=np.int64))
            elements.append(host[lo:hi] - (found.run[0] - found.copy.dst.offset))
        else:
            assert found.k is not None and found.index is not None
            elements.append(found.copy.dst.elements(found.k).numpy())
            index.append(found.index.numpy())
    where = np.concatenate(elements) if elements else np.empty(0, dtype=np.int64)
    held = np.concatenate(index) if index else np.empty(0, dtype=np.int64)
    if where.size > 1 and not bool((where[1:] > where[:-1]).all()):
        order = np.argsort(where, kind="stable")  # the write takes increasing positions
        where, held = where[order], held[order]
    return (
        torch.from_numpy(np.ascontiguousarray(where, dtype=np.int64)),
        torch.from_numpy(np.ascontiguousarray(held, dtype=np.int64)),
    )


def _stage_placed(
    target: Placements,
    plan: LoaderPlan,
    bits: torch.Tensor,
    op: str,
    positions: torch.Tensor,
    values: torch.Tensor,
    *,
    ulp: bool = False,
) -> StagedChange:
    """What :func:`_apply_placed` would do to ``bits`` (the flat storage every placement of
    ``plan`` writes into, :meth:`Placements._placed_bits`), read and not written: the
    storage positions of the changed canonical elements the module holds, increasing,
    their bits now and after the change, and the change's lane deltas summed at their
    canonical positions (this rank's part of the tensor's). ``ulp``: ``values`` are ulp
    differences from the old bits (an ``xor`` change, :func:`held_elementwise`), stepped
    here from the bits read."""
    at, take = _held_elements(target, plan, positions)
    before = bits[at.to(bits.device)].cpu()
    incoming = values[take]
    if ulp:
        after = after_bits(DecodedDelta(XOR, positions[take], incoming, ulp=True), before)
    else:
        after = before ^ incoming if op == XOR else incoming.clone()
    zero = (0,) * lane_count(bits.element_size())
    deltas = lanes_after_change(zero, positions[take], before, after)
    return StagedChange(at.to(bits.device), before.to(bits.device), after.to(bits.device), deltas)


def held_elementwise(delta: Delta) -> bool:
    """Whether ``delta`` completes against the old bits of each changed element alone (its
    positions plain, its values ``ulp`` differences), so a module holding part of the
    tensor (a shard) completes it at the elements it holds."""
    return (
        isinstance(delta, PendingDelta)
        and delta.op == XOR
        and delta.positions is not None
        and delta.classed is None
        and delta.ulp
        and delta.shift is None
    )


def _resolved_held(
    target: Placements, plan: LoaderPlan, bits: torch.Tensor, delta: PendingDelta
) -> DecodedDelta:
    """``delta`` (:func:`held_elementwise`) completed against the elements of ``bits`` (the
    storage of ``plan``'s placements) the module holds: XOR bits there, and zero at the
    positions it does not hold (another rank's, which nothing here writes)."""
    assert delta.positions is not None
    positions = delta.positions.to(torch.int64).cpu()
    values = delta.values.cpu()
    at, take = _held_elements(target, plan, positions)
    before = bits[at.to(bits.device)].cpu()
    stepped = DecodedDelta(XOR, positions[take], values[take], ulp=True)
    xor = torch.zeros_like(values)
    xor[take] = before ^ after_bits(stepped, before)
    return DecodedDelta(XOR, positions, xor)


def _column_block(view: View, host: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(i, k)`` for a view that is a block of columns of a row-major tensor (rows of
    ``C`` consecutive elements, ``M >= C`` apart): the sorted positions ``host[i]`` inside it
    and their elements ``k`` of the view, by arithmetic on the positions between its first
    and last element; None for any other view."""
    dims = [(n, s) for n, s in zip(view.sizes, view.strides, strict=True) if n > 1]
    if len(dims) != 2 or dims[1][1] != 1 or dims[0][1] < dims[1][0]:
        return None
    (rows, step), (cols, _) = dims
    lo, hi = np.searchsorted(host, (view.offset, view.offset + (rows - 1) * step + cols))
    row, col = np.divmod(host[lo:hi] - view.offset, step)
    inside = col < cols
    return np.flatnonzero(inside) + lo, row[inside] * cols + col[inside]


class _Run:
    """One loader run applying one change: performs (or refuses) each intercepted write."""

    def __init__(
        self,
        target: Placements,
        plan: LoaderPlan,
        op: str,
        positions: torch.Tensor | None,
        values: torch.Tensor,
    ) -> None:
        self.target, self.plan, self.op = target, plan, op
        self.positions, self.values = positions, values
        self.saved: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.moved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # pos, old, new
        self.deferred: list[tuple[_Copy, torch.Tensor, torch.Tensor | None]] = []
        self.exact = True  # every write was a placement: canonical bits can be read back

    def write(self, func, args, kwargs, hits):  # type: ignore[no-untyped-def]
        if self.op == FULL:
            for t in hits:  # a dense load of this tensor, old bits kept for the rollback
                if self.target.rollback_full:
                    self.saved.append((t, None, t.detach().clone()))
            return func(*args, **kwargs)
        mode = self._mode
        copies = self.target._describe(mode, func, args, kwargs, hits)
        for copy in copies:
            if copy.kind == "foreign":
                continue  # a constant the last full load already wrote (padding)
            if copy.kind not in ("placement", "transform") or (
                self.op == XOR and copy.kind != "placement"
            ):
                raise OverwriteRequiredError(
                    f"tensor {self.plan.name!r}: the loader's {copy.op} is not a placement "
                    "this time; it cannot be applied as " + self.op
                )
            src = args[1] if copy.kind == "transform" else None
            if self.plan.overlapping:
                self.deferred.append((copy, args[0], src))
            else:
                self._write(copy, args[0], src)
        return args[0]

    _mode: _Interceptor

    def _write(self, copy: _Copy, dst: torch.Tensor, src: torch.Tensor | None) -> None:
        assert self.positions is not None
        k, index = self.target._select(copy, self.positions)
        if k.numel() == 0:
            return
        self._store(copy, dst, src, k, index)

    def _store(
        self,
        copy: _Copy,
        dst: torch.Tensor,
        src: torch.Tensor | None,
        k: torch.Tensor,
        index: torch.Tensor,
    ) -> None:
        assert self.positions is not None
        flat = _flat(dst.detach())
        bits = _bits(flat, self.plan.name)
        elements = copy.dst.elements(k).to(flat.device)
        old = bits[elements].clone()
        if copy.kind == "placement":
            incoming = self.values[index].to(bits.device)
            new = old ^ incoming if self.op == XOR else incoming
            bits[elements] = new
            self.moved.append((self.positions[index], old.cpu(), new.cpu()))
        else:
            assert src is not None
            source = _flat(src.detach())
            at = _view_of(src, dst.shape).elements(k).to(source.device)
            flat[elements] = source[at].to(flat.dtype).to(flat.device)
            self.exact = False
        self.saved.append((bits, elements, old))

    def finish(self) -> None:
        """Overlapping destinations: only the last write of each element counts."""
        if not self.deferred:
            return
        assert self.positions is not None
        groups: dict[tuple[str, int], list[int]] = {}
        for index, (copy, _, _) in enumerate(self.deferred):
            groups.setdefault(copy.storage, []).append(index)
        for members in groups.values():
            elements = torch.cat([self.deferred[i][0].dst.elements() for i in members])
            owner = torch.cat([torch.full((self.deferred[i][0].dst.numel,), i) for i in members])
            k_all = torch.cat([torch.arange(self.deferred[i][0].dst.numel) for i in members])
            order = torch.sort(elements, stable=True).indices
            elements, owner, k_all = elements[order], owner[order], k_all[order]
            last = torch.ones_like(elements, dtype=torch.bool)
            last[:-1] = elements[1:] != elements[:-1]
            for i in members:
                copy, dst, src = self.deferred[i]
                mine = k_all[last & (owner == i)]
                canonical = self.target._canonical_all(copy)[mine]
                hit = torch.isin(canonical, self.positions)
                if bool(hit.any()):
                    at = torch.searchsorted(self.positions, canonical[hit])
                    self._store(copy, dst, src, mine[hit], at)

    def undo(self) -> None:
        for target, elements, old in reversed(self.saved):
            if elements is None:
                target.copy_(old)
            else:
                target[elements] = old
        self.saved.clear()

    def readback(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Canonical positions moved with their bits before and after (each position once)."""
        if not self.exact or self.plan.kind != "xor":
            return None
        if not self.moved:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, self.values[:0], self.values[:0]
        positions = torch.cat([m[0] for m in self.moved])
        old = torch.cat([m[1] for m in self.moved])
        new = torch.cat([m[2] for m in self.moved])
        unique, first_old = _first_of_each(positions, old)
        _, first_new = _first_of_each(positions, new)
        return unique, first_old, first_new
