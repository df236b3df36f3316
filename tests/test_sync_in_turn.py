"""A sync of several versions applies them one after the other as each is fetched, and any
failure, of a later fetch too, rolls every version back: the target ends as it was."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_bits, change_share, make_state, snapshot
from safetensors.torch import load_file

from dcr_format import DeltaReader, DeltaWriter, SafetensorsDirTarget, StateDictTarget, Transaction
from dcr_format.errors import ChecksumMismatchError
from dcr_format.sync import _fetch

OBJECTS = "objects/"


def _fail_fetching(monkeypatch: pytest.MonkeyPatch, version: int) -> list[str]:
    """Make the shards of ``version`` fail their checks; returns the keys fetched."""
    fetched: list[str] = []
    original = _fetch.get_verified

    def get_verified(store, key, *, size, sha256):
        fetched.append(key)
        if key.startswith(f"{OBJECTS}{version:020d}/"):
            raise ChecksumMismatchError(f"{key} is corrupt (a test)")
        return original(store, key, size=size, sha256=sha256)

    monkeypatch.setattr(_fetch, "get_verified", get_verified)
    return fetched


def _spy_changes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    changed: list[str] = []
    original = Transaction.change

    def change(self, change, staged=None, **options):
        changed.append(change.name)
        return original(self, change, staged, **options)

    monkeypatch.setattr(Transaction, "change", change)
    return changed


def test_a_failed_fetch_rolls_back_the_versions_already_applied(five_versions, monkeypatch):
    url, states, large = five_versions
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    reader.sync(0)
    held = {name: tensor for name, tensor in tensors.items()}
    fetched = _fail_fetching(monkeypatch, 3)
    changed = _spy_changes(monkeypatch)
    whole: list[bool] = []
    keep_whole = Transaction.keep_whole_undo
    monkeypatch.setattr(
        Transaction, "keep_whole_undo", lambda self: whole.append(True) or keep_whole(self)
    )
    with pytest.raises(ChecksumMismatchError):
        reader.sync()
    # versions 1 and 2 were fetched and applied before version 3 failed its fetch
    assert any(key.startswith(f"{OBJECTS}{2:020d}/") for key in fetched) and changed
    assert not any(key.startswith(f"{OBJECTS}{4:020d}/") for key in fetched)
    assert whole == ([True] if large else [])  # large changes: one copy of each tensor
    assert_same_bits(tensors, states[0])
    assert all(tensors[name] is tensor for name, tensor in held.items())  # same storage
    assert reader.target.resident().version == 0
    monkeypatch.undo()
    assert reader.sync().applied_versions == (1, 2, 3, 4)
    assert_same_bits(tensors, states[4])


def test_a_failed_fetch_leaves_a_directory_as_it_was(five_versions, tmp_path, monkeypatch):
    url, states, _ = five_versions
    target = SafetensorsDirTarget(tmp_path / "model")
    reader = DeltaReader(url, target)
    reader.sync(1)
    _fail_fetching(monkeypatch, 4)
    with pytest.raises(ChecksumMismatchError):
        reader.sync()
    assert_same_bits(load_file(str(tmp_path / "model" / "model.safetensors")), states[1])
    assert target.resident().version == 1
    monkeypatch.undo()
    assert reader.sync().version == 4
    assert_same_bits(load_file(str(tmp_path / "model" / "model.safetensors")), states[4])


def test_a_base_after_deltas_is_written_over_them_and_rolled_back_whole(tmp_path, monkeypatch):
    state = make_state(22)
    url = str(tmp_path / "store")
    writer = DeltaWriter(url, reader_records=False, base_every=3)
    states = []
    for version in range(6):  # bases at 0 and 3
        if version:
            change_share(state, version, 3)
        writer.publish(state)
        states.append(snapshot(state))
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    reader.sync(2)
    _fail_fetching(monkeypatch, 5)
    with pytest.raises(ChecksumMismatchError):
        reader.sync()  # 3 (the base), 4, then 5 fails
    assert_same_bits(tensors, states[2])
    monkeypatch.undo()
    assert reader.sync().version == 5
    assert_same_bits(tensors, states[5])


def test_only_syncs_that_decode_up_to_the_model_give_freed_pages_back(
    five_versions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A base or a plan of several versions gives the heap back after each job; a steady
    one-version sync does not (its next sync would fault the same pages in again)."""
    store, states, _ = five_versions
    trims: list[int] = []
    monkeypatch.setattr(_fetch, "give_back_freed", lambda: trims.append(1))
    target = StateDictTarget({})
    reader = DeltaReader(store, target)
    reader.sync(to=0)  # a base
    assert trims
    trims.clear()
    reader.sync(to=1)  # one delta: the steady state
    assert not trims
    reader.sync(to=4)  # three versions behind
    assert trims
    assert_same_bits(target.tensors, states[4])
