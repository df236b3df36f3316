"""A sync on its own completes each change against the live tensor while the version's
other objects still arrive, and the transaction then only writes it.

Behind a link slower than the decoding, a sync used to find the changed positions (the
``classed`` select pass, a read of every element) only once every object was fetched and
verified, so that pass, most of a sync's CPU, came after the download instead of during
it. Now the held changes are completed as they are decoded (read only); what must hold:
the result is bit for bit the version's; the completion is used only where no sync
claimed any target between the first completion and this sync's own claim (else the
tensors may have changed under it, and the changes are completed again in the
transaction); a target another sync holds gets no completion ahead at all.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, snapshot

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.delta.delta import DecodedDelta
from dcr_format.store import _local
from dcr_format.sync import _apply
from dcr_format.targets.claim import claim_mark, claim_target, claims_since

NAMES = ("a", "b", "c", "d")


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(300_000, generator=gen).mul(0.02).to(torch.bfloat16) for n in NAMES}


def _stepped(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 2.5% of the elements change: a completed change fits the share held ahead."""
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + torch.randn(t.shape, generator=gen).mul(2e-6)).to(torch.bfloat16)
        for n, t in state.items()
    }


class _Gate:
    """Holds back the first shard a sync fetches until ``release``: the other shards'
    changes are decoded and given to the sync meanwhile, before everything is verified."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.held: str | None = None
        self.released = threading.Event()
        self.lock = threading.Lock()
        real = _local.LocalBackend.get

        def get(backend, key, max_size):  # type: ignore[no-untyped-def]
            with self.lock:
                hold = self.armed and self.held is None and key.endswith(".dcrs")
                if hold:
                    self.held = key
            if hold:
                assert self.released.wait(30), "no change was completed while a shard was held"
            return real(backend, key, max_size)

        monkeypatch.setattr(_local.LocalBackend, "get", get)

    def arm(self) -> None:
        self.armed, self.held = True, None
        self.released.clear()


def _spied(monkeypatch: pytest.MonkeyPatch, gate: _Gate, between=lambda: None):  # type: ignore[no-untyped-def]
    """Each change the sync tried to complete ahead (its name and whether it did), with
    ``between`` called after the first and the held shard released once every other
    shard's change was tried; and each change the transaction was given, completed (True)
    or as decoded."""
    ahead: list[tuple[str, bool]] = []
    given: dict[str, bool] = {}
    real_ahead, real_run = _apply.EarlyApply._ahead, _apply.EarlyApply._run

    def spy_ahead(self, entry, delta):  # type: ignore[no-untyped-def]
        done = real_ahead(self, entry, delta)
        ahead.append((entry.name, done is not None))
        if len(ahead) == 1:
            between()
        if len(ahead) == len(NAMES) - 1:  # one shard a tensor: all but the held one's
            gate.released.set()
        return done

    def spy_run(self, entry, box):  # type: ignore[no-untyped-def]
        given[entry.name] = isinstance(box[0], DecodedDelta)
        return real_run(self, entry, box)

    monkeypatch.setattr(_apply.EarlyApply, "_ahead", spy_ahead)
    monkeypatch.setattr(_apply.EarlyApply, "_run", spy_run)
    return ahead, given


def _synced(tmp_path: Path, seed: int) -> tuple[DeltaWriter, DeltaReader, dict, dict]:
    """A writer of one shard per tensor and a dict target synced to its base."""
    state = _state(seed)
    writer = DeltaWriter(str(tmp_path), shard_bytes=4096)
    writer.publish(state)
    held = snapshot(state)
    reader = DeltaReader(str(tmp_path), StateDictTarget(held))
    reader.sync()
    return writer, reader, held, state


def test_changes_are_completed_while_a_shard_is_still_arriving(monkeypatch, tmp_path):
    gate = _Gate(monkeypatch)
    ahead, given = _spied(monkeypatch, gate)
    writer, reader, held, state = _synced(tmp_path, 0)
    for seed in (1, 2):
        state = _stepped(state, seed)
        writer.publish(state)
        ahead.clear()
        given.clear()
        gate.arm()
        reader.sync()
        assert gate.held is not None
        assert_same_bits(held, state)
        # every change but the held shard's was completed before the transaction opened,
        # and the transaction wrote those as completed
        assert len(ahead) == len(NAMES) - 1 and all(done for _, done in ahead)
        assert all(given[name] for name, _ in ahead)


def _held_back_sync(monkeypatch, tmp_path, seed, between=lambda: None):  # type: ignore[no-untyped-def]
    """One delta synced with its first shard held back (:func:`_spied`), checked bit for
    bit: what was tried ahead and what the transaction was given."""
    gate = _Gate(monkeypatch)
    ahead, given = _spied(monkeypatch, gate, between)
    writer, reader, held, state = _synced(tmp_path, seed)
    state = _stepped(state, seed + 1)
    writer.publish(state)
    gate.arm()
    reader.sync()
    assert_same_bits(held, state)
    return ahead, given


def test_a_claim_in_between_sends_the_changes_as_decoded(monkeypatch, tmp_path):
    """A claim of any target after the first completion (here another reader's target)
    may have changed the tensors under it: the transaction completes them again."""
    other = StateDictTarget({})
    ahead, given = _held_back_sync(
        monkeypatch, tmp_path, 3, between=lambda: claim_target(other, None)()
    )
    # completed while the shard was held, and not used
    assert len(ahead) == len(NAMES) - 1 and all(done for _, done in ahead)
    assert set(given) == set(NAMES) and not any(given.values())


def test_a_target_another_sync_holds_gets_no_completion_ahead(monkeypatch, tmp_path):
    """Held by another sync when the first change would be completed: none is, and the
    sync applies after that one releases the target."""
    gate = _Gate(monkeypatch)
    ahead, _ = _spied(monkeypatch, gate)
    writer, reader, held, state = _synced(tmp_path, 5)
    state = _stepped(state, 6)
    writer.publish(state)
    release = claim_target(reader.target, None)  # another sync's, until the fetch ends
    real_open = _apply.Applying._open

    def opened(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("wait", True):  # the apply after the fetch: the other sync ends
            release()
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(_apply.Applying, "_open", opened)
    gate.arm()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            reader.sync()
        except BaseException as exc:
            failed.append(exc)

    syncing = threading.Thread(target=run)
    syncing.start()
    syncing.join(60)
    release()
    assert not syncing.is_alive() and not failed
    assert gate.held is not None
    assert_same_bits(held, state)
    assert ahead and not any(done for _, done in ahead)


def test_a_mark_counts_the_claims_since():
    target, other = StateDictTarget({}), StateDictTarget({})
    mark = claim_mark(target)
    assert mark is not None and claims_since(mark) == 0
    claim_target(other, None)()
    assert claims_since(mark) == 1
    release = claim_target(target, None)
    assert claim_mark(target) is None  # held: a read now may see a sync's writes
    assert claim_mark(other) is not None
    release()
    assert claims_since(mark) == 2


def test_changes_completed_ahead_are_held_up_to_a_share_of_the_model(monkeypatch, tmp_path):
    """Completed, a change holds its positions and old bits (several times what it holds
    decoded): past a share of the model's bytes the later ones wait as decoded."""
    monkeypatch.setattr(_apply, "AHEAD_SHARE", 1e-6)  # the first change fills it
    ahead, given = _held_back_sync(monkeypatch, tmp_path, 7)
    assert [done for _, done in ahead] == [True] + [False] * (len(NAMES) - 2)
    assert [given[name] for name, _ in ahead] == [True] + [False] * (len(NAMES) - 2)
