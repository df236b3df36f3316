"""The SGLang test harness: a tiny Llama built locally (no hub), the trainer that publishes
its AdamW steps with DeltaWriter, and the environment SGLang's CPU path needs here (the shim
in tests_sglang/shims, see docs/pull.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from dcr_format.testing.tiny_llama import (  # noqa: F401  (the tests name them harness.*)
    VOCAB_SIZE,
    WORDS,
    Trainer,
    checkpoint,
    save_tokenizer,
    tiny_config,
)

PROMPTS = ["the quick brown fox", "seven small birds sing", "every morning bright sun"]
SHIMS = Path(__file__).parent / "shims"


def engine_env() -> dict[str, str]:
    """Environment for tiny CPU engines on a shared 2-core machine."""
    return {
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "SGLANG_DISABLE_REQUEST_LOGGING": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(SHIMS), os.environ.get("PYTHONPATH", "")) if p
        ),
    }


def apply_env() -> None:
    """Set the engine environment in this process (children inherit it)."""
    for key, value in engine_env().items():
        if key == "PYTHONPATH":
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    if str(SHIMS) not in sys.path:
        sys.path.insert(0, str(SHIMS))
        import sitecustomize  # noqa: F401  (the shim, in this process too)


# one small engine: no CUDA graphs, a small KV cache (else it reserves most of the memory)
SERVER_ARGS = [
    "--device", "cpu", "--dtype", "bfloat16", "--max-total-tokens", "512",
    "--max-running-requests", "4", "--context-length", "64", "--disable-cuda-graph",
    "--random-seed", "0", "--skip-server-warmup", "--log-level", "warning",
]  # fmt: skip
LOADER = "dcr_format.integrations.sglang.load_weights"
HOST = "127.0.0.1"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Server:
    """An SGLang server process on 127.0.0.1 with dcr's loader, and the calls tests make."""

    def __init__(self, model: Path, log: Path) -> None:
        import subprocess
        import time

        self.port = _free_port()
        self.url = f"http://{HOST}:{self.port}"
        args = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", HOST, "--port", str(self.port), "--custom-weight-loader", LOADER,
            *SERVER_ARGS,
        ]  # fmt: skip
        self.log_path = log
        self.log = log.open("w")
        self.started = time.perf_counter()
        env = {**os.environ, **engine_env()}
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 400) -> float:
        """Wait until it serves; returns the seconds it took to start."""
        import time

        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"sglang exited {self.proc.returncode}: see {self.log_path}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise AssertionError(f"sglang did not start in {timeout} s: see {self.log_path}")

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

    def stop(self) -> None:
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


def assert_weights(read: Any, state: dict[str, torch.Tensor]) -> None:
    """Every canonical tensor the engine holds (read by canonical name, through SGLang's own
    ``get_weights_by_name``) equals ``state``'s, bit for bit (bf16 widens exactly)."""
    for name, want in state.items():
        got = read(name)
        assert got is not None, name
        got = torch.as_tensor(got, dtype=torch.float32)
        assert torch.equal(got.to(torch.bfloat16).float(), got), name
        assert torch.equal(got.to(torch.bfloat16).view(torch.int16), want.view(torch.int16)), name


def corrupt_shard(store: str, version: int) -> None:
    """Flip one byte in the middle of the first shard of ``version``."""
    shards = sorted((Path(store) / "objects" / f"{version:020d}").rglob("shard-*.dcrs"))
    assert shards
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(data))


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
