"""Where the compiled (numba) CPU kernels are loaded: on first use, never by
``import dcr_format``, and not at all under ``DCR_KERNELS=torch`` or where numba is missing
or unusable (the numpy and torch references run instead).

:func:`native_kernels` is the tensor kernels module (:mod:`dcr_format.kernels.numba_kernels`);
:func:`compiled` loads any kernels module by name (a coding's, ``_launch``), once.
"""

from __future__ import annotations

import contextlib
import importlib
from functools import lru_cache
from types import ModuleType

from dcr_format.system.environ import getenv


def native_kernels() -> ModuleType | None:
    """The compiled CPU kernels, or None when ``DCR_KERNELS=torch`` or numba is missing.

    ``DCR_KERNELS`` is read at every call (see :mod:`dcr_format.delta.dispatch`); numba is
    imported on the first call that wants it, never by ``import dcr_format``.
    """
    return None if _torch_only() else _load_native()


def _torch_only() -> bool:
    """Whether ``DCR_KERNELS`` asks for the torch reference (read at every call)."""
    raw = getenv("DCR_KERNELS")
    return raw is not None and raw.strip().lower() == "torch"


def compiled_kernels() -> ModuleType | None:
    """:func:`native_kernels` for a caller that has read ``DCR_KERNELS`` itself (it is not
    read again): the compiled CPU kernels, or None where numba cannot load them."""
    return _load_native()


def compiled(name: str) -> ModuleType | None:
    """The compiled kernels module ``name``: a module of :mod:`dcr_format.kernels` by its
    own name (e.g. ``_launch``) or any module by its dotted name (a coding's kernels, e.g.
    ``dcr_format.codings._rans_kernels``), imported on first use, or None where
    :func:`native_kernels` is (or it cannot load)."""
    if _torch_only():
        return None
    module = _COMPILED.get(name, _UNLOADED)
    if module is _UNLOADED:  # imported once, not looked up by importlib at every call
        module = _COMPILED[name] = _import(name)
    return module if isinstance(module, ModuleType) else None


def _import(name: str) -> ModuleType | None:
    """The kernels module ``name`` (see :func:`compiled`), or None where numba cannot load."""
    if _load_native() is None:
        return None
    try:
        return importlib.import_module(name if "." in name else f"dcr_format.kernels.{name}")
    except (ImportError, OSError, RuntimeError):  # pragma: no cover - numba unusable
        return None


_UNLOADED = object()  # a name not imported yet (None is kept for one that cannot load)
_COMPILED: dict[str, object] = {}


def serial_kernels() -> contextlib.AbstractContextManager[None]:
    """A block in which this thread's compiled kernels run their serial forms
    (:func:`dcr_format.kernels._launch.serial_kernels`; nothing where they do not load)."""
    launch = compiled("_launch")
    return contextlib.nullcontext() if launch is None else launch.serial_kernels()


@lru_cache(maxsize=1)
def _load_native() -> ModuleType | None:
    try:
        from dcr_format.kernels import numba_kernels
    except (ImportError, OSError, RuntimeError):  # no numba, or numba unusable here
        return None
    return numba_kernels


__all__ = ["compiled", "compiled_kernels", "native_kernels", "serial_kernels"]
