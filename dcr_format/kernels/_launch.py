"""How the compiled kernels run: a parallel kernel or its serial twin.

Private, imported by the compiled kernel modules only. Each parallel kernel has a serial
twin over the same tasks (one body, two loops), and :func:`_launch` runs the twin for
one task (no parallel region to start: ~3 us under OpenMP, ~0.2 ms under ``workqueue``
on a 2-core VM) and in any process forked after this one launched a parallel kernel
under OpenMP: GNU OpenMP is not fork-safe, and numba terminates such a child at its
first parallel kernel (a trainer's or a reader's ``multiprocessing`` workers would die).
``workqueue`` aborts the process when two threads launch parallel kernels at once, so
every launch holds one process-wide lock.

The twins are compiled by :func:`serial_twin`: through numba's parallel pipeline with
every transformation into parallel loops turned off, so they start no parallel region
(in a forked child either), yet get what that pipeline's passes do to a task's inlined
body. A plain ``njit`` twin ran the same tasks 1.3-1.8x slower than its parallel kernel
on one thread (the fused diff of 2.9M elements at 1%: 1.10 against 0.61 ms; the writer's
rank pass over 128M elements: 64 against 41 ms); compiled so, 0.61 and 48 ms.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numba
from numba.core.compiler import CompilerBase, DefaultPassBuilder
from numba.core.compiler_machinery import PassManager, register_pass
from numba.core.cpu import ParallelOptions  # type: ignore[attr-defined]
from numba.core.errors import NumbaPerformanceWarning
from numba.core.typed_passes import ParforPass
from numba.parfors.parfor import Parfor

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


# numba's parallel pipeline with none of its transformations into parallel loops (an
# options object: numba empties a dict of options as it reads it, so a dict shared by
# several twins would leave the later ones every transformation)
_NO_PARALLEL_LOOPS = ParallelOptions(  # type: ignore[no-untyped-call]
    {
        "comprehension": False,
        "prange": False,
        "setitem": False,
        "reduction": False,
        "numpy": False,
        "stencil": False,
        "fusion": False,
        "inplace_binop": False,
    }
)


@register_pass(mutates_CFG=True, analysis_only=False)  # type: ignore[no-untyped-call]
class _QuietParforPass(ParforPass):
    """numba's parfor pass without its warning that it made no parallel loop (a twin makes
    none by design; the test suite turns warnings into errors), and refusing to compile a
    twin where one appeared after all."""

    _name = "dcr_quiet_parfor_pass"

    def run_pass(self, state: Any) -> bool:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumbaPerformanceWarning)
            done = bool(super().run_pass(state))  # type: ignore[no-untyped-call]
        for block in state.func_ir.blocks.values():
            if any(isinstance(statement, Parfor) for statement in block.body):
                raise RuntimeError(f"serial twin {state.func_id.func_name} has a parallel loop")
        return done


class _TwinCompiler(CompilerBase):
    """numba's nopython pipeline, with :class:`_QuietParforPass` for the parfor pass."""

    def define_pipelines(self) -> list[PassManager]:
        default = DefaultPassBuilder.define_nopython_pipeline(self.state)  # type: ignore[no-untyped-call]
        pm = PassManager(default.pipeline_name)  # type: ignore[no-untyped-call]
        for pass_class, description in default.passes:
            twin = _QuietParforPass if pass_class is ParforPass else pass_class
            pm.add_pass(twin, description)  # type: ignore[no-untyped-call]
        pm.finalize()  # type: ignore[no-untyped-call]
        return [pm]


def serial_twin(function: Callable[..., Any]) -> Any:
    """The serial twin of a parallel kernel (``njit(cache=True, nogil=True)`` otherwise),
    compiled as the module docstring says."""
    return _NUMBA.njit(  # numba's stubs type ``parallel`` as a bool only
        cache=True, nogil=True, parallel=_NO_PARALLEL_LOOPS, pipeline_class=_TwinCompiler
    )(function)


class _Serial(threading.local):
    """Whether this thread runs the serial twins only (:func:`serial_kernels`)."""

    on = False


_SERIAL = _Serial()


@contextlib.contextmanager
def serial_kernels(on: bool = True) -> Iterator[None]:
    """Within the block, kernels launched from this thread run their serial twins (``on``),
    as a pool that already fills every core wants (:mod:`dcr_format.delta.pipeline`)."""
    before, _SERIAL.on = _SERIAL.on, on
    try:
        yield
    finally:
        _SERIAL.on = before


def kernel_threads() -> int:
    """How many threads numba's parallel kernels run on."""
    return int(_NUMBA.get_num_threads())


def _launch(parallel: Any, serial: Any, tasks: int, *args: Any) -> None:
    """Run a kernel over ``tasks`` tasks: with its ``serial`` twin for one task, where
    parallel kernels are off, or in a :func:`serial_kernels` block; else with ``parallel``
    under the process-wide launch lock."""
    if tasks == 1 or (tasks and (_Launches.serial_only or _SERIAL.on)):
        serial(*args)
    elif tasks:
        with _LOCK:
            _Launches.launched = True
            parallel(*args)


__all__ = ["_Launches", "_launch", "kernel_threads", "serial_kernels", "serial_twin"]
