"""Bad arguments and unreadable inputs of the library raise named errors, not bare built-ins."""

from __future__ import annotations

import re

import pytest
import torch

from dcr_format import (
    DeltaReader,
    DeltaWriter,
    Layout,
    ModuleTarget,
    SafetensorsDirTarget,
    StateDictTarget,
    TargetError,
    ThreadCoordinator,
    TorchDistributedCoordinator,
    compact,
    diff,
    replay,
    show,
    verify,
)
from dcr_format.chain.layout import View, shard, whole
from dcr_format.errors import ArgumentError, DcrError
from dcr_format.publish.checkpoint import count_tensors, iter_checkpoint


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_every": 0},
        {"rank": 2, "world_size": 2},
        {"world_size": 2},  # no coordinator
        {"ops": {"w": "bogus"}},
        {"shard_bytes": 0},
        {"shard_bytes": "32MB"},
        {"zstd_level": 23},
        {"zstd_level": True},
        {"commit_timeout": "10"},
        {"commit_timeout": -1},
        {"baseline_device": "tpu"},
        {"features": "positions-classed"},
    ],
)
def test_bad_writer_arguments(tmp_path, kwargs):
    with pytest.raises(ArgumentError) as caught:
        DeltaWriter(str(tmp_path / "store"), **kwargs)
    assert isinstance(caught.value, ValueError)


def test_a_tensor_given_twice(tmp_path):
    writer = DeltaWriter(str(tmp_path / "store"))
    with pytest.raises(ArgumentError, match="twice"):
        writer.publish([("w", torch.ones(2)), ("w", torch.ones(2))])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"verify": "some"},
        {"reader_id": "a/b"},
        {"audit_every": 0},
        {"audit_seconds": -1.0},
        {"max_workers": 0},
        {"max_workers": 2.0},
        {"max_shard_bytes": -1},
        {"select": "w"},
        {"select": [1, 2]},
        {"select": 3},
    ],
)
def test_bad_reader_arguments(tmp_path, kwargs):
    DeltaWriter(str(tmp_path / "store")).publish({"w": torch.ones(2)})
    with pytest.raises(ArgumentError):
        DeltaReader(str(tmp_path / "store"), StateDictTarget({}), **kwargs)


def test_the_wrong_target_or_coordinator_is_refused_by_name(tmp_path):
    store = str(tmp_path / "store")
    DeltaWriter(store).publish({"w": torch.ones(2)})
    for given in ({"w": torch.ones(2)}, torch.nn.Linear(2, 2)):
        with pytest.raises(ArgumentError, match="DeltaReader takes a target, not a"):
            DeltaReader(store, given)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="world_size must be at least 1"):
        ThreadCoordinator(0)
    writer = DeltaWriter(store, world_size=2, coordinator=TorchDistributedCoordinator())
    with pytest.raises(ArgumentError, match=r"call torch\.distributed\.init_process_group"):
        writer.publish({"w": torch.zeros(2)})


@pytest.mark.parametrize("select", [["w"], ("w",), {"w"}, frozenset({"w"}), lambda n: n == "w"])
def test_a_reader_selects_by_a_function_or_a_collection_of_names(tmp_path, select):
    store = str(tmp_path / "store")
    DeltaWriter(store).publish({"w": torch.ones(2), "v": torch.zeros(3)})
    target = StateDictTarget({})
    DeltaReader(store, target, select=select).sync()
    assert sorted(target.tensors) == ["w"]


def test_the_writer_and_reader_take_numbers_of_any_integer_type(tmp_path):
    import numpy as np

    store = str(tmp_path / "store")
    writer = DeltaWriter(store, shard_bytes=np.int64(1 << 20), zstd_level=np.int32(1))
    writer.publish({"w": torch.ones(2)})
    assert writer.shard_bytes == 1 << 20 and type(writer.shard_bytes) is int
    reader = DeltaReader(store, StateDictTarget({}), max_workers=np.int64(2))
    assert reader.max_workers == 2 and reader.sync().version == 0


