"""SafetensorsDirTarget under contention and in operators' hands: one sync owns the directory
(a lock, waiting or refusing by name, a SIGKILLed holder's leftovers cleaned), only what dcr
created is deleted, everything else is carried forward as it is, the reserved tensor name
``__metadata__`` is refused, and every failure to read the directory is a TargetError."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import dir_target_workers
import pytest
import torch
from conftest import assert_same_bits, dir_snapshot, make_state, snapshot, step_state
from safetensors.torch import load_file

from dcr_format import DeltaReader, DeltaWriter, SafetensorsDirTarget
from dcr_format.chain.chain import Chain
from dcr_format.errors import (
    ApplyError,
    ReservedNameError,
    SchemaError,
    TargetBusyError,
    TargetChangedError,
    TargetError,
    TargetLayoutError,
    TargetUnreadableError,
)
from dcr_format.format.schema import Manifest, check_tensor_name, parse
from dcr_format.store.store import open_store
from dcr_format.targets import directory as targets
from dcr_format.targets.change import Resident
from dcr_format.targets.directory import DIR_STATE_FILE, SINGLE_FILE

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]


def _chain(store: str, versions: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    state = make_state(seed)
    writer = DeltaWriter(store)
    states = []
    for version in range(versions):
        if version:
            step_state(state, gen)
        writer.publish(state)
        states.append(snapshot(state))
    return writer, state, gen, states


def _dressed(store: str, path: Path, *, subdirectory: bool = True) -> dict[str, bytes]:
    """Sync ``path`` and add what an operator keeps in a checkpoint directory; returns the
    files that must survive every later sync."""
    DeltaReader(store, SafetensorsDirTarget(path)).sync()
    (path / "config.json").write_text('{"model_type": "toy"}')
    (path / "tokenizer.json").write_text('{"vocab": {}}')
    if subdirectory:
        (path / "original").mkdir()
        (path / "original" / "params.json").write_text('{"dim": 16}')
    return _kept(path)


def _kept(path: Path) -> dict[str, bytes]:
    files = dir_snapshot(path)[1]
    return {
        k: v for k, v in files.items() if not k.endswith(".safetensors") and k != "dcr-state.json"
    }


def _versions(path: Path) -> list[str]:
    return sorted(p.name for p in (path.parent / f".{path.name}.dcr").iterdir())


def _intact(path: Path, kept: dict[str, bytes], state: dict[str, torch.Tensor]) -> None:
    assert path.is_symlink() and path.resolve().is_dir(), "the link dangles"
    assert _kept(path) == kept, "config, tokenizer or original/ were lost"
    assert_same_bits(load_file(str(path / SINGLE_FILE)), state)
    assert _versions(path) == [path.resolve().name]


# --- 1. one owner per directory --------------------------------------------------------------


def test_a_second_sync_at_the_moment_of_the_swap_waits_and_destroys_nothing(tmp_path, monkeypatch):
    """Reader A has written its new directory and is about to swap the link; reader B
    starts. B must wait for A (not delete A's directory) and then find nothing to do."""
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    writer, state, gen, _ = _chain(store, 1)
    kept = _dressed(store, path)
    step_state(state, gen)
    writer.publish(state)
    at_swap, fresh_dirs = threading.Event(), []

    def pause(fresh: Path) -> None:  # A, between writing and swapping
        fresh_dirs.append(fresh)
        at_swap.set()
        time.sleep(3)  # B runs meanwhile; without the lock B would delete ``fresh`` at once

    monkeypatch.setattr(targets, "_fsync_dir", dir_target_workers.at_swap(pause))
    target_a = SafetensorsDirTarget(path)
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(DeltaReader(store, target_a).sync()))
    thread.start()
    assert at_swap.wait(60)
    result_b = DeltaReader(store, SafetensorsDirTarget(path)).sync()
    thread.join(60)
    _intact(path, kept, state)  # without the lock: a dangling link, config and tokenizer gone
    assert results and results[0].applied_versions == (1,)  # type: ignore[attr-defined]
    assert result_b.version == 1 and result_b.applied_versions == ()
    assert path.resolve() == fresh_dirs[0].resolve()


