"""Joint commits across real processes on the moto S3 server: writer ranks and reader groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcr_format import DeltaReader, StateDictTarget, Store
from dcr_format.chain.chain import Chain
from dcr_format.format.dtypes import bits_view
from dcr_format.testing.servers import ACCESS_KEY, REGION, SECRET_KEY

sys.path.insert(0, str(Path(__file__).parent))
from mp_workers import model

pytestmark = [pytest.mark.s3, pytest.mark.multiprocess]

WORKER = Path(__file__).with_name("mp_workers.py")


def _env(server) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION=REGION,
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
    )
    return env


def _run(role: str, world: int, work: Path, root: str, server, *extra: str) -> list[dict]:
    work.mkdir(parents=True, exist_ok=True)
    (work / "pg").unlink(missing_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), role, str(rank), str(world), str(work), root, *extra],
            env=_env(server),
        )
        for rank in range(world)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    results = []
    for rank, code in enumerate(codes):
        path = work / f"{role}-{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"exit": code})
        path.unlink(missing_ok=True)
    return results


def _reader_state(root: str, server) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(
        Store(root, storage_options=server.storage_options()), StateDictTarget(tensors)
    ).sync()
    return tensors


def test_writer_processes_commit_jointly_and_survive_a_dead_rank(moto_server, moto_root, tmp_path):
    # three writer processes publish versions 0..2 together
    results = _run("writer", 3, tmp_path / "a", moto_root, moto_server, "3", "-1")
    assert [r["committed"] for r in results] == [[0, 1, 2]] * 3
    store = Store(moto_root, storage_options=moto_server.storage_options())
    record = Chain(store).record(2).record
    assert record.world_size == 3 and len(record.manifests) == 3
    tensors = _reader_state(moto_root, moto_server)
    assert all(torch.equal(bits_view(tensors[n]), bits_view(t)) for n, t in model(2).items())

    # rank 2 dies before its manifest of version 3: no commit, survivors keep version 2
    results = _run("writer", 3, tmp_path / "b", moto_root, moto_server, "1", "3")
    assert results[2] == {"exit": 17}
    for survivor in results[:2]:
        assert survivor["committed"] == [] and survivor["version"] == 2
        assert survivor["errors"] == ["IncompleteVersionError"]
    assert Chain(store).versions() == [0, 1, 2]

    # restarted ranks recover their baselines from the chain and publish version 3
    results = _run("writer", 3, tmp_path / "c", moto_root, moto_server, "1", "-1")
    assert [r["committed"] for r in results] == [[3]] * 3
    tensors = _reader_state(moto_root, moto_server)
    assert all(torch.equal(bits_view(tensors[n]), bits_view(t)) for n, t in model(3).items())


def test_reader_group_applies_all_or_nothing(moto_server, moto_root, tmp_path):
    results = _run("writer", 2, tmp_path / "w", moto_root, moto_server, "4", "-1")
    assert [r["committed"] for r in results] == [[0, 1, 2, 3]] * 2

    # rank 2's share was edited: it refuses, the other three apply nothing either; then, the
    # edit undone, the same four ranks apply versions 2 and 3
    results = _run("reader", 4, tmp_path / "r", moto_root, moto_server, "3", "2")
    assert [r["poisoned"]["error"] for r in results] == ["GroupAbortError"] * 2 + [
        "BaselineMismatchError",
        "GroupAbortError",
    ]
    for r in results:
        assert r["poisoned"]["unchanged"] and r["poisoned"]["resident"] == 1
        intact = r["intact"]
        assert intact["error"] is None and intact["applied"] == [2, 3]
        assert intact["exact"] and intact["resident"] == 3
