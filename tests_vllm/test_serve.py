"""Scenarios 3 and 4: ``vllm serve`` as a real server on 127.0.0.1 with the ``dcr`` plugin,
driven from this (trainer) process by vLLM's own ``HTTPVLLMWeightSyncClient``; then a
target edited outside dcr and a corrupted shard: the update call fails with a clear error,
the engine keeps its weights and keeps serving."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import harness
import pytest
import requests

from dcr_format.errors import EngineUpdateError
from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync
from dcr_format.testing.engines import EngineServer


class Server(EngineServer):
    """A ``vllm serve`` process and the calls the test makes to it."""

    def __init__(self, model: Path, log: Path) -> None:
        env = {**os.environ, **harness.engine_env(), "VLLM_SERVER_DEV_MODE": "1"}
        env.pop("DCR_KERNELS", None)  # the server uses dcr's default (compiled) kernels

        def argv(host: str, port: int) -> list[str]:
            return [
                sys.executable, str(Path(__file__).parent / "vllm_cli.py"), "serve", str(model),
                "--host", host, "--port", str(port),
                "--weight-transfer-config", json.dumps({"backend": "dcr"}),
                "--worker-extension-cls", "dcr_test_extension.ProbeExtension",
                "--dtype", "bfloat16", "--max-model-len", "64", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "64", "--enforce-eager", "--seed", "0",
            ]  # fmt: skip

        super().__init__("vllm serve", argv, env=env, log=log)
        try:
            self.start_seconds = self.wait(300)
        except BaseException:
            self.stop()
            raise

    def greedy(self) -> list[list[int]]:
        out = []
        for prompt in harness.PROMPTS:
            reply = requests.post(
                f"{self.url}/v1/completions",
                json={
                    "prompt": prompt,
                    "max_tokens": 12,
                    "temperature": 0,
                    "return_token_ids": True,
                },
                timeout=60,
            )
            reply.raise_for_status()
            out.append(list(reply.json()["choices"][0]["token_ids"]))
        return out

    def rpc(self, method: str) -> list:  # type: ignore[type-arg]
        reply = requests.post(f"{self.url}/collective_rpc", json={"method": method}, timeout=60)
        reply.raise_for_status()
        return reply.json()["results"]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Server, harness.Trainer, str]]:
    store, trainer, ckpt = harness.first_version(tmp_path, tied=False)
    server = Server(ckpt, tmp_path / "serve.log")
    try:
        yield server, trainer, store
    finally:
        server.stop()


def test_vllm_serve_driven_by_http_client(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    server, trainer, store = served
    client = HTTPVLLMWeightSyncClient(server.url, timeout=120)
    sync = DcrWeightSync(trainer.writer, client, DcrInitInfo(store=store, reader_id="serve"))
    sync.init()
    rows, got, dirs = [], [], []
    for step in range(1, 4):
        trainer.step()
        version = sync.publish(trainer.export(), step=step)
        (report,) = server.rpc("dcr_report")
        assert report["version"] == version == step
        assert server.rpc("test_fused_bits") == [harness.want_fused(trainer.export())]
        weight_info = requests.get(f"{server.url}/weight_info", timeout=10).json()
        assert weight_info["weight_version"] == str(version)
        got.append(server.greedy())
        dirs.append(harness.checkpoint(store, version, tmp_path / f"v{step}", tied=False))
        rows.append(
            (
                step,
                sync.timings[-1]["update_seconds"],
                report["prepare_seconds"],
                report["apply_seconds"],
            )
        )
    assert harness.fresh_greedy(dirs) == got
    harness.record("vllm serve over HTTP", server.start_seconds, rows)

    # scenario 4a: a weight edited outside dcr; an audited update refuses to apply on it
    trainer.step()
    version = trainer.publish(4)
    before_bits, before_text = server.rpc("test_fused_bits"), server.greedy()
    server.rpc("test_poke")
    poked = server.rpc("test_fused_bits")
    with pytest.raises(EngineUpdateError, match="changed outside dcr"):
        sync.update(version, audit=True)
    assert server.rpc("test_fused_bits") == poked  # nothing applied
    server.greedy()  # still serving
    server.rpc("test_poke")  # undo the edit: now the update applies
    assert server.rpc("test_fused_bits") == before_bits
    assert server.greedy() == before_text
    sync.update(version)
    assert server.rpc("test_fused_bits") == [harness.want_fused(trainer.export())]

    # scenario 4b: a corrupted shard of the next version (initialised again without
    # prefetch, which would otherwise fetch and verify it before the test corrupts it, and
    # without the host's cache, which may hold the intact shard from an earlier run)
    sync.init_info = DcrInitInfo(store=store, reader_id="serve", prefetch=False, host_cache=False)
    sync.init()
    (report,) = server.rpc("dcr_report")
    assert report is None  # a new reader, still at the version the engine holds
    trainer.step()
    version = trainer.publish(5)
    harness.corrupt_shard(store, version)
    held_bits, held_text = server.rpc("test_fused_bits"), server.greedy()
    with pytest.raises(EngineUpdateError, match=f"did not reach version {version}") as failure:
        sync.update(version)
    assert "sha256" in str(failure.value), failure.value
    assert server.rpc("test_fused_bits") == held_bits
    assert server.greedy() == held_text
    assert [int(v) for v in server.rpc("dcr_version")] == [version - 1]
