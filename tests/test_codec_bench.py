"""Smoke test of benchmarks/codec_bench.py: the quick run works and its JSON is complete."""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Any

import pytest

pytestmark = pytest.mark.bench


def _load_bench():
    import codec_bench  # benchmarks/ is on sys.path (conftest.py)

    return codec_bench


@pytest.fixture(scope="module")
def quick_result() -> dict:
    bench = _load_bench()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--quick", "--json"]) == 0
    return json.loads(out.getvalue())


def test_quick_json_structure(quick_result: dict) -> None:
    bench = _load_bench()
    assert quick_result["size"] == "tiny"
    assert quick_result["params"] > 0
    rows = quick_result["rows"]
    assert len(rows) == 2 * len(bench.TARGETS)
    for row in rows:
        for _, key, _ in bench.COLUMNS:
            assert key in row, key
        assert 0 < row["changed"] <= row["total_elements"]
        assert 0 < row["rate"] < 1
        assert row["xor_bytes"] > 0 and row["bound_bytes"] > 0
        assert all(math.isfinite(row[k]) for k in ("vs_bound", "vs_dense", "xor_vs_overwrite"))
        assert row["encode_s"] > 0 and row["decode_apply_s"] > 0 and row["clone_s"] > 0
    assert set(quick_result["goal"]) >= {"vs_bound", "vs_bound_ok", "xor_saving", "xor_saving_ok"}


def test_quick_xor_smaller_than_overwrite(quick_result: dict) -> None:
    for row in quick_result["rows"]:
        assert row["xor_bytes"] < row["overwrite_bytes"]
        assert row["vs_dense"] < 0.2


def test_table_renders(quick_result: dict) -> None:
    table = _load_bench().format_table(quick_result)
    assert "vs bound" in table and "xor/ovw" in table
    assert len(table.splitlines()) > len(quick_result["rows"]) + 2


def _two_versions(*, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Three bf16 tensors and the same with 200 elements of each scaled by 1.01."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    old = {f"layers.{i}.w": torch.randn(64, 64, generator=gen).bfloat16() for i in range(3)}
    new = {name: t.clone() for name, t in old.items()}
    for t in new.values():
        flat = t.view(-1)
        where = torch.randint(0, flat.numel(), (200,), generator=gen)
        flat[where] = (flat[where].float() * 1.01).bfloat16()
    return old, new


def test_manifest_bytes_is_the_length_of_the_manifest_a_writer_uploads() -> None:
    from codec_bench import _encode_all, _shard_streams
    from codec_bounds import manifest_bytes

    from dcr_format import DeltaWriter, Store
    from dcr_format.chain.chain import Chain
    from dcr_format.format.shard import encode_shard

    old, new = _two_versions(seed=0)
    store = Store("memory://codec-bench-manifest-bytes")
    writer = DeltaWriter(store, features=())  # the plain codings the benchmark codes here
    writer.publish(old)
    writer.publish(new)
    (uploaded,) = Chain(store).record(1).record.manifests  # one rank, one shard
    encoded = _encode_all(old, new, "xor")
    stored, decoded = encode_shard(_shard_streams(encoded))
    assert manifest_bytes(encoded, new, stored=len(stored), decoded=decoded) == uploaded.size


@pytest.mark.parametrize(
    "features", [(), ("values-rans", "manifest-zstd", "implicit-parents")], ids=["plain", "rans"]
)
def test_commit_record_bytes_is_the_length_of_the_record_a_writer_commits(
    features: tuple[str, ...],
) -> None:
    from codec_bench import _encode_all, _shard_streams
    from codec_bounds import commit_record_bytes

    from dcr_format import DeltaWriter, Store
    from dcr_format.chain.chain import Chain, commit_key
    from dcr_format.format.shard import encode_shard

    old, new = _two_versions(seed=1)
    store = Store(f"memory://codec-bench-record-bytes-{len(features)}")
    writer = DeltaWriter(store, features=features)
    writer.publish(old, step=0)
    writer.publish(new, step=1)
    committed = len(store.get(commit_key(1)))
    record = Chain(store).record(1).record
    encoded = _encode_all(old, new, "xor", features[:1])
    stored, _ = encode_shard(_shard_streams(encoded))
    compressed = bool(features)
    uploaded = record.manifests[0].size  # its compressed size varies with the random ids
    got = commit_record_bytes(
        encoded, new, stored=len(stored), manifest=uploaded, compressed=compressed
    )
    assert got == committed
