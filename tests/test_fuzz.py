"""Hostile input end to end: mutated stored objects go through DeltaReader into a target.

The unit-level refusals live in test_codec_hostile.py, test_schema.py and test_store.py.
Here every hostile object is read by a real DeltaReader syncing a real target from version
2 to version 3 of a small chain, and every case must end in one of two ways:

- a DcrError (a named error), the target's bits and resident version untouched; or
- success with exactly the bits of version 3 (a harmless mutation, e.g. JSON key order).

A hypothesis fuzzer flips, truncates, extends and splices bytes of commit records,
manifests and shards, edits their JSON fields, rewrites decoded shard blobs and the
position and value streams inside them, and re-signs what it changed (sha256 and size
in the manifest, then in the commit record) so the bytes get past the checksums into the
parsers and decoders. Named cases cover sizes and memory (tracemalloc), overflow, keys
that leave the root, symlinks, and records that point at another chain's objects.
A short atheris run (tests/fuzz_targets.py) fuzzes the parsers directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import zstandard
from conftest import assert_same_bits, dir_snapshot, flip_bits, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec_hostile import ranges_stream, rice_stream

from dcr_format import (
    DcrError,
    DeltaReader,
    DeltaWriter,
    SafetensorsDirTarget,
    StateDictTarget,
    Store,
)
from dcr_format.chain.chain import sha256_hex
from dcr_format.errors import (
    ChainBrokenError,
    ChecksumMismatchError,
    InvalidKeyError,
    ObjectTooLargeError,
    SchemaError,
    ShardError,
)
from dcr_format.format.shard import compress, decode_shard, pack_streams

pytestmark = pytest.mark.slow

FUZZ_EXAMPLES = int(os.environ.get("DCR_FUZZ_EXAMPLES", "200"))
FUZZ_FIXED = "DCR_FUZZ_EXAMPLES" not in os.environ  # CI: the same examples every run
GROUP = "hostile input: DeltaReader into a target"


# --- a small chain whose objects get mutated --------------------------------------------------


def _states() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(40)
    state = {
        "model.embed.weight": torch.randn(24, 16, generator=gen).bfloat16(),
        "model.layers.0.q.weight": torch.randn(16, 16, generator=gen).half(),
        "model.norm.weight": torch.randn(16, generator=gen),
        "model.step": torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64),
    }
    states = [snapshot(state)]
    for _ in range(3):
        for index, name in enumerate(sorted(state)):
            flip_bits(state[name], gen, 2 + 5 * index)
        states.append(snapshot(state))
    return states


def _featured_states() -> list[dict[str, torch.Tensor]]:
    """Steps that a writer with every feature codes in every coding (checked by the
    fixture): bfloat16 weights stepped as fp32 masters (``classed`` positions, ``ulp-shift``
    values), float16 weights moved by one ulp (``ulp``), counters (``rans``)."""
    gen = torch.Generator().manual_seed(41)
    masters = {
        "model.embed.weight": torch.randn(96, 64, generator=gen) * 0.02,
        "model.layers.0.q.weight": torch.randn(64, 64, generator=gen) * 0.02,
        "model.norm.weight": 1 + torch.randn(64, generator=gen) * 0.01,
    }
    half = (torch.randn(4096, generator=gen) * 0.02).half()
    counts = torch.randint(0, 1000, (2048,), generator=gen, dtype=torch.int32)
    states = []
    for step in range(4):
        if step:
            for master in masters.values():
                master.add_(torch.randn(master.shape, generator=gen) * 1e-5)
            moved = torch.rand(4096, generator=gen) < 0.05
            steps = torch.where(torch.rand(4096, generator=gen) < 0.5, 1, -1).to(torch.int16)
            half.view(torch.int16)[moved] += steps[moved]
            counts[torch.rand(2048, generator=gen) < 0.1] += 1
        state = {name: master.to(torch.bfloat16) for name, master in masters.items()}
        state["model.layers.0.k.weight"] = half.clone()
        state["model.counts"] = counts.clone()
        state["model.step"] = torch.tensor([3, 1, 4, 1, step], dtype=torch.int64)
        states.append(state)
    return states


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass
class Chain4:
    """Versions 0..3 in a local store; the fuzzer mutates the objects of version 3."""

    url: str
    states: list[dict[str, torch.Tensor]]
    chain_id: str
    pristine: str = ""  # a copy as published: a clean source for set-up syncs
    compressed: bool = False  # manifests are zstd frames of their JSON (manifest-zstd)

    def manifest(self, key: str) -> dict:
        """The JSON of a manifest, compressed or not."""
        raw = self.read(key)
        return json.loads(
            zstandard.ZstdDecompressor().decompress(raw) if raw[:4] == _ZSTD_MAGIC else raw
        )

    def pack_manifest(self, manifest: dict) -> bytes:
        """A manifest's bytes as this chain stores them."""
        raw = _dump(manifest)
        if not self.compressed:
            return raw
        return zstandard.ZstdCompressor(write_content_size=True).compress(raw)

    @property
    def root(self) -> Path:
        return Path(self.url)

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def record_key(self, version: int = 3) -> str:
        return f"commits/{version:020d}.json"

    def record(self, version: int = 3) -> dict:
        return json.loads(self.read(self.record_key(version)))

    def manifest_keys(self, version: int = 3) -> list[str]:
        return [ref["path"] for ref in self.record(version)["manifests"]]

    def shard_refs(self, version: int = 3) -> list[tuple[str, dict]]:
        """(manifest key, shard ref) of every shard of the version."""
        return [
            (key, ref)
            for key in self.manifest_keys(version)
            for ref in self.manifest(key)["shards"]
        ]


