"""gc as a pure planner plus an executor: plans built from hand-made surveys (no store), the
executor's delete order, a publish in flight, and ``dcr gc --dry-run`` printing the plan."""

from __future__ import annotations

import copy
import json
import os
import threading
import time
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import fsspec
import pytest
import torch
from click.testing import CliRunner
from conftest import make_state, step_state
from pydantic import ValidationError

from dcr_format import DeltaWriter, Store
from dcr_format.chain.chain import Chain, attempt_prefix, commit_key
from dcr_format.cli.main import cli
from dcr_format.errors import ArgumentError, ChainBrokenError, InvalidKeyError
from dcr_format.store._memory import MemoryBackend
from dcr_format.store.store import TEMP_PREFIX, ObjectInfo
from dcr_format.tools import gc, verify
from dcr_format.tools._gc import (
    CLOCK_PROBE_PREFIX,
    GcOptions,
    GcSurvey,
    StoreClock,
    confirm,
    execute,
    plan_gc,
    survey,
)

NOW = datetime(2026, 1, 1, 12, tzinfo=timezone.utc)
HOUR = timedelta(hours=1)


def _attempt(version: int) -> str:
    """The committed attempt of ``version`` in a hand-made survey."""
    return f"{version:032x}"


def _objects(
    version: int, attempt: str, *, count: int = 2, age: timedelta | None = 3 * HOUR
) -> list[ObjectInfo]:
    when = None if age is None else NOW - age
    prefix = attempt_prefix(version, attempt)
    return [ObjectInfo(f"{prefix}shard-00000-{i:05d}.dcrs", 100 + i, when) for i in range(count)]


def _commit(version: int) -> ObjectInfo:
    return ObjectInfo(commit_key(version), 500 + version, NOW - 3 * HOUR)


def _survey(
    versions: Iterable[int],
    *,
    bases: Iterable[int] = (),
    extra: Iterable[ObjectInfo] = (),
    **fields: object,
) -> GcSurvey:
    """A store holding ``versions`` (each with one committed attempt of two objects, three
    hours old) whose base commits are ``bases``, plus ``extra`` objects."""
    versions = list(versions)
    objects = [o for v in versions for o in _objects(v, _attempt(v))] + list(extra)
    return GcSurvey(
        store="memory://by-hand",
        commits=tuple(_commit(v) for v in versions),
        objects=tuple(sorted(objects)),
        base_commits=frozenset(bases),
        clock=fields.pop("clock", StoreClock(NOW, "given")),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )


def _reasons(items: Iterable[object]) -> list[tuple[str, int, str | None, str]]:
    return [(i.kind, i.version, i.attempt, i.reason) for i in items]  # type: ignore[attr-defined]


# --- the planner, from plain data ---------------------------------------------------------------


def test_plan_truncates_to_the_newest_kept_base_and_counts_the_bytes() -> None:
    found = _survey(range(10), bases={0, 4, 8})
    plan = plan_gc(found, GcOptions(keep_last=2))
    assert plan.oldest_kept == 8 and plan.bases_kept == [8] and plan.latest == 9
    commits = [i for i in plan.deleted if i.kind == "version"]
    assert [i.version for i in commits] == list(range(8))  # oldest first
    assert {i.reason for i in commits} == {"older than the oldest kept base 8"}
    attempts = [i for i in plan.deleted if i.kind == "attempt"]
    assert [(i.version, i.attempt) for i in attempts] == [(v, _attempt(v)) for v in range(8)]
    assert {i.reason for i in attempts} == {"version older than the oldest kept base 8"}
    doomed = [o for o in (*found.commits, *found.objects) if int(o.key.split("/")[1][:20]) < 8]
    assert plan.deleted_objects == len(doomed) == 8 * 3
    assert plan.deleted_bytes == sum(o.size for o in doomed)
    assert sorted(k for i in plan.deleted for k in i.keys) == sorted(o.key for o in doomed)
    assert plan.kept == [] and plan.temp_files == []
    with pytest.raises(ValidationError):
        plan.oldest_kept = 0  # type: ignore[misc]  # frozen


