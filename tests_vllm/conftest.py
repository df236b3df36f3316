"""tests_vllm/: dcr against a real vLLM (CPU build), run with .venv-vllm's python (.ci/test).

The environment is set before vLLM is imported; the CPU prepack patch is applied in this
process and, for engine subprocesses and `vllm serve`, by tests_vllm/serve.py.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import harness

harness.apply_env()
# vLLM's CPU worker start scans sys.modules for Triton kernels and trips over llvmlite's
# objects; dcr's numba kernels would load llvmlite in this (trainer) process before the
# in-process engines start, so the trainer side here uses dcr's torch kernels
os.environ["DCR_KERNELS"] = "torch"

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: run .ci/setup-vllm")
import dcr_test_cpu_patch  # noqa: E402  (tests_vllm/plugins, put on sys.path by apply_env)

dcr_test_cpu_patch.keep_cpu_weights_updatable()


@pytest.fixture(autouse=True)
def _collect_engines() -> Iterator[None]:
    """An in-process engine kept alive by a reference cycle (a Trainer's callbacks) would be
    collected in the middle of the next test's engine, and vLLM's teardown of the first
    destroys the process-wide parallel groups the second uses: collect it here."""
    yield
    gc.collect()
