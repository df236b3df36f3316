"""The ``memory://`` backend: fsspec's process-local memory filesystem, made atomic.

Every memory store of a process shares fsspec's one memory filesystem, so one
process-wide lock around each check-and-write makes ``put_if_absent`` an atomic
create among Store users (code that writes ``memory://`` through fsspec directly
bypasses it).
"""

from __future__ import annotations

import threading

from fsspec.implementations.memory import MemoryFileSystem

from dcr_format.store._base import Kind
from dcr_format.store._fsspec import FsspecBackend

__all__ = ["MemoryBackend"]

_MEMORY_LOCK = threading.Lock()  # memory:// is process-local, so one lock serialises all writers


class MemoryBackend(FsspecBackend):
    """Objects in fsspec's memory filesystem under ``memory://name``."""

    kind: Kind = "memory"

    def __init__(self, fs: MemoryFileSystem, root: str, *, single_writer: bool) -> None:
        super().__init__(
            fs, root, "memory://" + root.strip("/"), single_writer=single_writer, lock=_MEMORY_LOCK
        )
