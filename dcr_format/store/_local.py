"""The local backend: objects as files under a directory, written crash-safely with ``os``.

Not fsspec: ``put`` writes a temporary file next to its object (a name starting
with ``.dcr-tmp-``, FORMAT.md §2.5), fsyncs it and renames it into place;
``put_if_absent`` hard-links the temporary file to the object's name, which
fails if the name exists, so the create is atomic. Listings never report
temporary files, and no key resolves (through a symlink) outside the root.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import PurePath

from dcr_format.store._base import (
    TEMP_PREFIX,
    Capabilities,
    Kind,
    NoHardLinks,
    ObjectExists,
    ObjectInfo,
    ObjectTooLarge,
    OutsideRoot,
    RetryPolicy,
    key_problem,
    temporary_key_problem,
)
from dcr_format.system.fsync import fsync

__all__ = ["LocalBackend", "local_root"]

_READ_CHUNK = 1 << 30  # one read(2) moves at most about 2 GiB on Linux


def local_root(url: str | os.PathLike[str]) -> str | None:
    """The absolute directory of a local store URL, or None when it is not a local one."""
    if isinstance(url, os.PathLike):
        return os.path.abspath(os.fspath(url))
    for scheme in ("file://", "local://"):
        if url.startswith(scheme):
            path = url[len(scheme) :]
            if path.startswith("localhost/"):
                path = path[len("localhost") :]
            return os.path.abspath(path or os.sep)
    if "://" in url or "::" in url:
        return None
    return os.path.abspath(os.path.expanduser(url))


_MAKE_TRIES = 8  # makings of a write's directory that an empty-directory prune may undo


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _link_new(temp: str, path: str) -> None:
    """Hard-link ``temp`` to the new name ``path``, then remove ``temp``.

    link(2) fails if the name exists: the create is atomic, never check-then-write.
    """
    try:
        os.link(temp, path)
    except FileExistsError:
        raise ObjectExists from None
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise NoHardLinks from exc
        raise
    finally:
        _unlink_quietly(temp)


def _read_fd(fd: int, expected: int, limit: int | None) -> bytes:
    """Read from ``fd`` until EOF, or until ``limit`` bytes when a limit is given."""
    chunks: list[bytes] = []
    total = 0
    while limit is None or total < limit:
        want = max(expected + 1 - total, 1 << 16)
        if limit is not None:
            want = min(want, limit - total)
        chunk = os.read(fd, min(want, _READ_CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _infos(found: Iterable[tuple[str, os.DirEntry[str]]]) -> builtins.list[ObjectInfo]:
    """Sorted listing entries with each file's size and modification time (a symlink's:
    its target's); entries deleted since their directory was read are left out."""
    infos = []
    for key, entry in found:
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        when = datetime.fromtimestamp(st.st_mtime_ns / 1e9, timezone.utc)
        infos.append(ObjectInfo(key, st.st_size, when))
    infos.sort()
    return infos


