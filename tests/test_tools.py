"""Chain tooling from Python: log, show, diff, verify, replay, compact, gc, doctor, plot.

The tests that touch objects run on a local store and on moto's S3 server.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, flip_bits, make_state, snapshot, step_state

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, Store
from dcr_format.chain.bases import base_record_key
from dcr_format.chain.chain import Chain, attempt_prefix, commit_key
from dcr_format.errors import (
    ArgumentError,
    ChainBrokenError,
    ChecksumMismatchError,
    GraceTooShortError,
    VersionNotFoundError,
)
from dcr_format.format.dtypes import bits_view
from dcr_format.tools import (
    compact,
    diff,
    doctor,
    gc,
    log,
    object_infos,
    parse_duration,
    plot,
    replay,
    show,
    verify,
)

pytestmark = pytest.mark.s3


@pytest.fixture(params=["local", "moto"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """A fresh store on local disk or on moto's S3 server."""
    if request.param == "local":
        return Store(tmp_path / "store")
    server = request.getfixturevalue("moto_server")
    root = request.getfixturevalue("moto_root")
    return Store(root, storage_options=server.storage_options())


@pytest.fixture
def local(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def _chain(
    store: Store, versions: int, *, base_every: int | None = None, seed: int = 0, **kwargs
) -> list[dict[str, torch.Tensor]]:
    """Publish ``versions`` versions of a small state; return each version's tensors."""
    gen = torch.Generator().manual_seed(seed)
    state = make_state(seed)
    writer = DeltaWriter(store, base_every=base_every, **kwargs)
    states = []
    for version in range(versions):
        if version:
            step_state(state, gen)
        writer.publish(state, step=10 * version)
        states.append(snapshot(state))
    return states


def _materialise(store: Store, version: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    DeltaReader(store, StateDictTarget(tensors), verify="all").sync(to=version)
    return tensors


def _shard_keys(store: Store, version: int) -> list[str]:
    chain = Chain(store)
    loaded = chain.record(version)
    return [s.path for m in chain.manifests(loaded) for s in m.shards]


# --- log and show --------------------------------------------------------------------------


def test_log_rows_limit_and_since(local: Store) -> None:
    _chain(local, 6, base_every=4)
    rows = log(local)
    assert [r.version for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r.kind for r in rows] == ["base", "delta", "delta", "delta", "base", "delta"]
    assert [r.parent for r in rows] == [None, 0, 1, 2, 3, 4]
    assert [r.step for r in rows] == [0, 10, 20, 30, 40, 50]
    assert rows[0].change_rate == 1.0 and 0 < rows[1].change_rate < 0.2
    assert all(r.writer_ranks == 1 and r.created.endswith("Z") for r in rows)
    assert all(r.ratio == pytest.approx(r.payload_bytes / r.dense_bytes) for r in rows)
    assert rows[1].payload_bytes < rows[0].payload_bytes
    assert [r.version for r in log(local, limit=2)] == [4, 5]
    assert [r.version for r in log(local, since=3)] == [3, 4, 5]
    assert [r.version for r in log(local, since=1, limit=2)] == [4, 5]
    assert log(local, limit=0) == [] and log(local, since=9) == []
    assert json.loads(rows[2].model_dump_json())["version"] == 2
    assert not any(r.compacted for r in rows)
    compact(local, at=3)
    assert [r.compacted for r in log(local)] == [False, False, False, True, False, False]


def test_show_rows_sort_and_top(local: Store) -> None:
    _chain(local, 3, features=())  # the plain codings: no features, rice and ranges positions
    detail = show(local, 1)
    assert detail.version.version == 1 and detail.attempt == Chain(local).record(1).record.attempt
    assert len(detail.tensors) == len(make_state(0))
    by_bytes = [r.encoded_bytes for r in detail.tensors]
    assert by_bytes == sorted(by_bytes, reverse=True)
    assert sum(r.share for r in detail.tensors) == pytest.approx(1.0)
    assert sum(r.changed for r in detail.tensors) == detail.version.changed_elements
    names = [r.name for r in show(local, 1, sort="name").tensors]
    assert names == sorted(names)
    changed = [r.changed for r in show(local, 1, sort="changed").tensors]
    assert changed == sorted(changed, reverse=True)
    assert len(show(local, 1, top=2).tensors) == 2
    with pytest.raises(VersionNotFoundError):
        show(local, 7)
    assert detail.required_features == ()
    entries = {e.name: e for m in Chain(local).manifests(Chain(local).record(1)) for e in m.entries}
    for row in detail.tensors:  # each row names its entry's codings, None where it has none
        entry = entries[row.name]
        assert row.positions_coding == (entry.positions and entry.positions.coding)
        assert row.values_coding == (entry.values and entry.values.coding)
    assert {r.positions_coding for r in detail.tensors} <= {"rice", "ranges", None}


def test_show_lists_the_features_and_codings_a_version_uses(local: Store) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(4096, generator=gen) * 0.02).bfloat16()
    writer = DeltaWriter(local, features=("values-rans", "values-ulp", "manifest-zstd"))
    writer.publish({"w": weight})
    moved = torch.rand(4096, generator=gen) < 0.05  # one ulp each way: ulp values pay
    steps = torch.where(torch.rand(4096, generator=gen) < 0.5, 1, -1).to(torch.int16)
    weight.view(torch.int16)[moved] += steps[moved]
    writer.publish({"w": weight})
    detail = show(local, 1)
    chain = Chain(local)
    manifests = chain.manifests(chain.record(1))
    assert detail.required_features == tuple(
        sorted({f for m in manifests for f in m.required_features})
    )
    assert {"manifest-zstd", "values-ulp"} <= set(detail.required_features)
    (row,) = detail.tensors
    assert (row.positions_coding, row.values_coding) == ("rice", "ulp")


def test_the_codings_of_a_tensor_in_pieces_are_each_named_once() -> None:
    from dcr_format.tools._inspect import _joined

    assert _joined(None, "rice") == "rice"
    assert _joined("rice", "rice") == "rice"
    assert _joined("rice", "ranges") == "ranges+rice"
    assert _joined("ranges+rice", "classed") == "classed+ranges+rice"
    assert _joined("rice", None) == "rice" and _joined(None, None) is None


def test_a_row_takes_the_fields_its_summary_has_and_the_rest_as_given(local: Store) -> None:
    from pydantic import ValidationError

    from dcr_format.tools._inspect import LogRow, row_from

    _chain(local, 2)
    info = DeltaWriter(local).publish(make_state(1))
    row = row_from(LogRow, info, parent=1, writer_ranks=1, kind="given wins")
    assert (row.version, row.step, row.created) == (info.version, info.step, info.created)
    assert (row.change_rate, row.ratio) == (info.change_rate, info.ratio)
    assert (row.parent, row.kind, row.compacted) == (1, "given wins", False)
    with pytest.raises(ValidationError, match="writer_ranks"):  # neither has it
        row_from(LogRow, info, parent=1)


# --- diff -------------------------------------------------------------------------------------


def _true_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, int]:
    counts = {}
    for name in set(a) | set(b):
        if name not in a or name not in b:
            counts[name] = (a.get(name) if name not in b else b[name]).numel()
        elif a[name].shape != b[name].shape or a[name].dtype != b[name].dtype:
            counts[name] = max(a[name].numel(), b[name].numel())
        else:
            counts[name] = int((bits_view(a[name]) != bits_view(b[name])).sum())
    return {n: c for n, c in counts.items() if c}


