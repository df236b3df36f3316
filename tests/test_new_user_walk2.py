"""Mistakes a new user makes on the publish side: each is refused by name, with one line
saying what to do, before anything is written to the store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, Store
from dcr_format.errors import ArgumentError


@pytest.mark.parametrize("step", [1 << 63, -(1 << 63), 1.5, "3", True])
def test_a_step_no_commit_record_holds_is_refused_before_the_version(
    tmp_path: Path, step: object
) -> None:
    writer = DeltaWriter(tmp_path / "store")
    state = {"w": torch.arange(8, dtype=torch.float32)}
    writer.publish(state, step=0)
    before = sorted(Store(tmp_path / "store").list(""))
    with pytest.raises(ArgumentError, match="step"):
        writer.publish(state, step=step)  # type: ignore[arg-type]
    assert sorted(Store(tmp_path / "store").list("")) == before  # no attempt was begun
    assert writer.publish(state, step=1 << 62).version == 1  # the writer carries on


def test_a_cache_dir_under_home_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cache_dir="~/.cache/dcr"`` (as docs/operate.md writes it) and DCR_CACHE_DIR="~/..."
    mean the home directory, not a directory named ``~`` in the working directory."""
    from dcr_format import tools
    from dcr_format.cli.params import default_cache

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    state = {"w": torch.arange(8, dtype=torch.float32)}
    writer = DeltaWriter(tmp_path / "store", cache_dir="~/.cache/dcr")
    writer.publish(state, step=0)
    tools.replay(tmp_path / "store", 0, tmp_path / "out", cache_dir="~/.cache/dcr")
    monkeypatch.setenv("DCR_CACHE_DIR", "~/dcr-cache")
    assert default_cache() == home / "dcr-cache"
    assert list(work.iterdir()) == []  # no "~" directory here
    assert list((home / ".cache" / "dcr").glob("*/replay"))  # the replay cache
    assert [p for p in (home / ".cache" / "dcr").rglob("*") if "replay" not in p.parts]


