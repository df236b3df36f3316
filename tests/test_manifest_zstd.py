"""The ``manifest-zstd`` feature (FORMAT.md §3.5): manifests stored as one zstd frame of their
JSON, read back exactly, and refused when the frame or the feature list is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zstandard

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.chain.chain import Chain
from dcr_format.errors import SchemaError, UnsupportedFeatureError
from dcr_format.format import schema
from dcr_format.store.store import open_store

FEATURE = "manifest-zstd"


def states(count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    state = {
        f"model.layers.{i}.mlp.{p}_proj.weight": torch.randn(32, 64, generator=gen).bfloat16()
        for i in range(6)
        for p in ("gate", "up", "down")
    }
    out = [state]
    for _ in range(count - 1):
        state = {n: t.clone() for n, t in state.items()}
        for t in state.values():
            t.view(-1)[::97] += 0.01
        out.append(state)
    return out


def stored_manifests(store: Path, version: int) -> list[bytes]:
    chain = Chain(open_store(store))
    return [open_store(store).get(ref.path) for ref in chain.record(version).record.manifests]


def test_compressed_manifests_read_back_and_are_smaller(tmp_path: Path) -> None:
    plain_store, small_store = tmp_path / "plain", tmp_path / "small"
    plain = DeltaWriter(plain_store, features=["values-rans"])
    small = DeltaWriter(small_store, features=["values-rans", FEATURE])
    versions = states(3)
    for state in versions:
        plain.publish(state)
        small.publish(state)
    for version in range(3):
        [compressed] = stored_manifests(small_store, version)
        [text] = stored_manifests(plain_store, version)
        assert compressed[:4] == b"\x28\xb5\x2f\xfd" and text[:1] == b"{"
        assert len(compressed) < 0.5 * len(text)
        record = Chain(open_store(small_store)).record(version).record
        assert FEATURE in record.required_features
        manifest = schema.parse_manifest(compressed, what="m")
        assert FEATURE in manifest.required_features
    target = StateDictTarget({})
    DeltaReader(small_store, target).sync()
    for name, tensor in versions[-1].items():
        assert torch.equal(target.tensors[name].view(torch.int16), tensor.view(torch.int16))
    incremental = StateDictTarget({})
    reader = DeltaReader(small_store, incremental)
    for version in range(3):
        reader.sync(to=version)
    assert all(torch.equal(incremental.tensors[n], t) for n, t in versions[-1].items())


def test_large_manifests_are_compressed_at_the_faster_level(tmp_path: Path) -> None:
    """Past 8 KiB of JSON (a model of a few dozen tensors) the reference uses level 9
    (FORMAT.md §3.5), whose frame is a few percent larger in a hundredth of level 19's
    time; all read back."""
    gen = torch.Generator().manual_seed(1)
    many = {f"w.{i}": torch.randn(8, generator=gen).bfloat16() for i in range(400)}
    stored = {}
    for label, count in (("small", 1), ("mid", 40), ("large", 400)):
        writer = DeltaWriter(tmp_path / label, features=[FEATURE])
        writer.publish(dict(list(many.items())[:count]))
        [stored[label]] = stored_manifests(tmp_path / label, 0)
    texts = {name: schema.parse_manifest(data, what="m").to_json() for name, data in stored.items()}
    assert len(texts["small"]) < 8 << 10 < len(texts["mid"]) < 64 << 10 < len(texts["large"])
    for label, level in (("small", 19), ("mid", 9), ("large", 9)):
        text = texts[label]
        assert (len(text) > schema.MANIFEST_ZSTD_LARGE_BYTES) == (level == 9)
        frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(text)
        assert stored[label] == frame
    assert len(schema.parse_manifest(stored["large"], what="m").entries) == 400


def test_bad_frames_and_feature_lists_are_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    DeltaWriter(store, features=[FEATURE]).publish(states(1)[0])
    [compressed] = stored_manifests(store, 0)
    text = zstandard.ZstdDecompressor().decompress(compressed)
    plain_with_feature = text  # lists the feature but is stored as JSON
    with pytest.raises(SchemaError, match="not compressed"):
        schema.parse_manifest(plain_with_feature, what="m")
    without = text.replace(b'"required_features":["manifest-zstd"]', b'"required_features":[]')
    assert without != text
    with pytest.raises(SchemaError, match="does not list"):
        schema.parse_manifest(zstandard.ZstdCompressor().compress(without), what="m")
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(text)
    with pytest.raises(SchemaError, match="declares"):
        schema.parse_manifest(no_size, what="m")
    bomb = zstandard.ZstdCompressor().compress(b" " * (schema.MAX_MANIFEST_JSON_BYTES + 1))
    with pytest.raises(SchemaError, match="declares"):
        schema.parse_manifest(bomb, what="m")
    with pytest.raises(SchemaError):
        schema.parse_manifest(compressed[:-3], what="m")  # truncated frame
    with pytest.raises(SchemaError):
        schema.parse_manifest(compressed + b"\x00", what="m")  # trailing bytes


def test_a_reader_without_the_feature_refuses_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    DeltaWriter(store, features=[FEATURE]).publish(states(1)[0])
    monkeypatch.setattr(schema, "KNOWN_FEATURES", schema.KNOWN_FEATURES - {FEATURE})
    target = StateDictTarget({})
    with pytest.raises(UnsupportedFeatureError, match=FEATURE):
        DeltaReader(store, target).sync()
    assert dict(target.tensors) == {}
