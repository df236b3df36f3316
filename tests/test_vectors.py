"""Golden vectors (spec/vectors/): readers reproduce them; the writer reproduces them exactly."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load_file

from dcr_format import (
    DeltaReader,
    StateDictTarget,
    replay,
    state_fingerprint,
    tensor_fingerprint,
)
from dcr_format.chain.chain import Chain, resolve_parents, state_table
from dcr_format.codings import classed, rans, ulp, ulp_shift
from dcr_format.errors import UnsupportedFeatureError
from dcr_format.format import features, schema
from dcr_format.format.dtypes import bits_view, info_for
from dcr_format.format.schema import Entry, Manifest
from dcr_format.format.shard import decode_shard
from dcr_format.publish._commit import read_reader_records
from dcr_format.store.store import open_store

VECTORS_DIR = Path(__file__).resolve().parent.parent / "spec" / "vectors"
NAMES = (
    "base-only",
    "xor-deltas",
    "mixed",
    "values-rans",
    "positions-classed",
    "values-ulp",
    "implicit-parents",
    "values-ulp-shift",
    "checkpoint-files",
    "default-codings",
    "baseline-names",
    "baseline-except",
    "reads-changed",
)


def expected_of(name: str) -> dict:
    return json.loads((VECTORS_DIR / name / "expected.json").read_text(encoding="utf-8"))


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The elements' little-endian bytes, row-major (torch runs on little-endian hosts)."""
    if tensor.numel() == 0:
        return b""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_state(tensors: dict[str, torch.Tensor], version: dict, where: str) -> None:
    """Names, dtypes, shapes, fingerprints and bytes of a state against expected.json."""
    want = version["tensors"]
    assert sorted(tensors) == sorted(want), f"{where}: tensor names differ"
    rows = []
    for name, spec in want.items():
        tensor = tensors[name]
        assert info_for(tensor.dtype).name == spec["dtype"], f"{where}: dtype of {name!r}"
        assert list(tensor.shape) == spec["shape"], f"{where}: shape of {name!r}"
        assert tensor_fingerprint(tensor) == spec["fingerprint"], f"{where}: fp of {name!r}"
        digest = hashlib.sha256(raw_bytes(tensor)).hexdigest()
        assert digest == spec["sha256"], f"{where}: bytes of {name!r}"
        rows.append((name, spec["dtype"], tuple(spec["shape"]), tensor_fingerprint(tensor)))
    assert state_fingerprint(rows) == version["state_fingerprint"], f"{where}: state fp"


def check_files(out: Path, version: dict, where: str) -> None:
    """The checkpoint files a directory holds (FORMAT.md §3.5.6) against expected.json: every
    file besides the tensors and dcr-state.json, with its listed bytes."""
    want = version.get("files", {})
    held = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in out.iterdir()
        if p.name != "dcr-state.json" and not p.name.endswith(".safetensors")
    }
    held.pop("model.safetensors.index.json", None)
    assert held == want, f"{where}: checkpoint files differ"


def store_files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", NAMES)
def test_expected_lists_the_committed_store(name: str) -> None:
    expected = expected_of(name)
    files = store_files(VECTORS_DIR / name / "store")
    listed = {o["key"]: o for o in expected["objects"]}
    assert sorted(files) == sorted(listed)
    for key, path in files.items():
        data = path.read_bytes()
        assert len(data) == listed[key]["size"], key
        assert hashlib.sha256(data).hexdigest() == listed[key]["sha256"], key
    commits = sorted(k for k in files if k.startswith("commits/"))
    assert len(commits) == len(expected["versions"])


