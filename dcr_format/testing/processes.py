"""Server processes for tests and benchmarks: a free port on 127.0.0.1, waiting until a
server answers (or its process exits), and stopping a process politely, then firmly; and
ranks run as threads of one process (:func:`run_ranks`, :func:`in_threads`)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    ready: Callable[[], bool],
    *,
    what: str,
    timeout: float,
    process: subprocess.Popen[Any] | None = None,
    interval: float = 0.05,
) -> None:
    """Return once ``ready()`` is true; raise ``RuntimeError`` naming ``what`` when
    ``process`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from {what} within {timeout:.0f} s")
        time.sleep(interval)


def stop_process(process: subprocess.Popen[Any], *, grace: float) -> None:
    """Terminate ``process`` and wait for it; kill it if it is still there after ``grace``
    seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace)


def run_ranks(
    world: int, fn: Callable[[int], _T], timeout: float | None = 60.0
) -> tuple[list[_T | None], list[BaseException | None]]:
    """Run ``fn(rank)`` for every rank of ``world``, each in a thread of its own; return
    the results and the errors by rank. A rank still running after ``timeout`` seconds
    (None: no limit) fails with ``AssertionError("a rank hung")``."""
    results: list[_T | None] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def go(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # reported to the caller, not to threading
            errors[rank] = exc

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a rank hung"
    return results, errors


def in_threads(fn: Callable[[int], _T], ranks: int, timeout: float | None = None) -> list[_T]:
    """:func:`run_ranks` that raises the first rank's error, else returns the results."""
    results, errors = run_ranks(ranks, fn, timeout)
    for error in errors:
        if error is not None:
            raise error
    return results  # type: ignore[return-value]
