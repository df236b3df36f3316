"""``benchmarks/bench_suite.py --quick`` (the suite end to end) and ``dcr project``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from bench_suite import bench, plot_path
from click.testing import CliRunner

from dcr_format.cli.costs import Costs, RateCosts, shipped_costs
from dcr_format.cli.explore import project as project_cmd
from dcr_format.cli.projection import (
    REFERENCES,
    Scenario,
    parse_count,
    parse_rate,
    project,
    projection_report,
)

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parent.parent
MEMBERS = 4  # relay members of the quick run's fan-out (each a process; --quick has 8)


@pytest.fixture(scope="module")
def quick(tmp_path_factory, request) -> dict:
    """One quick run (with fewer fan-out processes): the table it prints, its JSON, its PNG
    and its costs file."""
    request.getfixturevalue("isolated_aws_env")  # a session fixture: no AWS setting leaks in
    out = tmp_path_factory.mktemp("bench")
    png, data, costs = out / "plots" / "dcr-bench.png", out / "bench.json", out / "costs.json"
    cwd = out / "cwd"
    cwd.mkdir()
    with contextlib.chdir(cwd):
        result = CliRunner().invoke(
            bench,
            [
                "--quick",
                "--members",
                str(MEMBERS),
                "--out",
                str(png.parent),
                "--json-out",
                str(data),
                "--save-costs",
                str(costs),
            ],
        )
        assert result.exit_code == 0, result.output
        assert list(cwd.iterdir()) == []  # nothing left in the working directory
    return {
        "table": result.stdout,
        "json": json.loads(data.read_text()),
        "png": png,
        "costs": costs,
    }


def test_quick_table_lists_every_measurement(quick):
    table = quick["table"]
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("measure"))
    for column in ("store", "model", "change", "baseline", "dcr", "ratio", "note"):
        assert column in header
    for measure in (
        "refit time",
        "steady publish",
        "steady apply",
        "steady sync",
        "delta bytes",
        "encode speed",
        "apply speed",
        "fan-out store bytes",
        "fan-out wall time",
    ):
        assert any(line.startswith(measure) for line in lines), measure
    assert "load average" in lines[0]
    assert f"plot: {quick['png']}" in table


def test_quick_json_structure(quick):
    data = quick["json"]
    assert data["format"] == "dcr-bench-1" and data["skipped"] == []
    refit = data["refit"]
    rates = data["options"]["rates"]
    assert {(r["store"], r["target_rate"]) for r in refit} == {
        (store, rate) for store in ("local", "s3") for rate in rates
    }
    for r in refit:
        assert r["bit_exact"] and r["dense_s"] > 0 and r["dcr_s"] > 0
        assert 0 < r["delta_bytes"] < 0.1 * r["dense_bytes"]
        assert abs(r["change_rate"] - r["target_rate"]) < 0.3 * r["target_rate"]
        if r["store"] == "local":
            # stored bytes near the iid entropy bound: the default codings, coded against the
            # old bits, may go below it
            assert 0.5 < r["delta_vs_bound"] < 2.0
    steady = data["steady"]  # medians of a long-lived writer and readers, per rate
    assert [r["target_rate"] for r in steady] == rates
    for r in steady:
        assert r["bit_exact"] and r["steps"] == 2 and r["copy_s"] > 0
        for stage in ("publish", "prepare", "apply", "sync", "dense"):
            assert r[f"{stage}_s"] > 0
            assert r[f"{stage}_vs_copy"] == r[f"{stage}_s"] / r["copy_s"]
    assert len(data["codec"]) == len(rates)
    for row in data["codec"]:
        assert row["encode_vs_clone"] > 0 and row["decode_apply_vs_clone"] > 0
    fan = data["fanout"]
    assert fan["members"] == MEMBERS and fan["bit_exact"] and fan["store"] == "s3"
    assert fan["relay_fallbacks"] == 0
    for phase in ("base", "delta"):
        alone, relay = fan["phases"][f"independent_{phase}"], fan["phases"][f"relay_{phase}"]
        # one member reads each object once for all (an independent reader may read a commit
        # record twice: the relay answers the second read from memory)
        assert MEMBERS * relay["bytes"] <= alone["bytes"] < (MEMBERS + 0.1) * relay["bytes"]
        assert MEMBERS * relay["requests"] <= alone["requests"]
    assert len(data["table"]) >= 2 * len(refit) + 4


def test_quick_png_is_a_sane_image(quick):
    raw = quick["png"].read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", raw[16:24])
    assert 800 <= width <= 3000 and 600 <= height <= 2500
    assert 30_000 < len(raw) < 3_000_000


def test_project_from_saved_costs(quick):
    runner = CliRunner()
    args = ["--params", "1T", "--change", "3%", "--rollout-nodes", "64", "--link-gbps", "5"]
    result = runner.invoke(project_cmd, [*args, "--costs", str(quick["costs"])])
    assert result.exit_code == 0, result.output
    text = result.stdout
    for method in ("dense", "dcr over S3", "dcr relay tree"):
        assert any(line.startswith(method) for line in text.splitlines()), method
    for ref in REFERENCES:
        assert ref.name in text
    assert "why it differs" in text
    # the suite measures the part of a sync after its last object at every rate
    assert all(r.sync_tail_s_per_byte is not None for r in Costs.load(quick["costs"]).rates)
    assert "come after the last object" in text
    result = runner.invoke(project_cmd, [*args, "--costs", str(quick["costs"]), "--format", "json"])
    report = json.loads(result.stdout)
    totals = {e["method"]: e for e in report["estimates"]}
    assert totals["dcr over S3"]["network_s"] < totals["dense"]["network_s"] / 10
    assert totals["dcr relay tree"]["store_egress_bytes"] * 8 == pytest.approx(
        totals["dcr over S3"]["store_egress_bytes"]
    )
    assert len(report["references"]) == len(REFERENCES)


def test_project_uses_the_shipped_costs_without_a_file():
    # the package carries the costs the steady benchmark wrote for a 1 GB model
    shipped = shipped_costs()
    assert shipped.source == "benchmarks/steady_bench.py --save-costs"
    assert shipped.model_bytes > 900_000_000
    assert 'dcr_format = ["py.typed", "cli/costs.json"]' in (ROOT / "pyproject.toml").read_text()
    result = CliRunner().invoke(project_cmd, ["--params", "120B", "--change", "5%"])
    assert result.exit_code == 0, result.output
    assert "costs: benchmarks/steady_bench.py --save-costs" in result.stdout
    assert "120B delta at 5%" in result.stdout


def test_the_plot_goes_under_out_or_a_new_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plot_path(None, "p.png") == "p.png"
    assert plot_path(str(tmp_path / "a" / "b"), None) == str(tmp_path / "a" / "b" / "dcr-bench.png")
    assert (tmp_path / "a" / "b").is_dir()
    default = Path(plot_path(None, None))
    assert default.name == "dcr-bench.png" and default.parent.is_dir()
    assert default.parent != tmp_path and not default.exists()
    default.parent.rmdir()
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(bench, ["--quick", "--out", str(tmp_path / "file" / "x")])
    assert result.exit_code == 2 and "--out" in result.output


def test_bad_options_are_refused():
    runner = CliRunner()
    assert runner.invoke(project_cmd, ["--params", "lots"]).exit_code == 2
    assert runner.invoke(project_cmd, ["--params", "1T", "--change", "300%"]).exit_code == 2
    assert runner.invoke(bench, ["--sizes", "big"]).exit_code == 2
    assert parse_count("1T") == 1e12 and parse_count("120B") == 120e9 and parse_count("7e9") == 7e9
    assert parse_rate("3%") == pytest.approx(0.03) and parse_rate("0.05") == 0.05


# every value is checked before the benchmark starts: (arguments, a fragment of the error)
BAD_SUITE_OPTIONS: list[tuple[tuple[str, ...], str]] = [
    (("--sizes", "0"), "sizes must be positive numbers"),
    (("--sizes", "abc"), "is not a size like 100"),
    (("--sizes", "inf"), "sizes must be positive numbers"),
    (("--rates", "x"), "is not a change rate like 3%"),
    (("--rates", "200%"), "must be in (0, 100%]"),
    (("--members", "1"), "'--members': 1 is not in the range"),
    (("--reps", "0"), "'--reps': 0 is not in the range"),
    (("--fanout-mb", "nan"), "is not a finite number"),
    (("--png", "{new}/x.png"), "create it or write the file elsewhere"),
    (("--png", "{empty}"), "is a directory"),
    (("--json-out", "{new}/x.json"), "create it or write the file elsewhere"),
    (("--save-costs", "{new}/c.json"), "create it or write the file elsewhere"),
]


@pytest.mark.parametrize(("args", "fragment"), BAD_SUITE_OPTIONS, ids=lambda v: str(v)[:40])
def test_bad_suite_options_are_refused_before_it_starts(tmp_path, args, fragment):
    paths = {"new": str(tmp_path / "new"), "empty": str(tmp_path)}
    result = CliRunner().invoke(bench, [a.format(**paths) for a in args])
    assert result.exit_code == 2, (result.output, result.exception)
    assert fragment.format(**paths) in " ".join(result.stderr.split()), result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "new").exists()


def _costs(**overrides) -> Costs:
    fields = {
        "source": "test",
        "created": "2026-01-01T00:00:00.000000Z",
        "machine": {"cpus": 2, "load_average": [1.0]},
        "model_bytes": 100_000_000,
        "rates": (
            RateCosts(
                rate=0.01, bytes_per_changed=1.5, publish_s_per_byte=2e-9, sync_s_per_byte=3e-9
            ),
            RateCosts(
                rate=0.04, bytes_per_changed=1.2, publish_s_per_byte=4e-9, sync_s_per_byte=5e-9
            ),
        ),
        "dense_serialise_s_per_byte": 1e-9,
        "dense_load_s_per_byte": 1e-9,
        "request_s": 0.01,
        "request_store": "s3",
        "get_bytes_per_s": 1e9,
        "put_bytes_per_s": 1e9,
        "sha256_bytes_per_s": 1e9,
        "relay_hop_bytes_per_s": 2e9,
        "relay_round_s": 0.001,
        "shard_bytes": 256 << 20,
        "chunk_bytes": 4 << 20,
    }
    return Costs(**{**fields, **overrides})


def test_projection_model():
    costs = _costs()
    at = {e.method: e for e in project(Scenario(params=1e12, change=0.02), costs)}
    # delta bytes interpolate between measured rates (log-linear): between 1.2 and 1.5 B/change
    delta = at["dcr over S3"].moved_bytes
    assert 1e12 * 0.02 * 1.2 < delta < 1e12 * 0.02 * 1.5
    assert at["dense"].moved_bytes == 2e12
    link = 5e9 / 8
    assert at["dense"].terms["download"] == pytest.approx(2e12 / link)
    assert at["dcr over S3"].terms["download"] == pytest.approx(delta / link)
    for estimate in at.values():  # the stages add up to the total, each of one kind
        assert estimate.total == pytest.approx(sum(estimate.terms.values()))
        assert estimate.total == pytest.approx(
            sum(estimate.by_kind(kind) for kind in ("network", "compute", "requests"))
        )
    # the relay hop runs at the fabric's speed: the tree streams at the leader's download
    relay, fill = at["dcr relay tree"].terms["relay"], 3 * ((4 << 20) / 12.5e9 + 0.001)
    assert relay == pytest.approx(delta / link + fill)
    slow = {e.method: e for e in project(Scenario(1e12, 0.02, fabric_gbps=1), costs)}
    hop = 1e9 / 8
    assert slow["dcr relay tree"].terms["relay"] == pytest.approx(
        2 * delta / hop + 3 * ((4 << 20) / hop + 0.001)
    )
    unchanged = ("encode", "upload", "download", "apply")
    assert all(slow["dcr relay tree"].terms[t] == at["dcr relay tree"].terms[t] for t in unchanged)
    assert slow["dcr over S3"].terms == at["dcr over S3"].terms
    # fabric 0: the hop measured in the costs (2e9 B/s), capped by the 5 Gbps link; the
    # binary tree sends each byte twice per inner node, so with no store limit it is slower
    measured = {e.method: e for e in project(Scenario(1e12, 0.02, fabric_gbps=0), costs)}
    assert measured["dcr relay tree"].terms["relay"] == pytest.approx(
        2 * delta / link + 3 * ((4 << 20) / link + 0.001)
    )
    assert measured["dcr relay tree"].total > measured["dcr over S3"].total
    assert at["dcr relay tree"].store_egress_bytes == 8 * delta
    # a store that gives each of 64 nodes 1 Gbps: the tree wins
    limited = {e.method: e for e in project(Scenario(1e12, 0.02, store_gbps=64), costs)}
    assert limited["dcr relay tree"].total < limited["dcr over S3"].total
    # a chain (fan-out 1) sends each byte once
    at = measured
    chain = {e.method: e for e in project(Scenario(1e12, 0.02, fanout=1, fabric_gbps=0), costs)}
    assert chain["dcr relay tree"].terms["relay"] < at["dcr relay tree"].terms["relay"]
    report = projection_report(Scenario(1e12, 0.2), costs)
    assert report["rate_outside_measured"] is True
    assert all(math.isfinite(e["total_s"]) for e in report["estimates"])


def test_a_sync_overlaps_the_download_by_what_the_costs_measured():
    """Costs that measure the part of a sync after its last object overlap the rest with
    the delta's arrival (direct download, or the relay tree's stream); costs without that
    measure add the whole sync after the download, as an old costs file has it."""
    from dcr_format.cli.projection import apply_after

    assert apply_after(10.0, None, 4.0) == 10.0  # not measured: nothing overlaps
    assert apply_after(10.0, 3.0, 4.0) == pytest.approx(3.0 + (10.0 - 3.0 - 4.0))
    assert apply_after(10.0, 3.0, 20.0) == 3.0  # the download is the longer: the tail only
    assert apply_after(10.0, 12.0, 4.0) == 10.0  # a tail longer than the sync is the sync
    serial = _costs()
    tails = tuple(
        r.model_copy(update={"sync_tail_s_per_byte": r.sync_s_per_byte / 4}) for r in serial.rates
    )
    overlapped = _costs(rates=tails)
    scenario = Scenario(params=1e12, change=0.02)
    before = {e.method: e for e in project(scenario, serial)}
    after = {e.method: e for e in project(scenario, overlapped)}
    for method in ("dcr over S3", "dcr relay tree"):
        sync = before[method].terms["apply"]
        arrival = sum(
            after[method].terms[t] for t in ("download", "relay") if t in after[method].terms
        )
        want = sync / 4 + max(0.0, sync * 3 / 4 - arrival)
        assert after[method].terms["apply"] == pytest.approx(want)
        assert after[method].total < before[method].total
        assert {t: v for t, v in after[method].terms.items() if t != "apply"} == {
            t: v for t, v in before[method].terms.items() if t != "apply"
        }
    assert after["dense"].terms == before["dense"].terms
    # a rate between two measured ones takes the tail between theirs; one side unmeasured:
    # none
    at, _ = _interp_of(overlapped, 0.02)
    assert tails[0].sync_tail_s_per_byte < at.sync_tail_s_per_byte < tails[1].sync_tail_s_per_byte
    half = _costs(rates=(tails[0], serial.rates[1]))
    assert _interp_of(half, 0.02)[0].sync_tail_s_per_byte is None
    from dcr_format.cli.projection import format_projection

    assert "of it after the last object" in format_projection(
        projection_report(scenario, overlapped)
    )
    assert "after the last object" not in format_projection(projection_report(scenario, serial))
    lines = projection_report(scenario, overlapped)["why"]
    assert any("come after the last object" in line for line in lines)
    assert any(
        "is added after the download" in line for line in projection_report(scenario, serial)["why"]
    )


def test_a_writer_uploads_while_it_codes():
    """Each shard goes out while the next tensors are coded: the upload adds its last
    shards, or what it takes beyond the coding where the link is the narrower pipe."""
    from dcr_format.cli.projection import upload_after

    assert upload_after(4.0, 20.0, 0.5) == 0.5
    assert upload_after(30.0, 20.0, 0.5) == 10.0
    assert upload_after(0.2, 20.0, 0.5) == 0.2  # a delta smaller than the last shards
    costs = _costs()
    at = {e.method: e for e in project(Scenario(params=1e12, change=0.02), costs)}
    terms = at["dcr over S3"].terms
    link = 5e9 / 8
    delta = at["dcr over S3"].moved_bytes
    last = min(delta / (8 * link), 8 * min(256 << 20, delta / 64) / link)
    assert terms["upload"] == pytest.approx(max(last, delta / (8 * link) - terms["encode"]))
    assert terms["upload"] < delta / (8 * link)
    assert at["dense"].terms["upload"] == pytest.approx(2e12 / (8 * link))  # not overlapped


def _interp_of(costs: Costs, rate: float):  # type: ignore[no-untyped-def]
    from dcr_format.cli.projection import _interp

    return _interp(costs, rate)


def test_a_costs_file_without_sync_tails_still_loads(tmp_path):
    data = json.loads(shipped_costs().to_json())
    for rate in data["rates"]:
        rate.pop("sync_tail_s_per_byte", None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert all(r.sync_tail_s_per_byte is None for r in Costs.load(path).rates)


def test_project_cluster_options_are_the_scenario_fields(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(_costs().to_json())
    runner = CliRunner()

    def scenario(*options: str) -> dict:
        args = ["--params", "1T", *options, "--costs", str(costs), "--format", "json"]
        result = runner.invoke(project_cmd, args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["scenario"]

    assert scenario() == dataclasses.asdict(Scenario(params=1e12, change=0.03))
    given = {
        "rollout_nodes": 3,
        "link_gbps": 2.5,
        "fabric_gbps": 40.0,
        "trainer_nodes": 4,
        "workers": 5,
        "store_gbps": 6.5,
        "group_size": 7,
        "fanout": 3,
        "bytes_per_param": 1.5,
    }
    options = [f"--{k.replace('_', '-')}={v}" for k, v in given.items()]
    assert scenario(*options) == dataclasses.asdict(Scenario(1e12, 0.03, **given))
    bad_options = ("--workers=0", "--link-gbps=0", "--link-gbps=nan", "--store-gbps=inf")
    for bad in (*bad_options, "--fabric-gbps=-1"):
        result = runner.invoke(project_cmd, ["--params", "1T", bad, "--costs", str(costs)])
        assert result.exit_code == 2, bad


def test_the_harnesses_run_from_a_clone_outside_the_package():
    assert not (ROOT / "dcr_format" / "bench").exists()  # the installed package carries none
    names = ("codec_bench.py", "refit_bench.py", "bench_suite.py", "bench_costs.py")
    runs = {  # side by side: each start is mostly imports
        name: subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / name), "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in names
    }
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0 and "usage" in out.lower(), (name, err)


def test_steady_benchmark_quick_run(tmp_path):
    """benchmarks/steady_bench.py --quick: long-lived ends, medians, every stage over copy_."""
    out = tmp_path / "steady.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "steady_bench.py"), "--quick", "--json",
         str(out)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    assert "steady-state refit" in result.stdout and "dense/dcr" in result.stdout
    data = json.loads(out.read_text())
    rows = [r for r in data["rows"] if not r["warmup"]]
    assert len(rows) == 4 and all(r["bit_exact"] for r in data["rows"])
    assert not any(r["sync_audited"] for r in rows)  # steady state: no full re-read
    assert {r["target_rate"] for r in data["summary"]} == {0.005, 0.01}


def test_steady_benchmark_runs_a_mixture_of_experts_layout(tmp_path):
    """--experts: the same bytes as many small tensors (where a tensor's fixed cost shows),
    every step still bit-exact; the header says how many tensors."""
    from refit_bench import model_shapes

    dense, moe = model_shapes(20.0), model_shapes(20.0, experts=4)
    size = lambda shapes: sum(math.prod(s) for s in shapes.values())  # noqa: E731
    assert len(moe) > len(dense) and abs(size(moe) / size(dense) - 1) < 0.05
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in moe
    assert "model.layers.0.mlp.gate_proj.weight" not in moe
    with pytest.raises(ValueError, match="experts must be 0 or more"):
        model_shapes(20.0, experts=-1)
    out = tmp_path / "steady.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "steady_bench.py"), "--quick", "--experts",
         "4", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    assert f"20 MB bf16 model of {len(moe)} tensors" in result.stdout
    data = json.loads(out.read_text())
    assert data["tensors"] == len(moe) and all(r["bit_exact"] for r in data["rows"])


def test_native_benchmark_small_run():
    """benchmarks/native_bench.py on a small tensor: every measurement prints, and the
    classed positions it times decode to the positions it coded (the script checks)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "native_bench.py"), "--elements", "200000",
         "--repeats", "1", "--threads", "1"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    out = result.stdout
    assert "torch threads 1, numba threads 1" in out
    for heading in ("Rice,", "Fingerprint full pass", "Diff of bf16[200000] at 5%"):
        assert heading in out
    for rate in ("1%", "5%"):
        assert f"Classed positions of bf16[200000] at {rate}" in out
    assert out.count("x copy_") >= 6


