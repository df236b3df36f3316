"""Smoke test of benchmarks/gpu_check.py: its CPU dry run works and prints the full report."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "benchmarks" / "gpu_check.py"
SHELL = ROOT / "benchmarks" / "gpu_check.sh"
ROW_KEYS = {
    "target_rate",
    "changed",
    "change_rate",
    "compare_compact_seconds",
    "compare_compact_gbps",
    "compare_compact_ratio",
    "pipeline_seconds",
    "pipeline_gbps",
    "pipeline_ratio",
    "apply_seconds",
    "apply_gbps",
    "apply_ratio",
    "bit_exact",
}


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = _load().main(argv)
    return code, out.getvalue()


def _check_report(report: dict, kernels: str) -> None:
    assert report["dry_run"] is True
    assert report["device"] == "cpu" and report["kernels"] == kernels
    assert report["dtype"] == "bfloat16" and report["tensors"] > 10
    assert report["dense_bytes"] == 2 * report["elements"]
    assert report["copy_gbps"] > 0
    assert [row["target_rate"] for row in report["rates"]] == [0.01, 0.05]
    for row in report["rates"]:
        assert set(row) == ROW_KEYS
        assert row["bit_exact"] is True
        assert 0.4 * row["target_rate"] < row["change_rate"] < 2 * row["target_rate"]
        for key in ROW_KEYS - {"bit_exact", "target_rate", "changed", "change_rate"}:
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, key
    assert report["bit_exact"] is True


def test_dry_run_json_with_torch_kernels(monkeypatch):
    monkeypatch.delenv("DCR_KERNELS", raising=False)
    code, out = _run(["--dry-run", "--json"])
    assert code == 0
    _check_report(json.loads(out), "torch")
    assert "DCR_KERNELS" not in os.environ  # restored


def test_dry_run_text_report():
    code, out = _run(["--dry-run"])
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].startswith("dcr gpu_check: device=cpu kernels=torch dtype=bfloat16")
    assert re.match(r"copy \(device to device\): +[\d.]+ GB/s$", lines[1])
    for rate, block in zip(("1%", "5%"), (lines[2:6], lines[6:10]), strict=True):
        assert re.match(rf"rate {rate}: changed \d+ \([\d.]+%\) bit-exact: yes$", block[0])
        for line, label in zip(
            block[1:], ("compare+compact", "compact+copy-out", "apply"), strict=True
        ):
            assert re.match(rf"  {re.escape(label)}.*: +[\d.]+ GB/s = +[\d.]+x copy$", line)
    assert re.match(r"bit-exact: PASS \([\d.]+ s\)$", lines[10])
    assert len(lines) == 11


def test_dry_run_with_interpreted_triton_kernels():
    """The Triton kernels in Triton's interpreter (a fresh process: it is set at import)."""
    if importlib.util.find_spec("triton") is None:
        if os.environ.get("CI"):
            pytest.fail("triton is not installed in CI: pip install -e '.[test]'")
        pytest.skip("triton is not installed (pip install triton, Linux x86_64)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("DCR_KERNELS", None)
    done = subprocess.run(
        [sys.executable, str(CHECK), "--dry-run", "--kernels", "triton", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    _check_report(json.loads(done.stdout), "triton")


def test_full_model_is_at_least_4_gb_and_the_shell_entry_is_one_line():
    check = _load()
    elements = sum(math.prod(shape) for _, shape in check.model_shapes(**check.FULL_SHAPE))
    assert 2 * elements >= 4 * 10**9
    assert os.access(SHELL, os.X_OK)
    lines = [line for line in SHELL.read_text().splitlines() if not line.startswith("#")]
    assert len(lines) == 1 and "gpu_check.py" in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_and_without_dry_run_it_says_so(capsys):
    assert _load().main([]) == 2
    assert "--dry-run" in capsys.readouterr().err
