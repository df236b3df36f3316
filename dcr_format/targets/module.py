"""Applying versions to a live model through its own loader (FORMAT.md §8.4).

A rollout runtime keeps weights in its own layout (fused ``qkv_proj``, ``gate_up``,
tensor-parallel shards, fp32 norms) and knows the placement in its loader:
``load_weights(iterable of (canonical_name, tensor))`` in vLLM-style runtimes, or
``load_state_dict`` in plain torch. :class:`ModuleTarget` hands that loader a scratch
tensor of canonical shape, one name at a time, and intercepts with a storage-scoped
torch dispatch mode every write it makes into the module's parameter and buffer
storage. Meanwhile it follows where each scratch element goes: through views
(``narrow``, slicing, ``t()``, ``chunk``) and bit-preserving copies (``clone``,
``contiguous``) a copy is a *placement*; through pointwise arithmetic or a dtype cast
it is a *transform*; through anything else (a reduction, a matmul) it is *opaque*.

- ``xor``: the scratch holds the XOR bits at the delta's positions; each intercepted
  placement becomes ``dst_bits[e] ^= xor_bits`` at the destination elements ``e`` that
  the changed positions reach (found by inverting the copy's views: O(changed)).
- ``overwrite``: the scratch holds the new bits at the delta's positions; each
  intercepted copy, placement or transform, writes only the destination elements
  derived from those positions, with the values the loader computed for them.
- ``full``: the loader runs for real (a dense load of that tensor), old bits saved.

A prewarm pass (:meth:`ModuleTarget.prewarm`, run lazily for every name a sync meets)
runs the loader with the interception recording, not writing, and classifies each
canonical name: ``xor`` (every copy is a placement and no destination element is
written twice, within the name or by another name, e.g. tied embeddings),
``overwrite`` (a transform or an overlap), ``opaque`` (only ``full`` works) or
``absent`` (the loader places nothing: another rank's shard or expert). A reader
records the ``overwrite`` names in ``readers/<id>.json`` so writers send them that way;
an ``xor`` change for such a name fails closed with :class:`OverwriteRequiredError`
before anything is mutated.

Placements learned once: the loader's placement of an ``xor`` name is fixed, so after the
prewarm a change to it (``xor`` or ``overwrite``) is applied without calling the loader:
straight into the learned destinations (the copy's views inverted, O(changed), or a sorted
index table where they do not invert), and where the loader copies the whole tensor
unchanged into one contiguous run of a parameter (a whole weight, a row block of a fused
``qkv_proj``) through a canonical view of that run, with the fused apply a plain tensor
gets. The loader still runs for the names it transforms and for ``full`` writes. Each sync
first checks that every parameter and buffer still has the storage it had when the
placements were learned, and learns again the names placed in one that moved.

Verification: for ``xor`` names the canonical bits the module holds are read back
through the inverse of the placements, giving the fingerprint lanes of the canonical
elements this rank holds. A module holding whole tensors is verified exactly like a
dict of tensors. For a tensor-parallel shard the lanes are partial; with
``reduce_lanes`` (e.g. :func:`all_reduce_lanes` over the tensor-parallel group) the
ranks' disjoint parts are summed into the full lanes and checked; without it those
names are reported in ``SyncResult.unverified``, as are names the loader transforms
(their canonical bits cannot be read back).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcr_format.chain.layout import View
from dcr_format.delta.delta import FULL, OVERWRITE, XOR, DecodedDelta, apply_change
from dcr_format.delta.fingerprint import LANE_PRIMES, lanes_after_change, lanes_at, tensor_lanes
from dcr_format.errors import OverwriteRequiredError, TargetError
from dcr_format.format.dtypes import BY_TORCH, bits_view
from dcr_format.targets.targets import (
    Applied,
    Change,
    Resident,
    Target,
    Transaction,
    baseline_coding_error,
)

__all__ = ["LoaderPlan", "ModuleTarget", "all_reduce_lanes"]

aten = torch.ops.aten
_MOVES = {aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default}
_DTYPE_COPIES = {aten._to_copy.default}

# --- provenance of tensors derived from the scratch -------------------------------------


@dataclass(frozen=True)
class _Prov:
    """Where the elements of one storage come from.

    ``scratch``: storage element ``i`` is canonical position ``i``. ``derived``: the
    storage was made by one op whose output (geometry ``out`` in this storage) is,
    element by element, the input ``parent`` (a provenance and that input's view);
    ``transformed`` when the op (or any before it) changed values. ``opaque``: unknown.
    """

    kind: str  # "scratch" | "derived" | "opaque"
    element_size: int
    transformed: bool = False
    out: View | None = None
    parent: tuple[_Prov, View] | None = None


def _view_of(t: torch.Tensor, shape: Sequence[int] | None = None) -> View:
    """Geometry of ``t`` in its storage (element units), expanded to ``shape`` if given."""
    if shape is not None and tuple(t.shape) != tuple(shape):
        t = t.expand(tuple(shape))
    return View(int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))


def _canonical_of(prov: _Prov, view: View, k: torch.Tensor) -> torch.Tensor:
    """Canonical positions of logical elements ``k`` of a tensor with ``view``."""
    elements = view.elements(k)
    while prov.kind == "derived":
        assert prov.out is not None and prov.parent is not None
        _, k = prov.out.locate(elements)
        prov, view = prov.parent
        elements = view.elements(k)
    return elements


def _preimage(
    prov: _Prov, view: View, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(k, i)``: logical elements ``k`` of the tensor that hold ``positions[i]``; None when
    a view on the way cannot be inverted (then callers go dense)."""
    if prov.kind == "scratch":
        if not view.nested:
            return None
        inside, k = view.locate(positions)
        return k[inside], torch.nonzero(inside).reshape(-1)
    assert prov.out is not None and prov.parent is not None
    found = _preimage(prov.parent[0], prov.parent[1], positions)
    if found is None or not view.nested:
        return None
    k_parent, index = found
    inside, k = view.locate(prov.out.elements(k_parent))
    return k[inside], index[inside]


def _key(t: torch.Tensor) -> tuple[str, int]:
    return (t.device.type, t.untyped_storage().data_ptr())


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments an op mutates (``Tensor(a!)`` in its schema)."""
    out: list[torch.Tensor] = []
    for index, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(arg.name)
        out.extend(_tensors(value))
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat tensor of ``t``'s dtype."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(t, (numel,), (1,), 0)


def _bits(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype not in BY_TORCH:
        raise TargetError(f"{what}: module storage of dtype {t.dtype} cannot take exact bits")
    return bits_view(t)


# --- what one loader call did -------------------------------------------------------------


@dataclass
class _Copy:
    """One intercepted write into module storage."""

    kind: str  # "placement" | "transform" | "opaque" | "foreign" | "unsupported"
    storage: tuple[str, int]
    dst: View
    dst_dtype: torch.dtype
    src: tuple[_Prov, View] | None = None
    op: str = ""
    # the copy's canonical positions sorted, with its logical elements in that order: built
    # on first use where the copy's views cannot be inverted arithmetically
    table: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)


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


# torch leaves TorchDispatchMode's __init_subclass__ and __init__ unannotated
class _Interceptor(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Follows scratch-derived tensors and routes every write into module storage."""

    def __init__(
        self,
        module_storages: set[tuple[str, int]],
        scratch: torch.Tensor,
        on_write: Callable[[Any, tuple[Any, ...], dict[str, Any], list[torch.Tensor]], Any],
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.module_storages = module_storages
        self.on_write = on_write
        self.prov: dict[tuple[str, int], tuple[_Prov, torch.Tensor]] = {
            _key(scratch): (_Prov("scratch", scratch.element_size()), scratch)
        }
        self.scratch_key = _key(scratch)
        self.scratch_touched = False

    def source(self, t: torch.Tensor, shape: Sequence[int]) -> tuple[_Prov, View] | None:
        found = self.prov.get(_key(t))
        if found is None:
            return None
        prov = found[0]
        if prov.kind != "opaque" and prov.element_size != t.element_size():
            prov = _Prov("opaque", t.element_size())  # a reinterpretation of other widths
        return prov, _view_of(t, shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        hits = [t for t in written if _key(t) in self.module_storages]
        if hits:
            return self.on_write(func, args, kwargs, hits)
        out = func(*args, **kwargs)
        inputs = [t for t in _tensors((args, kwargs)) if _key(t) in self.prov]
        if inputs:
            self._follow(func, args, kwargs, inputs, out, written)
        return out

    def _follow(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[torch.Tensor],
        out: Any,
        written: list[torch.Tensor],
    ) -> None:
        """Track what an op outside module storage made from scratch-derived inputs."""
        pointwise = torch.Tag.pointwise in getattr(func, "tags", ())
        for t in written:  # in-place ops on scratch-derived storage
            self._follow_written(func, args, kwargs, inputs, t, pointwise)
        if written:
            return
        operands = {_key(t) for t in _tensors((args, kwargs))}
        for result in _tensors(out):
            key = _key(result)
            if key in self.prov or key in operands:
                continue  # a view of an input
            self._follow_result(func, kwargs, inputs, result, pointwise)

    def _follow_written(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[torch.Tensor],
        t: torch.Tensor,
        pointwise: bool,
    ) -> None:
        """An op wrote ``t`` in place (outside module storage)."""
        key = _key(t)
        if key == self.scratch_key:
            self.scratch_touched = True
        if key in self.prov:
            prov, keep = self.prov[key]
            # pointwise in place, reading only the element it writes: still one canonical
            # element per element, but transformed; anything else loses track
            alone = all(_key(i) == key and _view_of(i) == _view_of(t) for i in inputs)
            if func is aten.copy_.default and alone:
                return  # a copy onto itself
            kind = prov.kind if pointwise and alone else "opaque"
            self.prov[key] = (_Prov(kind, prov.element_size, True, prov.out, prov.parent), keep)
        elif func is aten.copy_.default and _key(args[1]) in self.prov:
            self._register(t, args[1], func, kwargs, full_storage=True)
        else:
            self.prov[key] = (_Prov("opaque", t.element_size()), t)

    def _follow_result(
        self,
        func: Any,
        kwargs: dict[str, Any],
        inputs: list[torch.Tensor],
        result: torch.Tensor,
        pointwise: bool,
    ) -> None:
        """An op made a new tensor ``result`` from scratch-derived ``inputs``."""
        one_input = len({_key(t) for t in inputs}) == 1
        if one_input and (func in _MOVES or func in _DTYPE_COPIES or pointwise):
            source = inputs[0]
            # every scratch-derived operand is the same view: element k depends on one
            # canonical element (x * x, not x[:4] * x[4:])
            one_view = all(_view_of(t) == _view_of(source) for t in inputs)
            if one_view and tuple(source.shape) == tuple(result.shape):
                self._register(result, source, func, kwargs, full_storage=False)
                return
        self.prov[_key(result)] = (_Prov("opaque", result.element_size()), result)

    def _register(self, result, source, func, kwargs, *, full_storage: bool) -> None:  # type: ignore[no-untyped-def]
        key = _key(result)
        found = self.source(source, result.shape)
        out = _view_of(result)
        numel = result.untyped_storage().nbytes() // max(result.element_size(), 1)
        if found is None or found[0].kind == "opaque" or not out.nested:
            self.prov[key] = (_Prov("opaque", result.element_size()), result)
            return
        if full_storage and out.numel != numel:
            self.prov[key] = (_Prov("opaque", result.element_size()), result)
            return
        parent_prov, parent_view = found
        moves = (
            func in _MOVES or func is aten.copy_.default or func in _DTYPE_COPIES
        ) and result.dtype == source.dtype
        transformed = parent_prov.transformed or not moves
        prov = _Prov("derived", result.element_size(), transformed, out, (parent_prov, parent_view))
        self.prov[key] = (prov, result)


def all_reduce_lanes(
    group: Any = None,
) -> Callable[[dict[str, tuple[int, ...]]], dict[str, tuple[int, ...]]]:
    """A ``reduce_lanes`` for :class:`ModuleTarget` over a ``torch.distributed`` group (the
    tensor-parallel ranks of one model replica, a backend that carries objects)."""

    def reduce(lanes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, lanes, group=group)
        total: dict[str, list[int]] = {}
        for part in gathered:
            for name, values in part.items():
                sums = total.setdefault(name, [0] * len(values))
                for i, v in enumerate(values):
                    sums[i] += v
        return {name: tuple(v) for name, v in total.items()}

    return reduce


# --- the target --------------------------------------------------------------------------


class ModuleTarget(Target):
    """A ``torch.nn.Module`` updated in place through its own loader.

    ``load_weights``: a vLLM-style ``load_weights(iterable of (name, tensor))``; it is
    called with one name at a time and may skip names it does not load on this rank.
    Without it the module's ``load_state_dict(..., strict=False)`` is used, and a name
    it reports as unexpected is an error. ``reduce_lanes`` sums partial fingerprint lanes
    over the ranks that share tensors (see :func:`all_reduce_lanes`); every rank must then
    sync together. ``version``/``chain_id`` declare a module already holding a version
    (loaded from that version's checkpoint). ``rollback_full`` keeps the old bits of
    whatever a ``full`` write replaces (a copy of the replaced parameters), so a failed
    sync can be undone; without it a failure during a base leaves the module mixed (and
    not resident at any version).

    ``direct``: a name whose loader only places elements (an ``xor`` plan) takes its later
    changes straight into the parameter storage, through the placements learned from the
    loader once, without calling the loader again; the loader still runs for names it
    transforms and for ``full`` writes. The placements are learned again when a parameter's
    storage has moved since (checked at the start of every sync). Without ``direct`` every
    change goes through the loader.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
        reduce_lanes: Callable[[dict[str, tuple[int, ...]]], dict[str, tuple[int, ...]]]
        | None = None,
        version: int | None = None,
        chain_id: str | None = None,
        rollback_full: bool = True,
        direct: bool = True,
    ) -> None:
        if (version is None) != (chain_id is None):
            raise ValueError("give both version and chain_id for a module that holds a version")
        self.module = module
        self.load_weights = load_weights
        self.reduce_lanes = reduce_lanes
        self.rollback_full = rollback_full
        self.direct = direct
        self._resident = Resident(chain_id, version) if chain_id and version is not None else None
        self._declared = self._resident is not None  # held names come from the plans
        self._held: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._plans: dict[tuple[str, torch.dtype, tuple[int, ...]], LoaderPlan] = {}
        self._extents: dict[tuple[str, int], list[tuple[int, int, str, list[_Copy]]]] = {}
        self._scratch: torch.Tensor | None = None
        self._mark: torch.Tensor | None = None
        # where each parameter and buffer lived when the plans were learned
        self._layout: dict[str, tuple[str, int]] | None = None
        self._by_key: dict[tuple[str, int], torch.Tensor] | None = None
        self._views: dict[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor | None] = {}

    # --- Target -------------------------------------------------------------------------

    def resident(self) -> Resident | None:
        """The version the module holds (as last synced, or as declared)."""
        return self._resident

    def begin(self) -> Transaction:
        """A transaction applying through the loader (or the placements learned from it)."""
        self._check_layout()
        return _ModuleTransaction(self)

    def claim_key(self) -> Hashable:
        """The module: targets over one module take turns."""
        return ("module", id(self.module))

    def _current_layout(self) -> dict[str, tuple[str, int]]:
        return {
            n: _key(t)
            for n, t in [
                *self.module.named_parameters(remove_duplicate=False),
                *self.module.named_buffers(remove_duplicate=False),
            ]
        }

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
        self._extents.clear()
        for plan in self._plans.values():  # the shared-storage index, without the stale names
            if plan.kind in ("xor", "overwrite"):
                self._check_shared(plan)
        for name, dtype, shape in stale:
            self.plan(name, dtype, shape)

    def accepts(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        """Whether the loader places ``name`` in this module (prewarms it on first sight)."""
        return self.plan(name, dtype, shape).kind != "absent"

    def reads_baseline(self) -> bool:
        """False: the module's tensors are reached through its loader, not as canonical bits."""
        return False

    def overwrite_names(self) -> frozenset[str]:
        """Names whose load path is not bit-preserving (they need ``overwrite``)."""
        return frozenset(p.name for p in self._plans.values() if p.kind == "overwrite")

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
            for count in (1, 3 * 8192):  # one chunk (serial kernels) and several (parallel)
                tensor = torch.zeros(count, dtype=dtype)
                flat = bits_view(tensor)
                positions = torch.arange(count, dtype=torch.int64)
                for op in (XOR, OVERWRITE):
                    done = apply_change(tensor, DecodedDelta(op, positions, flat.clone()))
                    assert done.before is not None
                    lanes_after_change(tensor_lanes(tensor), positions, done.before, flat.clone())

    def plan(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> LoaderPlan:
        """How the loader takes canonical tensor ``name`` (cached; one recording run)."""
        key = (name, dtype, tuple(shape))
        plan = self._plans.get(key)
        if plan is None:
            if self._layout is None:
                self._layout = self._current_layout()
            plan = self._record(name, dtype, tuple(shape))
            self._plans[key] = plan
            if plan.kind in ("xor", "overwrite"):
                self._check_shared(plan)
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
        spec = self._held.get(name)
        if spec is not None:
            return self._plans.get((name, *spec))
        found = [p for p in self._plans.values() if p.name == name and p.kind != "absent"]
        return found[0] if len(found) == 1 else None

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


class _ModuleTransaction(Transaction):
    """One sync into a :class:`ModuleTarget`: the changes go through the loader."""

    def __init__(self, target: ModuleTarget) -> None:
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
        plan = self.target._plan_of(name)
        if plan is None or plan.kind != "xor" or not self.target.direct:
            return None
        return self.target._canonical_view(plan)

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
        for change in changes:
            if change.delta.op == FULL:
                continue
            if change.delta.positions is not None and change.delta.positions.numel() == 0:
                continue
            if change.delta.needs_target:  # no canonical old bits to decode against
                raise baseline_coding_error(change.name)
            plan = self.target.plan(change.name, change.dtype, change.shape)
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
        for name, values in lanes.items():
            plan = self.target._plan_of(name)
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
        target, delta = self.target, change.delta
        assert delta.positions is not None
        positions = delta.positions.to(torch.int64).cpu()
        run = _Run(target, plan, delta.op, positions, delta.values.cpu())
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
        self._held[change.name] = (change.dtype, change.shape)
        readback = run.readback()
        assert readback is not None  # placements only: the bits moved are known
        return Applied(run.undo, *readback)


class _Run:
    """One loader run applying one change: performs (or refuses) each intercepted write."""

    def __init__(
        self,
        target: ModuleTarget,
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
