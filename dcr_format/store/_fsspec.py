"""The fsspec backend: objects through any fsspec filesystem, with no local-disk assumptions.

Such a filesystem is not known to create atomically, so ``put_if_absent``
signals :class:`~dcr_format.store._base.NoAtomicCreate` unless the store was
opened with ``single_writer=True`` (then it checks, then writes). The
``memory://`` backend (:mod:`dcr_format.store._memory`) is this one with a
process-wide lock that makes the check and the write one step.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from fsspec.asyn import AsyncFileSystem
from fsspec.spec import AbstractFileSystem

from dcr_format.store._base import (
    Capabilities,
    Kind,
    NoAtomicCreate,
    ObjectExists,
    ObjectInfo,
    ObjectTooLarge,
    RetryPolicy,
    key_problem,
    listed_size,
    utc,
)

__all__ = ["FsspecBackend", "fsspec_url"]


def fsspec_url(fs: AbstractFileSystem, url: str, root: str) -> str:
    """The normalised root URL of a store at ``root`` of ``fs``, opened as ``url``."""
    if "::" in url:  # chained URL: keep the chain as written
        return url.rstrip("/")
    return str(fs.unstrip_protocol(root.rstrip("/") or root))


def _implements(fs: AbstractFileSystem, *names: str) -> bool:
    """Whether ``fs``'s class overrides any of the named base-class methods."""
    for name in names:
        method = getattr(type(fs), name, None)
        bases = (getattr(AbstractFileSystem, name, None), getattr(AsyncFileSystem, name, None))
        if method is not None and all(method is not base for base in bases):
            return True
    return False


class FsspecBackend:
    """Objects through an fsspec filesystem; no local-disk assumptions.

    ``lock``, when given, is held around every check-and-write and makes
    ``put_if_absent`` atomic among the users of that lock (the memory backend's).
    """

    kind: Kind = "fsspec"
    local_root: str | None = None
    retry: RetryPolicy | None = None  # no failure of a generic filesystem is known transient

    def __init__(
        self,
        fs: AbstractFileSystem,
        root: str,
        url: str,
        *,
        single_writer: bool,
        lock: threading.Lock | None = None,
    ) -> None:
        self.fs = fs
        self.url = url
        # How this filesystem spells a path under the root, e.g. "/name/" or "bucket/prefix/".
        under = f"{root.rstrip('/')}/x" if root.strip("/") else "x"
        self.prefix: str = str(fs._strip_protocol(under))[:-1]
        self.single_writer = single_writer
        self.lock = lock
        self.capabilities = Capabilities(
            atomic_create=lock is not None,
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
        info: dict[str, Any] = self.fs.info(path)
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
            raise ObjectTooLarge(size)
        # Ranged even when the size is known: never read more than one byte past the limit.
        data = self.fs.cat_file(path, start=0, end=max(max_size + 1, 0))
        if len(data) > max_size:
            raise ObjectTooLarge(size)
        return bytes(data)

    def put(self, key: str, data: bytes) -> None:
        with self._locked():
            self.fs.pipe_file(self._path(key), data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        if self.lock is None and not self.single_writer:
            raise NoAtomicCreate
        path = self._path(key)
        # Check-then-write: atomic under the memory lock; with single_writer it is only
        # safe because the caller promised that no other process writes this store.
        with self._locked():
            self.fs.invalidate_cache(path)
            if self.fs.exists(path):
                raise ObjectExists
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
            if key_problem(key) is None:
                yield key, info

    def list(self, prefix: str) -> builtins.list[str]:
        return sorted(key for key, _ in self._find(prefix))

    def list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        infos = []
        for key, info in self._find(prefix):
            when = None
            for field in ("LastModified", "mtime", "last_modified", "modified", "created"):
                if info.get(field) is not None:
                    when = utc(info[field])
                    break
            infos.append(ObjectInfo(key, listed_size(info.get("size")), when))
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

    def delete_many(self, keys: builtins.list[str]) -> None:
        for key in keys:
            self.delete(key)

    def list_temporary(self) -> builtins.list[ObjectInfo]:
        return []  # every write is one pipe_file: no temporary file is ever left

    def delete_temporary(self, keys: builtins.list[str]) -> None:
        pass  # there are none (see list_temporary)
