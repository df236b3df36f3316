"""A pulled directory started from a local checkpoint that holds a version of the chain: the
checkpoint's tensors are checked against the chain's fingerprints, the version's files come
from the store, and a pull then fetches only the changes since."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dcr_format import DeltaReader, DeltaWriter, SafetensorsDirTarget, compact, gc
from dcr_format.chain.chain import Chain
from dcr_format.cli.main import cli
from dcr_format.errors import ArgumentError, VersionNotFoundError
from dcr_format.store.store import open_store
from dcr_format.tools import start_from

CONFIG = b'{"model_type": "toy"}'


def _states() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    state = {
        f"layer{i}.weight": torch.randn(64, 32, generator=generator).to(torch.bfloat16)
        for i in range(3)
    }
    states = [state]
    for _ in range(2):
        state = {
            n: torch.where(torch.rand(t.shape, generator=generator) < 0.05, t * 1.5, t)
            for n, t in state.items()
        }
        states.append(state)
    return states


@pytest.fixture
def chain(tmp_path: Path) -> tuple[str, list[dict[str, torch.Tensor]]]:
    """Versions 0..2 of a three-tensor model, each published with a config file."""
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    states = _states()
    for state in states:
        writer.publish(state, files={"config.json": CONFIG})
    return store, states


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_bytes(b'{"model_type": "local"}')
    return path


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.int16), b[n]) for n in b)


def _bits(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16) for n, t in tensors.items()}


def test_a_directory_started_from_the_first_version_fetches_only_what_follows(
    tmp_path: Path, chain: tuple[str, list[dict[str, torch.Tensor]]]
) -> None:
    store, states = chain
    hub = _checkpoint(tmp_path / "hub", states[0])
    before = (hub / "model.safetensors").read_bytes()
    into = tmp_path / "policy"
    assert start_from(store, hub, into) == 0
    assert _same(load_file(str(into / "model.safetensors")), _bits(states[0]))
    assert (into / "config.json").read_bytes() == CONFIG  # the chain's file, not the hub's
    assert (hub / "model.safetensors").read_bytes() == before  # only read

    result = DeltaReader(store, SafetensorsDirTarget(into)).sync()
    chain_ = Chain(open_store(store))
    later = sum(chain_.record(v).record.stats.payload_bytes for v in (1, 2))
    assert result.applied_versions == (1, 2) and result.payload_bytes == later
    assert _same(load_file(str(into / "model.safetensors")), _bits(states[2]))

    with pytest.raises(ArgumentError, match="already holds version 2"):
        start_from(store, hub, into)


def test_a_checkpoint_of_any_version_starts_there(
    tmp_path: Path, chain: tuple[str, list[dict[str, torch.Tensor]]]
) -> None:
    store, states = chain
    for version in (2, 1):
        hub = _checkpoint(tmp_path / f"hub{version}", states[version])
        assert start_from(store, hub, tmp_path / f"policy{version}") == version


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (
            lambda t: {
                **t,
                "layer1.weight": t["layer1.weight"].view(torch.int16).add(1).view(torch.bfloat16),
            },
            "its tensors' names, dtypes and shapes are the chain's, but their bits are no "
            "committed version's",
        ),
        (
            lambda t: {n: v.float() for n, v in t.items()},
            "tensor 'layer0.weight' is float32 [64, 32] there and bfloat16 [64, 32] in version 2",
        ),
        (
            lambda t: {n: v for n, v in t.items() if n != "layer2.weight"},
            "it lacks 1 tensor(s) of version 2 (first: 'layer2.weight')",
        ),
        (
            lambda t: {**t, "extra": torch.zeros(2)},
            "it holds 1 tensor(s) version 2 lacks (first: 'extra')",
        ),
    ],
)
def test_a_checkpoint_that_is_no_version_is_refused_with_why(
    tmp_path: Path, chain: tuple[str, list[dict[str, torch.Tensor]]], change, why
) -> None:
    store, states = chain
    hub = _checkpoint(tmp_path / "hub", change(states[0]))
    into = tmp_path / "policy"
    with pytest.raises(VersionNotFoundError) as refused:
        start_from(store, hub, into)
    assert str(refused.value) == (
        f"{hub} holds none of the chain's versions 0..2 ({why}); pull without starting from it"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hub", "store"]  # nothing written


def test_a_checkpoint_of_a_version_gc_removed_is_refused_saying_so(
    tmp_path: Path, chain: tuple[str, list[dict[str, torch.Tensor]]]
) -> None:
    store, states = chain
    compact(store, at=1)
    gc(store, keep_last=2, grace=0, commit_timeout=0)
    hub = _checkpoint(tmp_path / "hub", states[0])
    with pytest.raises(VersionNotFoundError) as refused:
        start_from(store, hub, tmp_path / "policy")
    assert str(refused.value) == (
        f"{hub} holds none of the chain's versions 1..2 (its tensors' names, dtypes and "
        "shapes are the chain's, but their bits are no committed version's; the versions "
        "before 1 were removed (dcr gc)); pull without starting from it"
    )


def test_the_pull_command_starts_a_new_directory_from_a_checkpoint_once(
    tmp_path: Path, chain: tuple[str, list[dict[str, torch.Tensor]]]
) -> None:
    store, states = chain
    hub = _checkpoint(tmp_path / "hub", states[0])
    into = tmp_path / "policy"
    args = ["pull", "--store", store, "--into", str(into), "--start-from", str(hub)]
    lines = {"DCR_PROGRESS_INTERVAL": "0"}  # a progress line for every step
    first = CliRunner().invoke(cli, args, catch_exceptions=False, env=lines)
    assert first.exit_code == 0, first.output
    assert f"{into} starts from {hub}: version 0, every tensor checked" in first.output
    assert "dcr start: done, " in first.output  # progress of the check, off a terminal
    assert "applied 2 versions" in first.output
    assert _same(load_file(str(into / "model.safetensors")), _bits(states[2]))
    again = CliRunner().invoke(cli, args, catch_exceptions=False)  # holds a version: ignored
    assert again.exit_code == 0 and f"{into} is already at version 2" in again.output
    assert "starts from" not in again.output

    empty = tmp_path / "empty"
    empty.mkdir()
    refused = CliRunner().invoke(
        cli, ["pull", "--store", store, "--into", str(tmp_path / "p2"), "--start-from", str(empty)]
    )
    assert refused.exit_code == 1
    assert f"{empty} holds no .safetensors files" in refused.output
