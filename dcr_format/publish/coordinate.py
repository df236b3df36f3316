"""How the writer ranks of one publish agree on its attempt id.

Rank 0 picks the attempt id; every rank must use the same one so the committer
finds all manifests under one prefix. Commit outcomes travel through the store
(the commit record or an abort marker), not through the coordinator.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from dcr_format.errors import ArgumentError, IncompleteVersionError
from dcr_format.system.options import whole


class Coordinator(Protocol):
    """Broadcast a small value from rank 0 to every writer rank."""

    def broadcast(self, value: Any, *, rank: int) -> Any:
        """Every rank calls this; all get rank 0's ``value``."""
        ...


class SoloCoordinator:
    """The coordinator of a single writer rank."""

    def broadcast(self, value: Any, *, rank: int) -> Any:
        """Return ``value`` (there is only rank 0)."""
        return value


class ThreadCoordinator:
    """Writer ranks as threads of one process (tests, single-host exports)."""

    def __init__(self, world_size: int, *, timeout: float = 600.0) -> None:
        world_size = whole(world_size, "world_size", low=1)
        self._barrier = threading.Barrier(world_size)
        self._timeout = timeout
        self._slot: Any = None

    def broadcast(self, value: Any, *, rank: int) -> Any:
        """Rank 0 publishes ``value``; the others wait for it."""
        try:
            if rank == 0:
                self._slot = value
            self._barrier.wait(self._timeout)
            result = self._slot
            self._barrier.wait(self._timeout)
        except threading.BrokenBarrierError:
            self._barrier.reset()
            raise IncompleteVersionError(
                "not every writer rank reached the publish in time; check the other ranks"
            ) from None
        return result


class TorchDistributedCoordinator:
    """Writer ranks of a ``torch.distributed`` job (any backend that carries objects)."""

    def __init__(self, group: Any = None) -> None:
        self._group = group

    def broadcast(self, value: Any, *, rank: int) -> Any:
        """``broadcast_object_list`` from the group's first rank."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ArgumentError(
                "torch.distributed is not initialised in this process; call "
                "torch.distributed.init_process_group on every rank before publishing"
            )
        box = [value]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(self._group, 0) if self._group else 0, group=self._group
        )
        return box[0]
