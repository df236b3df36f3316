"""Hostile counts: streams of a few bytes that declare any number of decoded elements.

A stream's decoded size is not bounded by its bytes (one ``rans`` symbol or one ``ranges``
run codes any count), so the reader counts what every entry decodes to against its shard
limit and its decode budget from the manifest alone, and refuses past them with
:class:`DecodeLimitError` before anything is fetched or allocated.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
import torch
import zstandard
from conftest import run_ranks
from test_hostile_memory import MiB, run_worker

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.chain import chain as chain_module
from dcr_format.chain.chain import (
    MAX_MANIFEST_BYTES,
    MAX_VERSION_MANIFEST_BYTES,
    Chain,
    ManifestAllowance,
    manifest_key,
    sha256_hex,
    state_table,
    table_fingerprint,
)
from dcr_format.errors import (
    ArgumentError,
    DecodeLimitError,
    IncompleteVersionError,
    ObjectTooLargeError,
)
from dcr_format.format.budget import DecodeBudget, decoded_bytes, default_ceiling_bytes
from dcr_format.format.schema import Manifest, parse_manifest, stored_manifest
from dcr_format.format.shard import encode_shard
from dcr_format.publish.coordinate import ThreadCoordinator
from dcr_format.store.store import open_store
from dcr_format.sync._fetch import fetch_changes
from dcr_format.sync._plan import entry_output_bytes, plan_fetch

HUGE = 1 << 40  # elements: terabytes decoded
NO_LIMIT = 1 << 62

# coding of each stream -> (op, dtype, positions coding, values coding, feature)
CODINGS = {
    "planes": ("full", "bfloat16", None, "planes", None),
    "rans": ("full", "bfloat16", None, "rans", "values-rans"),
    "ulp": ("xor", "bfloat16", "ranges", "ulp", "values-ulp"),
    "ulp-shift": ("xor", "bfloat16", "ranges", "ulp-shift", "values-ulp-shift"),
    "rice": ("xor", "int32", "rice", "planes", None),
    "ranges": ("overwrite", "int32", "ranges", "rans", "values-rans"),
    "classed": ("xor", "bfloat16", "classed", "rans", "values-rans"),
}
FEATURE_OF_POSITIONS = {"classed": "positions-classed"}


def _manifest(coding: str, count: int) -> tuple[Manifest, bytes]:
    """A manifest of one entry of ``count`` changed elements whose streams are 16 bytes each,
    and its shard."""
    op, dtype, positions, values, feature = CODINGS[coding]
    streams = {"0.v": bytes(range(16))}
    if positions is not None:
        streams["0.p"] = bytes(range(16, 32))
    stored, decoded = encode_shard(streams)
    features = sorted({f for f in (feature, FEATURE_OF_POSITIONS.get(positions or "")) if f})
    entry = {
        "name": "w",
        "dtype": dtype,
        "shape": [count],
        "op": op,
        "changed": count,
        "values": {"shard": 0, "key": "0.v", "coding": values},
        "fingerprint": "0" * 32,
    }
    if positions is not None:
        entry["positions"] = {"shard": 0, "key": "0.p", "coding": positions}
        entry["parent_fingerprint"] = "1" * 32
    data = {
        "format_version": 1,
        "required_features": features,
        "chain_id": "c" * 32,
        "version": 1,
        "kind": "delta",
        "attempt": "a" * 32,
        "rank": 0,
        "world_size": 1,
        "shards": [
            {
                "path": f"objects/00000000000000000001/{'a' * 32}/shard-00000-00000.dcrs",
                "sha256": sha256_hex(stored),
                "size": len(stored),
                "decoded_size": decoded,
            }
        ],
        "entries": [entry],
    }
    return Manifest.model_validate_json(json.dumps(data), strict=True), stored


@pytest.mark.parametrize("coding", sorted(CODINGS))
def test_a_tiny_stream_declaring_a_huge_count_is_refused_before_allocating(tmp_path, coding):
    """Every coding: the plan counts what the entry decodes to; past the shard limit or the
    budget's ceiling it is refused by name, with no allocation near the declared size."""
    manifest, shard = _manifest(coding, HUGE)
    store = open_store(str(tmp_path / "store"))
    store.put(manifest.shards[0].path, shard)
    entry = manifest.entries[0]
    assert entry_output_bytes(entry) >= 2 * HUGE
    wants = lambda name, dtype, shape: True  # noqa: E731
    tracemalloc.start()
    try:
        with pytest.raises(DecodeLimitError, match="shard limit"):
            plan_fetch([manifest], wants=wants, max_shard_bytes=16 << 30)
        plan = plan_fetch([manifest], wants=wants, max_shard_bytes=NO_LIMIT)
        budget = DecodeBudget(MiB, ceiling=64 * MiB)
        with pytest.raises(DecodeLimitError, match="decode ceiling"):
            fetch_changes(store, plan, map, budget)
        assert budget.in_use == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MiB, peak


