"""Test-only shims for SGLang on a CPU without sgl-kernel (put on PYTHONPATH by
tests_sglang/harness.py, so every SGLang process, the schedulers included, loads them).

- SGLang imports ``torchvision`` (its multimodal helpers) even for a text model; the index's
  torchvision is built against a CUDA torch, and on import its ``_meta_registrations``
  registers fake implementations of compiled operators that the CPU torch lacks, which
  fails. The hook gives that one module empty (the operators are never called).
- SGLang's rotary embedding picks its kernel by the module-level ``_is_cpu`` of
``sglang.srt.layers.rotary_embedding.base``, which is true only with
``SGLANG_USE_CPU_ENGINE=1``; that switch also selects sgl-kernel's CPU operators, which have
no build here. Left false, the module imports vLLM's CUDA rotary kernel. This hook sets
``_is_cpu`` on that one module right after it is executed (the torch rotary path), and edits
no file.

On a GPU none of this is needed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TARGET = "sglang.srt.layers.rotary_embedding.base"
_EMPTY = "torchvision._meta_registrations"


class _Empty(importlib.abc.Loader):
    def create_module(self, spec: Any) -> Any:
        return None

    def exec_module(self, module: Any) -> None:
        pass


class _SetCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == _EMPTY:
            return importlib.machinery.ModuleSpec(fullname, _Empty())
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        inner = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return inner.create_module(spec)

            def exec_module(self, module: Any) -> None:
                inner.exec_module(module)
                module._is_cpu = True

        spec.loader = _Loader()
        return spec


sys.meta_path.insert(0, _SetCpu())
