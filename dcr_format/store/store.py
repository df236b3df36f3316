"""Object store over local paths and fsspec URLs: every byte the format writes goes through here.

A :class:`Store` is a root URL holding objects named by relative keys
(``commits/00000000000000000001.json``). It is a thin layer over a backend
(the :class:`Backend` protocol, private modules ``dcr_format/store/_*.py``):
the Store checks every key, enforces size limits and capabilities, normalises
listing prefixes and translates every backend error, in one place
(``Store._translated``), into the errors of :mod:`dcr_format.errors`. The
backend is chosen from the URL:

- local paths (``./refit-store``, ``/abs/path``, ``file:///abs/path``): built on
  ``os`` (not fsspec) so that ``put`` is crash-safe (temporary file, fsync,
  rename) and ``put_if_absent`` is an atomic create (hard link, which fails if
  the name exists). Temporary files live next to their object under names
  starting with :data:`TEMP_PREFIX` (``.dcr-tmp-``); ``list`` never reports them
  and :func:`check_key` refuses keys that use that prefix.
- ``memory://name``: fsspec's process-local memory filesystem; a process-wide
  lock makes check-and-write atomic, so it supports atomic create too (among
  Store users; code that writes memory:// directly through fsspec bypasses it).
- ``s3://bucket/prefix`` (and ``s3a://``): AWS S3 or an S3-compatible server
  through s3fs (the ``s3`` extra). Endpoint, region and credentials come from
  the standard AWS environment and config files (``AWS_ENDPOINT_URL``,
  ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ...); ``storage_options`` (s3fs's
  ``endpoint_url``, ``key``, ``secret``, ``client_kwargs``, ``config_kwargs``,
  ...) override them. ``put_if_absent`` is a ``PUT`` with ``If-None-Match: *``;
  whether the server honours that header is probed once per process
  (:meth:`Store.probe_conditional_writes`), and a server that ignores it is
  treated like a backend without atomic create. Transient failures are retried
  there (capped exponential backoff), never a conditional write.
- any other fsspec URL: goes through fsspec with no local-disk assumptions.
  Such a backend is not known to create atomically, so ``put_if_absent``
  refuses with :class:`~dcr_format.errors.CapabilityError` unless the store
  was opened with ``single_writer=True``.

What a store is and can do is asked of the Store, never read from its URL:
:attr:`Store.kind` (``local``, ``memory``, ``s3``, ``fsspec``, ``relay``),
:attr:`Store.local_root` (the directory of a local store, else None) and
:attr:`Store.capabilities`.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from dcr_format.errors import (
    ArgumentError,
    CapabilityError,
    DcrError,
    InvalidKeyError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreError,
)
from dcr_format.store._backends import describe, open_backend
from dcr_format.store._base import (
    MAX_KEY_BYTES,
    TEMP_PREFIX,
    Backend,
    Capabilities,
    Kind,
    NoAtomicCreate,
    NoHardLinks,
    ObjectExists,
    ObjectInfo,
    ObjectTooLarge,
    OutsideRoot,
    key_problem,
    retrying,
    temporary_key_problem,
)
from dcr_format.store.host_cache import HostCache

__all__ = [
    "MAX_KEY_BYTES",
    "TEMP_PREFIX",
    "Backend",
    "Capabilities",
    "Kind",
    "ObjectInfo",
    "Store",
    "check_key",
    "open_store",
]

T = TypeVar("T")

_BACKEND_METHODS = (
    "probe_conditional_writes",
    "get",
    "put",
    "put_if_absent",
    "exists",
    "size",
    "list",
    "list_info",
    "delete",
    "delete_many",
    "list_temporary",
    "delete_temporary",
)


def check_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid store key, else raise ``InvalidKeyError``.

    A key is a relative, '/'-separated name of at most 1024 bytes of UTF-8 with
    no empty, '.' or '..' segment, no leading '/', no backslash, no NUL or
    control character, no segment starting with a Windows drive ('C:'), and no
    segment starting with the reserved temporary-file prefix '.dcr-tmp-'.
    """
    problem = key_problem(key)
    if problem is not None:
        raise InvalidKeyError(f"invalid store key {key!r}: {problem}; use a key like 'a/b.json'")
    return key


