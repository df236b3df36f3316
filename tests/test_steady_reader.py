"""Long-lived readers: O(changed) checks in the steady state, audits, prepare then apply."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, make_state, snapshot

import dcr_format.targets.protocol as targets_module
from dcr_format import DeltaReader, DeltaWriter, SafetensorsDirTarget, StateDictTarget, Store
from dcr_format.chain.chain import Chain, commit_key, sha256_hex
from dcr_format.errors import (
    ApplyError,
    BaselineMismatchError,
    ChainBrokenError,
    ChecksumMismatchError,
    ReservedNameError,
    StalePreparedError,
    StoreError,
    ValuesError,
)
from dcr_format.format.dtypes import bits_view
from dcr_format.sync.group import ReaderGroup

BF16 = "model.layers.0.self_attn.q_proj.weight"


def _step(state: dict[str, torch.Tensor], gen: torch.Generator, count: int = 5) -> None:
    """Change ``count`` elements of every floating tensor (an optimizer step)."""
    for tensor in state.values():
        if not tensor.is_floating_point():
            continue
        flat = tensor.view(-1)
        index = torch.randperm(flat.numel(), generator=gen)[:count]
        flat[index] = flat[index] * 1.5 + 0.25


class _CountingLanes:
    """Counts full fingerprint passes the targets make (``Transaction.lanes``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = targets_module.tensor_lanes

        def counted(tensor: torch.Tensor) -> tuple[int, ...]:
            self.calls += 1
            return original(tensor)

        monkeypatch.setattr(targets_module, "tensor_lanes", counted)


@pytest.fixture
def chain(tmp_path: Path):
    state = make_state(3)
    writer = DeltaWriter(str(tmp_path / "store"))
    writer.publish(state)
    return str(tmp_path / "store"), writer, state


def test_steady_state_syncs_do_not_reread_resident_tensors(chain, monkeypatch):
    url, writer, state = chain
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    first = reader.sync()
    assert first.audited
    counting = _CountingLanes(monkeypatch)
    for _ in range(4):
        _step(state, gen)
        writer.publish(state)
        result = reader.sync()
        assert not result.audited and result.apply_seconds >= 0 and result.fetch_seconds > 0
        assert_same_bits(tensors, state)
    assert counting.calls == 0  # no full pass over any resident tensor


def test_audits_run_every_n_syncs_and_when_asked(chain, monkeypatch):
    url, writer, state = chain
    gen = torch.Generator().manual_seed(1)
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors), audit_every=3)
    seen = [reader.sync().audited]
    for _ in range(6):
        _step(state, gen)
        writer.publish(state)
        seen.append(reader.sync().audited)
    assert seen == [True, False, False, True, False, False, True]
    _step(state, gen)
    writer.publish(state)
    assert reader.sync(audit=True).audited
    assert_same_bits(tensors, state)
    timed = DeltaReader(url, StateDictTarget({}), audit_seconds=0.0, audit_every=None)
    timed.sync(to=1)
    assert timed.sync(to=2).audited
    with pytest.raises(ValueError):
        DeltaReader(url, StateDictTarget({}), audit_every=0)


def _edited_reader(url, writer, state, gen, *, where: str):
    """A reader at the newest version whose target is then edited outside dcr, and the
    next version published; ``where`` is ``changed`` or ``unchanged`` (by that version)."""
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    reader.sync()
    before = bits_view(state[BF16]).reshape(-1).clone()
    _step(state, gen)
    writer.publish(state)
    changed = torch.nonzero(bits_view(state[BF16]).reshape(-1) != before).reshape(-1)
    assert changed.numel() > 0
    unchanged = next(i for i in range(before.numel()) if i not in set(changed.tolist()))
    index = int(changed[0]) if where == "changed" else unchanged
    bits_view(tensors[BF16]).reshape(-1)[index] ^= 1  # a stray write, outside dcr
    return reader, tensors, snapshot(tensors)


def test_an_edit_at_a_changed_position_is_caught_and_blamed_on_the_target(chain):
    url, writer, state = chain
    gen = torch.Generator().manual_seed(2)
    reader, tensors, edited = _edited_reader(url, writer, state, gen, where="changed")
    with pytest.raises(BaselineMismatchError, match="changed outside dcr"):
        reader.sync()
    assert_same_bits(tensors, edited)  # rolled back: the edit is still there, nothing else
    assert reader.target.resident().version == writer.version - 1


