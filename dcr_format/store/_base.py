"""What every store backend shares: the backend protocol, key rules, capabilities, signals.

A backend moves bytes for one store root; :class:`~dcr_format.store.store.Store` checks
every key before a backend sees it, enforces the limits and turns the backend's
exceptions into the errors of :mod:`dcr_format.errors`. A backend therefore
receives valid keys only and reports outcomes with built-in exceptions
(``FileNotFoundError``, ``OSError``, ``NotImplementedError``) or with the signals
defined here (:class:`ObjectExists`, :class:`ObjectTooLarge`, ...), which only
the Store translates.
"""

from __future__ import annotations

import builtins
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal, NamedTuple, Protocol, TypeVar

__all__ = [
    "MAX_KEY_BYTES",
    "TEMP_PREFIX",
    "Backend",
    "Capabilities",
    "Kind",
    "NoAtomicCreate",
    "NoHardLinks",
    "ObjectExists",
    "ObjectInfo",
    "ObjectTooLarge",
    "OutsideRoot",
    "RetryPolicy",
    "key_problem",
    "listed_size",
    "retrying",
    "temporary_key_problem",
    "utc",
]

T = TypeVar("T")

MAX_KEY_BYTES = 1024
"""Longest key accepted, in bytes of UTF-8 (the S3 limit)."""

TEMP_PREFIX = ".dcr-tmp-"
"""Names of temporary files (FORMAT.md §2.5) start with this; no key segment may."""

_WINDOWS_DRIVE = re.compile(r"[A-Za-z]:")

Kind = Literal["local", "memory", "s3", "fsspec", "relay"]
"""Which backend holds a store's objects."""


# --- keys ----------------------------------------------------------------------------------


def key_problem(key: object) -> str | None:
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
        if segment.startswith(TEMP_PREFIX):
            return f"segments starting with {TEMP_PREFIX!r} are reserved for temporary files"
    return None


def temporary_key_problem(key: object) -> str | None:
    """Say what is wrong with ``key`` as a temporary file's key, or return None when it is one.

    A temporary file's key is a valid key but for its last segment, which starts with
    :data:`TEMP_PREFIX` (FORMAT.md §2.5): only temporary files are named so.
    """
    if not isinstance(key, str):
        return key_problem(key)
    name = key.rpartition("/")[2]
    if not name.startswith(TEMP_PREFIX):
        return f"its last segment does not start with {TEMP_PREFIX!r}: it is not a temporary file"
    # every other rule is the key rules': the same key with a plain last segment must be valid
    return key_problem(f"{key[: len(key) - len(name)]}t{name}")


# --- what a backend can do and what it lists -----------------------------------------------


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
    writable: bool = True
    """``put``, ``put_if_absent`` and deletes are accepted (False: a read-only relay, or
    credentials the server refuses writes to)."""
    read_only: str = "it is a read-only view of a store; writers write to the store itself"
    """Why the store is not writable, where it is not (ends a sentence)."""
    batch_delete: bool = False
    """``delete_many`` sends one request per batch of keys (S3 ``DeleteObjects``)."""


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


def utc(value: object) -> datetime | None:
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


