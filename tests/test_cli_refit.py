"""The `dcr` command's refit commands: publish, pull, log, show, replay, verify, demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dcr_format.cli.main import cli
from dcr_format.format.dtypes import bits_view

pytestmark = pytest.mark.s3


def _run(*args: str, env: dict[str, str] | None = None, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == code, result.output
    # progress lines go to stderr; a failure's one line is on stderr too
    return result.output if code else result.stdout


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and torch.equal(bits_view(a[n]), bits_view(b[n])) for n in a
    )


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor], *, sharded: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():
        old.unlink()
    if not sharded:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names = sorted(tensors)
    half = len(names) // 2
    files = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32, generator=gen).bfloat16()
        for i in range(3)
    } | {"model.norm.weight": torch.ones(32, dtype=torch.float32)}


@pytest.mark.parametrize("sharded", [False, True])
def test_publish_pull_log_show_replay_verify(tmp_path: Path, sharded: bool) -> None:
    store = str(tmp_path / "store")
    cache = str(tmp_path / "cache")
    ckpt = tmp_path / "ckpt"
    weights = _model(0)
    versions = []
    for step in range(4):
        if step:
            flat = weights["model.layers.1.mlp.up_proj.weight"].view(-1)
            flat[step * 7 : step * 7 + 5] += 0.5
        _checkpoint(ckpt, weights, sharded=sharded)
        out = _run(
            "publish",
            str(ckpt),
            "--store",
            store,
            "--step",
            str(step),
            "--cache-dir",
            cache,
            "--format",
            "json",
        )
        info = json.loads(out)
        assert info["version"] == step
        assert info["kind"] == ("base" if step == 0 else "delta")
        assert info["changed_elements"] == (
            sum(t.numel() for t in weights.values()) if step == 0 else 5
        )
        versions.append({n: t.clone() for n, t in weights.items()})

    rows = json.loads(_run("log", "--store", store, "--format", "json"))
    assert [r["version"] for r in rows] == [0, 1, 2, 3]
    assert "delta" in _run("log", "--store", store)

    detail = json.loads(_run("show", "2", "--store", store, "--format", "json", "--top", "1"))
    assert detail["tensors"][0]["name"] == "model.layers.1.mlp.up_proj.weight"
    assert detail["tensors"][0]["changed"] == 5

    into = tmp_path / "pulled"
    _run("pull", "--store", store, "--into", str(into), "--version", "1")
    assert _bits_equal(load_file(str(into / "model.safetensors")), versions[1])
    out = _run("pull", "--store", store, "--into", str(into), "--format", "json")
    assert json.loads(out)["applied_versions"] == [2, 3]
    assert _bits_equal(load_file(str(into / "model.safetensors")), versions[3])

    _run("replay", "2", "--store", store, "--out", str(tmp_path / "replayed"))
    assert _bits_equal(load_file(str(tmp_path / "replayed" / "model.safetensors")), versions[2])

    assert json.loads(_run("verify", "--store", store, "--format", "json"))["ok"] is True


def test_store_from_environment_and_restart_without_cache(tmp_path: Path) -> None:
    env = {"DCR_STORE": str(tmp_path / "store"), "DCR_CACHE_DIR": str(tmp_path / "cache")}
    ckpt = tmp_path / "ckpt"
    weights = _model(1)
    _checkpoint(ckpt, weights)
    _run("publish", str(ckpt), env=env)
    # a lost cache means the next publish replays the baseline from the store
    for path in sorted((tmp_path / "cache").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    weights["model.norm.weight"][3] = 2.0
    _checkpoint(ckpt, weights)
    info = json.loads(_run("publish", str(ckpt), "--format", "json", env=env))
    assert (info["version"], info["changed_elements"]) == (1, 1)


def test_errors_are_one_line_and_exit_non_zero(tmp_path: Path) -> None:
    out = _run("log", "--store", str(tmp_path / "nothing"), code=1)
    assert out.startswith("dcr: error: ") and out.count("\n") == 1
    out = _run("pull", "--store", str(tmp_path / "nothing"), "--into", str(tmp_path / "x"), code=1)
    assert "no dcr chain" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _run("publish", str(empty), "--store", str(tmp_path / "s"), code=1)
    assert "holds no .safetensors files" in out


def test_verify_exit_status_names_the_broken_object(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ckpt = tmp_path / "ckpt"
    weights = _model(2)
    for step in range(2):
        weights["model.norm.weight"][step] = 3.0
        _checkpoint(ckpt, weights)
        _run("publish", str(ckpt), "--store", str(store), "--cache-dir", str(tmp_path / "c"))
    shard = next(store.glob("objects/00000000000000000001/*/shard-*.dcrs"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    out = _run("verify", "--store", str(store), code=1)
    assert shard.name in out and "ChecksumMismatchError" in out
    assert "first at version 1" in out


def test_demo_publishes_and_verifies_every_version(tmp_path: Path) -> None:
    out = _run(
        "demo", "--size", "tiny", "--steps", "2", "--store", str(tmp_path / "s"), "--format", "json"
    )
    rows = json.loads(out)
    assert [r["version"] for r in rows] == [0, 1, 2]
    assert all(r["verified"] for r in rows)
    assert rows[0]["kind"] == "base" and 0 < rows[2]["change_rate"] < 0.5


def test_s3_store_with_endpoint_url(tmp_path: Path, moto_server, moto_root) -> None:
    from dcr_format.testing.servers import ACCESS_KEY, SECRET_KEY

    env = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "DCR_CACHE_DIR": str(tmp_path / "cache"),
    }
    ckpt = tmp_path / "ckpt"
    weights = _model(3)
    _checkpoint(ckpt, weights)
    endpoint = ("--endpoint-url", moto_server.endpoint)
    _run("publish", str(ckpt), "--store", moto_root, *endpoint, env=env)
    rows = json.loads(_run("log", "--store", moto_root, *endpoint, "--format", "json", env=env))
    assert [r["version"] for r in rows] == [0]
    into = tmp_path / "pulled"
    _run("pull", "--store", moto_root, *endpoint, "--into", str(into), env=env)
    assert _bits_equal(load_file(str(into / "model.safetensors")), weights)
    out = _run("log", "--store", str(tmp_path / "local"), *endpoint, code=2)
    assert "--endpoint-url applies to s3:// stores" in out


def test_single_writer_flag_allows_a_store_without_atomic_create(
    tmp_path: Path, juicefs_gateway, juicefs_root
) -> None:
    from dcr_format.testing.servers import ACCESS_KEY, SECRET_KEY

    env = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": juicefs_gateway.endpoint,
        "DCR_CACHE_DIR": str(tmp_path / "cache"),
    }
    ckpt = tmp_path / "ckpt"
    _checkpoint(ckpt, _model(4))
    out = _run("publish", str(ckpt), "--store", juicefs_root, env=env, code=1)
    assert "conditional writes are not honoured" in out
    out = _run("publish", str(ckpt), "--store", juicefs_root, "--single-writer", env=env)
    assert "committed version 0" in out
