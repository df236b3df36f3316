"""Counting what crosses ``torch.distributed`` ranks: every collective call, the bytes of
the tensors it carries, and the functional collectives a ``DTensor`` dispatches.

``with counted_collectives() as seen: writer.publish(...)`` proves that a publish gathers
nothing (``seen.calls`` names each collective called; ``seen.bytes`` sums their tensors).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

__all__ = ["COLLECTIVES", "Collectives", "counted_collectives"]

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)


@dataclass
class Collectives:
    """What crossed ranks inside the ``with`` block."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes: int = 0
    functional: Counter[str] = field(default_factory=Counter)  # ops a DTensor dispatched
    functional_bytes: int = 0  # the bytes those ops returned (a gather: the gathered tensor)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@contextmanager
def counted_collectives(*, dispatch: bool = True) -> Iterator[Collectives]:
    """Count the collectives called in the block (``torch.distributed``'s functions, as the
    object collectives call them too) and, with ``dispatch``, the functional collectives
    any tensor operation dispatches (how ``full_tensor`` and ``redistribute`` gather)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = Collectives()

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            seen.calls[name] += 1
            seen.bytes += _tensor_bytes(list(args) + list(kwargs.values()))
            return fn(*args, **kwargs)

        return counted

    class _Functional(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            namespace = getattr(func, "namespace", "")
            result = func(*args, **(kwargs or {}))
            if namespace in ("_c10d_functional", "c10d", "_dtensor"):
                seen.functional[str(func)] += 1
                # the bytes a functional collective returns (c10d ops are counted as called
                # above; a wait or an autograd wrap returns the tensor it was given)
                name = str(func)
                if namespace == "_c10d_functional" and not any(
                    other in name for other in ("wait_tensor", "_wrap_tensor_autograd")
                ):
                    seen.functional_bytes += _tensor_bytes(result)
            return result

    with ExitStack() as stack:
        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            counted = wrap(name, original)
            stack.enter_context(mock.patch.object(c10d, name, counted))
            if getattr(dist, name, None) is original:
                stack.enter_context(mock.patch.object(dist, name, counted))
        if dispatch:
            stack.enter_context(_Functional())  # type: ignore[no-untyped-call]
        yield seen