def _dump(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Chain4:
    url = str(tmp_path_factory.mktemp("fuzz") / "store")
    states = _states()
    writer = DeltaWriter(  # the plain codings and JSON manifests (featured_chain: all six)
        url, shard_bytes=64, ops={"model.layers.0.q.weight": "overwrite"}, features=()
    )
    for state in states:
        writer.publish(state)
    pristine = str(Path(url).with_name("pristine"))
    shutil.copytree(url, pristine)
    return Chain4(url, states, writer.chain.header.chain_id, pristine)


FEATURES = (
    "values-rans",
    "values-ulp",
    "values-ulp-shift",
    "positions-classed",
    "manifest-zstd",
    "implicit-parents",
)


@pytest.fixture(scope="module")
def featured_chain(tmp_path_factory) -> Chain4:
    """:func:`chain` written with every feature: version 3 uses each of them."""
    url = str(tmp_path_factory.mktemp("fuzz-featured") / "store")
    states = _featured_states()
    writer = DeltaWriter(url, shard_bytes=64, features=FEATURES)
    for state in states:
        writer.publish(state)
    pristine = str(Path(url).with_name("pristine"))
    shutil.copytree(url, pristine)
    chain = Chain4(url, states, writer.chain.header.chain_id, pristine, compressed=True)
    used = {f for key in chain.manifest_keys() for f in chain.manifest(key)["required_features"]}
    assert used == set(FEATURES), used  # the fuzzer reaches every feature's decoding
    assert all(chain.read(key)[:4] == _ZSTD_MAGIC for key in chain.manifest_keys())
    return chain


@contextlib.contextmanager
def replaced(chain: Chain4, objects: dict[str, bytes | None]):
    """Objects written (None: deleted) for the ``with`` block, restored afterwards."""
    saved = {}
    for key in objects:
        path = chain.root / key
        saved[key] = path.read_bytes() if path.is_file() or path.is_symlink() else None
    try:
        for key, data in objects.items():
            path = chain.root / key
            if path.is_symlink() or path.exists():
                path.unlink()
            if data is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        yield
    finally:
        for key, data in saved.items():
            path = chain.root / key
            if path.is_symlink() or path.exists():
                path.unlink()
            if data is not None:
                path.write_bytes(data)


def resigned(
    chain: Chain4,
    *,
    shards: dict[str, bytes] | None = None,
    decoded: dict[str, int] | None = None,
    manifests: dict[str, bytes] | None = None,
) -> dict[str, bytes]:
    """New objects of version 3: ``shards`` replaced and their refs re-signed in their
    manifests (``decoded``: declared decoded sizes), ``manifests`` replaced (or re-signed
    to the new shards), and the commit record re-signed to the manifests."""
    shards, decoded, manifests = shards or {}, decoded or {}, dict(manifests or {})
    out: dict[str, bytes] = dict(shards)
    for key in chain.manifest_keys():
        if key in manifests:
            continue
        manifest = chain.manifest(key)
        touched = False
        for ref in manifest["shards"]:
            if ref["path"] in shards:
                data = shards[ref["path"]]
                ref.update(sha256=sha256_hex(data), size=len(data))
                touched = True
            if ref["path"] in decoded:
                ref["decoded_size"] = decoded[ref["path"]]
                touched = True
        if touched:
            manifests[key] = chain.pack_manifest(manifest)
    record = chain.record()
    for ref in record["manifests"]:
        if ref["path"] in manifests:
            data = manifests[ref["path"]]
            ref.update(sha256=sha256_hex(data), size=len(data))
    out.update(manifests)
    out[chain.record_key()] = _dump(record)
    return out


def attempt_sync(
    chain: Chain4, *, kind: str = "dict", tmp_path: Path | None = None, **reader
) -> str:
    """Sync a target at version 2 to the newest version: the error's name, or 'exact'."""
    if kind == "dict":
        target = StateDictTarget(snapshot(chain.states[2]), version=2, chain_id=chain.chain_id)
        before = snapshot(target.tensors)
    else:
        assert tmp_path is not None
        path = tmp_path / "ckpt"
        if not path.exists():
            DeltaReader(chain.pristine, SafetensorsDirTarget(path)).sync(to=2)
        target = SafetensorsDirTarget(path)
        before = dir_snapshot(path)
    try:
        DeltaReader(chain.url, target, **reader).sync()
    except DcrError as exc:
        assert target.resident().version == 2
        if kind == "dict":
            assert_same_bits(target.tensors, before)
        else:
            assert dir_snapshot(path) == before
        return type(exc).__name__
    assert target.resident().version == 3
    if kind == "dict":
        assert_same_bits(target.tensors, chain.states[3])
    else:
        from safetensors.torch import load_file

        assert_same_bits(load_file(str(path / "model.safetensors")), chain.states[3])
    return "exact"


def _outcome(name: str) -> str:
    return "exact bits of version 3 (harmless)" if name == "exact" else f"{name}, target untouched"


# --- the fuzzer -----------------------------------------------------------------------------------

_SPECIAL_INTS = [0, -1, 1, 7, 2**31, 2**32 + 1, 2**53 + 1, 2**62, 2**62 + 1, 2**63, 2**64, 10**30]
_SPECIAL_TEXT = [
    "",
    "../../../etc/passwd",
    "/etc/passwd",
    "objects/../../x",
    "objects/00000000000000000002/" + "0" * 32 + "/shard-00000-00000.dcrs",
    "commits/00000000000000000002.json",
    "xor",
    "overwrite",
    "full",
    "bfloat16",
    "float32",
    "float16",
    "int64",
    "uint8",
    "bool",
    "rice",
    "ranges",
    "planes",
    "pieces",
    "a" * 2000,
]
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(_SPECIAL_INTS),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False),
        st.sampled_from(_SPECIAL_TEXT),
        st.text(max_size=12),
    ),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def mutate_bytes(data: st.DataObject, raw: bytes) -> bytes:
    """One random byte-level mutation (never a no-op): flip, truncate, extend, splice, zero
    or duplicate."""
    new = _mutate_bytes(data, raw)
    if new == raw:  # an empty range, or zeros over zeros: flip a bit instead
        i = data.draw(st.integers(0, len(raw) - 1))
        new = raw[:i] + bytes([raw[i] ^ 1]) + raw[i + 1 :]
    return new