def test_plan_keeps_older_bases_or_the_whole_chain_without_a_base() -> None:
    found = _survey(range(10), bases={0, 4, 8})
    plan = plan_gc(found, GcOptions(keep_last=2, keep_bases=1))
    assert plan.oldest_kept == 4 and plan.bases_kept == [8, 4]
    assert max(i.version for i in plan.deleted) == 3
    assert plan_gc(found, GcOptions(keep_last=6)).oldest_kept == 4  # newest base at or before 4
    assert plan_gc(found, GcOptions(keep_last=100)).deleted == []
    # the kept range starts after the only base: nothing older than a base can go
    no_base = plan_gc(_survey(range(5, 10)), GcOptions(keep_last=1))
    assert no_base.oldest_kept == 5 and no_base.bases_kept == [] and no_base.deleted == []
    # an alternative base (a base record) is a starting point too
    alternative = plan_gc(
        _survey(range(10), bases={0}, base_records={7: "c" * 32}), GcOptions(keep_last=2)
    )
    assert alternative.oldest_kept == 7 and alternative.bases_kept == [7]


def test_plan_deletes_old_orphans_and_keeps_young_or_untimed_ones() -> None:
    old, young, untimed = "1" * 32, "2" * 32, "3" * 32
    extra = [
        *_objects(10, old),
        *_objects(10, young, age=HOUR - timedelta(seconds=1)),
        *_objects(11, untimed, age=None),
    ]
    plan = plan_gc(_survey(range(10), bases={0}, extra=extra), GcOptions(keep_last=20))
    assert _reasons(plan.deleted) == [("attempt", 10, old, "never committed")]
    assert plan.deleted[0].age_seconds == 3 * 3600
    assert _reasons(plan.kept) == [
        ("attempt", 10, young, "younger than the grace period"),
        ("attempt", 11, untimed, "the store reports no time for it"),
    ]
    assert plan.kept[1].age_seconds is None
    # a shorter grace period lets the young one go; the untimed one never goes
    shorter = plan_gc(_survey(range(10), extra=extra), GcOptions(keep_last=20, grace=HOUR / 2))
    assert [i.attempt for i in shorter.deleted] == [old, young]
    assert [i.attempt for i in shorter.kept] == [untimed]


def test_plan_deletes_a_truncated_version_s_attempts_even_when_young() -> None:
    """Grace protects what may still commit; a version older than the kept base is committed
    already, so every attempt of it goes at once."""
    retried = "9" * 32
    extra = _objects(1, retried, age=timedelta(seconds=5))
    plan = plan_gc(
        _survey(range(6), bases={0, 3}, extra=extra, committed_attempts={1: _attempt(1)}),
        GcOptions(keep_last=2),
    )
    assert (1, retried) in {(i.version, i.attempt) for i in plan.deleted}
    assert plan.kept == []


def test_plan_deletes_the_loser_of_a_commit_race_and_keeps_an_unreadable_version_whole() -> None:
    loser = "f" * 32
    extra = [*_objects(4, loser), *_objects(5, loser)]
    named = {4: _attempt(4), 5: None}  # version 5's commit record cannot be read
    plan = plan_gc(
        _survey(range(6), bases={0}, extra=extra, committed_attempts=named),
        GcOptions(keep_last=10),
    )
    assert _reasons(plan.deleted) == [("attempt", 4, loser, "lost the commit race or was retried")]
    assert plan.kept == []


def test_plan_drops_the_bases_of_removed_versions_and_judges_orphan_compactions() -> None:
    record, orphan, mine, unreadable = "b" * 32, "c" * 32, "d" * 32, "e" * 32

    def base(version: int, attempt: str, age: timedelta) -> ObjectInfo:
        return ObjectInfo(f"bases/{version:020d}/{attempt}/shard-00000-00000.dcrs", 7, NOW - age)

    base_objects = (
        ObjectInfo(f"bases/{2:020d}.json", 300, NOW - 3 * HOUR),
        base(2, record, timedelta(seconds=1)),  # young, but its base goes with version 2
        ObjectInfo(f"bases/{9:020d}.json", 300, NOW),
        base(9, mine, 3 * HOUR),
        base(9, orphan, 3 * HOUR),
        base(9, "a" * 32, timedelta(seconds=1)),
        ObjectInfo(f"bases/{10:020d}.json", 300, NOW),  # a version gc cannot judge
        base(10, unreadable, 3 * HOUR),
    )
    found = _survey(
        range(12),
        bases={0, 5},
        base_objects=base_objects,
        base_records={2: record, 9: mine, 10: None},
    )
    plan = plan_gc(found, GcOptions(keep_last=2))
    assert plan.oldest_kept == 10 and plan.bases_kept == [10]
    gone = [i for i in plan.deleted if i.kind in ("base", "base-attempt")]
    assert _reasons(gone) == [
        ("base", 2, None, "its version is no longer in the chain"),
        ("base", 9, None, "its version is no longer in the chain"),
        ("base-attempt", 2, record, "its base was removed"),
        ("base-attempt", 9, "a" * 32, "its base was removed"),
        ("base-attempt", 9, orphan, "its base was removed"),
        ("base-attempt", 9, mine, "its base was removed"),
    ]
    kept_nine = plan_gc(found, GcOptions(keep_last=3))  # version 9 stays: only the orphan goes
    assert _reasons(i for i in kept_nine.deleted if i.kind == "base-attempt") == [
        ("base-attempt", 2, record, "its base was removed"),
        ("base-attempt", 9, orphan, "no base record names it"),
    ]
    assert _reasons(kept_nine.kept) == [
        ("base-attempt", 9, "a" * 32, "younger than the grace period")
    ]


