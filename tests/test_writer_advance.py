"""The writer's baseline advances in the CPU diff's own pass (one pass per tensor).

What must hold: after a commit the baseline is the committed bits (in the same tensors:
nothing was copied); when the version does not commit, or anything fails while writing,
every baseline is back to the previous version's bits, exactly; both kernel paths agree.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_bits, make_state, snapshot, step_state

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.errors import ArgumentError, CommitConflictError
from dcr_format.store.store import Store


@pytest.fixture(params=["auto", "torch"])
def kernels(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setenv("DCR_KERNELS", "torch")
    else:
        monkeypatch.delenv("DCR_KERNELS", raising=False)
    return request.param


def _pointers(writer: DeltaWriter) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in writer.baseline.items()}


def test_committed_baseline_is_advanced_in_place(kernels, tmp_path):
    store = Store(str(tmp_path))
    gen = torch.Generator().manual_seed(3)
    state = make_state(3)
    writer = DeltaWriter(store)
    writer.publish(state)
    before = _pointers(writer)
    for _ in range(3):
        step_state(state, gen)
        writer.publish(state)
        assert_same_bits(writer.baseline, state)
    if kernels == "auto":  # the fused pass wrote into the baseline tensors themselves
        changed = [n for n, p in _pointers(writer).items() if before.get(n) == p]
        assert changed, "no baseline was advanced in place"
    target: dict[str, torch.Tensor] = {}
    DeltaReader(store, StateDictTarget(target)).sync()
    assert_same_bits(target, state)


def test_a_failure_while_writing_puts_every_baseline_back(kernels, tmp_path):
    store = Store(str(tmp_path))
    gen = torch.Generator().manual_seed(4)
    state = make_state(4)
    writer = DeltaWriter(store)
    writer.publish(state)
    at_base = snapshot(state)
    step_state(state, gen, per_tensor=50)
    items = list(state.items())
    # the last name repeats the first: refused only after the others were diffed
    with pytest.raises(ArgumentError, match="twice"):
        writer.publish([*items, items[0]])
    assert writer.version == 0
    assert_same_bits(writer.baseline, at_base)
    info = writer.publish(state)  # and the next publish is a correct delta of version 0
    assert info.version == 1 and info.changed_elements > 0
    target: dict[str, torch.Tensor] = {}
    DeltaReader(store, StateDictTarget(target)).sync()
    assert_same_bits(target, state)


def test_a_version_that_does_not_commit_puts_every_baseline_back(kernels, tmp_path):
    store = Store(str(tmp_path))
    gen = torch.Generator().manual_seed(5)
    state = make_state(5)
    DeltaWriter(store).publish(state)
    at_zero = snapshot(state)
    a, b = DeltaWriter(store), DeltaWriter(store)
    assert a.version == b.version == 0  # both open at version 0
    winner, loser = snapshot(state), snapshot(state)
    step_state(winner, gen, per_tensor=20)
    step_state(loser, gen, per_tensor=20)
    a.publish(winner)
    with pytest.raises(CommitConflictError):
        b.publish(loser)  # b's diff advanced its baselines before the commit failed
    assert b.version == 0
    assert_same_bits(b.baseline, at_zero)


def test_shards_are_cut_at_a_quarter_of_the_last_publish(tmp_path, monkeypatch):
    """A long-lived writer cuts about four shards a version (at least MIN_SHARD_BYTES, at
    most shard_bytes), so uploads overlap the coding of the rest; readers get the same."""
    import dcr_format.publish.writer as writer_module

    monkeypatch.setattr(writer_module, "MIN_SHARD_BYTES", 1 << 10)
    store = Store(str(tmp_path))
    gen = torch.Generator().manual_seed(6)
    state = {f"w{i}": torch.randn(256, 256, generator=gen).to(torch.bfloat16) for i in range(16)}
    writer = DeltaWriter(store)
    writer.publish(state)  # a base: one 2 MiB shard (nothing known yet)
    assert len(writer.chain.manifests(writer.chain.record(0))[0].shards) == 1
    for step in (1, 2):  # the first delta is cut at a quarter of the (larger) base
        for tensor in state.values():
            tensor.view(-1)[step::7] += 1
        writer.publish(state)
    first, second = (writer.chain.manifests(writer.chain.record(v))[0] for v in (1, 2))
    assert len(first.shards) == 1 and 4 <= len(second.shards) <= 5
    assert writer._shard_limit() == sum(r.decoded_size for r in second.shards) // 4
    small = DeltaWriter(str(tmp_path / "capped"), shard_bytes=1 << 20)
    small._last_streams = 1 << 40
    assert small._shard_limit() == 1 << 20  # never above shard_bytes
    target: dict[str, torch.Tensor] = {}
    DeltaReader(store, StateDictTarget(target)).sync()
    assert_same_bits(target, state)
