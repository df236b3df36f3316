"""Server processes for tests and benchmarks: a free port on 127.0.0.1, waiting until a
server answers (or its process exits), and stopping a process politely, then firmly."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any


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
