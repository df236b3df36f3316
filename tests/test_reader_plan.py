"""Planning a sync from metadata alone (readers/_plan.py), and the transaction's undo.

The planner gets commit records and manifests as plain data: here they are parsed from
the bytes a writer left in a memory store, the store is emptied, and only then is the
plan made, so nothing in it can come from a store.
"""

from __future__ import annotations

import math
import time
import uuid

import pytest
import torch
from conftest import assert_same_bits, make_state, snapshot

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.chain.chain import LoadedRecord, commit_key, sha256_hex, state_table
from dcr_format.delta.delta import FULL, XOR, DecodedDelta
from dcr_format.errors import ChainBrokenError, ShardError, VersionNotFoundError
from dcr_format.format.schema import CommitRecord, Manifest, parse
from dcr_format.store.store import Store
from dcr_format.sync._plan import (
    _join,
    check_version,
    choose_versions,
    plan_checks,
    plan_fetch,
    plan_step,
)
from dcr_format.targets.change import Change, Resident

NORM = "model.norm.weight"
MAX = 16 << 30


def _everything(name: str, dtype: str, shape: tuple[int, ...]) -> bool:
    return True


def _step(state: dict[str, torch.Tensor], names: list[str]) -> None:
    for name in names:
        flat = state[name].view(-1)
        flat[:3] = flat[:3] * 1.5 + 0.25


def _published(versions: int, *, base_every: int = 0) -> tuple[str, dict[int, tuple]]:
    """Publish ``versions`` versions into a fresh memory store; returns its URL and each
    version's (record, manifests) as read from the stored bytes. The store is then emptied."""
    url = f"memory://plan-{uuid.uuid4().hex[:12]}"
    state = make_state(5)
    # plain manifests (JSON, parents named), which this helper parses as they are stored
    writer = DeltaWriter(url, base_every=base_every or None, features=())
    writer.publish(state)
    for _ in range(versions - 1):
        _step(state, [NORM, "model.layers.1.mlp.up_proj.weight"])
        writer.publish(state)
    store = Store(url)
    metadata = {}
    for version in range(versions):
        data = store.get(commit_key(version))
        record = parse(CommitRecord, data, what=commit_key(version))
        loaded = LoadedRecord(record, sha256_hex(data), len(data))
        manifests = [
            parse(Manifest, store.get(ref.path), what=ref.path)
            for ref in sorted(record.manifests, key=lambda r: r.rank)
        ]
        metadata[version] = (loaded, manifests)
    store.delete_many(store.list(""))
    assert store.list("") == []
    return url, metadata


def _plan(metadata: dict[int, tuple], version: int, *, base: bool = False, wants=_everything):
    loaded, manifests = metadata[version]
    table = state_table(manifests)
    return plan_step(
        loaded,
        manifests,
        table,
        base=base,
        wants=wants,
        max_shard_bytes=MAX,
        metadata_bytes=sum(ref.size for ref in loaded.record.manifests),
    )


# --- which versions ---------------------------------------------------------------------------


def test_versions_continue_from_the_resident_version_without_listing_bases():
    def no_listing() -> list[int]:
        raise AssertionError("an incremental plan needs no alternative bases")

    versions, alternative = choose_versions(
        2, 5, range(6), kind=lambda v: "delta", alternatives=no_listing, where="x"
    )
    assert (versions, alternative) == ([3, 4, 5], None)


def test_versions_start_at_the_newest_base_or_alternative_base():
    kinds = {0: "base", 1: "delta", 2: "delta", 3: "base", 4: "delta", 5: "delta"}
    committed = [2, 3, 4, 5]  # 0 and 1 compacted away; the target is empty
    assert choose_versions(
        None, 5, committed, kind=kinds.__getitem__, alternatives=list, where="x"
    ) == ([3, 4, 5], None)
    assert choose_versions(
        None, 5, committed, kind=kinds.__getitem__, alternatives=lambda: [4], where="x"
    ) == ([4, 5], 4)
    # a resident version whose successors are gone: from a base again
    assert choose_versions(
        0, 5, committed, kind=kinds.__getitem__, alternatives=list, where="x"
    ) == ([3, 4, 5], None)