def test_plan_lists_only_temporary_files_older_than_the_grace_period() -> None:
    temporary = (
        ObjectInfo(f"objects/{TEMP_PREFIX}old", 3, NOW - 2 * HOUR),
        ObjectInfo(f"{TEMP_PREFIX}young", 3, NOW - HOUR / 2),
        ObjectInfo(f"{TEMP_PREFIX}untimed", 3, None),
    )
    plan = plan_gc(_survey(range(2), temporary=temporary), GcOptions(keep_last=5))
    assert plan.temp_files == [f"objects/{TEMP_PREFIX}old"] and plan.deleted == []
    blind = plan_gc(
        _survey(range(2), temporary=temporary, clock=StoreClock(None, "none")),
        GcOptions(keep_last=5),
    )
    assert blind.temp_files == [] and blind.now is None and blind.clock == "none"


def test_plan_without_a_clock_deletes_no_attempt_but_still_truncates() -> None:
    extra = _objects(6, "1" * 32)
    found = _survey(range(6), bases={0, 3}, extra=extra, clock=StoreClock(None, "none"))
    plan = plan_gc(found, GcOptions(keep_last=2))
    assert _reasons(plan.kept) == [("attempt", 6, "1" * 32, "the store reports no time for it")]
    assert plan.oldest_kept == 3 and {i.version for i in plan.deleted} == {0, 1, 2}


def test_plan_refuses_a_chain_with_a_gap_and_bad_options() -> None:
    with pytest.raises(ChainBrokenError, match="versions are missing"):
        plan_gc(_survey([0, 1, 3]), GcOptions(keep_last=1))
    for bad in ({"keep_last": 0}, {"keep_last": 1, "keep_bases": -1}):
        with pytest.raises(ArgumentError):
            GcOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grace"):
        GcOptions(keep_last=1, grace=-HOUR)
    empty = plan_gc(_survey([]), GcOptions(keep_last=1))
    assert empty.latest is None and empty.oldest_kept is None and empty.deleted == []


def test_report_json_leaves_the_keys_out() -> None:
    plan = plan_gc(_survey(range(6), bases={0, 3}), GcOptions(keep_last=1))
    report = plan.report(dry_run=True)
    assert report.deleted_objects == plan.deleted_objects == 9
    assert report.deleted_bytes == plan.deleted_bytes and report.clock == "given"
    rows = json.loads(report.model_dump_json())["deleted"]
    assert rows and all("keys" not in row for row in rows)


# --- survey and executor against real stores ------------------------------------------------


def _publish(store: Store | str, versions: int, *, base_every: int = 3) -> None:
    gen = torch.Generator().manual_seed(0)
    state = make_state(0)
    writer = DeltaWriter(store, base_every=base_every)
    for version in range(versions):
        if version:
            step_state(state, gen)
        writer.publish(state, step=version)


class _Recording(Store):
    """A memory store that records every delete and checks the chain left after each."""

    def __init__(self) -> None:
        super().__init__(f"memory://gc-plan-{uuid.uuid4().hex}")
        self.calls: list[tuple[str, ...]] = []

    def delete(self, key: str) -> None:
        super().delete(key)
        self.calls.append((key,))
        versions = Chain(self).versions()
        assert versions == list(range(versions[0], versions[-1] + 1))  # contiguous at every step
        if key.startswith("commits/"):  # no object of a version goes before its record
            assert self.list(key.replace("commits/", "objects/").removesuffix(".json"))

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        super().delete_many(keys)
        self.calls.append(tuple(keys))


