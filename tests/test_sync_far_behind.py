"""A preparation of several versions that decode to more than a share of the model leaves
them to the apply, which fetches and applies them in turn: the target reaches the goal's
bits, and any failure, of a fetch in the apply too, rolls every version back; a module far
behind keeps its parameters once as the undo and is restored whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits
from test_module_target import Runtime, assert_module, bits_of, checkpoint, step

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget, StateDictTarget, Transaction
from dcr_format.errors import ChecksumMismatchError
from dcr_format.sync import _fetch

OBJECTS = "objects/"


def _fetched(monkeypatch: pytest.MonkeyPatch, failing: int | None = None) -> list[str]:
    """The shard keys fetched from now on (those of version ``failing`` fail their checks)."""
    fetched: list[str] = []
    original = _fetch.get_verified

    def get_verified(store, key, *, size, sha256):
        fetched.append(key)
        if failing is not None and key.startswith(f"{OBJECTS}{failing:020d}/"):
            raise ChecksumMismatchError(f"{key} is corrupt (a test)")
        return original(store, key, size=size, sha256=sha256)

    monkeypatch.setattr(_fetch, "get_verified", get_verified)
    return fetched


def test_prepare_leaves_large_versions_to_the_apply(five_versions, monkeypatch):
    url, states, large = five_versions
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    reader.sync(0)
    prepared = reader.prepare()
    assert prepared.plan == (1, 2, 3, 4)
    assert_same_bits(tensors, states[0])  # nothing touched
    fetched = _fetched(monkeypatch)
    result = reader.apply(prepared)
    assert result.applied_versions == (1, 2, 3, 4) and result.version == 4
    assert_same_bits(tensors, states[4])
    # large versions are fetched by the apply, the last one at least; small ones are held
    last = [key for key in fetched if key.startswith(f"{OBJECTS}{4:020d}/")]
    assert bool(last) == large


@pytest.mark.parametrize("five_versions", [2], indirect=True)  # versions large enough to be left
def test_a_failed_fetch_in_the_apply_rolls_back_and_the_version_applies_again(
    five_versions, monkeypatch
):
    url, states, _ = five_versions
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    reader.sync(0)
    held = dict(tensors)
    prepared = reader.prepare()
    _fetched(monkeypatch, failing=4)
    with pytest.raises(ChecksumMismatchError):  # raised as it is, after the rollback
        reader.apply(prepared)
    assert_same_bits(tensors, states[0])
    assert all(tensors[name] is tensor for name, tensor in held.items())  # same storage
    assert reader.target.resident().version == 0
    monkeypatch.undo()
    assert reader.apply(prepared).version == 4  # the same prepared version, again
    assert_same_bits(tensors, states[4])


def _module_chain(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A module reader at version 0 of a chain that then moves on by four large steps."""
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    states = [checkpoint()]
    writer.publish(states[0])
    module = Runtime()
    reader = DeltaReader(store, ModuleTarget(module, load_weights=module.load_weights))
    reader.sync()  # its reader record asks for overwrite where the loader transforms
    for k in range(4):
        states.append(step(states[-1], k))
        writer.publish(states[-1])
    return reader, module, states


@pytest.mark.parametrize("how", ["sync", "prepare"])
def test_a_module_far_behind_keeps_its_parameters_once_and_is_restored_whole(
    tmp_path, monkeypatch, how
):
    reader, module, states = _module_chain(tmp_path)
    before = bits_of(module)
    kept: list[bool] = []
    keep_whole = Transaction.keep_whole_undo

    def keep_whole_undo(self, storage=None):  # type: ignore[no-untyped-def]
        kept.append(storage is not None)
        return keep_whole(self, storage)

    monkeypatch.setattr(Transaction, "keep_whole_undo", keep_whole_undo)
    _fetched(monkeypatch, failing=3)
    with pytest.raises(ChecksumMismatchError):
        reader.sync() if how == "sync" else reader.apply(reader.prepare())
    after = bits_of(module)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert reader.target.resident().version == 0
    assert kept == [True]  # the module's storage, once: not the undo of each change
    monkeypatch.undo()
    result = reader.sync() if how == "sync" else reader.apply(reader.prepare())
    assert result.applied_versions == (1, 2, 3, 4)
    assert_module(module, states[4])
