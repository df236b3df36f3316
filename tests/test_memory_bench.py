"""The memory benchmark: what a call adds to the peak is measured from a reset peak, and the
whole run (a writer and a reader process on one store) prints its table."""

from __future__ import annotations

import json
import sys

import memory_bench as memory
import pytest

pytestmark = [
    pytest.mark.bench,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self"),
]


def test_added_peak_counts_what_the_call_allocates_not_what_came_before():
    earlier = bytearray(64 << 20)  # resident and freed before the call: not the call's
    for i in range(0, len(earlier), 4096):
        earlier[i] = 1
    del earlier

    def allocate() -> int:
        block = bytearray(32 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1  # touch every page, so it is resident
        return len(block)

    result, peak = memory.added_peak(allocate)
    assert result == 32 << 20
    assert 30 << 20 <= peak < 48 << 20
    _, nothing = memory.added_peak(lambda: None)
    assert nothing < 8 << 20


def test_a_small_run_measures_every_step_of_both_roles(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DCR_KERNELS", "torch")  # the numba kernels' compile is not the point
    out = tmp_path / "memory.json"
    assert memory.main(["--mb", "4", "--rate", "0.01", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "added peak" in table and table.count("delta (warm-up)") == 2
    rows = json.loads(out.read_text())
    writer, reader = rows["writer"]["rows"], rows["reader"]["rows"]
    assert [r["step"] for r in writer] == [r["step"] for r in reader]
    assert writer[0]["changed_elements"] * 2 == writer[0]["dense_bytes"]  # the base is full
    assert 0 < writer[2]["changed_elements"] < writer[0]["changed_elements"] // 20
    assert [r["payload_bytes"] for r in reader] == [r["payload_bytes"] for r in writer]
    assert all(r["added_peak_bytes"] >= 0 for r in writer + reader)
    assert all(r["held_after_bytes"] > 0 for r in writer + reader)  # at least the baseline