def test_an_edit_at_an_unchanged_position_needs_an_audit(chain):
    url, writer, state = chain
    gen = torch.Generator().manual_seed(3)
    reader, tensors, edited = _edited_reader(url, writer, state, gen, where="unchanged")
    # the steady-state check reads only the changed positions: it cannot see this edit
    with pytest.raises(BaselineMismatchError):
        reader.sync(audit=True)
    assert_same_bits(tensors, edited)
    with pytest.raises(BaselineMismatchError, match=f"bits of version {writer.version - 1};"):
        reader.audit()
    for verify, audit_every in (("all", None), ("touched", 1)):
        fresh, _, _ = _edited_reader(url, writer, state, gen, where="unchanged")
        fresh.verify, fresh.audit_every = verify, audit_every
        with pytest.raises(BaselineMismatchError):
            fresh.sync()
    # the documented limit: without an audit the edit goes unnoticed at this sync
    blind, _, _ = _edited_reader(url, writer, state, gen, where="unchanged")
    assert not blind.sync().audited


def test_a_rollback_drops_the_trusted_lanes(chain, monkeypatch):
    url, writer, state = chain
    gen = torch.Generator().manual_seed(4)
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    reader.sync()
    _step(state, gen)
    writer.publish(state)
    calls = 0
    apply_delta = targets_module.apply_change

    def fail_second(tensor, delta):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("injected")
        return apply_delta(tensor, delta)

    monkeypatch.setattr(targets_module, "apply_change", fail_second)
    with pytest.raises(Exception, match="injected"):
        reader.sync()
    monkeypatch.undo()
    result = reader.sync()
    assert result.audited  # nothing trusted after a rollback
    assert_same_bits(tensors, state)


def test_audit_checks_without_changing_anything(chain):
    url, _, _ = chain
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    with pytest.raises(Exception, match="sync it first"):
        reader.audit()
    reader.sync()
    before = snapshot(tensors)
    assert reader.audit() == ()
    assert_same_bits(tensors, before)


# --- prepare while generating, pause only to apply ----------------------------------------


def test_prepare_does_not_touch_the_target_and_apply_makes_the_version(chain):
    url, writer, state = chain
    gen = torch.Generator().manual_seed(5)
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors))
    reader.sync()
    for _ in range(2):
        _step(state, gen)
        writer.publish(state)
    before = snapshot(tensors)
    prepared = reader.prepare()
    assert prepared.version == writer.version and prepared.plan == (1, 2)
    assert prepared.payload_bytes > 0 and prepared.fetch_seconds > 0
    assert_same_bits(tensors, before)
    assert reader.target.resident().version == 0
    result = reader.apply(prepared)
    assert result.version == 2 and result.applied_versions == (1, 2)
    assert result.fetch_seconds == prepared.fetch_seconds and result.apply_seconds > 0
    assert_same_bits(tensors, state)
    with pytest.raises(StalePreparedError):  # applied once: the target moved on
        reader.apply(prepared)
    again = reader.prepare()
    assert again.plan == ()
    noop = reader.apply(again)  # already there: no versions, no bytes, only the check's pause
    assert (noop.version, noop.previous, noop.applied_versions) == (2, 2, ())
    assert (noop.payload_bytes, noop.audited, noop.unverified) == (0, False, ())
    assert noop.fetch_seconds == again.fetch_seconds and noop.apply_seconds >= 0


def test_a_prepared_version_can_be_abandoned_or_go_stale(chain):
    url, writer, state = chain
    gen = torch.Generator().manual_seed(6)
    tensors: dict[str, torch.Tensor] = {}
    target = StateDictTarget(tensors)
    reader = DeltaReader(url, target)
    reader.sync()
    _step(state, gen)
    writer.publish(state)
    reader.prepare()  # abandoned: nothing to clean up
    stale = reader.prepare()
    other = DeltaReader(url, target)
    with pytest.raises(StalePreparedError, match="another DeltaReader"):
        other.apply(stale)
    other.sync()  # the target moves under the prepared version
    _step(state, gen)
    writer.publish(state)
    with pytest.raises(StalePreparedError, match="prepare it again"):
        reader.apply(stale)
    assert reader.sync().audited  # another reader moved the target: nothing trusted
    assert_same_bits(tensors, state)