def test_a_sync_that_may_not_wait_is_refused_with_the_holder(tmp_path, monkeypatch):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    writer, state, gen, _ = _chain(store, 1)
    kept = _dressed(store, path)
    step_state(state, gen)
    writer.publish(state)
    at_swap, go = threading.Event(), threading.Event()

    def pause(fresh: Path) -> None:
        at_swap.set()
        assert go.wait(60)

    monkeypatch.setattr(targets, "_fsync_dir", dir_target_workers.at_swap(pause))
    target_a = SafetensorsDirTarget(path)
    thread = threading.Thread(target=DeltaReader(store, target_a).sync)
    thread.start()
    try:
        assert at_swap.wait(60)
        holder = f"pid {os.getpid()} on {socket.gethostname()!r}"
        impatient = SafetensorsDirTarget(path, timeout=0)
        with pytest.raises(TargetBusyError, match=holder):
            DeltaReader(store, impatient).sync()
        with pytest.raises(TargetBusyError, match=holder):
            impatient.begin()
        started = time.monotonic()
        with pytest.raises(TargetBusyError, match="timeout"):
            SafetensorsDirTarget(path, timeout=0.3).resident()
        assert 0.3 <= time.monotonic() - started < 5
    finally:
        go.set()
        thread.join(60)
    _intact(path, kept, state)
    with pytest.raises(ValueError):
        SafetensorsDirTarget(path, timeout=-1)


def test_a_first_sync_that_fails_leaves_no_lock_file(tmp_path, monkeypatch):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    _, state, _, _ = _chain(store, 1)

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(SafetensorsDirTarget, "_write", full)
        with pytest.raises(ApplyError, match="No space"):
            DeltaReader(store, SafetensorsDirTarget(path)).sync()
    assert sorted(os.listdir(tmp_path)) == ["store"]  # no ckpt, no .ckpt.dcr.lock
    DeltaReader(store, SafetensorsDirTarget(path)).sync()  # the next try starts afresh
    assert_same_bits(load_file(str(path / SINGLE_FILE)), state)
    assert (tmp_path / ".ckpt.dcr.lock").exists()  # a made directory keeps its lock file


def test_a_sync_waiting_on_a_removed_lock_file_locks_the_new_one(tmp_path):
    path = tmp_path / "ckpt"
    first = SafetensorsDirTarget(path)._acquire(exclusive=True)
    assert first is not None
    taken: list[object] = []
    waiter = SafetensorsDirTarget(path, timeout=30)
    thread = threading.Thread(target=lambda: taken.append(waiter._acquire(exclusive=True)))
    thread.start()
    time.sleep(0.3)  # the waiter has opened the lock file and waits for its lock
    SafetensorsDirTarget(path)._release(first)  # a first sync that failed: the file goes
    thread.join(30)
    second = taken[0]
    assert isinstance(second, targets._Lock) and second.fd is not None
    assert targets._is_file(second.fd, tmp_path / ".ckpt.dcr.lock")
    with pytest.raises(TargetBusyError):  # one holder: a third sync waits for the waiter
        SafetensorsDirTarget(path, timeout=0)._acquire(exclusive=True)
    second.release()


def test_a_filesystem_whose_files_change_identity_still_gives_a_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(targets, "_is_file", lambda fd, path: False)
    lock = SafetensorsDirTarget(tmp_path / "ckpt", timeout=1)._acquire(exclusive=True)
    assert isinstance(lock, targets._Lock) and lock.fd is not None  # no endless relocking
    lock.release()


def test_a_sync_planned_before_another_committed_is_refused_by_name(tmp_path):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    writer, state, gen, _ = _chain(store, 1)
    kept = _dressed(store, path)
    step_state(state, gen)
    writer.publish(state)
    late = SafetensorsDirTarget(path)
    assert late.resident().version == 0  # B plans from version 0 ...
    DeltaReader(store, SafetensorsDirTarget(path)).sync()  # ... A moves the directory to 1
    with pytest.raises(TargetChangedError, match=r"from version 0 to version 1.*sync again"):
        late.begin()  # B's plan no longer fits: refused before anything is touched
    _intact(path, kept, state)
    assert DeltaReader(store, late).sync().applied_versions == ()  # the lock was released
    txn = late.begin()
    with pytest.raises(TargetError, match="already open"):
        late.begin()
    txn.abort()
    late.begin().abort()


