"""Smoke test of benchmarks/codec_bench.py: the quick run works and its JSON is complete."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "codec_bench.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("codec_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_result() -> dict:
    bench = _load_bench()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--quick", "--json"]) == 0
    return json.loads(out.getvalue())


def test_quick_json_structure(quick_result: dict) -> None:
    bench = _load_bench()
    assert quick_result["size"] == "tiny"
    assert quick_result["params"] > 0
    rows = quick_result["rows"]
    assert len(rows) == 2 * len(bench.TARGETS)
    for row in rows:
        for _, key, _ in bench.COLUMNS:
            assert key in row, key
        assert 0 < row["changed"] <= row["total_elements"]
        assert 0 < row["rate"] < 1
        assert row["xor_bytes"] > 0 and row["bound_bytes"] > 0
        assert all(math.isfinite(row[k]) for k in ("vs_bound", "vs_dense", "xor_vs_overwrite"))
        assert row["encode_s"] > 0 and row["decode_apply_s"] > 0 and row["clone_s"] > 0
    assert set(quick_result["goal"]) >= {"vs_bound", "vs_bound_ok", "xor_saving", "xor_saving_ok"}


def test_quick_xor_smaller_than_overwrite(quick_result: dict) -> None:
    for row in quick_result["rows"]:
        assert row["xor_bytes"] < row["overwrite_bytes"]
        assert row["vs_dense"] < 0.2


def test_table_renders(quick_result: dict) -> None:
    table = _load_bench().format_table(quick_result)
    assert "vs bound" in table and "xor/ovw" in table
    assert len(table.splitlines()) > len(quick_result["rows"]) + 2
