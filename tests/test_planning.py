"""Reader planning: incremental from the resident version, else from the newest base."""

from __future__ import annotations

from pathlib import Path

import torch

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.format.dtypes import bits_view


def test_resident_record_gone_falls_back_to_the_base_right_after_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    writer = DeltaWriter(store, base_every=2)
    weights = {"w": torch.arange(64, dtype=torch.float32)}
    for version in range(4):  # base, delta, base, delta
        weights["w"][version] += 1.0
        writer.publish(weights, step=version)
    replica: dict[str, torch.Tensor] = {}
    reader = DeltaReader(store, StateDictTarget(replica))
    reader.sync(to=1)
    (store / "commits" / f"{1:020d}.json").unlink()  # e.g. removed by gc
    result = reader.sync(to=3)
    assert result.applied_versions == (2, 3)
    assert torch.equal(bits_view(replica["w"]), bits_view(weights["w"]))
