"""Every bad argument of every `dcr` command is one line on stderr and a non-zero exit.

Usage errors (caught by click before any work) exit 2 and point at the command's --help;
errors found by the library exit 1 and say what to do. No bad input shows a traceback.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import make_state, step_state
from safetensors.torch import save_file

from dcr_format import DeltaReader, DeltaWriter, SafetensorsDirTarget
from dcr_format.cli.main import cli
from dcr_format.errors import VersionNotFoundError


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A store with versions 0..6 (bases at 0 and 5), a checkpoint, and bad inputs."""
    root = tmp_path_factory.mktemp("cli-errors")
    store = root / "store"
    gen = torch.Generator().manual_seed(0)
    state = make_state(0)
    writer = DeltaWriter(store, base_every=5, cache_dir=root / "cache")
    for version in range(7):
        if version:
            step_state(state, gen)
        writer.publish(state, step=version)
    ckpt = root / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.ones(4)}, str(ckpt / "model.safetensors"))
    (root / "empty").mkdir()
    (root / "binckpt").mkdir()  # saved with torch.save, not safetensors
    torch.save({"w": torch.ones(4)}, root / "binckpt" / "pytorch_model.bin")
    (root / "binckpt" / "config.json").write_text("{}")
    (root / "afile").write_text("not a directory")
    (root / "unmanaged").mkdir()
    (root / "unmanaged" / "notes.txt").write_text("someone else's")
    (root / "badckpt").mkdir()
    (root / "badckpt" / "model.safetensors").write_bytes(b"not safetensors")
    (root / "costs.json").write_text("{not json")
    (root / "both").mkdir()  # a stale single file beside a sharded save's index
    save_file({"w": torch.ones(4)}, str(root / "both" / "model.safetensors"))
    save_file({"w": torch.zeros(4)}, str(root / "both" / "model-00001-of-00001.safetensors"))
    index = '{"weight_map": {"w": "model-00001-of-00001.safetensors"}}'
    (root / "both" / "model.safetensors.index.json").write_text(index)
    DeltaReader(store, SafetensorsDirTarget(root / "at6")).sync()  # a pulled directory
    DeltaWriter(root / "other", cache_dir=root / "cache").publish(state)  # another chain
    assert DeltaWriter(root / "nocommit").version is None  # a chain, no version committed
    return {
        "store": str(store),
        "ckpt": str(ckpt),
        "empty": str(root / "empty"),
        "binckpt": str(root / "binckpt"),
        "afile": str(root / "afile"),
        "unmanaged": str(root / "unmanaged"),
        "badckpt": str(root / "badckpt"),
        "costs": str(root / "costs.json"),
        "both": str(root / "both"),
        "new": str(root / "new"),  # a path that does not exist
        "at6": str(root / "at6"),
        "other": str(root / "other"),
        "nocommit": str(root / "nocommit"),
    }


USAGE = 2
LIBRARY = 1
S = ("--store", "{store}")

