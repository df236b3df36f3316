"""The placements a module's loader makes, learned once per canonical name.

A prewarm run of the loader (:meth:`Placements.plan`) records, not performs, every write it
makes into module storage and classifies the name (:class:`LoaderPlan`): ``xor`` (every
copy a placement, no destination written twice), ``overwrite`` (a transform or an overlap),
``opaque`` (only ``full`` works) or ``absent`` (not loaded here). The learned placements
then locate changed positions in module storage (:meth:`Placements._select`), read the
canonical bits back (:meth:`Placements.read_lanes`) and give a canonical view of a tensor
the loader copies whole into one contiguous run (:meth:`Placements._canonical_view`). They
are learned again for a name whose parameter storage moved (:meth:`Placements._check_layout`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from dcr_format.chain.layout import View
from dcr_format.delta.delta import (
    OVERWRITE,
    XOR,
    DecodedDelta,
    apply_change,
    stage_change,
)
from dcr_format.delta.fingerprint import LANE_PRIMES, lanes_after_change, lanes_at, tensor_lanes
from dcr_format.delta.staged import put_staged, unput_staged
from dcr_format.errors import OverwriteRequiredError, TargetError
from dcr_format.format.dtypes import BY_TORCH, bits_view
from dcr_format.targets.change import Resident
from dcr_format.targets.module_trace import (
    _bits,
    _canonical_of,
    _Copy,
    _flat,
    _Interceptor,
    _key,
    _preimage,
    _tensors,
    _view_of,
    aten,
)

LoadWeights: TypeAlias = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
"""A vLLM-style ``load_weights``: takes (name, tensor) pairs."""

ReduceLanes: TypeAlias = Callable[[dict[str, tuple[int, ...]]], dict[str, tuple[int, ...]]]
"""Sums partial fingerprint lanes (by name) over the ranks that share tensors."""


@dataclass
class LoaderPlan:
    """How a module's loader takes one canonical tensor (found by a prewarm run).

    ``kind``: ``xor`` (bit-preserving placements only), ``overwrite`` (transforms or
    overlapping destinations: only ``overwrite``/``full`` work), ``opaque`` (only
    ``full``), ``absent`` (not loaded here). ``held``: canonical elements this module
    holds; ``reason`` says why a name is not ``xor``.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str
    held: int
    numel: int
    reason: str = ""
    copies: list[_Copy] = field(default_factory=list, repr=False)
    overlapping: bool = False  # destinations written twice within the name
    duplicated: bool = False  # a canonical element placed in more than one destination
    unheld_zero: tuple[int, ...] | None = None  # lanes of zeros at the elements not held

    @property
    def whole(self) -> bool:
        """Whether every canonical element lands in this module."""
        return self.held == self.numel


