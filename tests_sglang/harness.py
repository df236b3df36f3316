"""The SGLang test harness: a tiny Llama built locally (no hub), the trainer that publishes
its AdamW steps with DeltaWriter, and the environment SGLang's CPU path needs here (the shim
in tests_sglang/shims, see docs/pull.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from dcr_format.testing import engines
from dcr_format.testing.engines import EngineServer
from dcr_format.testing.tiny_llama import (  # noqa: F401  (the tests name them harness.*)
    PROMPTS,
    VOCAB_SIZE,
    WORDS,
    Trainer,
    checkpoint,
    corrupt_shard,
    save_tokenizer,
    tiny_config,
)

SHIMS = Path(__file__).parent / "shims"
SGLANG_ENV = {"SGLANG_DISABLE_REQUEST_LOGGING": "1"}


def engine_env() -> dict[str, str]:
    """Environment for tiny CPU engines on a shared 2-core machine."""
    return engines.engine_env(SGLANG_ENV, path=SHIMS)


def apply_env() -> None:
    """Set the engine environment in this process (children inherit it)."""
    if engines.apply_env(engine_env(), path=SHIMS):
        import sitecustomize  # noqa: F401  (the shim, in this process too)


# one small engine: no CUDA graphs, a small KV cache (else it reserves most of the memory)
SERVER_ARGS = [
    "--device", "cpu", "--dtype", "bfloat16", "--max-total-tokens", "512",
    "--max-running-requests", "4", "--context-length", "64", "--disable-cuda-graph",
    "--random-seed", "0", "--skip-server-warmup", "--log-level", "warning",
]  # fmt: skip
LOADER = "dcr_format.integrations.sglang.load_weights"


class Server(EngineServer):
    """An SGLang server process on 127.0.0.1 with dcr's loader, and the calls tests make."""

    def __init__(self, model: Path, log: Path) -> None:
        def argv(host: str, port: int) -> list[str]:
            return [
                sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
                "--host", host, "--port", str(port), "--custom-weight-loader", LOADER,
                *SERVER_ARGS,
            ]  # fmt: skip

        super().__init__("sglang", argv, env={**os.environ, **engine_env()}, log=log)

    def wait(self, timeout: float = 400) -> float:
        """Wait until it serves; returns the seconds it took to start."""
        return super().wait(timeout)

    def greedy(self) -> list[list[int]]:
        import requests

        reply = requests.post(
            f"{self.url}/generate",
            json={"text": PROMPTS, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
            timeout=120,
        )
        reply.raise_for_status()
        return [list(item["output_ids"]) for item in reply.json()]

    def weights(self, name: str) -> torch.Tensor:
        import requests

        reply = requests.post(
            f"{self.url}/get_weights_by_name",
            json={"name": name, "truncate_size": 1 << 20},
            timeout=60,
        )
        reply.raise_for_status()
        return torch.tensor(reply.json(), dtype=torch.float32)


def assert_weights(read: Any, state: dict[str, torch.Tensor]) -> None:
    """Every canonical tensor the engine holds (read by canonical name, through SGLang's own
    ``get_weights_by_name``) equals ``state``'s, bit for bit (bf16 widens exactly)."""
    for name, want in state.items():
        got = read(name)
        assert got is not None, name
        got = torch.as_tensor(got, dtype=torch.float32)
        assert torch.equal(got.to(torch.bfloat16).float(), got), name
        assert torch.equal(got.to(torch.bfloat16).view(torch.int16), want.view(torch.int16)), name


ENGINE_ARGS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "bfloat16",
    "max_total_tokens": 512,
    "max_running_requests": 4,
    "context_length": 64,
    "disable_cuda_graph": True,
    "random_seed": 0,
    "log_level": "warning",
}
