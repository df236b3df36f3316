"""The integration's parts that need no engine: import-lightness, the plugin entry point,
strict info parsing, the fail-closed check, canonical export, and the trainer-side errors."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dcr_format import TargetError
from dcr_format.errors import EngineUpdateError, TargetNotUpdatableError
from dcr_format.integrations import vllm as integration


def test_importing_the_integration_imports_no_vllm() -> None:
    code = (
        "import sys, dcr_format.integrations.vllm as v; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'transformers')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_entry_point_registers_the_backend_once() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    (point,) = [
        e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "dcr"
    ]
    assert point.value == "dcr_format.integrations.vllm:register"
    point.load()()
    point.load()()  # idempotent: vLLM loads plugins in every process, maybe twice
    vllm_config = SimpleNamespace(parallel_config=None, model_config=None)
    engine = WeightTransferEngineFactory.create_engine(
        SimpleNamespace(backend="dcr"),  # type: ignore[arg-type]
        vllm_config,  # type: ignore[arg-type]
        torch.device("cpu"),
        torch.nn.Linear(1, 1),
    )
    assert type(engine).__name__ == "DcrWeightTransferEngine"


def test_info_is_parsed_strictly() -> None:
    info = integration._parse(integration.DcrInitInfo, {"store": "/s", "verify": "all"}, "x")
    assert info.to_dict()["verify"] == "all" and "version" not in info.to_dict()
    with pytest.raises(ValueError, match="unknown field 'stor'"):
        integration._parse(integration.DcrInitInfo, {"stor": "/s"}, "init_info")
    with pytest.raises(ValueError, match="'verify' must be"):
        integration.DcrInitInfo(store="/s", verify="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs 'store'"):
        integration.DcrInitInfo(store="")
    with pytest.raises(ValueError, match="'version' must be"):
        integration.DcrUpdateInfo(version=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a dict"):
        integration._parse(integration.DcrUpdateInfo, [1], "update_info")


class _Linear(torch.nn.Module):
    def __init__(self, kernel, weight: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.cpu_linear = kernel


def test_prepacked_layers_fail_closed() -> None:
    integration.check_updatable(_Linear(torch.nn.functional.linear, torch.ones(2, 2)))
    handler = object()
    ops = SimpleNamespace(onednn_mm=lambda h, x, b: x)
    packed = _Linear(lambda x, weight, bias: ops.onednn_mm(handler, x, bias), torch.ones(2, 2))
    with pytest.raises(TargetNotUpdatableError, match="prepacked the weight"):
        integration.check_updatable(torch.nn.Sequential(packed))
    emptied = _Linear(lambda x, weight, bias: x, torch.empty(0))
    with pytest.raises(TargetNotUpdatableError, match="'0'"):
        integration.check_updatable(torch.nn.Sequential(emptied))


def test_canonical_state_drops_tied_aliases() -> None:
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 3)
    model.head = torch.nn.Linear(3, 4, bias=False)
    model.head.weight = model.embed.weight
    state = integration.canonical_state(model)
    assert list(state) == ["embed.weight"] and state["embed.weight"].dtype == torch.bfloat16


def test_resident_version_needs_a_replayed_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="dcr replay"):
        integration.resident_version(str(tmp_path), "chain")
    (tmp_path / "dcr-state.json").write_text('{"chain_id": "other", "version": 3}')
    with pytest.raises(TargetError, match="holds chain other"):
        integration.resident_version(str(tmp_path), "chain")
    (tmp_path / "dcr-state.json").write_text('{"chain_id": "chain", "version": 3}')
    assert integration.resident_version(str(tmp_path), "chain") == 3


class _Response:
    text = "not json"

    def json(self) -> dict:  # type: ignore[type-arg]
        return {"error": {"message": "Worker failed with error 'tensor changed outside dcr'"}}


class _Client:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:  # type: ignore[type-arg]
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict) -> None:  # type: ignore[type-arg]
        self.calls.append(f"update {update_info}")
        error = RuntimeError("500 Server Error")
        error.response = _Response()  # type: ignore[attr-defined]
        raise error

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish {weight_version}")


def test_a_failed_update_carries_the_engines_message() -> None:
    client = _Client()
    sync = integration.DcrWeightSync(None, client, integration.DcrInitInfo(store="/s"))
    with pytest.raises(EngineUpdateError, match=r"did not reach version 4 .*changed outside dcr"):
        sync.update(4)
    # vLLM ends the session itself after a failed update: no finish (it would be refused)
    assert client.calls == ["start", "update {'audit': False, 'version': 4}"]
    with pytest.raises(TypeError, match="not a weight-sync client"):
        integration.DcrWeightSync(None, object(), integration.DcrInitInfo(store="/s"))
