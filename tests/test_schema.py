"""JSON models: strict, frozen round trips, and named refusals of anything else."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dcr_format.errors import (
    DcrError,
    SchemaError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from dcr_format.format import schema
from dcr_format.format.schema import (
    CheckpointFile,
    CommitRecord,
    Entry,
    Manifest,
    ManifestRef,
    Piece,
    PositionsRef,
    ReaderRecord,
    ShardRef,
    Stats,
    StoreHeader,
    StreamRef,
    ValuesRef,
    parse,
)

SHA = "ab" * 32
FP = "0123456789abcdef" * 2
HEX32 = "f" * 32
WHEN = "2025-01-02T03:04:05.123456Z"


def shard_ref(**kw) -> ShardRef:
    return ShardRef(
        **{"path": "objects/1/abc/shard-0.zst", "sha256": SHA, "size": 10, "decoded_size": 64, **kw}
    )


def entry(**kw) -> Entry:
    fields = {
        "name": "model.layers.0.self_attn.q_proj.weight",
        "dtype": "bfloat16",
        "shape": (4096, 4096),
        "op": "xor",
        "changed": 12,
        "positions": PositionsRef(shard=0, key="e0.p", coding="rice"),
        "values": ValuesRef(shard=0, key="e0.v", coding="planes"),
        "encoded_bytes": 99,
        "fingerprint": FP,
        "parent_fingerprint": FP,
    }
    return Entry(**{**fields, **kw})


def manifest(**kw) -> Manifest:
    fields = {
        "chain_id": HEX32,
        "version": 3,
        "kind": "delta",
        "attempt": HEX32,
        "rank": 0,
        "world_size": 2,
        "shards": (shard_ref(),),
        "entries": (
            entry(),
            entry(name="lm_head.weight", op="full", positions=None, parent_fingerprint=None),
            entry(name="scalar", shape=(), op="overwrite", changed=0, positions=None, values=None),
        ),
    }
    return Manifest(**{**fields, **kw})


def commit_record(**kw) -> CommitRecord:
    fields = {
        "chain_id": HEX32,
        "version": 3,
        "kind": "delta",
        "parent": 2,
        "parent_sha256": SHA,
        "step": -7,
        "created": WHEN,
        "attempt": HEX32,
        "world_size": 2,
        "manifests": (ManifestRef(rank=0, path="objects/3/x/manifest-0.json", sha256=SHA, size=5),),
        "state_fingerprint": SHA,
        "stats": Stats(
            tensors=3, total_elements=10, changed_elements=2, payload_bytes=7, dense_bytes=20
        ),
    }
    return CommitRecord(**{**fields, **kw})


TOP_LEVEL = {
    "store_header": lambda: StoreHeader(chain_id=HEX32, created="2025-01-02T03:04:05Z"),
    "manifest": manifest,
    "commit_record": commit_record,
    "base_commit": lambda: commit_record(kind="base", parent=None, parent_sha256=None, step=None),
    "manifest_with_files": lambda: manifest(
        required_features=("checkpoint-files",),
        files=(
            CheckpointFile(name="config.json", size=3, sha256=SHA),
            CheckpointFile(name="tokenizer.json", size=0, sha256=SHA),
        ),
    ),
    "reader_record": lambda: ReaderRecord(
        reader_id="rollout-0.a_b", updated=WHEN, overwrite=("x",)
    ),
}
PARTS = {
    "shard_ref": shard_ref,
    "stream_ref": lambda: StreamRef(shard=1, key="k", coding="anything"),
    "positions_ref": lambda: PositionsRef(shard=0, key="p", coding="ranges"),
    "values_ref": lambda: ValuesRef(shard=0, key="v", coding="planes"),
    "entry": entry,
    "piece": lambda: Piece(index=1, count=2, lanes_before=(1, 2), lanes_after=(3, 4)),
    "piece_entry": lambda: entry(piece=Piece(index=0, count=3, lanes_after=(5, 6, 7))),
    "manifest_ref": lambda: ManifestRef(rank=3, path="a/b", sha256=SHA, size=0),
    "checkpoint_file": lambda: CheckpointFile(name="chat_template.jinja", size=9, sha256=SHA),
    "stats": lambda: Stats(
        tensors=0, total_elements=0, changed_elements=0, payload_bytes=0, dense_bytes=0
    ),
}


def test_every_model_is_covered():
    models = {
        obj
        for obj in vars(schema).values()
        if isinstance(obj, type) and issubclass(obj, schema._Model) and obj is not schema._Model
    }
    covered = {type(make()) for make in (*TOP_LEVEL.values(), *PARTS.values())}
    assert covered == models


@pytest.mark.parametrize("make", TOP_LEVEL.values(), ids=TOP_LEVEL.keys())
def test_top_level_objects_round_trip_through_parse(make):
    obj = make()
    data = obj.to_json()
    assert isinstance(data, bytes)
    back = parse(type(obj), data, what="obj")
    assert back == obj
    assert back.to_json() == data  # canonical: serialising again gives the same bytes
    assert parse(type(obj), data.decode(), what="obj") == obj
    assert json.loads(data)["format_version"] == 1


@pytest.mark.parametrize("make", PARTS.values(), ids=PARTS.keys())
def test_embedded_models_round_trip(make):
    obj = make()
    back = type(obj).model_validate_json(obj.to_json(), strict=True)
    assert back == obj and back.to_json() == obj.to_json()


@settings(max_examples=50, deadline=None)
@given(
    version=st.integers(0, 1 << 62),
    count=st.integers(0, 1 << 62),
    shape=st.lists(st.integers(0, 1 << 62), max_size=64).map(tuple),
    name=st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=50),
    step=st.one_of(st.none(), st.integers(-(1 << 62), 1 << 62)),
)
def test_random_valid_fields_round_trip(version, count, shape, name, step):
    m = manifest(version=version, entries=(entry(name=name, shape=shape, changed=count),))
    assert parse(Manifest, m.to_json(), what="m") == m
    c = commit_record(version=version, step=step)
    assert parse(CommitRecord, c.to_json(), what="c") == c


# --- refusals -----------------------------------------------------------------------------


def refused(error: type[Exception], model, data, **kw) -> Exception:
    with pytest.raises(DcrError) as info:
        parse(model, data, what="obj", **kw)
    assert type(info.value) is error, f"got {type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, ValueError)
    return info.value


def doc(make=commit_record, **changes) -> dict:
    raw = json.loads(make().to_json())
    for key, value in changes.items():
        raw[key] = value
    return raw


def dump(raw) -> bytes:
    return json.dumps(raw).encode()


@pytest.mark.parametrize("version", [2, 3, 1 << 70])
def test_newer_format_version(version):
    refused(UnsupportedVersionError, CommitRecord, dump(doc(format_version=version)))
    # refused before anything else is validated
    refused(UnsupportedVersionError, CommitRecord, dump({"format_version": version, "x": 1}))


def test_unknown_required_feature():
    refused(UnsupportedFeatureError, CommitRecord, dump(doc(required_features=["x"])))
    refused(UnsupportedFeatureError, Manifest, dump(doc(manifest, required_features=["a", "b"])))
    refused(
        UnsupportedFeatureError,
        StoreHeader,
        dump({"format_version": 1, "required_features": ["x"]}),
    )


@pytest.mark.parametrize(
    "features",
    [{"x": 1}, "x", [1], [None], [["x"]]],
    ids=["object", "string", "int", "null", "nested"],
)
def test_malformed_required_features(features):
    refused(SchemaError, CommitRecord, dump(doc(required_features=features)))


@pytest.mark.parametrize("version", ["absent", None, "1", 1.0, True, 0, -1, [1]])
def test_missing_or_bad_format_version(version):
    raw = doc()
    if version == "absent":
        del raw["format_version"]
    else:
        raw["format_version"] = version
    refused(SchemaError, CommitRecord, dump(raw))


@pytest.mark.parametrize("data", [b"[]", b'"text"', b"1", b"null", b"[{}]"])
def test_not_an_object(data):
    refused(SchemaError, CommitRecord, data)


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"{'a': 1}", b"\xff\xfe{}", b'{"format_version": 1,}', b"[" * 100_000, "{\ud800}"],
    ids=["empty", "open", "quotes", "utf16", "comma", "deep", "surrogate"],
)
def test_invalid_json(data):
    refused(SchemaError, CommitRecord, data)


def test_invalid_utf8():
    raw = dump(doc(manifest))
    refused(SchemaError, Manifest, raw.replace(b'"kind"', b'"\xff\xfe"'))


def test_oversize_input(monkeypatch):
    data = commit_record().to_json()
    monkeypatch.setattr(schema, "MAX_JSON_BYTES", len(data) - 1)
    refused(SchemaError, CommitRecord, data)
    monkeypatch.setattr(schema, "MAX_JSON_BYTES", len(data))
    assert parse(CommitRecord, data, what="obj") == commit_record()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("version", "1"),
        ("version", 1.0),
        ("version", True),
        ("world_size", "2"),
        ("step", "3"),
        ("step", 1.5),
        ("parent", "2"),
        ("chain_id", 5),
        ("created", 1700000000),
        ("kind", "Delta"),
        ("kind", None),
        ("manifests", {"rank": 0}),
        ("manifests", "[]"),
        ("stats", []),
        ("stats", None),
    ],
)
def test_wrong_types_are_not_coerced(field, value):
    refused(SchemaError, CommitRecord, dump(doc(**{field: value})))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chain_id", "F" * 32),
        ("chain_id", "f" * 31),
        ("chain_id", "f" * 33),
        ("chain_id", "g" * 32),
        ("chain_id", "f" * 32 + "\n"),
        ("attempt", ""),
        ("parent_sha256", "AB" * 32),
        ("parent_sha256", "ab" * 31),
        ("parent_sha256", "ab" * 32 + "\n"),
        ("state_fingerprint", "0x" + "a" * 62),
        ("state_fingerprint", " " + "a" * 63),
        ("created", "2025-01-02 03:04:05Z"),
        ("created", "2025-01-02T03:04:05"),
        ("created", "2025-01-02T03:04:05.1234567Z"),
        ("created", "٢٠٢٥-01-02T03:04:05Z"),  # non-ASCII digits
    ],
)
def test_bad_hex_and_timestamps(field, value):
    refused(SchemaError, CommitRecord, dump(doc(**{field: value})))


@pytest.mark.parametrize(
    "bad",
    ["", "A" * 32, FP[:-1], FP + "0", "z" * 32, FP[:-1] + "\n"],
)
def test_bad_tensor_fingerprint(bad):
    for field in ("fingerprint", "parent_fingerprint"):
        raw = doc(manifest)
        raw["entries"][0][field] = bad
        refused(SchemaError, Manifest, dump(raw))


@pytest.mark.parametrize(
    "path",
    [
        ["stats", "tensors"],
        ["stats", "dense_bytes"],
        ["manifests", 0, "size"],
        ["manifests", 0, "rank"],
        ["version"],
        ["parent"],
    ],
)
@pytest.mark.parametrize("value", [-1, (1 << 62) + 1])
def test_counts_out_of_range(path, value):
    raw = doc()
    target = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    refused(SchemaError, CommitRecord, dump(raw))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("changed", -1),
        ("encoded_bytes", -5),
        ("shape", [4, -1]),
        ("shape", [1] * 65),
        ("shape", [1.0]),
        ("dtype", "complex64"),
        ("dtype", "BF16"),
        ("op", "add"),
        ("name", ""),
        ("name", "a\nb"),
        ("name", "x" * 1025),
        ("positions", {"shard": 0, "key": "p", "coding": "bitmap"}),
        ("values", {"shard": 0, "key": "v", "coding": "raw"}),
        ("values", {"shard": -1, "key": "v", "coding": "planes"}),
        ("values", {"shard": 0, "key": "", "coding": "planes"}),
    ],
)
def test_bad_entry_fields(field, value):
    raw = doc(manifest)
    raw["entries"][0][field] = value
    refused(SchemaError, Manifest, dump(raw))


@pytest.mark.parametrize(
    "key",
    [
        "..",
        "../x",
        "a/../b",
        "a/..",
        ".",
        "a/./b",
        "/abs",
        "/",
        "a//b",
        "a/",
        "a\\b",
        "..\\x",
        "C:\\x",
        "",
        "a b",
        "a/b\n",
        "x" * 1025,
    ],
)
def test_bad_relative_keys(key):
    raw = doc(manifest)
    raw["shards"][0]["path"] = key
    refused(SchemaError, Manifest, dump(raw))
    raw = doc()
    raw["manifests"][0]["path"] = key
    refused(SchemaError, CommitRecord, dump(raw))


@pytest.mark.parametrize(
    "key", ["a", "a/b/c", "objects/00000000000000000001/x/shard-0.zst", "...", ".a/b.", "a..b"]
)
def test_good_relative_keys(key):
    raw = doc(manifest)
    raw["shards"][0]["path"] = key
    assert parse(Manifest, dump(raw), what="m").shards[0].path == key


@pytest.mark.parametrize("reader_id", ["", "a/b", "a b", "x" * 129, "a\n"])
def test_bad_reader_id(reader_id):
    raw = doc(TOP_LEVEL["reader_record"], reader_id=reader_id)
    refused(SchemaError, ReaderRecord, dump(raw))


def test_store_header_refuses_another_format_name():
    raw = doc(TOP_LEVEL["store_header"], format="zarr")
    refused(SchemaError, StoreHeader, dump(raw))


def test_missing_required_field():
    for field in ("chain_id", "stats", "manifests", "created", "parent"):
        raw = doc()
        del raw[field]
        refused(SchemaError, CommitRecord, dump(raw))


def test_unknown_extra_fields_are_ignored():
    raw = doc(future_field={"nested": [1, 2]}, another="x")
    raw["stats"]["extra"] = 1
    raw["manifests"][0]["extra"] = "y"
    assert parse(CommitRecord, dump(raw), what="obj") == commit_record()
    raw = doc(manifest, hint=None)
    raw["entries"][0]["later"] = {"a": 1}
    raw["entries"][0]["positions"]["later"] = 2
    assert parse(Manifest, dump(raw), what="obj") == manifest()


def test_known_feature_list_may_be_empty_or_absent():
    raw = doc(required_features=[])
    assert parse(CommitRecord, dump(raw), what="obj") == commit_record()
    del raw["required_features"]
    assert parse(CommitRecord, dump(raw), what="obj") == commit_record()


def test_error_names_the_object_and_field():
    error = refused(SchemaError, CommitRecord, dump(doc(version="1")))
    assert "obj" in str(error) and "version" in str(error)


# --- frozen --------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [*TOP_LEVEL.values(), *PARTS.values()])
def test_models_are_frozen(make):
    obj = make()
    field = next(iter(type(obj).model_fields))
    with pytest.raises(ValidationError):
        setattr(obj, field, getattr(obj, field))
    with pytest.raises((ValidationError, AttributeError, TypeError)):
        obj.not_a_field = 1  # type: ignore[attr-defined]
    hash(obj)  # frozen models are hashable


def test_nested_collections_are_immutable():
    m = manifest()
    assert isinstance(m.entries, tuple) and isinstance(m.entries[0].shape, tuple)
    with pytest.raises(ValidationError):
        m.entries[0].changed = 5  # type: ignore[misc]


def _files_doc(**changes) -> dict:
    raw = json.loads(TOP_LEVEL["manifest_with_files"]().to_json())
    raw.update(changes)
    return raw


def _file(name: str, size: int = 1) -> dict:
    return {"name": name, "size": size, "sha256": SHA}


@pytest.mark.parametrize(
    "changes",
    [
        {"required_features": []},  # files without the feature
        {"files": []},  # the feature without files
        {"rank": 1},  # only rank 0 lists files
        {"files": [_file("b.json"), _file("a.json")]},  # not in name order
        {"files": [_file("a.json"), _file("a.json")]},  # listed twice
        {"files": [_file("model.safetensors")]},  # a name the directory target writes
        {"files": [_file("model-00001-of-00002.safetensors")]},
        {"files": [_file("model.safetensors.index.json")]},
        {"files": [_file("dcr-state.json")]},
        {"files": [_file("sub/config.json")]},  # a path
        {"files": [_file("../config.json")]},
        {"files": [_file(".hidden")]},
        {"files": [_file("x" * 129)]},
        {"files": [_file("big", (64 << 20) + 1)]},  # one file over 64 MiB
        {"files": [_file(f"f{i}", 64 << 20) for i in range(5)]},  # over 256 MiB in all
        {"files": [_file(f"f{i:04d}", 0) for i in range(1025)]},  # over 1024 files
        {"files": [{"name": "a", "size": 1}]},  # no sha256
    ],
)
def test_checkpoint_files_that_break_a_rule_are_refused(changes):
    refused(SchemaError, Manifest, dump(_files_doc(**changes)))


def test_a_manifest_without_files_has_no_files_member():
    assert b'"files"' not in manifest().to_json()
