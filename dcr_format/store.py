"""Object store over local paths and fsspec URLs: every byte the format writes goes through here.

A :class:`Store` is a root URL holding objects named by relative keys
(``commits/00000000000000000001.json``). Three kinds of root are handled:

- local paths (``./refit-store``, ``/abs/path``, ``file:///abs/path``): a private
  backend built on ``os`` (not fsspec) so that ``put`` is crash-safe (temporary
  file, fsync, rename) and ``put_if_absent`` is an atomic create (hard link,
  which fails if the name exists). Temporary files live next to their object
  under names starting with ``.dcr-tmp-``; ``list`` never reports them and
  :func:`check_key` refuses keys that use that prefix.
- ``memory://name``: fsspec's process-local memory filesystem; a process-wide
  lock makes check-and-write atomic, so it supports atomic create too (among
  Store users; code that writes memory:// directly through fsspec bypasses it).
- ``s3://bucket/prefix`` (and ``s3a://``): AWS S3 or an S3-compatible server
  through s3fs (the ``s3`` extra), in the private module ``dcr_format._s3``.
  Endpoint, region and credentials come from the standard AWS environment and
  config files (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``,
  ...); ``storage_options`` (s3fs's ``endpoint_url``, ``key``, ``secret``,
  ``client_kwargs``, ``config_kwargs``, ...) override them. ``put_if_absent``
  is a ``PUT`` with ``If-None-Match: *``; whether the server honours that
  header is probed once per process (:meth:`Store.probe_conditional_writes`),
  and a server that ignores it is treated like a backend without atomic create.
- any other fsspec URL: goes through fsspec with no local-disk assumptions.
  Such a backend is not known to create atomically, so ``put_if_absent``
  refuses with :class:`~dcr_format.errors.CapabilityError` unless the store
  was opened with ``single_writer=True``.

Every backend error is translated in one place (``Store._translated``) into
the errors of :mod:`dcr_format.errors`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractFileSystem

from dcr_format.errors import (
    CapabilityError,
    DcrError,
    InvalidKeyError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreError,
)

if TYPE_CHECKING:
    from dcr_format._s3 import S3Backend

__all__ = ["Capabilities", "ObjectInfo", "Store", "check_key", "open_store"]

MAX_KEY_BYTES = 1024
"""Longest key accepted, in bytes of UTF-8 (the S3 limit)."""

T = TypeVar("T")

_TEMP_PREFIX = ".dcr-tmp-"
_WINDOWS_DRIVE = re.compile(r"[A-Za-z]:")
_READ_CHUNK = 1 << 30  # one read(2) moves at most about 2 GiB on Linux
_MEMORY_LOCK = threading.Lock()  # memory:// is process-local, so one lock serialises all writers


# --- keys ----------------------------------------------------------------------


def _key_problem(key: object) -> str | None:
    """Say what is wrong with ``key``, or return None when it is a valid key."""
    if not isinstance(key, str):
        return f"a key must be a str, not {type(key).__name__}"
    if not key:
        return "the key is empty"
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:
        return "the key is not valid UTF-8"
    if len(encoded) > MAX_KEY_BYTES:
        return f"the key is {len(encoded)} bytes of UTF-8, more than {MAX_KEY_BYTES}"
    if key.startswith("/"):
        return "the key starts with '/' (keys are relative to the store root)"
    if "\\" in key:
        return "the key contains a backslash (use '/' between segments)"
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in key):
        return "the key contains a NUL or control character"
    for segment in key.split("/"):
        if not segment:
            return "the key has an empty segment ('//' or a trailing '/')"
        if segment in (".", ".."):
            return f"the key has a {segment!r} segment"
        if _WINDOWS_DRIVE.match(segment):
            return "the key has a segment that starts with a Windows drive ('C:')"
        if segment.startswith(_TEMP_PREFIX):
            return f"segments starting with {_TEMP_PREFIX!r} are reserved for temporary files"
    return None


def check_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid store key, else raise ``InvalidKeyError``.

    A key is a relative, '/'-separated name of at most 1024 bytes of UTF-8 with
    no empty, '.' or '..' segment, no leading '/', no backslash, no NUL or
    control character, no segment starting with a Windows drive ('C:'), and no
    segment starting with the reserved temporary-file prefix '.dcr-tmp-'.
    """
    problem = _key_problem(key)
    if problem is not None:
        raise InvalidKeyError(f"invalid store key {key!r}: {problem}; use a key like 'a/b.json'")
    return key