class LocalBackend:
    """Objects as files under a local directory, written crash-safely with ``os`` calls."""

    kind: Kind = "local"
    retry: RetryPolicy | None = None  # a local filesystem has no transient failures
    capabilities = Capabilities(atomic_create=True, listing=True, delete=True)

    def __init__(self, root: str, *, single_writer: bool = False) -> None:
        self.root = root
        self.single_writer = single_writer  # the caller's promise (creates are atomic anyway)
        self.local_root: str | None = root
        self.url = "file://" + PurePath(root).as_posix()

    def _real_root(self) -> str:
        return os.path.realpath(self.root)

    def _resolve(self, key: str) -> str:
        """Real path of ``key``, refusing any that a symlink leads outside the root."""
        real = os.path.realpath(os.path.join(self.root, key))
        if not _is_within(real, self._real_root()):
            raise OutsideRoot
        return real

    def probe_conditional_writes(self) -> bool:
        return True  # link(2) creates atomically; nothing to ask

    def get(self, key: str, max_size: int | None) -> bytes:
        path = self._resolve(key)
        # O_NONBLOCK keeps a FIFO from hanging the open; O_NOFOLLOW refuses a symlink
        # swapped in after the path was resolved.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FileNotFoundError(errno.ENOENT, "not a regular file", path)
            if max_size is not None and st.st_size > max_size:
                raise ObjectTooLarge(st.st_size)
            limit = None if max_size is None else max(max_size + 1, 0)
            data = _read_fd(fd, st.st_size, limit)
        finally:
            os.close(fd)
        if max_size is not None and len(data) > max_size:
            raise ObjectTooLarge(None)
        return data

    def _makedirs(self, path: str) -> None:
        missing: builtins.list[str] = []
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise NotADirectoryError(
                        errno.ENOTDIR, "a parent of the key is an object", directory
                    ) from None
            else:
                fsync(os.path.dirname(directory))

    def _write_temp(self, directory: str, data: bytes) -> str:
        """Write ``data`` durably to a new temporary file in ``directory``; return its path.
        A directory a delete removed (empty) between its making and the file's creation is
        made again."""
        path = os.path.join(directory, TEMP_PREFIX + uuid.uuid4().hex)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        for attempt in range(_MAKE_TRIES):
            try:
                self._makedirs(directory)
                fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)
                break
            except FileNotFoundError:
                if attempt == _MAKE_TRIES - 1:
                    raise
        try:
            view = memoryview(data).cast("B")
            while view:
                written = os.write(fd, view[:_READ_CHUNK])
                view = view[written:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        return path

    def _place(self, key: str, data: bytes, move: Callable[[str, str], None]) -> None:
        """Write ``data`` durably to a temporary file next to ``key``'s path, ``move`` it to
        that path and make the move durable (the temporary file is gone in every case)."""
        path = self._resolve(key)
        directory = os.path.dirname(path)
        temp = self._write_temp(directory, data)
        try:
            move(temp, path)
        except BaseException:
            _unlink_quietly(temp)
            raise
        fsync(directory)

    def put(self, key: str, data: bytes) -> None:
        self._place(key, data, os.replace)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._place(key, data, _link_new)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._resolve(key))

    def size(self, key: str) -> int:
        path = self._resolve(key)
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(errno.ENOENT, "not a regular file", path)
        return st.st_size

    def _entries(self, prefix: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """(key, entry) of every entry under ``prefix`` that is not a directory, in no
        particular order; symlinked directories and temporary-named ones are not entered."""
        start = os.path.join(self.root, prefix) if prefix else self.root
        if prefix and not _is_within(os.path.realpath(start), self._real_root()):
            raise OutsideRoot
        pending = [(start, prefix)]
        while pending:
            directory, rel = pending.pop()
            try:
                entries = os.scandir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with entries:
                for entry in entries:
                    key = rel + entry.name
                    # Symlinked directories are not followed (no loops, no escapes).
                    if not entry.is_dir(follow_symlinks=False):
                        yield key, entry
                    elif not entry.name.startswith(TEMP_PREFIX):
                        pending.append((entry.path, key + "/"))

    def _walk(self, prefix: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """(key, entry) of every object under ``prefix``, in no particular order."""
        real_root = self._real_root()
        for key, entry in self._entries(prefix):
            if entry.name.startswith(TEMP_PREFIX):
                continue
            if not entry.is_file(follow_symlinks=False):
                if not entry.is_symlink():
                    continue
                target = os.path.realpath(entry.path)
                if not (_is_within(target, real_root) and os.path.isfile(target)):
                    continue
            if key_problem(key) is None:
                yield key, entry

    def list(self, prefix: str) -> builtins.list[str]:
        return sorted(key for key, _ in self._walk(prefix))

    def list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        return _infos(self._walk(prefix))

    def list_temporary(self) -> builtins.list[ObjectInfo]:
        """Temporary files of writes that never finished: regular files only (a symlink is
        never one of ours), in directories that hold objects."""
        return _infos(
            (key, entry)
            for key, entry in self._entries("")
            if entry.is_file(follow_symlinks=False) and temporary_key_problem(key) is None
        )

    def _lexical(self, key: str) -> str:
        """The path of ``key`` in its real parent directory (the last segment not resolved,
        so a symlink there is the link itself); :class:`OutsideRoot` outside the root."""
        lexical = os.path.join(self.root, key)
        parent = os.path.realpath(os.path.dirname(lexical))
        if not _is_within(parent, self._real_root()):
            raise OutsideRoot
        return os.path.join(parent, os.path.basename(lexical))

    def delete(self, key: str) -> None:
        # Resolve only the parent: deleting a symlink removes the link, not its target.
        path = self._lexical(key)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(path)
        self._prune(os.path.dirname(path))

    def delete_temporary(self, keys: builtins.list[str]) -> None:
        for key in keys:
            path = self._lexical(key)
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                if stat.S_ISREG(os.lstat(path).st_mode):  # never a link or a directory
                    os.unlink(path)
            self._prune(os.path.dirname(path))

    def _prune(self, directory: str) -> None:
        """Remove ``directory`` and its parents below the root while they are empty, so that
        deleting a version's objects (gc) or a probe's (doctor) leaves no empty directories
        behind. A write racing it makes its directory again (:meth:`_write_temp`)."""
        root = self._real_root()
        while directory != root and _is_within(directory, root):
            try:
                os.rmdir(directory)
            except OSError:  # not empty (or gone, or not ours to remove): stop here
                return
            directory = os.path.dirname(directory)

    def delete_many(self, keys: builtins.list[str]) -> None:
        for key in keys:
            self.delete(key)