@pytest.fixture(scope="module")
def context():
    from dcr_format.testing.soak import worker_context

    return worker_context()


def _wait_for(paths: list[Path], procs: list) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in paths):
        assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
        assert time.monotonic() < deadline, "the pull processes are stuck"
        time.sleep(0.01)


def test_concurrent_pull_processes_leave_one_intact_directory(context, tmp_path):
    """Three `dcr pull --into` at once, twice: exactly one applies each round's versions,
    the others wait for it and find nothing to do (or plan again), and the directory is
    intact. An 8 MiB tensor makes each write long enough for the syncs to overlap."""
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    gen = torch.Generator().manual_seed(0)
    state = make_state(0)
    state["model.big.weight"] = torch.randn(2048, 2048, generator=gen).bfloat16()
    writer = DeltaWriter(store)
    writer.publish(state)
    kept = _dressed(store, path, subdirectory=False)  # the race alone
    signals = tmp_path / "signals"
    signals.mkdir()
    count, rounds = 3, 2
    procs = [
        context.Process(
            target=dir_target_workers.pull_rounds,
            args=(store, str(path), str(signals), index, rounds),
        )
        for index in range(count)
    ]
    for proc in procs:
        proc.start()
    try:
        for round_ in range(rounds):
            for _ in range(2):
                step_state(state, gen)
                writer.publish(state)
            _wait_for([signals / f"ready-{round_}-{i}" for i in range(count)], procs)
            (signals / f"go-{round_}").touch()
            done = [signals / f"done-{round_}-{i}" for i in range(count)]
            _wait_for(done, procs)
            outputs = [d.read_text().split() for d in done]
            latest = 2 + 2 * round_
            assert all(o[0] == str(latest) for o in outputs), outputs
            assert sum(o[1] != "0" for o in outputs) >= 1, outputs
            _intact(path, kept, state)
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join(60)


def test_a_sigkilled_holder_releases_the_directory_and_its_leftovers_are_removed(context, tmp_path):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    writer, state, gen, _ = _chain(store, 1)
    kept = _dressed(store, path)
    before = snapshot(state)
    step_state(state, gen)
    writer.publish(state)
    ready = tmp_path / "ready"
    proc = context.Process(
        target=dir_target_workers.hold_before_swap, args=(store, str(path), str(ready))
    )
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() or not ready.read_text():
            assert proc.exitcode is None, proc.exitcode
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dead_dir = Path(ready.read_text())
        with pytest.raises(TargetBusyError, match=f"pid {proc.pid} "):
            SafetensorsDirTarget(path, timeout=0).begin()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert dead_dir.is_dir()  # the dead sync's complete directory, never swapped in
    _intact_old = SafetensorsDirTarget(path, timeout=0)
    assert _intact_old.resident().version == 0
    assert_same_bits(load_file(str(path / SINGLE_FILE)), before)
    result = DeltaReader(store, SafetensorsDirTarget(path, timeout=0)).sync()
    assert result.applied_versions == (1,)
    assert not dead_dir.exists()
    _intact(path, kept, state)


# --- 2. delete only what dcr created, carry everything else -----------------------------------


@pytest.mark.parametrize("when", ["before the first sync", "after a sync"])
def test_a_linked_sidecar_is_refused_and_the_other_disk_is_untouched(tmp_path, when):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    _chain(store, 2)
    bigdisk = tmp_path / "bigdisk"
    bigdisk.mkdir()
    (bigdisk / "datasets").mkdir()
    (bigdisk / "datasets" / "train.jsonl").write_text("{}\n")
    (bigdisk / "v00000000000000000009-0badf00d").mkdir()  # even a dcr-looking name
    sidecar = tmp_path / ".ckpt.dcr"
    if when == "after a sync":
        DeltaReader(store, SafetensorsDirTarget(path)).sync(to=0)
        for child in sidecar.iterdir():  # the operator moves the sidecar to a bigger disk
            os.rename(child, bigdisk / child.name)
        sidecar.rmdir()
    sidecar.symlink_to(bigdisk)
    before = dir_snapshot(bigdisk)
    names = sorted(p.name for p in bigdisk.iterdir())
    target = SafetensorsDirTarget(path)
    with pytest.raises(TargetLayoutError, match="symbolic link"):
        DeltaReader(store, target).sync()
    with pytest.raises(TargetLayoutError):
        target.begin()
    assert sorted(p.name for p in bigdisk.iterdir()) == names
    assert dir_snapshot(bigdisk) == before