# --- capabilities and backend signals -----------------------------------------------


@dataclass(frozen=True)
class Capabilities:
    """What a store's backend can do, as facts rather than hopes."""

    atomic_create: bool
    """``put_if_absent`` is a true atomic create-if-absent (safe for many writers)."""
    listing: bool
    """``list`` is supported."""
    delete: bool
    """``delete`` and ``delete_many`` are supported."""
    conditional_writes: bool | None = None
    """S3: whether the server honours ``If-None-Match: *`` (probed once per process).
    None where the backend sends no conditional request (local and ``memory://`` stores
    create atomically by other means; other fsspec backends cannot)."""


class ObjectInfo(NamedTuple):
    """One object of :meth:`Store.list_info`: its key, stored size and modification time.

    Immutable; a tuple too, so ``key, size, modified = info`` works.
    """

    key: str
    size: int
    """Stored bytes."""
    modified: datetime | None
    """When the store last wrote the object, timezone-aware UTC, by the store's own clock
    (file mtime, S3 ``LastModified``, the memory store's put time); None where the backend
    reports no time (some fsspec backends)."""


def _utc(value: object) -> datetime | None:
    """A backend's modification time (datetime or POSIX seconds) as aware UTC; None if absent.

    Raises ``ValueError`` for a value that is not a time (a hostile or broken listing).
    """
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, timezone.utc)
        except (OverflowError, OSError, ValueError):
            raise ValueError(f"modification time {value!r} is out of range") from None
    raise ValueError(f"modification time {value!r} is not a time")


def _listed_size(value: object) -> int:
    """A size from a listing: a non-negative int, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"object size {value!r} is not a byte count")
    return value


class _ObjectExists(Exception):
    """Backend signal: a create-if-absent found the name taken."""


class _ObjectTooLarge(Exception):
    """Backend signal: the object is larger than ``max_size``."""

    def __init__(self, size: int | None) -> None:
        super().__init__(size)
        self.size = size


class _OutsideRoot(Exception):
    """Backend signal: the key resolves (through a symlink) outside the store root."""


class _NoAtomicCreate(Exception):
    """Backend signal: atomic create is not available and single_writer is off."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason


class _NoHardLinks(Exception):
    """Backend signal: the local filesystem refuses hard links, which atomic create needs."""