def test_a_count_within_the_limits_still_decodes(tmp_path):
    """The same checks let an honest version through: a real publish and sync under a ceiling
    just above what it decodes (its entries, and the inflated shard a job holds with them)."""
    url = str(tmp_path / "store")
    state = {"w": torch.randn(4096).bfloat16(), "b": torch.arange(300, dtype=torch.int32)}
    DeltaWriter(url).publish(state)
    needed = decoded_bytes(4096, 2, positions=False) + decoded_bytes(300, 4, positions=False)
    target = StateDictTarget({})
    reader = DeltaReader(
        url,
        target,
        decode_budget=DecodeBudget(8, ceiling=needed + 64 * 1024),
        max_shard_bytes=needed + 64 * 1024,
    )
    reader.sync()
    assert torch.equal(target.tensors["w"].view(torch.int16), state["w"].view(torch.int16))
    budget = DecodeBudget(8, ceiling=needed - 1)
    refused = DeltaReader(url, StateDictTarget({}), decode_budget=budget)
    with pytest.raises(DecodeLimitError):
        refused.sync()


def test_budget_ceiling_defaults_and_checks():
    assert DecodeBudget().ceiling == max(DecodeBudget().limit, default_ceiling_bytes())
    with pytest.raises(ArgumentError):
        DecodeBudget(100, ceiling=99)
    budget = DecodeBudget(10, ceiling=100)
    with budget.hold(100):
        assert budget.in_use == 100
    with pytest.raises(DecodeLimitError):
        budget.acquire(101)
    assert budget.in_use == 0


def _hostile_base(tmp_path: Path, count: int) -> str:
    """A store whose base holds one tensor of ``count`` elements coded ``rans`` in 16 bytes:
    a valid chain (record, manifest and shard hashes, state fingerprint all match)."""
    url = str(tmp_path / "store")
    DeltaWriter(url).publish({"w": torch.ones(8).bfloat16()})
    root = Path(url)
    record_path = root / "commits" / f"{0:020d}.json"
    record = json.loads(record_path.read_bytes())
    ref = record["manifests"][0]
    manifest = parse_manifest((root / ref["path"]).read_bytes(), what="manifest").model_dump(
        mode="json", exclude_none=True
    )
    stored, decoded = encode_shard({"0.v": bytes(16)})
    shard = manifest["shards"][0]
    (root / shard["path"]).write_bytes(stored)
    shard.update(sha256=sha256_hex(stored), size=len(stored), decoded_size=decoded)
    manifest["required_features"] = sorted({*manifest["required_features"], "values-rans"})
    entry = manifest["entries"][0]
    entry.update(shape=[count], changed=count, encoded_bytes=16)
    entry["values"].update(key="0.v", coding="rans")
    parsed = Manifest.model_validate_json(json.dumps(manifest), strict=True)
    data = stored_manifest(parsed)
    (root / ref["path"]).write_bytes(data)
    ref.update(sha256=sha256_hex(data), size=len(data))
    record["state_fingerprint"] = table_fingerprint(state_table([parsed]))
    record_path.write_bytes(json.dumps(record).encode())
    return url


@pytest.mark.multiprocess
def test_a_hostile_base_is_refused_by_a_fresh_reader_in_bounded_memory(tmp_path):
    """End to end, with the reader's default limits: a base of one 2 TiB tensor coded in
    16 bytes is refused by name before anything is fetched, in a few MiB."""
    url = _hostile_base(tmp_path, HUGE)
    with pytest.raises(DecodeLimitError):
        DeltaReader(url, StateDictTarget({})).sync()
    result = run_worker("sync", url)
    # before: np.empty of the declared count, a bare MemoryError (or terabytes where allowed)
    assert result["error"] == "DecodeLimitError", result
    assert result["peak"] < 32 * MiB, result


