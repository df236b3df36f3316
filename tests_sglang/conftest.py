"""tests_sglang/: dcr against a real SGLang (its CPU path), run with .venv-sglang's python
(.ci/test). The environment and the test-only shims (tests_sglang/shims) are set before
SGLang is imported; engine processes get them through PYTHONPATH."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import harness

harness.apply_env()
# the engines' readers and this trainer use dcr's torch kernels: the compiled (numba) ones
# would compile in every engine process, which on a shared 2-core machine is most of the tier
os.environ["DCR_KERNELS"] = "torch"

sglang = pytest.importorskip("sglang", reason="SGLang is not installed: run .ci/setup-sglang")
