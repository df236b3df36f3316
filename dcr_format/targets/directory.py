"""A Hugging Face safetensors directory as a target (:class:`SafetensorsDirTarget`).

Each sync writes a complete new versioned directory beside the path and swaps a symbolic
link to it with one rename, under a lock file that one sync at a time holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dcr_format.errors import (
    ArgumentError,
    TargetBusyError,
    TargetChangedError,
    TargetError,
    TargetLayoutError,
    TargetUnreadableError,
)
from dcr_format.format.schema import CHECKPOINT_FILE_NAME, is_dcr_file_name
from dcr_format.system.fsync import fsync
from dcr_format.targets.change import SHA256_HEX, Resident
from dcr_format.targets.dict import _DictTransaction
from dcr_format.targets.protocol import LOCK_TIMEOUT, Target, Transaction

DIR_STATE_FILE = "dcr-state.json"
DIR_STATE_FORMAT = "dcr-dir-1"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_FILE_BYTES = 5 << 30  # Hugging Face's customary shard size
_VERSION_DIR = re.compile(r"^v[0-9]{20}-[0-9a-f]{8}$")  # the only directories dcr deletes
_TEMP_LINK = re.compile(r"^link-[0-9a-f]{8}$")
_FILE_NAME = re.compile(CHECKPOINT_FILE_NAME)


_UNSET = object()
_RELOCKS = 16  # locks taken again on a lock file removed and made anew meanwhile


class _Lock:
    """An open lock file holding an ``flock``; the kernel releases it when the fd closes
    (also when the holder is killed). An exclusive holder's record of itself (pid, host,
    since) is erased as it releases, so that nobody is later named as a holder it no longer
    is."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self.exclusive = False

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            if self.exclusive:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
            os.close(fd)

    def __del__(self) -> None:
        self.release()


