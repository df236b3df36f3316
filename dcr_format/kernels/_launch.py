"""How the compiled kernels run: a parallel kernel or its serial form.

Private, imported by the compiled kernel modules only. A kernel is one Python body whose
loop over its tasks is a ``prange``; :func:`parallel_kernel` compiles it twice, a parallel
form and a serial one over the same tasks (``prange`` runs as ``range``), and
:func:`_launch` runs the serial form for one task (no parallel region to start: ~3 us
under OpenMP, ~0.2 ms under ``workqueue`` on a 2-core VM) and in any process forked after
this one launched a parallel kernel under OpenMP: GNU OpenMP is not fork-safe, and numba
terminates such a child at its first parallel kernel (a trainer's or a reader's
``multiprocessing`` workers would die). ``workqueue`` aborts the process when two threads
launch parallel kernels at once, so every launch holds one process-wide lock.

The serial form is compiled through numba's parallel pipeline with every transformation
into parallel loops turned off, so it starts no parallel region (in a forked child
either), yet gets what that pipeline's passes do to a task's inlined body. A plain
``njit`` serial form ran the same tasks 1.3-1.8x slower than the parallel kernel on one
thread (the fused diff of 2.9M elements at 1%: 1.10 against 0.61 ms; the writer's rank
pass over 128M elements: 64 against 41 ms); compiled so, 0.61 and 48 ms. numba offers no
public switch for that pipeline, so this module builds it from numba's compiler classes
(the numba versions ``pyproject.toml`` allows are the ones it is tested with).
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

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
# several serial forms would leave the later ones every transformation)
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
    """numba's parfor pass without its warning that it made no parallel loop (a serial form
    makes none by design; the test suite turns warnings into errors), and refusing to compile
    a serial form where one appeared after all."""

    _name = "dcr_quiet_parfor_pass"

    def run_pass(self, state: Any) -> bool:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumbaPerformanceWarning)
            done = bool(super().run_pass(state))  # type: ignore[no-untyped-call]
        for block in state.func_ir.blocks.values():
            if any(isinstance(statement, Parfor) for statement in block.body):
                raise RuntimeError(f"serial kernel {state.func_id.func_name} has a parallel loop")
        return done


class _SerialCompiler(CompilerBase):
    """numba's nopython pipeline, with :class:`_QuietParforPass` for the parfor pass."""

    def define_pipelines(self) -> list[PassManager]:
        default = DefaultPassBuilder.define_nopython_pipeline(self.state)  # type: ignore[no-untyped-call]
        pm = PassManager(default.pipeline_name)  # type: ignore[no-untyped-call]
        for pass_class, description in default.passes:
            twin = _QuietParforPass if pass_class is ParforPass else pass_class
            pm.add_pass(twin, description)  # type: ignore[no-untyped-call]
        pm.finalize()  # type: ignore[no-untyped-call]
        return [pm]


class Kernel(NamedTuple):
    """A kernel's two compiled forms (numba dispatchers) from one body."""

    parallel: Any
    serial: Any


def renamed(function: Callable[..., Any], suffix: str) -> Callable[..., Any]:
    """A copy of the Python function ``function`` under its name with ``suffix`` added:
    numba's on-disk cache files a function's machine code by its name, not by how it was
    compiled, so a second compiled form of one body needs a name of its own."""
    copy = types.FunctionType(
        function.__code__,
        function.__globals__,
        f"{function.__name__}{suffix}",
        function.__defaults__,
        function.__closure__,
    )
    copy.__qualname__ = f"{function.__qualname__}{suffix}"
    copy.__doc__ = function.__doc__
    return copy


def parallel_kernel(function: Callable[..., Any]) -> Kernel:
    """``function``, whose loop over its tasks is a ``prange``, compiled twice: with
    ``njit(cache=True, nogil=True, parallel=True)``, and serially as the module docstring
    says. The serial form is a copy of the function under its own name (``<name>_serial``):
    numba's on-disk cache files a function's machine code by its name, not by how it was
    compiled, so the two forms must not share one."""
    serial = renamed(function, "_serial")
    return Kernel(
        parallel=_NUMBA.njit(cache=True, nogil=True, parallel=True)(function),
        serial=_NUMBA.njit(  # numba's stubs type ``parallel`` as a bool only
            cache=True, nogil=True, parallel=_NO_PARALLEL_LOOPS, pipeline_class=_SerialCompiler
        )(serial),
    )


class _Serial(threading.local):
    """Whether this thread runs the serial forms only (:func:`serial_kernels`)."""

    on = False


_SERIAL = _Serial()


@contextlib.contextmanager
def serial_kernels(on: bool = True) -> Iterator[None]:
    """Within the block, kernels launched from this thread run their serial forms (``on``),
    as a pool that already fills every core wants (:mod:`dcr_format.delta.pipeline`)."""
    before, _SERIAL.on = _SERIAL.on, on
    try:
        yield
    finally:
        _SERIAL.on = before


def kernel_threads() -> int:
    """How many threads numba's parallel kernels run on."""
    return int(_NUMBA.get_num_threads())


def _launch(kernel: Kernel, tasks: int, *args: Any, serial: bool = False) -> None:
    """Run ``kernel`` over ``tasks`` tasks: its serial form for one task, where ``serial``
    asks for it (a caller whose threads already fill the cores), where parallel kernels are
    off, or in a :func:`serial_kernels` block; else its parallel form under the
    process-wide launch lock."""
    if tasks == 1 or (tasks and (serial or _Launches.serial_only or _SERIAL.on)):
        kernel.serial(*args)
    elif tasks:
        with _LOCK:
            _Launches.launched = True
            kernel.parallel(*args)


__all__ = [
    "Kernel",
    "_Launches",
    "_launch",
    "kernel_threads",
    "parallel_kernel",
    "renamed",
    "serial_kernels",
]
