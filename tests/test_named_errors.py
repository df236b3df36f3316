"""Bad arguments and unreadable inputs of the library raise named errors, not bare built-ins."""

from __future__ import annotations

import pytest
import torch

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, TargetError
from dcr_format.checkpoint import count_tensors, iter_checkpoint
from dcr_format.errors import ArgumentError


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_every": 0},
        {"rank": 2, "world_size": 2},
        {"world_size": 2},  # no coordinator
        {"ops": {"w": "bogus"}},
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
    [{"verify": "some"}, {"reader_id": "a/b"}, {"audit_every": 0}, {"audit_seconds": -1.0}],
)
def test_bad_reader_arguments(tmp_path, kwargs):
    DeltaWriter(str(tmp_path / "store")).publish({"w": torch.ones(2)})
    with pytest.raises(ArgumentError):
        DeltaReader(str(tmp_path / "store"), StateDictTarget({}), **kwargs)


def test_an_unreadable_checkpoint_file_is_a_target_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(TargetError, match="not a readable safetensors file"):
        count_tensors(tmp_path)
    with pytest.raises(TargetError, match="not a readable safetensors file"):
        list(iter_checkpoint(tmp_path))


@pytest.mark.parametrize("limit", ["MAX_MANIFEST_BYTES", "MAX_RECORD_BYTES"])
def test_a_writer_refuses_objects_readers_would_refuse(tmp_path, monkeypatch, limit):
    import dcr_format.writers.writer as writer_module
    from dcr_format.chain import Chain
    from dcr_format.errors import ObjectTooLargeError
    from dcr_format.store import Store

    url = str(tmp_path / "store")
    monkeypatch.setattr(writer_module, limit, 200)
    with pytest.raises(ObjectTooLargeError, match="limit readers enforce"):
        DeltaWriter(url).publish({f"w{i}": torch.ones(2) for i in range(8)})
    assert Chain(Store(url)).versions() == []


def test_a_hostile_base_record_fails_fast_with_one_short_error():
    import json

    from dcr_format.bases import BaseRecord
    from dcr_format.errors import SchemaError
    from dcr_format.schema import parse

    ref = {"rank": 0, "path": "x", "sha256": "0" * 64, "size": -1}  # each one invalid
    record = {"format_version": 1, "manifests": [ref] * 2000}
    with pytest.raises(SchemaError) as caught:
        parse(BaseRecord, json.dumps(record).encode(), what="bases/x.json")
    assert len(str(caught.value)) < 500
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as raw:  # pydantic stops at the first bad manifest
        BaseRecord.model_validate(record)
    assert sum(1 for e in raw.value.errors() if e["loc"][0] == "manifests") == 1
