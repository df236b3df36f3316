"""Following a module's loader: where each element of a canonical scratch tensor goes.

:class:`_Interceptor` is a torch dispatch mode that tracks every tensor derived from the
scratch (its provenance, :class:`_Prov`: through views and bit-preserving copies a
*placement*, through pointwise arithmetic or a cast a *transform*, through anything else
*opaque*) and hands every write into the module's parameter and buffer storage to a
callback, which describes it as a :class:`_Copy`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcr_format.chain.layout import View
from dcr_format.errors import TargetError
from dcr_format.format.dtypes import BY_TORCH, bits_view

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
    """Where a tensor's storage lives: its device type and the storage's address."""
    # ``is_cpu`` first: ``t.device`` makes a new object (a sync keys every parameter)
    return ("cpu" if t.is_cpu else t.device.type, t.untyped_storage().data_ptr())


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