def test_only_versioned_directories_dcr_made_are_removed(tmp_path):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    writer, state, gen, _ = _chain(store, 1)
    DeltaReader(store, SafetensorsDirTarget(path)).sync()
    sidecar = tmp_path / ".ckpt.dcr"
    foreign = {
        "notes.txt": "file",
        "backup": "dir",
        "v1": "dir",
        "v00000000000000000001-DEADBEEF": "dir",  # not dcr's pattern (upper case)
        "v00000000000000000001-deadbeef.bak": "dir",
        "link-notalink": "file",
    }
    for name, kind in foreign.items():
        if kind == "dir":
            (sidecar / name).mkdir()
            (sidecar / name / "keep").write_text(name)
        else:
            (sidecar / name).write_text(name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    (sidecar / "v00000000000000000002-0000beef").symlink_to(elsewhere)  # a link, not a dir
    orphan = sidecar / "v00000000000000000001-deadbeef"  # a crashed sync's directory
    orphan.mkdir()
    (orphan / SINGLE_FILE).write_bytes(b"half written")
    (sidecar / "link-deadbeef").symlink_to(orphan)  # its temporary link
    for _ in range(2):
        step_state(state, gen)
        writer.publish(state)
        DeltaReader(store, SafetensorsDirTarget(path)).sync()
    assert not orphan.exists() and not (sidecar / "link-deadbeef").is_symlink()
    for name, kind in foreign.items():
        kept = sidecar / name / "keep" if kind == "dir" else sidecar / name
        assert kept.read_text() == name
    assert (sidecar / "v00000000000000000002-0000beef").is_symlink()
    assert (elsewhere / "keep").read_text() == "x"
    assert_same_bits(load_file(str(path / SINGLE_FILE)), state)


def test_subdirectories_and_links_are_carried_forward_as_they_are(tmp_path):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    writer, state, gen, _ = _chain(store, 1)
    DeltaReader(store, SafetensorsDirTarget(path)).sync()
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "generation_config.json").write_text('{"temperature": 0.7}')
    (shared / "chat_templates").mkdir()
    (shared / "chat_templates" / "default.jinja").write_text("{{ x }}")
    (path / "config.json").write_text('{"model_type": "toy"}')
    (path / "original").mkdir()
    (path / "original" / "params.json").write_text('{"dim": 16}')
    (path / "original" / "tokenizer").mkdir()
    (path / "original" / "tokenizer" / "tokenizer.model").write_bytes(b"\x00\x01sentencepiece")
    (path / "original" / "latest").symlink_to("params.json")  # a link inside a subdirectory
    links = {
        "generation_config.json": os.path.relpath(
            shared / "generation_config.json", path.resolve()
        ),  # relative, as operators write them (../../shared/...)
        "chat_templates": str(shared / "chat_templates"),  # absolute, to a directory
        "dangling.json": "../../nowhere.json",  # kept even if it points nowhere
    }
    for name, where in links.items():
        (path / name).symlink_to(where)
    inode = (path / "original" / "params.json").stat().st_ino
    files = _kept(path)
    for _ in range(3):
        step_state(state, gen)
        writer.publish(state)
        DeltaReader(store, SafetensorsDirTarget(path)).sync()
        for name, where in links.items():
            assert (path / name).is_symlink(), f"{name} became a copy"
            assert os.readlink(path / name) == where
        assert (path / "original" / "latest").is_symlink()
        assert os.readlink(path / "original" / "latest") == "params.json"
        assert _kept(path) == files
        assert (path / "generation_config.json").read_text() == '{"temperature": 0.7}'
        assert_same_bits(load_file(str(path / SINGLE_FILE)), state)
    # same filesystem: hard links, not copies, so large files are not rewritten every sync
    assert (path / "original" / "params.json").stat().st_ino == inode
    assert (shared / "generation_config.json").read_text() == '{"temperature": 0.7}'