# (arguments, exit status, a fragment of the one line: what is wrong or what to do)
CASES: list[tuple[tuple[str, ...], int, str]] = [
    # the group
    (("nosuchcommand",), USAGE, "No such command"),
    (("--nosuch",), USAGE, "No such option"),
    (("log",), USAGE, "Missing option '--store'"),
    (("log", *S, "--format", "yaml"), USAGE, "'yaml' is not one of"),
    # --store, --endpoint-url
    (("log", "--store", "foo://x"), LIBRARY, "install the fsspec backend"),
    (("log", "--store", ""), LIBRARY, "pass a path like"),
    (("log", "--store", "{afile}"), USAGE, "is a file, not a store directory"),
    (("log", "--store", "s3://"), LIBRARY, "use s3://bucket/prefix"),
    (("log", "--store", "s3://b/p", "--endpoint-url", "notaurl"), USAGE, "pass one like http"),
    (("log", "--store", "s3://b/p", "--endpoint-url", "http://[::1"), USAGE, "Invalid IPv6"),
    (("log", "--store", "s3://b/p", "--endpoint-url", "http://h:port"), USAGE, "endpoint URL"),
    (("log", "--store", "s3://b/p", "--endpoint-url", "ftp://h"), USAGE, "http:// or https://"),
    (("log", *S, "--endpoint-url", "http://h"), USAGE, "applies to s3:// stores"),
    (("log", "--store", "{new}"), LIBRARY, "publish to it first or check the store URL"),
    # publish
    (("publish", "{ckpt}", *S, "--base-every", "0"), USAGE, "'--base-every': 0 is not in"),
    (("publish", "{ckpt}", *S, "--base-every", "-1"), USAGE, "'--base-every': -1 is not in"),
    (("publish", "{new}", *S), USAGE, "does not exist"),
    (("publish", "{afile}", *S), USAGE, "is a file"),
    (("publish", "{empty}", *S), LIBRARY, "pass a checkpoint directory"),
    (("publish", "{binckpt}", *S), LIBRARY, "save the checkpoint as safetensors"),
    (("publish", "{badckpt}", *S), LIBRARY, "save the checkpoint again"),
    (("publish", "{both}", *S), LIBRARY, "the index is ignored): remove the stale one"),
    (("publish", "{ckpt}", *S, "--cache-dir", "{afile}"), USAGE, "is a file"),
    (("publish", "{ckpt}", *S, "--step", "x"), USAGE, "is not a valid integer"),
    (("publish", "{ckpt}", *S, "--step", str(1 << 63)), USAGE, "outside the range a commit"),
    (("publish", "{ckpt}", *S, "--features", "values-rans,typo"), USAGE, "writer features"),
    (("publish", "{ckpt}", "--store", "{ckpt}"), USAGE, "publish into a store outside it"),
    (("publish", "{ckpt}", "--store", "{ckpt}/refit"), USAGE, "is inside the checkpoint"),
    # pull
    (("pull", *S, "--into", "{unmanaged}"), LIBRARY, "choose a new or empty path"),
    (("pull", *S, "--into", "{afile}"), USAGE, "is a file"),
    (("pull", *S, "--into", "{new}", "--version", "99"), LIBRARY, "0..6; run `dcr log`"),
    (("pull", *S, "--into", "{new}", "--version", "-1"), USAGE, "'-1' is not a version number"),
    (("pull", *S, "--into", "{new}", "--version", "v3"), USAGE, "versions are 0, 1, 2"),
    (("pull", *S, "--into", "{new}", "--wait", "-1"), USAGE, "'--wait': -1"),
    # log
    (("log", *S, "--limit", "0"), USAGE, "'--limit': 0 is not in the range"),
    (("log", *S, "--limit", "-1"), USAGE, "'--limit': -1 is not in the range"),
    (("log", *S, "--since", "-1"), USAGE, "'--since': '-1' is not a version number"),
    # show
    (("show", "99", *S), LIBRARY, "run `dcr log`"),
    (("show", "-1", *S), USAGE, "No such option '-1'"),
    (("show", *S, "--", "-1"), USAGE, "'-1' is not a version number"),
    (("show", "abc", *S), USAGE, "'abc' is not a version number: versions are 0, 1, 2, ..."),
    (("show", "1", *S, "--top", "-1"), USAGE, "'--top': -1 is not in the range"),
    (("show", "1", *S, "--sort", "size"), USAGE, "'size' is not one of"),
    # diff
    (("diff", "1", "99", *S), LIBRARY, "run `dcr log`"),
    (("diff", "1", *S), USAGE, "Missing argument 'B'"),
    (("diff", "1", "2", *S, "--top", "-1"), USAGE, "'--top': -1 is not in the range"),
    # replay
    (("replay", "99", *S, "--out", "{new}"), LIBRARY, "holds versions 0..6; run `dcr log`"),
    (("replay", "3", *S, "--out", "{afile}"), USAGE, "is a file"),
    (("replay", "3", *S, "--out", "{unmanaged}"), LIBRARY, "choose a new or empty path"),
    (("replay", "1", *S, "--out", "{at6}"), LIBRARY, "replay older versions into a new directory"),
    (("pull", "--store", "{other}", "--into", "{at6}"), LIBRARY, "pull or replay into a new dir"),
    (("replay", "3", *S, "--out", "{new}", "--cache-dir", "{afile}"), USAGE, "is a file"),
    # verify
    (("verify", *S, "--from", "5", "--to", "2"), USAGE, "pass the older version to --from"),
    (("verify", *S, "--from", "99"), LIBRARY, "holds versions 0..6; pick one"),
    (("verify", *S, "--to", "99"), LIBRARY, "holds versions 0..6; pick one"),
    (("verify", *S, "--from", "-1"), USAGE, "'--from': '-1' is not a version number"),
    # compact
    (("compact", *S, "--at", "99"), LIBRARY, "run `dcr log`"),
    (("compact", *S, "--at", "-1"), USAGE, "'--at': '-1' is not a version number"),
    (("compact", *S, "--at", "3", "--shard-mb", "0"), USAGE, "'--shard-mb': 0 is not in"),
    # gc
    (("gc", *S, "--keep-last", "0"), USAGE, "'--keep-last': 0 is not in the range"),
    (("gc", *S), USAGE, "Missing option '--keep-last'"),
    (("gc", *S, "--keep-last", "1", "--keep-bases", "-1"), USAGE, "'--keep-bases': -1"),
    (("gc", *S, "--keep-last", "1", "--grace", "x"), USAGE, "write e.g. 30s, 15m"),
    (("gc", *S, "--keep-last", "1", "--grace", "-1s"), USAGE, "write e.g. 30s, 15m"),
    (("gc", "--store", "{new}", "--keep-last", "1"), LIBRARY, "publish to it first"),
    # doctor
    (("doctor", *S, "--large-mb", "-1"), USAGE, "'--large-mb': -1 is not in the range"),
    (("doctor", "--store", "{afile}"), USAGE, "pass a directory (or a new path)"),
    # plot
    (("plot", *S, "--out", "{empty}"), USAGE, "is a directory"),
    (("plot", *S, "--out", "{new}/x.png"), USAGE, "create it or write the file elsewhere"),
    (("plot", *S, "--out", "{new}.png", "--dpi", "5"), USAGE, "'--dpi': 5 is not in"),
    (("plot", *S, "--out", "{new}.png", "--limit", "0"), USAGE, "'--limit': 0 is not in"),
    (
        ("plot", *S, "--out", "{new}.png", "--since", "-1"),
        USAGE,
        "'--since': '-1' is not a version",
    ),
    (("plot", *S, "--out", "{new}.png", "--since", "99"), LIBRARY, "pick one of those"),
    (("plot", "--store", "{nocommit}", "--out", "{new}.png"), LIBRARY, "version to plot; publish"),
    # demo
    (("demo", "--steps", "0"), USAGE, "'--steps': 0 is not in the range"),
    (("demo", "--steps", "-1"), USAGE, "'--steps': -1 is not in the range"),
    (("demo", "--lr", "0"), USAGE, "'--lr': 0.0 is not in the range"),
    (("demo", "--lr", "-1"), USAGE, "'--lr': -1.0 is not in the range"),
    (("demo", "--lr", "nan"), USAGE, "is not a finite number"),
    (("demo", "--size", "huge"), USAGE, "'huge' is not one of"),
    (
        ("demo", *S, "--size", "tiny", "--steps", "1"),
        USAGE,
        "already holds a chain (versions 0..6)",
    ),
    # project
    (("project",), USAGE, "Missing option '--params'"),
    (("project", "--params", "bad"), USAGE, "'--params': 'bad' is not a parameter count"),
    (("project", "--params", "0"), USAGE, "pass a model size like 1T"),
    (("project", "--params", "1T", "--change", "x"), USAGE, "'--change': 'x' is not a change"),
    (("project", "--params", "1T", "--change", "0"), USAGE, "must be in (0, 100%]"),
    (("project", "--params", "1T", "--costs", "{new}"), USAGE, "does not exist"),
    (("project", "--params", "1T", "--costs", "{costs}"), USAGE, "bench_suite.py --save-costs"),
    (("project", "--params", "1T", "--rollout-nodes", "0"), USAGE, "'--rollout-nodes': 0"),
    (("project", "--params", "1T", "--link-gbps", "0"), USAGE, "'--link-gbps': 0.0 is not"),
    (("project", "--params", "1T", "--link-gbps", "nan"), USAGE, "is not a finite number"),
    (("project", "--params", "1T", "--store-gbps", "inf"), USAGE, "is not a finite number"),
    (("project", "--params", "1T", "--bytes-per-param", "-2"), USAGE, "is not in the range"),
]