def test_a_long_plan_starts_at_a_base_where_that_fetches_fewer_bytes():
    kinds = {v: "delta" for v in range(10)} | {0: "base", 6: "base"}
    sizes = {v: 100 for v in range(10)} | {0: 1000, 6: 1000}

    def cost(version: int, alternative: bool) -> int:
        return 350 if alternative else sizes[version]

    def plan(resident: int, alternatives=list):
        return choose_versions(
            resident, 9, range(10), kind=kinds.__getitem__, alternatives=alternatives,
            where="x", cost=cost,
        )  # fmt: skip

    # from 1: 2..5 and the base 6 and 7..9 fetch 1700 bytes, from the base 6 1300
    assert plan(1) == ([6, 7, 8, 9], None)
    assert plan(1, lambda: [8]) == ([8, 9], 8)  # 350 + 100
    assert plan(4) == ([6, 7, 8, 9], None)  # 1300 < 1400
    assert plan(6, lambda: [8]) == ([7, 8, 9], None)  # 300 < 450
    assert plan(8, lambda: [8]) == ([9], None)  # one version: no listing needed


def test_versions_without_a_base_left_are_refused():
    with pytest.raises(VersionNotFoundError, match="no base at or before version 5 is left in s"):
        choose_versions(None, 5, [4, 5], kind=lambda v: "delta", alternatives=list, where="s")


# --- what a version fetches -------------------------------------------------------------------


def test_a_step_lists_every_shard_with_its_size_and_sha256():
    _, metadata = _published(3)
    step = _plan(metadata, 2)
    loaded, manifests = metadata[2]
    assert step.version == 2 and not step.base
    refs = {ref.path: ref for m in manifests for ref in m.shards}
    fetched = [shard for job in step.fetch.jobs for shard in job.shards]
    assert fetched and {s.path for s in fetched} <= set(refs)
    for shard in fetched:
        ref = refs[shard.path]
        assert (shard.size, shard.sha256, shard.decoded_size) == (
            ref.size,
            ref.sha256,
            ref.decoded_size,
        )
    manifest_bytes = sum(ref.size for ref in loaded.record.manifests)
    assert step.payload_bytes == manifest_bytes + sum(s.size for s in fetched)
    changed = {t.name: t.changed for t in step.tensors}
    assert changed[NORM] == 3 and changed["model.layers.1.mlp.up_proj.weight"] == 3
    assert changed["lm_head.weight"] == 0
    assert all(not t.full for t in step.tensors)


def test_a_base_step_lists_each_wanted_tensor_once_as_a_full_change():
    _, metadata = _published(2)
    step = _plan(metadata, 0, base=True)
    entries = [e for m in metadata[0][1] for e in m.entries]
    assert [t.name for t in step.tensors] == [e.name for e in entries]
    for tensor, entry in zip(step.tensors, entries, strict=True):
        assert tensor.full and tensor.parent_fingerprint is None
        assert (tensor.changed, tensor.fingerprint) == (math.prod(entry.shape), entry.fingerprint)
    assert plan_checks([step]).baseline == {}


def test_a_target_that_takes_nothing_fetches_nothing():
    _, metadata = _published(2)
    step = _plan(metadata, 1, wants=lambda name, dtype, shape: False)
    assert step.fetch.jobs == () and step.tensors == ()
    assert step.payload_bytes == sum(ref.size for ref in metadata[1][0].record.manifests)


def test_the_plan_matches_what_a_reader_fetches():
    url = f"memory://plan-{uuid.uuid4().hex[:12]}"
    state = make_state(6)
    writer = DeltaWriter(url)
    writer.publish(state)
    target = StateDictTarget({})
    reader = DeltaReader(url, target)
    reader.sync()
    _step(state, [NORM])
    writer.publish(state)
    prepared = reader.prepare()
    plan = prepared._sync_plan
    assert plan is not None and plan.incremental and plan.versions == (1,)
    assert prepared.payload_bytes == plan.payload_bytes
    assert plan.checks.changing == {NORM}
    reader.apply(prepared)
    assert_same_bits(target.tensors, state)


