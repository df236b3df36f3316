"""A publish, a sync, a prepare and an apply hold the cyclic collector off while they run.

They make and drop a few objects for every tensor; on a model of thousands of small
tensors the collections those would set off walk the whole heap of the process again and
again (most of the collector's time in a run of syncs or publishes). What must hold: the
collector is off inside :meth:`DeltaWriter.publish`, :meth:`DeltaReader.sync`,
:meth:`DeltaReader.prepare` and :meth:`DeltaReader.apply`, on again after them (also after
a failure), and left off where the caller had it off.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from conftest import assert_same_bits, snapshot

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.errors import ArgumentError, VersionNotFoundError
from dcr_format.targets.protocol import Transaction


class _Spying(StateDictTarget):
    """A dict target that notes whether the collector is on when a transaction opens, and
    when a preparation asks which tensors it stages (``staged``)."""

    seen: list[bool]
    staged: list[bool]

    def begin(self) -> Transaction:
        self.seen.append(gc.isenabled())
        return super().begin()

    def staging(self, names):  # type: ignore[no-untyped-def]
        self.staged.append(gc.isenabled())
        return super().staging(names)


def _states() -> Iterator[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(512, generator=gen).to(torch.bfloat16) for i in range(4)}
    while True:
        yield state
        state = {
            n: (t.float() + torch.randn(t.shape, generator=gen).mul(1e-3)).to(torch.bfloat16)
            for n, t in state.items()
        }


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_sync_prepare_and_apply_hold_the_collector_off(tmp_path):
    states = _states()
    writer = DeltaWriter(str(tmp_path))
    state = next(states)
    writer.publish(state)
    held = snapshot(state)
    target = _Spying(held)
    target.seen, target.staged = [], []
    reader = DeltaReader(str(tmp_path), target)
    reader.sync()
    assert target.seen and not any(target.seen)  # off inside the sync
    assert gc.isenabled()  # on again after it

    state = next(states)
    writer.publish(state)
    target.seen, target.staged = [], []
    prepared = reader.prepare()
    assert target.staged and not any(target.staged)  # off inside the preparation
    assert gc.isenabled()
    reader.apply(prepared)
    assert target.seen and not any(target.seen)
    assert gc.isenabled()
    assert_same_bits(held, state)


def test_the_collector_is_on_again_after_a_failed_sync(tmp_path):
    states = _states()
    DeltaWriter(str(tmp_path)).publish(next(states))
    reader = DeltaReader(str(tmp_path), StateDictTarget({}))
    with pytest.raises(VersionNotFoundError):
        reader.sync(to=5)
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(tmp_path):
    states = _states()
    DeltaWriter(str(tmp_path)).publish(next(states))
    reader = DeltaReader(str(tmp_path), StateDictTarget({}))
    gc.disable()
    reader.sync()
    assert not gc.isenabled()


def test_publish_holds_the_collector_off(tmp_path):
    states = _states()
    seen: list[bool] = []

    class Spying(dict):  # type: ignore[type-arg]
        """A state dict that notes whether the collector is on as the writer reads it."""

        def items(self):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return super().items()

    writer = DeltaWriter(str(tmp_path))
    writer.publish(Spying(next(states)))
    writer.publish(Spying(next(states)))
    assert seen and not any(seen)  # off inside each publish
    assert gc.isenabled()  # on again after it
    with pytest.raises(ArgumentError):
        writer.publish({"w0": "not a tensor"})  # type: ignore[dict-item]
    assert gc.isenabled()  # and after a refused one
    gc.disable()
    writer.publish(next(states))
    assert not gc.isenabled()  # the caller's choice is left as it was
