"""A mixture-of-experts model (a tiny Qwen3-MoE) in an in-process engine with the ``dcr``
backend: after each update every layer's stacked expert weights (``w13_weight``: each
expert's gate and up rows; ``w2_weight``: its down projection) hold exactly the trainer's
bf16 tensors, the router too, and greedy generation equals a fresh engine's on ``dcr
replay`` of the last version. The trainer publishes AdamW steps and a change confined to a
few elements of one expert."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import harness
import pytest
import torch

from dcr_format.errors import TargetNotUpdatableError
from dcr_format.integrations import vllm as integration
from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync


@pytest.fixture(autouse=True)
def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16)


def _check_experts(model: Any, state: dict[str, torch.Tensor], layers: int) -> None:
    for i in range(layers):
        prefix = f"model.layers.{i}.mlp"
        mlp = model.model.layers[i].mlp
        experts = mlp.experts.routed_experts
        # the trainer's fused [experts, 2 * intermediate, hidden] gate_up_proj is the
        # engine's w13 stack (gate rows, then up rows, per expert); down_proj is w2
        assert torch.equal(
            _bits(experts.w13_weight), _bits(state[f"{prefix}.experts.gate_up_proj"])
        ), prefix
        assert torch.equal(_bits(experts.w2_weight), _bits(state[f"{prefix}.experts.down_proj"]))
        assert torch.equal(_bits(mlp.gate.weight), _bits(state[f"{prefix}.gate.weight"]))


def _change_one_expert(trainer: harness.Trainer) -> tuple[int, int]:
    """A sparse step: a few elements of expert 2 of the last layer (gate, up and down rows)."""
    layer, expert = len(trainer.model.model.layers) - 1, 2
    experts = trainer.model.model.layers[layer].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj[expert, 3:5, :8] += 0.25  # gate rows
        experts.gate_up_proj[expert, 70:72, 8:16] -= 0.25  # up rows
        experts.down_proj[expert, :16, 5] *= 1.5
    return layer, expert


def test_moe_engine_follows_updates_bit_exact(tmp_path: Path) -> None:
    config = harness.tiny_moe_config()
    store, trainer, ckpt = harness.first_version(tmp_path, tied=False, config=config)
    llm = harness.engine(ckpt, weight_transfer_config={"backend": "dcr"})
    sync = DcrWeightSync(
        trainer.writer, llm, DcrInitInfo(store=store, reader_id="moe", prefetch=False)
    )
    sync.init()
    engine = llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    layers = config.num_hidden_layers
    _check_experts(model, trainer.export(), layers)  # the loader keeps the trainer's layout
    got = []
    for step in range(1, 4):
        before = trainer.export()
        if step == 2:
            layer, expert = _change_one_expert(trainer)
        else:
            trainer.step()
        state = trainer.export()
        version = sync.publish(state, step=step)
        report = engine.last_update
        assert report is not None and report.version == version == step
        assert report.unverified == ()
        _check_experts(model, state, layers)
        if step == 2:  # the step changed that expert's elements only (and the engine too)
            name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
            changed = (_bits(state[name]) != _bits(before[name])).nonzero()[:, 0].unique()
            assert changed.tolist() == [expert]
            assert {n for n in state if not torch.equal(state[n], before[n])} == {
                name,
                f"model.layers.{layer}.mlp.experts.down_proj",
            }
        got.append(harness.greedy(llm))
    assert len({str(g) for g in got}) > 1, "the steps should change the generation"
    # a fresh engine on the last version (one engine start: the bits above are checked at
    # every version, and the last holds the expert change and the AdamW steps after it)
    fresh = harness.checkpoint(store, 3, tmp_path / "v3", tied=False, config=config)
    assert harness.fresh_greedy([fresh]) == [got[-1]]


def test_repacked_cpu_experts_fail_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own CPU MoE experts repack their stacks after loading: refused before any
    change (the tier's plugin keeps them unpacked; an engine without it is refused)."""
    import dcr_test_cpu_patch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    experts = object.__new__(cpu_moe.CPUUnquantizedExperts)
    experts._use_zentorch = False
    layer = torch.nn.Module()  # where vLLM's MoE layer keeps its experts' kernel
    layer.quant_method = SimpleNamespace(
        moe_kernel=SimpleNamespace(impl=SimpleNamespace(fused_experts=experts))
    )
    model = torch.nn.Sequential(layer)
    integration.check_updatable(model)  # the plugin's experts keep the loader's layout
    monkeypatch.setattr(
        cpu_moe.CPUUnquantizedExperts,
        "process_weights_after_loading",
        dcr_test_cpu_patch.ORIGINAL_MOE,
    )
    with pytest.raises(TargetNotUpdatableError, match=r"repacked the expert weights of '0'"):
        integration.check_updatable(model)
    experts._use_zentorch = True  # zentorch's kernel keeps them
    integration.check_updatable(model)