# --- local backend ---------------------------------------------------------------


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _fsync_dir(path: str) -> None:
    """Persist a directory's entries; best effort (some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


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


class _LocalBackend:
    """Objects as files under a local directory, written crash-safely with ``os`` calls."""

    capabilities = Capabilities(atomic_create=True, listing=True, delete=True)

    def __init__(self, root: str) -> None:
        self.root = root
        self.url = "file://" + PurePath(root).as_posix()

    def _real_root(self) -> str:
        return os.path.realpath(self.root)

    def _resolve(self, key: str) -> str:
        """Real path of ``key``, refusing any that a symlink leads outside the root."""
        real = os.path.realpath(os.path.join(self.root, key))
        if not _is_within(real, self._real_root()):
            raise _OutsideRoot
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
                raise _ObjectTooLarge(st.st_size)
            limit = None if max_size is None else max(max_size + 1, 0)
            data = _read_fd(fd, st.st_size, limit)
        finally:
            os.close(fd)
        if max_size is not None and len(data) > max_size:
            raise _ObjectTooLarge(None)
        return data

    def _makedirs(self, path: str) -> None:
        missing: list[str] = []
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
                _fsync_dir(os.path.dirname(directory))

    def _write_temp(self, directory: str, data: bytes) -> str:
        """Write ``data`` durably to a new temporary file in ``directory``; return its path."""
        self._makedirs(directory)
        path = os.path.join(directory, _TEMP_PREFIX + uuid.uuid4().hex)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)
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

    def put(self, key: str, data: bytes) -> None:
        path = self._resolve(key)
        directory = os.path.dirname(path)
        temp = self._write_temp(directory, data)
        try:
            os.replace(temp, path)
        except BaseException:
            _unlink_quietly(temp)
            raise
        _fsync_dir(directory)

    def put_if_absent(self, key: str, data: bytes) -> None:
        path = self._resolve(key)
        directory = os.path.dirname(path)
        temp = self._write_temp(directory, data)
        try:
            # link(2) fails if the name exists: the create is atomic, never check-then-write.
            os.link(temp, path)
        except FileExistsError:
            raise _ObjectExists from None
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise _NoHardLinks from exc
            raise
        finally:
            _unlink_quietly(temp)
        _fsync_dir(directory)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._resolve(key))

    def size(self, key: str) -> int:
        path = self._resolve(key)
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(errno.ENOENT, "not a regular file", path)
        return st.st_size

    def _walk(self, prefix: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """(key, entry) of every object under ``prefix``, in no particular order."""
        real_root = self._real_root()
        start = os.path.join(self.root, prefix) if prefix else self.root
        if prefix and not _is_within(os.path.realpath(start), real_root):
            raise _OutsideRoot
        pending = [(start, prefix)]
        while pending:
            directory, rel = pending.pop()
            try:
                entries = os.scandir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with entries:
                for entry in entries:
                    if entry.name.startswith(_TEMP_PREFIX):
                        continue
                    key = rel + entry.name
                    # Symlinked directories are not followed (no loops, no escapes).
                    if entry.is_dir(follow_symlinks=False):
                        pending.append((entry.path, key + "/"))
                        continue
                    if not entry.is_file(follow_symlinks=False):
                        if not entry.is_symlink():
                            continue
                        target = os.path.realpath(entry.path)
                        if not (_is_within(target, real_root) and os.path.isfile(target)):
                            continue
                    if _key_problem(key) is None:
                        yield key, entry

    def list(self, prefix: str) -> list[str]:
        return sorted(key for key, _ in self._walk(prefix))

    def list_info(self, prefix: str) -> list[ObjectInfo]:
        infos = []
        for key, entry in self._walk(prefix):
            try:
                st = entry.stat()  # a symlink inside the root: its target's size and time
            except FileNotFoundError:
                continue  # deleted since the directory was read
            when = datetime.fromtimestamp(st.st_mtime_ns / 1e9, timezone.utc)
            infos.append(ObjectInfo(key, st.st_size, when))
        infos.sort()
        return infos

    def delete(self, key: str) -> None:
        # Resolve only the parent: deleting a symlink removes the link, not its target.
        lexical = os.path.join(self.root, key)
        parent = os.path.realpath(os.path.dirname(lexical))
        if not _is_within(parent, self._real_root()):
            raise _OutsideRoot
        try:
            os.unlink(os.path.join(parent, os.path.basename(lexical)))
        except (FileNotFoundError, NotADirectoryError):
            pass


# --- fsspec backend ----------------------------------------------------------------


def _implements(fs: AbstractFileSystem, *names: str) -> bool:
    """Whether ``fs``'s class overrides any of the named base-class methods."""
    for name in names:
        method = getattr(type(fs), name, None)
        bases = (getattr(AbstractFileSystem, name, None), getattr(AsyncFileSystem, name, None))
        if method is not None and all(method is not base for base in bases):
            return True
    return False


