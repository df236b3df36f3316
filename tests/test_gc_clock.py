"""gc measures ages on the store's clock: ``Store.list_info`` on every backend, and gc runs
whose own clock is a day off (local store with file times set by ``os.utime``; moto S3)."""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import make_state
from test_store import _GenericMemoryFileSystem

from dcr_format import DeltaWriter, Store
from dcr_format.chain.chain import Chain, attempt_prefix, utc_now
from dcr_format.cli.main import cli
from dcr_format.errors import InvalidKeyError, StoreError
from dcr_format.store.store import TEMP_PREFIX, ObjectInfo
from dcr_format.tools import _gc, gc

pytestmark = pytest.mark.s3

DAY = timedelta(days=1)


@pytest.fixture(params=["local", "memory", "fsspec", "moto"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """A fresh store on every kind of backend."""
    if request.param == "local":
        return Store(tmp_path / "store")
    if request.param == "memory":
        return Store(f"memory://gc-clock-{uuid.uuid4().hex}")
    if request.param == "fsspec":
        request.addfinalizer(_GenericMemoryFileSystem.store.clear)
        return Store(f"dcrtest://gc-clock-{uuid.uuid4().hex}")
    server = request.getfixturevalue("moto_server")
    return Store(request.getfixturevalue("moto_root"), storage_options=server.storage_options())


# --- Store.list_info ---------------------------------------------------------------------


def test_list_info_matches_list_with_sizes_and_store_times(any_store: Store) -> None:
    started = utc_now() - timedelta(seconds=2)  # S3 LastModified is whole seconds
    objects = {"a/1": b"x", "a/10/x": b"yy" * 100, "a/2": b"", "b": b"zzz"}
    for key, data in objects.items():
        any_store.put(key, data)
    infos = any_store.list_info()
    assert [i.key for i in infos] == any_store.list() == sorted(objects)
    assert all(isinstance(i, ObjectInfo) for i in infos)
    assert {i.key: i.size for i in infos} == {k: len(v) for k, v in objects.items()}
    for info in infos:
        assert info.modified is not None and info.modified.utcoffset() == timedelta(0)
        assert started <= info.modified <= utc_now() + timedelta(seconds=2)
    assert [i.key for i in any_store.list_info("a")] == ["a/1", "a/10/x", "a/2"]
    assert any_store.list_info("a/10/") == [i for i in infos if i.key == "a/10/x"]
    assert any_store.list_info("nope/") == []
    key, size, modified = infos[0]  # a tuple too, for callers that unpack
    assert (key, size, modified) == (infos[0].key, infos[0].size, infos[0].modified)
    with pytest.raises(InvalidKeyError):
        any_store.list_info("../x")


def test_local_list_info_reports_file_mtime_and_skips_temp_files(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.put("a/x", b"1")
    (tmp_path / "store" / "a" / ".dcr-tmp-crashed").write_bytes(b"partial")
    os.utime(tmp_path / "store" / "a" / "x", (1_000_000_000, 1_000_000_000))
    assert store.list_info() == [
        ObjectInfo("a/x", 1, datetime.fromtimestamp(1_000_000_000, timezone.utc))
    ]


@pytest.mark.parametrize(
    "field",
    [{"size": -1}, {"size": "12"}, {"size": None}, {"created": "yesterday"}, {"mtime": 1e30}],
)
def test_list_info_refuses_a_hostile_listing(
    field: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(f"dcrtest://hostile-{uuid.uuid4().hex}")
    store.put("k", b"1")
    find = _GenericMemoryFileSystem.find

    def hostile_find(self: Any, path: str, **kwargs: Any) -> Any:
        found = find(self, path, **kwargs)
        return {name: {**info, **field} for name, info in found.items()}

    monkeypatch.setattr(_GenericMemoryFileSystem, "find", hostile_find)
    try:
        with pytest.raises(StoreError, match="invalid entry"):
            store.list_info()
    finally:
        _GenericMemoryFileSystem.store.clear()


# --- Store.list_temporary / delete_temporary ---------------------------------------------


def test_every_backend_answers_for_its_temporary_files(any_store: Store) -> None:
    any_store.put("a/b", b"1")
    assert any_store.list_temporary() == []  # no write left one (an S3 probe deletes its own)
    any_store.delete_temporary([f"a/{TEMP_PREFIX}gone"])  # none there: not an error
    with pytest.raises(InvalidKeyError, match="not a temporary file"):
        any_store.delete_temporary(["a/b"])
    assert any_store.list() == ["a/b"]


def test_local_temporary_files_are_the_regular_files_crashed_writes_left(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root)
    store.put("a/x", b"1")
    crashed = root / "a" / f"{TEMP_PREFIX}{'1' * 32}"
    crashed.write_bytes(b"half")
    os.utime(crashed, (1000.0, 1000.0))
    (root / f"{TEMP_PREFIX}dir").mkdir()  # not a file of ours: never entered
    (root / f"{TEMP_PREFIX}dir" / f"{TEMP_PREFIX}y").write_bytes(b"no")
    outside = tmp_path / f"{TEMP_PREFIX}outside"
    outside.write_bytes(b"not the store's")
    (root / f"{TEMP_PREFIX}link").symlink_to(outside)  # a link is never one of ours
    (root / "out").symlink_to(tmp_path)
    when = datetime.fromtimestamp(1000, timezone.utc)
    assert store.list_temporary() == [ObjectInfo(f"a/{crashed.name}", 4, when)]
    store.delete_temporary([f"{TEMP_PREFIX}link"])
    assert (root / f"{TEMP_PREFIX}link").is_symlink() and outside.exists()
    with pytest.raises(InvalidKeyError, match="outside"):
        store.delete_temporary([f"out/{outside.name}"])
    with pytest.raises(InvalidKeyError, match="reserved for temporary files"):
        store.delete_temporary([f"{TEMP_PREFIX}dir/{TEMP_PREFIX}y"])
    store.delete_temporary([f"a/{crashed.name}"])
    assert not crashed.exists() and outside.exists() and store.list_temporary() == []
    assert store.list() == ["a/x"]


def test_s3_reports_and_deletes_the_probe_keys_a_crashed_process_left(
    moto_server: Any, moto_root: str
) -> None:
    store = Store(moto_root, storage_options=moto_server.storage_options())
    store.put("a/b", b"1")
    left = f"{TEMP_PREFIX}probe-{'0' * 32}"  # what a probe killed before its delete leaves
    backend: Any = store._backend  # the S3 backend: its s3fs client writes past the Store
    backend.fs.pipe_file(f"{backend.bucket}/{backend.root}{left}", b"1")
    found = store.list_temporary()
    assert [(i.key, i.size) for i in found] == [(left, 1)] and found[0].modified is not None
    assert store.list() == ["a/b"]
    store.delete_temporary([left])
    assert store.list_temporary() == [] and store.list() == ["a/b"]


# --- gc on the store's clock ---------------------------------------------------------------


def _publish(store: Store, versions: int) -> None:
    writer = DeltaWriter(store)
    state = make_state()
    for step in range(versions):
        state["model.step"][0] = step
        writer.publish(state, step=step)


def _attempt(store: Store, version: int) -> str:
    """An uncommitted attempt of ``version``: two shard-like objects; returns its id."""
    attempt = uuid.uuid4().hex
    for index in range(2):
        store.put(attempt_prefix(version, attempt) + f"shard-00000-{index:05d}.dcrs", b"s" * 64)
    return attempt


def _skew(monkeypatch: pytest.MonkeyPatch, offset: timedelta) -> None:
    """This machine's clock, as gc reads it, is ``offset`` off."""
    monkeypatch.setattr(_gc, "utc_now", lambda: datetime.now(timezone.utc) + offset)


def _attempts(store: Store, version: int) -> set[str]:
    return {k.split("/")[2] for k in store.list(f"objects/{version:020d}/")}


@pytest.mark.parametrize("offset", [DAY, -DAY], ids=["ahead", "behind"])
def test_skewed_gc_keeps_in_flight_attempts_and_deletes_old_orphans_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset: timedelta
) -> None:
    root = tmp_path / "store"
    store = Store(root)
    _publish(store, 2)
    old, in_flight = _attempt(store, 2), _attempt(store, 2)
    two_hours_ago = time.time() - 7200
    for key in store.list(attempt_prefix(2, old)):
        os.utime(root / key, (two_hours_ago, two_hours_ago))
    fresh_temp = root / "objects" / ".dcr-tmp-in-flight"  # a write happening now
    fresh_temp.write_bytes(b"partial")
    _skew(monkeypatch, offset)

    dry = gc(store, keep_last=5, grace=timedelta(hours=1), dry_run=True)
    assert [i.attempt for i in dry.deleted] == [old] and _attempts(store, 2) == {old, in_flight}
    report = gc(store, keep_last=5, grace=timedelta(hours=1))
    assert [i.attempt for i in report.deleted] == [old]
    assert [(i.attempt, i.reason) for i in report.kept] == [
        (in_flight, "younger than the grace period")
    ]
    assert _attempts(store, 2) == {in_flight}
    assert fresh_temp.exists() and report.temp_files == []
    assert report.clock == "store" and report.now is not None
    assert abs(report.now - datetime.now(timezone.utc)) < timedelta(minutes=1)
    assert report.clock_skew_seconds is not None
    assert abs(report.clock_skew_seconds - offset.total_seconds()) < 60
    assert 7100 < report.deleted[0].age_seconds < 7300  # type: ignore[operator]
    assert store.list("doctor/") == []  # the clock probe is gone
    assert Chain(store).versions() == [0, 1]


def test_skewed_gc_on_s3_uses_last_modified(
    moto_server: Any, moto_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(moto_root, storage_options=moto_server.storage_options())
    _publish(store, 2)
    old = _attempt(store, 2)
    time.sleep(2.1)  # LastModified is whole seconds: the old orphan is >= 2 s older
    in_flight = _attempt(store, 2)
    _skew(monkeypatch, DAY)
    report = gc(store, keep_last=5, grace=timedelta(seconds=1.5), commit_timeout=timedelta(0))
    assert [i.attempt for i in report.deleted] == [old]
    assert [i.attempt for i in report.kept] == [in_flight]
    assert _attempts(store, 2) == {in_flight}
    assert report.clock == "store" and abs(report.clock_skew_seconds - 86400) < 60  # type: ignore[operator]
    assert store.list("doctor/") == []


def test_without_a_probe_gc_ages_against_the_newest_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store gc cannot write (read-only credentials on a dry run): "now" is the newest time
    the store gave any object, which errs towards keeping."""
    root = tmp_path / "store"
    store = Store(root)
    _publish(store, 2)
    old, in_flight = _attempt(store, 2), _attempt(store, 2)
    now = time.time()
    for key in store.list():
        stamp = now - 7200 if key.startswith(attempt_prefix(2, old)) else now - 3 * 86400
        if key.startswith(attempt_prefix(2, in_flight)):
            stamp = now - 600
        os.utime(root / key, (stamp, stamp))
    put = store.put

    def read_only(key: str, data: bytes) -> None:
        if key.startswith("doctor/"):
            raise StoreError("could not write: permission denied")
        put(key, data)

    monkeypatch.setattr(store, "put", read_only)
    _skew(monkeypatch, DAY)
    report = gc(store, keep_last=5, grace=timedelta(hours=1), dry_run=True)
    assert report.clock == "newest-object" and report.clock_skew_seconds is None
    assert report.now == datetime.fromtimestamp(now - 600, timezone.utc)
    assert [i.attempt for i in report.deleted] == [old]  # 7200 - 600 s older than the newest
    assert [i.attempt for i in report.kept] == [in_flight]


def test_gc_removes_clock_probes_a_crashed_gc_left(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root)
    _publish(store, 1)
    left = _gc.CLOCK_PROBE_PREFIX + "0" * 32
    recent = _gc.CLOCK_PROBE_PREFIX + "1" * 32
    store.put(left, b"probe")
    store.put(recent, b"probe")  # a gc running right now
    an_hour_ago = time.time() - 3600
    os.utime(root / left, (an_hour_ago, an_hour_ago))
    gc(store, keep_last=1)
    assert store.list("doctor/") == [recent]


def test_cli_gc_says_when_this_clock_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    _publish(Store(store), 1)
    _skew(monkeypatch, DAY)
    result = CliRunner().invoke(cli, ["gc", "--store", str(store), "--keep-last", "1"])
    assert result.exit_code == 0, result.output
    assert "this machine's clock is 86400 s ahead of the store's" in result.output
