"""The trainer side of the vLLM integration against a stand-in weight-sync client (the
engine side runs in tests_vllm/)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dcr_format import DeltaWriter
from dcr_format.errors import EngineUpdateError
from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync


class Client:
    """Records the four calls; ``update_weights`` fails while ``refuse`` is set (as vLLM
    does, it then ends the session itself: a finish would be refused)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.refuse = False
        self.active = False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.active = True
        self.calls.append(("start", None))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append(("update", update_info))
        if self.refuse:
            self.active = False
            raise RuntimeError("tensor 'w' in the target is not the bits of version 1")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start")
        self.active = False


def _sync(tmp_path) -> tuple[DcrWeightSync, Client]:  # type: ignore[no-untyped-def]
    store = str(tmp_path / "store")
    client = Client()
    return DcrWeightSync(DeltaWriter(store), client, DcrInitInfo(store=store)), client


def test_an_update_without_a_version_names_the_newest_to_the_engine(tmp_path):
    sync, client = _sync(tmp_path)
    w = torch.arange(64, dtype=torch.float32).bfloat16()
    sync.writer.publish({"w": w})
    sync.writer.publish({"w": w + 1})
    sync.update()
    # the engine is told the version, and /weight_info reports it
    assert client.calls == [
        ("start", None),
        ("update", {"audit": False, "version": 1}),
        ("finish", "1"),
    ]


def test_a_refused_update_leaves_the_session_to_the_engine(tmp_path):
    sync, client = _sync(tmp_path)
    sync.writer.publish({"w": torch.zeros(8, dtype=torch.bfloat16)})
    client.refuse = True
    with pytest.raises(EngineUpdateError, match="not the bits of version 1"):
        sync.update(0)
    # no finish after the engine ended the session (it would log a second traceback)
    assert [name for name, _ in client.calls] == ["start", "update"]
