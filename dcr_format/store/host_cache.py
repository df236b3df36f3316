"""Objects shared by the readers of one host.

The tensor-parallel ranks of an engine each read every shard of a version (each holds a
slice of every tensor), and a host often runs several engines of one run: without
sharing, a host downloads each object once per reader. A :class:`HostCache` is a
directory the readers of a host share: the first to need an object reads it from the
store (the others wait for it, one lock file per object), checks it, and leaves it
there; the others take it from the directory, checked again. Entries are named by the
sha256 the chain records for them, so they never change and a reader takes only the
bytes it asked for; an entry that is not those bytes is replaced. The directory holds at
most ``max_bytes`` (the entries used longest ago go first). It is a cache only: where the
directory cannot be used or written (another user's, a full ``/dev/shm``), a reader
reads the store as without it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from dcr_format.errors import ArgumentError

DEFAULT_MAX_BYTES = 4 << 30
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TEMPORARY = ".tmp-"
_LOCK = ".lock"


def default_directory() -> Path:
    """This user's shared directory of the host: in ``/dev/shm`` (memory) where the host
    has it, else in the temporary directory."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root / f"dcr-host-cache-{os.getuid()}"


class HostCache:
    """A directory of verified objects shared by the readers of one host (module
    docstring): give it to :class:`~dcr_format.Store` (``host_cache=``) in every reader
    of the host. ``directory`` (default :func:`default_directory`) is made for this user
    alone where missing; one that another user owns, or that is a link, is not used.
    ``hits`` and ``reads`` count the objects taken from the directory and from the store.
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ArgumentError(
                f"max_bytes must be a number of bytes (0 or more), not {max_bytes!r}"
            )
        self.directory = Path(directory) if directory is not None else default_directory()
        self.max_bytes = max_bytes
        self.hits = 0
        self.reads = 0
        self._usable = self._prepare()

    def _prepare(self) -> bool:
        """Whether the directory is this user's own (made where missing)."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = os.lstat(self.directory)
        except OSError:
            return False
        return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()

    @property
    def usable(self) -> bool:
        """Whether objects go through the directory (else every read is the store's)."""
        return self._usable

    def fetch(self, sha256: str, size: int, read: Callable[[], bytes]) -> bytes:
        """The bytes of the object of ``size`` bytes whose sha256 is ``sha256``: from the
        directory where an entry holds exactly them, else ``read()`` (which must return
        them checked), left in the directory for the other readers. One reader of the host
        reads a missing object at a time; the others wait for it."""
        if not self._usable or self.max_bytes < size or not _SHA256.fullmatch(sha256):
            data = read()
            self.reads += 1
            return data
        found = self._load(sha256, size)
        if found is not None:
            return found
        with self._claim(sha256) as claimed:
            if claimed:  # another reader may have left it while this one waited
                found = self._load(sha256, size)
                if found is not None:
                    return found
            data = read()
            self.reads += 1
            if claimed and not self._keep(sha256, data):
                with contextlib.suppress(OSError):  # nothing kept: no lock file left either
                    (self.directory / (sha256 + _LOCK)).unlink()
            return data

    def _load(self, sha256: str, size: int) -> bytes | None:
        path = self.directory / sha256
        try:
            with open(path, "rb") as handle:
                data = handle.read(size + 1)
        except OSError:
            return None
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            with contextlib.suppress(OSError):
                path.unlink()  # not those bytes: the next reader reads the store again
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: evicted last
        self.hits += 1
        return data

    @contextlib.contextmanager
    def _claim(self, sha256: str) -> Iterator[bool]:
        """Hold the object's lock file (False: it could not be taken; read without it)."""
        try:
            handle = open(self.directory / (sha256 + _LOCK), "a+b")
        except OSError:
            yield False
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield True
        finally:
            handle.close()  # releases the lock

    def _keep(self, sha256: str, data: bytes) -> bool:
        """Leave ``data`` as the entry of ``sha256`` (complete or not at all), then keep the
        directory within ``max_bytes``; whether it was kept (a failure leaves the cache as
        it was)."""
        temporary = self.directory / f"{_TEMPORARY}{uuid.uuid4().hex}"
        try:
            with open(temporary, "wb") as handle:
                handle.write(data)
            os.replace(temporary, self.directory / sha256)
        except OSError:
            with contextlib.suppress(OSError):
                temporary.unlink()
            return False
        self._evict(keep=sha256)
        return True

    def _evict(self, keep: str) -> None:
        """Remove the entries used longest ago until the directory holds ``max_bytes``."""
        entries = []
        try:
            with os.scandir(self.directory) as found:
                for item in found:
                    if _SHA256.fullmatch(item.name) and item.is_file(follow_symlinks=False):
                        info = item.stat(follow_symlinks=False)
                        entries.append((info.st_mtime, info.st_size, item.name))
        except OSError:
            return
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= self.max_bytes:
                break
            if name == keep:
                continue
            for stale in (name, name + _LOCK):
                with contextlib.suppress(OSError):
                    (self.directory / stale).unlink()
            total -= size