class Store:
    """An object store rooted at a local path or fsspec URL; every format byte goes through it.

    Keys are relative '/'-separated names checked by :func:`check_key`.
    ``storage_options`` are passed to the fsspec filesystem (ignored for local
    paths; for ``s3://`` they are s3fs options and override the AWS environment).
    ``single_writer=True`` lets ``put_if_absent`` fall back to an unsafe
    check-then-write on backends without atomic create (including S3-compatible
    servers that ignore ``If-None-Match``); set it only when a single process
    ever writes the store.

    ``url`` may also be a backend object (the :class:`Backend` protocol), which
    carries its own options.

    ``host_cache`` (a :class:`~dcr_format.store.host_cache.HostCache`, or its directory):
    the readers of one host that pass the same directory read each verified object from
    the store once between them (tensor-parallel ranks, engines of one run).

    A Store is safe to use from several threads at once.
    """

    url: str
    """The normalised root URL (``file:///abs/path``, ``memory://name``, ``s3://b/p``, ...)."""

    def __init__(
        self,
        url: str | os.PathLike[str] | Backend,
        *,
        storage_options: dict[str, Any] | None = None,
        single_writer: bool = False,
        host_cache: HostCache | str | os.PathLike[str] | None = None,
    ) -> None:
        backend: Backend
        if isinstance(url, (str, os.PathLike)):
            if isinstance(url, str) and not url.strip():
                raise StoreError(
                    "empty store URL; pass a path like './refit-store' or an fsspec URL"
                )
            backend = open_backend(url, storage_options, single_writer=single_writer)
        elif all(callable(getattr(type(url), name, None)) for name in _BACKEND_METHODS):
            if storage_options is not None or single_writer:
                raise ArgumentError(
                    "storage_options and single_writer apply to store URLs; "
                    "a backend carries its own"
                )
            backend = url
        else:
            raise ArgumentError(f"store URL must be a str or path, not {type(url).__name__}")
        self._backend = backend
        self.url = backend.url
        self.host_cache: HostCache | None = (
            host_cache
            if host_cache is None or isinstance(host_cache, HostCache)
            else HostCache(host_cache)
        )

    @property
    def single_writer(self) -> bool:
        """Whether the caller promised that only one process writes this store."""
        return self._backend.single_writer

    @property
    def kind(self) -> Kind:
        """Which backend holds the objects: ``local``, ``memory``, ``s3``, ``fsspec`` or
        ``relay``; ask this (or :attr:`capabilities`), never parse :attr:`url`."""
        return self._backend.kind

    @property
    def local_root(self) -> str | None:
        """The absolute directory holding the objects of a local store (where temporary
        files of crashed writes lie, FORMAT.md §2.5); None for every other kind."""
        return self._backend.local_root

    @property
    def capabilities(self) -> Capabilities:
        """What the backend can do.

        For ``s3://`` the first use in a process probes the server (two small
        conditional writes to a reserved temporary key, then a delete); see
        :meth:`probe_conditional_writes`.
        """
        with self._translated("", "probe conditional writes in", where=f"store {self.url}"):
            return self._retried(lambda: self._backend.capabilities)

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
            return self._retried(self._backend.probe_conditional_writes)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _key(self, key: str) -> str:
        problem = key_problem(key)
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
        except OutsideRoot:
            raise InvalidKeyError(
                f"key {key!r} leads outside store {self.url} through a symlink; "
                "remove the symlink or keep its target inside the store"
            ) from None
        except ObjectExists:
            raise ObjectExistsError(
                f"object {where} already exists; another writer created it, re-read it instead"
            ) from None
        except ObjectTooLarge as exc:
            size = "larger" if exc.size is None else f"{exc.size} bytes, larger"
            raise ObjectTooLargeError(
                f"object {where} is {size} than the {max_size}-byte limit; "
                "the object is corrupt or not from this format"
            ) from None
        except NoAtomicCreate as exc:
            if exc.reason is not None:
                raise CapabilityError(
                    f"store {self.url} cannot create {key!r} atomically: {exc.reason}; pass "
                    "single_writer=True (one writer only): Store(url, single_writer=True)"
                ) from None
            raise CapabilityError(
                f"store {self.url} cannot create {key!r} atomically; use a local path or "
                "memory://, or open it with single_writer=True if one process alone writes"
            ) from None
        except NoHardLinks as exc:
            raise CapabilityError(
                f"the filesystem of store {self.url} refuses hard links, which atomic create "
                f"of {key!r} needs ({describe(exc.__cause__ or exc)}); use a POSIX filesystem"
            ) from None
        except NotImplementedError as exc:
            raise CapabilityError(
                f"store {self.url} cannot {action} {key!r}: {describe(exc)}; "
                "use a backend that supports it"
            ) from exc
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            if not reading:
                raise StoreError(
                    f"could not {action} {where}: {describe(exc)}; "
                    "check that the store root exists and is writable, then retry"
                ) from exc
            raise ObjectNotFoundError(
                f"no object {where}; check the key and the store URL"
            ) from exc
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreError(
                    f"could not {action} {where}: {describe(exc)}; the store's disk or quota "
                    "is full: free space (`dcr gc --keep-last K` deletes old versions), "
                    "then retry"
                ) from exc
            if exc.errno == errno.EROFS:
                raise StoreError(
                    f"could not {action} {where}: {describe(exc)}; the store's filesystem "
                    "is mounted read-only: use a writable store"
                ) from exc
            allowed = "reading" if reading else "writing"
            raise StoreError(
                f"could not {action} {where}: {describe(exc)}; check that the store is "
                f"reachable and that its credentials allow {allowed}, then retry"
            ) from exc

    def _retried(self, call: Callable[[], T]) -> T:
        """``call()`` tried again after transient failures, as the backend's policy says."""
        return retrying(call, self._backend.retry)

    def _require(self, capability: str, action: str) -> None:
        if not getattr(self.capabilities, capability):
            raise CapabilityError(
                f"store {self.url} does not support {action}; use a backend that does"
            )

    def _writable(self, action: str) -> None:
        capabilities = self.capabilities
        if not capabilities.writable:
            raise StoreError(f"cannot {action} through {self!r}: {capabilities.read_only}")

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        """Return the bytes of ``key``.

        Raises ``ObjectNotFoundError`` if it is missing and ``ObjectTooLargeError``
        if ``max_size`` is given and the object is larger; the size is checked
        before reading where the backend reports it, and no more than
        ``max_size + 1`` bytes are read in any case.
        """
        self._key(key)
        with self._translated(key, "read", reading=True, max_size=max_size):
            return self._retried(lambda: self._backend.get(key, max_size))

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``key``, replacing any object there (atomically on local disk)."""
        self._key(key)
        self._writable(f"write {key!r}")
        with self._translated(key, "write"):
            self._retried(lambda: self._backend.put(key, data))

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
        self._writable(f"create {key!r}")
        with self._translated(key, "create"):
            self._backend.put_if_absent(key, data)  # never retried: see the docstring

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        self._key(key)
        with self._translated(key, "check"):
            return self._retried(lambda: self._backend.exists(key))

    def size(self, key: str) -> int:
        """The size in bytes of the object at ``key``; ``ObjectNotFoundError`` if missing."""
        self._key(key)
        with self._translated(key, "stat", reading=True):
            return self._retried(lambda: self._backend.size(key))

    def list(self, prefix: str = "") -> builtins.list[str]:
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
        problem = key_problem(prefix[:-1] if prefix.endswith("/") else prefix)
        if problem is not None:
            raise InvalidKeyError(
                f"invalid prefix {prefix!r} for store {self.url}: {problem}; "
                "use '' or a key like 'objects/1/'"
            )
        return prefix.rstrip("/") + "/"

    def list_info(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Like :meth:`list`, with each object's size and modification time, sorted by key.

        The times are the store's own (file mtime, S3 ``LastModified``, the memory
        store's put time), so they can be compared with each other whatever this
        machine's clock says. A listing whose sizes or times are not valid raises
        ``StoreError``.
        """
        return self._listing(prefix, self._backend.list_info)

    def _listing(self, prefix: str, lister: Callable[[str], builtins.list[T]]) -> builtins.list[T]:
        directory = self._prefix(prefix)
        self._require("listing", "listing")
        with self._translated(directory, "list"):
            try:
                return self._retried(lambda: lister(directory))
            except (TypeError, ValueError) as exc:
                raise StoreError(
                    f"store {self.url} answered a listing of {directory!r} with an invalid "
                    f"entry ({describe(exc)}); check the store or the server"
                ) from None

    def delete(self, key: str) -> None:
        """Delete the object at ``key``; a missing object is not an error."""
        self._key(key)
        self._writable(f"delete {key!r}")
        self._require("delete", "delete")
        with self._translated(key, "delete"):
            self._retried(lambda: self._backend.delete(key))

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete every object in ``keys`` (all keys are checked before any is deleted)."""
        checked = [self._key(key) for key in keys]
        self._writable("delete objects")
        self._require("delete", "delete")
        if self.capabilities.batch_delete:  # one request per batch of keys
            if checked:
                with self._translated(
                    checked[0], "delete", where=f"{len(checked)} objects in store {self.url}"
                ):
                    self._retried(lambda: self._backend.delete_many(checked))
            return
        for key in checked:
            with self._translated(key, "delete"):
                self._retried(functools.partial(self._backend.delete, key))

    def list_temporary(self) -> builtins.list[ObjectInfo]:
        """The temporary files of writes that never finished (FORMAT.md §2.5), sorted by key.

        Keys are relative to the root, their last segment starts with :data:`TEMP_PREFIX`;
        sizes and times are the store's, as in :meth:`list_info`. A local store's are the
        files a write killed before its rename leaves; an ``s3://`` store's the probe keys
        of a process killed during :meth:`probe_conditional_writes`; other stores write none
        (``[]``). Such keys are not object keys: only :meth:`delete_temporary` takes them.
        """
        self._require("listing", "listing")
        with self._translated("", "list temporary files in", where=f"store {self.url}"):
            found = self._retried(self._backend.list_temporary)
        for info in found:
            problem = temporary_key_problem(info.key)
            if problem is not None:
                raise StoreError(
                    f"store {self.url} listed temporary file {info.key!r}, whose key is not "
                    f"valid ({problem}); check the store backend"
                )
        return found

    def delete_temporary(self, keys: Iterable[str]) -> None:
        """Delete the named temporary files (keys from :meth:`list_temporary`; all are checked
        before any is deleted). A missing one is not an error; a key that is not a temporary
        file's raises ``InvalidKeyError``. Name no live write's file: pick files older than
        any write takes (gc waits for its grace period)."""
        checked = []
        for key in keys:
            problem = temporary_key_problem(key)
            if problem is not None:
                raise InvalidKeyError(
                    f"invalid temporary file key {key!r} for store {self.url}: {problem}; "
                    "pass keys that list_temporary returned"
                )
            checked.append(key)
        if not checked:
            return
        self._writable("delete temporary files")
        self._require("delete", "delete")
        where = f"{len(checked)} temporary files in store {self.url}"
        with self._translated(checked[0], "delete", where=where):
            self._retried(lambda: self._backend.delete_temporary(checked))


def open_store(store: Store | str | os.PathLike[str]) -> Store:
    """Return ``store`` itself if it is a :class:`Store`, else open a Store at that URL or path."""
    if isinstance(store, Store):
        return store
    return Store(store)
