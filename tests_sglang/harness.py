"""The SGLang test harness: a tiny Llama built locally (no hub), the trainer that publishes
its AdamW steps with DeltaWriter, and the environment SGLang's CPU path needs here (the shim
in tests_sglang/shims, see docs/pull.md)."""

from __future__ import annotations

import os
import shutil
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


def state_checkpoint(state: dict[str, torch.Tensor], out: Path, *, tied: bool) -> Path:
    """A checkpoint holding ``state`` as the trainer exported it (what a fresh engine on
    that version loads)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    tiny_config(tied=tied).save_pretrained(out)
    save_tokenizer(out)
    return out


PROBE = "sglang_probe.probe"  # tests_sglang/sglang_probe.py, a test-only loader


def tp_env(tp: int) -> dict[str, str]:
    """What a CPU engine with ``tp`` tensor-parallel ranks needs here: the probe loader on
    its path, and a core for each rank (SGLang binds one NUMA node per rank unless told)."""
    if tp <= 1:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    bind = "|".join(str(cores[i % len(cores)]) for i in range(tp))
    path = os.pathsep.join((str(Path(__file__).parent), engine_env()["PYTHONPATH"]))
    return {"SGLANG_CPU_OMP_THREADS_BIND": bind, "PYTHONPATH": path}


class Server(EngineServer):
    """An SGLang server process on 127.0.0.1 with dcr's loader (and, with tensor parallelism,
    the probe loader), and the calls tests make."""

    def __init__(self, model: Path, log: Path, *, tp: int = 1) -> None:
        self.tp = tp
        loaders = [LOADER, PROBE] if tp > 1 else [LOADER]

        def argv(host: str, port: int) -> list[str]:
            return [
                sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
                "--host", host, "--port", str(port), "--custom-weight-loader", *loaders,
                "--tp-size", str(tp), *SERVER_ARGS,
            ]  # fmt: skip

        env = {**os.environ, **engine_env(), **tp_env(tp)}
        super().__init__("sglang", argv, env=env, log=log)

    def load_from_disk(self, model: Path) -> None:
        """SGLang's own ``update_weights_from_disk`` (the model's loader, sharding for every
        rank itself): an edit outside dcr, or what a fresh engine on ``model`` holds."""
        import requests

        reply = requests.post(
            f"{self.url}/update_weights_from_disk", json={"model_path": str(model)}, timeout=300
        )
        assert reply.ok and reply.json()["success"], reply.text

    def probe(self, payload: dict[str, Any]) -> None:
        """Send one request to the probe loader on every rank."""
        import requests
        import sglang_probe

        from dcr_format.integrations.sglang import _serialized

        for path, body in (
            ("/begin_weight_update", {}),
            (
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [_serialized(sglang_probe.request(payload))]
                    * self.tp,
                    "load_format": PROBE,
                    "flush_cache": True,
                },
            ),
            ("/end_weight_update", {}),
        ):
            reply = requests.post(f"{self.url}{path}", json=body, timeout=120)
            assert reply.ok and reply.json()["success"], reply.text

    def shards(self, out: Path) -> list[dict[str, torch.Tensor]]:
        """Every rank's parameters, as that rank holds them."""
        self.probe({"op": "dump", "dir": str(out)})
        found = [torch.load(out / f"rank-{k}.pt") for k in range(self.tp)]
        shutil.rmtree(out)
        return found

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
