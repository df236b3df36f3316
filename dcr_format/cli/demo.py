"""``dcr demo``: train a small transformer, publish every step, pull and check each version."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from pydantic import BaseModel, ConfigDict

from dcr_format.cli.toymodel import Trainer
from dcr_format.format.dtypes import bits_view
from dcr_format.publish.writer import DeltaWriter
from dcr_format.store.store import Store
from dcr_format.sync.reader import DeltaReader
from dcr_format.targets.dict import StateDictTarget
from dcr_format.tools._inspect import row_from

DEFAULT_LR = 1e-6  # an RL-like rate: about 1% of bf16 elements change per step


class DemoRow(BaseModel):
    """One published and pulled version of the demo (the fields it shares with
    :class:`~dcr_format.CommitInfo` are the publish's). ``pull_s`` is the reader's
    preparation (fetch, verify, decode: an engine generates meanwhile), ``apply_s`` the
    pause that follows (the target checked and changed)."""

    model_config = ConfigDict(frozen=True)

    version: int
    kind: str
    change_rate: float
    delta_bytes: int
    dense_bytes: int
    ratio: float
    publish_s: float
    pull_s: float
    apply_s: float
    verified: bool


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        a[n].dtype == b[n].dtype
        and a[n].shape == b[n].shape
        and torch.equal(bits_view(a[n]), bits_view(b[n]))
        for n in a
    )


def run_demo(
    store: Store | str | os.PathLike[str],
    *,
    steps: int = 10,
    size: str = "small",
    lr: float | None = None,
    seed: int = 0,
    on_row: Callable[[DemoRow], object] | None = None,
) -> list[DemoRow]:
    """Publish the initial weights and ``steps`` AdamW steps; pull each into a reader copy,
    prepared first and then applied, as an engine pulls it.

    Every version is checked bit for bit against the trainer's bf16 export; ``on_row`` is
    called with each version's row as soon as that version is checked.
    """
    trainer = Trainer(size=size, lr=DEFAULT_LR if lr is None else lr, seed=seed)
    writer = DeltaWriter(store)
    replica: dict[str, torch.Tensor] = {}
    reader = DeltaReader(store, StateDictTarget(replica))
    rows = []
    for step in range(steps + 1):
        if step:
            trainer.step()
        weights = trainer.export_bf16()
        started = time.perf_counter()
        info = writer.publish(weights, step=step)
        published = time.perf_counter()
        result = reader.apply(reader.prepare())
        row = row_from(
            DemoRow,
            info,
            delta_bytes=info.payload_bytes,
            publish_s=published - started,
            pull_s=result.fetch_seconds,
            apply_s=result.apply_seconds,
            verified=result.version == info.version and _bit_equal(replica, weights),
        )
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
