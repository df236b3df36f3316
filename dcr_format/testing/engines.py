"""Inference engines (vLLM, SGLang) under test: the environment a tiny CPU engine runs in on
a shared machine, and an engine's server process on 127.0.0.1, ready once its ``/health``
answers. Each engine's tier adds its own settings and its own calls."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dcr_format.testing.processes import free_port, stop_process, wait_until

HOST = "127.0.0.1"
# every engine: one thread, no hub
_SHARED_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def engine_env(settings: Mapping[str, str], *, path: Path) -> dict[str, str]:
    """The environment of a tiny CPU engine: ``settings`` over the shared ones, with ``path``
    (test-only plugins or shims) first on this process's ``PYTHONPATH``."""
    pythonpath = os.pathsep.join(p for p in (str(path), os.environ.get("PYTHONPATH", "")) if p)
    return {**_SHARED_ENV, **settings, "PYTHONPATH": pythonpath}


def apply_env(env: Mapping[str, str], *, path: Path) -> bool:
    """Set ``env`` in this process (children inherit it): ``PYTHONPATH`` as given, every other
    variable only where it is unset; ``path`` first on ``sys.path``. Returns whether ``path``
    was put there now (it was not there before)."""
    for key, value in env.items():
        if key == "PYTHONPATH":
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    if str(path) in sys.path:
        return False
    sys.path.insert(0, str(path))
    return True


class EngineServer:
    """An engine's server process on 127.0.0.1 (a free port), its output in ``log``.

    ``argv(host, port)`` is the command line; ``env`` its whole environment.
    """

    def __init__(
        self,
        name: str,
        argv: Callable[[str, int], Sequence[str]],
        *,
        env: Mapping[str, str],
        log: Path,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log
        self.log = log.open("w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            list(argv(HOST, self.port)), env=dict(env), stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait(self, timeout: float) -> float:
        """Wait until it serves (``/health`` answers 200); returns the seconds it took to
        start."""
        wait_until(
            self._healthy,
            what=f"{self.name} (see {self.log_path})",
            timeout=timeout,
            process=self.proc,
            interval=0.5,
        )
        return time.perf_counter() - self.started

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return int(reply.status) == 200
        except OSError:  # not listening yet, or an error status while it starts
            return False

    def stop(self) -> None:
        """Stop the process (killed if it does not end within a minute); close the log."""
        stop_process(self.proc, grace=60)
        self.log.close()
