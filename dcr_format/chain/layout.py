"""Canonical coordinates on the trainer side: where a trainer's local tensors sit in the
canonical (Hugging Face) tensors the format carries.

A trainer holds its weights in its own layout: tensor-parallel shards, fused
``qkv``/``gate_up`` matrices, Megatron's QKV interleaved by query group, transposed
matrices, stacked experts. A :class:`Layout` describes that relation as
:class:`Piece` objects. A piece is a pair of strided :class:`View` objects of the same
logical shape, one over a local tensor's row-major elements and one over a canonical
tensor's: element ``k`` of the local view holds element ``k`` of the canonical view.
This covers any placement that moves elements without changing them, so a writer can
diff a local tensor against its own baseline and carry the changed local positions to
canonical flat indices arithmetically (:meth:`Piece.project`), never building a
canonical tensor.

Tensors that are not a pure placement (a cast from fp32 masters, a merge of adapters)
are :class:`Conversion` objects: a function of local tensors whose output is then placed
like a local tensor (a whole canonical tensor by default), diffed against the previous
output (the residual baseline, in canonical bits).

Ownership: a canonical tensor split over ``parts`` ranks is published as ``parts``
pieces, piece ``part`` by the rank holding it (FORMAT.md §4.8). Ranks holding the same
elements (data-parallel replicas, or tensor-parallel ranks that replicate a norm) are
*replicas*: exactly one of them publishes, the replica ``crc32(name) mod replicas``.

A ``DTensor``'s local shard is placed by its device mesh
(:mod:`dcr_format.chain.placement`).

The constructors return lists of pieces to combine into one layout::

    layout = Layout([
        *fused("qkv", [("q_proj.weight", (64, 32)), ("k_proj.weight", (16, 32)),
                       ("v_proj.weight", (16, 32))], dim=0, rank=tp_rank, size=tp),
        *shard("o_proj.weight", (32, 64), dim=1, rank=tp_rank, size=tp),
        *whole("norm.weight", (32,), replica=tp_rank, replicas=tp),
    ], replica=dp_rank, replicas=dp)
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from dcr_format.errors import ArgumentError, MissingTensorError
from dcr_format.format.dtypes import bits_view

__all__ = [
    "Conversion",
    "Layout",
    "Piece",
    "View",
    "block",
    "converted",
    "experts",
    "fused",
    "interleaved_qkv",
    "shard",
    "transposed",
    "whole",
]

CONVERTED_PREFIX = "converted:"  # local name of a conversion's output


def numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= int(dim)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class View:
    """A strided view over a tensor's row-major flat elements.

    Element ``k`` of the view (row-major over ``sizes``) is flat element
    ``offset + sum(idx[d] * strides[d])`` of the tensor, where ``idx`` is ``k``
    unravelled by ``sizes``.
    """

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))
        if len(self.sizes) != len(self.strides):
            raise ArgumentError(
                f"view sizes {self.sizes} and strides {self.strides} differ in rank"
            )
        if self.offset < 0 or any(s < 0 for s in self.sizes) or any(s < 0 for s in self.strides):
            raise ArgumentError(f"view {self} has a negative offset, size or stride")

    @property
    def numel(self) -> int:
        """Elements in the view."""
        return numel(self.sizes)

    @property
    def end(self) -> int:
        """One past the largest flat element the view touches (``offset`` when empty)."""
        if self.numel == 0:
            return self.offset
        return (
            self.offset
            + sum((n - 1) * s for n, s in zip(self.sizes, self.strides, strict=True))
            + 1
        )

    @cached_property
    def _order(self) -> tuple[int, ...] | None:
        """Dimensions by decreasing stride when the view is *nested* (each stride exceeds the
        span of all smaller ones), which makes it injective and exactly invertible by
        successive division; None otherwise."""
        dims = sorted(
            (d for d, n in enumerate(self.sizes) if n > 1), key=lambda d: -self.strides[d]
        )
        span = 0
        for d in reversed(dims):
            if self.strides[d] <= span:
                return None
            span += self.strides[d] * (self.sizes[d] - 1)
        return tuple(dims)

    @cached_property
    def contiguous(self) -> bool:
        """Whether the view is one run of consecutive flat elements in view order."""
        return all(
            n <= 1 or s == step
            for n, s, step in zip(self.sizes, self.strides, _row_major(self.sizes), strict=True)
        )

    @property
    def nested(self) -> bool:
        """Whether :meth:`locate` can invert the view (no element reached twice)."""
        return self._order is not None

    def elements(self, k: torch.Tensor | None = None) -> torch.Tensor:
        """Flat elements of view positions ``k`` (int64), or of the whole view in view order."""
        if k is None:
            out = torch.full((1,), self.offset, dtype=torch.int64)
            for n, s in zip(self.sizes, self.strides, strict=True):
                out = (out[:, None] + torch.arange(n, dtype=torch.int64) * s).reshape(-1)
            return out
        k = k.to(torch.int64)
        if self.contiguous:
            return k + self.offset
        out = torch.full_like(k, self.offset)
        for n, s, step in zip(self.sizes, self.strides, _row_major(self.sizes), strict=True):
            if n > 1:
                out += (k // step % n) * s
        return out

    def locate(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Invert the view: ``(inside, k)`` for flat elements ``flat`` (``k`` valid where
        ``inside``). O(len(flat) * ndim); the view must be :attr:`nested`."""
        order = self._order
        if order is None:
            raise ArgumentError(f"view {self} is not nested; it cannot be inverted")
        rel = flat.to(torch.int64) - self.offset
        inside = rel >= 0
        if self.numel == 0:
            return torch.zeros_like(inside), torch.zeros_like(rel)
        if self.contiguous:
            return inside & (rel < self.numel), rel
        k = torch.zeros_like(rel)
        steps = _row_major(self.sizes)
        for d in order:
            q = torch.div(rel, self.strides[d], rounding_mode="floor")
            inside &= (q >= 0) & (q < self.sizes[d])
            rel = rel - q * self.strides[d]
            k += q * steps[d]
        inside &= rel == 0
        return inside, k