class _FsspecBackend:
    """Objects through an fsspec filesystem; no local-disk assumptions."""

    def __init__(self, fs: AbstractFileSystem, root: str, url: str, *, single_writer: bool) -> None:
        self.fs = fs
        self.url = url
        # How this filesystem spells a path under the root, e.g. "/name/" or "bucket/prefix/".
        self.prefix = fs._strip_protocol(f"{root.rstrip('/')}/x" if root.strip("/") else "x")[:-1]
        self.single_writer = single_writer
        # Only fsspec's own memory filesystem is known to be process-local, where a lock suffices.
        self.lock = _MEMORY_LOCK if type(fs) is MemoryFileSystem else None
        self.capabilities = Capabilities(
            atomic_create=self.lock is not None,
            listing=_implements(fs, "ls", "_ls"),
            delete=_implements(fs, "rm_file", "_rm", "rm", "_rm_file"),
        )

    def _path(self, key: str) -> str:
        return self.prefix + key

    def probe_conditional_writes(self) -> bool:
        return self.capabilities.atomic_create  # fsspec has no conditional write to try

    def _locked(self) -> contextlib.AbstractContextManager[Any]:
        return self.lock if self.lock is not None else contextlib.nullcontext()

    def _info(self, path: str) -> dict[str, Any]:
        self.fs.invalidate_cache(path)
        info = self.fs.info(path)
        if info.get("type", "file") != "file":
            raise FileNotFoundError(errno.ENOENT, "not an object", path)
        return info

    def get(self, key: str, max_size: int | None) -> bytes:
        path = self._path(key)
        if max_size is None:
            self.fs.invalidate_cache(path)
            return bytes(self.fs.cat_file(path))
        size = self._info(path).get("size")
        if size is not None and size > max_size:
            raise _ObjectTooLarge(size)
        # Ranged even when the size is known: never read more than one byte past the limit.
        data = self.fs.cat_file(path, start=0, end=max(max_size + 1, 0))
        if len(data) > max_size:
            raise _ObjectTooLarge(size)
        return bytes(data)

    def put(self, key: str, data: bytes) -> None:
        with self._locked():
            self.fs.pipe_file(self._path(key), data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        if self.lock is None and not self.single_writer:
            raise _NoAtomicCreate
        path = self._path(key)
        # Check-then-write: atomic under the memory lock; with single_writer it is only
        # safe because the caller promised that no other process writes this store.
        with self._locked():
            self.fs.invalidate_cache(path)
            if self.fs.exists(path):
                raise _ObjectExists
            self.fs.pipe_file(path, data)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        return bool(self.fs.isfile(path))

    def size(self, key: str) -> int:
        size = self._info(self._path(key)).get("size")
        if size is None:
            raise NotImplementedError("the backend does not report object sizes")
        return int(size)

    def _find(self, prefix: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """(key, fsspec info) of every object under ``prefix``."""
        # A client-side listing cache could hide objects other processes wrote.
        self.fs.invalidate_cache()
        under = self.prefix + prefix
        try:
            found = self.fs.find(under.rstrip("/"), detail=True)
        except FileNotFoundError:
            return
        for name, info in found.items():
            if info.get("type", "file") != "file" or not name.startswith(under):
                continue
            key = name[len(self.prefix) :]
            if _key_problem(key) is None:
                yield key, info

    def list(self, prefix: str) -> list[str]:
        return sorted(key for key, _ in self._find(prefix))

    def list_info(self, prefix: str) -> list[ObjectInfo]:
        infos = []
        for key, info in self._find(prefix):
            when = None
            for field in ("LastModified", "mtime", "last_modified", "modified", "created"):
                if info.get(field) is not None:
                    when = _utc(info[field])
                    break
            infos.append(ObjectInfo(key, _listed_size(info.get("size")), when))
        infos.sort()
        return infos

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._locked():
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)


# --- store ------------------------------------------------------------------------------


def _local_root(url: str | os.PathLike[str]) -> str | None:
    """The absolute directory of a local store URL, or None when fsspec must handle it."""
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


def _fsspec_url(fs: AbstractFileSystem, url: str, root: str) -> str:
    if "::" in url:  # chained URL: keep the chain as written
        return url.rstrip("/")
    if type(fs) is MemoryFileSystem:
        return "memory://" + root.strip("/")
    return fs.unstrip_protocol(root.rstrip("/") or root)


def _describe(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())


class Store:
    """An object store rooted at a local path or fsspec URL; every format byte goes through it.

    Keys are relative '/'-separated names checked by :func:`check_key`.
    ``storage_options`` are passed to the fsspec filesystem (ignored for local
    paths; for ``s3://`` they are s3fs options and override the AWS environment).
    ``single_writer=True`` lets ``put_if_absent`` fall back to an unsafe
    check-then-write on backends without atomic create (including S3-compatible
    servers that ignore ``If-None-Match``); set it only when a single process
    ever writes the store.

    A Store is safe to use from several threads at once.
    """

    url: str
    """The normalised root URL (``file:///abs/path``, ``memory://name``, ``s3://b/p``, ...)."""
    single_writer: bool
    """Whether the caller promised that only one process writes this store."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        single_writer: bool = False,
    ) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise TypeError(f"store URL must be a str or path, not {type(url).__name__}")
        if isinstance(url, str) and not url.strip():
            raise StoreError("empty store URL; pass a path like './refit-store' or an fsspec URL")
        self.single_writer = single_writer
        root = _local_root(url)
        backend: _LocalBackend | _FsspecBackend | S3Backend
        if root is not None:
            backend = _LocalBackend(root)
        elif isinstance(url, str) and url.startswith(_S3_SCHEMES):
            backend = _open_s3(url, storage_options, single_writer=single_writer)
        else:
            assert isinstance(url, str)
            try:
                fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
            except (ImportError, ValueError) as exc:
                raise CapabilityError(
                    f"cannot open store {url}: {_describe(exc)}; "
                    "install the fsspec backend for this protocol or fix the URL"
                ) from exc
            except OSError as exc:
                raise StoreError(
                    f"cannot open store {url}: {_describe(exc)}; "
                    "check the URL, credentials and connectivity, then retry"
                ) from exc
            backend = _FsspecBackend(
                fs, path, _fsspec_url(fs, url, path), single_writer=single_writer
            )
        self._backend = backend
        self.url = backend.url

    @property
    def capabilities(self) -> Capabilities:
        """What the backend can do.

        For ``s3://`` the first use in a process probes the server (two small
        conditional writes to a reserved temporary key, then a delete); see
        :meth:`probe_conditional_writes`.
        """
        with self._translated("", "probe conditional writes in", where=f"store {self.url}"):
            return self._backend.capabilities

    def probe_conditional_writes(self) -> bool:
        """Whether a create-if-absent is refused when the object exists (asks the server).

        On ``s3://`` this writes a reserved temporary key (``.dcr-tmp-probe-<id>``,
        never listed) twice with ``If-None-Match: *``, deletes it, and returns
        whether the second write was refused; the answer also updates what
        :attr:`capabilities` reports in this process. Local and ``memory://``
        stores return True without any request (they create atomically); other
        fsspec backends return False (they have no conditional write).
        """
        with self._translated("", "probe conditional writes in", where=f"store {self.url}"):
            return self._backend.probe_conditional_writes()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _key(self, key: str) -> str:
        problem = _key_problem(key)
        if problem is not None:
            raise InvalidKeyError(
                f"invalid key {key!r} for store {self.url}: {problem}; use a key like 'a/b.json'"
            )
        return key

    @contextlib.contextmanager
    def _translated(
        self,
        key: str,
        action: str,
        *,
        reading: bool = False,
        max_size: int | None = None,
        where: str | None = None,
    ) -> Iterator[None]:
        """Turn backend errors into dcr-format errors; the one place that does so."""
        where = where or f"{key!r} in store {self.url}"
        try:
            yield
        except DcrError:
            raise
        except _OutsideRoot:
            raise InvalidKeyError(
                f"key {key!r} leads outside store {self.url} through a symlink; "
                "remove the symlink or keep its target inside the store"
            ) from None
        except _ObjectExists:
            raise ObjectExistsError(
                f"object {where} already exists; another writer created it, re-read it instead"
            ) from None
        except _ObjectTooLarge as exc:
            size = "larger" if exc.size is None else f"{exc.size} bytes, larger"
            raise ObjectTooLargeError(
                f"object {where} is {size} than the {max_size}-byte limit; "
                "the object is corrupt or not from this format"
            ) from None
        except _NoAtomicCreate as exc:
            if exc.reason is not None:
                raise CapabilityError(
                    f"store {self.url} cannot create {key!r} atomically: {exc.reason}; pass "
                    "single_writer=True (one writer only): Store(url, single_writer=True)"
                ) from None
            raise CapabilityError(
                f"store {self.url} cannot create {key!r} atomically; use a local path or "
                "memory://, or open it with single_writer=True if one process alone writes"
            ) from None
        except _NoHardLinks as exc:
            raise CapabilityError(
                f"the filesystem of store {self.url} refuses hard links, which atomic create "
                f"of {key!r} needs ({_describe(exc.__cause__ or exc)}); use a POSIX filesystem"
            ) from None
        except NotImplementedError as exc:
            raise CapabilityError(
                f"store {self.url} cannot {action} {key!r}: {_describe(exc)}; "
                "use a backend that supports it"
            ) from exc
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            if not reading:
                raise StoreError(
                    f"could not {action} {where}: {_describe(exc)}; "
                    "check that the store root exists and is writable, then retry"
                ) from exc
            raise ObjectNotFoundError(
                f"no object {where}; check the key and the store URL"
            ) from exc
        except OSError as exc:
            raise StoreError(
                f"could not {action} {where}: {_describe(exc)}; "
                "check that the store is reachable and writable, then retry"
            ) from exc

    def _require(self, capability: str, action: str) -> None:
        if not getattr(self.capabilities, capability):
            raise CapabilityError(
                f"store {self.url} does not support {action}; use a backend that does"
            )

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        """Return the bytes of ``key``.

        Raises ``ObjectNotFoundError`` if it is missing and ``ObjectTooLargeError``
        if ``max_size`` is given and the object is larger; the size is checked
        before reading where the backend reports it, and no more than
        ``max_size + 1`` bytes are read in any case.
        """
        self._key(key)
        with self._translated(key, "read", reading=True, max_size=max_size):
            return self._backend.get(key, max_size)

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``key``, replacing any object there (atomically on local disk)."""
        self._key(key)
        with self._translated(key, "write"):
            self._backend.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create ``key`` with ``data``; raise ``ObjectExistsError`` if it already exists.

        Atomic on local disk, ``memory://`` and S3 servers that honour
        ``If-None-Match: *`` (probed once per process). Elsewhere it raises
        ``CapabilityError`` unless the store was opened with ``single_writer=True``,
        in which case it checks then writes (unsafe with several writers).
        On S3 an outcome that cannot be known (a timeout, a 5xx, an answer to a
        re-sent request) raises ``StoreError``, never ``ObjectExistsError``:
        re-read the object to learn whether this write landed.
        """
        self._key(key)
        with self._translated(key, "create"):
            self._backend.put_if_absent(key, data)

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        self._key(key)
        with self._translated(key, "check"):
            return self._backend.exists(key)

    def size(self, key: str) -> int:
        """The size in bytes of the object at ``key``; ``ObjectNotFoundError`` if missing."""
        self._key(key)
        with self._translated(key, "stat", reading=True):
            return self._backend.size(key)

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys of every object under ``prefix``, recursively.

        ``prefix`` is '' (the whole store) or a key naming a directory, with or
        without a trailing '/'; it matches whole segments, so ``list("objects/1")``
        does not return ``objects/10/...``. A missing prefix gives ``[]``.
        Temporary files and entries whose names are not valid keys are skipped.
        """
        return self._listing(prefix, self._backend.list)

    def _prefix(self, prefix: str) -> str:
        """``prefix`` checked and normalised to '' or 'a/b/'."""
        if prefix == "":
            return ""
        problem = _key_problem(prefix[:-1] if prefix.endswith("/") else prefix)
        if problem is not None:
            raise InvalidKeyError(
                f"invalid prefix {prefix!r} for store {self.url}: {problem}; "
                "use '' or a key like 'objects/1/'"
            )
        return prefix.rstrip("/") + "/"

    def list_info(self, prefix: str = "") -> list[ObjectInfo]:
        """Like :meth:`list`, with each object's size and modification time, sorted by key.

        The times are the store's own (file mtime, S3 ``LastModified``, the memory
        store's put time), so they can be compared with each other whatever this
        machine's clock says. A listing whose sizes or times are not valid raises
        ``StoreError``.
        """
        return self._listing(prefix, self._backend.list_info)

    def _listing(self, prefix: str, lister: Callable[[str], list[T]]) -> list[T]:
        directory = self._prefix(prefix)
        self._require("listing", "listing")
        with self._translated(directory, "list"):
            try:
                return lister(directory)
            except (TypeError, ValueError) as exc:
                raise StoreError(
                    f"store {self.url} answered a listing of {directory!r} with an invalid "
                    f"entry ({_describe(exc)}); check the store or the server"
                ) from None

    def delete(self, key: str) -> None:
        """Delete the object at ``key``; a missing object is not an error."""
        self._key(key)
        self._require("delete", "delete")
        with self._translated(key, "delete"):
            self._backend.delete(key)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete every object in ``keys`` (all keys are checked before any is deleted)."""
        checked = [self._key(key) for key in keys]
        self._require("delete", "delete")
        delete_many = getattr(self._backend, "delete_many", None)
        if delete_many is not None:  # one request per batch of keys
            if checked:
                with self._translated(
                    checked[0], "delete", where=f"{len(checked)} objects in store {self.url}"
                ):
                    delete_many(checked)
            return
        for key in checked:
            with self._translated(key, "delete"):
                self._backend.delete(key)


_S3_SCHEMES = ("s3://", "s3a://")


def _open_s3(url: str, storage_options: dict[str, Any] | None, *, single_writer: bool) -> S3Backend:
    try:
        from dcr_format._s3 import S3Backend
    except ImportError as exc:
        raise CapabilityError(
            f"cannot open store {url}: {_describe(exc)}; install the S3 extra: "
            "pip install 'dcr-format[s3]'"
        ) from exc
    try:
        return S3Backend(url, storage_options, single_writer=single_writer)
    except (TypeError, ValueError) as exc:
        raise StoreError(
            f"cannot open store {url}: {_describe(exc)}; use s3://bucket/prefix and valid "
            "storage_options"
        ) from exc


def open_store(store: Store | str | os.PathLike[str]) -> Store:
    """Return ``store`` itself if it is a :class:`Store`, else open a Store at that URL or path."""
    if isinstance(store, Store):
        return store
    return Store(store)