# --- 3. the reserved name and unreadable directories ------------------------------------------


def test_the_safetensors_header_key_is_a_reserved_tensor_name(tmp_path):
    with pytest.raises(ReservedNameError, match="reserved"):
        check_tensor_name("__metadata__")
    assert check_tensor_name("__metadata__.weight") == "__metadata__.weight"
    assert issubclass(ReservedNameError, ValueError)
    store = str(tmp_path / "store")
    writer = DeltaWriter(store, features=())  # a plain JSON manifest, edited below
    writer.publish({"model.metadata__x": torch.ones(3)})
    key = next(Path(store).rglob("manifest-*.json"))
    hostile = key.read_bytes().replace(b"model.metadata__x", b"__metadata__")
    with pytest.raises(SchemaError, match="reserved"):
        parse(Manifest, hostile, what=str(key))
    # a writer cannot publish it (the schema refuses the entry); nothing new is committed
    with pytest.raises(ValueError, match="reserved"):
        DeltaWriter(str(tmp_path / "other")).publish({"__metadata__": torch.ones(3)})
    assert not list((tmp_path / "other").rglob("commits/*.json"))


def test_a_dir_target_refuses_to_write_the_reserved_name(tmp_path):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    _chain(store, 1)
    DeltaReader(store, SafetensorsDirTarget(path)).sync()
    before = dir_snapshot(path)
    txn = SafetensorsDirTarget(path).begin()
    txn.full_tensor("__metadata__", torch.float32, (3,)).zero_()
    with pytest.raises(TargetError, match="__metadata__"):
        txn.commit(Resident(json.loads((path / DIR_STATE_FILE).read_text())["chain_id"], 1))
    txn.abort()
    assert dir_snapshot(path) == before
    assert _versions(path) == [path.resolve().name]
    SafetensorsDirTarget(path, timeout=0).begin().abort()  # the lock was released