@dataclass(frozen=True)
class Piece:
    """Elements of one local tensor that are elements of one canonical tensor.

    ``local_view`` (over the local tensor of shape ``local_shape``) and
    ``canonical_view`` (over canonical tensor ``canonical`` of shape ``shape``) have
    the same sizes; their ``k``-th elements are the same weight. ``part``/``parts``:
    which of the canonical tensor's disjoint regions (one per rank holding a share)
    this is; pieces of one rank with the same ``part`` form one region. ``replica``/
    ``replicas``: how many ranks hold this same region, and which of them this is.
    """

    local: str
    local_shape: tuple[int, ...]
    canonical: str
    shape: tuple[int, ...]
    local_view: View
    canonical_view: View
    part: int = 0
    parts: int = 1
    replica: int = 0
    replicas: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_shape", tuple(int(s) for s in self.local_shape))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        what = f"piece of {self.canonical!r} in {self.local!r}"
        if self.local_view.sizes != self.canonical_view.sizes:
            raise ArgumentError(f"{what}: local and canonical views differ in shape")
        if not (self.local_view.nested and self.canonical_view.nested):
            raise ArgumentError(f"{what}: a view reaches an element twice (not a placement)")
        if self.local_view.end > numel(self.local_shape):
            raise ArgumentError(f"{what}: the local view runs past the local tensor")
        if self.canonical_view.end > numel(self.shape):
            raise ArgumentError(f"{what}: the canonical view runs past the canonical tensor")
        if not (0 <= self.part < self.parts and 0 <= self.replica < self.replicas):
            raise ArgumentError(f"{what}: part or replica out of range")

    def project(self, local_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(local, canonical)`` flat indices of the given local elements that this piece
        places, in the order given: the changed-positions projection of a writer."""
        inside, k = self.local_view.locate(local_flat)
        if bool(inside.all()):  # (a piece holding the whole local tensor)
            return local_flat, self.canonical_view.elements(k)
        return local_flat[inside], self.canonical_view.elements(k[inside])

    def region(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(local, canonical)`` flat indices of every element of the piece, in view order."""
        return self.local_view.elements(), self.canonical_view.elements()


@dataclass(frozen=True)
class Conversion:
    """A local tensor computed from others by ``fn`` (a cast, a merge): the residual path.

    Its output, named ``name`` among the local tensors, is placed by pieces like any
    local tensor; the writer diffs it against its previous output.
    """

    name: str
    inputs: tuple[str, ...]
    fn: Callable[..., torch.Tensor] = field(compare=False)


def _contiguous_view(shape: Sequence[int], starts: Sequence[int], sizes: Sequence[int]) -> View:
    strides = _row_major(shape)
    return View(sum(a * s for a, s in zip(starts, strides, strict=True)), tuple(sizes), strides)


def block(
    local: str,
    local_shape: Sequence[int],
    canonical: str,
    shape: Sequence[int],
    *,
    sizes: Sequence[int],
    canonical_start: Sequence[int] | None = None,
    local_start: Sequence[int] | None = None,
    perm: Sequence[int] | None = None,
    part: int = 0,
    parts: int = 1,
    replica: int = 0,
    replicas: int = 1,
) -> Piece:
    """A rectangular block of ``sizes`` (canonical dimension order) at ``canonical_start``
    of the canonical tensor, held at ``local_start`` of a local tensor whose dimension
    ``i`` is canonical dimension ``perm[i]`` (default: same order)."""
    ndim = len(shape)
    perm = tuple(range(ndim)) if perm is None else tuple(perm)
    if sorted(perm) != list(range(ndim)) or len(local_shape) != ndim:
        raise ArgumentError(f"perm {perm} does not map {tuple(local_shape)} onto {tuple(shape)}")
    canonical_start = tuple(canonical_start or (0,) * ndim)
    local_start = tuple(local_start or (0,) * ndim)
    canonical_view = _contiguous_view(shape, canonical_start, sizes)
    local_strides = _row_major(local_shape)
    # canonical dim d sits at local dim perm.index(d)
    strides = tuple(local_strides[perm.index(d)] for d in range(ndim))
    offset = sum(a * s for a, s in zip(local_start, local_strides, strict=True))
    return Piece(
        local,
        tuple(local_shape),
        canonical,
        tuple(shape),
        View(offset, tuple(sizes), strides),
        canonical_view,
        part,
        parts,
        replica,
        replicas,
    )


def whole(
    name: str,
    shape: Sequence[int],
    *,
    local: str | None = None,
    replica: int = 0,
    replicas: int = 1,
) -> list[Piece]:
    """A canonical tensor held whole (as ``local``, default the same name); ``replica`` of
    ``replicas`` ranks that all hold it (e.g. a norm on every tensor-parallel rank)."""
    return [
        block(
            local or name,
            shape,
            name,
            shape,
            sizes=shape,
            replica=replica,
            replicas=replicas,
        )
    ]


def _split(extent: int, size: int, what: str) -> int:
    if size < 1 or extent % size:
        raise ArgumentError(f"{what}: {extent} does not split into {size} equal shards")
    return extent // size


def shard(
    name: str,
    shape: Sequence[int],
    *,
    dim: int,
    rank: int,
    size: int,
    local: str | None = None,
    replica: int = 0,
    replicas: int = 1,
) -> list[Piece]:
    """Tensor-parallel shard ``rank`` of ``size`` along ``dim`` (column-parallel: dim 0 of a
    weight; row-parallel: dim 1): a :func:`fused` local tensor of one canonical tensor."""
    return fused(
        local or name,
        [(name, shape)],
        dim=dim,
        rank=rank,
        size=size,
        replica=replica,
        replicas=replicas,
    )


def fused(
    local: str,
    parts: Sequence[tuple[str, Sequence[int]]],
    *,
    dim: int = 0,
    rank: int = 0,
    size: int = 1,
    replica: int = 0,
    replicas: int = 1,
) -> list[Piece]:
    """A local tensor that concatenates, along ``dim``, shard ``rank`` of ``size`` of each
    canonical tensor in ``parts`` (fused QKV, gate/up: ``[("q", shape), ("k", shape), ...]``).
    """
    shapes = [tuple(shape) for _, shape in parts]
    ndim = len(shapes[0])
    dim = dim % ndim
    if any(
        len(s) != ndim or s[:dim] + s[dim + 1 :] != shapes[0][:dim] + shapes[0][dim + 1 :]
        for s in shapes
    ):
        raise ArgumentError(f"{local}: fused tensors differ outside dimension {dim}")
    chunks = [_split(s[dim], size, name) for (name, _), s in zip(parts, shapes, strict=True)]
    local_shape = (*shapes[0][:dim], sum(chunks), *shapes[0][dim + 1 :])
    pieces, at = [], 0
    for (name, _), shape, chunk in zip(parts, shapes, chunks, strict=True):
        sizes = (*shape[:dim], chunk, *shape[dim + 1 :])
        canonical_start = [0] * ndim
        canonical_start[dim] = rank * chunk
        local_start = [0] * ndim
        local_start[dim] = at
        pieces.append(
            block(
                local,
                local_shape,
                name,
                shape,
                sizes=sizes,
                canonical_start=canonical_start,
                local_start=local_start,
                part=rank if size > 1 else 0,
                parts=size,
                replica=replica,
                replicas=replicas,
            )
        )
        at += chunk
    return pieces


def interleaved_qkv(
    local: str,
    q: str,
    k: str,
    v: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    inner: Sequence[int] = (),
    rank: int = 0,
    size: int = 1,
    replica: int = 0,
    replicas: int = 1,
) -> list[Piece]:
    """Megatron's fused QKV: rows grouped by query group, each group holding its
    ``num_heads / num_kv_heads`` query heads, then its key head, then its value head;
    tensor-parallel rank ``rank`` of ``size`` holds a contiguous run of groups.
    ``inner`` is the trailing shape (``(hidden,)`` for a weight, ``()`` for a bias)."""
    if num_heads % num_kv_heads:
        raise ArgumentError(f"{local}: {num_heads} heads do not form {num_kv_heads} groups")
    groups = _split(num_kv_heads, size, local)  # groups on this rank
    per_group = num_heads // num_kv_heads
    inner = tuple(inner)
    row = numel(inner)
    local_shape = (groups * (per_group + 2) * head_dim, *inner)
    group_stride = (per_group + 2) * head_dim * row
    pieces = []
    for name, heads, at, total in (
        (q, per_group, 0, num_heads),
        (k, 1, per_group, num_kv_heads),
        (v, 1, per_group + 1, num_kv_heads),
    ):
        rows = heads * head_dim
        shape = (total * head_dim, *inner)
        sizes = (groups, rows * row)
        local_view = View(at * head_dim * row, sizes, (group_stride, 1))
        canonical_view = View(rank * groups * rows * row, sizes, (rows * row, 1))
        pieces.append(
            Piece(
                local,
                local_shape,
                name,
                shape,
                local_view,
                canonical_view,
                rank if size > 1 else 0,
                size,
                replica,
                replicas,
            )
        )
    return pieces


def transposed(
    name: str,
    shape: Sequence[int],
    *,
    local: str | None = None,
    dim: int | None = None,
    rank: int = 0,
    size: int = 1,
    replica: int = 0,
    replicas: int = 1,
) -> list[Piece]:
    """A 2-D canonical tensor held transposed (``local = canonical.T``), optionally as
    tensor-parallel shard ``rank`` of ``size`` along canonical dimension ``dim``."""
    shape = tuple(shape)
    if len(shape) != 2:
        raise ArgumentError(f"{name}: only 2-D tensors can be held transposed")
    sizes = list(shape)
    start = [0, 0]
    if dim is not None and size > 1:
        dim %= 2
        sizes[dim] = _split(shape[dim], size, name)
        start[dim] = rank * sizes[dim]
    return [
        block(
            local or name,
            (sizes[1], sizes[0]),
            name,
            shape,
            sizes=sizes,
            canonical_start=start,
            perm=(1, 0),
            part=rank if size > 1 else 0,
            parts=size if dim is not None else 1,
            replica=replica,
            replicas=replicas,
        )
    ]


def experts(
    local: str,
    names: Sequence[str],
    shape: Sequence[int],
    *,
    rank: int = 0,
    size: int = 1,
    transpose: bool = False,
    replica: int = 0,
    replicas: int = 1,
) -> list[Piece]:
    """Stacked experts: a local tensor ``(E / size, *shape)`` holding whole experts
    ``rank * E/size ...`` (expert parallelism), canonical tensor ``names[e]`` each;
    ``transpose`` when each expert's two matrix dimensions are stored swapped."""
    shape = tuple(shape)
    per_rank = _split(len(names), size, local)
    inner = (shape[1], shape[0]) if transpose else shape
    local_shape = (per_rank, *inner)
    local_strides = _row_major(local_shape)
    strides = local_strides[1:]
    if transpose:
        strides = (strides[1], strides[0])
    canonical_view = View(0, shape, _row_major(shape))  # each expert's tensor, whole
    return [
        Piece(
            local,
            local_shape,
            name,
            shape,
            View(i * local_strides[0], shape, strides),
            canonical_view,
            replica=replica,
            replicas=replicas,
        )
        for i, name in enumerate(names[rank * per_rank : (rank + 1) * per_rank])
    ]


def converted(
    name: str,
    shape: Sequence[int],
    *,
    inputs: Sequence[str],
    fn: Callable[..., torch.Tensor],
    replica: int = 0,
    replicas: int = 1,
) -> list[Piece | Conversion]:
    """A canonical tensor computed from local tensors ``inputs`` by ``fn`` (a cast of an
    fp32 master, an adapter merge): published whole from the diff of ``fn``'s outputs."""
    local = CONVERTED_PREFIX + name
    return [
        Conversion(local, tuple(inputs), fn),
        *whole(name, shape, local=local, replica=replica, replicas=replicas),
    ]


class Layout:
    """How one writer rank's local tensors relate to canonical tensors.

    ``items`` are pieces and conversions (see the constructors of this module);
    ``replica``/``replicas`` place the rank among data-parallel replicas of the whole
    layout (every piece's replica group grows by that factor).
    """

    def __init__(
        self, items: Iterable[Piece | Conversion], *, replica: int = 0, replicas: int = 1
    ) -> None:
        if not 0 <= replica < replicas:
            raise ArgumentError(f"replica {replica} is not in [0, {replicas})")
        self.replica, self.replicas = replica, replicas
        items = list(items)
        self.pieces: tuple[Piece, ...] = tuple(i for i in items if isinstance(i, Piece))
        self.conversions: dict[str, Conversion] = {}
        for item in items:
            if isinstance(item, Conversion):
                if item.name in self.conversions:
                    raise ArgumentError(f"conversion {item.name!r} is given twice")
                self.conversions[item.name] = item
        shapes: dict[str, tuple[int, ...]] = {}
        canon: dict[str, tuple[int, ...]] = {}
        regions: dict[tuple[str, int], tuple[int, int, int]] = {}
        for piece in self.pieces:
            if shapes.setdefault(piece.local, piece.local_shape) != piece.local_shape:
                raise ArgumentError(f"local tensor {piece.local!r} is given two shapes")
            if canon.setdefault(piece.canonical, piece.shape) != piece.shape:
                raise ArgumentError(f"canonical tensor {piece.canonical!r} is given two shapes")
            key = (piece.canonical, piece.part)
            group = (piece.parts, piece.replica, piece.replicas)
            if regions.setdefault(key, group) != group:
                raise ArgumentError(
                    f"pieces of part {piece.part} of {piece.canonical!r} disagree on parts "
                    "or replicas"
                )
        self.local_shapes = shapes
        self.shapes = canon
        for conversion in self.conversions.values():
            if conversion.name not in shapes:
                raise ArgumentError(f"conversion {conversion.name!r} places no piece")

    def __add__(self, other: Layout) -> Layout:
        if (self.replica, self.replicas) != (other.replica, other.replicas):
            raise ArgumentError("layouts of different replicas cannot be combined")
        return Layout(
            [*self.pieces, *self.conversions.values(), *other.pieces, *other.conversions.values()],
            replica=self.replica,
            replicas=self.replicas,
        )

    def inputs(self) -> set[str]:
        """Names of the local tensors a publish must be given."""
        needed = {p.local for p in self.pieces if p.local not in self.conversions}
        for conversion in self.conversions.values():
            needed.update(conversion.inputs)
        return needed

    def owns(self, piece: Piece) -> bool:
        """Whether this rank publishes ``piece``'s region (one replica of each does)."""
        replicas = piece.replicas * self.replicas
        replica = piece.replica + piece.replicas * self.replica
        return zlib.crc32(piece.canonical.encode()) % replicas == replica

    def regions(self) -> dict[tuple[str, int], list[Piece]]:
        """The regions this rank publishes: ``(canonical, part) -> pieces``, layout order."""
        out: dict[tuple[str, int], list[Piece]] = {}
        for piece in self.pieces:
            if self.owns(piece):
                out.setdefault((piece.canonical, piece.part), []).append(piece)
        return out

    def local_tensors(self, given: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The placed local tensors (conversions applied), detached and checked."""
        unknown = sorted(set(given) - self.inputs())
        if unknown:
            raise ArgumentError(
                f"{len(unknown)} tensors are not in the layout (first: {unknown[0]!r}); "
                "add them to the layout so that they are published"
            )
        missing = sorted(self.inputs() - set(given))
        if missing:
            raise MissingTensorError(
                f"{len(missing)} local tensors of the layout were not given "
                f"(first: {missing[0]!r}); pass every tensor each step"
            )
        out: dict[str, torch.Tensor] = {}
        for name, shape in self.local_shapes.items():
            conversion = self.conversions.get(name)
            if conversion is not None:
                with torch.no_grad():
                    tensor = conversion.fn(*(given[i].detach() for i in conversion.inputs))
            else:
                tensor = given[name]
            tensor = tensor.detach()
            if tuple(tensor.shape) != shape:
                raise ArgumentError(
                    f"local tensor {name!r} has shape {tuple(tensor.shape)}, the layout says "
                    f"{shape}"
                )
            out[name] = tensor
        return out

    def scatter(self, canonical: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Local tensors cut from canonical tensors (what each local tensor holds of them;
        elements no piece places are zero). Locals whose canonical tensors are absent are
        left out. Conversions' outputs are included under their own names."""
        return self._copy_pieces(canonical, {}, to_canonical=False)

    def gather(
        self, local: Mapping[str, torch.Tensor], into: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Canonical tensors filled with what these local tensors place (the inverse of
        :meth:`scatter`; gather every rank's locals into one dict to rebuild the full
        canonical state). Conversions are applied."""
        placed = self.local_tensors(local) if self.conversions else dict(local)
        return self._copy_pieces(placed, {} if into is None else into, to_canonical=True)

    def _copy_pieces(
        self,
        sources: Mapping[str, torch.Tensor],
        out: dict[str, torch.Tensor],
        *,
        to_canonical: bool,
    ) -> dict[str, torch.Tensor]:
        """Copy the bits of every piece whose tensor is in ``sources`` into its tensor on the
        other side in ``out`` (made, as zeros, where absent): local to canonical tensors
        (``to_canonical``) or canonical to local ones."""
        for piece in self.pieces:
            if to_canonical:
                source, name, shape = sources.get(piece.local), piece.canonical, piece.shape
            else:
                source, name, shape = sources.get(piece.canonical), piece.local, piece.local_shape
            if source is None:
                continue
            target = out.get(name)
            if target is None:
                target = out[name] = torch.zeros(shape, dtype=source.dtype, device=source.device)
            local_idx, canonical_idx = piece.region()
            into_idx, from_idx = (
                (canonical_idx, local_idx) if to_canonical else (local_idx, canonical_idx)
            )
            dst = bits_view(target).reshape(-1)
            src = bits_view(source.contiguous()).reshape(-1)
            dst[into_idx.to(dst.device)] = src[from_idx.to(src.device)]
        return out
