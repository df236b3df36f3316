"""dcr into a real SGLang server with two tensor-parallel ranks (CPU, gloo): the two
schedulers' loaders form a reader group over SGLang's own tensor-parallel group.

What each rank holds is read through a test-only loader (sglang_probe) and compared with
what SGLang's own loader places on that rank from a checkpoint of the same version, bit for
bit. A weight edited outside dcr on one rank only is refused by the group's audit, and a
store read that fails on one rank only stops the other rank too: every rank keeps its
weights and the server keeps serving."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import harness
import pytest
import torch

from dcr_format.errors import EngineUpdateError
from dcr_format.integrations.sglang import DcrSGLangSync
from dcr_format.integrations.vllm import DcrInitInfo

TP = 2
EDITED = "model.layers.0.mlp.down_proj.weight"  # split by columns across the ranks


def _equal(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want) == TP
    for rank, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine.keys() == theirs.keys(), rank
        for name, tensor in mine.items():
            assert torch.equal(tensor.view(torch.int16), theirs[name].view(torch.int16)), (
                rank,
                name,
            )


@pytest.fixture(scope="module")
def tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dcr-sglang-tp-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_tensor_parallel_group_applies_on_every_rank_or_none(tmp: Path) -> None:
    store = str(tmp / "store")
    trainer = harness.Trainer(store, tied=False)
    exports = [trainer.export()]
    trainer.writer.publish(exports[0], step=0)
    server = harness.Server(
        harness.checkpoint(store, 0, tmp / "v0", tied=False), tmp / "server.log", tp=TP
    )
    try:
        server.wait()
        info = DcrInitInfo(store=store, poll_seconds=0.2)
        sync = DcrSGLangSync(trainer.writer, server.url, info)
        assert sync.init() == 0
        assert [(o.ok, o.rank, o.ranks) for o in sync.outcomes] == [(True, 0, TP), (True, 1, TP)]
        for step in (1, 2):
            trainer.step()
            exports.append(trainer.export())
            if step == 1:  # updated at once: the ranks prepare together, in the update
                assert sync.publish(exports[step], step=step) == step
            else:  # every rank prepares it in the background while the engine serves
                trainer.writer.publish(exports[step], step=step)
                time.sleep(2.5)
                assert sync.update(step).version == step
                assert [o.report["prefetched"] for o in sync.outcomes] == [True] * TP
                # through the host's cache, one rank takes what the other read
                assert sum(o.report["host_cache_hits"] for o in sync.outcomes) > 0
            held = server.shards(tmp / "held")
            # what SGLang's own loader places on each rank from that version's checkpoint
            server.load_from_disk(
                harness.state_checkpoint(exports[step], tmp / f"s{step}", tied=False)
            )
            _equal(held, server.shards(tmp / "fresh"))
        assert held[0][EDITED].shape == (128, 64)  # each rank holds half the columns
        text = server.greedy()

        # rank 1 only: a weight changed outside dcr. The group audits the whole tensor,
        # so rank 0, whose own columns are untouched, refuses it too
        server.probe({"op": "edit", "rank": 1, "name": EDITED})
        before = server.shards(tmp / "before")
        trainer.step()
        exports.append(trainer.export())
        version = int(trainer.writer.publish(exports[-1]).version)
        with pytest.raises(EngineUpdateError, match="changed outside dcr") as refused:
            sync.update(version, audit=True)
        assert "at version 2" in str(refused.value)
        assert [(o.ok, o.version) for o in sync.outcomes] == [(False, 2)] * TP
        assert all(EDITED in str(o.error) for o in sync.outcomes), sync.outcomes
        _equal(server.shards(tmp / "after"), before)  # neither rank applied anything
        server.greedy()  # still serving

        # an init audits too: refused on every rank, so no rank keeps a reader
        with pytest.raises(EngineUpdateError, match="did not start dcr"):
            sync.init()
        assert [o.ok for o in sync.outcomes] == [False] * TP
        with pytest.raises(EngineUpdateError, match="send the init request first"):
            sync.update(version)
        assert [o.ok for o in sync.outcomes] == [False] * TP

        # the edit undone by SGLang's own loader; the engine holds version 2 again
        server.load_from_disk(tmp / "s2")
        assert server.greedy() == text
        # without prefetch: the ranks would otherwise read version 3 before the failure below;
        # without the host's cache, through which rank 1 may take what rank 0 read
        sync.init_info = DcrInitInfo(store=store, version=2, prefetch=False, host_cache=False)
        assert sync.init() == 2
        before = server.shards(tmp / "before")

        # a store read fails on rank 1 only: rank 0 fetched its version, yet applies nothing
        server.probe({"op": "fail-fetch", "rank": 1})
        with pytest.raises(EngineUpdateError, match="injected") as refused:
            sync.update(version)
        first, second = sync.outcomes
        assert str(first.error).startswith("GroupAbortError"), first
        assert "rank(s) [1] failed" in str(first.error), first
        assert "injected" in str(second.error), second
        assert first.version == second.version == 2
        _equal(server.shards(tmp / "after"), before)
        assert server.greedy() == text

        # again: now every rank applies
        assert sync.update(version).version == version
        assert [(o.ok, o.rank, o.version) for o in sync.outcomes] == [
            (True, rank, version) for rank in range(TP)
        ]
        held = server.shards(tmp / "held")
        server.load_from_disk(harness.state_checkpoint(exports[-1], tmp / "s3", tied=False))
        _equal(held, server.shards(tmp / "fresh"))
    finally:
        server.stop()