def test_a_step_that_goes_backwards_is_published_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The step is informational: a resumed trainer may repeat steps, so the version is
    published, but a mistyped step is pointed out."""
    writer = DeltaWriter(tmp_path / "store")
    state = {"w": torch.arange(8, dtype=torch.float32)}
    with caplog.at_level("WARNING", logger="dcr_format.publish.writer"):
        writer.publish(state, step=10)
        state["w"][0] += 1
        writer.publish(state, step=11)
        assert not caplog.records  # steps that advance: nothing to say
        state["w"][1] += 1
        info = writer.publish(state, step=4)
    assert info.version == 2 and info.step == 4
    assert [r.getMessage() for r in caplog.records] == [
        "step 4 is not after step 11 of version 1, the newest; publishing it as given "
        "(check the step, unless the trainer resumed from an earlier checkpoint)"
    ]


def test_a_dropped_tensor_says_how_to_drop_it(tmp_path: Path) -> None:
    """A delta cannot drop a tensor; the error names the way that can: this version as a
    base, which the same writer then publishes, and the next version is a delta again. A
    reader drops the tensor with the base."""
    from dcr_format.errors import MissingTensorError

    state = {"w": torch.arange(8, dtype=torch.float32), "v": torch.ones(3)}
    writer = DeltaWriter(tmp_path / "store")
    writer.publish(state)
    held: dict[str, torch.Tensor] = {}
    reader = DeltaReader(tmp_path / "store", StateDictTarget(held))
    reader.sync()
    del state["v"]
    with pytest.raises(MissingTensorError, match=r"as a base to drop them \(DeltaWriter\.publish"):
        writer.publish(state)
    info = writer.publish(state, base=True)  # what it says to do
    assert (info.version, info.kind, info.tensors) == (1, "base", 1)
    state["w"][0] += 1
    assert writer.publish(state).kind == "delta"
    reader.sync()
    assert set(held) == {"w"} and torch.equal(held["w"], state["w"])


def test_dcr_publish_base_writes_a_base_that_drops_a_tensor(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from safetensors.torch import save_file

    from dcr_format.cli.main import cli

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.ones(4), "v": torch.ones(2)}, str(ckpt / "model.safetensors"))
    argv = ["--store", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache")]
    assert CliRunner().invoke(cli, ["publish", str(ckpt), *argv]).exit_code == 0
    save_file({"w": torch.ones(4)}, str(ckpt / "model.safetensors"))
    refused = CliRunner().invoke(cli, ["publish", str(ckpt), *argv])
    assert refused.exit_code == 1 and "dcr publish --base" in refused.stderr
    based = CliRunner().invoke(cli, ["publish", str(ckpt), *argv, "--base", "--format", "json"])
    assert based.exit_code == 0, based.stderr
    assert '"kind": "base"' in based.stdout


def test_dcr_publish_that_loses_a_race_says_to_run_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library's "reopen the writer" is not something a command-line user can do."""
    from click.testing import CliRunner
    from safetensors.torch import save_file

    import dcr_format.publish._commit as commit
    from dcr_format.cli.main import cli

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.ones(4)}, str(ckpt / "model.safetensors"))
    monkeypatch.setattr(commit, "create_if_absent", lambda *a, **k: False)  # a rival won
    argv = ["publish", str(ckpt), "--store", str(tmp_path / "store")]
    result = CliRunner().invoke(cli, [*argv, "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 1
    assert result.stderr == (
        "dcr: error: another writer committed this version while this publish ran, so "
        f"nothing of {ckpt} was committed; run the command again to publish it on top\n"
    )


def test_a_mistyped_dcr_kernels_is_named_not_wrapped_as_an_apply_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcr_format import DeltaReader, StateDictTarget

    state = {"w": torch.arange(64, dtype=torch.float32)}
    writer = DeltaWriter(tmp_path / "store")
    writer.publish(state)
    state["w"][3] += 1
    writer.publish(state)
    held: dict[str, torch.Tensor] = {}
    reader = DeltaReader(tmp_path / "store", StateDictTarget(held))
    reader.sync(to=0)
    before = held["w"].clone()
    monkeypatch.setenv("DCR_KERNELS", "Numba")
    with pytest.raises(ArgumentError) as caught:
        reader.sync()
    assert str(caught.value) == (
        "DCR_KERNELS='Numba' is not one of auto, triton, torch; set it to one of those, or unset it"
    )
    assert torch.equal(held["w"], before)  # nothing applied
    monkeypatch.delenv("DCR_KERNELS")
    assert reader.sync().version == 1


def test_a_checkpoint_file_given_as_text_says_to_pass_bytes(tmp_path: Path) -> None:
    writer = DeltaWriter(tmp_path / "store")
    with pytest.raises(ArgumentError, match=r"not bytes; pass the file's bytes \(text.encode\(\)"):
        writer.publish({"w": torch.ones(2)}, files={"config.json": '{"a": 1}'})  # type: ignore[dict-item]
    assert writer.publish({"w": torch.ones(2)}, files={"config.json": b'{"a": 1}'}).version == 0


def test_the_dcr_command_prints_library_warnings_as_its_own_lines(tmp_path: Path) -> None:
    """A warning the library logs (here: a step that goes backwards) is one
    ``dcr: warning:`` line on stderr, not a bare line from Python's last-resort handler."""
    import os
    import subprocess
    import sys

    from safetensors.torch import save_file

    DeltaWriter(tmp_path / "store").publish({"w": torch.zeros(4)}, step=5)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.ones(4)}, str(ckpt / "model.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "DCR_DEBUG"}
    env["DCR_PROGRESS_INTERVAL"] = "1000"  # no progress lines
    argv = ["publish", str(ckpt), "--store", str(tmp_path / "store"), "--step", "3"]
    argv += ["--cache-dir", str(tmp_path / "cache")]
    run = subprocess.run(
        [sys.executable, "-c", "from dcr_format.cli.main import main; main()", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("committed version 1 (delta)")
    assert run.stderr == (
        "dcr: warning: step 3 is not after step 5 of version 0, the newest; publishing it as "
        "given (check the step, unless the trainer resumed from an earlier checkpoint)\n"
    )