def test_linked_shards_are_one_job_and_each_shard_is_checked_before_any_fetch():
    _, metadata = _published(2)
    manifest = metadata[1][1][0]
    shard = manifest.shards[0]
    shards = tuple(
        shard.model_copy(update={"path": f"{shard.path}-{i}", "decoded_size": 0}) for i in range(3)
    )
    changed = [e for e in manifest.entries if e.changed > 0][:3]
    assert len(changed) >= 2 and all(e.values is not None for e in changed)
    first, second = changed[0], changed[1]
    assert first.positions is not None and first.values is not None
    entries = [
        first.model_copy(
            update={
                "positions": first.positions.model_copy(update={"shard": 0}),
                "values": first.values.model_copy(update={"shard": 1}),
            }
        ),
        second.model_copy(
            update={"positions": None, "values": second.values.model_copy(update={"shard": 1})}
        ),
        *(
            e.model_copy(
                update={"positions": None, "values": e.values.model_copy(update={"shard": 2})}
            )
            for e in changed[2:]
        ),
    ]
    linked = manifest.model_copy(update={"shards": shards, "entries": tuple(entries)})
    fetch = plan_fetch([linked], wants=_everything, max_shard_bytes=MAX)
    groups = [([s.index for s in job.shards], list(job.entries)) for job in fetch.jobs]
    assert groups[0] == ([0, 1], [0, 1])
    if len(changed) > 2:
        assert groups[1] == ([2], [2])
    hostile = linked.model_copy(
        update={"shards": (shards[0].model_copy(update={"decoded_size": 1 << 40}), *shards[1:])}
    )
    with pytest.raises(ShardError, match="over the"):
        plan_fetch([hostile], wants=_everything, max_shard_bytes=MAX)
    with pytest.raises(ShardError, match="need at most"):
        plan_fetch([hostile], wants=_everything, max_shard_bytes=1 << 41)


# --- the checks -------------------------------------------------------------------------------


def test_checks_cover_deltas_onto_resident_bits_not_after_a_full_write():
    _, metadata = _published(4, base_every=2)  # versions 0 and 2 are bases
    steps = [_plan(metadata, 1), _plan(metadata, 2, base=True), _plan(metadata, 3)]
    assert metadata[2][0].record.kind == "base"
    checks = plan_checks(steps)
    # version 1 changes these from the resident bits; version 3's changes follow the base
    assert checks.changing == {NORM, "model.layers.1.mlp.up_proj.weight"}
    parent = state_table(metadata[0][1])
    for name, tensor in checks.baseline.items():
        assert tensor.parent_fingerprint == parent[name].fingerprint
    assert set(checks.baseline) == set(parent)  # every tensor is listed by version 1
    only_base = plan_checks(steps[1:])
    assert only_base.changing == set() and only_base.baseline == {}


def test_a_version_that_does_not_add_up_is_refused():
    _, metadata = _published(2)
    loaded, manifests = metadata[1]
    parent = state_table(metadata[0][1])
    table = state_table(manifests)
    check_version(loaded, manifests, table, parent)
    forged = LoadedRecord(
        loaded.record.model_copy(update={"state_fingerprint": "0" * 32}), loaded.sha256, 1
    )
    with pytest.raises(ChainBrokenError, match="do not add up"):
        check_version(forged, manifests, table, parent)
    with pytest.raises(ChainBrokenError, match="drops tensor"):
        check_version(loaded, manifests, table, {**parent, "extra": parent[NORM]})
    moved = {**parent, NORM: parent["model.step"]}
    with pytest.raises(ChainBrokenError, match="from bits its parent does not hold"):
        check_version(loaded, manifests, table, moved)


