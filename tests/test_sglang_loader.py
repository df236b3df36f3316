"""dcr's SGLang loader (``dcr_format.integrations.sglang``) on a plain module with a fused
loader, without SGLang: requests travel in tensor names, the model follows the chain in place,
and every refusal (a corrupted shard, an unknown op, a tensor that is not a request, a sync
before init) is reported, never raised, with the weights as they were. The tier with real
SGLang engines is tests_sglang/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dcr_format import DeltaWriter
from dcr_format.errors import EngineUpdateError
from dcr_format.integrations import sglang as dcr_sglang
from dcr_format.integrations.sglang import last_outcome, load_weights, request_tensors
from dcr_format.integrations.vllm import DcrInitInfo


class Fused(nn.Module):
    """q and k fused into one parameter by the model's own loader, as engines do."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, w in weights:
            at = 0 if name == "q.weight" else 4
            self.qk.data.narrow(0, at, w.shape[0]).copy_(w)


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q.weight": torch.randn(4, 4, generator=gen).to(torch.bfloat16),
        "k.weight": torch.randn(2, 4, generator=gen).to(torch.bfloat16),
    }


def _fused(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state["q.weight"], state["k.weight"]])


def _ask(model: nn.Module, request: dict, report: Path) -> dict:  # type: ignore[type-arg]
    load_weights(model, request_tensors({**request, "report": str(report)}))
    return json.loads((report / "rank-0.json").read_text())


def test_loader_syncs_in_place_and_reports_refusals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCR_KERNELS", "torch")  # the loader's logic, not the compiled kernels
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    states = [_state(0)]
    writer.publish(states[0], step=0)
    model = Fused()
    model.load_weights(states[0].items())
    report = tmp_path / "report"

    # a sync before init: refused, reported
    out = _ask(model, {"op": "sync", "version": 0}, report)
    assert not out["ok"] and "send the init request first" in out["error"]

    init = {"store": store, "version": 0, "prefetch": False}
    out = _ask(model, {"op": "init", "init_info": init}, report)
    assert out["ok"] and out["version"] == 0

    changed = {k: v.clone() for k, v in states[0].items()}
    changed["q.weight"][1, 2] = 7.0
    changed["k.weight"][0, 0] = -3.0
    states.append(changed)
    writer.publish(changed, step=1)
    out = _ask(model, {"op": "sync", "version": 1}, report)
    assert out["ok"] and out["version"] == 1 and out["report"]["applied_versions"] == [1]
    assert torch.equal(model.qk.view(torch.int16), _fused(changed).view(torch.int16))

    # a corrupted shard: refused, the weights as they were, the version still held
    broken = {k: v.clone() for k, v in changed.items()}
    broken["q.weight"][0, 0] = 5.0
    version = int(writer.publish(broken, step=2).version)
    shards = sorted((Path(store) / "objects" / f"{version:020d}").rglob("shard-*.dcrs"))
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(data))
    out = _ask(model, {"op": "sync", "version": version}, report)
    assert not out["ok"] and out["version"] == 1 and "sha256" in out["error"]
    assert torch.equal(model.qk.view(torch.int16), _fused(changed).view(torch.int16))

    # not requests: reported, nothing raised
    out = _ask(model, {"op": "reload"}, report)
    assert not out["ok"] and "unknown dcr request op" in out["error"]
    load_weights(model, [("q.weight", torch.zeros(4, 4))])
    outcome = last_outcome(model)
    assert outcome is not None and not outcome.ok and "not a dcr request" in str(outcome.error)
    assert torch.equal(model.qk.view(torch.int16), _fused(changed).view(torch.int16))


def _reports(directory: Path, *outcomes: dcr_sglang.SyncOutcome) -> Path:
    directory.mkdir()
    for o in outcomes:
        (directory / f"rank-{o.rank}.json").write_text(json.dumps(o.to_dict()))
    return directory


def test_trainer_reads_the_engines_report(tmp_path: Path) -> None:
    """The trainer side raises the engine's reason for a refusal, and says where it looked
    when the engine wrote nothing (an engine without dcr's loader)."""
    refused = dcr_sglang.SyncOutcome(False, "sync", 3, 0, "ApplyError: broken")
    assert dcr_sglang._read_reports(_reports(tmp_path / "r", refused)) == [refused]
    with pytest.raises(EngineUpdateError, match="custom-weight-loader"):
        dcr_sglang._read_reports(tmp_path / "nothing")


def test_trainer_reads_every_tensor_parallel_rank(tmp_path: Path) -> None:
    """With tensor parallelism the rank whose own failure stopped the group is the reason
    given, not the ranks it stopped; a rank missing from the reports (a report directory
    one host does not reach) is an error, not a success."""
    stopped = dcr_sglang.SyncOutcome(
        False, "sync", 3, 0, "GroupAbortError: reader rank(s) [1] failed", ranks=2
    )
    failed = dcr_sglang.SyncOutcome(False, "sync", 3, 1, "OSError: unreadable", ranks=2)
    outcomes = dcr_sglang._read_reports(_reports(tmp_path / "a", failed, stopped))
    assert outcomes == [stopped, failed]
    assert dcr_sglang._summary(outcomes) == failed
    applied = dcr_sglang.SyncOutcome(True, "sync", 4, 0, ranks=2)
    with pytest.raises(EngineUpdateError, match=r"only tensor-parallel ranks \[0\] of 2"):
        dcr_sglang._read_reports(_reports(tmp_path / "b", applied))


class _Engine:
    """An ``sglang.Engine`` stand-in: its weight update runs dcr's loader on ``model``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def begin_weight_update(self) -> tuple[bool, str]:
        return True, ""

    def update_weights_from_tensor(self, named, load_format, flush_cache):  # type: ignore[no-untyped-def]
        assert load_format == dcr_sglang.LOAD_FORMAT and flush_cache
        load_weights(self.model, named)
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        return True, ""


def test_trainer_publishes_and_brings_the_engine_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCR_KERNELS", "torch")
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    writer.publish(_state(0), step=0)
    model = Fused()
    model.load_weights(_state(0).items())
    info = DcrInitInfo(store=store, version=0, prefetch=False)
    reports = str(tmp_path / "reports")
    sync = dcr_sglang.DcrSGLangSync(writer, _Engine(model), info, report_dir=reports)
    assert sync.init() == 0
    assert sync.publish(_state(1), step=1) == 1
    assert torch.equal(model.qk.view(torch.int16), _fused(_state(1)).view(torch.int16))
    assert sync.timings[0]["version"] == 1.0
    assert set(sync.timings[0]) == {"version", "publish_seconds", "update_seconds"}
    sync.close()
    assert Path(reports).is_dir()  # a report_dir the caller gave is the caller's
    with dcr_sglang.DcrSGLangSync(writer, _Engine(model), info) as own:
        made = Path(own.report_dir or "")
        assert own.publish(_state(2), step=2) == 2 and made.is_dir()
    assert not made.exists()


def test_a_pipeline_parallel_engine_is_refused_also_with_one_tensor_parallel_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCR_KERNELS", "torch")
    store = str(tmp_path / "store")
    DeltaWriter(store).publish(_state(0), step=0)
    model = Fused()
    model.load_weights(_state(0).items())
    sizes = {"tp_size": 1, "tp_rank": 0, "pp_size": 2}
    monkeypatch.setattr(dcr_sglang, "_parallel", lambda name, default: sizes.get(name, default))
    init = {"store": store, "version": 0, "prefetch": False}
    out = _ask(model, {"op": "init", "init_info": init}, tmp_path / "report")
    assert not out["ok"] and "--pp-size 1" in out["error"]
