"""Tensor parallel 2 on the CPU build: the two ranks of the engine form a reader group,
each prepares a new version in the background and applies its own shards through its
loader, the partial fingerprints are summed over the group (nothing is left unverified),
and generation equals a fresh TP=2 engine's."""

from __future__ import annotations

import time
from pathlib import Path

import harness

from dcr_format.chain.chain import Chain
from dcr_format.integrations.vllm import DcrInitInfo, DcrWeightSync
from dcr_format.store.store import open_store


def test_tensor_parallel_ranks_form_a_reader_group(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the bit check's callable
    store, trainer, ckpt = harness.first_version(tmp_path, tied=False)
    started = time.perf_counter()
    llm = harness.engine(
        ckpt,
        tensor_parallel_size=2,
        weight_transfer_config={"backend": "dcr"},
        worker_extension_cls="dcr_format.integrations.vllm.DcrWorkerExtension",
    )
    start_seconds = time.perf_counter() - started
    try:
        info = DcrInitInfo(store=store, reader_id="tp2", poll_seconds=0.2)
        sync = DcrWeightSync(trainer.writer, llm, info)
        sync.init()
        rows, got, dirs = [], [], []
        for step in range(1, 4):
            trainer.step()
            if step == 1:  # updated at once: the ranks prepare together, in the update
                version = sync.publish(trainer.export(), step=step)
            else:
                version = trainer.publish(step)
                time.sleep(2.5)  # every rank prepares it in the background meanwhile
                harness.greedy(llm)  # and the engine keeps serving
                sync.update(version)
            reports = llm.collective_rpc("dcr_report")
            assert len(reports) == 2
            for report in reports:
                assert report["version"] == version and not report["unverified"], report
                if step > 1:
                    assert report["prefetched"], report
            state = trainer.export()
            assert llm.collective_rpc(harness.fused_bits) == [
                harness.want_fused(state, rank=r, ranks=2) for r in range(2)
            ]
            got.append(harness.greedy(llm))
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
        # the two ranks read each object through the host's cache: one takes what the
        # other read (or an earlier run left there)
        assert sum(r["host_cache_hits"] for r in llm.collective_rpc("dcr_report")) > 0
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert harness.fresh_greedy(dirs, tensor_parallel=2) == got
    # each rank holds part of the sharded tensors: their records ask for no coding that needs
    # a whole tensor's old bits, and say they read those of each changed element, so the
    # shards' values come as ulp differences wherever those are smaller
    chain = Chain(open_store(store))
    sharded = [
        e
        for m in chain.manifests(chain.record(version))
        for e in m.entries
        if e.op == "xor" and e.changed and "norm" not in e.name
    ]
    assert not [e.name for e in sharded if e.positions and e.positions.coding == "classed"]
    assert not [e.name for e in sharded if e.values and e.values.coding == "ulp-shift"]
    assert any(e.values and e.values.coding == "ulp" for e in sharded)
    harness.record("tensor parallel 2 (multiprocessing)", start_seconds, rows)