def _one_line_error(stderr: str, code: int, fragment: str, stdout: str = "") -> str:
    assert "Traceback" not in stderr + stdout
    assert stdout == "", stdout
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    line = stderr.rstrip("\n")
    assert line.startswith("dcr: error: "), line
    assert fragment in line, line
    if code == USAGE:  # what to do: read the command's help
        assert "--help')" in line, line
    return line


@pytest.mark.parametrize(
    ("args", "code", "fragment"), CASES, ids=[" ".join(c[0])[:60] for c in CASES]
)
def test_bad_argument_is_one_line(
    paths: dict[str, str], args: tuple[str, ...], code: int, fragment: str
) -> None:
    argv = [a.format(**paths) for a in args]
    result = CliRunner().invoke(cli, argv, env={"DCR_DEBUG": None, "AWS_ENDPOINT_URL": None})
    assert result.exit_code == code, (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    _one_line_error(result.stderr, code, fragment.format(**paths), result.stdout)


def test_bad_arguments_leave_the_store_alone(paths: dict[str, str]) -> None:
    from dcr_format import Store

    assert Store(paths["store"]).list("commits/") == [f"commits/{v:020d}.json" for v in range(7)]
    assert not os.path.exists(paths["new"])


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (("publish", "{ckpt}", "--store", "{new}", "--base-every", "0"), USAGE, "--base-every"),
        (("log", "--store", "s3://b/p", "--endpoint-url", "nota url"), USAGE, "endpoint URL"),
        (("nosuchcommand",), USAGE, "No such command"),
        (("show", "99", "--store", "{store}"), LIBRARY, "run `dcr log`"),
    ],
)
def test_the_installed_command_prints_one_line(
    paths: dict[str, str], args: tuple[str, ...], code: int, fragment: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DCR_DEBUG", "AWS_ENDPOINT_URL")}
    run = subprocess.run(
        [sys.executable, "-c", "from dcr_format.cli.main import main; main()"]
        + [a.format(**paths) for a in args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == code, run.stderr
    _one_line_error(run.stderr, code, fragment, run.stdout)


def test_a_directory_another_sync_holds_says_how_to_wait(
    paths: dict[str, str], tmp_path: Path
) -> None:
    lock = os.open(tmp_path / ".policy.dcr.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another sync holds ./policy
    try:
        argv = ["pull", "--store", paths["store"], "--into", str(tmp_path / "policy")]
        result = CliRunner().invoke(cli, [*argv, "--wait", "0"], env={"DCR_DEBUG": None})
    finally:
        os.close(lock)
    assert result.exit_code == LIBRARY
    line = _one_line_error(result.stderr, LIBRARY, "is being synced by", result.stdout)
    assert "`dcr pull --wait SECONDS`" in line


def test_a_finished_sync_is_not_named_as_the_holder(paths: dict[str, str], tmp_path: Path) -> None:
    argv = ["pull", "--store", paths["store"], "--into", str(tmp_path / "policy")]
    assert CliRunner().invoke(cli, [*argv, "--version", "5"]).exit_code == 0  # it finished
    lock = os.open(tmp_path / ".policy.dcr.lock", os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_SH)  # a reader holds the directory
    try:
        result = CliRunner().invoke(cli, [*argv, "--wait", "0"], env={"DCR_DEBUG": None})
    finally:
        os.close(lock)
    line = _one_line_error(result.stderr, LIBRARY, "is being synced by another process")
    assert f"pid {os.getpid()}" not in line


def test_a_refused_pull_leaves_no_lock_file_beside_the_directory(
    paths: dict[str, str], tmp_path: Path
) -> None:
    mine = tmp_path / "ckpt"
    mine.mkdir()
    (mine / "config.json").write_text("{}")  # a directory of the user's, not dcr's
    for command in (["pull", "--into"], ["replay", "3", "--out"]):
        result = CliRunner().invoke(cli, [*command, str(mine), "--store", paths["store"]])
        assert result.exit_code == LIBRARY and "not managed by dcr" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_help_version_and_success_still_exit_zero(paths: dict[str, str]) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["--version"]).exit_code == 0
    assert runner.invoke(cli, ["gc", "--help"]).exit_code == 0
    result = runner.invoke(cli, ["log", "--store", paths["store"], "--limit", "1"])
    assert result.exit_code == 0 and result.stdout.splitlines()[1].startswith("6 ")
    bare = runner.invoke(cli, [])  # `dcr` alone prints its help (click's exit status 2)
    assert bare.exit_code == 2 and "Commands:" in bare.output


# --- the one handler: errors no check caught ---------------------------------------------------


def _failing_log(exc: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    import dcr_format.tools

    def fail(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(dcr_format.tools, "log", fail)


@pytest.mark.parametrize(
    "exc",
    [
        PermissionError(13, "Permission denied", "/data/ckpt"),
        ValueError("a value the checks missed\nover two lines"),
        TypeError("an argument of the wrong type"),
    ],
    ids=["OSError", "ValueError", "TypeError"],
)
def test_uncaught_input_errors_are_one_line(
    paths: dict[str, str], monkeypatch: pytest.MonkeyPatch, exc: Exception
) -> None:
    _failing_log(exc, monkeypatch)
    result = CliRunner().invoke(cli, ["log", "--store", paths["store"]], env={"DCR_DEBUG": None})
    assert result.exit_code == LIBRARY
    line = _one_line_error(result.stderr, LIBRARY, "check the arguments (DCR_DEBUG=1")
    assert " ".join(str(exc).split()) in line


def test_dcr_debug_shows_the_traceback(
    paths: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for exc in (PermissionError(13, "Permission denied"), VersionNotFoundError("no version")):
        _failing_log(exc, monkeypatch)
        result = CliRunner().invoke(cli, ["log", "--store", paths["store"]], env={"DCR_DEBUG": "1"})
        assert result.exception is exc  # raised, so Python prints its traceback


def test_a_bug_keeps_its_traceback(paths: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    bug = KeyError("internal")
    _failing_log(bug, monkeypatch)
    result = CliRunner().invoke(cli, ["log", "--store", paths["store"]], env={"DCR_DEBUG": None})
    assert result.exception is bug and result.exit_code == 1


@pytest.mark.parametrize(
    ("key", "remedy"),
    [("dcr.json", "restore dcr.json from a copy"), (None, "run `dcr verify` on the store")],
    ids=["header", "commit-record"],
)
def test_a_corrupt_record_says_what_to_do(
    paths: dict[str, str], tmp_path: Path, key: str | None, remedy: str
) -> None:
    from dcr_format.chain.chain import commit_key

    store = tmp_path / "store"
    shutil.copytree(paths["store"], store)
    (store / (key or commit_key(6))).write_text("{not json")
    result = CliRunner().invoke(cli, ["show", "6", "--store", str(store)], env={"DCR_DEBUG": None})
    assert result.exit_code == LIBRARY
    line = _one_line_error(result.stderr, LIBRARY, "the object is corrupt")
    assert remedy in line