def _mutate_bytes(data: st.DataObject, raw: bytes) -> bytes:
    size = len(raw)
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice", "zero", "dup"]))
    if kind == "extend" or size == 0:
        return raw + data.draw(st.binary(min_size=1, max_size=64))
    i = data.draw(st.integers(0, size - 1))
    if kind == "flip":
        bit = data.draw(st.integers(0, 7))
        return raw[:i] + bytes([raw[i] ^ (1 << bit)]) + raw[i + 1 :]
    if kind == "truncate":
        return raw[:i]
    j = data.draw(st.integers(i, min(size, i + 64)))
    if kind == "splice":
        return raw[:i] + data.draw(st.binary(max_size=16)) + raw[j:]
    if kind == "zero":
        return raw[:i] + bytes(j - i) + raw[j:]
    return raw[:j] + raw[i:j] + raw[j:]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            yield from _paths(value, (*prefix, index))


def mutate_json(data: st.DataObject, obj: dict) -> dict:
    """Set, delete or duplicate one field anywhere in a JSON object."""
    path = data.draw(st.sampled_from([p for p in _paths(obj) if p]))
    parent = obj
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    action = data.draw(st.sampled_from(["set", "set", "delete", "dup"]))
    if action == "delete":
        del parent[last]
    elif action == "dup" and isinstance(parent, list):
        parent.insert(last, json.loads(json.dumps(parent[last])))
    else:
        parent[last] = data.draw(json_values)
    return obj


