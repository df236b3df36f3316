"""The `dcr` command as a user meets it: the environment of S3 work does not break local
stores, commands start without loading what they do not need, out-of-range values are one
named line, nothing is created or committed by a command that has nothing to do."""

from __future__ import annotations

import ast
import gc as collector
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner, Result
from conftest import assert_same_bits, make_state, step_state
from safetensors.torch import save_file

from dcr_format import DeltaWriter
from dcr_format.cli.main import COMMAND_MODULES, cli
from dcr_format.errors import ArgumentError, GraceTooShortError
from dcr_format.tools import gc
from dcr_format.tools._common import parse_duration


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local store whose chain ends at version 1."""
    root = tmp_path_factory.mktemp("cli-workflow")
    gen = torch.Generator().manual_seed(0)
    state = make_state(0)
    writer = DeltaWriter(root / "store", cache_dir=root / "cache")
    for version in range(2):
        if version:
            step_state(state, gen)
        writer.publish(state, step=version)
    return str(root / "store")


def _invoke(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env={"DCR_DEBUG": None, **(env or {})})


def test_aws_endpoint_from_the_environment_applies_to_s3_stores_only(store: str) -> None:
    env: dict[str, str | None] = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    result = _invoke("log", "--store", store, env=env)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].startswith("1 ")
    # even one that is no URL at all: it is for S3 tools, not for this store
    assert _invoke("log", "--store", store, env={"AWS_ENDPOINT_URL": "x"}).exit_code == 0
    # an explicit --endpoint-url with a local store is still a usage error
    refused = _invoke("log", "--store", store, "--endpoint-url", "http://127.0.0.1:9")
    assert refused.exit_code == 2 and "applies to s3:// stores" in refused.stderr


_HEAVY = (
    "torch",
    "numpy",
    "numba",
    "pydantic",
    "fsspec",
    "s3fs",
    "botocore",
    "aiobotocore",
    "boto3",
)
_COMMAND_MODULES = tuple(
    f"dcr_format.cli.{module}" for module in ("transfer", "browse", "maintain", "explore")
)


def _heavy_modules(
    *argv: str, modules: tuple[str, ...] = _COMMAND_MODULES
) -> tuple[str, list[str], tuple[bool, int, str | None]]:
    """What ``dcr ARGV`` prints, which heavy packages (``_HEAVY``) and ``modules`` (the
    command modules of the CLI) it imported, and whether its garbage collector is on after
    it, how many objects it froze and the OpenMP wait policy it left for its kernels."""
    code = (
        "import gc, os, sys\n"
        "from dcr_format.cli.main import main\n"
        f"try:\n    main({list(argv)!r})\nexcept SystemExit:\n    pass\n"
        f"heavy = {{m.split('.')[0] for m in sys.modules}} & set({_HEAVY!r})\n"
        f"heavy |= set(sys.modules) & set({modules!r})\n"
        "print(sorted(heavy))\n"
        "print((gc.isenabled(), gc.get_freeze_count(), os.environ.get('OMP_WAIT_POLICY')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0, run.stderr
    *out, heavy, collector = run.stdout.splitlines()
    return "\n".join(out), ast.literal_eval(heavy), ast.literal_eval(collector)


def test_version_and_log_import_only_what_they_need(store: str) -> None:
    out, heavy, gc_state = _heavy_modules("--version")
    assert out == "dcr, version 0.1.0" and heavy == [] and gc_state == (True, 0, "PASSIVE")
    # a local store: no S3 or fsspec client; and only the module that defines ``log``
    out, heavy, (enabled, frozen, _) = _heavy_modules("log", "--store", store)
    assert out.splitlines()[-1].startswith("1 ")
    assert heavy == ["dcr_format.cli.browse", "pydantic"]  # no numpy, torch or numba
    out, heavy, _ = _heavy_modules("show", "1", "--store", store)
    assert "version 1" in out and heavy == ["dcr_format.cli.browse", "pydantic"], out
    # what the command imported is frozen, out of the collector's way; the work collects
    assert enabled and frozen > 10_000
    # a caller that runs the command in its own process keeps its collector as it was
    assert _invoke("log", "--store", store).exit_code == 0
    assert collector.isenabled() and collector.get_freeze_count() == 0


def test_a_publish_restarted_on_its_cache_imports_no_reader(tmp_path: Path) -> None:
    store, cache = str(tmp_path / "store"), ("--cache-dir", str(tmp_path / "cache"))
    state = make_state(0)
    ckpt = _checkpoint(tmp_path / "ckpt", state)
    assert _invoke("publish", ckpt, "--store", store, *cache).exit_code == 0
    step_state(state, torch.Generator().manual_seed(1))
    _checkpoint(tmp_path / "ckpt", state)
    reader = ("dcr_format.sync.reader", "dcr_format.sync._plan")
    out, heavy, _ = _heavy_modules("publish", ckpt, "--store", store, *cache, modules=reader)
    assert out.startswith("committed version 1 (delta)"), out
    assert not set(heavy) & set(reader)  # the cache at the chain's version: nothing to replay


def test_each_command_is_looked_up_in_the_module_that_defines_it() -> None:
    defined = {
        command.name: module.rsplit(".", 1)[1]
        for module in _COMMAND_MODULES
        for command in importlib.import_module(module).COMMANDS
    }
    assert defined == COMMAND_MODULES


def test_a_huge_grace_is_one_line_not_an_overflow(store: str) -> None:
    result = _invoke("gc", "--store", store, "--keep-last", "1", "--grace", "99999999999d")
    assert result.exit_code == 2, result.output
    assert "longer than" in result.stderr and "Traceback" not in result.output
    result = _invoke("gc", "--store", store, "--keep-last", "1", "--grace", "9" * 400 + "d")
    assert result.exit_code == 2 and "longer than" in result.stderr
    assert parse_duration("1000w") == timedelta(weeks=1000)


def test_a_grace_below_the_commit_timeout_is_refused(store: str) -> None:
    with pytest.raises(GraceTooShortError, match="commit timeout"):
        gc(store, keep_last=1, grace=timedelta(minutes=5))
    with pytest.raises(GraceTooShortError):
        gc(store, keep_last=1, grace=timedelta(seconds=30), commit_timeout=timedelta(minutes=1))
    result = _invoke("gc", "--store", store, "--keep-last", "5", "--grace", "1m")
    assert result.exit_code == 1 and "commit timeout" in result.stderr
    # where the writers use a shorter timeout (or none runs), a shorter grace is fine
    ok = ("--grace", "1m", "--commit-timeout", "30s", "--dry-run")
    assert _invoke("gc", "--store", store, "--keep-last", "5", *ok).exit_code == 0
    assert gc(store, keep_last=5, grace=timedelta(0), commit_timeout=timedelta(0)).deleted == []


def test_diff_past_the_end_of_the_chain_names_the_version_asked_for(store: str) -> None:
    result = _invoke("diff", "0", "7", "--store", store)
    assert result.exit_code == 1
    assert "version 7 is not committed" in result.stderr and "0..1" in result.stderr
    assert "version 2" not in result.stderr


def test_doctor_refuses_a_directory_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "store"
    result = _invoke("doctor", "--store", str(missing))
    assert result.exit_code == 1 and "does not exist" in result.stderr, result.output
    assert "safe" not in result.stdout
    assert not (tmp_path / "no").exists()
    os.makedirs(missing)  # an empty directory is a new store to probe
    assert _invoke("doctor", "--store", str(missing), "--large-mb", "0").exit_code == 0


def _checkpoint(path: Path, state: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    path.mkdir(exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    return str(path)


def test_publishing_an_unchanged_checkpoint_commits_nothing(tmp_path: Path) -> None:
    from dcr_format import Store
    from dcr_format.errors import UnchangedVersionError

    store = str(tmp_path / "store")
    cache = ("--cache-dir", str(tmp_path / "cache"))
    ckpt = _checkpoint(tmp_path / "ckpt", make_state(0))
    assert _invoke("publish", ckpt, "--store", store, *cache).exit_code == 0
    listed = Store(store).list()
    again = _invoke("publish", ckpt, "--store", store, *cache)
    assert again.exit_code == 0, again.output
    assert again.stdout.startswith("unchanged:") and "nothing committed" in again.stdout
    assert Store(store).list() == listed  # a delta that uploads nothing leaves no marker
    as_base = _invoke("publish", ckpt, "--store", store, *cache, "--base-every", "1")
    assert as_base.stdout.startswith("unchanged:"), as_base.output
    assert Store(store).list() == listed  # found before the base was uploaded in full
    forced = _invoke("publish", ckpt, "--store", store, *cache, "--allow-empty")
    assert "committed version 1" in forced.stdout, forced.output
    (tmp_path / "ckpt" / "config.json").write_text('{"changed": true}')  # a file alone is a change
    edited = _invoke("publish", ckpt, "--store", store, *cache)
    assert "committed version 2" in edited.stdout, edited.output
    # the writer option under it: nothing committed, and the next change still publishes
    writer = DeltaWriter(store, cache_dir=tmp_path / "cache2")
    state = make_state(0)
    listed = Store(store).list()
    with pytest.raises(UnchangedVersionError):
        writer.publish(state, allow_empty=False)
    assert Store(store).list() == listed
    step_state(state, torch.Generator().manual_seed(3))
    assert writer.publish(state, allow_empty=False).version == 3


def test_a_base_held_back_while_unchanged_publishes_every_tensor_once_it_differs(
    tmp_path: Path,
) -> None:
    from dcr_format import DeltaReader, StateDictTarget, Store
    from dcr_format.errors import UnchangedVersionError

    store = Store(tmp_path / "store")
    writer = DeltaWriter(store, base_every=1)
    state = make_state(0)
    writer.publish(state)
    names = list(state)
    with pytest.raises(UnchangedVersionError):  # streamed once: found after the last tensor
        writer.publish(iter(list(state.items())), allow_empty=False)
    with pytest.raises(ArgumentError, match="given twice"):  # held names are still checked
        writer.publish([(names[0], state[names[0]])] * 2, allow_empty=False)
    assert not any("/shard-" in k for k in store.list("objects/00000000000000000001/"))
    changed = dict(state)
    last = names[-1]  # every tensor before it is held back, then given from the baseline
    changed[last] = state[last] + 1
    assert writer.publish(iter(list(changed.items())), allow_empty=False).version == 1
    fewer = {n: t for n, t in changed.items() if n != last}  # a base may drop a tensor
    assert writer.publish(fewer, allow_empty=False).version == 2
    for version, expected in ((1, changed), (2, fewer)):
        target = StateDictTarget({})
        DeltaReader(store, target).sync(version)
        assert_same_bits(target.tensors, expected)


def test_a_publish_that_fails_after_uploading_a_shard_marks_its_attempt(tmp_path: Path) -> None:
    from dcr_format import Store

    store = Store(tmp_path / "store")
    writer = DeltaWriter(store, cache_dir=tmp_path / "cache", shard_bytes=64)
    state = make_state(0)

    def interrupted() -> Iterator[tuple[str, torch.Tensor]]:
        yield from list(state.items())[:4]  # more than a 64-byte shard: one is uploaded
        raise OSError("the checkpoint file could not be read")

    with pytest.raises(OSError, match="could not be read"):
        writer.publish(interrupted())
    keys = store.list("objects/")
    assert any("/shard-" in k for k in keys)
    assert sum(k.endswith("/ABORTED") for k in keys) == 1
    assert writer.publish(state).version == 0  # the next try starts afresh


def test_a_refused_pull_leaves_no_lock_file_and_pull_offers_no_writer_option(
    store: str, tmp_path: Path
) -> None:
    into = tmp_path / "out"
    refused = _invoke("pull", "--store", store, "--into", str(into), "--version", "5")
    assert refused.exit_code == 1 and "not committed" in refused.stderr
    assert sorted(os.listdir(tmp_path)) == []
    assert "--single-writer" not in _invoke("pull", "--help").stdout
    assert "--single-writer" in _invoke("publish", "--help").stdout


def test_demo_leaves_the_store_of_dcr_store_alone(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dcr_format.cli.demo as demo

    given: list[str] = []
    monkeypatch.setattr(demo, "run_demo", lambda where, **_: given.append(str(where)) or [])
    result = _invoke("demo", "--size", "tiny", "--steps", "1", env={"DCR_STORE": store})
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("store: a temporary directory")
    assert len(given) == 1 and not given[0].startswith(store)
    assert "dcr demo: training a tiny model for 1 step\n" in result.stderr


def test_demo_streams_its_rows_reports_progress_and_removes_its_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    rows: list[str] = []
    import dcr_format.cli.demo as demo

    real = demo.run_demo

    def watched(*args, **kwargs):  # type: ignore[no-untyped-def]
        given = kwargs["on_row"]

        def on_row(row):  # type: ignore[no-untyped-def]
            given(row)
            rows.append(row.version)

        return real(*args, **{**kwargs, "on_row": on_row})

    monkeypatch.setattr(demo, "run_demo", watched)
    prepared: list[int] = []
    prepare = demo.DeltaReader.prepare

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        version = prepare(self, *args, **kwargs)
        prepared.append(version.version)
        return version

    monkeypatch.setattr(demo.DeltaReader, "prepare", counted)
    result = _invoke("demo", "--size", "tiny", "--steps", "2", env={"DCR_PROGRESS_INTERVAL": "0"})
    assert result.exit_code == 0, result.output
    assert rows == [0, 1, 2]
    table = result.stdout.splitlines()
    assert table[0] == "store: a temporary directory (removed at the end)"
    assert [line.split()[0] for line in table[2:]] == ["0", "1", "2"]
    assert all(line.endswith("yes") for line in table[2:])
    # the pause is of a prepared version, as an engine's is, in milliseconds
    assert table[1].split()[-2:] == ["apply", "verified"]
    assert all(line.split()[-2].endswith("ms") for line in table[2:])
    assert prepared == [0, 1, 2]
    assert "dcr demo: 3 of 3 versions" in result.stderr
    assert [n for n in os.listdir(tmp_path) if n.startswith("dcr-demo-")] == []  # store gone


def test_long_tools_report_progress_off_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCR_PROGRESS_INTERVAL", "0")
    store = str(tmp_path / "store")
    gen = torch.Generator().manual_seed(0)
    state = make_state(0)
    writer = DeltaWriter(store, cache_dir=tmp_path / "cache")
    for version in range(4):
        if version:
            step_state(state, gen)
        writer.publish(state)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(state, str(ckpt / "model.safetensors"))
    pulled = str(tmp_path / "pulled")
    assert _invoke("pull", "--store", store, "--into", pulled, "--version", "1").exit_code == 0
    runs = {
        "replay": ("replay", "3", "--store", store, "--out", str(tmp_path / "r"), "--no-cache"),
        "pull": ("pull", "--store", store, "--into", pulled),  # from version 1 on
        "publish": (
            "publish",
            str(ckpt),
            "--store",
            str(tmp_path / "other"),
            "--cache-dir",
            str(tmp_path / "c"),
        ),
        "verify --deep": ("verify", "--store", store, "--deep"),
        "diff": ("diff", "0", "3", "--store", store),
        "compact": ("compact", "--store", store, "--at", "2"),
    }
    for what, args in runs.items():
        result = _invoke(*args)
        assert result.exit_code == 0, (what, result.output)
        lines = [line for line in result.stderr.splitlines() if line.startswith("dcr ")]
        assert lines, (what, result.stderr)
        assert any(f"dcr {what}" in line and " s" in line for line in lines), lines
        assert "done" in lines[-1], lines
        if what in ("replay", "pull"):  # the bytes of the payload, out of the payload's total
            assert all(" of " in line for line in lines), lines
            fetched, total = lines[-1].split("done, ")[1].rsplit(", ", 1)[0].split(" of ")
            assert fetched == total, lines[-1]


def test_plot_marks_compacted_versions_and_keeps_its_legend_off_the_data(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from dcr_format.tools import compact, plot_data
    from dcr_format.tools._plot import _COMPACTED, _figure

    store = str(tmp_path / "store")
    gen = torch.Generator().manual_seed(0)
    state = make_state(0)
    writer = DeltaWriter(store, cache_dir=tmp_path / "cache")
    for version in range(3):
        if version:
            step_state(state, gen)
        writer.publish(state)
    compact(store, 1)
    data = plot_data(store)
    assert [(v.kind, v.compacted) for v in data.versions] == [
        ("base", False), ("delta", True), ("delta", False),
    ]  # fmt: skip
    figure = _figure(data, dpi=50)
    figure.canvas.draw()
    top = figure.axes[0]
    bars = [p.get_facecolor() for p in top.patches]
    from matplotlib.colors import to_rgba

    assert bars[1] == to_rgba(_COMPACTED) and bars[2] != bars[1]
    legend = top.get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert "delta with an alternative base" in labels and "dense checkpoint" in labels
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    box, area = legend.get_window_extent(renderer), top.get_window_extent(renderer)
    assert box.x0 >= area.x1  # beside the panel: it covers neither bars nor the dense line


def test_replay_and_pull_say_where_the_versions_came_from(store: str, tmp_path: Path) -> None:
    def said(*args: str) -> str:
        result = _invoke(*args, "--store", store)
        assert result.exit_code == 0, result.output
        return result.stdout.strip()

    cache = ("--cache-dir", str(tmp_path / "cache"))
    a, b, c = (str(tmp_path / name) for name in "abc")
    assert "verified: 1 version applied from the base at version 0," in said(
        "replay", "0", "--out", a, *cache
    )
    assert "verified: 1 version applied from the cache at version 0," in said(
        "replay", "1", "--out", b, *cache
    )
    assert said("replay", "1", "--out", c, *cache).endswith("verified: copied from the cache")
    assert said("replay", "1", "--out", b, *cache).endswith("verified: already there")
    pulled = said("pull", "--into", str(tmp_path / "d"), "--version", "0")
    assert pulled.startswith(f"{tmp_path / 'd'} is at version 0 (applied 1 version, ")


def test_every_option_of_every_command_says_what_it_does() -> None:
    ctx = click.Context(cli)
    undocumented = [
        f"dcr {name} {param.opts[0]}"
        for name in COMMAND_MODULES
        for param in cli.get_command(ctx, name).params  # type: ignore[union-attr]
        if isinstance(param, click.Option) and not param.help
    ]
    assert undocumented == []


def test_a_long_step_off_a_terminal_says_it_is_still_working(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gc
    import threading
    import time

    from dcr_format.tools import _progress

    monkeypatch.setenv("DCR_PROGRESS_INTERVAL", "0.01")
    monkeypatch.setattr(_progress, "MIN_QUIET_SECONDS", 0.05)

    def heartbeats(what: str) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == f"dcr progress: {what}"]

    with _progress.Progress("slow", total=3, unit="versions") as bar:
        bar.add()
        time.sleep(0.4)  # one long step: lines say it goes on
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("dcr slow: still working, 1 of 3 versions, ") for line in lines)
    assert lines[-1].startswith("dcr slow: done, 1 of 3 versions"), lines
    time.sleep(0.2)  # closed: nothing more, and its heartbeat has ended
    assert capsys.readouterr().err == ""
    assert not heartbeats("slow")

    with pytest.raises(RuntimeError), _progress.Progress("failed", total=2) as bar:
        bar.add()
        raise RuntimeError("stop")
    assert "done" not in capsys.readouterr().err  # a failed run has no "done" line

    forgotten = _progress.Progress("forgotten")  # never closed: its heartbeat ends with it
    assert heartbeats("forgotten")
    del forgotten
    gc.collect()
    deadline = time.monotonic() + 5
    while heartbeats("forgotten") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not heartbeats("forgotten")