def _break(path: Path, how: str) -> None:
    live = path.resolve()
    if how == "garbage safetensors":
        (live / SINGLE_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    elif how == "metadata tensor":  # what dcr wrote before the name was reserved
        header = json.dumps(
            {"__metadata__": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
        ).encode()
        (live / SINGLE_FILE).write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    elif how == "truncated safetensors":
        data = (live / SINGLE_FILE).read_bytes()
        (live / SINGLE_FILE).write_bytes(data[: len(data) // 2])
    elif how == "safetensors is a directory":
        (live / SINGLE_FILE).unlink()
        (live / "model-00001-of-00001.safetensors").mkdir()
        (live / "x.safetensors").write_bytes(b"")
    elif how == "state not json":
        (live / DIR_STATE_FILE).write_text("{not json")
    elif how == "state version a string":
        state = json.loads((live / DIR_STATE_FILE).read_text())
        (live / DIR_STATE_FILE).write_text(json.dumps({**state, "version": "3"}))
    elif how == "state bad record hash":
        state = json.loads((live / DIR_STATE_FILE).read_text())
        (live / DIR_STATE_FILE).write_text(json.dumps({**state, "record_sha256": "zz"}))
    elif how == "state a list":
        (live / DIR_STATE_FILE).write_text("[1, 2]")
    elif how == "state is a directory":
        (live / DIR_STATE_FILE).unlink()
        (live / DIR_STATE_FILE).mkdir()
    else:
        raise AssertionError(how)


BREAKS = [
    "garbage safetensors",
    "metadata tensor",
    "truncated safetensors",
    "safetensors is a directory",
    "state not json",
    "state version a string",
    "state bad record hash",
    "state a list",
    "state is a directory",
]


@pytest.mark.parametrize("how", BREAKS)
def test_an_unreadable_directory_is_a_target_error_that_says_what_to_do(tmp_path, how):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    writer, state, gen, _ = _chain(store, 1)
    DeltaReader(store, SafetensorsDirTarget(path)).sync()
    step_state(state, gen)
    writer.publish(state)
    _break(path, how)
    target = SafetensorsDirTarget(path)
    with pytest.raises(TargetUnreadableError) as caught:
        if how.startswith("state"):
            target.resident()
        else:
            DeltaReader(store, target).sync()
    assert "remove" in str(caught.value) or "readable" in str(caught.value)
    SafetensorsDirTarget(path, timeout=0)._acquire(exclusive=True).release()  # type: ignore[union-attr]
    path.unlink()  # what the message says: remove the path and pull again
    DeltaReader(store, SafetensorsDirTarget(path)).sync()
    assert_same_bits(load_file(str(path / SINGLE_FILE)), state)
    assert _versions(path) == [path.resolve().name]


@pytest.mark.parametrize("when", ["seen before writing", "while writing"])
def test_a_version_that_does_not_fit_the_disk_is_refused_and_the_directory_kept(
    tmp_path, monkeypatch, when
):
    """A full disk (or quota) is told as such, with what the version needs, whether the
    free space is short before anything is written or the disk fills while writing (a
    filesystem that reports no size; safetensors names the OS error in its text only);
    the directory keeps its version, nothing of the new one is left, and once there is
    room the same sync completes."""
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    writer, state, gen, _ = _chain(store, 1)
    DeltaReader(store, SafetensorsDirTarget(path)).sync()
    before = dir_snapshot(path)
    step_state(state, gen)
    writer.publish(state)
    if when == "seen before writing":
        usage = shutil.disk_usage(tmp_path)
        full = usage._replace(free=1000)
        monkeypatch.setattr(targets.shutil, "disk_usage", lambda where: full)
    else:
        import safetensors.torch

        def no_room(*args, **kwargs):
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        nothing = shutil.disk_usage(tmp_path)._replace(total=0, used=0, free=0)
        monkeypatch.setattr(targets.shutil, "disk_usage", lambda where: nothing)
        monkeypatch.setattr(safetensors.torch, "save_file", no_room)
    with pytest.raises(TargetUnreadableError, match=r"the disk of .*ckpt is full: version 1 needs"):
        DeltaReader(store, SafetensorsDirTarget(path)).sync()
    assert dir_snapshot(path) == before
    assert _versions(path) == [path.resolve().name]
    monkeypatch.undo()
    assert DeltaReader(store, SafetensorsDirTarget(path)).sync().version == 1
    assert_same_bits(load_file(str(path / SINGLE_FILE)), state)


def test_a_lock_file_that_is_a_link_is_refused(tmp_path):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    _chain(store, 1)
    elsewhere = tmp_path / "precious"
    elsewhere.write_text("do not truncate")
    (tmp_path / ".ckpt.dcr.lock").symlink_to(elsewhere)
    with pytest.raises(TargetUnreadableError, match="lock file"):
        DeltaReader(store, SafetensorsDirTarget(path)).sync()
    assert elsewhere.read_text() == "do not truncate"


# --- resident record hash ---------------------------------------------------------------------


def test_the_record_hash_is_kept_in_the_state_file_and_old_files_still_read(tmp_path):
    store, path = str(tmp_path / "store"), tmp_path / "ckpt"
    _chain(store, 1)
    DeltaReader(store, SafetensorsDirTarget(path)).sync()
    state_path = path / DIR_STATE_FILE
    written = json.loads(state_path.read_text())  # the reader records the record's sha256
    assert written["record_sha256"] == Chain(open_store(store)).record(0).sha256
    target = SafetensorsDirTarget(path)
    assert target.resident() == Resident(written["chain_id"], 0, written["record_sha256"])
    del written["record_sha256"]  # a state file from before dcr kept it
    state_path.write_text(json.dumps(written))
    old = target.resident()
    assert old == Resident(written["chain_id"], 0) and old.record_sha256 is None
    txn = target.begin()
    txn.commit(Resident(old.chain_id, old.version, "f" * 64))
    assert target.resident() == Resident(old.chain_id, old.version, "f" * 64)
    assert json.loads(state_path.read_text())["record_sha256"] == "f" * 64
