"""Mistakes a new user makes on the publish side: each is refused by name, with one line
saying what to do, before anything is written to the store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcr_format import DeltaWriter, Store
from dcr_format.errors import ArgumentError


@pytest.mark.parametrize("step", [1 << 63, -(1 << 63), 1.5, "3", True])
def test_a_step_no_commit_record_holds_is_refused_before_the_version(
    tmp_path: Path, step: object
) -> None:
    writer = DeltaWriter(tmp_path / "store")
    state = {"w": torch.arange(8, dtype=torch.float32)}
    writer.publish(state, step=0)
    before = sorted(Store(tmp_path / "store").list(""))
    with pytest.raises(ArgumentError, match="step"):
        writer.publish(state, step=step)  # type: ignore[arg-type]
    assert sorted(Store(tmp_path / "store").list("")) == before  # no attempt was begun
    assert writer.publish(state, step=1 << 62).version == 1  # the writer carries on
