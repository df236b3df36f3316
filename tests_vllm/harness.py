"""The vLLM test harness: a tiny Llama built locally (no hub), the trainer that publishes its
AdamW steps with DeltaWriter, and the one patch vLLM's CPU build needs (see docs/vllm.md)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from dcr_format.testing import engines
from dcr_format.testing.tiny_llama import (  # noqa: F401  (the tests name them harness.*)
    PROMPTS,
    VOCAB_SIZE,
    WORDS,
    Trainer,
    checkpoint,
    corrupt_shard,
    first_version,
    save_tokenizer,
    tiny_config,
    tiny_moe_config,
    want_fused,
)
from dcr_format.testing.tiny_llama import fused_bits as _fused_bits

PLUGINS = Path(__file__).parent / "plugins"  # the test-only CPU patch plugin (a dist-info)
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # vLLM imports Ray where it is installed, and Ray reads these at import: the tier's Ray
    # instance (test_ray.py) takes only this run's token, and none is written to ~/.ray
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}


def engine_env() -> dict[str, str]:
    """Environment for tiny CPU engines on a shared 2-core machine."""
    return engines.engine_env(VLLM_ENV, path=PLUGINS)


def apply_env() -> None:
    """Set the engine environment in this process (children inherit it)."""
    engines.apply_env(engine_env(), path=PLUGINS)


def fused_bits(worker: Any) -> list[list[int]]:
    """Runs in each worker (``collective_rpc``): its fused parameters' bits."""
    return _fused_bits(worker.model_runner.get_model())


ENGINE_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "max_model_len": 64,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "enforce_eager": True,
    "seed": 0,
}


def engine(model: Path, **kwargs: Any) -> Any:
    """An in-process ``vllm.LLM`` on the checkpoint ``model``: the tier's engine arguments,
    ``kwargs`` over them."""
    from vllm import LLM

    return LLM(model=str(model), **{**ENGINE_ARGS, **kwargs})


def greedy(llm: Any, prompts: list[str] | None = None) -> list[list[int]]:
    """The greedy tokens ``llm`` generates for ``prompts`` (default: :data:`PROMPTS`)."""
    from vllm import SamplingParams

    outs = llm.generate(
        prompts or PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


FIGURES = Path(os.environ.get("DCR_VLLM_FIGURES", "/tmp/dcr-vllm-figures.jsonl"))


def record(mode: str, start_seconds: float, rows: list[tuple[int, float, float, float]]) -> None:
    """Append the figures of one scenario (engine start; per step: update, prepare, pause)."""
    import json

    with FIGURES.open("a") as out:
        out.write(
            json.dumps(
                {
                    "mode": mode,
                    "engine_start_s": round(start_seconds, 3),
                    "steps": [
                        {
                            "step": s,
                            "update_s": round(u, 4),
                            "prepare_s": round(p, 4),
                            "pause_s": round(a, 4),
                        }
                        for s, u, p, a in rows
                    ],
                }
            )
            + "\n"
        )


def fresh_greedy(
    dirs: list[Path], prompts: list[str] = PROMPTS, *, tensor_parallel: int = 1
) -> list[list[list[int]]]:
    """Greedy tokens of a fresh engine started on each checkpoint (in a subprocess)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, **engine_env(), "DCR_TEST_TP": str(tensor_parallel)}
    env.pop("DCR_KERNELS", None)
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "fresh_greedy.py"),
            *map(str, dirs),
            "--",
            *prompts,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("GREEDY "):
            return json.loads(line[len("GREEDY ") :])
    raise AssertionError(f"fresh engines failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
