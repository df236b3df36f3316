"""Worker processes for tests/test_dir_target_hardening.py: `dcr pull --into` racing on one
directory, and a sync that holds the directory's lock until it is SIGKILLed.

They run in processes forked from a forkserver that has torch and dcr_format loaded
(``dcr_format.testing.soak.worker_context``), so each starts in milliseconds.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from dcr_format import DeltaReader, SafetensorsDirTarget
from dcr_format.errors import StalePreparedError, TargetChangedError
from dcr_format.targets import directory as targets

_VERSIONED = re.compile(r"^v[0-9]{20}-[0-9a-f]{8}$")


def at_swap(hook: Callable[[Path], None]) -> Callable[[Path], None]:
    """A stand-in for ``targets._fsync_dir`` that calls ``hook(fresh)`` the first time a
    sync has fsynced its complete new versioned directory, the last step before it swaps
    the link (the same moment in the code before the directory had an owner)."""
    original = targets._fsync_dir
    fired: list[bool] = []

    def fsync_dir(path: Path) -> None:
        original(path)
        if not fired and _VERSIONED.match(Path(path).name):
            fired.append(True)
            hook(Path(path))

    return fsync_dir


def _signal(path: Path, text: str) -> None:
    """Write a signal file whole: the test waits for the name and then reads it, so the
    name appears only once the text is in (``write_text`` creates the file empty first)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def pull_rounds(store: str, path: str, signals: str, index: int, rounds: int) -> None:
    """Each round: say ready, wait for the go, sync ``path`` to the newest version (again
    when another pull moved it meanwhile), and write ``version applied attempts``."""
    for round_ in range(rounds):
        Path(signals, f"ready-{round_}-{index}").touch()
        while not Path(signals, f"go-{round_}").exists():
            time.sleep(0.001)
        attempts = 0
        while True:
            attempts += 1
            try:
                result = DeltaReader(store, SafetensorsDirTarget(path)).sync()
                break
            except (StalePreparedError, TargetChangedError):  # another pull moved it
                if attempts == 50:
                    raise
        done = f"{result.version} {len(result.applied_versions)} {attempts}"
        _signal(Path(signals, f"done-{round_}-{index}"), done)


def hold_before_swap(store: str, path: str, ready: str) -> None:
    """Sync ``path`` but stop, holding the lock, with the new directory complete and the
    link not yet swapped; write that directory's path to ``ready``."""

    def hold(fresh: Path) -> None:
        _signal(Path(ready), str(fresh))
        time.sleep(600)

    targets._fsync_dir = at_swap(hold)  # type: ignore[assignment]
    DeltaReader(store, SafetensorsDirTarget(path)).sync()
