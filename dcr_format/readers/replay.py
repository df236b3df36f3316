"""Materialise any committed version as a Hugging Face checkpoint directory."""

from __future__ import annotations

import os

from dcr_format.readers.reader import DeltaReader, SyncResult
from dcr_format.readers.targets import SafetensorsDirTarget
from dcr_format.store import Store


def replay(
    store: Store | str | os.PathLike[str], version: int, out_dir: str | os.PathLike[str]
) -> SyncResult:
    """Write version ``version`` into ``out_dir`` and check every tensor's fingerprint.

    ``out_dir`` must be new, empty, or a directory an earlier replay or pull of the
    same chain left at an older version (then only the versions in between are
    applied).
    """
    return DeltaReader(store, SafetensorsDirTarget(out_dir), verify="all").sync(to=version)
