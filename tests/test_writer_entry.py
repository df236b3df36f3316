"""The manifest entry of a coded tensor (writers/_part.encoded_entry): what the canonical
writer lists for each tensor, and what the codec benchmark sizes manifests with."""

from __future__ import annotations

import torch

from dcr_format.delta.delta import encode_tensor
from dcr_format.publish._part import encoded_entry


def test_a_delta_entry_names_both_streams_in_the_shards_they_were_queued_in():
    old = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    new = old.clone()
    new[2, 3] = 100.0
    encoded = encode_tensor(new, old, op="xor")
    queued: list[tuple[str, bytes]] = []

    def add(key: str, stream: bytes) -> int:
        queued.append((key, stream))
        return len(queued) + 4  # the shard index the writer says it lands in

    entry = encoded_entry("w", new, encoded, 7, add, "a" * 32, "b" * 32)
    assert encoded.positions is not None and encoded.values is not None
    assert queued == [("7.p", encoded.positions), ("7.v", encoded.values)]
    assert entry.positions is not None and entry.values is not None
    assert (entry.positions.key, entry.positions.shard) == ("7.p", 5)
    assert (entry.values.key, entry.values.shard) == ("7.v", 6)
    assert (entry.positions.coding, entry.values.coding) == (
        encoded.positions_coding,
        encoded.values_coding,
    )
    assert (entry.name, entry.dtype, entry.shape, entry.op) == ("w", "bfloat16", (8, 8), "xor")
    assert (entry.changed, entry.encoded_bytes) == (1, encoded.nbytes)
    assert (entry.fingerprint, entry.parent_fingerprint) == ("a" * 32, "b" * 32)


def test_a_full_entry_has_values_only_and_an_unchanged_one_no_streams():
    new = torch.ones(3, 5, dtype=torch.float32)
    keys: list[str] = []

    def add(key: str, stream: bytes) -> int:
        keys.append(key)
        return 0

    full = encoded_entry("f", new, encode_tensor(new), 0, add, "c" * 32, None)
    assert keys == ["0.v"] and full.positions is None and full.values is not None
    assert (full.op, full.changed, full.dtype) == ("full", 15, "float32")
    assert full.parent_fingerprint is None
    same = encoded_entry(
        "s", new, encode_tensor(new, new.clone(), op="xor"), 1, add, "c" * 32, "c" * 32
    )
    assert keys == ["0.v"] and same.positions is None and same.values is None
    assert same.changed == 0
