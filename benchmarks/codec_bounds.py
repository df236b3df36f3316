"""What one step's delta could cost at best, and what peers store: the bounds and
reference sizes :mod:`codec_bench` compares the codec against.

- :func:`entropy_bound`: positions as independent per-tensor Bernoulli draws plus the
  pooled order-0 entropy of the XOR values;
- :func:`conditional_bound`: the same given each element's old bf16 exponent;
- :func:`manifest_bytes`: the exact length of the manifest a writer uploads;
- :func:`nemo_bytes`: NeMo RL's sparse layout, the nearest peer;
- :func:`huffman_bits`, :func:`zstd_bits`: a static prefix code's and zstd's bits per value.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import torch
import zstandard

from dcr_format.chain.chain import manifest_key, timestamp
from dcr_format.delta.delta import FULL, EncodedTensor
from dcr_format.format.features import (
    IMPLICIT_PARENTS_FEATURE,
    MANIFEST_ZSTD_FEATURE,
    features_for,
)
from dcr_format.format.schema import (
    CommitRecord,
    Manifest,
    ManifestRef,
    ShardRef,
    Stats,
    implicit_parents,
    stored_manifest,
)
from dcr_format.format.shard import ZSTD_LEVEL
from dcr_format.publish._part import encoded_entry


def _binary_entropy(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1.0 - p) * math.log2(1.0 - p))


def _entropy_bits(symbols: np.ndarray) -> float:
    """Order-0 empirical entropy in bits per symbol."""
    if symbols.size == 0:
        return 0.0
    _, counts = np.unique(symbols, return_counts=True)
    probs = counts / symbols.size
    return float(-(probs * np.log2(probs)).sum())


def huffman_bits(symbols: np.ndarray) -> float:
    """Mean code length in bits of an optimal static prefix code for ``symbols``."""
    if symbols.size == 0:
        return 0.0
    counts = np.unique(symbols, return_counts=True)[1].tolist()
    if len(counts) == 1:
        return 1.0
    heapq.heapify(counts)
    total = 0
    while len(counts) > 1:
        merged = heapq.heappop(counts) + heapq.heappop(counts)
        total += merged
        heapq.heappush(counts, merged)
    return total / symbols.size


def zstd_bits(data: bytes, count: int, **params: int) -> float:
    """Bits per value of ``data`` compressed with the shard's zstd level and ``params``."""
    cparams = zstandard.ZstdCompressionParameters.from_level(ZSTD_LEVEL, **params)
    return 8 * len(zstandard.ZstdCompressor(compression_params=cparams).compress(data)) / count


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bits (int16) -> int32 whose order is the float order (-0 just below +0)."""
    as_int = bits.to(torch.int32)
    return torch.where(as_int < 0, -1 - (as_int & 0x7FFF), as_int)


@dataclass(frozen=True)
class EntropyBound:
    """The empirical entropy bound of one step's delta (bf16 state dicts)."""

    changed: int
    positions_bits: float
    """Per-tensor Bernoulli positions: sum of ``numel * H2(changed / numel)``."""
    values_bits: float
    """``changed * H`` with H the order-0 entropy of the XOR values as 16-bit symbols, pooled
    over every tensor's changes (one distribution for the step, not one per tensor)."""
    h_xor: float
    h_ulp: float
    xor_symbols: np.ndarray

    @property
    def bytes(self) -> float:
        return (self.positions_bits + self.values_bits) / 8


