"""Reads of the process environment on hot paths.

``os.environ.get`` of a variable that is not set raises and catches two ``KeyError``
inside :mod:`os` (about 0.7 us a call). The kernels' dispatch reads ``DCR_KERNELS`` at
every call, a dozen times a tensor at each end, and that was 5-10% of the CPU time of a
small tensor's publish and sync. :func:`getenv` looks the name up in the mapping's own
store, as ``os.environ`` itself does, without the exceptions (about 0.1 us), and falls back
to ``os.environ.get`` where ``os.environ`` is not CPython's mapping (replaced by a test, or
another interpreter).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any


class _View:
    """How to read one ``os.environ`` object's store: the store, and its key and value
    codecs (CPython's ``_Environ``: bytes on POSIX, upper-case str on Windows)."""

    def __init__(self, environ: object) -> None:
        self.environ = environ
        data = getattr(environ, "_data", None)
        encode = getattr(environ, "encodekey", None)
        decode = getattr(environ, "decodevalue", None)
        self.store: Mapping[Any, Any] | None = (
            data if isinstance(data, dict) and callable(encode) and callable(decode) else None
        )
        self.encode: Callable[[str], Any] = encode if callable(encode) else str
        self.decode: Callable[[Any], str] = decode if callable(decode) else str
        self.keys: dict[str, Any] = {}

    def get(self, name: str) -> str | None:
        if self.store is None:
            return os.environ.get(name)
        key = self.keys.get(name)
        if key is None:
            key = self.keys[name] = self.encode(name)
        value = self.store.get(key)
        return None if value is None else self.decode(value)


_view = _View(os.environ)


def getenv(name: str) -> str | None:
    """``os.environ.get(name)``, read at every call, without its cost where ``name`` is not
    set."""
    global _view
    view = _view
    if view.environ is not os.environ:  # os.environ was replaced (a test's monkeypatch)
        view = _view = _View(os.environ)
    return view.get(name)
