"""dcr into real SGLang engines through its ``--custom-weight-loader`` hook: a server on
127.0.0.1 driven over HTTP (untied Llama) and an offline ``sglang.Engine`` (tied Llama).
After each AdamW step's update every canonical tensor the engine holds equals the
trainer's export bit for bit, and after the last the greedy output equals a fresh engine's
started on that version; a weight edited outside dcr and a corrupted shard are refused
while the engine keeps its weights and keeps serving."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness
import pytest
import torch

from dcr_format.errors import EngineUpdateError
from dcr_format.integrations.sglang import DcrSGLangSync
from dcr_format.integrations.vllm import DcrInitInfo

STEPS = 3


class _Run:
    """A trainer whose exports after 0..STEPS steps are made first, version 0 published, and
    a fresh server started on the last export (it starts while the engine under test does)."""

    def __init__(self, tmp: Path, *, tied: bool) -> None:
        self.store = str(tmp / "store")
        self.trainer = harness.Trainer(self.store, tied=tied)
        self.exports = [self.trainer.export()]
        for _ in range(STEPS):
            self.trainer.step()
            self.exports.append(self.trainer.export())
        self.trainer.writer.publish(self.exports[0], step=0)
        self.ckpt = harness.checkpoint(self.store, 0, tmp / "v0", tied=tied)
        fresh = harness.state_checkpoint(self.exports[-1], tmp / "fresh", tied=tied)
        self.fresh = harness.Server(fresh, tmp / "fresh.log")

    def fresh_greedy(self) -> list[list[int]]:
        try:
            self.fresh.wait()
            harness.assert_weights(self.fresh.weights, self.exports[-1])
            return self.fresh.greedy()
        finally:
            self.fresh.stop()

    def next_version(self) -> int:
        """One more step, published without updating the engine."""
        self.trainer.step()
        self.exports.append(self.trainer.export())
        return int(self.trainer.writer.publish(self.exports[-1]).version)


def _updates(sync: DcrSGLangSync, run: _Run, read: Any, greedy: Any) -> list[dict[str, float]]:
    assert sync.init() == 0
    rows = []
    for step in range(1, STEPS + 1):
        started = time.perf_counter()
        version = sync.publish(run.exports[step], step=step)
        assert version == step
        rows.append({"update_s": time.perf_counter() - started})
        harness.assert_weights(read, run.exports[step])
    assert greedy() == run.fresh_greedy()
    return rows


def _refuse_corrupted_shard(sync: DcrSGLangSync, run: _Run, read: Any, greedy: Any) -> None:
    # without prefetch: it would otherwise fetch and verify the version before it is
    # corrupted; without the host's cache, which may hold the intact shard from an earlier run
    sync.init_info = DcrInitInfo(store=run.store, prefetch=False, host_cache=False)
    held = sync.init()
    version = run.next_version()
    harness.corrupt_shard(run.store, version)
    text = greedy()
    with pytest.raises(EngineUpdateError, match=f"did not reach version {version}") as failure:
        sync.update(version)
    assert "sha256" in str(failure.value), failure.value
    assert f"at version {held}" in str(failure.value)
    harness.assert_weights(read, run.exports[held])
    assert greedy() == text  # still serving, on the weights it held


@pytest.fixture
def private_tmp() -> Iterator[Path]:
    """A directory of this tier's own: engines outlive the retention of pytest's numbered
    directories, which concurrent pytest runs on the machine prune."""
    tmp = Path(tempfile.mkdtemp(prefix="dcr-sglang-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[harness.Server, _Run]]:
    tmp = Path(tempfile.mkdtemp(prefix="dcr-sglang-"))
    run = _Run(tmp, tied=False)
    server = harness.Server(run.ckpt, tmp / "server.log")
    try:
        server.wait()
        yield server, run
    finally:
        server.stop()
        run.fresh.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_server_updates_match_fresh_engine(served: tuple[harness.Server, _Run]) -> None:
    server, run = served
    sync = DcrSGLangSync(run.trainer.writer, server.url, DcrInitInfo(store=run.store))
    rows = _updates(sync, run, server.weights, server.greedy)
    assert len(rows) == STEPS


def test_server_refuses_edit_outside_dcr_and_corrupted_shard(
    served: tuple[harness.Server, _Run],
) -> None:
    server, run = served
    sync = DcrSGLangSync(run.trainer.writer, server.url, DcrInitInfo(store=run.store))
    held = sync.init()
    assert held == len(run.exports) - 1
    name = "model.layers.0.mlp.down_proj.weight"
    original = run.exports[held][name]
    tmp = Path(run.store).parent
    edited = {**run.exports[held], name: (original.float() * 1.5).to(torch.bfloat16)}
    server.load_from_disk(harness.state_checkpoint(edited, tmp / "edited", tied=False))
    version = run.next_version()
    with pytest.raises(EngineUpdateError, match="changed outside dcr"):
        sync.update(version, audit=True)
    assert not torch.equal(server.weights(name).to(torch.bfloat16), original)  # untouched
    server.greedy()  # still serving
    # the edit undone: now the update applies
    server.load_from_disk(harness.state_checkpoint(run.exports[held], tmp / "held", tied=False))
    sync.update(version)
    harness.assert_weights(server.weights, run.exports[version])
    _refuse_corrupted_shard(sync, run, server.weights, server.greedy)


def test_offline_engine_updates_and_refusals(private_tmp: Path) -> None:
    import sglang

    run = _Run(private_tmp, tied=True)
    engine = sglang.Engine(
        model_path=str(run.ckpt), custom_weight_loader=[harness.LOADER], **harness.ENGINE_ARGS
    )
    try:

        def read(name: str) -> Any:
            return engine.get_weights_by_name(name, truncate_size=1 << 20)

        def greedy() -> list[list[int]]:
            params = {"max_new_tokens": 12, "temperature": 0}
            out = engine.generate(prompt=harness.PROMPTS, sampling_params=params)
            return [list(item["output_ids"]) for item in out]

        sync = DcrSGLangSync(run.trainer.writer, engine, DcrInitInfo(store=run.store))
        _updates(sync, run, read, greedy)
        _refuse_corrupted_shard(sync, run, read, greedy)
    finally:
        engine.shutdown()
        run.fresh.stop()