TARGETS = ["record", "record-json", "manifest", "manifest-json", "shard", "shard-blob", "stream"]


def _mutation(chain: Chain4, data: st.DataObject, where: str) -> tuple[dict[str, bytes], str]:
    """The objects to write for one example, and a class name for the report."""
    if where == "record":
        key = chain.record_key()
        return {key: mutate_bytes(data, chain.read(key))}, "commit record bytes"
    if where == "record-json":
        return {chain.record_key(): _dump(mutate_json(data, chain.record()))}, "commit record field"
    if where in ("manifest", "manifest-json"):
        key = data.draw(st.sampled_from(chain.manifest_keys()))
        raw = chain.read(key)
        new = (
            mutate_bytes(data, raw)
            if where == "manifest"
            else chain.pack_manifest(mutate_json(data, chain.manifest(key)))
        )
        sign = data.draw(st.booleans())
        what = "manifest " + ("bytes" if where == "manifest" else "field")
        if not sign:
            return {key: new}, what + " (not re-signed)"
        return resigned(chain, manifests={key: new}), what + " (re-signed)"
    _, ref = data.draw(st.sampled_from(chain.shard_refs()))
    stored = chain.read(ref["path"])
    if where == "shard":
        new = mutate_bytes(data, stored)
        if not data.draw(st.booleans()):
            return {ref["path"]: new}, "shard bytes (not re-signed)"
        return resigned(chain, shards={ref["path"]: new}), "shard bytes (re-signed)"
    blob = zstandard.ZstdDecompressor().decompress(stored)
    if where == "shard-blob":
        new_blob = mutate_bytes(data, blob)
        what = "decoded shard blob (recompressed, re-signed)"
    else:
        streams = {k: bytes(v) for k, v in decode_shard(stored, decoded_size=len(blob)).items()}
        key = data.draw(st.sampled_from(sorted(streams)))
        streams[key] = _mutate_stream(data, key, streams[key])
        new_blob = pack_streams(streams)
        what = ("positions" if key.endswith(".p") else "values") + " stream (re-signed)"
    new = compress(new_blob)
    return resigned(chain, shards={ref["path"]: new}, decoded={ref["path"]: len(new_blob)}), what


def _mutate_stream(data: st.DataObject, key: str, raw: bytes) -> bytes:
    """Random bytes, or a crafted positions stream: duplicates, unsorted (wrapping gaps), out
    of range, huge gaps, wrong counts."""
    if not key.endswith(".p") or data.draw(st.booleans()):
        return mutate_bytes(data, raw)
    gaps = data.draw(st.lists(st.sampled_from([0, 1, 2, 5, 400, 2**40, 2**63 - 1]), max_size=12))
    if data.draw(st.booleans()):
        k = data.draw(st.integers(0, 8)) if max(gaps, default=0) < 4096 else 62
        return rice_stream(gaps, k)  # k keeps the unary part of every gap short
    lengths = data.draw(
        st.lists(st.sampled_from([0, 1, 3, 2**40]), min_size=len(gaps), max_size=len(gaps))
    )
    return ranges_stream(gaps, lengths)


