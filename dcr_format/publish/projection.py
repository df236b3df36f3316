"""Publishing from a trainer's own layout: ``ProjectionWriter(store, layout, ...)``.

A writer given a :class:`~dcr_format.chain.layout.Layout` takes the rank's *local* tensors
(tensor-parallel shards, fused ``qkv``, ...) in ``publish``, diffs them against its
local baseline and carries the changed positions to canonical flat indices (the
projection part, ``publish/_projection.py``). :func:`ProjectionWriter` is the short
way to write ``DeltaWriter(store, layout=layout, ...)``.
"""

from __future__ import annotations

import os
from typing import Any

from dcr_format.chain.layout import Layout
from dcr_format.publish.writer import DeltaWriter
from dcr_format.store.store import Store

__all__ = ["ProjectionWriter"]


def ProjectionWriter(  # named as the writer it builds, like a class
    store: Store | str | os.PathLike[str], layout: Layout, **options: Any
) -> DeltaWriter:
    """A :class:`~dcr_format.DeltaWriter` that publishes from local tensors placed by ``layout``.

    Every rank of the publish passes its own layout and its own local tensors to
    ``publish``; ``options`` are those of :class:`~dcr_format.DeltaWriter` (``cache_dir``
    is not supported: reopening a chain restores the baseline from the store).
    """
    return DeltaWriter(store, layout=layout, **options)
