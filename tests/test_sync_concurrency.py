"""Two syncs of one target at once: one applies, the other waits for it and finds the target
already there (or plans again), and the target ends at exactly one version.

A hook lines both syncs up right before their baseline checks: if both could get there,
both would apply in place over each other (each passing its check before either writes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, make_state, run_ranks, snapshot
from torch import nn

from dcr_format import (
    DeltaReader,
    DeltaWriter,
    ModuleTarget,
    SafetensorsDirTarget,
    StateDictTarget,
    Target,
)
from dcr_format.errors import TargetBusyError
from dcr_format.sync import reader as reader_module

WAIT = 1.5  # seconds the hook waits for the other sync to reach its check too


def _step(state: dict[str, torch.Tensor], seed: int) -> None:
    """Change about a third of every float tensor's elements (a mix is then plain to see)."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in state.values():
        if tensor.is_floating_point():
            flat = tensor.view(-1)
            index = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 3)]
            flat[index] = flat[index] * 1.5 + 0.25


@pytest.fixture
def chain(tmp_path: Path):
    """A store with versions 0..2 and the state of each."""
    state = make_state(11)
    # the plain codings: a module target (which cannot read its old bits) reads these
    # versions without having told the writer so first
    writer = DeltaWriter(str(tmp_path / "store"), reader_records=False, features=())
    states = []
    for version in range(3):
        if version:
            _step(state, version)
        writer.publish(state)
        states.append(snapshot(state))
    return str(tmp_path / "store"), states


def _line_up(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make each sync wait (up to WAIT) for a second one at its baseline check; returns
    the count of syncs that reached it."""
    barrier = threading.Barrier(2)
    reached: list[int] = []
    original = reader_module.DeltaReader._check_target

    def check_target(self, sync):
        reached.append(1)
        try:
            barrier.wait(WAIT)
        except threading.BrokenBarrierError:
            pass  # the other sync did not get here (it waits for this one)
        return original(self, sync)

    monkeypatch.setattr(reader_module.DeltaReader, "_check_target", check_target)
    return reached


def _at(reader: DeltaReader, version: int, states, tensors) -> None:
    """Resident ``version`` with exactly its bits, and an audit agrees."""
    assert reader.target.resident() is not None
    assert reader.target.resident().version == version
    if tensors is not None:
        assert_same_bits(tensors, states[version])
    assert reader.sync(audit=True).version == version


def _sync_both(syncs: list[Callable[[], object]]) -> None:
    results, errors = run_ranks(2, lambda i: syncs[i](), timeout=120)
    assert errors == [None, None], errors
    assert [r.version for r in results] == [2, 2]  # type: ignore[attr-defined]


@pytest.mark.parametrize("start", [0, 1], ids=["two-step plan", "one-step plan"])
def test_two_threads_on_one_reader(chain, monkeypatch, start):
    url, states = chain
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    reader.sync(start)
    reached = _line_up(monkeypatch)
    _sync_both([reader.sync, reader.sync])
    assert len(reached) == 1  # the second found the target at the goal: nothing to check
    monkeypatch.undo()
    _at(reader, 2, states, tensors)


def test_two_readers_sharing_one_target(chain, monkeypatch):
    url, states = chain
    tensors: dict[str, torch.Tensor] = {}
    target = StateDictTarget(tensors)
    readers = [DeltaReader(url, target), DeltaReader(url, target)]
    readers[0].sync(0)
    _line_up(monkeypatch)
    _sync_both([r.sync for r in readers])
    monkeypatch.undo()
    _at(readers[1], 2, states, tensors)


def test_two_targets_over_one_dict(chain, monkeypatch):
    url, states = chain
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(url, StateDictTarget(tensors)).sync(0)
    chain_id = DeltaReader(url, StateDictTarget({})).chain.header.chain_id
    readers = [
        DeltaReader(url, StateDictTarget(tensors, version=0, chain_id=chain_id)) for _ in range(2)
    ]
    _line_up(monkeypatch)
    _, errors = run_ranks(2, lambda i: readers[i].sync(), timeout=120)
    # each target believes its own resident version: the one that waited finds the dict
    # moved under it and says so, without touching it
    assert sorted(type(e).__name__ for e in errors if e is not None) in (
        [],
        ["BaselineMismatchError"],
    )
    assert any(e is None for e in errors)
    monkeypatch.undo()
    assert_same_bits(tensors, states[2])


class _Net(nn.Module):
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in state.items():
            self.register_buffer(name.replace(".", "_"), torch.zeros_like(tensor))
        self.names = {name: name.replace(".", "_") for name in state}

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            getattr(self, self.names[name]).copy_(tensor)

    def canonical(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, attr) for name, attr in self.names.items()}


def test_two_readers_sharing_one_module(chain, monkeypatch):
    url, states = chain
    net = _Net(states[0])
    target = ModuleTarget(net, load_weights=net.load_weights)
    readers = [DeltaReader(url, target), DeltaReader(url, target)]
    readers[0].sync(0)
    _line_up(monkeypatch)
    _sync_both([r.sync for r in readers])
    monkeypatch.undo()
    assert_same_bits(net.canonical(), states[2])
    _at(readers[0], 2, states, None)


def test_two_threads_on_one_directory(chain, tmp_path, monkeypatch):
    url, states = chain
    target = SafetensorsDirTarget(tmp_path / "model")
    reader = DeltaReader(url, target)
    reader.sync(0)
    _line_up(monkeypatch)
    _sync_both([reader.sync, reader.sync])
    monkeypatch.undo()
    from safetensors.torch import load_file

    assert_same_bits(load_file(str(tmp_path / "model" / "model.safetensors")), states[2])
    _at(reader, 2, states, None)


def test_a_busy_target_is_refused_after_its_timeout():
    from dcr_format.targets.claim import claim_target

    target: Target = StateDictTarget({})
    release = claim_target(target, timeout=None)
    try:
        with pytest.raises(TargetBusyError, match="another sync"):
            claim_target(StateDictTarget(target.tensors), timeout=0.05)  # type: ignore[attr-defined]
        other = claim_target(StateDictTarget({}), timeout=0.05)  # another dict: free
        other()
    finally:
        release()
    claim_target(target, timeout=0.05)()  # free again


def test_a_sync_from_inside_a_sync_of_the_same_target_is_refused_at_once():
    from dcr_format.targets.claim import claim_target

    target = StateDictTarget({})
    release = claim_target(target, timeout=None)
    try:
        with pytest.raises(TargetBusyError, match="already syncing"):
            claim_target(target, timeout=None)  # would wait for itself
    finally:
        release()
