"""The `dcr` command's chain tools: log, show, diff, verify, replay, compact, gc, doctor, plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import assert_same_bits, make_state, snapshot, step_state
from safetensors.torch import load_file

from dcr_format import DeltaWriter
from dcr_format.cli.main import cli


@pytest.fixture
def chain(tmp_path: Path) -> tuple[str, list[dict[str, torch.Tensor]]]:
    """A local store with 7 versions (bases at 0 and 5) and each version's tensors."""
    store = str(tmp_path / "store")
    gen = torch.Generator().manual_seed(0)
    state = make_state(0)
    writer = DeltaWriter(store, base_every=5)
    states = []
    for version in range(7):
        if version:
            step_state(state, gen)
        writer.publish(state, step=version)
        states.append(snapshot(state))
    return store, states


def _run(*args: str, code: int = 0, env: dict[str, str] | None = None) -> str:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == code, result.output
    # progress lines go to stderr; a failure's one line is on stderr too
    return result.output if code else result.stdout


def _json(*args: str, code: int = 0, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return json.loads(_run(*args, "--format", "json", code=code, env=env))


def test_log_limit_since_and_human_columns(chain) -> None:  # type: ignore[no-untyped-def]
    store, _ = chain
    rows = _json("log", "--store", store)
    assert [r["version"] for r in rows] == list(range(7))
    assert set(rows[0]) >= {
        "version", "kind", "parent", "step", "created", "change_rate", "payload_bytes",
        "dense_bytes", "ratio", "writer_ranks", "compacted",
    }  # fmt: skip
    assert [r["version"] for r in _json("log", "--store", store, "--limit", "2")] == [5, 6]
    assert [r["version"] for r in _json("log", "--store", store, "--since", "4")] == [4, 5, 6]
    both = _json("log", "--store", store, "--since", "1", "--limit", "3")
    assert [r["version"] for r in both] == [4, 5, 6]
    text = _run("log", "--store", store, "--limit", "2")
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["version", "kind", "parent", "step"]
    assert "ranks" in lines[0] and len(lines) == 3
    assert lines[1].split()[:2] == ["5", "base"] and lines[2].split()[:3] == ["6", "delta", "5"]


def test_show_prints_a_missing_parent_and_step_as_dcr_log_does(tmp_path: Path) -> None:
    DeltaWriter(tmp_path / "store").publish({"w": torch.ones(4)})  # no step given
    text = _run("show", "0", "--store", str(tmp_path / "store"))
    assert text.startswith("version 0 (base), parent -, step -, created "), text


def test_show_sort_and_top(chain) -> None:  # type: ignore[no-untyped-def]
    store, _ = chain
    detail = _json("show", "3", "--store", store, "--top", "3")
    assert detail["version"]["version"] == 3 and len(detail["tensors"]) == 3
    sizes = [r["encoded_bytes"] for r in detail["tensors"]]
    assert sizes == sorted(sizes, reverse=True)
    names = [r["name"] for r in _json("show", "3", "--store", store, "--sort", "name")["tensors"]]
    assert names == sorted(names) and len(names) == len(make_state(0))
    text = _run("show", "3", "--store", store, "--top", "2", "--sort", "changed")
    assert text.startswith("version 3 (delta), parent 2")
    lines = text.splitlines()
    assert len(lines) == 4 + 1 + 2  # summary, features, header, two rows
    # the chain was written with the default features: the version lists those it uses
    assert lines[3].startswith("features ") and "manifest-zstd" in lines[3]
    assert lines[4].split()[-1] == "coding"
    rows = _json("show", "3", "--store", store, "--top", "2", "--sort", "changed")["tensors"]
    assert [line.split()[-1] for line in lines[5:]] == [
        f"{r['positions_coding'] or '-'}/{r['values_coding'] or '-'}" for r in rows
    ]


def test_diff_verify_replay_compact_gc(chain, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, states = chain
    env = {"DCR_CACHE_DIR": str(tmp_path / "cache")}
    report = _json("diff", "1", "4", "--store", store)
    assert report["a"] == 1 and report["tensors_differing"] > 0
    assert all(r["status"] == "changed" for r in report["tensors"])
    assert _json("diff", "1", "4", "--store", store, "--exact")["exact"] is True
    text = _run("diff", "1", "4", "--store", store, "--top", "1")
    assert text.startswith("versions 1 -> 4:") and len(text.splitlines()) == 3
    across = _json("diff", "3", "6", "--store", store, "--exact")
    assert across["exact"] is True

    assert "ok: 7 versions" in _run("verify", "--store", store, "--deep")
    deep = _json("verify", "--store", store, "--deep", "--from", "3", "--to", "4")
    assert deep["ok"] and deep["replayed_versions"] == 2 and deep["first_version"] == 3

    first = _json("replay", "3", "--store", store, "--out", str(tmp_path / "r3"), env=env)
    assert first["source"] == "base" and first["applied_versions"] == [0, 1, 2, 3]
    second = _json("replay", "4", "--store", store, "--out", str(tmp_path / "r4"), env=env)
    assert second["source"] == "cache" and second["applied_versions"] == [4]
    assert_same_bits(load_file(str(tmp_path / "r4" / "model.safetensors")), states[4])
    text = _run("replay", "6", "--store", store, "--out", str(tmp_path / "r6"), "--no-cache")
    assert "holds version 6, verified" in text

    made = _json("compact", "--store", store, "--at", "4")
    assert made["created"] and made["key"] == "bases/00000000000000000004.json"
    assert "nothing to do" in _run("compact", "--store", store, "--at", "4")
    lines = _run("log", "--store", store).splitlines()
    assert [line.split()[1] for line in lines[1:]][4:6] == ["delta+base", "base"]

    dry = _json("gc", "--store", store, "--keep-last", "2", "--dry-run")
    assert dry["dry_run"] and dry["oldest_kept"] == 5 and dry["deleted_objects"] > 0
    assert len(_json("log", "--store", store)) == 7
    text = _run("gc", "--store", store, "--keep-last", "3", "--grace", "10m")
    assert "deleted" in text and "keeps versions 4..6" in text
    assert [r["version"] for r in _json("log", "--store", store)] == [4, 5, 6]
    assert "ok: 3 versions" in _run("verify", "--store", store, "--deep")
    pulled = tmp_path / "late"
    out = _json("pull", "--store", store, "--into", str(pulled))
    assert out["applied_versions"] == [5, 6]  # from the newest base at or before 6
    assert_same_bits(load_file(str(pulled / "model.safetensors")), states[6])


def test_verify_names_each_broken_object_and_exits_1(chain) -> None:  # type: ignore[no-untyped-def]
    store, _ = chain
    shard = next(Path(store).glob("objects/00000000000000000002/*/shard-*.dcrs"))
    shard.unlink()
    out = _run("verify", "--store", store, code=1)
    assert shard.name in out and "ObjectNotFoundError" in out
    assert "broken: 1 problem, first at version 2" in out
    report = _json("verify", "--store", store, "--deep", code=1)
    assert report["first_broken_version"] == 2
    assert {p["check"] for p in report["problems"]} == {"object", "state"}


def test_doctor_and_plot(chain, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, _ = chain
    report = _json("doctor", "--store", store, "--large-mb", "1")
    assert report["ok"] and {v["use"] for v in report["verdicts"]} == {
        "readers", "single writer", "multiple writers", "gc",
    }  # fmt: skip
    text = _run("doctor", "--store", store, "--large-mb", "0")
    assert "multiple writers: safe" in text and "large-put: skipped" in text
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    assert "wrote" in _run("plot", "--store", store, "--out", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_and_errors_are_one_line(tmp_path: Path, chain) -> None:  # type: ignore[no-untyped-def]
    store, _ = chain
    result = CliRunner().invoke(cli, ["gc", "--store", store, "--keep-last", "1", "--grace", "x"])
    assert result.exit_code == 2 and "duration" in result.output
    result = CliRunner().invoke(cli, ["gc", "--store", store, "--keep-last", "0"])
    assert result.exit_code == 2
    out = _run("diff", "1", "9", "--store", store, code=1)
    assert out.startswith("dcr: error: ") and out.count("\n") == 1
    out = _run("compact", "--store", str(tmp_path / "none"), "--at", "1", code=1)
    assert "no dcr chain" in out and out.count("\n") == 1


def test_pull_waits_for_or_refuses_a_directory_another_sync_holds(tmp_path):
    import fcntl

    store = str(tmp_path / "store")
    DeltaWriter(store).publish(make_state(5))
    into = tmp_path / "ckpt"
    with open(tmp_path / ".ckpt.dcr.lock", "a+") as held:  # as a sync in progress holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        result = CliRunner().invoke(
            cli, ["pull", "--store", store, "--into", str(into), "--wait", "0"]
        )
        fcntl.flock(held, fcntl.LOCK_UN)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "is being synced by another process" in result.output
    assert "is at version 0" in _run("pull", "--store", store, "--into", str(into))


def test_help_shows_the_default_of_every_option_that_has_one() -> None:
    import click

    from dcr_format.cli.explore import project

    context = click.Context(cli)
    runs: list[tuple[click.Command, click.Command, list[str]]] = []
    for name in cli.list_commands(context):
        command = cli.get_command(context, name)
        assert command is not None, name
        runs.append((command, cli, [name, "--help"]))
    runs.append((project, project, ["--help"]))  # also when run on its own, outside the group
    for command, entry, args in runs:
        text = " ".join(CliRunner().invoke(entry, args).output.split())
        options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
        given = [p.to_info_dict()["default"] for p in options]
        defaults = [d for d in given if d is not None and d is not False]  # 0.0 is a default
        assert text.count("[default: ") == len(defaults) > 0, (args, text)