class Placements:
    """A module and its loader, with what the loader was seen to do for each canonical name
    and the names and version the module holds (the state of a :class:`ModuleTarget`)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        load_weights: LoadWeights | None = None,
        reduce_lanes: ReduceLanes | None = None,
        rollback_full: bool = True,
        direct: bool = True,
        resident: Resident | None = None,
    ) -> None:
        self.module = module
        self.load_weights = load_weights
        self.reduce_lanes = reduce_lanes
        self.rollback_full = rollback_full
        self.direct = direct
        self._resident = resident
        self._declared = self._resident is not None  # held names come from the plans
        # by canonical name, the plan and canonical view the pause looks up for it (found
        # from ``_held``, ``_plans`` and ``_views``; forgotten whenever one of them changes)
        self._named: dict[str, tuple[LoaderPlan | None, torch.Tensor | None]] = {}
        self._held = {}
        self._plans: dict[tuple[str, torch.dtype, tuple[int, ...]], LoaderPlan] = {}
        self._extents: dict[tuple[str, int], list[tuple[int, int, str, list[_Copy]]]] = {}
        self._scratch: torch.Tensor | None = None
        self._mark: torch.Tensor | None = None
        # where each parameter and buffer lived when the plans were learned
        self._layout: dict[str, tuple[str, int]] | None = None
        self._by_key: dict[tuple[str, int], torch.Tensor] | None = None
        self._views: dict[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor | None] = {}
        # the flat bits of each storage changes are staged against (:meth:`_placed_bits`)
        self._stored: dict[tuple[tuple[str, int], torch.dtype], torch.Tensor] = {}

    @property
    def _held(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The canonical names the module holds, with their dtype and shape (as committed;
        a transaction works on its own copy and sets it again on commit)."""
        return self._held_names

    @_held.setter
    def _held(self, held: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self._held_names = held
        self._named.clear()

    def _current_layout(self) -> dict[str, tuple[str, int]]:
        """Where each parameter and buffer lives, by its name in the module (the names
        ``named_parameters``/``named_buffers`` give, duplicates kept; one walk of the
        submodules for both)."""
        layout = {}
        for prefix, module in self.module.named_modules(remove_duplicate=False):
            dot = prefix + "." if prefix else ""
            for members in (module._parameters, module._buffers):
                for name, tensor in members.items():
                    if tensor is not None:
                        layout[dot + name] = _key(tensor)
        return layout

    def _check_layout(self) -> None:
        """Learn the placements again of the names placed in a parameter or buffer whose
        storage moved since they were learned (a runtime that re-created a weight,
        ``param.data = ...``); the others are kept."""
        layout = self._current_layout()
        self._by_key = None
        if self._layout is None or layout == self._layout:
            self._layout = layout
            return
        gone = {key for name, key in self._layout.items() if layout.get(name) != key}
        stale = [
            key
            for key, plan in self._plans.items()
            if any(copy.storage in gone for copy in plan.copies)
        ]
        for key in stale:
            del self._plans[key]
        self._layout = layout
        self._views.clear()
        self._stored.clear()
        self._named.clear()
        self._extents.clear()
        for plan in self._plans.values():  # the shared-storage index, without the stale names
            if plan.kind in ("xor", "overwrite"):
                self._check_shared(plan)
        for name, dtype, shape in stale:
            self.plan(name, dtype, shape)

    # --- prewarm ------------------------------------------------------------------------

    def prewarm(
        self, specs: dict[str, tuple[torch.dtype, Sequence[int]]] | Iterable[tuple[str, Any, Any]]
    ) -> dict[str, LoaderPlan]:
        """Classify canonical tensors ``{name: (dtype, shape)}`` without changing weights."""
        items = specs.items() if isinstance(specs, dict) else ((n, (d, s)) for n, d, s in specs)
        return {name: self.plan(name, dtype, tuple(shape)) for name, (dtype, shape) in items}

    def warm(self) -> None:
        """Compile (or load from numba's cache) the kernels a sync runs to apply and verify
        changes, for every dtype the learned placements hold, so that the first sync's pause
        does not include it. Call it after :meth:`prewarm` (or a first sync)."""
        dtypes = {p.dtype for p in self._plans.values() if p.kind != "absent"}
        for dtype in sorted(dtypes, key=str):
            if dtype not in BY_TORCH:
                continue
            for count in (1, 5 * 8192):  # one chunk (serial kernels) and several (parallel)
                tensor = torch.zeros(count, dtype=dtype)
                flat = bits_view(tensor)
                positions = torch.arange(count, dtype=torch.int64)
                for op in (XOR, OVERWRITE):
                    change = DecodedDelta(op, positions, flat.clone())
                    done = apply_change(tensor, change)
                    assert done.before is not None
                    lanes_after_change(tensor_lanes(tensor), positions, done.before, flat.clone())
                    staged = stage_change(tensor, change)  # a prepared version, and its undo
                    unput_staged(tensor, staged, put_staged(tensor, staged))

    def plan(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> LoaderPlan:
        """How the loader takes canonical tensor ``name`` (cached; one recording run)."""
        named = self._named.get(name)  # the plan looked up by name, where it is this one
        if named is not None:
            plan = named[0]
            if plan is not None and plan.dtype == dtype and plan.shape == shape:
                return plan
        key = (name, dtype, tuple(shape))
        plan = self._plans.get(key)
        if plan is None:
            if self._layout is None:
                self._layout = self._current_layout()
            plan = self._record(name, dtype, tuple(shape))
            self._plans[key] = plan
            if plan.kind in ("xor", "overwrite"):
                self._check_shared(plan)  # may make another name's plan overwrite
            self._named.clear()
        return plan

    def _record(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> LoaderPlan:
        copies: list[_Copy] = []

        def record(func, args, kwargs, hits):  # type: ignore[no-untyped-def]
            copies.extend(self._describe(mode, func, args, kwargs, hits))
            return args[0] if args else None

        scratch = self._scratch_for(dtype, shape)
        mode = _Interceptor(self._module_storages(), scratch, record)
        self._run_loader(name, scratch, mode, recording=True)
        self._clean_scratch(mode, scratch, None)
        numel = 1
        for dim in shape:
            numel *= dim
        moves = [c for c in copies if c.kind in ("placement", "transform")]
        bad = [c for c in copies if c.kind in ("opaque", "unsupported")]
        if not copies:
            return LoaderPlan(name, dtype, shape, "absent", 0, numel, "not loaded here")
        held, duplicated, unheld_zero = 0, False, None
        if moves:
            placed = torch.unique(torch.cat([self._canonical_all(c) for c in moves]))
            held = int(placed.numel())
            duplicated = held != sum(c.dst.numel for c in moves)
            if held < numel:  # a shard: read back, the zeros elsewhere must not count
                zeros = torch.zeros(numel, dtype=dtype)
                unheld_zero = _subtract(
                    tensor_lanes(zeros), lanes_at(placed, bits_view(zeros)[:held])
                )
        overlapping = _overlaps([c for c in copies if c.kind != "foreign"])
        if bad:
            what = (
                "values the loader derives from several elements (not pointwise)"
                if bad[0].kind == "opaque"
                else f"a write into the module that dcr cannot follow ({bad[0].op})"
            )
            return LoaderPlan(name, dtype, shape, "opaque", held, numel, what, copies, overlapping)
        if not moves:
            return LoaderPlan(name, dtype, shape, "absent", 0, numel, "only constants written")
        if any(c.kind == "transform" for c in moves):
            reason = "the loader transforms its values (a cast or arithmetic)"
            return LoaderPlan(name, dtype, shape, "overwrite", held, numel, reason, copies, False)
        if overlapping:
            reason = "the loader writes some destination elements twice"
            return LoaderPlan(name, dtype, shape, "overwrite", held, numel, reason, copies, True)
        plan = LoaderPlan(name, dtype, shape, "xor", held, numel, "", copies, False)
        plan.duplicated, plan.unheld_zero = duplicated, unheld_zero
        return plan

    def _check_shared(self, plan: LoaderPlan) -> None:
        """Destinations shared with another name (tied weights): both need overwrite, since
        an XOR arriving through each name would be applied twice."""
        for copy in plan.copies:
            if copy.kind not in ("placement", "transform"):
                continue
            lo, hi = copy.dst.offset, copy.dst.end
            for other_lo, other_hi, other_name, other_copies in self._extents.get(copy.storage, []):
                if other_name == plan.name or hi <= other_lo or other_hi <= lo:
                    continue
                mine = copy.dst.elements()
                if any(
                    bool(torch.isin(c.dst.elements(), mine).any())
                    for c in other_copies
                    if c.storage == copy.storage
                ):
                    pair = {plan.name: other_name, other_name: plan.name}
                    for other in self._plans.values():
                        if other.name in pair and other.kind == "xor":
                            other.kind = "overwrite"
                            other.reason = (
                                f"it shares parameter storage with {pair[other.name]!r} "
                                "(tied weights), so an XOR would arrive twice"
                            )
            self._extents.setdefault(copy.storage, []).append((lo, hi, plan.name, plan.copies))

    # --- the loader under interception ------------------------------------------------------

    def _module_storages(self) -> set[tuple[str, int]]:
        keys = set()
        for t in [
            *self.module.parameters(recurse=True),
            *self.module.buffers(recurse=True),
        ]:
            if t.numel():
                keys.add(_key(t))
        return keys

    def _device(self) -> torch.device:
        for t in self.module.parameters():
            return t.device
        return torch.device("cpu")

    def _scratch_for(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed canonical-shaped scratch, a view of one buffer sized for the largest."""
        numel = 1
        for dim in shape:
            numel *= dim
        width = torch.empty(0, dtype=dtype).element_size()
        nbytes = max(numel * width, 8)
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.zeros(nbytes, dtype=torch.uint8, device=self._device())
        return self._scratch[: numel * width].view(dtype).view(shape)

    def _clean_scratch(
        self, mode: _Interceptor, scratch: torch.Tensor, positions: torch.Tensor | None
    ) -> None:
        """Back to all zeros (the loader may even have written into it)."""
        if positions is None or mode.scratch_touched:
            _bits(scratch, "scratch").reshape(-1).zero_()
        else:
            _bits(scratch, "scratch").reshape(-1)[positions.to(scratch.device)] = 0

    def _run_loader(
        self, name: str, scratch: torch.Tensor, mode: _Interceptor, *, recording: bool = False
    ) -> None:
        """One loader call for ``name`` under ``mode``; while recording (a prewarm), any
        failure of the loader means it rejects the name."""
        storages = {n: _key(p) for n, p in self.module.named_parameters(remove_duplicate=False)}
        try:
            with torch.no_grad(), mode:
                if self.load_weights is not None:
                    self.load_weights([(name, scratch)])
                else:
                    result = self.module.load_state_dict({name: scratch}, strict=False)
                    if result.unexpected_keys:
                        raise TargetError(
                            f"the module's load_state_dict does not know tensor {name!r}"
                        )
        except (TargetError, OverwriteRequiredError):
            raise
        except Exception as exc:
            if not recording:
                raise  # while applying: the reader rolls back and reports it
            raise TargetError(f"the module's loader rejects tensor {name!r}: {exc}") from exc
        moved = [
            n
            for n, p in self.module.named_parameters(remove_duplicate=False)
            if storages.get(n) != _key(p)
        ]
        if moved:
            raise TargetError(
                f"loading {name!r} replaced the storage of parameter {moved[0]!r} instead of "
                "copying into it; dcr cannot follow such a loader"
            )

    def _describe(self, mode, func, args, kwargs, hits) -> list[_Copy]:  # type: ignore[no-untyped-def]
        """What an intercepted write is: a copy from the scratch, a constant, or unknown."""
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            found = mode.source(src, dst.shape)
            if found is None and _key(src) in mode.module_storages:
                kind = "opaque"  # copied from another parameter: not a constant, not ours
            elif found is None:
                kind = "foreign"
            elif found[0].kind == "opaque":
                kind = "opaque"
            elif found[0].transformed or src.dtype != dst.dtype:
                kind = "transform"
            else:
                kind = "placement"
            return [_Copy(kind, _key(dst), _view_of(dst), dst.dtype, found, str(func))]
        if func in (aten.fill_.Scalar, aten.zero_.default, aten.fill_.Tensor):
            inputs = [t for t in _tensors((args[1:], kwargs)) if _key(t) in mode.prov]
            kind = "opaque" if inputs else "foreign"
            return [_Copy(kind, _key(t), _view_of(t), t.dtype, op=str(func)) for t in hits]
        return [_Copy("unsupported", _key(t), _view_of(t), t.dtype, op=str(func)) for t in hits]

    def _canonical_all(self, copy: _Copy) -> torch.Tensor:
        assert copy.src is not None
        k = torch.arange(copy.dst.numel, dtype=torch.int64)
        return _canonical_of(copy.src[0], copy.src[1], k)

    def _select(self, copy: _Copy, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, i)``: the copy's logical elements holding ``positions[i]``; by inverting its
        views where they invert (O(changed)), else through the copy's index table (built
        once: canonical position to logical element)."""
        assert copy.src is not None
        found = _preimage(copy.src[0], copy.src[1], positions)
        if found is not None:
            return found
        if copy.table is None:
            canonical, order = torch.sort(self._canonical_all(copy), stable=True)
            copy.table = (canonical, order)
        canonical, order = copy.table
        lo = torch.searchsorted(canonical, positions)
        counts = torch.searchsorted(canonical, positions, right=True) - lo
        index = torch.repeat_interleave(torch.arange(positions.numel()), counts)
        starts = torch.repeat_interleave(lo - (torch.cumsum(counts, 0) - counts), counts)
        return order[starts + torch.arange(index.numel())], index

    # --- reading back -------------------------------------------------------------------

    def read_lanes(self, name: str) -> tuple[int, ...] | None:
        """Lanes of the canonical elements of ``name`` this module holds, read back through
        its placements; None unless the name is an ``xor`` (bit-preserving) name."""
        plan = self._plan_of(name)
        if plan is None or plan.kind != "xor":
            return None
        placements = [c for c in plan.copies if c.kind == "placement"]
        if not placements:
            return None
        storages = self._storages()
        direct = all(c.src is not None and c.src[0].kind == "scratch" for c in placements)
        if direct and not plan.duplicated:
            # the inverse copies into the (zeroed) scratch, then one row-wise pass
            scratch = self._scratch_for(plan.dtype, plan.shape)
            flat = _bits(scratch, name).reshape(-1)
            try:
                for copy in placements:
                    assert copy.src is not None
                    dst = _bits(self._storage_tensor(copy, storages), name)
                    held = torch.as_strided(dst, copy.dst.sizes, copy.dst.strides, copy.dst.offset)
                    view = copy.src[1]
                    torch.as_strided(flat, view.sizes, view.strides, view.offset).copy_(held)
                lanes = tensor_lanes(scratch)
            finally:
                flat.zero_()
            if plan.unheld_zero is not None:
                lanes = _subtract(lanes, plan.unheld_zero)
            return lanes
        positions, bits = [], []
        for copy in placements:
            positions.append(self._canonical_all(copy))
            dst = _bits(self._storage_tensor(copy, storages), name)
            bits.append(dst[copy.dst.elements().to(dst.device)].cpu())
        pos, val = _first_of_each(torch.cat(positions), torch.cat(bits))
        return lanes_at(pos, val)

    def _plan_of(self, name: str) -> LoaderPlan | None:
        """The plan of the tensor ``name`` the module holds (else of the one plan learned
        for that name), or None."""
        return self._lookup(name)[0]

    def _view_of_name(self, name: str) -> torch.Tensor | None:
        """The canonical view (:meth:`_canonical_view`) of ``name``'s ``xor`` plan, or
        None."""
        return self._lookup(name)[1]

    def _lookup(self, name: str) -> tuple[LoaderPlan | None, torch.Tensor | None]:
        """``name``'s plan and ``xor`` canonical view, kept until the held names, the plans
        or the views change (each sync looks them up several times a tensor)."""
        found = self._named.get(name)
        if found is not None:
            return found
        spec = self._held.get(name)
        if spec is not None:
            plan = self._plans.get((name, *spec))
        else:
            named = [p for p in self._plans.values() if p.name == name and p.kind != "absent"]
            plan = named[0] if len(named) == 1 else None
        view = None if plan is None or plan.kind != "xor" else self._canonical_view(plan)
        self._named[name] = found = (plan, view)
        return found

    def held_storage(self) -> list[torch.Tensor]:
        """The module's parameters and buffers (a sync far behind keeps them once as its
        undo)."""
        return [*self.module.parameters(), *self.module.buffers()]

    def _storages(self) -> dict[tuple[str, int], torch.Tensor]:
        """Parameter and buffer storages by key (kept from one layout check to the next)."""
        if self._by_key is None:
            self._by_key = {_key(t): t for t in [*self.module.parameters(), *self.module.buffers()]}
        return self._by_key

    def _canonical_view(self, plan: LoaderPlan) -> torch.Tensor | None:
        """``plan``'s canonical tensor as a view of module storage: where the loader copies
        the whole tensor, unchanged and in row-major order, into one contiguous run of one
        parameter (a whole weight, or a row block of a fused one); else None."""
        key = (plan.name, plan.dtype, plan.shape)
        if key in self._views:
            return self._views[key]
        view = None
        placements = [c for c in plan.copies if c.kind == "placement"]
        if plan.kind == "xor" and plan.whole and not plan.duplicated and len(placements) == 1:
            copy = placements[0]
            assert copy.src is not None
            prov, src = copy.src
            if (
                prov.kind == "scratch"
                and src.offset == 0
                and src.numel == plan.numel
                and _row_major(src)
                and _row_major(copy.dst)
                and copy.dst_dtype == plan.dtype
            ):
                flat = self._storage_tensor(copy, self._storages())
                view = flat[copy.dst.offset : copy.dst.offset + plan.numel].view(plan.shape)
        self._views[key] = view
        return view

    def _placed_bits(self, plan: LoaderPlan) -> torch.Tensor | None:
        """The flat bits of the one storage every placement of ``plan`` writes into, where
        there is one (a tensor-parallel shard: a block of rows or columns of a parameter)
        and each canonical element is placed once; None otherwise. The same tensor object
        until the storage moves (:meth:`_check_layout`), so a change staged against it is
        known to land where it was read."""
        placements = [c for c in plan.copies if c.kind == "placement"]
        if plan.kind != "xor" or plan.duplicated or not placements:
            return None
        key = (placements[0].storage, placements[0].dst_dtype)
        if any((c.storage, c.dst_dtype) != key for c in placements):
            return None
        found = self._stored.get(key)
        if found is None:
            storage = self._storage_tensor(placements[0], self._storages())
            found = self._stored[key] = _bits(storage, plan.name)
        return found

    def _storage_tensor(
        self, copy: _Copy, storages: dict[tuple[str, int], torch.Tensor]
    ) -> torch.Tensor:
        """The whole storage a copy wrote into, as a flat tensor of the copy's dtype."""
        found = storages.get(copy.storage)
        if found is None:
            raise TargetError("a parameter the loader wrote into is gone from the module")
        flat = _flat(found.detach())
        return flat if flat.dtype == copy.dst_dtype else flat.view(copy.dst_dtype)


def _row_major(view: View) -> bool:
    """Whether a view's elements are one contiguous run in row-major order."""
    step = 1
    for size, stride in reversed(list(zip(view.sizes, view.strides, strict=True))):
        if size > 1 and stride != step:
            return False
        step *= size
    return True


def _subtract(lanes: tuple[int, ...], part: tuple[int, ...]) -> tuple[int, ...]:
    return tuple((a - b) % LANE_PRIMES[i] for i, (a, b) in enumerate(zip(lanes, part, strict=True)))


def _first_of_each(
    positions: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each distinct position once (its first occurrence), sorted."""
    unique, inverse = torch.unique(positions, return_inverse=True)
    first = torch.full((unique.numel(),), positions.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(positions.numel()), reduce="amin")
    return unique, values[first]


def _overlaps(copies: list[_Copy]) -> bool:
    """Whether two of the copies (or one copy with itself) write a destination element twice."""
    by_storage: dict[tuple[str, int], list[torch.Tensor]] = {}
    for copy in copies:
        if not copy.dst.nested:
            return True
        by_storage.setdefault(copy.storage, []).append(copy.dst.elements())
    for elements in by_storage.values():
        if len(elements) == 1:
            continue
        merged = torch.cat(elements)
        if torch.unique(merged).numel() != merged.numel():
            return True
    return False
