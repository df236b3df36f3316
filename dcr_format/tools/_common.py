"""Pieces every tool shares: frozen result models, object listings with sizes and ages."""

from __future__ import annotations

import re
from datetime import timedelta

from pydantic import BaseModel, ConfigDict

from dcr_format.errors import DcrError
from dcr_format.store.store import ObjectInfo, Store


class Row(BaseModel):
    """Base of every result model: frozen; JSON output is its serialisation."""

    model_config = ConfigDict(frozen=True)


def object_infos(store: Store, prefix: str) -> list[ObjectInfo]:
    """Every object under ``prefix`` with its size and the store's modification time,
    sorted by key (:meth:`Store.list_info`; ``modified=None`` where the backend has none)."""
    return sorted(store.list_info(prefix), key=lambda info: info.key)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_LONGEST = timedelta(days=365_000)  # a thousand years; timedelta itself ends near 2.7e6 years
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``"90s"``, ``"15m"``, ``"2h"``, ``"7d"``, ``"1w"`` or plain seconds (``"0"``)."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a duration; write e.g. 30s, 15m, 2h or 7d")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if not seconds <= _LONGEST.total_seconds():
        raise ValueError(f"{text!r} is longer than {_LONGEST.days} days; write a shorter duration")
    return timedelta(seconds=seconds)


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