def listed_size(value: object) -> int:
    """A size from a listing: a non-negative int, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"object size {value!r} is not a byte count")
    return value


# --- retries ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How failed requests of a backend are tried again: which failures, how often, how long.

    The Store applies it to every idempotent request (reads, plain writes, listings,
    deletes, the conditional-write probe), never to ``put_if_absent``, whose outcome
    after a failure is unknown rather than worth repeating.
    """

    transient: Callable[[BaseException], bool]
    """Whether a failure (or what caused it) is transient: worth another try."""
    attempts: int
    """Tries of one request before its error is raised."""
    base_s: float
    """The first wait, in seconds; each later one doubles, up to ``cap_s``."""
    cap_s: float

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before try ``attempt + 1``: capped exponential, with jitter."""
        return min(self.cap_s, self.base_s * 2.0**attempt) * random.uniform(0.5, 1.0)


def retrying(call: Callable[[], T], policy: RetryPolicy | None) -> T:
    """``call()``, tried again after transient failures as ``policy`` says (None: once)."""
    attempt = 0
    while True:
        try:
            return call()
        except _SIGNALS:
            raise
        except Exception as exc:
            attempt += 1
            if policy is None or attempt >= policy.attempts or not policy.transient(exc):
                raise
            time.sleep(policy.backoff(attempt - 1))


# --- the protocol ----------------------------------------------------------------------------


class Backend(Protocol):
    """The operations a :class:`~dcr_format.store.store.Store` asks of the backend under it.

    Keys are valid (checked by the Store); a listing ``prefix`` is '' or ends in '/'.
    Outcomes are reported with built-in exceptions or the signals of this module.

    Temporary files (names starting with :data:`TEMP_PREFIX`, FORMAT.md §2.5) are not
    objects: no key names one and no listing reports one. A backend that writes them (a
    local store's write-then-rename, S3's conditional-write probe) reports the ones left
    behind by writes that never finished in :meth:`list_temporary` and deletes them in
    :meth:`delete_temporary`; a backend that writes none answers ``[]`` and deletes nothing.
    gc finds and removes stale temporary files through these two alone.
    """

    url: str
    """The normalised root URL (``file:///abs/path``, ``memory://name``, ``s3://b/p``, ...)."""
    kind: Kind
    """Which backend this is."""
    local_root: str | None
    """The absolute directory holding the objects for a local store, else None."""
    single_writer: bool
    """Whether the caller promised that only one process writes this store."""

    @property
    def retry(self) -> RetryPolicy | None:
        """How the Store retries this backend's idempotent requests (None: never)."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What the backend can do (S3: the first use probes the server)."""
        ...

    def probe_conditional_writes(self) -> bool:
        """Whether a create-if-absent is refused when the object exists (asks the server)."""
        ...

    def get(self, key: str, max_size: int | None) -> bytes:
        """The object's bytes; :class:`ObjectTooLarge` past ``max_size`` (read at most +1)."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``key``, replacing any object there."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create ``key``; :class:`ObjectExists` if it exists, :class:`NoAtomicCreate` if
        this backend cannot know (and ``single_writer`` is off)."""
        ...

    def exists(self, key: str) -> bool:
        """Whether an object (not a directory) is stored under ``key``."""
        ...

    def size(self, key: str) -> int:
        """The object's stored bytes; ``FileNotFoundError`` if missing."""
        ...

    def list(self, prefix: str) -> builtins.list[str]:
        """Sorted keys under ``prefix``, temporary files and invalid names left out."""
        ...

    def list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        """Like :meth:`list`, with sizes and the store's own modification times."""
        ...

    def delete(self, key: str) -> None:
        """Delete ``key``; a missing object is not an error."""
        ...

    def delete_many(self, keys: builtins.list[str]) -> None:
        """Delete every key (one request per batch where ``batch_delete``)."""
        ...

    def list_temporary(self) -> builtins.list[ObjectInfo]:
        """The temporary files under the root, sorted, with sizes and the store's times; keys
        relative to the root, each valid by :func:`temporary_key_problem` ([] if none)."""
        ...

    def delete_temporary(self, keys: builtins.list[str]) -> None:
        """Delete the named temporary files (keys valid by :func:`temporary_key_problem`);
        a missing one is not an error, and nothing but a temporary file is deleted."""
        ...


# --- signals (raised by backends, translated by the Store alone) ----------------------------


class ObjectExists(Exception):
    """Backend signal: a create-if-absent found the name taken."""


class ObjectTooLarge(Exception):
    """Backend signal: the object is larger than ``max_size``."""

    def __init__(self, size: int | None) -> None:
        super().__init__(size)
        self.size = size


class OutsideRoot(Exception):
    """Backend signal: the key resolves (through a symlink) outside the store root."""


class NoAtomicCreate(Exception):
    """Backend signal: atomic create is not available and single_writer is off."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason


class NoHardLinks(Exception):
    """Backend signal: the local filesystem refuses hard links, which atomic create needs."""


_SIGNALS = (ObjectExists, ObjectTooLarge, OutsideRoot, NoAtomicCreate, NoHardLinks)