def entropy_bound(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> EntropyBound:
    """Positions as independent per-tensor Bernoulli draws plus the pooled order-0 entropy of
    the XOR values (see `EntropyBound`)."""
    pos_bound_bits = 0.0
    changed = 0
    xor_parts, ulp_parts = [], []
    for name, tensor in new.items():
        old_bits = old[name].view(torch.int16).reshape(-1)
        new_bits = tensor.view(torch.int16).reshape(-1)
        mask = old_bits != new_bits
        count = int(mask.sum())
        changed += count
        pos_bound_bits += tensor.numel() * _binary_entropy(count / tensor.numel())
        if count:
            o, n = old_bits[mask], new_bits[mask]
            xor_parts.append((o ^ n).numpy().view(np.uint16))
            ulp_parts.append((_ordered(n) - _ordered(o)).numpy())
    xor_symbols = np.concatenate(xor_parts) if xor_parts else np.empty(0, np.uint16)
    ulp_symbols = np.concatenate(ulp_parts) if ulp_parts else np.empty(0, np.int32)
    h_xor = _entropy_bits(xor_symbols)
    return EntropyBound(
        changed=changed,
        positions_bits=pos_bound_bits,
        values_bits=changed * h_xor,
        h_xor=h_xor,
        h_ulp=_entropy_bits(ulp_symbols),
        xor_symbols=xor_symbols,
    )


_SHARD_PATH = f"objects/{1:020d}/{'0' * 32}/shard-00000-00000.dcrs"


def _hex(seed: int, digits: int) -> str:
    return np.random.default_rng(seed).bytes(digits // 2).hex()


def manifest_bytes(
    encoded: list[tuple[str, EncodedTensor]],
    new: dict[str, torch.Tensor],
    *,
    stored: int,
    decoded: int,
    compressed: bool = False,
) -> int:
    """Exact length of the manifest a writer rank uploads for ``encoded`` in one shard:
    plain JSON, or (``compressed``) as a writer allowed the manifest features stores it
    (``implicit-parents``: no parent fingerprints; ``manifest-zstd``: one zstd frame). The
    fingerprints, ids and hashes are fixed-width hex; random hex stands for them, so the
    compressed size is that of real ones (incompressible)."""
    entries = [
        encoded_entry(
            name,
            new[name],
            enc,
            i,
            lambda key, stream: 0,  # every stream in the one shard
            _hex(2 * i, 32),
            None if enc.op == FULL else _hex(2 * i + 1, 32),
        )
        for i, (name, enc) in enumerate(encoded)
    ]
    shard = ShardRef(
        path=_SHARD_PATH, sha256=_hex(-1 % 2**32, 64), size=stored, decoded_size=decoded
    )
    features = features_for(r.coding for e in entries for r in e.streams)
    manifest = Manifest(
        required_features=tuple(sorted({*features, MANIFEST_ZSTD_FEATURE}))
        if compressed
        else features,
        chain_id=_hex(2**31, 32),
        version=1,
        kind="delta",
        attempt=_hex(2**31 + 1, 32),
        rank=0,
        world_size=1,
        shards=(shard,),
        entries=tuple(entries),
    )
    return len(stored_manifest(implicit_parents(manifest) if compressed else manifest))


def commit_record_bytes(
    encoded: list[tuple[str, EncodedTensor]],
    new: dict[str, torch.Tensor],
    *,
    stored: int,
    manifest: int,
    compressed: bool = False,
) -> int:
    """Exact length of the commit record of a one-rank delta version of ``new`` whose
    manifest (``manifest`` bytes, :func:`manifest_bytes`) lists ``encoded`` in one shard of
    ``stored`` bytes: the features its codings need (and the manifest features where
    ``compressed``), a step number, the stats; fixed-width fields as random hex."""
    features = set(
        features_for(c for _, e in encoded for c in (e.positions_coding, e.values_coding))
    )
    if compressed:
        features |= {MANIFEST_ZSTD_FEATURE, IMPLICIT_PARENTS_FEATURE}
    version = 1
    attempt = _hex(2**31 + 1, 32)
    record = CommitRecord(
        required_features=tuple(sorted(features)),
        chain_id=_hex(2**31, 32),
        version=version,
        kind="delta",
        parent=version - 1,
        parent_sha256=_hex(2**31 + 2, 64),
        step=version,
        created=timestamp(datetime(2026, 1, 1, tzinfo=timezone.utc)),
        attempt=attempt,
        world_size=1,
        manifests=(
            ManifestRef(
                rank=0,
                path=manifest_key(version, attempt, 0),
                sha256=_hex(2**31 + 3, 64),
                size=manifest,
            ),
        ),
        state_fingerprint=_hex(2**31 + 4, 64),
        stats=Stats(
            tensors=len(new),
            total_elements=sum(t.numel() for t in new.values()),
            changed_elements=sum(e.changed for _, e in encoded),
            payload_bytes=stored + manifest,
            dense_bytes=sum(t.numel() * t.element_size() for t in new.values()),
        ),
    )
    return len(record.to_json())


def download_bytes(
    encoded: list[tuple[str, EncodedTensor]],
    new: dict[str, torch.Tensor],
    *,
    stored: int,
    manifest: int,
    compressed: bool = False,
) -> int:
    """What a reader downloads for the version: its shard (``stored`` bytes), its manifest
    (``manifest`` bytes) and its commit record (:func:`commit_record_bytes`)."""
    record = commit_record_bytes(
        encoded, new, stored=stored, manifest=manifest, compressed=compressed
    )
    return stored + manifest + record


def conditional_bound(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """Bits of positions and values given the class of each element's old value: its bf16
    exponent (both ends hold the old bits). Positions: per tensor and class, Bernoulli draws
    (``n_c * H2(k_c / n_c)``); values: the step's XOR values, order-0 within each class."""
    pos_bits = 0.0
    keys = []
    for name, tensor in new.items():
        o = old[name].view(torch.int16).reshape(-1).numpy().view(np.uint16)
        n = tensor.view(torch.int16).reshape(-1).numpy().view(np.uint16)
        mask = o != n
        classes = (o >> 7) & 0xFF
        totals = np.bincount(classes, minlength=256)
        changed = np.bincount(classes[mask], minlength=256)
        for total, count in zip(totals.tolist(), changed.tolist(), strict=True):
            if total:
                pos_bits += total * _binary_entropy(count / total)
        keys.append((classes[mask].astype(np.int64) << 16) | (o[mask] ^ n[mask]))
    joined = np.concatenate(keys) if keys else np.empty(0, np.int64)
    if joined.size == 0:
        return pos_bits, 0.0
    uniq, counts = np.unique(joined, return_counts=True)
    class_totals = np.bincount(uniq >> 16, weights=counts, minlength=256)
    val_bits = float((counts * np.log2(class_totals[uniq >> 16] / counts)).sum())
    return pos_bits, val_bits


def nemo_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """NeMo RL's sparse layout, the nearest peer: per tensor the changed positions as gaps in
    the narrowest unsigned width or as (start, length) u32 runs, whichever is smaller, the
    XOR values as raw 16-bit words, everything in one zstd level-1 frame."""
    parts = []
    for name, tensor in new.items():
        o = old[name].view(torch.int16).reshape(-1).numpy().view(np.uint16)
        n = tensor.view(torch.int16).reshape(-1).numpy().view(np.uint16)
        positions = np.flatnonzero(o != n)
        if positions.size == 0:
            continue
        gaps = np.diff(positions, prepend=0)
        width = next(w for w in (1, 2, 4, 8) if int(gaps.max()) < 1 << (8 * w))
        as_gaps = gaps.astype(f"<u{width}").tobytes()
        runs = 1 + int(np.count_nonzero(np.diff(positions) != 1))
        parts.append(as_gaps if len(as_gaps) <= 8 * runs else b"r" * (8 * runs))
        if len(as_gaps) > 8 * runs:  # the runs themselves, as the peer writes them
            breaks = np.flatnonzero(np.diff(positions) != 1) + 1
            starts = positions[np.concatenate(([0], breaks))]
            lengths = np.diff(np.concatenate(([0], breaks, [positions.size])))
            parts[-1] = np.stack([starts, lengths], axis=1).astype("<u4").tobytes()
        parts.append((o[positions] ^ n[positions]).astype("<u2").tobytes())
    return len(zstandard.ZstdCompressor(level=1).compress(b"".join(parts)))
