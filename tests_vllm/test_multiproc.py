"""Scenario 2: the engine core in its own process, the ``dcr`` backend selected by name
(registered there by the ``vllm.general_plugins`` entry point), versions prepared in the
background while the engine serves; plus the worker extension and the fail-closed check."""

from __future__ import annotations

import time
from pathlib import Path

import dcr_test_cpu_patch
import harness
import pytest

from dcr_format.errors import TargetNotUpdatableError
from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync

EXTENSION = "dcr_format.integrations.vllm.DcrWorkerExtension"


def test_backend_by_name_in_engine_process(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the bit check's callable
    store, trainer, ckpt = harness.first_version(tmp_path, tied=False)
    started = time.perf_counter()
    llm = harness.engine(
        ckpt, weight_transfer_config={"backend": "dcr"}, worker_extension_cls=EXTENSION
    )
    start_seconds = time.perf_counter() - started
    try:
        sync = DcrWeightSync(
            trainer.writer, llm, DcrInitInfo(store=store, reader_id="mp", poll_seconds=0.2)
        )
        sync.init()
        rows, got, dirs = [], [], []
        for step in range(1, 4):
            trainer.step()
            version = trainer.publish(step)
            time.sleep(1.5)  # the engine prepares it in the background meanwhile
            harness.greedy(llm)  # and keeps serving
            began = time.perf_counter()
            sync.update(version)
            update_seconds = time.perf_counter() - began
            (report,) = llm.collective_rpc("dcr_report")
            assert report["version"] == version and report["prefetched"], report
            assert llm.collective_rpc(harness.fused_bits) == [harness.want_fused(trainer.export())]
            got.append(harness.greedy(llm))
            dirs.append(harness.checkpoint(store, version, tmp_path / f"v{step}", tied=False))
            rows.append((step, update_seconds, report["prepare_seconds"], report["apply_seconds"]))
        assert harness.fresh_greedy(dirs) == got
        harness.record("multiprocessing (prefetched)", start_seconds, rows)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_worker_extension_without_the_transfer_api(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    store, trainer, ckpt = harness.first_version(tmp_path, tied=True)
    llm = harness.engine(ckpt, worker_extension_cls=EXTENSION)
    assert llm.collective_rpc("dcr_init", kwargs={"init_info": {"store": store}}) == [
        {"version": 0}
    ]
    for step in range(1, 4):
        trainer.step()
        version = trainer.publish(step)
        (report,) = llm.collective_rpc("dcr_sync", kwargs={"version": version})
        assert report["version"] == version
        assert list(report["applied_versions"]) == [version]
        assert llm.collective_rpc(harness.fused_bits) == [harness.want_fused(trainer.export())]
    with pytest.raises(Exception, match="not committed"):
        llm.collective_rpc("dcr_sync", kwargs={"version": 99})
    assert llm.collective_rpc("dcr_version") == [3]
    harness.greedy(llm)


def test_prepacked_cpu_weights_fail_closed(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers import utils

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(
        utils, "dispatch_cpu_unquantized_gemm", dcr_test_cpu_patch.ORIGINAL_DISPATCH
    )
    store, _, ckpt = harness.first_version(tmp_path, tied=False)
    llm = harness.engine(ckpt, weight_transfer_config={"backend": "dcr"})
    before = harness.greedy(llm)
    with pytest.raises(TargetNotUpdatableError, match=r"prepacked the weight of .*docs/vllm.md"):
        llm.init_weight_transfer_engine({"init_info": {"store": store}})
    assert harness.greedy(llm) == before  # untouched, still serving
