"""Bad arguments and unreadable inputs of the library raise named errors, not bare built-ins."""

from __future__ import annotations

import pytest
import torch

from dcr_format import ArgumentError, DeltaReader, DeltaWriter, StateDictTarget, TargetError
from dcr_format.checkpoint import count_tensors, iter_checkpoint


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