def test_a_failure_in_the_parallel_fetch_leaves_the_target_untouched(tmp_path):
    url = str(tmp_path / "store")
    state = make_state(7)
    writer = DeltaWriter(url, shard_bytes=16)  # about a shard per tensor: many fetches
    writer.publish(state)
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors), max_workers=4)
    reader.sync()
    _step(state, torch.Generator().manual_seed(7))
    writer.publish(state)
    chain = Chain(Store(url))
    manifest = chain.manifests(chain.record(1))[0]
    assert len(manifest.shards) >= 3
    middle = manifest.shards[len(manifest.shards) // 2].path
    path = Path(url) / middle
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    before = snapshot(tensors)
    with pytest.raises(ChecksumMismatchError):
        reader.sync()
    assert_same_bits(tensors, before)
    with pytest.raises(ChecksumMismatchError):
        reader.prepare()
    assert_same_bits(tensors, before)


# --- the resident record's hash ------------------------------------------------------------


def _rewrite_record(url: str, version: int, **changes) -> str:
    """Rewrite commits/<version>.json in place (as a second writer on a store without
    conditional writes could); returns the new sha256."""
    path = Path(url) / commit_key(version)
    record = json.loads(path.read_bytes())
    record.update(changes)
    data = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    path.write_bytes(data)
    return sha256_hex(data)


@pytest.mark.parametrize("kind", ["dict", "dir"])
def test_a_rewritten_resident_record_is_noticed(tmp_path, kind):
    url = str(tmp_path / "store")
    state = make_state(8)
    writer = DeltaWriter(url)
    writer.publish(state)
    _step(state, torch.Generator().manual_seed(8))
    writer.publish(state)
    target = (
        StateDictTarget({}) if kind == "dict" else SafetensorsDirTarget(tmp_path / "checkpoint")
    )
    DeltaReader(url, target).sync(to=0)
    new_sha = _rewrite_record(url, 0, created="2020-01-01T00:00:00Z")
    _rewrite_record(url, 1, parent_sha256=new_sha)  # the chain still links: 1 -> new 0
    with pytest.raises(ChainBrokenError, match="rewritten"):
        DeltaReader(url, target).sync()
    assert target.resident().version == 0


# --- writers ---------------------------------------------------------------------------------


def test_a_reserved_tensor_name_is_refused_before_anything_is_published(tmp_path):
    url = str(tmp_path / "store")
    writer = DeltaWriter(url)
    with pytest.raises(ReservedNameError):
        writer.publish({"__metadata__": torch.zeros(3), "w": torch.ones(2)})
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()]  # not even dcr.json


def test_a_cache_that_cannot_be_written_after_the_commit_is_a_warning(tmp_path, caplog):
    url = str(tmp_path / "store")
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    writer = DeltaWriter(url, cache_dir=blocker)
    state = make_state(9)
    with caplog.at_level(logging.WARNING, logger="dcr_format.publish._cache"):
        info = writer.publish(state)
    assert info.version == 0 and writer.version == 0
    assert "is committed" in caplog.text
    _step(state, torch.Generator().manual_seed(9))
    assert writer.publish(state).version == 1  # no retry publishes the same step twice
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(url, StateDictTarget(tensors)).sync()
    assert_same_bits(tensors, state)
    restarted = DeltaWriter(url, cache_dir=blocker)
    assert restarted.version == 1


def test_a_failed_background_upload_fails_the_publish_and_commits_nothing(tmp_path, monkeypatch):
    url = str(tmp_path / "store")
    writer = DeltaWriter(url, shard_bytes=64)
    state = make_state(10)
    writer.publish(state)
    _step(state, torch.Generator().manual_seed(10))
    put = Store.put
    count = 0

    def failing_put(self, key, data):
        nonlocal count
        if "/shard-" in key:
            count += 1
            if count == 3:
                raise StoreError(f"injected failure putting {key}")
        return put(self, key, data)

    monkeypatch.setattr(Store, "put", failing_put)
    with pytest.raises(StoreError, match="injected"):
        writer.publish(state)
    monkeypatch.undo()
    assert Chain(Store(url)).versions() == [0] and writer.version == 0
    assert writer.publish(state).version == 1
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(url, StateDictTarget(tensors)).sync()
    assert_same_bits(tensors, state)


