"""SafetensorsDirTarget: how a Hugging Face checkpoint directory is created, kept and sharded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, dir_snapshot, make_state, snapshot, step_state
from safetensors.torch import load_file

from dcr_format import DeltaReader, DeltaWriter, SafetensorsDirTarget, StateDictTarget, TargetError
from dcr_format.targets.directory import DIR_STATE_FILE, INDEX_FILE, SINGLE_FILE


def _chain(store_url: str, versions: int, seed: int = 0, **writer_options):
    gen = torch.Generator().manual_seed(seed)
    state = make_state(seed)
    writer = DeltaWriter(store_url, **writer_options)
    states = []
    for version in range(versions):
        if version:
            step_state(state, gen)
        writer.publish(state)
        states.append(snapshot(state))
    return writer, state, gen, states


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize("start", ["missing", "empty"])
def test_directory_is_created_from_the_base(store_url, tmp_path, start):
    _, _, _, states = _chain(store_url, 3)
    path = tmp_path / "ckpt"
    if start == "empty":
        path.mkdir()
    target = SafetensorsDirTarget(path)
    assert target.resident() is None
    result = DeltaReader(store_url, target).sync()
    assert result.applied_versions == (0, 1, 2)
    assert path.is_symlink()
    resolved = path.resolve()
    assert resolved.is_dir()
    assert resolved.parent == tmp_path / ".ckpt.dcr"
    assert sorted(p.name for p in path.iterdir()) == [DIR_STATE_FILE, SINGLE_FILE]
    state = json.loads((path / DIR_STATE_FILE).read_text())
    assert state["version"] == 2
    assert target.resident().version == 2
    assert_same_bits(load_file(str(path / SINGLE_FILE)), states[2])


def test_each_sync_swaps_the_link_to_a_new_versioned_dir(store_url, tmp_path):
    writer, state, gen, _ = _chain(store_url, 1)
    path = tmp_path / "ckpt"
    target = SafetensorsDirTarget(path)
    reader = DeltaReader(store_url, target)
    reader.sync()
    seen = [path.resolve()]
    (path / "config.json").write_text('{"model_type": "toy"}')
    (path / "tokenizer.json").write_text("{}")
    for version in (1, 2, 3):
        step_state(state, gen)
        writer.publish(state)
        reader.sync()
        now = path.resolve()
        assert now not in seen
        assert not any(old.exists() for old in seen), "the previous version was not removed"
        seen.append(now)
        assert target.resident().version == version
        assert (path / "config.json").read_text() == '{"model_type": "toy"}'
        assert (path / "tokenizer.json").read_text() == "{}"
        assert_same_bits(load_file(str(path / SINGLE_FILE)), state)
    assert sorted(p.name for p in (tmp_path / ".ckpt.dcr").iterdir()) == [seen[-1].name]


def test_existing_unmanaged_directory_is_refused(store_url, tmp_path):
    _chain(store_url, 2)
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"somebody else's checkpoint")
    before = dir_snapshot(path)
    target = SafetensorsDirTarget(path)
    with pytest.raises(TargetError):
        DeltaReader(store_url, target).sync()
    with pytest.raises(TargetError):
        target.resident()
    assert dir_snapshot(path) == before
    assert not path.is_symlink()


def test_sharded_layout_with_index_is_kept_across_syncs(store_url, tmp_path):
    writer, state, gen, _ = _chain(store_url, 1)
    biggest = max(t.numel() * t.element_size() for t in state.values())
    path = tmp_path / "ckpt"
    target = SafetensorsDirTarget(path, max_file_bytes=biggest + 64)
    reader = DeltaReader(store_url, target)
    reader.sync()
    files = sorted(p.name for p in path.glob("*.safetensors"))
    count = len(files)
    assert count > 2
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    index = json.loads((path / INDEX_FILE).read_text())
    layout = index["weight_map"]
    assert sorted(layout) == sorted(state)
    assert set(layout.values()) == set(files)
    for file in files:
        names = load_file(str(path / file)).keys()
        assert {n for n, f in layout.items() if f == file} == set(names)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    assert_same_bits(_load_dir(path), state)

    for version in (1, 2):
        step_state(state, gen)
        writer.publish(state)
        reader.sync()
        assert target.resident().version == version
        assert sorted(p.name for p in path.glob("*.safetensors")) == files
        assert json.loads((path / INDEX_FILE).read_text())["weight_map"] == layout
        assert not (path / SINGLE_FILE).exists()
        assert_same_bits(_load_dir(path), state)


def test_dir_and_dict_targets_agree(store_url, tmp_path):
    writer, state, gen, _ = _chain(store_url, 2, seed=3, base_every=3)
    dict_target = StateDictTarget({})
    dir_target = SafetensorsDirTarget(tmp_path / "ckpt")
    for _ in range(5):
        step_state(state, gen)
        writer.publish(state)
        DeltaReader(store_url, dict_target).sync()
        DeltaReader(store_url, dir_target).sync()
        assert_same_bits(_load_dir(tmp_path / "ckpt"), dict_target.tensors)
        assert_same_bits(dict_target.tensors, state)


def test_state_dict_target_declared_at_a_version(store_url):
    """A dict already holding version N (e.g. loaded from a checkpoint) syncs incrementally."""
    writer, _, _, states = _chain(store_url, 3)
    chain_id = writer.chain.header.chain_id
    target = StateDictTarget(snapshot(states[1]), version=1, chain_id=chain_id)
    result = DeltaReader(store_url, target).sync()
    assert result.applied_versions == (2,)
    assert_same_bits(target.tensors, states[2])
    with pytest.raises(ValueError):
        StateDictTarget({}, version=1)


def test_leftovers_of_a_crashed_sync_are_removed(store_url, tmp_path):
    writer, state, gen, _ = _chain(store_url, 1)
    path = tmp_path / "ckpt"
    target = SafetensorsDirTarget(path)
    reader = DeltaReader(store_url, target)
    reader.sync()
    orphan = tmp_path / ".ckpt.dcr" / "v00000000000000000001-deadbeef"
    orphan.mkdir()
    (orphan / SINGLE_FILE).write_bytes(b"half written")
    (tmp_path / ".ckpt.dcr" / "link-deadbeef").symlink_to(orphan)
    step_state(state, gen)
    writer.publish(state)
    reader.sync()
    assert sorted(p.name for p in (tmp_path / ".ckpt.dcr").iterdir()) == [path.resolve().name]
    assert_same_bits(load_file(str(path / SINGLE_FILE)), state)


@pytest.mark.parametrize("relative", [False, True])
def test_link_to_an_unmanaged_directory_is_refused_and_kept(store_url, tmp_path, relative):
    _chain(store_url, 2)
    precious = tmp_path / "models" / "llama"
    precious.mkdir(parents=True)
    (precious / "config.json").write_text("{}")
    (precious / SINGLE_FILE).write_bytes(b"a checkpoint dcr does not manage")
    path = tmp_path / "ckpt"
    path.symlink_to(Path("models/llama") if relative else precious)
    before = dir_snapshot(precious)
    target = SafetensorsDirTarget(path)
    with pytest.raises(TargetError):
        DeltaReader(store_url, target).sync()
    with pytest.raises(TargetError):
        target.resident()
    assert dir_snapshot(precious) == before
    assert path.resolve() == precious.resolve()
