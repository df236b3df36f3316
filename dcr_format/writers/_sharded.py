"""The sharded part: publishing a ``torch.distributed`` state dict of ``DTensor`` objects as
each rank holds it, without gathering a tensor.

Given tensors that are ``DTensor`` objects (FSDP2, tensor parallelism, both on a 2-D
mesh, HSDP), a :class:`~dcr_format.DeltaWriter` without a layout derives one from the
tensors themselves: each ``DTensor``'s local shard is placed in its canonical tensor by
its device mesh and placements (:func:`~dcr_format.layout.placed`), and every plain
tensor is a whole tensor among ``world_size`` replicas, owned by the canonical part's
rule (``crc32(name) mod world_size``). The projection part (``writers/_projection.py``)
then diffs each local shard against the rank's own baseline of it and publishes the
changes in canonical coordinates. Only the commit protocol's small messages cross ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

import torch

from dcr_format.chain import Chain, LoadedRecord, TensorState
from dcr_format.errors import ArgumentError
from dcr_format.layout import Layout, Piece, placed, whole
from dcr_format.schema import Manifest, check_tensor_name
from dcr_format.writers._part import Attempt, Tensors, Written, pairs
from dcr_format.writers._projection import ProjectionPart


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed`` ``DTensor`` (without importing the
    distributed package where it was never loaded)."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(tensor, dtensor)


def peek_sharded(tensors: Tensors) -> tuple[bool, Tensors]:
    """Whether ``tensors`` holds ``DTensor`` objects (a mapping: any of them; a stream: its
    first), and the tensors to publish (a stream with its first pair put back)."""
    if isinstance(tensors, Mapping):
        return any(is_dtensor(t) for t in tensors.values()), tensors
    stream: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    first = next(stream, None)
    if first is None:
        return False, ()
    return is_dtensor(first[1]), itertools.chain((first,), stream)


class ShardedPart:
    """A writer rank's part of a state dict of ``DTensor`` objects (and plain tensors): its
    local shards, placed by the layout their placements give."""

    def __init__(
        self, *, rank: int, world_size: int, device: torch.device, ops: Mapping[str, str]
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.device, self.ops = device, ops
        self._pieces: tuple[Piece, ...] | None = None
        self._part: ProjectionPart | None = None
        self._restore: tuple[Chain, LoadedRecord, dict[str, TensorState]] | None = None

    @property
    def baseline(self) -> Mapping[str, torch.Tensor]:
        """The bits of the local shards this rank publishes, at the last commit."""
        return {} if self._part is None else self._part.baseline

    @property
    def layout(self) -> Layout | None:
        """The layout the tensors of the last publish gave (None before one)."""
        return None if self._part is None else self._part.layout

    def owns(self, name: str) -> bool:
        """Whether this rank publishes some region of canonical tensor ``name`` (known once
        a publish has shown the tensors' placements)."""
        return self._part is not None and self._part.owns(name)

    def check_manifest(self, manifest: Manifest, rank: int, key: str) -> None:
        """Regions follow the placements; the committer checks them when it combines pieces."""

    def restore(self, chain: Chain, latest: LoadedRecord, table: dict[str, TensorState]) -> None:
        """Continue from ``latest``: the baseline is cut at the first publish, once the
        tensors' placements say which regions this rank holds."""
        self._restore = (chain, latest, table)

    def write(self, tensors: Tensors, attempt: Attempt) -> Written:
        """Place the local shards, then publish them as the projection part does."""
        local: dict[str, torch.Tensor] = {}
        pieces: list[Piece] = []
        for name, tensor in pairs(tensors):
            check_tensor_name(name)
            if name in local:
                raise ArgumentError(f"tensor {name!r} was given twice in one publish")
            if is_dtensor(tensor):
                pieces.extend(placed(name, tensor))
                local[name] = tensor.to_local()  # type: ignore[attr-defined]
            else:
                shape = tuple(tensor.shape)
                pieces.extend(whole(name, shape, replica=self.rank, replicas=self.world_size))
                local[name] = tensor
        part = self._part_for(tuple(pieces))
        return part.write(local, attempt)

    def _part_for(self, pieces: tuple[Piece, ...]) -> ProjectionPart:
        if self._part is not None:
            if pieces != self._pieces:
                raise ArgumentError(
                    "the tensors' names, shapes or placements differ from the last publish; "
                    "open a new DeltaWriter to publish a model sharded another way"
                )
            return self._part
        part = ProjectionPart(Layout(pieces), device=self.device, ops=self.ops)
        if self._restore is not None:
            part.restore(*self._restore)
            self._restore = None
        self._part, self._pieces = part, pieces
        return part
