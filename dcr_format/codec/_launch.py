"""How the compiled kernels run: a parallel kernel or its serial twin.

Private, imported by the compiled kernel modules only. Each parallel kernel has a serial
twin over the same tasks (one body, two loops), and :func:`_launch` runs the twin for
one task (no parallel region to start: ~3 us under OpenMP, ~0.2 ms under ``workqueue``
on a 2-core VM) and in any process forked after this one launched a parallel kernel
under OpenMP: GNU OpenMP is not fork-safe, and numba terminates such a child at its
first parallel kernel (a trainer's or a reader's ``multiprocessing`` workers would die).
``workqueue`` aborts the process when two threads launch parallel kernels at once, so
every launch holds one process-wide lock.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numba

_LOCK = threading.Lock()  # held around every parallel kernel launch
_NUMBA: Any = numba  # threading_layer() is numba's API, not in its stubs' exports


class _Launches:
    """Whether this process launched a parallel kernel, and whether it may (see the module
    docstring: not in a child forked after one under OpenMP)."""

    launched = False
    serial_only = False


def _forked() -> None:
    """In a forked child: a fresh launch lock (another thread of the parent may have held
    it), and parallel kernels off if the parent launched one under OpenMP."""
    global _LOCK
    _LOCK = threading.Lock()
    if _Launches.launched:
        try:
            layer = _NUMBA.threading_layer()
        except ValueError:  # no layer was loaded after all: take no chance
            layer = "omp"
        _Launches.serial_only = layer == "omp"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _launch(parallel: Any, serial: Any, tasks: int, *args: Any) -> None:
    """Run a kernel over ``tasks`` tasks: with its ``serial`` twin for one task, or where
    parallel kernels are off; else with ``parallel`` under the process-wide launch lock."""
    if tasks == 1 or (tasks and _Launches.serial_only):
        serial(*args)
    elif tasks:
        with _LOCK:
            _Launches.launched = True
            parallel(*args)


__all__ = ["_Launches", "_launch"]