@pytest.mark.parametrize("where", TARGETS)
@pytest.mark.parametrize("which", ["chain", "featured_chain"])
def test_fuzz_mutated_objects_are_refused_or_harmless(request, which, where, reliability):
    chain = request.getfixturevalue(which)
    outcomes: dict[tuple[str, str], int] = {}

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=FUZZ_FIXED,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        objects, what = _mutation(chain, data, where)
        with replaced(chain, objects):
            name = attempt_sync(chain)
        outcomes[(what, name)] = outcomes.get((what, name), 0) + 1

    run()
    group = "fuzz: mutated stored objects (hypothesis)"
    if which == "featured_chain":
        group = "fuzz: mutated stored objects, every codec feature (hypothesis)"
    for (what, name), count in sorted(outcomes.items()):
        reliability.record(group, what, _outcome(name), cases=count)


# --- named cases ---------------------------------------------------------------------------------


def _peak(call) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = call()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return result, peak


def _shard_of(chain: Chain4) -> dict:
    return chain.shard_refs()[0][1]


def _record_with(chain: Chain4, edit) -> dict[str, bytes]:
    record = chain.record()
    edit(record)
    return {chain.record_key(): _dump(record)}


def _manifest_with(chain: Chain4, edit) -> dict[str, bytes]:
    key = chain.manifest_keys()[0]
    manifest = json.loads(chain.read(key))
    edit(manifest)
    return resigned(chain, manifests={key: _dump(manifest)})


def _zero_frame(size: int) -> bytes:
    compressor = zstandard.ZstdCompressor(write_content_size=True).compressobj(size=size)
    chunk = bytes(1 << 20)
    return b"".join([*(compressor.compress(chunk) for _ in range(size >> 20)), compressor.flush()])


def _first_entry(manifest: dict, op: str | None = None) -> dict:
    return next(e for e in manifest["entries"] if e["changed"] and (op is None or e["op"] == op))


CASES = {
    # name: (class for the report, objects to write or a callable(chain, tmp_path), expected)
    "record truncated": (
        "sizes",
        lambda c, t: {c.record_key(): c.read(c.record_key())[:40]},
        SchemaError,
    ),
    "manifest declared over the 256 MiB limit": (
        "sizes",
        lambda c, t: _record_with(c, lambda r: r["manifests"][0].update(size=(256 << 20) + 1)),
        SchemaError,
    ),
    "manifest larger than declared": (
        "sizes",
        lambda c, t: _record_with(
            c, lambda r: r["manifests"][0].update(size=r["manifests"][0]["size"] - 1)
        ),
        ObjectTooLargeError,
    ),
    "manifest smaller than declared": (
        "sizes",
        lambda c, t: _record_with(
            c, lambda r: r["manifests"][0].update(size=r["manifests"][0]["size"] + 1)
        ),
        ChecksumMismatchError,
    ),
    "shard decoded size declared wrong (re-signed)": (
        "sizes",
        lambda c, t: resigned(c, decoded={_shard_of(c)["path"]: _shard_of(c)["decoded_size"] + 8}),
        ShardError,
    ),
    "shape overflowing 2^62 elements (re-signed)": (
        "integer overflow",
        lambda c, t: _manifest_with(c, lambda m: _first_entry(m).update(shape=[2**40, 2**40])),
        SchemaError,
    ),
    "changed count past the tensor (re-signed)": (
        "integer overflow",
        lambda c, t: _manifest_with(c, lambda m: _first_entry(m).update(changed=2**62)),
        SchemaError,
    ),
    "shard index past the manifest's shards (re-signed)": (
        "integer overflow",
        lambda c, t: _manifest_with(c, lambda m: _first_entry(m)["positions"].update(shard=2**62)),
        SchemaError,
    ),
    "shard offsets past the blob (re-signed)": (
        "integer overflow",
        lambda c, t: _blob_with(
            c,
            lambda h: next(v for k, v in h.items() if k != "__metadata__").update(
                data_offsets=[0, 2**64 + 3]
            ),
        ),
        ShardError,
    ),
    "dtype changed to another width (re-signed)": (
        "dtype/width mismatch",
        lambda c, t: _manifest_with(c, lambda m: _first_entry(m, "xor").update(dtype="float32")),
        ChainBrokenError,
    ),
    "shard path leaving the root (re-signed)": (
        "keys leaving the store root",
        lambda c, t: _manifest_with(c, lambda m: m["shards"][0].update(path="../../../etc/passwd")),
        SchemaError,
    ),
    "manifest path outside its attempt": (
        "keys leaving the store root",
        lambda c, t: _record_with(
            c,
            lambda r: r["manifests"][0].update(
                path="objects/00000000000000000002/" + r["attempt"] + "/manifest-00000.json"
            ),
        ),
        SchemaError,
    ),
}


