"""dcr into a real SGLang server with two tensor-parallel ranks (CPU, gloo): the two
schedulers' loaders form a reader group over SGLang's own tensor-parallel group.

What each rank holds is read through a test-only loader (sglang_probe) and compared with
what SGLang's own loader places on that rank from a checkpoint of the same version, bit for
bit. A weight edited outside dcr on one rank only is refused by that rank's audit, and the
other rank, whose own part is fine, applies nothing either: both keep their weights and the
server keeps serving."""

from __future__ import annotations

import shutil
import tempfile
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
        sync = DcrSGLangSync(trainer.writer, server.url, DcrInitInfo(store=store))
        assert sync.init() == 0
        for step in (1, 2):
            trainer.step()
            exports.append(trainer.export())
            assert sync.publish(exports[step], step=step) == step
            held = server.shards(tmp / "held")
            # what SGLang's own loader places on each rank from that version's checkpoint
            server.load_from_disk(
                harness.state_checkpoint(exports[step], tmp / f"s{step}", tied=False)
            )
            _equal(held, server.shards(tmp / "fresh"))
        text = server.greedy()

        # rank 1 only: a weight changed outside dcr; its audit refuses, rank 0 follows
        server.probe({"op": "edit", "rank": 1, "name": EDITED})
        before = server.shards(tmp / "before")
        trainer.step()
        exports.append(trainer.export())
        version = int(trainer.writer.publish(exports[-1]).version)
        with pytest.raises(EngineUpdateError, match="changed outside dcr") as refused:
            sync.update(version, audit=True)
        assert "at version 2" in str(refused.value)
        _equal(server.shards(tmp / "after"), before)  # neither rank applied anything
        server.greedy()  # still serving

        # the edit undone by SGLang's own loader: now every rank applies
        server.load_from_disk(tmp / "s2")
        assert server.greedy() == text
        assert sync.update(version).version == version
        held = server.shards(tmp / "held")
        server.load_from_disk(harness.state_checkpoint(exports[-1], tmp / "s3", tied=False))
        _equal(held, server.shards(tmp / "fresh"))
    finally:
        server.stop()