def test_diff_counts_exactly_what_xor_deltas_change(local: Store) -> None:
    gen = torch.Generator().manual_seed(3)
    state = make_state(3)
    # the plain codings: xor entries whose positions count exactly without the old bits
    writer = DeltaWriter(local, ops={"lm_head.weight": "overwrite"}, features=())
    writer.publish(state)
    q = "model.layers.0.self_attn.q_proj.weight"
    flat = state[q].view(torch.int16).reshape(-1)
    flat[5] ^= 1  # changes at 1 ...
    writer.publish(state)
    flat[5] ^= 1  # ... and back at 2: not a difference between 0 and 3
    flat[9] ^= 4
    flip_bits(state["lm_head.weight"], gen, 4)  # overwrite entries: an upper bound
    writer.publish(state)
    state["model.extra.bias"] = torch.ones(3)  # a new tensor: full
    step_state(state, gen)
    writer.publish(state)
    states = [_materialise(local, v) for v in range(4)]

    report = diff(local, 0, 3)
    truth = _true_diff(states[0], states[3])
    rows = {r.name: r for r in report.tensors}
    assert set(rows) == set(truth)
    for name, row in rows.items():
        assert (row.elements == truth[name]) if row.exact else (row.elements >= truth[name])
    assert rows[q].exact and rows[q].status == "changed"
    assert rows["model.extra.bias"].status == "added"
    assert not rows["lm_head.weight"].exact
    assert report.elements_differing == sum(r.elements for r in report.tensors)

    exact = diff(local, 0, 3, exact=True)
    assert exact.exact
    assert {r.name: r.elements for r in exact.tensors} == truth

    assert {r.name: r.elements for r in diff(local, 1, 2, exact=True).tensors} == _true_diff(
        states[1], states[2]
    )
    back = {r.name: r for r in diff(local, 3, 0).tensors}
    assert back["model.extra.bias"].status == "removed"
    same = diff(local, 2, 2, include_unchanged=True)
    assert same.tensors_differing == 0 and all(r.status == "unchanged" for r in same.tensors)
    assert len(same.tensors) == len(states[2])