def test_survey_reads_what_the_plan_needs_and_execute_deletes_records_first() -> None:
    store = _Recording()
    _publish(store, 8)
    orphan = attempt_prefix(8, "1" * 32) + "shard-00000-00000.dcrs"
    store.put(orphan, b"orphan")
    options = GcOptions(keep_last=2, grace=timedelta(0))
    chain = Chain(store)
    found = survey(chain, options, StoreClock(None, "none"))
    assert found.versions == list(range(8)) and found.clock.source == "newest-object"
    assert found.base_commits == {6}  # read only the record of 6, the oldest kept (a base)
    plan = plan_gc(found, options)
    assert plan.oldest_kept == 6 and plan == confirm(chain, plan)
    execute(store, plan)
    deleted = [key for call in store.calls for key in call]
    assert deleted == [
        *(commit_key(v) for v in range(6)),
        *sorted(k for i in plan.deleted if i.kind == "attempt" for k in i.keys),
    ]
    assert len(store.calls) == 6 + 1  # one record at a time, then every object in one call
    assert Chain(store).versions() == [6, 7] and not store.exists(orphan)
    assert verify(store, deep=True).ok


def test_execute_deletes_only_temporary_files_inside_a_local_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _publish(root, 1)
    store = Store(root)
    stale = root / "objects" / f"{TEMP_PREFIX}{'1' * 32}"
    stale.write_bytes(b"half")
    clock = StoreClock(datetime.now(timezone.utc) + 2 * HOUR, "given")
    plan = plan_gc(survey(Chain(store), GcOptions(keep_last=1), clock), GcOptions(keep_last=1))
    assert plan.temp_files == [f"objects/{stale.name}"]
    outside = tmp_path / f"{TEMP_PREFIX}outside"
    outside.write_bytes(b"not the store's")
    for key in (f"../{outside.name}", "objects/shard-00000-00000.dcrs"):
        with pytest.raises(InvalidKeyError, match="invalid temporary file key"):
            execute(store, plan.model_copy(update={"temp_files": [key]}))
    execute(store, plan)
    assert not stale.exists() and outside.exists() and verify(store).ok
    memory = Store(f"memory://gc-plan-{uuid.uuid4().hex}")
    _publish(memory, 1)
    assert survey(Chain(memory), GcOptions(keep_last=1), StoreClock(NOW, "given")).temporary == ()


class _LeftTemporaries(MemoryBackend):
    """A memory backend that reports temporary files, as a local or S3 one does."""

    def __init__(self, url: str, temporaries: Iterable[ObjectInfo]) -> None:
        fs, path = fsspec.core.url_to_fs(url)
        super().__init__(fs, path, single_writer=False)
        self.temporaries = {i.key: i for i in temporaries}
        self.deleted: list[str] = []

    def list_temporary(self) -> list[ObjectInfo]:
        return sorted(self.temporaries.values())

    def delete_temporary(self, keys: list[str]) -> None:
        self.deleted += keys
        for key in keys:
            self.temporaries.pop(key, None)


def test_gc_finds_and_deletes_temporary_files_through_the_store_interface_alone() -> None:
    now = datetime.now(timezone.utc)
    stale = ObjectInfo(f"objects/{TEMP_PREFIX}{'1' * 32}", 4, now - 2 * HOUR)
    young = ObjectInfo(f"{TEMP_PREFIX}probe-{'2' * 32}", 1, now - HOUR / 2)
    backend = _LeftTemporaries(f"memory://gc-temporaries-{uuid.uuid4().hex}", [stale, young])
    store = Store(backend)
    assert store.local_root is None  # no directory to walk: only the interface knows them
    _publish(store, 1)
    report = gc(store, keep_last=1, dry_run=True, now=now)
    assert report.temp_files == [stale.key] and backend.deleted == []
    report = gc(store, keep_last=1, now=now)
    assert report.temp_files == [stale.key] and backend.deleted == [stale.key]
    assert store.list_temporary() == [young] and Chain(store).versions() == [0]