class SafetensorsDirTarget(Target):
    """A Hugging Face checkpoint directory, replaced atomically on every sync.

    ``path`` becomes a symbolic link to a versioned directory beside it
    (``.<name>.dcr/v<version>-<id>/``) holding ``model.safetensors`` (or shards
    plus ``model.safetensors.index.json``), the version's checkpoint files (config,
    generation config, tokenizer files, chat template: those the writer published) and
    ``dcr-state.json``. A sync writes the new directory completely, fsyncs it, then swaps
    the link with one rename, so a crash at any moment leaves the old or the new version,
    never a mix. A checkpoint file is written as the version has it (one the writer no
    longer publishes is removed); everything else in the directory (files, subdirectories
    and symbolic links you added) is carried forward as it is.

    One sync at a time owns the directory: :meth:`begin` takes an exclusive
    ``flock`` on ``.<name>.dcr.lock`` beside it until the transaction commits or
    aborts, and :meth:`resident` a shared one while it reads. A second sync waits up
    to ``timeout`` seconds (None: for ever; 0: refuses at once) and then raises
    :class:`TargetBusyError` naming the holder's pid and host. A holder that dies
    releases the lock with its last file descriptor.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_file_bytes: int = MAX_FILE_BYTES,
        timeout: float | None = LOCK_TIMEOUT,
    ) -> None:
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0
        ):
            raise ArgumentError("timeout is seconds >= 0, or None to wait for ever")
        self.path = Path(path)
        self.max_file_bytes = max_file_bytes
        self.timeout = timeout
        self._held: _Lock | None = None  # the exclusive lock of this target's open transaction
        self._planned: object = _UNSET  # what resident() last answered (checked by begin)

    def claim_key(self) -> Hashable:
        """The path (its parent resolved): targets over one directory take turns."""
        return ("directory", os.path.realpath(self.path.parent), self.path.name)

    def claim_timeout(self) -> float | None:
        """``timeout``, as for the lock file."""
        return self.timeout

    @property
    def _store_dir(self) -> Path:
        return self.path.parent / f".{self.path.name}.dcr"

    @property
    def _lock_path(self) -> Path:
        return self.path.parent / f".{self.path.name}.dcr.lock"

    # --- ownership -----------------------------------------------------------------------

    def _acquire(self, *, exclusive: bool) -> _Lock | None:
        """Take the directory's lock (None: a shared lock where the lock file cannot be
        opened, e.g. a read-only filesystem, where nobody can sync either). A lock taken on
        a file that is no longer the lock file (a first sync that failed removed it while
        this one waited) is let go and taken again on the file there now."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for _ in range(_RELOCKS):
            lock = self._lock_once(exclusive, deadline)
            if lock is None or lock.fd is None or _is_file(lock.fd, self._lock_path):
                return lock
            lock.exclusive = False  # nobody else finds this file: no record to erase
            lock.release()
        # a filesystem whose files do not keep their identity between two looks: the lock
        # as it is taken
        return self._lock_once(exclusive, deadline)

    def _lock_once(self, exclusive: bool, deadline: float | None) -> _Lock | None:
        lock_path = self._lock_path
        flags = os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(lock_path, flags | os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if not exclusive:
                try:
                    fd = os.open(lock_path, flags | os.O_RDONLY)
                except OSError:
                    return None
            else:
                raise TargetUnreadableError(
                    f"cannot open the lock file {lock_path} ({exc}); make {self.path.parent} "
                    "writable by this user (and not a link)"
                ) from None
        lock = _Lock(fd)
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        delay = 0.01
        try:
            while True:
                try:
                    fcntl.flock(fd, mode | (fcntl.LOCK_NB if deadline is not None else 0))
                    break
                except BlockingIOError:
                    assert deadline is not None
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TargetBusyError(
                            f"{self.path} is being synced by {_holder(fd)} (lock {lock_path}); "
                            f"waited {self.timeout:g} s; wait for that sync to finish, or "
                            "wait longer (`dcr pull --wait SECONDS`, timeout= in Python)"
                        ) from None
                    time.sleep(min(delay, left))
                    delay = min(delay * 2, 0.25)
            if exclusive:
                holder = {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(holder).encode(), 0)
                lock.exclusive = True  # held: its record is erased as it releases
        except OSError as exc:
            lock.release()
            raise TargetUnreadableError(
                f"cannot lock {lock_path} ({exc}); use a local filesystem with flock support"
            ) from None
        except BaseException:
            lock.release()
            raise
        return lock

    def _check_managed(self) -> Path | None:
        """The versioned directory the link points at; None for a missing or empty path (or
        a link to a versioned directory that is gone: the next sync starts from a base)."""
        store = self._store_dir
        if store.is_symlink() or (os.path.lexists(store) and not store.is_dir()):
            raise TargetLayoutError(
                f"{store} is a symbolic link or not a directory; dcr keeps its versioned "
                f"directories in a real directory beside {self.path} and deletes old ones "
                f"there: to use another disk, move {self.path} and {store} there together "
                "(or mount the disk at that path)"
            )
        if self.path.is_symlink():
            link = os.readlink(self.path)
            real = Path(os.path.realpath(self.path.parent / link))
            if real.parent == Path(os.path.realpath(store)) and _VERSION_DIR.match(real.name):
                return real if real.is_dir() else None
            raise TargetLayoutError(
                f"{self.path} is a link to {link}, not to a directory "
                f"dcr manages under {store}; choose a new or empty path"
            )
        if not self.path.exists():
            return None
        if self.path.is_dir() and not any(self.path.iterdir()):
            return None
        raise TargetLayoutError(
            f"{self.path} is an existing directory not managed by dcr; choose a new or "
            "empty path (dcr keeps it as a link to versioned directories)"
        )

    def _read_state(self, live: Path) -> Resident | None:
        return self._state(live)[0]

    def _state(self, live: Path) -> tuple[Resident | None, dict[str, str]]:
        """The resident version ``dcr-state.json`` records, and the checkpoint files it
        records as the chain's (sha256 by name)."""
        state_path = live / DIR_STATE_FILE
        try:
            raw = state_path.read_bytes()
        except FileNotFoundError:
            return None, {}
        except OSError as exc:
            raise TargetUnreadableError(
                f"cannot read {state_path} ({exc}); make it readable by this user"
            ) from None
        try:
            state = json.loads(raw)
            if not isinstance(state, dict) or state.get("format") != DIR_STATE_FORMAT:
                raise ValueError(f"not a {DIR_STATE_FORMAT} state")
            chain_id, version = state["chain_id"], state["version"]
            sha = state.get("record_sha256")
            if not isinstance(chain_id, str) or type(version) is not int or version < 0:
                raise ValueError("chain_id or version malformed")
            if sha is not None and not (isinstance(sha, str) and SHA256_HEX.match(sha)):
                raise ValueError("record_sha256 malformed")
            files = state.get("files", {})
            if not isinstance(files, dict) or not all(
                isinstance(n, str)
                and _FILE_NAME.match(n)
                and not is_dcr_file_name(n)
                and isinstance(h, str)
                and SHA256_HEX.match(h)
                for n, h in files.items()
            ):
                raise ValueError("files malformed")
            return Resident(chain_id, version, sha), files
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise TargetUnreadableError(
                f"{state_path} is unreadable ({exc}); remove {self.path} and pull again"
            ) from None

    # --- the target ----------------------------------------------------------------------

    def resident(self) -> Resident | None:
        """The version recorded in the directory's ``dcr-state.json``, read under the
        shared lock (waits for a sync in progress, up to ``timeout``)."""
        if self._held is None and not self._lock_path.exists():
            # no sync has run here (a sync creates the lock file first), and a sync refused
            # before it begins leaves no lock file behind
            if not os.path.lexists(self.path):  # nothing is resident
                self._planned = None
                return None
            self._check_managed()  # a directory dcr does not manage is refused here
        lock = None if self._held is not None else self._acquire(exclusive=False)
        try:
            live = self._check_managed()
            found = None if live is None else self._read_state(live)
        finally:
            if lock is not None:
                lock.release()
        if self._held is None:  # a sync planning (not one checking its open transaction)
            self._planned = found
        return found

    def checkpoint_files(self) -> Mapping[str, str]:
        """The checkpoint files the directory holds from the chain (FORMAT.md §3.5.6), their
        sha256 by name: those ``dcr-state.json`` records whose bytes are still the recorded
        ones (a file edited or removed since is fetched again), read under the shared lock."""
        lock = None if self._held is not None else self._acquire(exclusive=False)
        try:
            live = self._check_managed()
            if live is None:
                return {}
            recorded = self._state(live)[1]
            return {n: sha for n, sha in recorded.items() if _file_sha256(live / n) == sha}
        finally:
            if lock is not None:
                lock.release()

    def begin(self) -> Transaction:
        """Take the directory's lock and load its tensors; commit writes and swaps in a new
        directory, commit or abort releases the lock.

        Raises :class:`TargetChangedError` if another sync moved the directory since this
        target's last :meth:`resident` (the reader planned from there: sync again).
        """
        if self._held is not None:
            raise TargetError(
                f"a transaction on {self.path} is already open; commit or abort it first"
            )
        planned, self._planned = self._planned, _UNSET
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TargetUnreadableError(
                f"cannot create {self.path.parent} ({exc}); create it or pick another path"
            ) from None
        lock = self._acquire(exclusive=True)
        assert lock is not None
        try:
            live = self._check_managed()
            current, held = (None, {}) if live is None else self._state(live)
            if planned is not _UNSET and current != planned:
                raise TargetChangedError(
                    f"another sync moved {self.path} from {_describe(planned)} to "
                    f"{_describe(current)} while this one was planning; sync again"
                )
            self._clean_orphans(live)
            tensors, layout = (
                self._load(live) if live is not None and current is not None else ({}, {})
            )
        except BaseException:
            self._release(lock)
            raise
        self._held = lock
        return _DirTransaction(self, tensors, layout, live, lock, held)

    def _release(self, lock: _Lock) -> None:
        """Let the lock go; where the directory was never made (a first sync that failed),
        its lock file goes too, removed while held (a sync waiting for it takes the lock
        again on a new file, see :meth:`_acquire`)."""
        if self._held is lock:
            self._held = None
        if lock.exclusive and not os.path.lexists(self.path):
            with contextlib.suppress(OSError):
                self._lock_path.unlink()
        lock.release()

    def _load(self, live: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        layout: dict[str, str] = {}
        for file in sorted(live.glob("*.safetensors")):
            if not file.is_file():
                continue
            try:
                loaded = load_file(str(file))
            except Exception as exc:  # SafetensorError, OSError, a bad header: all unreadable
                raise TargetUnreadableError(
                    f"{self.path}/{file.name} cannot be loaded ({type(exc).__name__}: {exc}); "
                    f"remove {self.path} and pull again"
                ) from None
            for name, tensor in loaded.items():
                tensors[name] = tensor
                layout[name] = file.name
        return tensors, layout

    def _clean_orphans(self, live: Path | None) -> None:
        """Remove what crashed syncs left in the sidecar: versioned directories the link does
        not point at and temporary links. Called under the exclusive lock, so no live sync
        can still swap one in; nothing else in the sidecar is touched."""
        store = self._store_dir
        if not store.is_dir():
            return
        for child in store.iterdir():
            if _VERSION_DIR.match(child.name) and child.is_dir() and not child.is_symlink():
                if live is None or child.name != live.name:
                    shutil.rmtree(child, ignore_errors=True)
            elif _TEMP_LINK.match(child.name) and child.is_symlink():
                child.unlink(missing_ok=True)

    def _plan_files(
        self, tensors: dict[str, torch.Tensor], layout: dict[str, str]
    ) -> dict[str, list[str]]:
        files: dict[str, list[str]] = {}
        if layout and all(name in layout for name in tensors):
            for name in tensors:
                files.setdefault(layout[name], []).append(name)
            if len(files) > 1:
                return files  # the index names exactly these
            # one file left (a base dropped the others' tensors): a loader finds it only
            # as model.safetensors, since no index is written for one file
            return {SINGLE_FILE: next(iter(files.values()), [])}
        groups: list[list[str]] = [[]]
        size = 0
        # by name, numbers as numbers (layer 2 before layer 10): the same files whatever
        # order a sync's changes arrived in
        for name in sorted(tensors, key=_natural_key):
            tensor = tensors[name]
            nbytes = tensor.numel() * tensor.element_size()
            if groups[-1] and size + nbytes > self.max_file_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
        if len(groups) == 1:
            return {SINGLE_FILE: groups[0]}
        n = len(groups)
        return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}

    def _write(
        self,
        tensors: dict[str, torch.Tensor],
        layout: dict[str, str],
        resident: Resident,
        live: Path | None,
        chain_files: _FileSet,
    ) -> None:
        from dcr_format.format.schema import RESERVED_TENSOR_NAMES

        reserved = sorted(RESERVED_TENSOR_NAMES & set(tensors))
        if reserved:
            raise TargetError(
                f"tensor name {reserved[0]!r} cannot be stored in a safetensors file; "
                "rename the tensor in the writer"
            )
        store = self._store_dir
        store.mkdir(exist_ok=True)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        size += sum(len(data) for data in chain_files.fetched.values())
        free = _free_bytes(store)
        if free is not None and free < size:
            raise TargetUnreadableError(self._full(resident, size, free, live))
        fresh = store / f"v{resident.version:020d}-{uuid.uuid4().hex[:8]}"
        fresh.mkdir()
        link = store / f"link-{uuid.uuid4().hex[:8]}"
        swapped = False
        try:
            try:
                self._fill(fresh, tensors, layout, resident, live, chain_files)
            except Exception as exc:
                if not _out_of_space(exc):
                    raise
                raise TargetUnreadableError(self._full(resident, size, None, live)) from exc
            _fsync_dir(fresh)  # complete: what follows is the swap
            if self.path.is_dir() and not self.path.is_symlink():
                self.path.rmdir()  # empty (checked); the previous version was nothing
            os.symlink(os.path.relpath(fresh, self.path.parent), link)
            os.replace(link, self.path)
            swapped = True
        finally:
            if not swapped:
                link.unlink(missing_ok=True)
                shutil.rmtree(fresh, ignore_errors=True)
        _fsync_dir(self.path.parent)
        if live is not None and live.name != fresh.name:
            shutil.rmtree(live, ignore_errors=True)

    def _full(self, resident: Resident, size: int, free: int | None, live: Path | None) -> str:
        """The message of a version that does not fit the directory's disk (``live``: the
        directory of the version it holds, if any)."""
        needs, has = f"{size / 1e6:.1f} MB", "" if free is None else f"{free / 1e6:.1f} MB"
        if needs == has:  # too close for megabytes
            needs, has = f"{size:,} bytes", f"{free:,} bytes"
        beside, kept = (
            (" written beside the version the directory holds", " (it still holds its version)")
            if live is not None
            else ("", "")
        )
        return (
            f"the disk of {self.path} is full: version {resident.version} needs {needs}"
            f"{beside}{has and f', {has} free'}; free space there and sync again{kept}"
        )

    def _fill(
        self,
        fresh: Path,
        tensors: dict[str, torch.Tensor],
        layout: dict[str, str],
        resident: Resident,
        live: Path | None,
        chain_files: _FileSet,
    ) -> None:
        """Write a new version's directory: its safetensors files (and index), its
        checkpoint files, what the previous version held besides tensors (less the chain's
        files the version no longer has), and the state file; each file synced."""
        from safetensors.torch import save_file

        files = self._plan_files(tensors, layout)
        mode = _new_file_mode(fresh)
        for file, names in files.items():
            path = fresh / file
            save_file(
                {n: tensors[n].contiguous() for n in names}, str(path), metadata={"format": "pt"}
            )
            # safetensors writes owner-only files; the engine reading them may be another user
            os.chmod(path, mode)
            fsync(path, strict=True)
        if len(files) > 1:
            index = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in tensors.values())
                },
                "weight_map": {n: f for f, names in files.items() for n in sorted(names)},
            }
            _write_synced(fresh / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True).encode())
        if live is not None:
            _carry_forward(live, fresh, skip=chain_files.replaced)
        for name, data in chain_files.fetched.items():
            _write_synced(fresh / name, data)
        missing = sorted(n for n in chain_files.listed if not (fresh / n).is_file())
        if missing:
            raise TargetError(
                f"checkpoint file {missing[0]!r} vanished from {self.path} during the sync; "
                "sync again"
            )
        state: dict[str, object] = {
            "format": DIR_STATE_FORMAT,
            "chain_id": resident.chain_id,
            "version": resident.version,
        }
        if resident.record_sha256 is not None:
            state["record_sha256"] = resident.record_sha256
        if chain_files.listed:
            state["files"] = dict(sorted(chain_files.listed.items()))
        _write_synced(fresh / DIR_STATE_FILE, json.dumps(state).encode())


