"""Memory bombs from hostile stores: JSON amplification and zstd shards, with measured bounds.

Each hostile input runs in a fresh subprocess (tests/memory_workers.py) that reports the
peak resident memory the call added, so the native allocations of zstd and pydantic-core
count (tracemalloc sees neither). The bounds are the ones docs/reliability.md states.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from conftest import flip_bits, snapshot
from memory_workers import JSON_CASES
from test_codec_hostile import rice_stream
from test_fuzz import Chain4, attempt_sync, replaced, resigned

from dcr_format import DeltaWriter
from dcr_format.codings.positions import encode_ranges, encode_rice
from dcr_format.codings.registry import positions_bound
from dcr_format.errors import SchemaError, ShardError
from dcr_format.format import jsonscan
from dcr_format.format.budget import DecodeBudget, default_budget_bytes
from dcr_format.format.jsonscan import scan
from dcr_format.format.schema import CommitRecord, Manifest, parse
from dcr_format.format.shard import (
    MAX_UNREFERENCED_BYTES,
    decode_shard,
    encode_shard,
    header_allowance,
    pack_streams,
    shard_decoded_bound,
)
from dcr_format.sync._plan import stream_limits

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("memory_workers.py")
MiB = 1 << 20


def run_worker(*args: str, timeout: float = 120) -> dict:
    """One case in a fresh interpreter; its JSON report."""
    done = subprocess.run(
        [sys.executable, str(WORKER), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- JSON amplification ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def json_costs() -> dict[str, dict]:
    """Every hostile case of 1 MiB, measured one after another in one fresh interpreter."""
    return run_worker("json", "all", str(MiB))


@pytest.mark.parametrize("case", JSON_CASES)
def test_refusing_a_hostile_1mib_record_is_cheap(case, json_costs):
    # before: up to 1.7 GiB and 12 s ("flat empty objects"), every error kept with its input
    result = json_costs[case]
    assert result["error"] == "SchemaError", result
    assert result["peak"] < 32 * MiB, result
    assert result["seconds"] < 1.0, result
    assert result["message_len"] < 500 and not result["context"], result


def test_a_valid_manifest_still_parses_at_the_writers_size():
    result = run_worker("manifest", str(4 * MiB))
    assert result["error"] is None, result
    # the parsed models themselves take most of it (~10x the JSON)
    assert result["peak"] < 16 * 4 * MiB, result


def test_schema_error_keeps_nothing_of_the_input():
    data = json.dumps(
        {"format_version": 1, "manifests": [{"junk": "x" * 1000}] * 50, "chain_id": 7}
    ).encode()
    with pytest.raises(SchemaError) as caught:
        parse(CommitRecord, data, what="commits/x.json")
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    assert len(str(caught.value)) < 300 and "xxxx" not in str(caught.value)


def test_kind_limits_and_max_bytes():
    record = b'{"format_version":1}'
    with pytest.raises(SchemaError, match="byte limit"):
        parse(CommitRecord, record + b" " * MiB, what="r")
    with pytest.raises(SchemaError, match="byte limit"):
        parse(Manifest, record, what="m", max_bytes=8)


@pytest.mark.parametrize(
    ("data", "refused"),
    [
        (b'{"a":"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', False),  # in a string
        (b'{"a":"\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\\\"}', False),
        (b'{"a":"\\\\"' + b"[" * 40 + b"]" * 40 + b"}", True),  # escaped backslash: real
        (b'{"a":' + b"[" * 16 + b"1" + b"]" * 16 + b"}", True),  # 17 levels
        (b'{"a":' + b"[" * 15 + b"1" + b"]" * 15 + b"}", False),  # 16 levels
        (b'{"a":[}', True),
        (b"[" + b"[]," * 1000 + b"[]]", True),
        (b"[" + b"1," * 1000 + b"1]", True),
        (b"[" + b'"abc",' * 1000 + b"1]", False),
    ],
)
def test_scan(data, refused):
    assert (scan(data) is not None) == refused


def test_both_ways_of_finding_what_is_outside_strings_agree():
    rng = np.random.default_rng(0)
    cases = [b"", b'"', b'""', b'"abc', b'[1,"a"', b'{"a":"b"}x"y', b'"' * 1001]
    cases += [bytes(rng.choice(list(b'"[]{},:'), size=n).tolist()) for n in (1, 7, 100, 5000)]
    for chars in cases:
        assert jsonscan._outside_by_split(chars) == jsonscan._outside_by_parity(chars), chars
    # on each side of the size where the scan changes from one to the other
    record = json.dumps({"a": ["x]{", 1] * 3000}).encode()
    for size in (jsonscan._SPLIT_UP_TO - 1, jsonscan._SPLIT_UP_TO + 1):
        data = record[:size]
        assert jsonscan._skeleton(data) == jsonscan._STRING.sub(b"", data).translate(
            None, jsonscan._NOT_STRUCTURE
        )


def test_scan_is_linear_on_unterminated_strings():
    data = b'{"a":"' + b'\\"' * (4 * MiB)
    started = time.perf_counter()
    scan(data)
    assert time.perf_counter() - started < 2.0


# --- shard bounds ---------------------------------------------------------------------------


def _shape_rice_streams(numel: int, count: int, rng: np.random.Generator) -> list[bytes]:
    positions = np.sort(rng.choice(numel, size=count, replace=False)).astype(np.int64)
    gaps = np.diff(positions, prepend=-1) - 1
    streams = [encode_rice(positions), encode_ranges(positions)]
    streams += [rice_stream(gaps.tolist(), k) for k in (0, 1, 7, 30, 62)]
    return streams


@pytest.mark.parametrize(("numel", "count"), [(1, 1), (64, 1), (64, 64), (5000, 7), (4096, 4000)])
def test_positions_bound_holds_for_every_k(numel, count):
    rng = np.random.default_rng(numel + count)
    for _ in range(5):
        for index, stream in enumerate(_shape_rice_streams(numel, count, rng)):
            coding = "ranges" if index == 1 else "rice"
            assert len(stream) <= positions_bound(coding, count, numel), (index, len(stream))


def _manifest_for(streams: dict[str, bytes], entries: list[dict]) -> Manifest:
    stored, decoded = encode_shard(streams)
    data = {
        "format_version": 1,
        "chain_id": "c" * 32,
        "version": 1,
        "kind": "delta",
        "attempt": "a" * 32,
        "rank": 0,
        "world_size": 1,
        "shards": [{"path": "s", "sha256": "0" * 64, "size": len(stored), "decoded_size": decoded}],
        "entries": entries,
    }
    return Manifest.model_validate_json(json.dumps(data), strict=True)


def _entry(name: str, changed: int, numel: int, coding: str = "ranges") -> dict:
    return {
        "name": name,
        "dtype": "bfloat16",
        "shape": [numel],
        "op": "xor",
        "changed": changed,
        "positions": {"shard": 0, "key": f"{name}.p", "coding": coding},
        "values": {"shard": 0, "key": f"{name}.v", "coding": "planes"},
        "fingerprint": "0" * 32,
        "parent_fingerprint": "1" * 32,
    }


def test_stream_limits_from_entries():
    positions = np.array([1, 5, 6], dtype=np.int64)
    streams = {"a.p": encode_ranges(positions), "a.v": bytes(6)}
    manifest = _manifest_for(streams, [_entry("a", 3, 100)])
    limits = stream_limits(manifest)
    assert limits == {0: {"a.p": positions_bound("ranges", 3, 100), "a.v": 6}}
    stored, decoded = encode_shard(streams)
    assert decoded <= shard_decoded_bound(limits[0])
    assert set(decode_shard(stored, decoded_size=decoded, limits=limits[0])) == {"a.p", "a.v"}
    assert header_allowance(["a.p", "a.v"]) >= len(pack_streams(streams)) - 6 - len(streams["a.p"])


def _bomb_frame(streams: dict[str, bytes], junk: int, *, key: str = "~junk") -> tuple[bytes, int]:
    """A shard with a valid header: ``streams`` and an extra stream of ``junk`` zero bytes,
    compressed in chunks (the test never holds ``junk`` bytes)."""
    header = pack_streams({**streams, key: b""})
    prefix_len = int.from_bytes(header[:8], "little") + 8
    text = json.loads(header[8:prefix_len])
    begin = text[key]["data_offsets"][0]
    text[key] = {"dtype": "U8", "shape": [junk], "data_offsets": [begin, begin + junk]}
    if key < max(streams):  # keep the layout: the junk stream last
        raise AssertionError("junk key must sort last")
    raw = json.dumps(text, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    body = len(raw).to_bytes(8, "little") + raw + header[prefix_len:]
    size = len(body) + junk
    compressor = zstandard.ZstdCompressor(write_content_size=True).compressobj(size=size)
    parts = [compressor.compress(body)]
    chunk = bytes(MiB)
    for _ in range(junk // MiB):
        parts.append(compressor.compress(chunk))
    parts.append(compressor.compress(bytes(junk % MiB)))
    parts.append(compressor.flush())
    return b"".join(parts), size


def test_decode_shard_refuses_a_declared_size_its_entries_cannot_need():
    streams = {"a.p": encode_ranges(np.array([1, 5, 6], dtype=np.int64)), "a.v": bytes(6)}
    limits = stream_limits(_manifest_for(streams, [_entry("a", 3, 100)]))[0]
    stored, size = _bomb_frame(streams, 256 * MiB)
    started = time.perf_counter()
    with pytest.raises(ShardError, match="entries need at most"):
        decode_shard(stored, decoded_size=size, limits=limits)
    assert time.perf_counter() - started < 0.1  # nothing inflated (256 MiB takes longer)
    # within the bound the junk stream is allowed (FORMAT.md §4.3 rule 4) and ignored
    stored, size = _bomb_frame(streams, MAX_UNREFERENCED_BYTES // 2)
    assert set(decode_shard(stored, decoded_size=size, limits=limits)) >= {"a.p", "a.v"}


def test_decode_shard_refuses_a_named_stream_over_its_bound_after_the_header_only():
    # a 200 MiB values stream where the entry needs 6 bytes, in a shard whose declared size
    # fits the bounds of all its entries together (another entry may need 200 MiB)
    streams = {"a.p": encode_ranges(np.array([1, 5, 6], dtype=np.int64))}
    stored, size = _bomb_frame(streams, 200 * MiB, key="a.v")
    limits = {"a.p": 200 * MiB, "a.v": 6}
    assert size <= shard_decoded_bound(limits)
    started = time.perf_counter()
    with pytest.raises(ShardError, match="more than the 6"):
        decode_shard(stored, decoded_size=size, limits=limits)
    with pytest.raises(ShardError, match="lacks stream"):
        decode_shard(stored, decoded_size=size, limits={**limits, "a.v": 200 * MiB, "b.v": 1})
    assert time.perf_counter() - started < 0.2  # the header alone was inflated


def test_a_zero_bomb_is_refused_after_reading_its_header_only():
    size = 1 << 30
    compressor = zstandard.ZstdCompressor(write_content_size=True).compressobj(size=size)
    chunk = bytes(MiB)
    bomb = b"".join([*(compressor.compress(chunk) for _ in range(size // MiB)), compressor.flush()])
    started = time.perf_counter()
    with pytest.raises(ShardError, match="header"):
        decode_shard(bomb, decoded_size=size)  # no limits: the header-first check alone
    assert time.perf_counter() - started < 0.2  # inflating 1 GiB takes seconds


def test_shard_errors_keep_nothing_of_the_header():
    blob = (8).to_bytes(8, "little") + b"nonsense"
    with pytest.raises(ShardError, match="not JSON") as caught:
        decode_shard(zstandard.ZstdCompressor().compress(blob), decoded_size=len(blob))
    assert caught.value.__context__ is None and caught.value.__cause__ is None


# --- the budget -----------------------------------------------------------------------------


def test_budget_caps_parallel_holders_and_lets_an_oversized_one_through_alone():
    budget = DecodeBudget(100)
    seen: list[int] = []
    lock = threading.Lock()

    def work(nbytes: int) -> None:
        with budget.hold(nbytes):
            with lock:
                seen.append(budget.in_use)
            time.sleep(0.01)

    threads = [threading.Thread(target=work, args=(n,)) for n in [40, 40, 40, 150, 30, 60] * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads)
    assert budget.in_use == 0
    assert max(seen) <= 150 and all(v <= 100 or v == 150 for v in seen), seen
    assert budget.peak <= 150


def test_budget_serves_in_order_and_times_out():
    budget = DecodeBudget(10)
    budget.acquire(8)
    assert not budget.acquire(5, timeout=0.05)  # does not fit; gives up
    order: list[str] = []
    big = threading.Thread(target=lambda: (budget.acquire(10), order.append("big")))
    big.start()
    time.sleep(0.05)
    small = threading.Thread(target=lambda: (budget.acquire(1), order.append("small")))
    small.start()
    time.sleep(0.05)
    assert order == []  # the small one fits, but waits behind the big one
    budget.release(8)
    big.join(5)
    budget.release(10)
    small.join(5)
    assert order == ["big", "small"]
    with pytest.raises(ValueError):
        budget.release(5)
    with pytest.raises(ValueError):
        DecodeBudget(0)
    assert 256 << 20 <= default_budget_bytes() <= 2 << 30


# --- end to end: a hostile store through DeltaReader --------------------------------------------


def _chain(tmp_path: Path, tensors: int = 8) -> Chain4:
    """Versions 0..3 with ``tensors`` tensors and one shard per entry (tiny shards)."""
    gen = torch.Generator().manual_seed(13)
    state = {
        f"model.layers.{i}.w": torch.randn(64, generator=gen).bfloat16() for i in range(tensors)
    }
    states = [snapshot(state)]
    for _ in range(3):
        for name in sorted(state):
            flip_bits(state[name], gen, 5)
        states.append(snapshot(state))
    url = str(tmp_path / "store")
    writer = DeltaWriter(url, shard_bytes=1, features=())  # plain JSON manifests: resigned()
    for one in states:
        writer.publish(one)
    return Chain4(url, states, writer.chain.header.chain_id)


def test_eight_zero_bombs_of_1_gib_are_refused_in_bounded_memory(tmp_path):
    chain = _chain(tmp_path)
    refs = chain.shard_refs()
    assert len(refs) >= 8
    size = 1 << 30
    compressor = zstandard.ZstdCompressor(write_content_size=True).compressobj(size=size)
    chunk = bytes(MiB)
    bomb = b"".join([*(compressor.compress(chunk) for _ in range(size // MiB)), compressor.flush()])
    assert len(bomb) < 64 << 10
    paths = [ref["path"] for _, ref in refs[:8]]
    objects = resigned(chain, shards=dict.fromkeys(paths, bomb), decoded=dict.fromkeys(paths, size))
    with replaced(chain, objects):
        assert attempt_sync(chain) == "ShardError"
        result = run_worker("sync", chain.url)
    # before: 8 shards inflated in parallel, 4.4 GiB before the header check
    assert result["error"] == "ShardError", result
    assert result["peak"] < 64 * MiB and result["seconds"] < 5, result


def test_bombs_with_valid_headers_are_refused_before_inflating(tmp_path):
    chain = _chain(tmp_path)
    shards, decoded = {}, {}
    for _, ref in chain.shard_refs()[:8]:
        streams = decode_shard(chain.read(ref["path"]), decoded_size=ref["decoded_size"])
        stored, size = _bomb_frame({k: bytes(v) for k, v in streams.items()}, 128 * MiB)
        shards[ref["path"]], decoded[ref["path"]] = stored, size
    with replaced(chain, resigned(chain, shards=shards, decoded=decoded)):
        result = run_worker("sync", chain.url)
    # without limits the reader inflates 8 x 128 MiB and the sync succeeds (junk ignored)
    assert result["error"] == "ShardError", result
    assert result["peak"] < 64 * MiB, result
