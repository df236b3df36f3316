"""The engine's pause: a prepared dcr update against a dense in-memory reload, in one vLLM.

One in-process vLLM engine (the CPU build works) serves a Llama built from a config. Each
step changes a fraction of every tensor's elements, publishes the version with
:class:`~dcr_format.DeltaWriter`, and then, in the same engine:

- ``dcr``: the pause of ``update_weights`` on the ``dcr`` backend, the version already
  prepared (fetched, verified, decoded): the apply and its verification;
- ``dcr (loader)``: the same with every change going through the model's loader (the
  placements not used: ``ModuleTarget(direct=False)``), on alternate steps;
- ``dense``: ``model.load_weights`` of the whole version, already in memory;
- ``vLLM sparse patch``: vLLM's ``load_checkpoint_weight_patches`` with the changed
  elements of the same version (where the installed vLLM has it).

It prints medians over the steps, the pause per tensor and per changed element, and each
pause as a ratio of the dense reload, all measured in this one run.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/engine_bench.py [--size small|large]
        [--rate 0.03] [--steps 6] [--json]

``small`` is a 29M-parameter Llama, ``large`` a 206M one. vLLM's CPU build prepacks its
linear weights unless the weights are kept updatable; this uses the same plugin as the
vLLM test tier (tests_vllm/plugins).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests_vllm"))

SIZES: dict[str, dict[str, int]] = {
    "small": {"hidden": 512, "intermediate": 1408, "layers": 4, "vocab": 16000, "heads": 8},
    "large": {"hidden": 1024, "intermediate": 2816, "layers": 12, "vocab": 32000, "heads": 16},
}


def _config(size: str) -> Any:
    from dcr_format.testing.tiny_llama import llama_config

    s = SIZES[size]
    return llama_config(
        vocab=s["vocab"],
        hidden=s["hidden"],
        intermediate=s["intermediate"],
        layers=s["layers"],
        heads=s["heads"],
        kv_heads=s["heads"] // 2,
        architectures=["LlamaForCausalLM"],
    )


def _state(size: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Canonical bf16 tensors of the Llama (Hugging Face names)."""
    s = SIZES[size]
    h, f, v = s["hidden"], s["intermediate"], s["vocab"]
    kv = h // 2

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).bfloat16()

    out = {"model.embed_tokens.weight": w(v, h), "lm_head.weight": w(v, h)}
    out["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for i in range(s["layers"]):
        p = f"model.layers.{i}"
        out.update(
            {
                f"{p}.self_attn.q_proj.weight": w(h, h),
                f"{p}.self_attn.k_proj.weight": w(kv, h),
                f"{p}.self_attn.v_proj.weight": w(kv, h),
                f"{p}.self_attn.o_proj.weight": w(h, h),
                f"{p}.mlp.gate_proj.weight": w(f, h),
                f"{p}.mlp.up_proj.weight": w(f, h),
                f"{p}.mlp.down_proj.weight": w(h, f),
                f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            }
        )
    return out


def _step(
    state: dict[str, torch.Tensor], rate: float, gen: torch.Generator
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A new version with ``rate`` of every tensor's elements changed, and the positions."""
    new, changed = {}, {}
    for name, tensor in state.items():
        flat = tensor.reshape(-1).clone()
        count = max(1, int(flat.numel() * rate))
        positions = torch.randperm(flat.numel(), generator=gen)[:count].sort().values
        flat[positions] = (flat[positions].float() + 1e-3 * (1 + flat[positions].abs())).bfloat16()
        new[name] = flat.view(tensor.shape)
        changed[name] = positions
    return new, changed


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run(size: str, rate: float, steps: int) -> dict[str, Any]:
    """Run the benchmark; returns the figures."""
    import harness

    harness.apply_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    # vLLM's CPU worker start trips over llvmlite loaded before it: dcr's numba kernels are
    # off until the engine runs (DCR_KERNELS is read at every call)
    os.environ["DCR_KERNELS"] = "torch"
    import dcr_test_cpu_patch

    dcr_test_cpu_patch.keep_cpu_weights_updatable()
    from vllm import LLM

    from dcr_format import DeltaWriter, replay
    from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync

    gen = torch.Generator().manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="dcr-engine-bench-"))
    atexit.register(shutil.rmtree, tmp, True)  # the store and checkpoint, however it ends
    store = str(tmp / "store")
    state = _state(size, gen)
    writer = DeltaWriter(store)
    writer.publish(state, step=0)
    ckpt = tmp / "ckpt"
    replay(store, 0, ckpt)
    _config(size).save_pretrained(ckpt)
    harness.save_tokenizer(ckpt)
    llm = LLM(model=str(ckpt), weight_transfer_config={"backend": "dcr"}, **harness.ENGINE_ARGS)
    os.environ.pop("DCR_KERNELS")
    sync = DcrWeightSync(writer, llm, DcrInitInfo(store=store, prefetch=False))
    started = time.perf_counter()
    sync.init()
    init_seconds = time.perf_counter() - started
    worker = llm.llm_engine.model_executor.driver_worker.worker
    engine = worker.weight_transfer_engine
    model = worker.model_runner.get_model()
    target = engine._syncer.target
    try:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )
    except ImportError:
        load_checkpoint_weight_patches = None
    tensors = len(state)
    params = sum(t.numel() for t in state.values())
    rows: dict[str, list[float]] = {"dcr": [], "dcr (loader)": [], "dense": [], "patch": []}
    changed_total = 0
    for step in range(1, steps + 1):
        state, changed = _step(state, rate, gen)
        changed_total = sum(p.numel() for p in changed.values())
        version = writer.publish(state, step=step).version
        direct = step % 2 == 1 or step == 1
        target.direct = direct
        sync.update(version)
        report = engine.last_update
        assert report is not None and report.version == version
        if step > 1:  # the first update also reads every tensor's lanes once
            rows["dcr" if direct else "dcr (loader)"].append(report.apply_seconds)
        target.direct = True
        started = time.perf_counter()
        model.load_weights(list(state.items()))
        rows["dense"].append(time.perf_counter() - started)
        if load_checkpoint_weight_patches is not None:
            patches = [
                CheckpointWeightPatch(
                    name, tuple(t.shape), t.dtype, t.reshape(-1)[changed[name]], changed[name]
                )
                for name, t in state.items()
            ]
            started = time.perf_counter()
            load_checkpoint_weight_patches(model, patches)
            rows["patch"].append(time.perf_counter() - started)
    medians = {k: _median(v) for k, v in rows.items() if v}
    dense = medians["dense"]
    out = {
        "size": size,
        "params": params,
        "tensors": tensors,
        "rate": rate,
        "changed_per_step": changed_total,
        "steps": steps,
        "init_seconds": round(init_seconds, 3),
        "medians": {k: round(v, 5) for k, v in medians.items()},
        "ratio_to_dense": {k: round(v / dense, 3) for k, v in medians.items()},
        "per_tensor_ms": {k: round(1e3 * v / tensors, 4) for k, v in medians.items()},
        "per_changed_ns": {k: round(1e9 * v / changed_total, 2) for k, v in medians.items()},
        "runs": {k: [round(x, 5) for x in v] for k, v in rows.items()},
    }
    del llm
    return out


def main() -> int:
    """Command line: prints a table (or JSON) of the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--rate", type=float, default=None, help="default: 3%% small, 1%% large")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rate = args.rate if args.rate is not None else (0.03 if args.size == "small" else 0.01)
    out = run(args.size, rate, args.steps)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{out['params'] / 1e6:.1f}M params, {out['tensors']} tensors, "
        f"{rate:.1%} changed ({out['changed_per_step']} elements a step), "
        f"medians of {args.steps} steps; engine init (prewarm) {out['init_seconds']} s"
    )
    names = {
        "dcr": "dcr apply (prepared)",
        "dcr (loader)": "dcr apply through the loader",
        "dense": "dense load_weights (in memory)",
        "patch": "vLLM sparse checkpoint patch",
    }
    print("| what stops generation | seconds | x dense | ms/tensor | ns/changed element |")
    print("|---|---|---|---|---|")
    for key, label in names.items():
        if key in out["medians"]:
            print(
                f"| {label} | {out['medians'][key]:.4f} | {out['ratio_to_dense'][key]:.2f} "
                f"| {out['per_tensor_ms'][key]:.3f} | {out['per_changed_ns'][key]:.1f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
