"""Pieces every tool shares: frozen result models, object listings with sizes and ages."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict

from dcr_format.errors import DcrError, StoreError
from dcr_format.store import Store, _key_problem


class Row(BaseModel):
    """Base of every result model: frozen; JSON output is its serialisation."""

    model_config = ConfigDict(frozen=True)


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a listing: its key, stored size and last-modified time (None: unknown)."""

    key: str
    size: int
    modified: datetime | None


def object_infos(store: Store, prefix: str) -> list[ObjectInfo]:
    """Every object under ``prefix`` with its size and last-modified time, sorted by key.

    The times come from the backend (file mtime, S3 ``LastModified``); a backend
    that reports none gives ``modified=None``. Stores do not (yet) offer this call,
    so it is answered here per backend.
    """
    lister = getattr(store, "list_info", None)
    if callable(lister):  # a Store that reports sizes and times itself
        return sorted((ObjectInfo(*item) for item in lister(prefix)), key=lambda i: i.key)
    keys = store.list(prefix)
    url = store.url
    if url.startswith("file://"):
        root = url[len("file://") :]
        infos = []
        for key in keys:
            try:
                st = os.stat(os.path.join(root, key))
            except FileNotFoundError:
                continue  # deleted since the listing
            modified = datetime.fromtimestamp(st.st_mtime, timezone.utc)
            infos.append(ObjectInfo(key, st.st_size, modified))
        return infos
    return _fsspec_infos(store, prefix, keys)


def _fsspec_infos(store: Store, prefix: str, keys: list[str]) -> list[ObjectInfo]:
    backend: Any = store._backend
    fs = backend.fs
    if hasattr(backend, "bucket"):  # s3://: s3fs paths are "bucket/root/key"
        base = f"{backend.bucket}/{backend.root}"
    else:
        base = backend.prefix
    wanted = set(keys)
    try:
        fs.invalidate_cache()
        found = fs.find((base + prefix).rstrip("/"), detail=True)
    except FileNotFoundError:
        found = {}
    except OSError as exc:
        raise StoreError(f"could not list {prefix!r} in store {store.url}: {exc}") from exc
    infos = []
    for name, info in found.items():
        key = name[len(base) :] if name.startswith(base) else None
        if key is None or key not in wanted or _key_problem(key) is not None:
            continue
        infos.append(ObjectInfo(key, int(info.get("size") or 0), _modified(info)))
    return sorted(infos, key=lambda i: i.key)


def _modified(info: dict[str, Any]) -> datetime | None:
    for field in ("LastModified", "mtime", "last_modified", "created"):
        value = info.get(field)
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        if isinstance(value, (int, float)):
            return datetime.fromtimestamp(value, timezone.utc)
    return None


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``"90s"``, ``"15m"``, ``"2h"``, ``"7d"``, ``"1w"`` or plain seconds (``"0"``)."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a duration; write e.g. 30s, 15m, 2h or 7d")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2) or "s"])


class Problem(Row):
    """One broken object or link found by :func:`~dcr_format.tools.verify`."""

    version: int
    """The first version the problem breaks."""
    key: str
    """The broken object (or the commit record whose link is broken)."""
    error: str
    message: str
    check: str = "object"
    """``object`` (an object, its sha256 or schema), ``link`` (hash chain, numbering),
    ``state`` (replayed bits differ), ``base`` (an alternative base)."""

    @classmethod
    def of(cls, version: int, key: str, exc: DcrError, check: str = "object") -> Problem:
        """A problem from the error that found it."""
        return cls(
            version=version, key=key, error=type(exc).__name__, message=str(exc), check=check
        )


def numel(shape: tuple[int, ...] | list[int]) -> int:
    """Elements of a shape (1 for 0-d)."""
    total = 1
    for dim in shape:
        total *= dim
    return total
