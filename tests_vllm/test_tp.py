"""Tensor parallel 2 on the CPU build: the two ranks of the engine form a reader group,
each applies its own shards through its loader, the partial fingerprints are summed over
the group (nothing is left unverified), and generation equals a fresh TP=2 engine's."""

from __future__ import annotations

import time
from pathlib import Path

import harness
import torch

from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync


def _shards(worker) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Runs in each worker: its shards of the fused parameters, as bits."""
    model = worker.model_runner.get_model()
    out = []
    for layer in model.model.layers:
        for p in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight):
            out.append(p.detach().contiguous().view(torch.int16).reshape(-1).tolist())
    return out


def _want(state: dict[str, torch.Tensor], rank: int, ranks: int) -> list[list[int]]:
    def part(t: torch.Tensor) -> torch.Tensor:
        size = t.shape[0] // ranks
        return t[rank * size : (rank + 1) * size]

    out = []
    for i in range(2):
        p = f"model.layers.{i}"
        qkv = [part(state[f"{p}.self_attn.{x}_proj.weight"]) for x in "qkv"]
        gate_up = [part(state[f"{p}.mlp.{x}_proj.weight"]) for x in ("gate", "up")]
        for pieces in (qkv, gate_up):
            out.append(torch.cat(pieces).contiguous().view(torch.int16).reshape(-1).tolist())
    return out


def test_tensor_parallel_ranks_form_a_reader_group(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the bit check's callable
    store = str(tmp_path / "store")
    trainer = harness.Trainer(store, tied=False)
    trainer.publish(0)
    ckpt = harness.checkpoint(store, 0, tmp_path / "ckpt", tied=False)
    started = time.perf_counter()
    llm = LLM(
        model=str(ckpt),
        tensor_parallel_size=2,
        weight_transfer_config={"backend": "dcr"},
        worker_extension_cls="dcr_format.integrations.vllm.DcrWorkerExtension",
        **harness.ENGINE_ARGS,
    )
    start_seconds = time.perf_counter() - started
    try:
        sync = DcrWeightSync(trainer.writer, llm, DcrInitInfo(store=store, reader_id="tp2"))
        sync.init()
        rows, got, dirs = [], [], []
        for step in range(1, 4):
            trainer.step()
            version = sync.publish(trainer.export(), step=step)
            reports = llm.collective_rpc("dcr_report")
            assert len(reports) == 2
            for report in reports:
                assert report["version"] == version and not report["unverified"], report
                assert not report["prefetched"]  # ranks prepare together, in the update
            state = trainer.export()
            assert llm.collective_rpc(_shards) == [_want(state, r, 2) for r in range(2)]
            outs = llm.generate(
                harness.PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
            )
            got.append([list(o.outputs[0].token_ids) for o in outs])
            dirs.append(harness.checkpoint(store, version, tmp_path / f"v{step}", tied=False))
            slowest = max(reports, key=lambda r: r["apply_seconds"])
            rows.append(
                (
                    step,
                    sync.timings[-1]["update_seconds"],
                    slowest["prepare_seconds"],
                    slowest["apply_seconds"],
                )
            )
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert harness.fresh_greedy(dirs, tensor_parallel=2) == got
    harness.record("tensor parallel 2 (multiprocessing)", start_seconds, rows)