# --- what one version's manifests add up to -------------------------------------------------


def _inflating_version(tmp_path: Path, ranks: int, padding: int) -> str:
    """A store whose version 0 has ``ranks`` manifests, each a zstd frame of a few KiB that
    inflates to ``padding`` bytes of valid JSON (whitespace after an empty manifest)."""
    url = str(tmp_path / "store")
    DeltaWriter(url).publish({"w": torch.ones(8).bfloat16()})
    root = Path(url)
    record_path = root / "commits" / f"{0:020d}.json"
    record = json.loads(record_path.read_bytes())
    refs = []
    for rank in range(ranks):
        text = json.dumps(
            {
                "format_version": 1,
                "required_features": ["manifest-zstd"],
                "chain_id": record["chain_id"],
                "version": 0,
                "kind": "base",
                "attempt": record["attempt"],
                "rank": rank,
                "world_size": ranks,
                "shards": [],
                "entries": [],
            }
        ).encode()
        chunk = b" " * MiB
        compressor = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(
            size=len(text) + padding
        )
        frame = b"".join(
            [
                compressor.compress(text),
                *(compressor.compress(chunk) for _ in range(padding // MiB)),
                compressor.flush(),
            ]
        )
        path = manifest_key(0, record["attempt"], rank)
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(frame)
        refs.append({"rank": rank, "path": path, "sha256": sha256_hex(frame), "size": len(frame)})
    record.update(world_size=ranks, manifests=refs)
    record_path.write_bytes(json.dumps(record).encode())
    return url


@pytest.mark.multiprocess
def test_manifests_that_inflate_past_the_version_limit_are_refused_as_they_are_read(tmp_path):
    """4 ranks of 60 MiB manifests stored in a few KiB each: refused once what they
    inflate to passes the version's limit, before the rest are inflated or parsed."""
    url = _inflating_version(tmp_path, 4, 60 * MiB)
    with pytest.raises(ObjectTooLargeError, match="limit of one version"):
        Chain(open_store(url)).manifests(Chain(open_store(url)).record(0))
    result = run_worker("sync", url)
    # before: every manifest inflated and parsed (4 x 60 MiB), then refused for its content
    assert result["error"] == "ObjectTooLargeError", result
    assert result["peak"] < 2 * MAX_VERSION_MANIFEST_BYTES, result


def test_the_version_limit_counts_stored_sizes_before_fetching(tmp_path):
    url = _inflating_version(tmp_path, 3, MiB)
    chain = Chain(open_store(url))
    loaded = chain.record(0)
    assert len(chain.manifests(loaded)) == 3  # within the limit: read as before
    refs = [ref.model_copy(update={"size": MAX_MANIFEST_BYTES}) for ref in loaded.record.manifests]
    with pytest.raises(ObjectTooLargeError, match="as stored"):
        ManifestAllowance("version 0", refs)


def test_the_committer_and_readers_hold_a_version_to_the_limit(tmp_path, monkeypatch):
    """A version whose ranks' manifests add up past the limit is not committed (the committer
    refuses what readers would), and a reader refuses such a version as it reads it."""
    world = 2
    state = {f"layers.{i}.weight": torch.full((4,), float(i)) for i in range(12)}
    url = str(tmp_path / "store")

    def writers() -> list[DeltaWriter]:
        coordinator = ThreadCoordinator(world, timeout=30)
        return [
            DeltaWriter(url, rank=r, world_size=world, coordinator=coordinator, commit_timeout=5)
            for r in range(world)
        ]

    monkeypatch.setattr(chain_module, "MAX_VERSION_MANIFEST_BYTES", 3000)
    ranks = writers()
    _, errors = run_ranks(world, lambda r: ranks[r].publish(state))
    assert isinstance(errors[0], ObjectTooLargeError), errors
    assert isinstance(errors[1], IncompleteVersionError), errors
    assert Chain(open_store(url)).versions() == []
    monkeypatch.undo()
    ranks = writers()
    _, errors = run_ranks(world, lambda r: ranks[r].publish(state))
    assert errors == [None, None]
    monkeypatch.setattr(chain_module, "MAX_VERSION_MANIFEST_BYTES", 3000)
    with pytest.raises(ObjectTooLargeError, match="limit of one version"):
        DeltaReader(url, StateDictTarget({})).sync()
    monkeypatch.undo()
    DeltaReader(url, StateDictTarget({})).sync()