def _blob_with(chain: Chain4, edit) -> dict[str, bytes]:
    ref = _shard_of(chain)
    blob = zstandard.ZstdDecompressor().decompress(chain.read(ref["path"]))
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    new_blob = len(text).to_bytes(8, "little") + text + blob[8 + length :]
    return resigned(
        chain, shards={ref["path"]: compress(new_blob)}, decoded={ref["path"]: len(new_blob)}
    )


@pytest.mark.parametrize("kind", ["dict", "dir"])
@pytest.mark.parametrize("case", list(CASES))
def test_named_hostile_objects(chain, case, kind, tmp_path, reliability):
    cls, make, expected = CASES[case]
    with replaced(chain, make(chain, tmp_path)):
        name = attempt_sync(chain, kind=kind, tmp_path=tmp_path)
    assert name == expected.__name__, (case, name)
    reliability.record(GROUP, f"{cls}: {case}", _outcome(name))


def test_oversized_record_is_refused_before_reading(chain, tmp_path, reliability):
    key = chain.record_key()
    saved = chain.read(key)
    (chain.root / key).unlink()
    try:
        with open(chain.root / key, "wb") as handle:
            handle.truncate((64 << 20) + 1)  # sparse: no disk used
        name, peak = _peak(lambda: attempt_sync(chain))
    finally:
        (chain.root / key).write_bytes(saved)
    assert name == "ObjectTooLargeError" and peak < 8 << 20, (name, peak)
    reliability.record(
        GROUP,
        "sizes: commit record of 64 MiB + 1 (sparse file)",
        _outcome(name) + f", peak {peak >> 10} KiB",
    )


@pytest.mark.parametrize("lying", [False, True])
def test_zstd_bombs_fail_fast_in_bounded_memory(chain, lying, reliability):
    bomb = _zero_frame(64 << 20)
    path = _shard_of(chain)["path"]
    if lying:  # the frame header claims 4 KiB over 64 MiB of blocks
        assert bomb[4] >> 6 == 2
        bomb = bomb[:6] + (4096).to_bytes(4, "little") + bomb[10:]
        declared = 4096
    else:
        declared = 64 << 20
    objects = resigned(chain, shards={path: bomb}, decoded={path: declared})
    with replaced(chain, objects):
        name, peak = _peak(lambda: attempt_sync(chain, max_shard_bytes=8 << 20))
    assert name == "ShardError" and peak < 8 << 20, (name, peak)
    what = "frame header lying (4 KiB declared)" if lying else "64 MiB declared, reader limit 8 MiB"
    reliability.record(GROUP, f"zstd bomb: {what}", _outcome(name) + f", peak {peak >> 10} KiB")


