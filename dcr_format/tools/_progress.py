"""Progress of a long tool run on stderr: a bar on a terminal, a line now and then off one.

Off a terminal (logs, CI, notebooks) a bar would print nothing useful, so a run prints
``dcr <what>: <how far>, <elapsed> s`` every few seconds (``DCR_PROGRESS_INTERVAL``
seconds, default 2; 0 prints every step) and a last line when it ends, if it printed any.
A run shorter than the interval prints nothing. While one step takes long (the first run
compiles the kernels), a line says it is still working after each ``QUIET_INTERVALS``
intervals without a line (at least ``MIN_QUIET_SECONDS``), so that a log never goes quiet
for long.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Container
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcr_format.store.store import Store

DEFAULT_INTERVAL = 2.0
QUIET_INTERVALS = 5  # intervals without a line before a "still working" one
MIN_QUIET_SECONDS = 10.0


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("DCR_PROGRESS_INTERVAL", DEFAULT_INTERVAL)))
    except ValueError:
        return DEFAULT_INTERVAL


def _amount(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:g}"
    for name in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or name == "GB":
            return f"{n:.0f} {name}" if name == "B" else f"{n:.1f} {name}"
        n /= 1000
    return f"{n:g}"


class Progress:
    """How far a step of a tool run is, on stderr (nothing where ``enabled`` is false).

    ``what`` names the work (``replay``), ``unit`` what is counted (``B``: bytes, shown in
    KB/MB/GB; else a plural noun such as ``versions``), ``total`` how many there will be
    (None: unknown).
    """

    def __init__(
        self, what: str, *, total: float | None = None, unit: str = "", enabled: bool = True
    ) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.done = 0.0
        self.enabled = enabled
        self._started = self._last = time.monotonic()
        self._printed = False
        self._interval = _interval()
        self._bar: Any = None
        self._lock = threading.Lock()  # one line at a time, from the work or the heartbeat
        self._stop: threading.Event | None = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            scale = unit == "B"
            self._bar = tqdm(
                desc=what, total=total, unit=unit or "it", unit_scale=scale, leave=False
            )
        elif enabled:
            self._stop = threading.Event()
            quiet = max(MIN_QUIET_SECONDS, QUIET_INTERVALS * self._interval)
            threading.Thread(
                target=_heartbeat,
                args=(weakref.ref(self), self._stop, quiet),
                name=f"dcr progress: {what}",
                daemon=True,
            ).start()

    def set_total(self, total: float | None) -> None:
        """The total, once it is known."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def add(self, n: float = 1) -> None:
        """``n`` more units are done."""
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._line(self._how_far(), now)

    def _how_far(self) -> str:
        done = _amount(self.done, self.unit)
        noun = "" if self.unit == "B" else f" {self.unit}"
        if self.total is None:
            return f"{done}{noun}"
        return f"{done} of {_amount(self.total, self.unit)}{noun}"

    def _line(self, text: str, now: float) -> None:
        with self._lock:
            if not self.enabled:
                return
            self._printed = True
            self._last = now
            line = f"dcr {self.what}: {text}, {now - self._started:.1f} s"
            print(line, file=sys.stderr, flush=True)

    def _quiet(self, quiet: float) -> None:
        """The heartbeat's check: a line where none was printed for ``quiet`` seconds."""
        now = time.monotonic()
        if self.enabled and now - self._last >= quiet:
            self._line(f"still working, {self._how_far()}", now)

    def close(self) -> None:
        """The step ended: a last line where lines were printed."""
        if self._stop is not None:
            self._stop.set()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self._printed:
            self._line(f"done, {self._how_far()}", time.monotonic())
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is not None:  # failed: no "done" line
            self.enabled = False
        self.close()


def _heartbeat(ref: weakref.ref[Progress], stop: threading.Event, quiet: float) -> None:
    """Until ``stop`` is set or the progress is gone: a line after each ``quiet`` seconds
    without one (holding the progress only while it checks)."""
    while not stop.wait(min(quiet, 1.0)):
        progress = ref()
        if progress is None:
            return
        progress._quiet(quiet)
        del progress


def counting_store(
    store: Store, tick: Callable[[int], Any], *, versions: Container[int] | None = None
) -> Store:
    """The same store, reporting to ``tick`` the size of every manifest and shard it reads
    (of ``versions`` only, where given): the payload, as a version's ``payload_bytes``
    counts it."""
    from dcr_format.chain.chain import payload_version

    counted = copy.copy(store)
    get = store.get

    def get_counted(key: str, *, max_size: int | None = None) -> bytes:
        data = get(key, max_size=max_size)
        version = payload_version(key)
        if version is not None and (versions is None or version in versions):
            tick(len(data))
        return data

    counted.get = get_counted  # type: ignore[method-assign]  # on this copy only
    return counted
