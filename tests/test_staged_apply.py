"""prepare() reads a one-version change against a dict target's live tensors; apply() only
writes it (so the engine's pause is only the write). Exactness must not depend on that."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, make_state, scale_elements, snapshot
from test_module_prepared import fail_after_writing

import dcr_format.sync._diagnose as diagnose_module
from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, Transaction
from dcr_format.errors import ApplyError, BaselineMismatchError
from dcr_format.format.dtypes import bits_view

BF16 = "model.layers.0.self_attn.q_proj.weight"


def _spy_apply(monkeypatch: pytest.MonkeyPatch) -> list:
    """The changes that go through Transaction.apply (not a staged put)."""
    applies: list = []
    original = Transaction.apply

    def spied(self, change):
        applies.append(change)
        return original(self, change)

    monkeypatch.setattr(Transaction, "apply", spied)
    return applies


def _changed_position(at_zero, state, name: str = BF16) -> int:
    differs = bits_view(at_zero[name]).reshape(-1) != bits_view(state[name]).reshape(-1)
    return int(differs.nonzero()[0])


def test_prepare_stages_and_apply_writes_the_version(synced, monkeypatch):
    reader, tensors, state, at_zero = synced
    prepared = reader.prepare()
    assert BF16 in prepared._staged  # read against the live tensor
    assert_same_bits(tensors, at_zero)  # and nothing written
    applies = []
    original = Transaction.apply
    monkeypatch.setattr(
        Transaction, "apply", lambda self, c: applies.append(c) or original(self, c)
    )
    result = reader.apply(prepared)
    assert result.version == 1
    assert_same_bits(tensors, state)
    assert not any(c.name in prepared._staged for c in applies)  # staged ones were only put
    assert not reader.sync().applied_versions  # and the trusted lanes hold


def test_sync_does_not_stage(synced, monkeypatch):
    reader, tensors, state, _ = synced
    monkeypatch.setattr(DeltaReader, "_stage", lambda self, step: pytest.fail("staged"))
    reader.sync()
    assert_same_bits(tensors, state)


def test_an_edit_before_prepare_is_caught_as_before(synced):
    reader, tensors, state, at_zero = synced
    bits_view(tensors[BF16]).reshape(-1)[_changed_position(at_zero, state)] ^= 1
    edited = snapshot(tensors)
    prepared = reader.prepare()
    with pytest.raises(BaselineMismatchError, match="changed outside dcr"):
        reader.apply(prepared)
    assert_same_bits(tensors, edited)  # rolled back to the edited bits, nothing else


def test_an_edit_between_prepare_and_apply_still_ends_exact(synced):
    reader, tensors, state, at_zero = synced
    prepared = reader.prepare()
    bits_view(tensors[BF16]).reshape(-1)[_changed_position(at_zero, state)] ^= 1
    reader.apply(prepared)
    assert_same_bits(tensors, state)  # the version's bits went there anyway


def test_a_tensor_replaced_after_prepare_is_applied_the_usual_way(synced, monkeypatch):
    reader, tensors, state, _ = synced
    prepared = reader.prepare()
    tensors[BF16] = tensors[BF16].clone()  # same bits, another tensor: the stage is stale
    applies = _spy_apply(monkeypatch)
    reader.apply(prepared)
    names = {c.name for c in applies}
    assert BF16 in names and not names & (set(prepared._staged) - {BF16})
    assert_same_bits(tensors, state)


def test_a_failure_while_putting_rolls_every_put_back(synced, monkeypatch):
    reader, tensors, state, at_zero = synced
    prepared = reader.prepare()
    assert len(prepared._staged) > 2
    written = fail_after_writing(monkeypatch, 2, "injected")
    with pytest.raises(ApplyError, match="injected"):
        reader.apply(prepared)
    assert len(written) == 2
    assert_same_bits(tensors, at_zero)
    assert reader.target.resident().version == 0
    monkeypatch.undo()
    reader.sync()
    assert_same_bits(tensors, state)


def test_tied_tensors_are_not_staged(tmp_path: Path):
    state = make_state(9)
    state["lm_head.weight"] = state[BF16]  # one tensor under two names
    writer = DeltaWriter(str(tmp_path / "store"))
    writer.publish(state)
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(str(tmp_path / "store"), StateDictTarget(tensors))
    reader.sync()
    tensors["lm_head.weight"] = tensors[BF16]
    scale_elements(state, torch.Generator().manual_seed(10))
    writer.publish(state)
    prepared = reader.prepare()
    assert BF16 not in prepared._staged and "lm_head.weight" not in prepared._staged
    reader.apply(prepared)
    assert_same_bits(tensors, state)


def test_the_pause_computes_no_staged_fingerprint_past_the_cache_floor(synced, monkeypatch):
    # a cache floor below the two fingerprints per staged tensor (a model of more tensors
    # than a fixed cache holds): the reader's reservation keeps every one for the checks
    reader, tensors, state, _ = synced
    monkeypatch.setattr(diagnose_module, "FINGERPRINTS", diagnose_module.FingerprintCache(2))
    prepared = reader.prepare()
    assert len(prepared._staged) >= 4
    full = [e.name for e, _ in prepared._steps[0].changes if e.op == "full"]
    computed: list[tuple[int, ...]] = []
    original = diagnose_module.fingerprint_from_lanes

    def counted(dtype, shape, lanes):
        computed.append(tuple(lanes))
        return original(dtype, shape, lanes)

    monkeypatch.setattr(diagnose_module, "fingerprint_from_lanes", counted)
    reader.apply(prepared)
    assert_same_bits(tensors, state)
    assert len(computed) == len(full)  # only the tensors written whole, checked afresh
