"""Failures: every one is refused with a named error and leaves the target exactly as it was."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_same_bits,
    bits,
    dir_snapshot,
    flip_bits,
    make_state,
    run_ranks,
    snapshot,
    step_state,
)
from safetensors.torch import load_file, save_file

import dcr_format.sync._diagnose as diagnose_module
import dcr_format.targets.protocol as targets_module
from dcr_format import (
    DcrError,
    DeltaReader,
    DeltaWriter,
    SafetensorsDirTarget,
    StateDictTarget,
    Store,
    TargetError,
    ThreadCoordinator,
    owner,
)
from dcr_format.chain.chain import Chain, attempt_prefix, commit_key, manifest_key
from dcr_format.errors import (
    ApplyError,
    ArgumentError,
    BaselineMismatchError,
    ChainBrokenError,
    ChecksumMismatchError,
    CommitConflictError,
    FingerprintMismatchError,
    IncompleteVersionError,
    MissingTensorError,
    ObjectNotFoundError,
    StoreNotInitializedError,
    UnsupportedDtypeError,
    VersionNotFoundError,
)
from dcr_format.targets.directory import SINGLE_FILE


@dataclass
class _Setup:
    """A chain of versions and a target synced to one of them."""

    store_url: str
    writer: DeltaWriter
    states: list[dict[str, torch.Tensor]]
    target: StateDictTarget | SafetensorsDirTarget
    path: Path | None  # the dir target's path

    @property
    def store(self) -> Store:
        return Store(self.store_url)

    def reader(self, **options) -> DeltaReader:
        return DeltaReader(self.store_url, self.target, **options)

    def capture(self):
        resident = self.target.resident()
        if self.path is not None:
            return resident, dir_snapshot(self.path)
        return resident, snapshot(self.target.tensors)

    def assert_unchanged(self, before) -> None:
        resident, content = before
        assert self.target.resident() == resident
        if self.path is not None:
            assert dir_snapshot(self.path) == content
        else:
            assert_same_bits(self.target.tensors, content)

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.path is not None:
            return load_file(str(self.path / SINGLE_FILE))
        return self.target.tensors

    def changed_between(self, old: int, new: int) -> list[str]:
        a, b = self.states[old], self.states[new]
        return sorted(n for n in a if not torch.equal(bits(a[n]), bits(b[n])))


def _setup(store_url, tmp_path, kind, *, versions=6, at=2, seed=0, **writer_options) -> _Setup:
    gen = torch.Generator().manual_seed(seed)
    state = make_state(seed)
    writer = DeltaWriter(store_url, **writer_options)
    states = []
    for version in range(versions):
        if version:
            step_state(state, gen)
        writer.publish(state)
        states.append(snapshot(state))
    path = tmp_path / "ckpt" if kind == "dir" else None
    target = SafetensorsDirTarget(path) if path is not None else StateDictTarget({})
    setup = _Setup(store_url, writer, states, target, path)
    setup.reader().sync(to=at)
    return setup


@pytest.fixture(params=["dict", "dir"])
def kind(request) -> str:
    return request.param


def _finish(setup: _Setup) -> None:
    """After the failure, a clean sync still reaches the newest version bit-exactly."""
    setup.reader().sync()
    assert setup.target.resident().version == len(setup.states) - 1
    assert_same_bits(setup.tensors(), setup.states[-1])


# --- target edited outside dcr -----------------------------------------------------------------


def _count_applies(monkeypatch) -> list[int]:
    calls = [0]
    original = targets_module.apply_change

    def counting(tensor, delta, **options):
        calls[0] += 1
        return original(tensor, delta, **options)

    monkeypatch.setattr(targets_module, "apply_change", counting)
    return calls


def test_edited_state_dict_is_refused_before_anything_changes(store_url, tmp_path, monkeypatch):
    setup = _setup(store_url, tmp_path, "dict")
    name = setup.changed_between(2, 3)[0]
    flip_bits(setup.target.tensors[name], torch.Generator().manual_seed(99), 1)
    before = setup.capture()
    applies = _count_applies(monkeypatch)
    with pytest.raises(BaselineMismatchError, match="not the bits of version 2; it was changed"):
        setup.reader().sync()
    assert applies == [0]
    setup.assert_unchanged(before)


def test_edit_of_a_tensor_changed_only_by_a_later_version_is_a_baseline_mismatch(
    store_url, tmp_path, monkeypatch
):
    setup = _setup(store_url, tmp_path, "dict", versions=8)
    later = set().union(*(setup.changed_between(v, v + 1) for v in range(3, 7)))
    names = sorted(later - set(setup.changed_between(2, 3)))
    assert names, "no tensor is quiet in version 3 and changed later; pick another seed"
    flip_bits(setup.target.tensors[names[0]], torch.Generator().manual_seed(99), 1)
    before = setup.capture()
    applies = _count_applies(monkeypatch)
    with pytest.raises(BaselineMismatchError):
        setup.reader().sync()
    assert applies == [0]
    setup.assert_unchanged(before)


def test_edited_unchanged_tensor_is_caught_by_verify_all(store_url, tmp_path):
    setup = _setup(store_url, tmp_path, "dict")
    quiet = sorted(set(setup.states[2]) - set(setup.changed_between(2, 3)))
    assert quiet, "the chain changed every tensor; pick another seed"
    flip_bits(setup.target.tensors[quiet[0]], torch.Generator().manual_seed(99), 1)
    before = setup.capture()
    with pytest.raises(BaselineMismatchError, match="not the bits of version 2; it was changed"):
        setup.reader(verify="all").sync(to=3)
    setup.assert_unchanged(before)


def test_edited_checkpoint_directory_is_refused(store_url, tmp_path):
    setup = _setup(store_url, tmp_path, "dir")
    name = setup.changed_between(2, 3)[0]
    file = setup.path / SINGLE_FILE
    tensors = load_file(str(file))
    flip_bits(tensors[name], torch.Generator().manual_seed(99), 1)
    save_file(tensors, str(file), metadata={"format": "pt"})  # through the link
    before = setup.capture()
    with pytest.raises(BaselineMismatchError):
        setup.reader().sync()
    setup.assert_unchanged(before)


# --- damaged store ---------------------------------------------------------------------------


def _flip_byte(store: Store, key: str) -> None:
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01
    store.put(key, bytes(data))


def _shards(store: Store, version: int) -> list[str]:
    chain = Chain(store)
    keys = [s.path for m in chain.manifests(chain.record(version)) for s in m.shards]
    assert keys, f"version {version} has no shard"
    return keys


def _rewrite_record(store: Store, version: int, **changes) -> None:
    raw = json.loads(store.get(commit_key(version)))
    raw.update(changes)
    store.put(commit_key(version), json.dumps(raw, separators=(",", ":")).encode())


def _delete_shard(store: Store, version: int) -> None:
    store.delete(_shards(store, version)[0])


def _corrupt_shard(store: Store, version: int) -> None:
    _flip_byte(store, _shards(store, version)[-1])


def _corrupt_manifest(store: Store, version: int) -> None:
    _flip_byte(store, Chain(store).record(version).record.manifests[0].path)


def _wrong_parent_hash(store: Store, version: int) -> None:
    parent = Chain(store).record(version).record.parent_sha256
    _rewrite_record(store, version, parent_sha256=("0" if parent[0] != "0" else "1") * 64)


def _delete_manifest(store: Store, version: int) -> None:
    store.delete(Chain(store).record(version).record.manifests[0].path)


def _record_names_missing_manifest(store: Store, version: int) -> None:
    record = json.loads(store.get(commit_key(version)))
    attempt = "f" * 32
    refs = [
        {**ref, "path": manifest_key(version, attempt, ref["rank"])} for ref in record["manifests"]
    ]
    _rewrite_record(store, version, attempt=attempt, manifests=refs)


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        (_delete_shard, ObjectNotFoundError),
        (_corrupt_shard, ChecksumMismatchError),
        (_corrupt_manifest, ChecksumMismatchError),
        (_wrong_parent_hash, ChainBrokenError),
        (_delete_manifest, ObjectNotFoundError),
        (_record_names_missing_manifest, ObjectNotFoundError),
    ],
)
def test_damaged_store_is_refused_and_target_untouched(store_url, tmp_path, kind, damage, error):
    setup = _setup(store_url, tmp_path, kind)
    damage(setup.store, 4)
    before = setup.capture()
    with pytest.raises(error) as caught:
        setup.reader().sync()
    assert isinstance(caught.value, DcrError)
    setup.assert_unchanged(before)
    # the versions before the damage are still reachable
    assert setup.reader().sync(to=3).applied_versions == (3,)
    assert_same_bits(setup.tensors(), setup.states[3])


def test_missing_objects_are_file_not_found(store_url, tmp_path):
    setup = _setup(store_url, tmp_path, "dict")
    _delete_shard(setup.store, 3)
    with pytest.raises(FileNotFoundError):
        setup.reader().sync()


# --- failures during the apply -------------------------------------------------------------------


@pytest.mark.parametrize("nth", [1, 4, 12])
def test_failure_halfway_through_apply_rolls_back(store_url, tmp_path, kind, monkeypatch, nth):
    setup = _setup(store_url, tmp_path, kind, versions=7, base_every=4)
    before = setup.capture()
    original = targets_module.apply_change
    calls = 0

    def failing(tensor, delta, **options):
        nonlocal calls
        calls += 1
        if calls == nth:
            raise RuntimeError("injected failure")
        return original(tensor, delta, **options)

    monkeypatch.setattr(targets_module, "apply_change", failing)
    with pytest.raises(ApplyError):
        setup.reader().sync()  # versions 3..6, with a base at 4
    assert calls == nth
    setup.assert_unchanged(before)
    monkeypatch.undo()
    _finish(setup)


def test_failed_base_restores_replaced_dropped_and_added_tensors(store_url, monkeypatch):
    state = make_state(30)
    writer = DeltaWriter(store_url, base_every=1)
    writer.publish(state)
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    objects = dict(target.tensors)
    before = snapshot(target.tensors)
    state["lm_head.weight"] = torch.randn(8, 4)  # another shape
    state["model.norm.weight"] = state["model.norm.weight"].float()  # another dtype
    del state["model.step"]
    state["model.new.weight"] = torch.ones(3)
    writer.publish(state)
    original = targets_module.apply_change
    calls = 0

    def failing_last(tensor, delta, **options):
        nonlocal calls
        calls += 1
        if calls == len(state) - 1:  # the last write: the new tensor is its decoded values
            raise RuntimeError("injected failure")
        return original(tensor, delta, **options)

    monkeypatch.setattr(targets_module, "apply_change", failing_last)
    with pytest.raises(ApplyError):
        DeltaReader(store_url, target).sync()
    assert target.resident().version == 0
    assert target.tensors.keys() == objects.keys()
    assert all(target.tensors[n] is t for n, t in objects.items())
    assert_same_bits(target.tensors, before)
    monkeypatch.undo()
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)


def test_interrupt_during_apply_rolls_back_and_propagates(store_url, tmp_path, monkeypatch):
    setup = _setup(store_url, tmp_path, "dict")
    before = setup.capture()
    original = targets_module.apply_change
    calls = 0

    def interrupted(tensor, delta, **options):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return original(tensor, delta, **options)

    monkeypatch.setattr(targets_module, "apply_change", interrupted)
    with pytest.raises(KeyboardInterrupt):
        setup.reader().sync()
    setup.assert_unchanged(before)
    monkeypatch.undo()
    _finish(setup)


@pytest.mark.parametrize("verify", ["touched", "all"])
def test_fingerprint_mismatch_after_apply_rolls_back(
    store_url, tmp_path, kind, monkeypatch, verify
):
    setup = _setup(store_url, tmp_path, kind)
    before = setup.capture()
    applied = False
    apply_delta = targets_module.apply_change
    from_lanes = diagnose_module.fingerprint_of

    def apply_and_note(tensor, delta, **options):
        nonlocal applied
        applied = True
        return apply_delta(tensor, delta, **options)

    def wrong_lanes_after_apply(dtype, shape, lanes):
        return "0" * 32 if applied else from_lanes(dtype, shape, lanes)

    # "touched" follows the lanes through the change, "all" reads them again: both end in
    # fingerprint_of
    monkeypatch.setattr(targets_module, "apply_change", apply_and_note)
    monkeypatch.setattr(diagnose_module, "fingerprint_of", wrong_lanes_after_apply)
    with pytest.raises(FingerprintMismatchError, match="after applying; the target was rolled"):
        setup.reader(verify=verify).sync()
    assert applied
    setup.assert_unchanged(before)
    monkeypatch.undo()
    _finish(setup)


# --- requests that cannot be served --------------------------------------------------------------


def test_unknown_version_is_refused(store_url, tmp_path, kind):
    setup = _setup(store_url, tmp_path, kind)
    before = setup.capture()
    with pytest.raises(VersionNotFoundError) as caught:
        setup.reader().sync(to=99)
    assert isinstance(caught.value, LookupError)
    setup.assert_unchanged(before)


@pytest.mark.parametrize("root", ["missing", "empty"])
def test_store_without_chain_is_refused(tmp_path, root):
    url = tmp_path / "nothing"
    if root == "empty":
        url.mkdir()
    target = StateDictTarget({})
    with pytest.raises(StoreNotInitializedError, match=r"no dcr chain \(no dcr.json\); publish"):
        DeltaReader(url, target).sync()
    assert target.tensors == {} and target.resident() is None


def test_chain_without_commits_is_refused(store_url):
    assert DeltaWriter(store_url).version is None  # opening creates the header only
    with pytest.raises(VersionNotFoundError):
        DeltaReader(store_url, StateDictTarget({})).sync()
    with pytest.raises(VersionNotFoundError, match=r"version 0 is not committed in .*dcr log"):
        Chain(Store(store_url)).record(0)


def test_target_of_another_chain_is_refused(store_url, tmp_path, kind):
    setup = _setup(store_url, tmp_path, kind)
    other = str(tmp_path / "other-store")
    DeltaWriter(other).publish(make_state(5))
    before = setup.capture()
    with pytest.raises(TargetError):
        DeltaReader(other, setup.target).sync()
    setup.assert_unchanged(before)


def test_target_newer_than_goal_is_refused(store_url, tmp_path, kind):
    setup = _setup(store_url, tmp_path, kind, at=4)
    before = setup.capture()
    with pytest.raises(TargetError):
        setup.reader().sync(to=3)
    setup.assert_unchanged(before)


# --- writer failures ------------------------------------------------------------------------------


def test_publish_missing_a_tensor_commits_nothing(store_url):
    gen = torch.Generator().manual_seed(20)
    state = make_state(20)
    writer = DeltaWriter(store_url, base_every=10)
    writer.publish(state)
    step_state(state, gen)
    writer.publish(state)
    baseline = snapshot(writer.baseline)
    partial = dict(state)
    del partial["lm_head.weight"]
    step_state(state, gen)
    with pytest.raises(MissingTensorError):
        writer.publish(partial)
    assert writer.version == 1
    assert Chain(Store(store_url)).versions() == [0, 1]
    assert_same_bits(writer.baseline, baseline)
    info = writer.publish(state)
    assert (info.version, info.kind) == (2, "delta")
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)


def test_racing_writers_conflict_and_the_loser_keeps_its_baseline(store_url):
    gen = torch.Generator().manual_seed(21)
    state = make_state(21)
    first = DeltaWriter(store_url)
    for version in range(4):
        if version:
            step_state(state, gen)
        first.publish(state)
    at_three = snapshot(state)
    a, b = DeltaWriter(store_url), DeltaWriter(store_url)
    assert a.version == b.version == 3
    winner = snapshot(state)
    step_state(winner, gen)
    loser = snapshot(state)
    step_state(loser, gen)
    info = a.publish(winner)
    assert info.version == 4
    with pytest.raises(CommitConflictError) as caught:
        b.publish(loser)
    assert isinstance(caught.value, FileExistsError)
    assert b.version == 3
    assert_same_bits(b.baseline, at_three)
    store = Store(store_url)
    assert Chain(store).record(4).record.attempt == info.attempt
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, winner)
    # the loser reopens and continues from the winner's version
    reopened = DeltaWriter(store_url)
    assert reopened.version == 4
    step_state(winner, gen)
    assert reopened.publish(winner).version == 5
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, winner)


def _owned_name(prefix: str, rank: int, world: int) -> str:
    return next(f"{prefix}.{i}" for i in range(1000) if owner(f"{prefix}.{i}", world) == rank)


@pytest.mark.parametrize(("failing", "crash"), [(1, False), (0, False), (1, True)])
def test_failing_rank_leaves_version_uncommitted_and_all_ranks_recover(
    store_url, monkeypatch, failing, crash
):
    world = 3
    gen = torch.Generator().manual_seed(22)
    state = make_state(22)
    coordinator = ThreadCoordinator(world, timeout=30)
    # a crashed rank is waited for until the commit timeout; an aborting one is not waited
    # for at all, which a timeout far longer than the publish shows on a loaded machine too
    timeout = 2 if crash else 30
    writers = [
        DeltaWriter(
            store_url, rank=r, world_size=world, coordinator=coordinator, commit_timeout=timeout
        )
        for r in range(world)
    ]
    for _ in range(2):
        frozen = snapshot(state)
        results, errors = run_ranks(world, lambda r, s=frozen: writers[r].publish(s))
        assert errors == [None] * world
        step_state(state, gen)
    baselines = [snapshot(w.baseline) for w in writers]
    bad_name = _owned_name("model.bad", failing, world)
    bad = {**state, bad_name: torch.zeros(4, dtype=torch.complex64)}

    if crash:  # a rank that dies leaves no ABORTED marker: the committer times out
        monkeypatch.setattr(writers[failing], "_abort", lambda version, attempt: None)
    started = time.monotonic()
    results, errors = run_ranks(world, lambda r: writers[r].publish(bad if r == failing else state))
    assert time.monotonic() - started < (12 if crash else 15)
    monkeypatch.undo()
    for rank, error in enumerate(errors):
        expected = UnsupportedDtypeError if rank == failing else IncompleteVersionError
        assert isinstance(error, expected), (rank, error)
    store = Store(store_url)
    assert not store.exists(commit_key(2))
    assert Chain(store).versions() == [0, 1]
    assert [w.version for w in writers] == [1, 1, 1]
    for writer, baseline in zip(writers, baselines, strict=True):
        assert_same_bits(writer.baseline, baseline)

    results, errors = run_ranks(world, lambda r: writers[r].publish(state))
    assert errors == [None] * world
    assert [info.version for info in results] == [2, 2, 2]
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)
    # the abandoned attempt is marked, and its objects were kept (never deleted)
    keys = store.list(attempt_prefix(2, "x")[: -len("x/")])
    assert len({k.split("/")[2] for k in keys}) == 2
    assert sum(k.endswith("/ABORTED") for k in keys) == 1


def test_a_reopened_rank_reads_only_its_own_manifest_of_the_newest_version(
    store_url, tmp_path, monkeypatch
):
    """A job of thousands of ranks restarting from their baseline caches must not read the
    square of that many manifests: rank 0 (the committer) reads the newest version's table
    in full, every other rank only its own manifest, and the job publishes on exactly."""
    world = 3
    gen = torch.Generator().manual_seed(25)
    state = make_state(25)

    def writers() -> list[DeltaWriter]:
        coordinator = ThreadCoordinator(world, timeout=30)
        return [
            DeltaWriter(
                store_url,
                rank=r,
                world_size=world,
                coordinator=coordinator,
                cache_dir=tmp_path / "cache",
            )
            for r in range(world)
        ]

    first = writers()
    for _ in range(2):
        frozen = snapshot(state)
        _, errors = run_ranks(world, lambda r, s=frozen: first[r].publish(s))
        assert errors == [None] * world
        step_state(state, gen)
    read: list[str] = []
    original = Store.get

    def counted(self, key, **kwargs):
        read.append(key)
        return original(self, key, **kwargs)

    monkeypatch.setattr(Store, "get", counted)
    reopened = writers()
    for rank, writer in enumerate(reopened):
        read.clear()
        assert writer.version == 1  # opens the chain and restores the baseline
        manifests = sorted({k.rsplit("/", 1)[1] for k in read if "/manifest-" in k})
        assert manifests == (
            [f"manifest-{r:05d}.json" for r in range(world)]
            if rank == 0
            else [f"manifest-{rank:05d}.json"]
        ), rank
        assert_same_bits(writer.baseline, first[rank].baseline)
    monkeypatch.undo()
    _, errors = run_ranks(world, lambda r: reopened[r].publish(state))
    assert errors == [None] * world
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)


def test_ranks_that_publish_different_steps_commit_nothing(store_url):
    world = 3
    gen = torch.Generator().manual_seed(24)
    state = make_state(24)
    coordinator = ThreadCoordinator(world, timeout=30)
    writers = [
        DeltaWriter(store_url, rank=r, world_size=world, coordinator=coordinator, commit_timeout=30)
        for r in range(world)
    ]
    results, errors = run_ranks(world, lambda r: writers[r].publish(state, step=0))
    assert errors == [None] * world
    step_state(state, gen)
    baselines = [snapshot(w.baseline) for w in writers]

    started = time.monotonic()  # rank 2 is a step ahead: it abandons, and no one waits
    results, errors = run_ranks(world, lambda r: writers[r].publish(state, step=2 if r == 2 else 1))
    assert time.monotonic() - started < 15
    assert isinstance(errors[2], ArgumentError)
    assert str(errors[2]) == (
        "writer rank 2 publishes step 2 while rank 0 publishes step 1; "
        "call publish on every rank with the same step"
    )
    assert all(isinstance(e, IncompleteVersionError) for e in errors[:2]), errors
    assert Chain(Store(store_url)).versions() == [0]
    for writer, baseline in zip(writers, baselines, strict=True):
        assert writer.version == 0
        assert_same_bits(writer.baseline, baseline)

    # no step at all on every rank agrees too; then the ranks go on in step
    results, errors = run_ranks(world, lambda r: writers[r].publish(state))
    assert errors == [None] * world
    assert [info.version for info in results] == [1, 1, 1]
    assert Chain(Store(store_url)).record(1).record.step is None
    results, errors = run_ranks(world, lambda r: writers[r].publish(state, step=3))
    assert errors == [None] * world
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)


def test_rank_that_never_arrives_times_out_and_the_coordinator_recovers(store_url):
    world = 3
    state = make_state(23)
    coordinator = ThreadCoordinator(world, timeout=1)
    writers = [
        DeltaWriter(store_url, rank=r, world_size=world, coordinator=coordinator, commit_timeout=5)
        for r in range(world)
    ]
    results, errors = run_ranks(2, lambda r: writers[r].publish(state))  # rank 2 is missing
    assert all(isinstance(e, IncompleteVersionError) for e in errors)
    assert Chain(Store(store_url)).versions() == []
    results, errors = run_ranks(world, lambda r: writers[r].publish(state))
    assert errors == [None] * world
    assert [info.version for info in results] == [0, 0, 0]


def _commit_puts(monkeypatch, *, land: bool, times: int) -> list[int]:
    """Make creating a commit record fail ``times`` times with a store error."""
    from dcr_format import StoreError

    calls = [0]
    original = Store.put_if_absent

    def put_if_absent(store, key, data):
        if key.startswith("commits/") and calls[0] < times:
            calls[0] += 1
            if land:
                original(store, key, data)  # the request landed, its answer was lost
            raise StoreError("injected: connection reset")
        return original(store, key, data)

    monkeypatch.setattr(Store, "put_if_absent", put_if_absent)
    return calls


def test_lost_commit_answer_is_resolved_by_rereading(store_url, monkeypatch):
    state = make_state(24)
    writer = DeltaWriter(store_url)
    writer.publish(state)
    calls = _commit_puts(monkeypatch, land=True, times=1)
    info = writer.publish(state)
    assert calls == [1]
    assert info.version == writer.version == 1
    assert Chain(Store(store_url)).record(1).record.attempt == info.attempt


def test_unknown_commit_outcome_keeps_the_attempt(store_url, monkeypatch):
    from dcr_format.errors import CommitStateUnknownError

    gen = torch.Generator().manual_seed(25)
    state = make_state(25)
    writer = DeltaWriter(store_url)
    writer.publish(state)
    baseline = snapshot(writer.baseline)
    step_state(state, gen)
    _commit_puts(monkeypatch, land=False, times=2)
    with pytest.raises(CommitStateUnknownError) as caught:
        writer.publish(state)
    assert isinstance(caught.value, TimeoutError)
    assert writer.version == 0
    assert_same_bits(writer.baseline, baseline)
    store = Store(store_url)
    kept = store.list(attempt_prefix(1, "x")[: -len("x/")])
    assert any("/manifest-" in k for k in kept), "the attempt's objects were deleted"
    monkeypatch.undo()
    assert writer.publish(state).version == 1
    target = StateDictTarget({})
    DeltaReader(store_url, target).sync()
    assert_same_bits(target.tensors, state)


def test_target_with_a_tensor_the_version_lacks_is_refused(store_url, tmp_path):
    setup = _setup(store_url, tmp_path, "dict", versions=3, at=0)
    chain_id = setup.writer.chain.header.chain_id
    target = StateDictTarget(
        {**snapshot(setup.states[0]), "stray": torch.ones(2)}, version=0, chain_id=chain_id
    )
    before = snapshot(target.tensors)
    with pytest.raises(TargetError):
        DeltaReader(store_url, target).sync()
    assert target.resident().version == 0
    assert_same_bits(target.tensors, before)
    # a reader that selects only the chain's names leaves the stray tensor alone
    DeltaReader(store_url, target, select=lambda name: name != "stray").sync()
    assert_same_bits({n: t for n, t in target.tensors.items() if n != "stray"}, setup.states[2])
