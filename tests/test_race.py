"""Two writers racing on one store for 100 versions (50 on moto), each with its own DeltaWriter.

Every round both publish the same next version at once (a barrier lines them up):
exactly one wins, the other gets CommitConflictError with its baseline and version
untouched, reopens (a new DeltaWriter, from its baseline cache) and finds the
winner's bits. Every version ends with exactly one commit record and the chain
verifies deep.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import assert_same_bits, flip_bits, snapshot

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, Store
from dcr_format.chain.chain import Chain
from dcr_format.errors import CommitConflictError
from dcr_format.tools import verify

pytestmark = [pytest.mark.s3, pytest.mark.slow]

VERSIONS = 100
# a round on moto is ~50 requests (~0.35-0.6 s on a loaded 2-core machine): 50 versions there,
# a base among them (base_every=25) and every round contested as on the local store; more or
# fewer with $DCR_RACE_MOTO_VERSIONS
MOTO_VERSIONS = int(os.environ.get("DCR_RACE_MOTO_VERSIONS", "50"))


def _first() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(30)
    return {
        "model.embed.weight": torch.randn(8, 16, generator=gen).bfloat16(),
        "model.norm.weight": torch.randn(16, generator=gen),
        "lm_head.weight": torch.randn(4, 16, generator=gen).half(),
    }


def _state(
    committed: dict[str, torch.Tensor], writer: int, version: int
) -> dict[str, torch.Tensor]:
    """What writer ``writer`` wants version ``version`` to be: its own change of the last one."""
    gen = torch.Generator().manual_seed(version * 2 + writer)
    state = snapshot(committed)
    for name in sorted(state)[writer::2]:
        flip_bits(state[name], gen, 3)
    return state


def _race(open_store, cache_root, reliability, where: str, versions: int = VERSIONS) -> None:
    def open_writer(index: int) -> DeltaWriter:
        return DeltaWriter(
            open_store(), base_every=25, cache_dir=cache_root / f"w{index}", reader_records=False
        )

    committed = _first()
    writers = [open_writer(0), open_writer(1)]
    writers[0].publish(committed, step=0)
    writers[1] = open_writer(1)
    winners: list[int] = []
    attempts: list[str] = []
    for version in range(1, versions):
        wanted = [_state(committed, i, version) for i in range(2)]
        before = [(w.version, snapshot(w.baseline)) for w in writers]
        barrier = threading.Barrier(2)
        outcome: list[object] = [None, None]

        def publish(
            i: int, wanted=wanted, barrier=barrier, outcome=outcome, version=version
        ) -> None:
            barrier.wait()
            try:
                outcome[i] = writers[i].publish(wanted[i], step=version * 10 + i)
            except BaseException as exc:
                outcome[i] = exc

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        won = [i for i in range(2) if not isinstance(outcome[i], BaseException)]
        assert len(won) == 1, outcome
        winner, loser = won[0], 1 - won[0]
        assert isinstance(outcome[loser], CommitConflictError), outcome[loser]
        assert outcome[winner].version == version
        # the loser's baseline and version are exactly as before the round
        assert writers[loser].version == before[loser][0] == version - 1
        assert_same_bits(writers[loser].baseline, before[loser][1])
        # reopened, it holds the winner's bits (for the names it owns: all, one rank)
        writers[loser] = open_writer(loser)
        assert writers[loser].version == version
        assert_same_bits(writers[loser].baseline, wanted[winner])
        committed = wanted[winner]
        winners.append(winner)
        attempts.append(outcome[winner].attempt)

    store = open_store()
    chain = Chain(store)
    assert chain.versions() == list(range(versions))
    assert store.list("commits/") == [f"commits/{v:020d}.json" for v in range(versions)]
    for version, (winner, attempt) in enumerate(zip(winners, attempts, strict=True), start=1):
        record = chain.record(version).record
        assert (record.attempt, record.step) == (attempt, version * 10 + winner)
    tensors: dict = {}
    DeltaReader(store, StateDictTarget(tensors)).sync()
    assert_same_bits(tensors, committed)
    report = verify(store, deep=True)
    assert report.ok and report.replayed_versions == versions, report.problems
    reliability.record(
        "race: two writers, one store",
        f"{versions - 1} contested versions ({where}); wins {winners.count(0)}/{winners.count(1)}",
        "one commit record per version; losers unchanged and reopened exact; verify --deep ok",
        cases=versions - 1,
    )


def test_two_writers_race_for_100_versions_on_a_local_store(tmp_path, reliability):
    url = str(tmp_path / "store")
    _race(lambda: Store(url), tmp_path / "cache", reliability, "local")


def test_two_writers_race_on_moto(moto_server, moto_root, tmp_path, reliability):
    options = moto_server.storage_options()
    store = lambda: Store(moto_root, storage_options=options)  # noqa: E731
    _race(store, tmp_path / "cache", reliability, "moto", MOTO_VERSIONS)