def _paused_publish(store: Store) -> tuple[threading.Event, threading.Event, threading.Thread]:
    """A publish of version 1 that stops once its shards are uploaded, before its manifest
    and commit record (resume it with the second event)."""
    reached, resume = threading.Event(), threading.Event()
    paused = copy.copy(store)
    put = store.put

    def pausing_put(key: str, data: bytes) -> None:
        if "/manifest-" in key and not reached.is_set():
            reached.set()
            assert resume.wait(30)
        put(key, data)

    paused.put = pausing_put  # type: ignore[method-assign]
    state = make_state(0)
    step_state(state, torch.Generator().manual_seed(1))
    thread = threading.Thread(target=DeltaWriter(paused).publish, args=(state,), daemon=True)
    thread.start()
    assert reached.wait(30)
    return reached, resume, thread


def test_a_publish_in_flight_is_kept_and_an_attempt_committed_meanwhile_is_not_deleted(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "store")
    _publish(store, 1)
    _, resume, thread = _paused_publish(store)
    try:
        live = store.list(f"objects/{1:020d}/")
        assert live
        chain = Chain(store)
        # on the store's real clock the attempt is seconds old: the plan keeps it
        options = GcOptions(keep_last=5)
        plan = plan_gc(survey(chain, options, StoreClock(None, "none")), options)
        assert [(i.version, i.reason) for i in plan.kept] == [(1, "younger than the grace period")]
        assert plan.deleted == []
        # a clock two hours ahead makes it look abandoned; it commits before the executor runs
        later = StoreClock(datetime.now(timezone.utc) + 2 * HOUR, "given")
        stale = plan_gc(survey(chain, options, later), options)
        assert [(i.version, i.reason) for i in stale.deleted] == [(1, "never committed")]
    finally:
        resume.set()
        thread.join(30)
    assert Chain(store).versions() == [0, 1]
    confirmed = confirm(Chain(store), stale)
    assert confirmed.deleted == []  # committed with that very attempt since the listing
    execute(store, confirmed)
    assert all(store.exists(k) for k in live) and verify(store, deep=True).ok


# --- dcr gc --dry-run ----------------------------------------------------------------------------


def _run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_cli_dry_run_prints_the_plan_as_a_table_and_deletes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _publish(root, 5)
    store = Store(root)
    young = attempt_prefix(5, "7" * 32) + "shard-00000-00000.dcrs"
    store.put(young, b"in flight")
    crashed_probe = f"{CLOCK_PROBE_PREFIX}{'0' * 32}"  # a probe a crashed gc left
    store.put(crashed_probe, b"probe")
    hours_ago = time.time() - 7200
    os.utime(root / crashed_probe, (hours_ago, hours_ago))
    (root / "objects" / f"{TEMP_PREFIX}{'2' * 32}").write_bytes(b"half")
    os.utime(root / "objects" / f"{TEMP_PREFIX}{'2' * 32}", (hours_ago, hours_ago))
    before = _listing(root)

    lines = _run("gc", "--store", str(root), "--keep-last", "2", "--dry-run").splitlines()
    header = lines[0].split()
    assert header == ["action", "what", "version", "attempt", "reason", "objects", "bytes", "age"]
    rows = [line.split() for line in lines[1:] if line.startswith(("delete", "keep"))]
    assert [r[:4] for r in rows if r[1] == "commit"] == [
        ["delete", "commit", "record", str(v)] for v in range(3)
    ]
    assert any(r[:4] == ["keep", "attempt", "5", "7" * 32] for r in rows)
    assert "would delete 1 temporary files of crashed writes" in lines
    assert lines[-1].startswith("would delete 9 objects") and "keeps versions 3..4" in lines[-1]
    assert _listing(root) == before  # nothing deleted, not even the crashed gc's probe

    report = json.loads(
        _run("gc", "--store", str(root), "--keep-last", "2", "--dry-run", "--format", "json")
    )
    assert report["dry_run"] and report["deleted_objects"] == 9 and report["oldest_kept"] == 3
    assert [i["attempt"] for i in report["kept"]] == ["7" * 32]
    assert _listing(root) == before

    done = _run("gc", "--store", str(root), "--keep-last", "2")
    assert "deleted the commit record of version 0" in done
    assert Chain(store).versions() == [3, 4] and store.exists(young)
    assert not store.exists(crashed_probe)
    store.delete(young)
    lines = _run("gc", "--store", str(root), "--keep-last", "2", "--dry-run").splitlines()
    assert lines[0] == "nothing to delete" and "would delete 0 objects" in lines[-1]
