"""The ``classed`` positions of one tensor's change against its old bits (FORMAT.md §6.5):
found on the host with the old bits' exponent rows, which a long-lived reader keeps and
moves from change to change (:func:`decode_classed_at`, :func:`rows_after`), or with the
class passes of the tensor's :class:`~dcr_format.delta.backend.Backend` on its device
(:func:`device_positions` to decode, :func:`device_classed` to encode)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from dcr_format.codings.classed import (
    EXPONENT_FIELDS,
    ClassedStream,
    choose_classes,
    class_ranks_of,
    class_starts,
    classed_stream,
    decode_classed,
    exponent_rows,
    move_rows,
    rows_fit,
)
from dcr_format.delta.backend import Backend
from dcr_format.errors import PositionsError
from dcr_format.format.dtypes import bits_to_numpy, info_for
from dcr_format.kernels.native import compiled
from dcr_format.kernels.reference import ClassPlan


def device_positions(
    stream: ClassedStream, old: torch.Tensor, dtype: str, backend: Backend
) -> torch.Tensor:
    """The positions of a ``classed`` stream with the class passes on ``old``'s device (the
    class sizes come to the host to decode the ranks, which go back)."""
    shift, mask = EXPONENT_FIELDS[dtype]
    base, count = stream.base, stream.classes
    sizes = backend.class_sizes(old, shift, mask, base, count).cpu().numpy()
    ranks = torch.from_numpy(class_ranks_of(stream, sizes)).to(old.device)
    classes = torch.repeat_interleave(
        torch.tensor([c for c, *_ in stream.parts], dtype=torch.int64),
        torch.tensor([stream.counts[c] for c, *_ in stream.parts], dtype=torch.int64),
    ).to(old.device)
    return backend.class_positions(old, shift, mask, base, count, classes, ranks)


def device_classed(
    old: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, backend: Backend
) -> bytes:
    """The ``classed`` stream with the class passes on the tensors' device (the histograms
    and the classes and ranks of the changes come to the host, not the tensor)."""
    name = info_for(dtype).name
    shift, mask = EXPONENT_FIELDS[name]
    everything, changed = backend.exponent_histograms(old, positions, shift, mask)
    base, count = choose_classes(everything.cpu().numpy(), changed.cpu().numpy())
    classes, ranks = backend.class_ranks(old, positions, shift, mask, base, count)
    return classed_stream(base, count, classes.cpu().numpy(), ranks.cpu().numpy())


def decode_classed_at(
    stream: ClassedStream,
    given: np.ndarray | None,
    held: np.ndarray,
    dtype: str,
    before: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The positions of a ``classed`` stream against the host bits ``held`` and the
    exponent rows they decoded with: ``given`` where they fit, else counted. Rows that were
    given and do not decode are counted again before the stream is refused: a keeper's rows
    never turn into a refusal that the held bits would not make. ``before``, where given,
    takes the held bits at the positions."""
    count, numel = sum(stream.counts), int(held.size)
    fits = given is not None and rows_fit(given, numel, dtype)
    rows = given if fits and given is not None else exponent_rows(held, dtype)
    try:  # the rows fit: checked here, or counted from the bits
        found = decode_classed(
            stream, held, dtype, count=count, numel=numel, rows=rows, old_at=before,
            rows_fit_known=True,
        )  # fmt: skip
    except PositionsError:
        if not fits:
            raise
        rows = exponent_rows(held, dtype)
        found = decode_classed(
            stream, held, dtype, count=count, numel=numel, rows=rows, old_at=before,
            rows_fit_known=True,
        )  # fmt: skip
    return found, rows


def rows_after(
    rows: np.ndarray,
    positions: torch.Tensor,
    before: torch.Tensor,
    after: torch.Tensor,
    dtype: torch.dtype,
) -> np.ndarray:
    """The exponent rows of a tensor after a change, from those before it (not changed) and
    the bits the change found and wrote at its positions (host tensors)."""
    moved = rows.copy()
    move_rows(
        moved,
        positions.numpy(),
        bits_to_numpy(before),
        bits_to_numpy(after),
        info_for(dtype).name,
        tally=False,
    )
    return moved


class KeptClasses(NamedTuple):
    """What a long-lived writer keeps of one tensor between steps for its ``classed``
    positions: the exponent rows of its baseline, and the classes (``base``, ``K``) of its
    last change's stream, where it made one."""

    rows: np.ndarray
    classes: tuple[int, int] | None


def class_plan(kept: KeptClasses | None, dtype: str, numel: int) -> ClassPlan | None:
    """The classes a writer's next diff of a tensor of ``numel`` elements of the format dtype
    ``dtype`` ranks its changes in (:meth:`Backend.diff_with_lanes`): those of its last
    change, counted from its kept rows. A tensor's classes seldom move from one step to
    the next; where they do, the encoder counts the ranks again. None where nothing is kept
    to guess from, the rows do not fit the tensor, or the compiled diff does not run here."""
    if kept is None or kept.classes is None or dtype not in EXPONENT_FIELDS:
        return None
    if compiled("dcr_format.kernels.numba_kernels") is None or not rows_fit(
        kept.rows, numel, dtype
    ):
        return None
    shift, mask = EXPONENT_FIELDS[dtype]
    base, count = kept.classes
    return ClassPlan(shift, mask, base, count, class_starts(kept.rows, base, count))


__all__ = [
    "KeptClasses",
    "class_plan",
    "decode_classed_at",
    "device_classed",
    "device_positions",
    "rows_after",
]
