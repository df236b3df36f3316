"""Where a sharded tensor's local shard sits in its canonical tensor: the placement
arithmetic of a device mesh.

:func:`sharded` turns a mesh shape, a rank's coordinate and one placement per mesh
dimension (shards along any dimension, uneven splits, strided shards, replicas) into the
:class:`~dcr_format.chain.layout.Piece` objects of that rank, as torch's ``DTensor``
places them; :func:`placed` reads those from a ``DTensor`` itself (its mesh, coordinate
and placements, and the copies of a mesh sliced from a larger one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from dcr_format.chain.layout import Piece, block, numel
from dcr_format.errors import ArgumentError, UnsupportedPlacementError

__all__ = ["Placement", "placed", "sharded"]


Placement = tuple[int, int] | None
"""One mesh dimension's placement of a tensor: ``(dim, split_factor)`` where it shards tensor
dimension ``dim`` (``split_factor`` 1 for ``Shard(dim)``, more for ``_StridedShard``), None
where it replicates."""


def _shard_indices(indices: list[int], chunks: int, index: int, split_factor: int) -> list[int]:
    """The elements of ``indices`` that shard ``index`` of ``chunks`` holds, as torch's
    ``Shard`` (``split_factor`` 1: chunks of ``ceil(n / chunks)``, the last ones shorter
    or empty) and ``_StridedShard`` (each of ``split_factor`` such chunks split again and
    shard ``index`` of each kept, in order) place them."""
    if split_factor > 1:
        size = -(-len(indices) // split_factor)
        groups = [indices[at : at + size] for at in range(0, len(indices), max(size, 1))]
    else:
        groups = [indices]
    out: list[int] = []
    for group in groups:
        size = -(-len(group) // chunks)
        out.extend(group[index * size : (index + 1) * size])
    return out


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """``(start, length, local_start)`` of each run of consecutive values in ``indices``."""
    runs: list[tuple[int, int, int]] = []
    for local, value in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][1] == value:
            start, length, at = runs[-1]
            runs[-1] = (start, length + 1, at)
        else:
            runs.append((value, 1, local))
    return runs


def _ravel(coordinate: Sequence[int], sizes: Sequence[int]) -> int:
    flat = 0
    for c, n in zip(coordinate, sizes, strict=True):
        flat = flat * n + c
    return flat


def sharded(
    name: str,
    shape: Sequence[int],
    *,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    local: str | None = None,
) -> list[Piece]:
    """What the rank at ``coordinate`` of a device mesh of ``mesh_shape`` holds of canonical
    tensor ``name`` placed by ``placements`` (one per mesh dimension, see
    :data:`Placement`), as torch's ``DTensor`` places it: shards along any dimension
    (uneven splits included), strided shards (FSDP2 over tensor parallelism), replicas.

    The rank's shard coordinates number its part among the mesh's shards, its replicate
    coordinates its replica; one piece per run of consecutive canonical indices.
    """
    shape = tuple(int(s) for s in shape)
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ArgumentError(f"{name}: mesh shape, coordinate and placements differ in length")
    indices = [list(range(n)) for n in shape]
    shard_at: list[int] = []
    replicate_at: list[int] = []
    for mesh_dim, placement in enumerate(placements):
        if placement is None:
            replicate_at.append(mesh_dim)
            continue
        dim, split_factor = placement
        dim %= len(shape)
        indices[dim] = _shard_indices(
            indices[dim], int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim]), split_factor
        )
        shard_at.append(mesh_dim)
    parts = numel([mesh_shape[d] for d in shard_at])
    part = _ravel([coordinate[d] for d in shard_at], [mesh_shape[d] for d in shard_at])
    replicas = numel([mesh_shape[d] for d in replicate_at])
    replica = _ravel([coordinate[d] for d in replicate_at], [mesh_shape[d] for d in replicate_at])
    local_shape = tuple(len(i) for i in indices)
    if numel(local_shape) == 0:  # an empty shard: one empty piece (its part is still listed)
        runs = [[(0, 0, 0)] for _ in indices]
    else:
        runs = [_runs(i) for i in indices]
    pieces: list[Piece] = []
    combos: list[tuple[tuple[int, int, int], ...]] = [()]
    for dim_runs in runs:
        combos = [(*c, r) for c in combos for r in dim_runs]
    for combo in combos:
        pieces.append(
            block(
                local or name,
                local_shape,
                name,
                shape,
                sizes=[r[1] for r in combo],
                canonical_start=[r[0] for r in combo],
                local_start=[r[2] for r in combo],
                part=part,
                parts=parts,
                replica=replica,
                replicas=replicas,
            )
        )
    return pieces


def placed(name: str, tensor: torch.Tensor) -> list[Piece]:
    """The pieces of canonical tensor ``name`` that a ``torch.distributed`` ``DTensor``'s
    local shard (``tensor.to_local()``, the local tensor of the same name) holds, from
    its device mesh and placements (see :func:`sharded`); ``Partial`` placements (sums
    not yet reduced) are refused with :class:`UnsupportedPlacementError`."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if not isinstance(tensor, DTensor):
        raise TypeError(f"{name!r} is not a DTensor")
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedPlacementError(
            f"this rank is not in the device mesh of {name!r}; publish from the ranks that hold it"
        )
    placements: list[Placement] = []
    for placement in tensor.placements:
        if isinstance(placement, _StridedShard):
            placements.append((placement.dim, int(placement.split_factor)))
        elif isinstance(placement, Shard):
            placements.append((placement.dim, 1))
        elif isinstance(placement, Replicate):
            placements.append(None)
        else:
            raise UnsupportedPlacementError(
                f"{name!r} is placed {placement} (a partial sum is not a weight); reduce it "
                "(redistribute to Shard or Replicate) before publishing"
            )
    pieces = sharded(
        name,
        tuple(tensor.shape),
        mesh_shape=tuple(mesh.shape),
        coordinate=tuple(coordinate),
        placements=placements,
    )
    copy, copies = _mesh_copy(mesh)
    if copies == 1:
        return pieces
    return [
        dataclasses.replace(p, replica=p.replica + p.replicas * copy, replicas=p.replicas * copies)
        for p in pieces
    ]


def _mesh_copy(mesh: object) -> tuple[int, int]:
    """Which of the copies of a device mesh this rank is in, and how many there are: a
    mesh sliced from a larger one (the data-parallel dimension of a 2-D mesh) is repeated
    along the other dimensions, whose ranks hold the same shards."""
    root = mesh._get_root_mesh()  # type: ignore[attr-defined]
    if root is mesh:
        return 0, 1
    ranks = {int(r) for r in mesh.mesh.reshape(-1).tolist()}  # type: ignore[attr-defined]
    grid = root.mesh
    at = root.get_coordinate()
    if at is None:
        return 0, 1
    other = []
    for dim in range(grid.ndim):
        if grid.shape[dim] < 2:
            continue
        step = list(at)
        step[dim] = (step[dim] + 1) % grid.shape[dim]
        if int(grid[tuple(step)]) not in ranks:
            other.append(dim)
    sizes = [int(grid.shape[d]) for d in other]
    return _ravel([at[d] for d in other], sizes), numel(sizes)