def _free_bytes(path: Path) -> int | None:
    """Bytes free for this user on the filesystem of ``path`` (None: it does not say, as
    some network and FUSE filesystems report no size at all)."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free if usage.total > 0 else None


def _out_of_space(exc: BaseException) -> bool:
    """Whether a write failed for want of space (a full disk or quota): an OSError with
    that errno, or safetensors' own error, which gives the OS error in its text only."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return any(
        mark in text
        for mark in (
            os.strerror(errno.ENOSPC),
            os.strerror(errno.EDQUOT),
            f"os error {errno.ENOSPC})",
        )
    )


@dataclass(frozen=True)
class _FileSet:
    """The checkpoint files a directory's new version holds (``listed``: sha256 by name),
    the bytes of those written anew (``fetched``), and the names not carried forward from
    the previous version (``replaced``: fetched anew, or the chain's and gone)."""

    listed: Mapping[str, str]
    fetched: Mapping[str, bytes]
    replaced: frozenset[str]


def _file_sha256(path: Path) -> str | None:
    """The sha256 of a regular file's bytes (None: missing, a link, or not a file)."""
    import hashlib

    if path.is_symlink() or not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class _DirTransaction(_DictTransaction):
    """A dict transaction over a directory's tensors, holding its lock until the end."""

    def __init__(
        self,
        target: SafetensorsDirTarget,
        tensors: dict[str, torch.Tensor],
        layout: dict[str, str],
        live: Path | None,
        lock: _Lock,
        held: Mapping[str, str],
    ) -> None:
        super().__init__(tensors, torch.device("cpu"), lambda resident: None)
        self._target = target
        self._loaded = tensors
        self._layout = layout
        self._live = live
        self._lock: _Lock | None = lock
        # the chain's checkpoint files: those the directory holds, until put_files says
        self._files = _FileSet(held, {}, frozenset())

    def put_files(self, files: Mapping[str, str], fetched: Mapping[str, bytes]) -> None:
        """The version's checkpoint files replace the chain's files the directory held; a
        file the version lists and did not fetch is carried forward (it holds those bytes)."""
        gone = set(self._files.listed) - set(files)
        self._files = _FileSet(dict(files), dict(fetched), frozenset(gone | set(fetched)))

    def commit(self, resident: Resident) -> None:
        if self._lock is None:
            raise TargetError("this transaction is closed; begin a new one")
        try:
            self._target._write(self._loaded, self._layout, resident, self._live, self._files)
        finally:
            self._close()
        self._previous.clear()

    def abort(self) -> None:
        super().abort()
        self._close()

    def _close(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            self._target._release(lock)


def _is_file(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the file at ``path`` (not one removed since)."""
    try:
        held, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def _describe(resident: object) -> str:
    if isinstance(resident, Resident):
        return f"version {resident.version}"
    return "nothing"


def _holder(fd: int) -> str:
    """Who holds a lock, as its holder recorded (pid, host, since)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(info['pid'])} on {str(info['host'])!r} since {info['since']!s}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (one reading it, or a sync that has not recorded its pid yet)"


def _link_or_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Hard-link ``src`` at ``dst`` (the old version is deleted after the swap, so the new
    one keeps the only name); copy where links are impossible (another filesystem)."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
        fsync(Path(dst), strict=True)


def _carry_forward(live: Path, fresh: Path, *, skip: frozenset[str] = frozenset()) -> None:
    """Everything of the previous version that is not dcr's own (config, tokenizer,
    ``original/``, links) and not named in ``skip``, into the new directory: links as links
    with the same target, files and directories hard-linked or copied."""
    for item in sorted(live.iterdir()):
        if item.name in skip:
            continue
        destination = fresh / item.name
        if item.is_symlink():
            if item.name in (INDEX_FILE, DIR_STATE_FILE) or item.name.endswith(".safetensors"):
                continue  # loaded as tensors and written anew
            os.symlink(os.readlink(item), destination)
        elif item.is_dir():
            shutil.copytree(item, destination, symlinks=True, copy_function=_link_or_copy)
            for root, dirs, _ in os.walk(destination):
                for name in dirs:
                    _fsync_dir(Path(root) / name)
        elif item.is_file():
            if item.name in (INDEX_FILE, DIR_STATE_FILE) or item.name.endswith(".safetensors"):
                continue
            _link_or_copy(item, destination)


def _fsync_dir(path: Path) -> None:
    """Flush a directory's entries, best effort (around the link swap: tests hook it)."""
    fsync(path)


def _new_file_mode(directory: Path) -> int:
    """The permission bits a file created in ``directory`` gets by default (0o666 less the
    process's umask), read from a probe file so that nothing process-wide is changed."""
    probe = directory / f".mode-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """``name`` split into text and numbers, so that names sort as a reader expects them:
    ``layers.2`` before ``layers.10``."""
    return tuple(
        (1, int(part)) if part.isdigit() else (0, part) for part in re.split(r"(\d+)", name)
    )