@pytest.mark.parametrize("name", NAMES)
def test_replay_every_version_into_a_fresh_directory(name: str, tmp_path: Path) -> None:
    expected = expected_of(name)
    store = VECTORS_DIR / name / "store"
    for version in expected["versions"]:
        number = version["version"]
        out = tmp_path / f"v{number}"
        result = replay(store, number, out)
        assert result.version == number
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(out.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        check_state(tensors, version, f"{name} replay v{number}")
        check_files(out, version, f"{name} replay v{number}")


@pytest.mark.parametrize("name", NAMES)
def test_replay_incrementally_into_one_directory(name: str, tmp_path: Path) -> None:
    expected = expected_of(name)
    store = VECTORS_DIR / name / "store"
    out = tmp_path / "checkpoint"
    for version in expected["versions"]:
        number = version["version"]
        result = replay(store, number, out)
        assert result.applied_versions == (number,)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(out.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        check_state(tensors, version, f"{name} incremental replay v{number}")
        check_files(out, version, f"{name} incremental replay v{number}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("verify", ["touched", "all"])
def test_reader_syncs_a_state_dict_version_by_version(name: str, verify: str) -> None:
    expected = expected_of(name)
    target = StateDictTarget({})
    reader = DeltaReader(VECTORS_DIR / name / "store", target, verify=verify)
    for version in expected["versions"]:
        number = version["version"]
        result = reader.sync(to=number)
        assert result.applied_versions == (number,)
        check_state(dict(target.tensors), version, f"{name} state dict v{number}")


@pytest.mark.parametrize("name", NAMES)
def test_reader_syncs_each_version_into_an_empty_state_dict(name: str) -> None:
    expected = expected_of(name)
    for version in expected["versions"]:
        target = StateDictTarget({})
        DeltaReader(VECTORS_DIR / name / "store", target).sync(to=version["version"])
        check_state(dict(target.tensors), version, f"{name} fresh v{version['version']}")


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "dcr_vectors_generate", VECTORS_DIR / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # keep spec/ clean
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = bytecode
        del sys.modules[spec.name]
    return module


def test_generator_reproduces_every_object_byte_for_byte(tmp_path: Path) -> None:
    load_generator().generate(tmp_path)
    problems = []
    for name in NAMES:
        committed = VECTORS_DIR / name
        fresh = tmp_path / name
        old, new = store_files(committed / "store"), store_files(fresh / "store")
        for key in sorted(set(old) - set(new)):
            problems.append(f"{name}/store/{key}: committed, not regenerated")
        for key in sorted(set(new) - set(old)):
            problems.append(f"{name}/store/{key}: regenerated, not committed")
        for key in sorted(set(old) & set(new)):
            if old[key].read_bytes() != new[key].read_bytes():
                kind = "shard (zstd output)" if key.endswith(".dcrs") else "object"
                problems.append(f"{name}/store/{key}: {kind} differs")
        if (committed / "expected.json").read_bytes() != (fresh / "expected.json").read_bytes():
            problems.append(f"{name}/expected.json differs")
    if any("shard" in p for p in problems):
        made = expected_of(NAMES[0])["zstd"]
        problems.append(
            f"(the committed shards were compressed with zstd {made['library']}, python-zstandard "
            f"{made['python-zstandard']}; this run has zstd "
            f"{'.'.join(map(str, zstandard.ZSTD_VERSION))}, python-zstandard "
            f"{zstandard.__version__}; manifests and commit records embed shard hashes)"
        )
    assert not problems, "regenerated vectors differ from spec/vectors:\n" + "\n".join(problems)


def test_values_rans_vector_covers_escapes_and_a_one_symbol_table() -> None:
    store = open_store(VECTORS_DIR / "values-rans" / "store")
    chain = Chain(store)
    seen = set()
    for version in expected_of("values-rans")["versions"]:
        loaded = chain.record(version["version"])
        assert "values-rans" in loaded.record.required_features
        for manifest in chain.manifests(loaded):
            assert "values-rans" in manifest.required_features
            for entry in manifest.entries:
                if entry.values is None or entry.values.coding != "rans":
                    continue
                shard = manifest.shards[entry.values.shard]
                streams = decode_shard(store.get(shard.path), decoded_size=shard.decoded_size)
                data = bytes(streams[entry.values.key])
                width = info_for(entry.dtype).width
                parsed = rans._parse(data, count=entry.changed, width=width)
                seen.add(f"width {width}")
                if parsed.escape_count:
                    seen.add("escapes")
                if parsed.table.size == 1:
                    seen.add("one-symbol table")
                if parsed.words.size == 0:
                    seen.add("no words")
    assert seen >= {"width 1", "width 2", "width 4", "escapes", "one-symbol table", "no words"}


def test_a_reader_without_values_rans_refuses_the_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema, "KNOWN_FEATURES", frozenset({schema.PIECES_FEATURE}))
    target = StateDictTarget({})
    with pytest.raises(UnsupportedFeatureError, match="values-rans"):
        DeltaReader(VECTORS_DIR / "values-rans" / "store", target).sync(to=0)
    assert dict(target.tensors) == {}


def test_positions_classed_vector_decodes_against_the_old_bits_of_each_version() -> None:
    """Every classed stream of the vector parses, names all four float widths, and decodes
    against the bits the previous version left to exactly the positions whose bits differ;
    an element whose class changed in v2 is found in v3 by its new class."""
    store = open_store(VECTORS_DIR / "positions-classed" / "store")
    chain = Chain(store)
    versions = expected_of("positions-classed")["versions"]
    previous: dict[str, torch.Tensor] = {}
    target = StateDictTarget({})
    widths = set()
    for version in versions:
        loaded = chain.record(version["version"])
        for manifest in chain.manifests(loaded):
            for entry in manifest.entries:
                if entry.positions is None or entry.positions.coding != "classed":
                    continue
                assert "positions-classed" in manifest.required_features
                shard = manifest.shards[entry.positions.shard]
                streams = decode_shard(store.get(shard.path), decoded_size=shard.decoded_size)
                old = bits_view(previous[entry.name]).reshape(-1).numpy()
                info = info_for(entry.dtype)
                found = classed.decode_classed(
                    bytes(streams[entry.positions.key]),
                    old.view(f"<u{info.width}"),
                    entry.dtype,
                    count=entry.changed,
                    numel=old.size,
                )
                DeltaReader(store, target).sync(to=version["version"])
                new = bits_view(target.tensors[entry.name]).reshape(-1).numpy()
                assert np.array_equal(found, np.flatnonzero(new != old))
                widths.add(info.width)
        DeltaReader(store, target).sync(to=version["version"])
        previous = {n: t.clone() for n, t in target.tensors.items()}
    assert widths == {2, 4, 8}


def _value_streams(
    name: str, coding: str
) -> Iterator[tuple[Manifest, Entry, bytes, np.ndarray, np.ndarray]]:
    """For every entry of vector ``name`` whose values are coded ``coding``: its manifest,
    the entry, its values stream, and the bits of its changed elements before (the previous
    version's, as a reader synced to it holds them) and after (checked to be exactly the
    entry's ``changed`` elements)."""
    store = open_store(VECTORS_DIR / name / "store")
    chain = Chain(store)
    previous: dict[str, torch.Tensor] = {}
    target = StateDictTarget({})
    for version in expected_of(name)["versions"]:
        number = version["version"]
        before = {n: bits_view(t).reshape(-1).numpy().copy() for n, t in previous.items()}
        DeltaReader(store, target).sync(to=number)
        for manifest in chain.manifests(chain.record(number)):
            for entry in manifest.entries:
                if entry.values is None or entry.values.coding != coding:
                    continue
                assert features.CODING_FEATURES[coding] in manifest.required_features
                width = info_for(entry.dtype).width
                shard = manifest.shards[entry.values.shard]
                streams = decode_shard(store.get(shard.path), decoded_size=shard.decoded_size)
                old = before[entry.name].view(f"<u{width}")
                new = bits_view(target.tensors[entry.name]).reshape(-1).numpy()
                new = new.view(f"<u{width}")
                where = np.flatnonzero(old != new)
                assert where.size == entry.changed
                yield manifest, entry, bytes(streams[entry.values.key]), old[where], new[where]
        previous = {n: t.clone() for n, t in target.tensors.items()}


def test_values_ulp_vector_decodes_to_the_xor_of_each_step() -> None:
    """Every ulp stream of the vector decodes (rANS) to zigzag differences that, against the
    bits of the previous version, give exactly the next version's bits; all three float
    widths and a step across zero are there; every manifest is a zstd frame."""
    widths, crossed = set(), False
    for _, entry, stream, old, new in _value_streams("values-ulp", "ulp"):
        width = info_for(entry.dtype).width
        z = rans.decode_rans(stream, count=entry.changed, width=width)
        assert np.array_equal(ulp.from_ulp(old, z), new)
        widths.add(width)
        crossed |= bool(((old >> (8 * width - 1)) != (new >> (8 * width - 1))).any())
    assert widths == {2, 4, 8} and crossed
    store = open_store(VECTORS_DIR / "values-ulp" / "store")
    chain = Chain(store)
    for version in expected_of("values-ulp")["versions"]:
        loaded = chain.record(version["version"])
        assert "manifest-zstd" in loaded.record.required_features
        assert all(store.get(r.path)[:4] == b"\x28\xb5\x2f\xfd" for r in loaded.record.manifests)


def test_values_ulp_shift_vector_joins_to_the_differences_of_each_step() -> None:
    """Every ulp-shift stream of the vector splits (origin, rANS part, low bits) and joins,
    against the bits of the previous version, to the ulp differences that give exactly the
    next version's bits; all three float widths, shifts at each dtype's cap and an ``ulp``
    entry next to the shifted ones are there."""
    widths, capped, codings = set(), set(), set()
    for manifest, entry, stream, old, new in _value_streams("values-ulp-shift", "ulp-shift"):
        codings |= {e.values.coding for e in manifest.entries if e.values and e.changed}
        width = info_for(entry.dtype).width
        parsed = ulp_shift.parse(stream, count=entry.changed, width=width, dtype=entry.dtype)
        y = rans.decode_rans(parsed.coded, count=entry.changed, width=width)
        z = ulp_shift.join(old, y, parsed.origin, parsed.low, entry.dtype)
        assert np.array_equal(ulp.from_ulp(old, z), new)
        widths.add(width)
        exponents = ulp_shift.exponents_of(old, entry.dtype)
        shifts = ulp_shift.shifts_of(exponents, parsed.origin, entry.dtype)
        if int(shifts.max()) == ulp_shift.shift_cap(entry.dtype):
            capped.add(entry.dtype)
    assert widths == {2, 4, 8} and "bfloat16" in capped
    assert codings >= {"ulp-shift", "ulp", "rans"}


def test_implicit_parents_vector_leaves_every_delta_parent_to_the_table() -> None:
    """Every delta manifest of the vector lists the feature and leaves each parent
    fingerprint null; resolved against the previous version's table they are the parents the
    explicit ``xor-deltas`` vector (the same states) writes."""
    chain = Chain(open_store(VECTORS_DIR / "implicit-parents" / "store"))
    explicit = Chain(open_store(VECTORS_DIR / "xor-deltas" / "store"))
    ops = set()
    for version in expected_of("implicit-parents")["versions"][1:]:
        number = version["version"]
        loaded = chain.record(number)
        assert "implicit-parents" in loaded.record.required_features
        [manifest] = chain.manifests(loaded)
        assert "implicit-parents" in manifest.required_features
        assert all(e.parent_fingerprint is None for e in manifest.entries)
        ops |= {e.op for e in manifest.entries}
        parent = state_table(chain.manifests(chain.record(number - 1)))
        [resolved] = resolve_parents([manifest], parent, number)
        [theirs] = explicit.manifests(explicit.record(number))
        assert {e.name: e.parent_fingerprint for e in resolved.entries} == {
            e.name: e.parent_fingerprint for e in theirs.entries
        }
    assert ops == {"xor", "overwrite"}


@pytest.mark.parametrize(
    "feature", ["positions-classed", "values-ulp", "values-ulp-shift", "implicit-parents"]
)
def test_a_reader_without_the_feature_refuses_its_vector(
    feature: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vector named after a feature reads to its base without it (the feature is in
    its deltas only) and is refused from the first delta on, before anything changes."""
    store = VECTORS_DIR / feature / "store"
    target = StateDictTarget({})
    DeltaReader(store, target).sync(to=0)
    monkeypatch.setattr(schema, "KNOWN_FEATURES", schema.KNOWN_FEATURES - {feature})
    with pytest.raises(UnsupportedFeatureError, match=feature):
        DeltaReader(store, target).sync(to=1)
    resident = target.resident()
    assert resident is not None and resident.version == 0


def test_checkpoint_files_vector_lists_each_version_s_files() -> None:
    """Rank 0's manifest lists exactly the files of expected.json (none: no feature), each
    stored once under its sha256; a reader without the feature refuses every version that
    lists files, before anything changes."""
    chain = Chain(open_store(VECTORS_DIR / "checkpoint-files" / "store"))
    for version in expected_of("checkpoint-files")["versions"]:
        loaded = chain.record(version["version"])
        [manifest] = chain.manifests(loaded)
        listed = {f.name: {"size": f.size, "sha256": f.sha256} for f in manifest.files}
        assert listed == version["files"]
        assert ("checkpoint-files" in loaded.record.required_features) == bool(listed)
        for ref in manifest.files:
            data = chain.store.get(ref.key)
            assert hashlib.sha256(data).hexdigest() == ref.sha256 and len(data) == ref.size


def test_a_reader_without_checkpoint_files_refuses_the_vector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = VECTORS_DIR / "checkpoint-files" / "store"
    monkeypatch.setattr(schema, "KNOWN_FEATURES", schema.KNOWN_FEATURES - {"checkpoint-files"})
    target = StateDictTarget({})
    with pytest.raises(UnsupportedFeatureError, match="checkpoint-files"):
        DeltaReader(store, target).sync(to=0)
    assert target.resident() is None


def test_default_codings_vector_uses_every_feature_until_a_reader_cannot_read_old_bits() -> None:
    """Written with the writer's default features: with no reader records its deltas use the
    codings against the old bits and the manifest features; once a record says its reader
    cannot read its old bits, the next version uses none of those codings (the other
    features stay). A writer reading the vector's records chooses exactly that."""
    chain = Chain(open_store(VECTORS_DIR / "default-codings" / "store"))
    expected = expected_of("default-codings")
    assert expected["writer"]["features"] == "default"
    used = [chain.record(v["version"]).record.required_features for v in expected["versions"]]
    assert used[1] == (
        "implicit-parents",
        "manifest-zstd",
        "positions-classed",
        "values-rans",
        "values-ulp",
        "values-ulp-shift",
    )
    assert {"positions-classed", "values-ulp-shift"} <= set(used[2])
    assert used[3] == ("implicit-parents", "manifest-zstd", "values-rans")
    wishes = read_reader_records(chain.store)
    assert not wishes.reads_baseline and wishes.limiting == ("engine-0",)
    assert wishes.features_for(None) == set(used[3])


@pytest.mark.parametrize("name", ["baseline-names", "baseline-except"])
def test_per_tensor_vectors_code_against_old_bits_only_what_every_record_reads(name: str) -> None:
    """The records list the tensors whose old bits their readers read (``baseline-names``)
    or every tensor's but those they list (``baseline-except``): the versions after them
    code exactly the tensors every record reads against the old bits, and a writer reading
    the vector's records chooses that set."""
    chain = Chain(open_store(VECTORS_DIR / name / "store"))
    expected = expected_of(name)
    readable = {"model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight"}
    readable.add("model.layers.0.steps")
    for version in (1, 2):
        assert set(expected["baseline_names"][str(version)]) == readable
        against = set()
        for manifest in chain.manifests(chain.record(version)):
            for entry in manifest.entries:
                if (entry.positions and entry.positions.coding == "classed") or (
                    entry.values and entry.values.coding in ("ulp", "ulp-shift")
                ):
                    against.add(entry.name)
        assert against == readable - {"model.layers.0.steps"}  # no float, no ulp
    wishes = read_reader_records(chain.store)
    codings = features.PublishCodings(features.WRITER_FEATURES, wishes.baseline)
    names = {e.name for m in chain.manifests(chain.record(1)) for e in m.entries}
    assert {n for n in names if "classed" in codings.for_tensor(n).codings} == readable
    assert wishes.limiting == ("engine-0", "engine-1")


def test_the_reads_changed_vector_sends_ulp_values_where_every_record_reads_changed_elements():
    """``reads-changed``: engine-1 reads the old bits of each changed element it holds, so
    ``k_proj``, which engine-0 reads whole, takes ``ulp`` values, but neither ``classed``
    positions nor ``ulp-shift`` values; a writer reading the records allows exactly that."""
    chain = Chain(open_store(VECTORS_DIR / "reads-changed" / "store"))
    expected = expected_of("reads-changed")
    k = "model.layers.0.self_attn.k_proj.weight"
    for version in (1, 2):
        assert k in expected["changed_names"][str(version)]
        assert k not in expected["baseline_names"][str(version)]
        entry = next(
            e for m in chain.manifests(chain.record(version)) for e in m.entries if e.name == k
        )
        assert entry.positions is not None and entry.values is not None
        assert (entry.positions.coding, entry.values.coding) == ("rice", "ulp")
    wishes = read_reader_records(chain.store)
    codings = features.PublishCodings(features.WRITER_FEATURES, wishes.baseline, wishes.changed)
    assert codings.for_tensor(k).codings & {"classed", "ulp", "ulp-shift"} == {"ulp"}