@pytest.mark.parametrize(
    ("tensors", "match"),
    [([torch.ones(2)], "not a list"), ({"w": torch.ones(2), "n": 3}, "'n' is not a torch.Tensor")],
)
def test_a_state_dict_target_of_something_else_is_refused(tensors, match):
    with pytest.raises(ArgumentError, match=match):
        StateDictTarget(tensors)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: StateDictTarget({}, version=1), "give both version and chain_id"),
        (lambda: StateDictTarget({}, version=1, chain_id="c", record_sha256="x"), "64 lowercase"),
        (lambda: ModuleTarget(torch.nn.Linear(2, 2), chain_id="c"), "give both version"),
        (lambda: ModuleTarget({"w": torch.ones(2)}), "takes a torch.nn.Module, not a dict"),
        (lambda: SafetensorsDirTarget("d", timeout=-1), "timeout is seconds >= 0"),
        (lambda: SafetensorsDirTarget("d", timeout="5"), "timeout is seconds >= 0"),
        (lambda: View(0, (2, 3), (1,)), "differ in rank"),
        (lambda: Layout(shard("w", (5, 2), dim=0, rank=0, size=2)), "does not split into 2"),
        (lambda: Layout([*whole("w", (2,)), *whole("w", (3,))]), "given two shapes"),
    ],
)
def test_bad_target_and_layout_arguments(make, match):
    with pytest.raises(ArgumentError, match=match) as caught:
        make()
    assert isinstance(caught.value, ValueError)  # what these raised before, still caught


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda store, out: replay(store, "0", out), "version must be an int, not str"),
        (lambda store, out: replay(store, -1, out), "version must be at least 0, not -1"),
        (lambda store, out: show(store, 0.0), "version must be an int, not float"),
        (lambda store, out: diff(store, 0, "1"), "b must be an int"),
        (lambda store, out: verify(store, start=-2), "start must be at least 0"),
        (lambda store, out: compact(store, None), "at must be an int, not NoneType"),
        (lambda store, out: compact(store, 0, zstd_level=30), "zstd_level must be from"),
        (lambda store, out: DeltaReader(store, StateDictTarget({})).sync(to="0"), "to must be"),
        (lambda store, out: DeltaReader(store, StateDictTarget({})).prepare(to=-1), "at least 0"),
    ],
)
def test_a_tool_given_a_version_of_the_wrong_kind_says_so(tmp_path, call, match):
    """Not "version 0 is not committed" for a version given as the string "0"."""
    store = str(tmp_path / "store")
    DeltaWriter(store).publish({"w": torch.ones(2)})
    with pytest.raises(ArgumentError, match=match):
        call(store, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unreadable_checkpoint_file_is_a_target_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(TargetError, match="not a readable safetensors file"):
        count_tensors(tmp_path)
    with pytest.raises(TargetError, match="not a readable safetensors file"):
        list(iter_checkpoint(tmp_path))


@pytest.mark.parametrize("limit", ["MAX_MANIFEST_BYTES", "MAX_RECORD_BYTES"])
def test_a_writer_refuses_objects_readers_would_refuse(tmp_path, monkeypatch, limit):
    import dcr_format.publish.writer as writer_module
    from dcr_format.chain.chain import Chain
    from dcr_format.errors import ObjectTooLargeError
    from dcr_format.store.store import Store

    url = str(tmp_path / "store")
    monkeypatch.setattr(writer_module, limit, 200)
    with pytest.raises(ObjectTooLargeError, match="limit readers enforce"):
        DeltaWriter(url).publish({f"w{i}": torch.ones(2) for i in range(8)})
    assert Chain(Store(url)).versions() == []


def test_a_hostile_base_record_fails_fast_with_one_short_error():
    import json

    from dcr_format.chain.bases import BaseRecord
    from dcr_format.errors import SchemaError
    from dcr_format.format.schema import parse

    ref = {"rank": 0, "path": "x", "sha256": "0" * 64, "size": -1}  # each one invalid
    record = {"format_version": 1, "manifests": [ref] * 2000}
    with pytest.raises(SchemaError) as caught:
        parse(BaseRecord, json.dumps(record).encode(), what="bases/x.json")
    assert len(str(caught.value)) < 500
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as raw:  # pydantic stops at the first bad manifest
        BaseRecord.model_validate(record)
    assert sum(1 for e in raw.value.errors() if e["loc"][0] == "manifests") == 1


def _store_files(root) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


BAD_INPUT = [
    ("meta", lambda good: {**good, "m": torch.empty(4, 4, device="meta")}, "meta device"),
    ("empty name", lambda good: {**good, "": torch.ones(3)}, "empty"),
    ("NUL in name", lambda good: {**good, "a\x00b": torch.ones(3)}, "control character"),
    ("long name", lambda good: {**good, "n" * 2000: torch.ones(3)}, "2000 characters"),
    ("a list", lambda good: {**good, "l": [1.0, 2.0]}, "not a torch.Tensor"),
    ("not a str", lambda good: {**good, 7: torch.ones(3)}, "must be strings"),
    ("sparse", lambda good: {**good, "s": torch.eye(3).to_sparse()}, "layout"),
    ("complex", lambda good: {**good, "c": torch.ones(2, dtype=torch.complex64)}, "dtype"),
    ("bare tensors", lambda good: list(good.values()), "(name, tensor) pairs"),
    ("listed, bad late", lambda good: [*good.items(), ("", torch.ones(1))], "empty"),
    ("streamed, bad late", lambda good: iter([*good.items(), ("", torch.ones(1))]), "empty"),
    ("a module", lambda good: torch.nn.Linear(2, 2), "not a Linear; pass model.state_dict()"),
    ("nothing", lambda good: None, "not a NoneType; pass {name: tensor}"),
    ("one tensor", lambda good: good["a"], "not a Tensor"),
]


@pytest.mark.parametrize(("case", "make", "match"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_publish_input_is_refused_by_name_before_anything_is_written(
    tmp_path, case, make, match
):
    """Bad writer input raises a named DcrError, and a mapping leaves the store as it was
    (pairs streamed once are checked as they come: the publish fails at the bad pair)."""
    good = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3).bfloat16()}
    root = tmp_path / "store"
    writer = DeltaWriter(str(root))
    writer.publish(good)
    before = _store_files(root)
    with pytest.raises(DcrError, match=re.escape(match)):
        writer.publish(make(good))
    if not case.startswith("streamed"):
        assert _store_files(root) == before
    good["a"][0] = 5.0
    assert writer.publish(good).version == 1  # the writer is still usable