def _positions_stream(chain: Chain4) -> tuple[dict, str, int]:
    """The shard ref, stream key and changed count of version 3's largest positions stream."""
    best = None
    for manifest_key, ref in chain.shard_refs():
        manifest = json.loads(chain.read(manifest_key))
        index = manifest["shards"].index(ref)
        for entry in manifest["entries"]:
            positions = entry.get("positions")
            if positions and positions["shard"] == index:
                if best is None or entry["changed"] > best[2]:
                    best = (ref, positions["key"], entry["changed"])
    assert best is not None and best[2] >= 5
    return best


POSITION_CASES = {
    "runs adjacent (ranges, zero gap)": lambda c: ranges_stream([0, 0], [c - 2, 0]),
    "runs overlapping by wrap-around (ranges)": lambda c: ranges_stream([5, 2**64 - 1], [c - 2, 0]),
    "duplicates (rice gaps adding up to 2^64)": lambda c: rice_stream(
        [0] + [2**62 - 1] * 4 + [0] * (c - 5), 62
    ),
    "past the tensor (rice)": lambda c: rice_stream([0] * (c - 1) + [10**6], 2),
    "count differs from the entry (rice)": lambda c: rice_stream([0] * (c + 1), 2),
}


@pytest.mark.parametrize("case", list(POSITION_CASES))
def test_crafted_positions_are_refused(chain, case, reliability):
    ref, key, count = _positions_stream(chain)
    stored = chain.read(ref["path"])
    streams = {
        k: bytes(v) for k, v in decode_shard(stored, decoded_size=ref["decoded_size"]).items()
    }
    streams[key] = POSITION_CASES[case](count)
    blob = pack_streams(streams)
    objects = resigned(
        chain, shards={ref["path"]: compress(blob)}, decoded={ref["path"]: len(blob)}
    )
    with replaced(chain, objects):
        name = attempt_sync(chain)
    # a stream longer than its entry can need is refused by its size bound before decoding
    allowed = (
        ("PositionsError", "ShardError")
        if case == "past the tensor (rice)"
        else ("PositionsError",)
    )
    assert name in allowed, name
    reliability.record(GROUP, f"positions: {case} (re-signed)", _outcome(name))


def test_symlinks_in_a_local_store(chain, tmp_path, reliability):
    outside = tmp_path / "outside.dcrs"
    path = _shard_of(chain)["path"]
    outside.write_bytes(chain.read(path))
    target = chain.root / path
    saved = chain.read(path)
    cases = {}
    try:
        # a shard that is a symlink to a file outside the store (same bytes even)
        target.unlink()
        target.symlink_to(outside)
        cases["object symlinked outside the root"] = attempt_sync(chain)
        # a shard that is a symlink to another object inside the store (another version's)
        target.unlink()
        other = chain.shard_refs(2)[0][1]["path"]
        target.symlink_to(chain.root / other)
        cases["object symlinked to another version's shard"] = attempt_sync(chain)
    finally:
        target.unlink()
        target.write_bytes(saved)
    # the commits/ directory itself a symlink to a copy outside the root
    commits = chain.root / "commits"
    moved = tmp_path / "commits-elsewhere"
    shutil.copytree(commits, moved)
    shutil.rmtree(commits)
    try:
        commits.symlink_to(moved)
        cases["commits/ symlinked outside the root"] = attempt_sync(chain)
    finally:
        commits.unlink()
        shutil.copytree(moved, commits)
    assert cases == {
        "object symlinked outside the root": InvalidKeyError.__name__,
        "object symlinked to another version's shard": ChecksumMismatchError.__name__,
        "commits/ symlinked outside the root": InvalidKeyError.__name__,
    }
    for case, name in cases.items():
        reliability.record(GROUP, f"symlinks: {case}", _outcome(name))