def test_diff_across_a_base_is_an_upper_bound_until_exact(local: Store) -> None:
    _chain(local, 6, base_every=3)
    states = [_materialise(local, v) for v in (1, 5)]
    report = diff(local, 1, 5)
    assert not report.exact
    assert all(r.elements == r.total for r in report.tensors)  # a base rewrote everything
    exact = diff(local, 1, 5, exact=True)
    assert {r.name: r.elements for r in exact.tensors} == _true_diff(*states)


# --- verify -----------------------------------------------------------------------------------


def test_verify_names_a_deleted_shard_a_flipped_byte_and_a_broken_link(store: Store) -> None:
    _chain(store, 7)
    intact = verify(store, deep=True)
    assert intact.ok and intact.replayed_versions == 7 and intact.first_broken_version is None

    deleted = _shard_keys(store, 2)[0]
    store.delete(deleted)
    flipped = _shard_keys(store, 4)[0]
    data = bytearray(store.get(flipped))
    data[len(data) // 2] ^= 0x10
    store.put(flipped, bytes(data))
    record = json.loads(store.get(commit_key(5)))
    record["parent_sha256"] = "0" * 64
    store.put(commit_key(5), json.dumps(record, separators=(",", ":")).encode())

    report = verify(store)
    assert not report.ok and report.first_broken_version == 2
    found = {(p.version, p.key, p.error) for p in report.problems}
    assert (2, deleted, "ObjectNotFoundError") in found
    assert (4, flipped, "ChecksumMismatchError") in found
    assert (5, commit_key(5), "ChainBrokenError") in found  # 5 no longer links to 4
    assert (6, commit_key(6), "ChainBrokenError") in found  # 5's bytes changed under 6
    assert json.loads(report.model_dump_json())["first_broken_version"] == 2

    deep = verify(store, deep=True)
    replay_problems = [p for p in deep.problems if p.check == "state"]
    assert [p.version for p in replay_problems] == [2]  # nothing after it replays: no base
    assert deep.replayed_versions == 2

    ranged = verify(store, start=3, end=4)
    assert {p.key for p in ranged.problems} == {flipped}
    assert ranged.versions_checked == 2


def test_deep_verify_replays_the_chain_once(local: Store, monkeypatch) -> None:
    _chain(local, 8, base_every=5)
    base_shard = _shard_keys(local, 0)[0]
    fetched: list[str] = []
    get = Store.get

    def counting(self, key, *, max_size=None):  # type: ignore[no-untyped-def]
        fetched.append(key)
        return get(self, key, max_size=max_size)

    monkeypatch.setattr(Store, "get", counting)
    report = verify(local, deep=True, start=2, end=7)
    assert report.ok and report.replayed_versions == 6
    # once to replay versions 0..2, never again for 3..7 (shallow checks do not reach 0)
    assert fetched.count(base_shard) == 1
    for version in range(3, 8):
        shard = _shard_keys(local, version)[0]
        assert fetched.count(shard) == 2  # shallow check + one replay step


def test_verify_reports_missing_versions_and_a_truncated_start(local: Store) -> None:
    _chain(local, 6, base_every=2)
    local.delete(commit_key(3))
    report = verify(local)
    assert [(p.version, p.error) for p in report.problems] == [(3, "VersionNotFoundError")]
    (missing,) = report.problems
    assert (missing.key, missing.check) == (commit_key(3), "link")
    assert missing.message.startswith("version 3 is missing from the chain")
    local.delete(commit_key(0))
    local.delete(commit_key(1))
    local.delete(commit_key(2))
    assert verify(local, start=4).ok  # starts at a base: its parent link is not checked
    local.delete(commit_key(4))
    truncated = verify(local)  # 5 is left alone, a delta without a base: nothing can start
    assert [(p.version, p.check) for p in truncated.problems] == [(5, "link")]
    (start,) = truncated.problems
    assert (start.key, start.error) == (commit_key(5), "ChainBrokenError")
    assert "neither a base nor has an alternative base" in start.message


# --- replay -----------------------------------------------------------------------------------


def test_replay_cache_applies_only_the_versions_after_it(local: Store, tmp_path: Path) -> None:
    states = _chain(local, 5)
    cache = tmp_path / "cache"
    first = replay(local, 3, tmp_path / "out1", cache_dir=cache)
    assert first.source == "base" and first.applied_versions == (0, 1, 2, 3)
    assert first.cache_version == 3

    gen = torch.Generator().manual_seed(9)
    state = snapshot(states[-1])
    writer = DeltaWriter(local)
    for _ in range(3):
        step_state(state, gen)
        writer.publish(state)
    second = replay(local, 7, tmp_path / "out2", cache_dir=cache)
    assert second.source == "cache" and second.start_version == 3
    assert second.applied_versions == (4, 5, 6, 7)
    assert second.payload_bytes < first.payload_bytes
    from safetensors.torch import load_file

    assert_same_bits(load_file(str(tmp_path / "out2" / "model.safetensors")), state)

    older = replay(local, 2, tmp_path / "out3", cache_dir=cache)
    assert older.source == "base" and older.cache_version == 7  # the cache stays newest
    assert_same_bits(load_file(str(tmp_path / "out3" / "model.safetensors")), states[2])
    same = replay(local, 7, tmp_path / "out4", cache_dir=cache)
    assert same.source == "cache" and same.applied_versions == ()

    # a damaged cache is detected by its fingerprints and replaced by a replay from the base
    cached = next((cache / Chain(local).header.chain_id / "replay" / "state").glob("*.safetensors"))
    tensors = load_file(str(cached))
    name = sorted(tensors)[0]
    flip_bits(tensors[name], torch.Generator().manual_seed(1), 1)
    from safetensors.torch import save_file

    cached.unlink()  # the file may be a hard link shared with out2
    save_file(tensors, str(cached))
    again = replay(local, 7, tmp_path / "out5", cache_dir=cache)
    assert again.source == "base" and again.applied_versions[0] == 0
    assert_same_bits(load_file(str(tmp_path / "out5" / "model.safetensors")), state)
    assert_same_bits(load_file(str(tmp_path / "out2" / "model.safetensors")), state)


# --- compact ----------------------------------------------------------------------------------


def test_compact_lets_a_late_joiner_start_at_the_new_base(store: Store) -> None:
    states = _chain(store, 9, features=())  # plain codings: versions 4-7 outweigh a base
    before = DeltaReader(store, StateDictTarget({})).sync()
    assert before.applied_versions[0] == 0

    made = compact(store, at=7)
    assert made.created and made.key == base_record_key(7)
    assert made.replayed_versions == tuple(range(8))
    assert store.exists(base_record_key(7))

    tensors: dict[str, torch.Tensor] = {}
    after = DeltaReader(store, StateDictTarget(tensors)).sync()
    assert after.applied_versions == (7, 8)
    assert after.payload_bytes < before.payload_bytes
    assert_same_bits(tensors, states[8])
    # a reader that already holds a version starts at the base too where that fetches less
    # than the versions in between (else it goes on incrementally: test_reader_plan.py)
    resident: dict[str, torch.Tensor] = {}
    reader = DeltaReader(store, StateDictTarget(resident))
    reader.sync(to=3)
    assert reader.sync().applied_versions == (7, 8)
    assert_same_bits(resident, states[8])

    report = verify(store, deep=True)
    assert report.ok and report.bases_checked == 1
    assert not compact(store, at=7).created
    assert compact(store, at=0).reason == "the version is a base"


def test_a_broken_alternative_base_fails_closed_and_verify_names_it(local: Store) -> None:
    _chain(local, 5)
    compact(local, at=3)
    record = json.loads(local.get(base_record_key(3)))
    shard = record["manifests"][0]["path"].replace("manifest-00000.json", "shard-00000-00000.dcrs")
    data = bytearray(local.get(shard))
    data[-3] ^= 1
    local.put(shard, bytes(data))
    with pytest.raises(ChecksumMismatchError):
        DeltaReader(local, StateDictTarget({})).sync()
    report = verify(local)
    assert [(p.version, p.key, p.check) for p in report.problems] == [(3, shard, "base")]
    record["state_fingerprint"] = "0" * 64
    local.delete(base_record_key(3))
    local.put(base_record_key(3), json.dumps(record).encode())
    with pytest.raises(ChainBrokenError):
        DeltaReader(local, StateDictTarget({})).sync()


# --- gc -----------------------------------------------------------------------------------------


def test_gc_truncates_to_the_newest_kept_base(local: Store) -> None:
    states = _chain(local, 12, base_every=4)
    sizes = {i.key: i.size for i in object_infos(local, "")}
    dry = gc(local, keep_last=3, dry_run=True)
    assert dry.dry_run and dry.oldest_kept == 8 and dry.bases_kept == [8]
    assert {i.version for i in dry.deleted if i.kind == "version"} == set(range(8))
    assert len(local.list("commits/")) == 12  # nothing deleted
    doomed = [k for k in sizes if k.startswith("commits/") and int(k[8:28]) < 8]
    doomed += [k for k in sizes if k.startswith("objects/") and int(k[8:28]) < 8]
    assert dry.deleted_objects == len(doomed)
    assert dry.deleted_bytes == sum(sizes[k] for k in doomed)

    kept_more = gc(local, keep_last=3, keep_bases=1, dry_run=True)
    assert kept_more.oldest_kept == 4 and kept_more.bases_kept == [8, 4]

    done = gc(local, keep_last=3)
    assert done.deleted_objects == dry.deleted_objects
    assert Chain(local).versions() == list(range(8, 12))
    assert all(int(k[8:28]) >= 8 for k in local.list("objects/"))
    assert verify(local, deep=True).ok
    tensors: dict[str, torch.Tensor] = {}
    assert DeltaReader(local, StateDictTarget(tensors)).sync().applied_versions == (8, 9, 10, 11)
    assert_same_bits(tensors, states[11])
    assert gc(local, keep_last=3).deleted == []  # nothing left to do
    with pytest.raises(ValueError):
        gc(local, keep_last=0)


def test_gc_can_truncate_at_an_alternative_base(local: Store) -> None:
    states = _chain(local, 10)
    stale: dict[str, torch.Tensor] = {}
    stale_reader = DeltaReader(local, StateDictTarget(stale))
    stale_reader.sync(to=4)
    compact(local, at=8)
    report = gc(local, keep_last=1)
    assert report.oldest_kept == 8 and Chain(local).versions() == [8, 9]
    assert verify(local, deep=True).ok
    # a reader whose version is gone starts again from the alternative base
    assert stale_reader.sync().applied_versions == (8, 9)
    assert_same_bits(stale, states[9])
    compact(local, at=9)
    assert gc(local, keep_last=1).oldest_kept == 9
    assert not local.exists(base_record_key(8)) and not local.list("bases/00000000000000000008")


def _crash_publish(store: Store, state: dict[str, torch.Tensor]) -> str:
    """A publish that dies while uploading its manifest: its shards stay behind."""
    state = snapshot(state)
    flip_bits(state["model.norm.weight"], torch.Generator().manual_seed(2), 2)  # some shard
    broken = copy.copy(store)
    put = store.put

    def failing_put(key: str, data: bytes) -> None:
        if key.endswith(".json") and "/manifest-" in key:
            raise RuntimeError("the trainer died")
        put(key, data)

    broken.put = failing_put  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        DeltaWriter(broken).publish(state)
    latest = Chain(store).latest()
    assert latest is not None
    prefixes = {k.split("/")[2] for k in store.list(f"objects/{latest + 1:020d}/")}
    assert len(prefixes) == 1
    return attempt_prefix(latest + 1, prefixes.pop())


def test_gc_never_deletes_a_live_attempt_and_removes_a_crashed_one(store: Store) -> None:
    states = _chain(store, 6, base_every=3)
    gen = torch.Generator().manual_seed(5)
    state = snapshot(states[-1])
    step_state(state, gen)
    crashed = _crash_publish(store, state)
    assert store.list(crashed)
    time.sleep(3.2)  # the crashed attempt ages past the grace period (S3 times are whole seconds)

    reached, resume = threading.Event(), threading.Event()
    paused = copy.copy(store)
    put = store.put

    def pausing_put(key: str, data: bytes) -> None:
        if "/manifest-" in key and not reached.is_set():
            reached.set()  # every shard of the live attempt is uploaded
            assert resume.wait(30)
        put(key, data)

    paused.put = pausing_put  # type: ignore[method-assign]
    outcome: dict[str, object] = {}

    def publish() -> None:
        try:
            outcome["info"] = DeltaWriter(paused, base_every=3).publish(state, step=99)
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        assert reached.wait(30)
        live = [k for k in store.list("objects/00000000000000000006/") if not k.startswith(crashed)]
        assert live
        report = gc(store, keep_last=2, grace=timedelta(seconds=2), commit_timeout=timedelta(0))
    finally:
        resume.set()
        thread.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert all(store.exists(k) for k in live)  # the live attempt is untouched
    assert not store.list(crashed)  # the crashed one is gone
    assert any(i.kind == "attempt" and i.reason == "never committed" for i in report.deleted)
    assert report.oldest_kept == 3 and Chain(store).versions() == [3, 4, 5, 6]
    assert outcome["info"].version == 6  # type: ignore[attr-defined]
    assert verify(store, deep=True).ok
    tensors: dict[str, torch.Tensor] = {}
    assert DeltaReader(store, StateDictTarget(tensors)).sync().version == 6
    assert_same_bits(tensors, state)


def test_gc_grace_keeps_young_orphans_until_they_age(local: Store) -> None:
    states = _chain(local, 3)
    crashed = _crash_publish(local, states[-1])
    young = gc(local, keep_last=5)
    assert young.deleted == [] and [i.reason for i in young.kept] == [
        "younger than the grace period"
    ]
    later = gc(local, keep_last=5, now=time_after(hours=2))
    assert [i.attempt for i in later.deleted] == [crashed.split("/")[2]]
    assert not local.list(crashed) and verify(local).ok
    # an attempt that lost the race for a committed version is garbage too
    loser = attempt_prefix(1, "f" * 32) + "shard-00000-00000.dcrs"
    local.put(loser, b"junk")
    report = gc(local, keep_last=5, grace=timedelta(0), commit_timeout=timedelta(0))
    assert report.deleted[0].reason == "lost the commit race or was retried"
    assert not local.exists(loser)


def test_gc_takes_its_durations_as_seconds_too(local: Store) -> None:
    """gc's grace and commit timeout may be numbers of seconds, like the writer's
    ``commit_timeout``; anything else is one clear error."""
    states = _chain(local, 3)
    crashed = _crash_publish(local, states[-1])
    with pytest.raises(GraceTooShortError, match="grace of 60 s"):
        gc(local, keep_last=5, grace=60)
    kept = gc(local, keep_last=5, grace=7200, commit_timeout=60.0, now=time_after(hours=1))
    assert kept.deleted == [] and [i.reason for i in kept.kept] == ["younger than the grace period"]
    later = gc(local, keep_last=5, grace=3600, commit_timeout=60, now=time_after(hours=2))
    assert [i.attempt for i in later.deleted] == [crashed.split("/")[2]]
    for bad in ("1h", True, float("inf")):
        with pytest.raises(ArgumentError, match="grace"):
            gc(local, keep_last=5, grace=bad)  # type: ignore[arg-type]


def time_after(**kwargs: float):  # type: ignore[no-untyped-def]
    from dcr_format.chain.chain import utc_now

    return utc_now() + timedelta(**kwargs)


def test_parse_duration() -> None:
    assert parse_duration("90s") == timedelta(seconds=90)
    assert parse_duration("15m") == timedelta(minutes=15)
    assert parse_duration("2h") == parse_duration("120m")
    assert parse_duration("0") == timedelta(0)
    assert parse_duration("1.5d") == timedelta(hours=36)
    with pytest.raises(ValueError):
        parse_duration("soon")


# --- doctor and plot --------------------------------------------------------------------------


def test_doctor_reports_capabilities(store: Store) -> None:
    _chain(store, 1)
    report = doctor(store, large_bytes=(1 << 20) + 7)
    checks = {c.name: c for c in report.checks}
    assert report.ok and report.chain_id == Chain(store).header.chain_id
    for name in ("atomic-create", "put", "read-after-write", "list-after-write", "delete"):
        assert checks[name].ok, checks[name]
    assert checks["large-put"].ok and checks["object-ages"].ok
    verdicts = {v.use: v.safe for v in report.verdicts}
    assert verdicts == {
        "readers": True,
        "single writer": True,
        "multiple writers": True,
        "gc": True,
    }
    assert not store.list("doctor/")  # probes are cleaned up


def test_plot_writes_a_png_of_the_expected_size(local: Store, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    _chain(local, 5, base_every=3)
    out = tmp_path / "chain.png"
    data = plot(local, out, dpi=50)
    assert data.rows[:3] == ["layer 0", "layer 1", "layer 2"]
    assert "lm_head.weight" in data.rows and len(data.versions) == 5
    assert data.change_rate[0][0] is None and data.change_rate[0][3] is None  # bases
    assert all(v is not None for v in data.change_rate[0][1:3])
    image = matplotlib.image.imread(str(out))
    height = 5.0 + min(0.22 * len(data.rows), 12.0)
    assert image.shape[:2] == (round(height * 50), 500)