def test_sync_plans_again_when_another_reader_moves_the_target(chain, monkeypatch):
    url, writer, state = chain
    gen = torch.Generator().manual_seed(11)
    tensors: dict[str, torch.Tensor] = {}
    target = StateDictTarget(tensors)
    reader, other = DeltaReader(url, target), DeltaReader(url, target)
    reader.sync()
    _step(state, gen)
    writer.publish(state)
    begin = reader._begin  # claims the target, then sync() checks it is where it planned from
    calls = 0

    def race_then_begin(**kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            other.sync()  # moves the target under the version just prepared
            _step(state, gen)
            writer.publish(state)
        return begin(**kwargs)

    monkeypatch.setattr(reader, "_begin", race_then_begin)
    result = reader.sync()
    assert calls == 2 and result.version == writer.version and result.applied_versions == (2,)
    assert_same_bits(tensors, state)


# --- changes completed while later ones are decoded ----------------------------------------

_BASELINE_FEATURES = ["positions-classed", "values-rans", "values-ulp", "values-ulp-shift"]


def _classed_chain(tmp_path: Path, shard_bytes: int = 1 << 26):
    """A chain of three bf16 tensors whose deltas are coded against the old bits, its base
    synced by a one-worker reader, and a first delta published (returns the store's URL,
    the reader, its tensors and the delta's state)."""
    from refit_bench import SyntheticTrainer, lr_for

    shapes = {"a.weight": (600, 1024), "b.weight": (500, 1024), "c.weight": (400, 1024)}
    trainer = SyntheticTrainer(shapes, seed=3)
    url = str(tmp_path / "store")
    writer = DeltaWriter(url, features=_BASELINE_FEATURES, shard_bytes=shard_bytes)
    writer.publish(trainer.export())
    tensors: dict[str, torch.Tensor] = {}
    reader = DeltaReader(url, StateDictTarget(tensors), max_workers=1)
    reader.sync()
    trainer.step(lr_for(0.01))
    state = trainer.export()
    writer.publish(state)
    entries = Chain(Store(url)).manifests(Chain(Store(url)).record(1))[0].entries
    assert all(e.positions is not None and e.positions.coding == "classed" for e in entries)
    return url, reader, tensors, state, entries


def test_a_fetch_worker_decodes_two_entries_rans_values_at_once(tmp_path, monkeypatch):
    """A job's entries decode two at a time: the rans values of the first two of the three
    changes decode in one call (decode_rans_pair), the third alone, and the version applies
    bit for bit."""
    import dcr_format.sync._fetch as fetch_module

    _, reader, tensors, state, entries = _classed_chain(tmp_path)
    assert all(e.values is not None and e.values.coding in ("ulp", "ulp-shift") for e in entries)
    pairs = []
    real_pair = fetch_module.decode_rans_pair

    def pair(first, second, *, width):
        pairs.append((first[1], second[1]))
        return real_pair(first, second, width=width)

    monkeypatch.setattr(fetch_module, "decode_rans_pair", pair)
    reader.sync()
    assert pairs == [(entries[0].changed, entries[1].changed)]
    assert_same_bits(tensors, state)


class _GroupOfOne(ReaderGroup):
    """A reader group of one that does not say it is alone: its syncs take the path of a
    rank of a group (every change decoded before the transaction opens), without
    torch.distributed."""

    @property
    def alone(self) -> bool:
        return False


def _as_group_member(reader: DeltaReader) -> None:
    reader.group = _GroupOfOne.solo()


@pytest.mark.parametrize("member", ["alone", "group"])
def test_a_change_completed_just_before_its_apply_keeps_the_old_bits_it_read(
    tmp_path, monkeypatch, member
):
    """A change completed inside the transaction keeps the old bits its select pass read,
    and the apply takes them instead of reading the tensor again; one completed while the
    fetch still runs, before the transaction opens, does so only for a reader on its own,
    which applies it under its claim with no sync claiming a target in between (a rank of a
    group does not: the tensor may be read again by then). A sync of two versions completes
    every change in its transaction; every one applies bit for bit."""
    from refit_bench import lr_for

    import dcr_format.delta.delta as delta_module
    import dcr_format.sync._apply as apply_module
    import dcr_format.sync._fetch as fetch_module
    import dcr_format.targets.reader_side as reader_side_module
    from dcr_format.delta.backend_numba import NumbaBackend

    url, reader, tensors, state, entries = _classed_chain(tmp_path)
    if member == "group":
        _as_group_member(reader)
    calls: list[tuple[str, bool]] = []
    given: list[bool] = []
    real_resolve, real_apply = delta_module.resolve, NumbaBackend.apply_ulp_with_lanes

    def spy(where: str):
        def resolve(delta, target, *, keep_before=False):
            pending = isinstance(delta, delta_module.PendingDelta)
            if pending and (delta.classed is not None or delta.shift is not None):
                calls.append((where, keep_before))
            return real_resolve(delta, target, keep_before=keep_before)

        return resolve

    def apply(self, flat, positions, z, *, lanes=True, before=None):
        given.append(before is not None)
        return real_apply(self, flat, positions, z, lanes=lanes, before=before)

    monkeypatch.setattr(reader_side_module, "resolve", spy("transaction"))
    monkeypatch.setattr(apply_module, "resolve", spy("early"))
    monkeypatch.setattr(NumbaBackend, "apply_ulp_with_lanes", apply)
    real_run_job = fetch_module._run_job

    def run_job_then_wait(*args, **kwargs):
        # the job ends only once the reader has taken a change early, so that a loaded
        # machine cannot let it decode and end before the reader's thread looks
        done = real_run_job(*args, **kwargs)
        deadline = time.monotonic() + 10
        while ("early", False) not in calls and time.monotonic() < deadline:
            time.sleep(0.001)
        return done

    if member == "group":
        monkeypatch.setattr(fetch_module, "_run_job", run_job_then_wait)
    reader.sync()  # one version: changes decoded before the last are completed early
    monkeypatch.setattr(fetch_module, "_run_job", real_run_job)
    assert len(calls) == len(entries)
    if member == "group":
        assert ("early", False) in calls
        assert set(calls) <= {("early", False), ("transaction", True)}
    else:
        assert set(calls) <= {("early", True), ("transaction", True)}
    assert given.count(True) == len([c for c in calls if c[1]])
    assert_same_bits(tensors, state)
    writer = DeltaWriter(url, features=_BASELINE_FEATURES)
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        state = {
            n: (t.float() + lr_for(0.01) * torch.randn(t.shape, generator=gen)).bfloat16()
            for n, t in state.items()
        }
        writer.publish(state)
    calls.clear()
    given.clear()
    reader.sync()
    assert len(calls) == 2 * len(entries) and set(calls) == {("transaction", True)}
    assert len(given) == len(calls) and all(given)
    assert_same_bits(tensors, state)


def test_a_group_member_completes_changes_while_later_ones_are_still_decoded(tmp_path, monkeypatch):
    """A one-step sync of a rank of a group into a dict target finds the positions of each
    change coded against the old bits (``classed``, ``ulp-shift``) as soon as that change
    is decoded, while the fetch worker decodes the next ones: here the last change's
    decode waits until an earlier change has been completed (it would wait in vain if the
    reader decoded the whole version first), and the version still applies bit for bit."""
    import threading

    import dcr_format.sync._apply as apply_module
    import dcr_format.sync._fetch as fetch_module

    _, reader, tensors, state, entries = _classed_chain(tmp_path)
    _as_group_member(reader)
    completed, waited = threading.Event(), []
    real_resolve, real_decode = apply_module.resolve, fetch_module._decode_entry

    def resolve(delta, tensor, *, keep_before=False):
        done = real_resolve(delta, tensor, keep_before=keep_before)
        completed.set()
        return done

    def decode(entry, manifest, streams, symbols=None):
        if entry.name == entries[-1].name:
            waited.append(completed.wait(timeout=30))
        return real_decode(entry, manifest, streams, symbols)

    monkeypatch.setattr(apply_module, "resolve", resolve)
    monkeypatch.setattr(fetch_module, "_decode_entry", decode)
    result = reader.sync()
    assert waited == [True]
    assert result.applied_versions == (1,)
    assert_same_bits(tensors, state)
    assert set(reader._rows) == {e.name for e in entries}  # the rows followed the changes


def _applied_spy(reader: DeltaReader, monkeypatch):
    """Count the changes ``reader`` applies while its fetch still decodes; the event is
    set after the first."""
    import threading

    applied, names = threading.Event(), []
    real = reader._change_now

    def change_now(sync, entry, delta):
        real(sync, entry, delta)
        names.append(entry.name)
        applied.set()

    monkeypatch.setattr(reader, "_change_now", change_now)
    return applied, names


def test_a_sync_on_its_own_applies_changes_while_later_ones_are_still_decoded(
    tmp_path, monkeypatch
):
    """A reader on its own opens its transaction once every object of the version is
    fetched and verified, and applies each change as it is decoded: here the last change's
    decode waits until an earlier change's new bits are in the target (it would wait in
    vain if the reader decoded the whole version first). The version applies bit for bit,
    verified, and the exponent rows follow every change."""
    import dcr_format.sync._fetch as fetch_module

    _, reader, tensors, state, entries = _classed_chain(tmp_path)
    applied, names = _applied_spy(reader, monkeypatch)
    seen: list[bool] = []
    real_decode = fetch_module._decode_entry

    def decode(entry, manifest, streams, symbols=None):
        if entry.name == entries[-1].name:
            seen.append(applied.wait(timeout=30))
            first = names[0]
            seen.append(torch.equal(bits_view(tensors[first]), bits_view(state[first])))
        return real_decode(entry, manifest, streams, symbols)

    monkeypatch.setattr(fetch_module, "_decode_entry", decode)
    result = reader.sync()
    assert seen == [True, True]  # an earlier change was in the target before the last decode
    assert sorted(names) == sorted(e.name for e in entries)  # all while fetching
    assert result.applied_versions == (1,) and not result.unverified
    assert_same_bits(tensors, state)
    assert set(reader._rows) == {e.name for e in entries}
    assert reader.sync().applied_versions == ()  # committed: nothing left to do


def test_a_decode_failure_after_changes_were_applied_rolls_them_back(tmp_path, monkeypatch):
    """A stream that fails its decoder after the transaction opened (every object was
    fetched and verified, earlier changes are in the target) rolls every change back and
    is raised as it is; the next sync applies the version bit for bit."""
    import dcr_format.sync._fetch as fetch_module

    _, reader, tensors, state, entries = _classed_chain(tmp_path)
    applied, names = _applied_spy(reader, monkeypatch)
    real_decode = fetch_module._decode_entry

    def decode(entry, manifest, streams, symbols=None):
        if entry.name == entries[-1].name:
            assert applied.wait(timeout=30)
            raise ValuesError("a hostile stream")
        return real_decode(entry, manifest, streams, symbols)

    monkeypatch.setattr(fetch_module, "_decode_entry", decode)
    before = snapshot(tensors)
    with pytest.raises(ValuesError, match="a hostile stream"):
        reader.sync()
    assert names  # changes were applied, then undone
    assert_same_bits(tensors, before)
    assert reader.target.resident().version == 0
    monkeypatch.setattr(fetch_module, "_decode_entry", real_decode)
    assert reader.sync().audited  # the failure dropped the trusted lanes
    assert_same_bits(tensors, state)


def test_a_failure_after_the_fetch_rolls_back_what_it_applied(tmp_path, monkeypatch):
    """Something failing between the fetch and the apply (here the reader record) while
    the changes applied during the fetch are in the target rolls them back: the target
    keeps its bits and its resident version, and the next sync applies the version."""
    _, reader, tensors, state, entries = _classed_chain(tmp_path)
    _, names = _applied_spy(reader, monkeypatch)

    def broken(names: object = None) -> None:
        raise RuntimeError("the record broke")

    monkeypatch.setattr(reader, "_record_overwrites", broken)
    before = snapshot(tensors)
    with pytest.raises(RuntimeError, match="the record broke"):
        reader.sync()
    assert sorted(names) == sorted(e.name for e in entries)  # applied, then undone
    assert_same_bits(tensors, before)
    assert reader.target.resident().version == 0
    monkeypatch.undo()
    reader.sync()
    assert_same_bits(tensors, state)


def test_a_failed_change_while_fetching_rolls_back_the_others(tmp_path, monkeypatch):
    """A change that fails while the fetch still decodes stops the sync: the changes
    applied beside it are undone (those in flight first end), the failure is an
    ApplyError as in any apply, and the next sync applies the version bit for bit."""
    _, reader, tensors, state, entries = _classed_chain(tmp_path)
    real = reader._change_entry
    done: list[str] = []

    def change_entry(sync, entry, delta, **options):
        if entry.name == entries[1].name:
            raise RuntimeError("the target broke")
        real(sync, entry, delta, **options)
        done.append(entry.name)

    monkeypatch.setattr(reader, "_change_entry", change_entry)
    before = snapshot(tensors)
    with pytest.raises(ApplyError, match="rolled back: the target broke"):
        reader.sync()
    assert_same_bits(tensors, before)
    assert reader.target.resident().version == 0
    monkeypatch.undo()
    reader.sync()
    assert_same_bits(tensors, state)


@pytest.mark.parametrize("member", ["alone", "group"])
def test_a_failed_shard_after_completed_changes_leaves_the_target_untouched(
    tmp_path, monkeypatch, member
):
    """A shard that fails its check fails the sync with the target untouched: the changes
    completed against the live tensors before that shard was fetched are dropped, and a
    reader on its own opens no transaction before every shard is verified. The next sync,
    with the shard intact again, applies the version bit for bit."""
    import threading

    import dcr_format.sync._apply as apply_module
    import dcr_format.sync._fetch as fetch_module

    url, reader, tensors, state, entries = _classed_chain(tmp_path, shard_bytes=16)
    if member == "group":
        _as_group_member(reader)
    manifest = Chain(Store(url)).manifests(Chain(Store(url)).record(1))[0]
    assert len(manifest.shards) == len(entries)  # a shard a tensor: a job each, in order
    path = Path(url) / manifest.shards[-1].path
    intact = path.read_bytes()
    data = bytearray(intact)
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    calls, waited, completed, opened = [], [], threading.Event(), []
    real_resolve, real_get = apply_module.resolve, fetch_module.get_verified
    real_begin = reader.target.begin

    def resolve(delta, tensor, *, keep_before=False):
        calls.append(tensor.data_ptr())
        completed.set()
        return real_resolve(delta, tensor, keep_before=keep_before)

    def get_verified(store, key, **expected):
        if key == manifest.shards[-1].path:
            waited.append(completed.wait(timeout=30))
            waited.append(not opened)
        return real_get(store, key, **expected)

    def begin():
        opened.append(True)
        return real_begin()

    monkeypatch.setattr(apply_module, "resolve", resolve)
    monkeypatch.setattr(fetch_module, "get_verified", get_verified)
    monkeypatch.setattr(reader.target, "begin", begin)
    before = snapshot(tensors)
    with pytest.raises(ChecksumMismatchError):
        reader.sync()
    assert waited == [True, True] and calls  # completed early, before the failure
    if member == "alone":
        assert not opened  # nothing opened, before or after
    assert_same_bits(tensors, before)
    path.write_bytes(intact)
    reader.sync()
    assert_same_bits(tensors, state)


FORK_CHILD_SYNC = """
import os, sys, tempfile
import torch
from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
sys.path.append({benchmarks!r})
from refit_bench import SyntheticTrainer, lr_for
from dcr_format.system.pools import _POOLS
shapes = {{"a.weight": (300, 512), "b.weight": (200, 512)}}
trainer = SyntheticTrainer(shapes, seed=5)
url = tempfile.mkdtemp(dir={tmp!r})
writer = DeltaWriter(url, features={features!r})
writer.publish(trainer.export())
tensors = {{}}
reader = DeltaReader(url, StateDictTarget(tensors))
reader.sync()
trainer.step(lr_for(0.05))
writer.publish(trainer.export())
reader.sync()  # applied on the kept pool: its threads exist
assert any(name == "dcr-apply" for name, _ in _POOLS), _POOLS
trainer.step(lr_for(0.05))
state = trainer.export()
writer.publish(state)
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)  # torch's own OpenMP threads are not in the child either
    reader.sync()
    same = all(torch.equal(tensors[n].view(torch.int16), state[n].view(torch.int16)) for n in state)
    os._exit(0 if same else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_syncs_on_an_apply_pool_of_its_own(tmp_path):
    """A child forked after the reader's kept apply pool started has none of its threads:
    its sync makes its own pool (a change queued on the parent's would never be applied,
    and the child would hang) and applies the version bit for bit."""
    import subprocess
    import sys

    benchmarks = str(Path(__file__).resolve().parent.parent / "benchmarks")
    script = FORK_CHILD_SYNC.format(
        tmp=str(tmp_path), features=_BASELINE_FEATURES, benchmarks=benchmarks
    )
    result = subprocess.run(
        [sys.executable, "-c", script], timeout=120, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
