"""A change read against a live tensor ahead of its write (staged), and that write: the
bits at its positions before and after, written in the pause of a sync and put back by its
undo (:func:`put_staged`, :func:`unput_staged`), or, for a prepared version, every staged
change of one bit width end to end and written in one pass (:func:`put_batch`,
:func:`unput_batch`). :func:`dcr_format.delta.delta.stage_change` makes a staged change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dcr_format.delta.backends import backend_for
from dcr_format.format.dtypes import bits_view
from dcr_format.kernels.native import serial_kernels


@dataclass(frozen=True)
class StagedChange:
    """An ``xor``/``overwrite`` change read against a tensor but not yet written: the bits
    at its positions now (``before``), the bits it puts there (``after``) and its
    fingerprint lane deltas. :func:`put_staged` writes it; :func:`unput_staged` undoes that."""

    positions: torch.Tensor  # int64, strictly increasing, on the tensor's device
    before: torch.Tensor
    after: torch.Tensor
    lane_deltas: tuple[int, ...]


def put_staged(target: torch.Tensor, staged: StagedChange) -> torch.Tensor:
    """Write a staged change's ``after`` bits into ``target`` (the pause of a sync); returns
    the bits it replaced, which :func:`unput_staged` puts back (an edit made since the
    change was staged is then restored too, not the bits the staging read)."""
    flat = bits_view(target).reshape(-1)
    replaced = backend_for(flat).put(flat, staged.positions, staged.after, keep=True)
    assert replaced is not None
    return replaced


def unput_staged(target: torch.Tensor, staged: StagedChange, replaced: torch.Tensor) -> None:
    """Put back the bits :func:`put_staged` replaced (its undo)."""
    flat = bits_view(target).reshape(-1)
    backend_for(flat).put(flat, staged.positions, replaced)


@dataclass(frozen=True)
class StagedBatch:
    """Staged changes to several tensors, their positions and bits end to end (change ``t``
    at ``starts[t]`` to ``starts[t + 1]``), so that :func:`put_batch` writes them all in
    one pass."""

    positions: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor
    starts: np.ndarray  # int64, one more than the changes


def batch_staged(changes: Sequence[StagedChange]) -> tuple[StagedBatch, list[StagedChange]]:
    """``changes`` (on one device, of one bit width) end to end, and each change again as
    views of the batch (so their bits are held once)."""
    starts, sizes = [0], []
    for change in changes:
        sizes.append(int(change.positions.numel()))
        starts.append(starts[-1] + sizes[-1])
    batch = StagedBatch(
        torch.cat([c.positions.reshape(-1) for c in changes]),
        torch.cat([c.before.reshape(-1) for c in changes]),
        torch.cat([c.after.reshape(-1) for c in changes]),
        np.array(starts, dtype=np.int64),
    )
    # each change's views of the batch, cut by one split of each of its three tensors
    views = [
        StagedChange(positions, before, after, c.lane_deltas)
        for c, positions, before, after in zip(
            changes,
            torch.split(batch.positions, sizes),
            torch.split(batch.before, sizes),
            torch.split(batch.after, sizes),
            strict=True,
        )
    ]
    return batch, views


def put_batch(targets: Sequence[torch.Tensor], batch: StagedBatch) -> torch.Tensor:
    """:func:`put_staged` of every change of ``batch`` into ``targets`` (its tensors, in
    order), in one pass where the backend can; returns the bits it replaced, end to end,
    which :func:`unput_batch` puts back. Every position is checked to lie in its tensor
    before anything is written (:class:`IndexError` otherwise, nothing changed)."""
    backend = backend_for(batch.positions)
    with _serial_below(batch):
        replaced = backend.put_segments(
            targets, batch.positions, batch.after, batch.starts, keep=True
        )
    assert replaced is not None
    return replaced


def unput_batch(
    targets: Sequence[torch.Tensor], batch: StagedBatch, replaced: torch.Tensor
) -> None:
    """Put back the bits :func:`put_batch` replaced (its undo)."""
    with _serial_below(batch):
        backend_for(batch.positions).put_segments(targets, batch.positions, replaced, batch.starts)


SERIAL_PUT = 1 << 16
"""Fewer changed elements in a batch than this are written on the calling thread alone: a
parallel region costs more to start than their write (about 0.2 ms on an idle 2-core host,
and milliseconds where its threads wait for a busy host's cores), which at this size is
well under a millisecond on one thread."""


def _serial_below(batch: StagedBatch) -> contextlib.AbstractContextManager[None]:
    """The serial kernels for a batch of fewer than :data:`SERIAL_PUT` positions."""
    if batch.positions.numel() < SERIAL_PUT:
        return serial_kernels()
    return contextlib.nullcontext()


__all__ = [
    "StagedBatch",
    "StagedChange",
    "batch_staged",
    "put_batch",
    "put_staged",
    "unput_batch",
    "unput_staged",
]