# --- the transaction owns the undo ------------------------------------------------------------


def test_rollback_undoes_changes_newest_first_and_restores_replaced_tensors():
    tensors = {"a": torch.arange(8, dtype=torch.int16)}
    target = StateDictTarget(tensors, version=0, chain_id="c" * 32)
    made = target.begin()  # "b" made by a sync: the target's own, so a new shape replaces it
    made.change(
        Change("b", torch.int32, (4,), DecodedDelta(FULL, None, torch.ones(4, dtype=torch.int32)))
    )
    made.commit(Resident("c" * 32, 0))
    original = {n: t for n, t in tensors.items()}
    before = snapshot(tensors)
    txn = target.begin()
    positions = torch.tensor([1, 2], dtype=torch.int64)
    xor = DecodedDelta(XOR, positions, torch.tensor([5, 5], dtype=torch.int16))
    for _ in range(2):  # twice: only the newest-first undo restores the bits
        txn.change(Change("a", torch.int16, (8,), xor))
    full = DecodedDelta(FULL, None, torch.zeros(6, dtype=torch.int32))
    txn.change(Change("b", torch.int32, (6,), full))  # a new shape: a replaced tensor
    txn.change(Change("a", torch.int16, (8,), xor))
    assert not torch.equal(tensors["a"], before["a"]) and tensors["b"].shape == (6,)
    txn.rollback()
    assert all(tensors[n] is t for n, t in original.items())
    assert_same_bits(tensors, before)
    assert target.resident() == Resident("c" * 32, 0)


def test_undo_keeps_the_transaction_open_for_a_commit():
    tensors = {"a": torch.zeros(4, dtype=torch.int16)}
    target = StateDictTarget(tensors, version=0, chain_id="c" * 32)
    txn = target.begin()
    delta = DecodedDelta(XOR, torch.tensor([0]), torch.tensor([1], dtype=torch.int16))
    txn.change(Change("a", torch.int16, (4,), delta))
    txn.undo()
    txn.undo()  # nothing left to undo
    assert tensors["a"].tolist() == [0, 0, 0, 0]
    txn.change(Change("a", torch.int16, (4,), delta))
    txn.commit(Resident("c" * 32, 1))
    assert tensors["a"].tolist() == [1, 0, 0, 0] and target.resident().version == 1


def _components(items: list[tuple[int, set[int]]]) -> set[tuple[tuple[int, ...], frozenset[int]]]:
    """The groups _join must give, by a plain fixed point: shard sets merged until none share."""
    groups = [([index], set(shards)) for index, shards in items]
    merged = True
    while merged:
        merged = False
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                if groups[i][1] & groups[j][1]:
                    groups[i][0].extend(groups[j][0])
                    groups[i][1].update(groups[j][1])
                    del groups[j]
                    merged = True
                    break
            if merged:
                break
    return {(tuple(sorted(indices)), frozenset(members)) for indices, members in groups}


@pytest.mark.parametrize("seed", range(6))
def test_shards_that_entries_link_join_into_the_same_groups_as_a_fixed_point(seed):
    gen = torch.Generator().manual_seed(seed)
    items = []
    for index in range(60):
        count = 1 + int(torch.randint(0, 2, (1,), generator=gen))
        items.append((index, {int(s) for s in torch.randint(0, 25, (count,), generator=gen)}))
    joined = _join(items)
    assert {(tuple(i), frozenset(m)) for i, m in joined} == _components(items)
    assert all(indices == sorted(indices) for indices, _ in joined)


def test_many_entries_of_one_shard_join_in_about_linear_time():
    # thousands of small tensors' streams share a shard: each entry joins in a constant step
    # (a copy of the group per entry took seconds here at this count)
    items = [(index, {index // 50_000}) for index in range(100_000)]
    started = time.process_time()
    joined = _join(items)
    assert time.process_time() - started < 2.0
    assert [len(indices) for indices, _ in joined] == [50_000, 50_000]
