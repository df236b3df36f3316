"""Crash safety with real processes: writers and readers SIGKILLed at every stage.

A writer process (two ranks in threads) or a reader process kills itself with
SIGKILL at a named stage (tests/crash_workers.py); stages that must die with a
request on the wire are killed by the fault proxy as the request passes. After
each kill:

- writers: a reader that synced all along saw only committed versions, bit for
  bit; a restarted writer recovers its baseline from the chain (or its cache)
  and publishes the next version correctly; ``gc`` with no grace removes the
  orphans; ``verify(deep=True)`` passes;
- readers: the safetensors directory is exactly the old or the new version,
  never a mix, and the next sync completes.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import assert_same_bits, dir_snapshot

from dcr_format import DcrError, DeltaReader, SafetensorsDirTarget, StateDictTarget, Store
from dcr_format.chain.chain import Chain
from dcr_format.store.store import TEMP_PREFIX
from dcr_format.testing.faultproxy import FaultProxy, Rule
from dcr_format.tools import gc, verify

sys.path.insert(0, str(Path(__file__).parent))
import crash_workers
from crash_workers import (
    FILE_BYTES,
    PROXY_STAGES,
    READER_STAGES,
    WRITER_STAGES,
    model,
    publish_ranks,
)

pytestmark = [pytest.mark.s3, pytest.mark.multiprocess, pytest.mark.slow]

COMMITTED_AT = {"during-commit", "after-commit", "mid-cache-save"}  # the killed version landed
# On S3 the stages killed in flight by the proxy run always; the others (killed by the same
# store-level hooks as on a local store) only with $DCR_CRASH_ALL_S3, to keep CI short.
ALL_ON_S3 = bool(os.environ.get("DCR_CRASH_ALL_S3"))


@pytest.fixture(scope="module")
def context():
    from dcr_format.testing.soak import worker_context

    return worker_context()


@pytest.fixture(scope="module")
def proxy(moto_server):
    with FaultProxy(moto_server.endpoint) as running:
        yield running


@pytest.fixture(params=["local", "moto"])
def backend(request, tmp_path):
    """(url, storage options for the worker, storage options for the test)."""
    if request.param == "local":
        yield str(tmp_path / "store"), None, None
        return
    server = request.getfixturevalue("moto_server")
    proxy = request.getfixturevalue("proxy")
    with server.fresh_root() as root:
        through = {**server.storage_options(), "endpoint_url": proxy.endpoint}
        yield root, through, server.storage_options()
    proxy.remove_rules()


def _open(url: str, options) -> Store:
    return Store(url, storage_options=options) if options else Store(url)


class _Watcher:
    """A reader syncing in a thread all along: every version it lands on must be exact."""

    def __init__(self, store: Store) -> None:
        self.store, self.seen, self.wrong, self.errors = store, [], [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        tensors: dict = {}
        reader = DeltaReader(self.store, StateDictTarget(tensors))
        while not self._stop.is_set():
            try:
                version = reader.sync().version
            except DcrError as exc:  # refused (a version half-published is not committed)
                self.errors.append(type(exc).__name__)
                continue
            if not self.seen or self.seen[-1] != version:
                self.seen.append(version)
                try:
                    assert_same_bits(tensors, model(version))
                except AssertionError:
                    self.wrong.append(version)
            self._stop.wait(0.02)

    def __enter__(self) -> _Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _orphans(store: Store) -> list[str]:
    """Objects under objects/ that no commit record names."""
    chain = Chain(store)
    committed = {v: chain.record(v).record.attempt for v in chain.versions()}
    found = []
    for key in store.list("objects/"):
        _, version, attempt, _ = key.split("/", 3)
        if committed.get(int(version)) != attempt:
            found.append(key)
    return found


def _temp_files(url: str) -> list[Path]:
    if url.startswith("s3://"):
        return []
    return sorted(p for p in Path(url).rglob(TEMP_PREFIX + "*"))


@pytest.mark.parametrize("stage", list(WRITER_STAGES))
def test_writer_killed_at_every_stage(context, backend, stage, tmp_path, reliability, proxy):
    url, worker_options, options = backend
    if url.startswith("s3://") and stage not in PROXY_STAGES and not ALL_ON_S3:
        pytest.skip("the same store-level hook as on a local store; DCR_CRASH_ALL_S3=1 runs it")
    store = _open(url, options)
    for version in range(2):
        publish_ranks(store, version, model(version), cache_dir=str(tmp_path / "cache"))
    crashing = 2
    process_box: list = []
    if url.startswith("s3://") and stage in PROXY_STAGES:
        kind, key = PROXY_STAGES[stage]
        proxy.add(
            Rule(
                fault="callback",
                kinds=(kind,),
                key=key,
                times=1,
                after=stage == "during-commit",  # the commit reaches the server first
                action=lambda request: os.kill(process_box[0].pid, signal.SIGKILL),
            )
        )
    with _Watcher(_open(url, options)) as watcher:
        process = context.Process(
            target=crash_workers.writer,
            args=(url, worker_options, str(tmp_path / "cache"), stage),
        )
        process_box.append(process)
        process.start()
        process.join(120)
        assert process.exitcode == -signal.SIGKILL, f"the worker did not die at {stage}"
    proxy.remove_rules()

    # readers saw committed versions only, bit for bit
    expected = crashing if stage in COMMITTED_AT else crashing - 1
    assert Chain(store).versions() == list(range(expected + 1))
    assert not watcher.wrong, f"a reader held wrong bits at versions {watcher.wrong}"
    assert set(watcher.seen) <= set(range(expected + 1))
    tensors: dict = {}
    DeltaReader(store, StateDictTarget(tensors)).sync()
    assert_same_bits(tensors, model(expected))

    # a restarted writer recovers its baseline and publishes the next version correctly
    publish_ranks(store, expected + 1, model(expected + 1), cache_dir=str(tmp_path / "cache"))
    DeltaReader(store, StateDictTarget(tensors)).sync()
    assert_same_bits(tensors, model(expected + 1))

    # gc with no grace removes every orphan; the chain verifies deep
    orphans = _orphans(store)
    if stage in ("mid-shard", "some-manifests", "before-commit"):
        assert orphans, "the killed attempt left nothing behind"
    if url.startswith("s3://"):
        report = gc(store, keep_last=100, grace=timedelta(0), commit_timeout=timedelta(0))
        checked = verify(store, deep=True)
    else:  # the commands themselves: dcr gc, dcr verify --deep
        from click.testing import CliRunner

        from dcr_format.cli.main import cli
        from dcr_format.tools import GcReport, VerifyReport

        runner = CliRunner()
        done = runner.invoke(
            cli,
            [
                "gc",
                "--store",
                url,
                "--keep-last",
                "100",
                "--format",
                "json",
                "--grace",
                "0s",
                "--commit-timeout",
                "0",
            ],
        )
        assert done.exit_code == 0, done.output
        report = GcReport.model_validate_json(done.output)
        done = runner.invoke(cli, ["verify", "--store", url, "--deep", "--format", "json"])
        assert done.exit_code == 0, done.output
        checked = VerifyReport.model_validate_json(done.output)
    assert report.deleted_objects == len(orphans)
    assert _orphans(store) == []
    assert _temp_files(url) == [], "gc left a crashed write's temporary file"
    assert checked.ok, checked.problems
    assert checked.replayed_versions == expected + 2
    where = "local" if not url.startswith("s3://") else "moto"
    reliability.record(
        "crash: writer SIGKILL",
        f"{WRITER_STAGES[stage]} ({where})",
        "readers exact; restart publishes next; gc removes orphans; verify --deep ok",
    )


def _reader_setup(store_url: str, tmp_path: Path, *, fresh: bool) -> tuple[Path, int]:
    for version in range(5):
        publish_ranks(Store(store_url), version, model(version))
    path = tmp_path / "a" / "ckpt"
    path.parent.mkdir()
    if not fresh:
        DeltaReader(store_url, SafetensorsDirTarget(path, max_file_bytes=FILE_BYTES)).sync(to=2)
        (path / "config.json").write_text('{"model_type": "toy"}')
    return path, 4


def _dir_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    tensors: dict = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _synced_copy(store_url: str, path: Path, tmp_path: Path) -> dict[str, bytes]:
    """The files of ``path`` after a clean sync, made on a copy."""
    copy = tmp_path / "b"
    shutil.copytree(path.parent, copy, symlinks=True)
    target = SafetensorsDirTarget(copy / path.name, max_file_bytes=FILE_BYTES)
    DeltaReader(store_url, target).sync()
    return dir_snapshot(copy / path.name)[1]


@pytest.mark.parametrize(
    ("stage", "fresh"),
    [(stage, False) for stage in READER_STAGES] + [("mid-files", True), ("before-swap", True)],
)
def test_reader_killed_at_every_stage(context, store_url, tmp_path, stage, fresh, reliability):
    path, latest = _reader_setup(store_url, tmp_path, fresh=fresh)
    old = dir_snapshot(path)[1]
    new = _synced_copy(store_url, path, tmp_path)
    assert old != new
    process = context.Process(target=crash_workers.reader, args=(store_url, None, str(path), stage))
    process.start()
    process.join(120)
    assert process.exitcode == -signal.SIGKILL, f"the worker did not die at {stage}"

    after = dir_snapshot(path)[1]
    assert after in (old, new), "the directory is a mix of two versions"
    assert after == (new if stage == "after-swap" else old)
    if after:
        held = SafetensorsDirTarget(path).resident().version
        assert_same_bits(_dir_tensors(path), model(held))

    # the next sync completes and cleans up what the crash left
    target = SafetensorsDirTarget(path, max_file_bytes=FILE_BYTES)
    DeltaReader(store_url, target).sync()
    assert target.resident().version == latest
    assert dir_snapshot(path)[1] == new
    # what the crash left is removed by the next sync that applies a version (one with
    # nothing to apply leaves the target alone, stale directories included)
    publish_ranks(Store(store_url), latest + 1, model(latest + 1))
    DeltaReader(store_url, target).sync()
    assert_same_bits(_dir_tensors(path), model(latest + 1))
    versioned = list((path.parent / f".{path.name}.dcr").iterdir())
    assert versioned == [path.resolve()], versioned
    reliability.record(
        "crash: reader SIGKILL (safetensors dir)",
        READER_STAGES[stage] + (" (first sync)" if fresh else ""),
        "directory exactly old" if after == old else "directory exactly new",
    )


def test_gc_removes_only_stale_temporary_files(store_url, reliability):
    """A killed local write leaves a .dcr-tmp- file (FORMAT.md §2.5); gc removes those older
    than the grace period and leaves younger ones (a write may still be in flight)."""
    publish_ranks(Store(store_url), 0, model(0))
    directory = Path(store_url) / "objects" / "00000000000000000001" / ("a" * 32)
    directory.mkdir(parents=True)
    stale, fresh = (
        directory / f"{TEMP_PREFIX}{'1' * 32}",
        Path(store_url) / f"{TEMP_PREFIX}{'2' * 32}",
    )
    stale.write_bytes(b"half a shard")
    fresh.write_bytes(b"in flight")
    hours_ago = stale.stat().st_mtime - 7200
    os.utime(stale, (hours_ago, hours_ago))
    dry = gc(store_url, keep_last=10, grace=timedelta(hours=1), dry_run=True)
    assert dry.temp_files == [str(stale.relative_to(store_url))] and stale.exists()
    report = gc(store_url, keep_last=10, grace=timedelta(hours=1))
    assert report.temp_files == dry.temp_files
    assert not stale.exists() and fresh.exists()
    assert verify(store_url).ok
    reliability.record(
        "crash: writer SIGKILL",
        "temporary file of a killed local write",
        "gc removes it after the grace period, keeps younger ones",
    )