def test_pause_benchmark_small_run():
    """benchmarks/pause_bench.py: both targets' pauses print beside a dense copy, and the
    memory reads it reports as the write's bound run."""
    bench = [sys.executable, str(ROOT / "benchmarks" / "pause_bench.py")]
    pauses, lines = (  # side by side: only what they print is checked, not how fast
        subprocess.Popen([*bench, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in (
            ("--steps", "2", "--layers", "1", "--vocab", "512", "--fraction", "0.03"),
            ("--lines", "4", "--fraction", "0.01"),
        )
    )
    out, err = pauses.communicate(timeout=600)
    assert pauses.returncode == 0, err
    for kind in ("dict", "module"):
        assert any(line.startswith(kind) and "pause/dense" in line for line in out.splitlines())
    out, err = lines.communicate(timeout=600)
    assert lines.returncode == 0, err
    assert out.count(" ms") == 3 and "1.0% changed positions" in out


def test_cli_benchmark_small_run():
    """benchmarks/cli_bench.py: every command it times runs, it reports each goal, and its
    breakdown names each start-up piece, the kernels loaded and the work of each command."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cli_bench.py"), "--mb", "1", "--steps", "1",
         "--repeat", "1", "--breakdown"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    for name in ("python -c pass", "dcr --version", "dcr log", "warm publish, pull"):
        assert any(line.startswith(name) for line in lines), result.stdout
    assert result.stdout.count("goal") == 3
    pieces = ("+ torch, numpy", "+ the package's modules", "+ numba, the kernel", "+ numba's setup")
    for piece in pieces:
        assert sum(line.strip().startswith(piece) for line in lines) == 1, result.stdout
    for command in ("publish", "pull"):
        (line,) = [line for line in lines if line.strip().startswith(f"{command}: ")]
        assert "kernels loaded from numba's cache" in line and "the work alone" in line
