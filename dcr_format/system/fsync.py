"""One way to flush a file or a directory to disk (the store, the directory target and
replay all need it)."""

from __future__ import annotations

import os


def fsync(path: str | os.PathLike[str], *, strict: bool = False) -> None:
    """Flush the file or directory at ``path`` (its data, or its entries) to disk.

    Best effort unless ``strict``: some filesystems refuse to open or fsync a directory,
    and a caller that only hardens a rename against power loss goes on without it.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)