def test_records_pointing_at_another_chains_objects(chain, tmp_path, reliability):
    other_url = str(tmp_path / "other")
    writer = DeltaWriter(other_url, shard_bytes=64, ops={"model.layers.0.q.weight": "overwrite"})
    for state in chain.states:
        writer.publish(state)  # the same bits, another chain
    other = Chain4(other_url, chain.states, writer.chain.header.chain_id)
    cases = {}
    # 1. another chain's commit record copied in
    with replaced(chain, {chain.record_key(): other.read(other.record_key())}):
        cases["another chain's record copied in"] = attempt_sync(chain)
    # 2. our record naming the other chain's attempt, whose objects are copied in
    record = chain.record()
    theirs = other.record()
    record["attempt"] = theirs["attempt"]
    record["manifests"] = theirs["manifests"]
    copied = {k: other.read(k) for k in other.manifest_keys()}
    copied.update({ref["path"]: other.read(ref["path"]) for _, ref in other.shard_refs()})
    with replaced(chain, {**copied, chain.record_key(): _dump(record)}):
        cases["our record naming another chain's attempt"] = attempt_sync(chain)
    # 3. the other chain's manifest put in place of ours, re-signed into our record
    key = chain.manifest_keys()[0]
    with replaced(chain, resigned(chain, manifests={key: other.read(other.manifest_keys()[0])})):
        cases["another chain's manifest re-signed into our record"] = attempt_sync(chain)
    assert cases == {
        "another chain's record copied in": ChainBrokenError.__name__,
        "our record naming another chain's attempt": SchemaError.__name__,
        "another chain's manifest re-signed into our record": SchemaError.__name__,
    }
    for case, name in cases.items():
        reliability.record(GROUP, f"other chain: {case}", _outcome(name))


# --- atheris: the parsers directly ----------------------------------------------------------------


def test_atheris_fuzzes_the_parsers_briefly(chain, tmp_path, reliability):
    try:
        import fuzz_targets  # imports atheris
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"atheris is missing in CI ({exc}); pip install -e '.[test]'")
        pytest.skip(f"atheris is not installed ({exc})")

    corpus = tmp_path / "corpus"
    fuzz_targets.seed_corpus(corpus, chain.url)
    script = Path(__file__).with_name("fuzz_targets.py")
    runs = int(os.environ.get("DCR_ATHERIS_RUNS", "50000"))
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            str(corpus),
            f"-runs={runs}",
            "-max_len=65536",
            "-rss_limit_mb=2048",
            "-seed=1",
            f"-artifact_prefix={tmp_path}/",  # slow or crashing inputs, not into the checkout
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    executed = _atheris_runs(done.stderr)
    assert executed >= runs // 2
    reliability.record(
        "fuzz: parsers (atheris, coverage-guided)",
        "commit record, manifest, header, shard container, positions and values decoders",
        "only DcrError raised; RSS under 2 GiB",
        cases=executed,
    )


def test_atheris_seeds_of_entries_decode_to_their_step():
    try:
        import fuzz_targets  # imports atheris
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"atheris is missing in CI ({exc}); pip install -e '.[test]'")
        pytest.skip(f"atheris is not installed ({exc})")

    seeds = fuzz_targets.baseline_seeds()
    codings = set()
    results = []
    for seed in seeds:  # each reaches the decoders whole: every coding decodes the same step
        rest = seed[1:]
        codings.add(
            (fuzz_targets.BASELINE_POSITIONS[rest[0]], fuzz_targets.BASELINE_VALUES[rest[1]])
        )
        results.append(fuzz_targets.baseline_entry(rest))
    assert {p for p, _ in codings} == {"rice", "classed"}
    assert {v for _, v in codings} == {"planes", "rans", "ulp", "ulp-shift"}
    assert all(torch.equal(r.view(torch.uint16), results[0].view(torch.uint16)) for r in results)
    assert not torch.equal(results[0].view(torch.uint16), fuzz_targets.OLD.view(torch.uint16))


def _atheris_runs(log: str) -> int:
    for line in reversed(log.splitlines()):
        if "Done " in line and " runs " in line:
            return int(line.split("Done ")[1].split()[0])
    return 0


def test_the_reference_chain_still_syncs(chain, tmp_path):
    assert attempt_sync(chain) == "exact"
    assert attempt_sync(chain, kind="dir", tmp_path=tmp_path) == "exact"
    assert Store(chain.url).list("commits/") == [chain.record_key(v) for v in range(4)]
