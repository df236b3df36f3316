"""After every sync a directory target is a checkpoint a loader finds: one
``model.safetensors``, or an index naming exactly the files present."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from dcr_format import DeltaReader, DeltaWriter, SafetensorsDirTarget
from dcr_format.targets.directory import INDEX_FILE, SINGLE_FILE


def _check_loadable(path: Path, expected: dict[str, torch.Tensor]) -> None:
    files = {p.name for p in path.glob("*.safetensors")}
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        assert set(weight_map.values()) == files
    else:
        assert files == {SINGLE_FILE}
        weight_map = dict.fromkeys(load_file(str(path / SINGLE_FILE)), SINGLE_FILE)
    assert sorted(weight_map) == sorted(expected)
    for name, tensor in expected.items():
        loaded = load_file(str(path / weight_map[name]))[name]
        assert torch.equal(loaded.view(torch.uint8), tensor.view(torch.uint8))


def _tensors(names: list[str], value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full((64,), value + i) for i, n in enumerate(names)}


def test_a_base_that_empties_a_file_leaves_a_loadable_directory(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store, base_every=1)
    path = tmp_path / "ckpt"
    reader = DeltaReader(store, SafetensorsDirTarget(path, max_file_bytes=256))
    three = _tensors(["a", "b", "c"], 1.0)  # 256 bytes each: one file each
    writer.publish(three)
    reader.sync()
    assert len(list(path.glob("*.safetensors"))) == 3
    _check_loadable(path, three)

    two = _tensors(["a", "b"], 2.0)  # c's file is gone: the index names the other two
    writer.publish(two)
    reader.sync()
    _check_loadable(path, two)

    one = _tensors(["a"], 3.0)  # one file left: model.safetensors, no index
    writer.publish(one)
    reader.sync()
    _check_loadable(path, one)
    assert not (path / INDEX_FILE).exists()

    writer.publish(_tensors(["a"], 4.0))  # and so it stays
    reader.sync()
    _check_loadable(path, _tensors(["a"], 4.0))


def test_a_fresh_directory_has_the_same_files_whatever_order_the_changes_came_in(tmp_path):
    """A base's tensors reach a directory target in the order they are decoded, which varies
    from sync to sync; the files they land in do not (names in order, layer 2 before 10)."""
    from dcr_format import Resident
    from dcr_format.delta.delta import FULL, DecodedDelta
    from dcr_format.targets.change import Change

    names = [f"model.layers.{i}.weight" for i in (10, 2, 1, 0, 11, 3)]
    tensors = _tensors(names, 1.0)  # 256 bytes each
    layouts = []
    for k, order in enumerate((names, names[::-1])):
        path = tmp_path / f"ckpt{k}"
        target = SafetensorsDirTarget(path, max_file_bytes=512)
        txn = target.begin()
        for name in order:
            txn.change(
                Change(
                    name,
                    torch.float32,
                    (64,),
                    DecodedDelta(FULL, None, tensors[name].view(torch.int32)),
                )
            )
        txn.commit(Resident("c" * 32, 0))
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        layouts.append(weight_map)
        _check_loadable(path, tensors)
    assert layouts[0] == layouts[1]
    assert layouts[0]["model.layers.0.weight"] == layouts[0]["model.layers.1.weight"]
    assert layouts[0]["model.layers.10.weight"] == layouts[0]["model.layers.11.weight"]


def test_every_file_of_a_version_has_the_permissions_the_umask_gives(tmp_path):
    """The safetensors files are as readable as the config beside them (what the umask
    allows), not owner-only: an engine that loads the directory may run as another user."""
    import os

    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    for umask, expected in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        previous = os.umask(umask)
        try:
            path = tmp_path / f"ckpt-{umask:o}"
            writer.publish(_tensors(["a", "b"], float(umask)), files={"config.json": b"{}"})
            DeltaReader(store, SafetensorsDirTarget(path, max_file_bytes=256)).sync()
        finally:
            os.umask(previous)
        modes = {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()}
        assert sum(name.endswith(".safetensors") for name in modes) == 2
        assert set(modes.values()) == {expected}, modes
