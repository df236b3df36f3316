"""Build the golden test vectors of spec/FORMAT.md §13.3 (see spec/vectors/README.md).

Run from the repository root::

    .venv/bin/python spec/vectors/generate.py [--out DIR]

Each vector is written to ``DIR/<name>/store/`` (a complete store) and
``DIR/<name>/expected.json`` (what a conforming reader must reproduce, and the
writer inputs a conforming writer needs to reproduce the store byte for byte).
``DIR`` defaults to this script's directory. An existing ``store/`` and
``expected.json`` of a vector are replaced; nothing else under ``DIR`` is touched.

Everything is deterministic: tensor bits come from explicit patterns and from
the raw output of numpy's PCG64 bit generator with fixed seeds (bit generator
streams are stable across numpy versions; no distribution method and no torch
RNG is used), the writer's clock returns fixed instants one second apart, and
its id source returns a fixed list (the chain id first, then one attempt id per
publish). Bits are built with integer operations only, so NaN payloads, -0.0 and
subnormals survive exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from dcr_format import DeltaWriter
from dcr_format.chain.chain import Chain
from dcr_format.delta.fingerprint import state_fingerprint, tensor_fingerprint
from dcr_format.format.dtypes import BY_NAME
from dcr_format.format.schema import KNOWN_FEATURES, ReaderRecord
from dcr_format.store.store import open_store

HERE = Path(__file__).resolve().parent
CLOCK_START = datetime(2025, 1, 2, 3, 4, 5, 123456, tzinfo=timezone.utc)
_UNSIGNED = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}
_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

# ------------------------------------------------------------------------------------------
# bit patterns
# ------------------------------------------------------------------------------------------


def raw(seed: int, n: int) -> np.ndarray:
    """``n`` raw 64-bit outputs of PCG64 seeded with ``seed`` (a stable stream)."""
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    return np.random.PCG64(seed).random_raw(n).astype(np.uint64)


def weights(seed: int, dtype: str, n: int) -> np.ndarray:
    """Bits of ``n`` plausible weights (random sign, small exponent range, random mantissa)."""
    r = raw(seed, n)
    sign = r >> np.uint64(63)
    exp_pick = (r >> np.uint64(56)) & np.uint64(7)
    mant = r & np.uint64((1 << 52) - 1)
    if dtype == "bfloat16":  # 1 + 8 + 7 bits, exponents 0x76..0x7d (about 2^-9 .. 2^-2)
        bits = (sign << np.uint64(15)) | ((exp_pick + np.uint64(0x76)) << np.uint64(7))
        bits |= mant & np.uint64(0x7F)
    elif dtype == "float16":  # 1 + 5 + 5 + 10 bits
        bits = (sign << np.uint64(15)) | ((exp_pick + np.uint64(0x06)) << np.uint64(10))
        bits |= mant & np.uint64(0x3FF)
    elif dtype == "float32":  # 1 + 8 + 23 bits
        bits = (sign << np.uint64(31)) | ((exp_pick + np.uint64(0x76)) << np.uint64(23))
        bits |= mant & np.uint64((1 << 23) - 1)
    elif dtype == "float64":  # 1 + 11 + 52 bits
        bits = (sign << np.uint64(63)) | ((exp_pick + np.uint64(0x3F6)) << np.uint64(52)) | mant
    else:
        raise ValueError(dtype)
    return bits.astype(_UNSIGNED[BY_NAME[dtype].width])


def uniform_bits(seed: int, dtype: str, n: int) -> np.ndarray:
    """Bits of ``n`` elements drawn uniformly from every pattern of the dtype (bool: 0/1)."""
    width = BY_NAME[dtype].width
    r = raw(seed, n)
    if dtype == "bool":
        r = r & np.uint64(1)
    return r.astype(_UNSIGNED[width]) if width < 8 else r.astype("<u8")


def scattered(seed: int, n: int, count: int, *, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """``count`` distinct positions in ``[lo, hi)`` (sorted), picked from a fixed stream."""
    hi = n if hi is None else hi
    r = (raw(seed, count * 8) % np.uint64(hi - lo)).astype(np.int64) + lo
    _, first = np.unique(r, return_index=True)
    picked = r[np.sort(first)][:count]
    assert picked.size == count, "not enough distinct positions"
    return np.sort(picked)


def run(start: int, length: int) -> np.ndarray:
    """The contiguous positions ``[start, start + length)``."""
    return np.arange(start, start + length, dtype=np.int64)


def flip(bits: np.ndarray, positions: np.ndarray, seed: int, mask: int) -> np.ndarray:
    """A copy of ``bits`` with every listed element XOR-ed by a non-zero value in ``[1, mask]``."""
    out = bits.copy()
    m = (raw(seed, positions.size) % np.uint64(mask)) + np.uint64(1)
    out[positions] ^= m.astype(out.dtype)
    return out


def nudge(bits: np.ndarray, positions: np.ndarray, seed: int) -> np.ndarray:
    """A copy of ``bits`` (16-bit floats) with each listed element moved by one or two ulps
    up or down (magnitude bits plus or minus 1 or 2, sign kept): an optimizer step's change."""
    out = bits.copy()
    r = raw(seed, positions.size)
    step = ((r & np.uint64(3)) % np.uint64(3)).astype(np.int64)  # 0, 1, 2, 0: mostly 1 ulp
    step = np.where(step == 0, 1, step) * np.where((r >> np.uint64(8)) & np.uint64(1), 1, -1)
    magnitude = (out[positions] & 0x7FFF).astype(np.int64)
    moved = np.clip(magnitude + step, 1, 0x7F7F)
    moved = np.where(moved == magnitude, magnitude - step, moved)
    out[positions] = (out[positions] & 0x8000) | moved.astype(out.dtype)
    return out


def put(bits: np.ndarray, positions: np.ndarray | list[int], values: list[int]) -> np.ndarray:
    """A copy of ``bits`` with explicit bit patterns at ``positions``."""
    out = bits.copy()
    out[np.asarray(positions, dtype=np.int64)] = np.array(values, dtype=np.uint64).astype(out.dtype)
    return out


def bits_of(dtype: str, values: list[int]) -> np.ndarray:
    """An array of explicit bit patterns."""
    return np.array(values, dtype=np.uint64).astype(_UNSIGNED[BY_NAME[dtype].width])


# ------------------------------------------------------------------------------------------
# tensors
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One tensor of one version: format dtype, shape and flat element bits."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray

    def __post_init__(self) -> None:
        numel = int(np.prod(self.shape, dtype=np.int64))
        width = BY_NAME[self.dtype].width
        assert self.bits.shape == (numel,), (self.dtype, self.shape, self.bits.shape)
        assert self.bits.dtype == np.dtype(_UNSIGNED[width]), (self.dtype, self.bits.dtype)
        if self.dtype == "bool":
            assert int(self.bits.max(initial=0)) <= 1

    def tensor(self) -> torch.Tensor:
        """A fresh torch tensor holding exactly these bits."""
        info = BY_NAME[self.dtype]
        array = np.ascontiguousarray(self.bits).view(_SIGNED[info.width]).copy()
        return torch.from_numpy(array).view(info.torch_dtype).reshape(self.shape)

    def raw_bytes(self) -> bytes:
        """The elements' little-endian bytes, row-major."""
        return self.bits.astype(_UNSIGNED[BY_NAME[self.dtype].width]).tobytes()


State = dict[str, Spec]


@dataclass
class Vector:
    """A vector: writer configuration and the state published as each version."""

    name: str
    description: str
    number: int
    versions: list[tuple[int, State]]  # (step, state) per version, in publish order
    base_every: int | None = None
    ops: dict[str, str] = field(default_factory=dict)
    # the writer's shard size limit; 256 MiB, the reference default when the vectors were
    # made (expected.json records it), unless a vector sets its own
    shard_bytes: int = 256 << 20
    # codec features the writer may use (FORMAT.md §12); None: the writer's default
    features: tuple[str, ...] | None = ()
    # reader records (FORMAT.md §3.6) put in the store before the version of that number
    records: dict[int, list[ReaderRecord]] = field(default_factory=dict)
    # the checkpoint files given with each version (FORMAT.md §3.5.6; None: the previous
    # version's again); empty: the vector publishes no files
    files: list[dict[str, bytes] | None] = field(default_factory=list)

    def ids(self) -> list[str]:
        """The id source's outputs: the chain id, then one attempt id per publish."""
        chain = f"{self.number:x}" * 32
        return [chain] + [f"a{self.number:x}{v:030x}" for v in range(len(self.versions))]


# ------------------------------------------------------------------------------------------
# the vectors
# ------------------------------------------------------------------------------------------


def base_only() -> Vector:
    state = {
        "model.embed_tokens.weight": Spec("bfloat16", (32, 16), weights(101, "bfloat16", 512)),
        "model.layers.0.mlp.down_proj.weight": Spec(
            "bfloat16", (16, 32), weights(102, "bfloat16", 512)
        ),
        "model.norm.weight": Spec(
            "float32", (16,), put(weights(103, "float32", 16), [0, 1], [0x3F800000, 0x80000000])
        ),
        "lm_head.bias": Spec("float32", (4, 8), weights(104, "float32", 32)),
    }
    return Vector(
        "base-only",
        "one base version (version 0) of bfloat16 and float32 tensors",
        1,
        [(0, state)],
    )


def xor_deltas() -> Vector:
    a0 = weights(201, "bfloat16", 64 * 64)
    b0 = weights(202, "bfloat16", 2048)
    c0 = weights(203, "bfloat16", 8 * 16)

    def state(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> State:
        return {
            "model.layers.0.self_attn.q_proj.weight": Spec("bfloat16", (64, 64), a),
            "model.layers.0.mlp.up_proj.weight": Spec("bfloat16", (2048,), b),
            "model.layers.0.input_layernorm.weight": Spec("bfloat16", (8, 16), c),
        }

    # v1: scattered changes in a (rice), one contiguous block in b (ranges), c unchanged
    a1 = flip(a0, scattered(211, 4096, 40), 212, 0x7F)
    b1 = flip(b0, run(300, 200), 213, 0x7F)
    c1 = c0
    # v2: nothing changes
    a2, b2, c2 = a1, b1, c1
    # v3: a gets three runs plus scattered elements, c one element, b unchanged
    pos = np.unique(
        np.concatenate([run(0, 16), run(1000, 64), run(4080, 16), scattered(221, 4096, 12)])
    )
    a3 = flip(a2, pos, 222, 0x7F)
    b3 = b2
    c3 = flip(c2, np.array([77]), 223, 0x7F)
    # v4: sparse scattered changes in b (rice), whole rows 10..12 of a (one run of 192)
    a4 = flip(a3, run(10 * 64, 3 * 64), 231, 0xFF)
    b4 = flip(b3, scattered(232, 2048, 25), 233, 0x3)
    c4 = c3
    # v5: the first and last element of every tensor, sign flips included
    a5 = flip(a4, np.array([0, 4095]), 241, 0x7F)
    b5 = put(b4, [0, 2047], [int(b4[0]) ^ 0x8000, int(b4[2047]) ^ 0x8001])
    c5 = flip(c4, np.array([0, 127]), 243, 0x7F)
    return Vector(
        "xor-deltas",
        "a base and five xor deltas of bfloat16 tensors: scattered (rice) and contiguous "
        "(ranges) changes, a version that changes nothing, first/last elements",
        2,
        [
            (0, state(a0, b0, c0)),
            (1, state(a1, b1, c1)),
            (2, state(a2, b2, c2)),
            (3, state(a3, b3, c3)),
            (4, state(a4, b4, c4)),
            (5, state(a5, b5, c5)),
        ],
    )


# special bit patterns
F64_SPECIAL = [
    0x7FF8000000000000,  # quiet NaN
    0x7FF8000000000001,  # quiet NaN, payload 1
    0xFFF8DEADBEEF0001,  # negative quiet NaN with a payload
    0x7FF0000000000001,  # signalling NaN
    0x8000000000000000,  # -0.0
    0x0000000000000000,  # +0.0
    0x7FF0000000000000,  # inf
    0xFFF0000000000000,  # -inf
    0x0000000000000001,  # smallest subnormal
    0x800FFFFFFFFFFFFF,  # largest negative subnormal
    0x3FF0000000000000,  # 1.0
    0xBFF8000000000000,  # -1.5
]
F32_SPECIAL = [
    0x7FC00000,  # quiet NaN
    0x7FC00001,  # quiet NaN, payload 1
    0xFFBFFFFF,  # negative signalling NaN, all payload bits
    0x7F800001,  # signalling NaN
    0x80000000,  # -0.0
    0x7F800000,  # inf
    0xFF800000,  # -inf
    0x00000001,  # smallest subnormal
    0x807FFFFF,  # largest negative subnormal
    0x3F800000,  # 1.0
]
F16_SPECIAL = [
    0x7E00,  # quiet NaN
    0x7C01,  # signalling NaN
    0xFE01,  # negative quiet NaN, payload 1
    0x7DFF,  # signalling NaN, all payload bits
    0x8000,  # -0.0
    0x0000,  # +0.0
    0x7C00,  # inf
    0xFC00,  # -inf
    0x0001,  # smallest subnormal
    0x83FF,  # largest negative subnormal
]


def mixed() -> Vector:
    ow = "model.layers.0.self_attn.o_proj.weight"  # always sent as overwrite
    f32 = "mixed.float32"
    f64 = "mixed.float64"
    f16 = "mixed.float16"
    e4 = "mixed.float8_e4m3fn"
    e5 = "mixed.float8_e5m2"
    flag = "mixed.bool"
    i8 = "mixed.int8"
    i64 = "mixed.int64"
    retype = "mixed.retype"
    empty = "mixed.empty"
    scalar = "mixed.scalar"
    added = "mixed.added"
    step = "mixed.step"
    i16 = "mixed.int16"
    u8 = "mixed.uint8"

    every_byte = np.arange(256, dtype=np.uint64).astype("<u1")  # every float8 bit pattern
    v0: State = {
        ow: Spec("bfloat16", (16, 16), weights(301, "bfloat16", 256)),
        f32: Spec(
            "float32",
            (8, 8),
            np.concatenate([bits_of("float32", F32_SPECIAL), weights(302, "float32", 54)]),
        ),
        f64: Spec(
            "float64",
            (16,),
            np.concatenate([bits_of("float64", F64_SPECIAL), weights(303, "float64", 4)]),
        ),
        f16: Spec(
            "float16",
            (32,),
            np.concatenate([bits_of("float16", F16_SPECIAL), weights(304, "float16", 22)]),
        ),
        e4: Spec("float8_e4m3fn", (256,), every_byte.copy()),
        e5: Spec("float8_e5m2", (16, 16), every_byte.copy()),
        flag: Spec("bool", (48,), uniform_bits(305, "bool", 48)),
        i8: Spec(
            "int8",
            (32,),
            put(uniform_bits(306, "int8", 32), [0, 1, 2, 3], [0x80, 0x7F, 0xFF, 0x00]),
        ),
        i64: Spec(
            "int64",
            (4, 4),
            put(
                uniform_bits(307, "int64", 16),
                [0, 1, 2, 3],
                [0x8000000000000000, 0x7FFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF, 0],
            ),
        ),
        i16: Spec("int16", (2, 5), uniform_bits(308, "int16", 10)),
        u8: Spec("uint8", (12,), uniform_bits(309, "uint8", 12)),
        retype: Spec(
            "int32", (6,), bits_of("int32", [0, 1, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 42])
        ),
        empty: Spec("float32", (0, 4), np.zeros(0, dtype="<u4")),
        scalar: Spec("float64", (), bits_of("float64", [0x7FF8000000000BAD])),
    }

    # v1: overwrite with a run and scattered changes; every float8_e4m3fn element changes
    # (full); a new tensor (full); NaN payload and -0.0 -> +0.0 changes; a few bools and int8s
    v1 = dict(v0)
    v1[ow] = Spec(
        "bfloat16",
        (16, 16),
        flip(
            v0[ow].bits, np.unique(np.concatenate([run(32, 20), scattered(311, 256, 8)])), 312, 0x7F
        ),
    )
    v1[e4] = Spec("float8_e4m3fn", (256,), flip(v0[e4].bits, run(0, 256), 313, 0xFF))
    v1[added] = Spec("float32", (20,), weights(314, "float32", 20))
    v1[f64] = Spec(
        "float64", (16,), put(v0[f64].bits, [1, 4], [0x7FF8000000000002, 0x0000000000000000])
    )
    v1[flag] = Spec("bool", (48,), v0[flag].bits ^ put(np.zeros(48, "<u1"), [3, 17, 40], [1, 1, 1]))
    v1[i8] = Spec("int8", (32,), put(v0[i8].bits, [0, 31], [0x7F, 0x80]))

    # v2: the overwrite tensor does not change; every int64 changes (full); a dtype change
    # (int32 -> float32) and a shape change ([20] -> [4, 5]), both full; float16 NaN
    # payloads and signed zeros change (xor); a contiguous run in float32
    v2 = dict(v1)
    v2[i64] = Spec("int64", (4, 4), v1[i64].bits ^ (uniform_bits(321, "int64", 16) | np.uint64(1)))
    v2[retype] = Spec(
        "float32", (6,), bits_of("float32", [0x3F800000, 0x7FC00000, 0x80000000, 0, 1, 0x7F800000])
    )
    v2[added] = Spec("float32", (4, 5), v1[added].bits.copy())
    v2[f16] = Spec(
        "float16",
        (32,),
        put(v1[f16].bits, [0, 1, 4, 5, 8], [0x7E01, 0x7C02, 0x0000, 0x8000, 0x0002]),
    )
    v2[f32] = Spec("float32", (8, 8), flip(v1[f32].bits, run(20, 30), 322, 0xFF))

    # v3: a base (base_every=3) that drops mixed.retype and changes a few elements
    v3 = {k: s for k, s in v2.items() if k != retype}
    v3[f16] = Spec("float16", (32,), flip(v2[f16].bits, np.array([12, 13]), 331, 0x3))

    # v4: float32 changes incl. NaN payloads; scattered float8_e5m2 changes
    # (into NaN/inf patterns); an overwrite of a contiguous run; a new 0-d tensor (full)
    v4 = dict(v3)
    v4[f32] = Spec(
        "float32",
        (8, 8),
        put(
            v3[f32].bits,
            [1, 2, 4, 40, 63],
            [0x7FC00002, 0xFFBFFFFE, 0x00000000, 0x7F800000, 0x00000002],
        ),
    )
    v4[e5] = Spec(
        "float8_e5m2",
        (16, 16),
        put(v3[e5].bits, [5, 60, 61, 130, 200, 255], [0x7D, 0x7C, 0xFE, 0x80, 0x01, 0x00]),
    )
    v4[ow] = Spec("bfloat16", (16, 16), flip(v3[ow].bits, run(128, 64), 341, 0x7F))
    v4[step] = Spec("int64", (), bits_of("int64", [4]))
    v4[i16] = Spec("int16", (2, 5), put(v3[i16].bits, [9], [0x8000]))

    # v5: 0-d tensors change (a NaN payload, an int64: full); bools and two uint8s flip
    v5 = dict(v4)
    v5[scalar] = Spec("float64", (), bits_of("float64", [0xFFF8000000000BAD]))
    v5[step] = Spec("int64", (), bits_of("int64", [5]))
    v5[u8] = Spec("uint8", (12,), flip(v4[u8].bits, run(4, 2), 351, 0xFF))
    v5[flag] = Spec("bool", (48,), v4[flag].bits ^ put(np.zeros(48, "<u1"), [0, 47], [1, 1]))

    return Vector(
        "mixed",
        "overwrite (configured), full (a tensor changing >50%, new tensors, a dtype change, "
        "a shape change), a second base (base_every=3) that drops a tensor, every dtype "
        "including float8 (every bit pattern), bool, int8, int64, float64, float16, NaN "
        "payloads, -0.0, infinities, subnormals, 0-d and empty tensors, several shards per "
        "manifest",
        3,
        [(100, v0), (101, v1), (102, v2), (103, v3), (104, v4), (105, v5)],
        base_every=3,
        ops={ow: "overwrite"},
        shard_bytes=512,
    )


def values_rans() -> Vector:
    """Entropy-coded values (feature ``values-rans``, FORMAT.md §7.3)."""
    a0 = weights(401, "bfloat16", 64 * 64)
    b0 = weights(402, "bfloat16", 32 * 32)
    c0 = uniform_bits(403, "int8", 512) & np.uint8(0x03)  # four values: rans even in a base
    d0 = weights(404, "float32", 256)
    e0 = weights(405, "bfloat16", 64)

    def state(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray, e: np.ndarray) -> State:
        return {
            "model.layers.0.mlp.gate_proj.weight": Spec("bfloat16", (64, 64), a),
            "model.layers.0.self_attn.k_proj.weight": Spec("bfloat16", (32, 32), b),
            "model.layers.0.mask": Spec("int8", (512,), c),
            "model.norm.weight": Spec("float32", (256,), d),
            "lm_head.bias": Spec("bfloat16", (64,), e),
        }

    # v1: one- and two-ulp steps in a (~3%) and b (~2%, plus XORs no table holds: escapes),
    # a few changes of c, and of e (too few for rans: planes in the same manifest)
    a1 = nudge(a0, scattered(411, 4096, 120), 412)
    b1 = flip(nudge(b0, scattered(413, 1024, 20), 414), scattered(415, 1024, 4), 416, 0x7FFF)
    c1 = put(c0, scattered(417, 512, 30), [int(v) for v in raw(418, 30) % np.uint64(4)])
    e1 = flip(e0, np.array([5, 40]), 419, 0x7F)
    # v2: every changed element of a moves by the same XOR (one table symbol, no escape)
    pos = scattered(421, 4096, 50)
    a2 = put(a1, pos, [int(v) ^ 0x0001 for v in a1[pos]])
    # v3: float32 steps (width 4) and a second step of a
    d3 = d0.copy()
    dpos = scattered(431, 256, 40)
    d3[dpos] = d3[dpos] ^ ((raw(432, 40) % np.uint64(3)).astype("<u4") + np.uint32(1))
    a3 = nudge(a2, scattered(433, 4096, 80), 434)
    return Vector(
        "values-rans",
        "rans values (feature values-rans): bfloat16 ulp steps, escapes, a one-symbol table, "
        "an int8 base, float32 steps, planes next to rans in one manifest",
        4,
        [
            (0, state(a0, b0, c0, d0, e0)),
            (1, state(a1, b1, c1, d0, e1)),
            (2, state(a2, b1, c1, d0, e1)),
            (3, state(a3, b1, c1, d3, e1)),
        ],
        features=("values-rans",),
    )


def below(bits: np.ndarray, dtype: str, exponent: int, seed: int, one_in: int) -> np.ndarray:
    """Positions (sorted) of about one in ``one_in`` of the elements whose exponent field
    is below ``exponent``: an optimizer step moves small weights (fine spacing) most."""
    shift, mask = {"bfloat16": (7, 0xFF), "float16": (10, 0x1F), "float32": (23, 0xFF)}.get(
        dtype, (52, 0x7FF)
    )
    field = (bits.astype(np.uint64) >> np.uint64(shift)) & np.uint64(mask)
    picked = (raw(seed, bits.size) % np.uint64(one_in)) == 0
    return np.flatnonzero((field < np.uint64(exponent)) & picked).astype(np.int64)


def positions_classed() -> Vector:
    """Positions coded against the old bits (feature ``positions-classed``, FORMAT.md §6.5)."""
    a0 = weights(501, "bfloat16", 64 * 64)
    b0 = weights(502, "float32", 32 * 64)
    c0 = weights(503, "float16", 1024)
    d0 = weights(504, "float64", 512)
    e0 = uniform_bits(505, "int16", 1024)
    f0 = weights(506, "bfloat16", 256)

    def state(*t: np.ndarray) -> State:
        a, b, c, d, e, f = t
        return {
            "model.layers.0.mlp.up_proj.weight": Spec("bfloat16", (64, 64), a),
            "model.layers.0.self_attn.q_proj.weight": Spec("float32", (32, 64), b),
            "model.layers.0.mlp.down_proj.weight": Spec("float16", (1024,), c),
            "model.layers.0.master": Spec("float64", (512,), d),
            "model.layers.0.counts": Spec("int16", (1024,), e),
            "model.norm.weight": Spec("bfloat16", (256,), f),
        }

    # v1: small weights move (classed wins); int16 changes (no classes: rice next to classed);
    # two changes of f (too few for classed to pay: rice)
    a1 = nudge(a0, below(a0, "bfloat16", 0x79, 511, 3), 512)
    b1 = flip(b0, below(b0, "float32", 0x78, 513, 2), 514, 0xFF)
    c1 = nudge(c0, below(c0, "float16", 0x09, 515, 3), 516)
    d1 = flip(d0, below(d0, "float64", 0x3F8, 517, 2), 518, 0xFFFF)
    e1 = flip(e0, scattered(519, 1024, 60), 520, 0xFF)
    f1 = flip(f0, np.array([3, 255]), 521, 0x7F)
    # v2: a again, and its exponent's low bit flipped in a few large weights, so that those
    # elements change class: v3 is decoded against the classes v2 left
    a2 = nudge(a1, below(a1, "bfloat16", 0x79, 531, 3), 532)
    moved = scattered(533, 4096, 12)
    a2[moved] ^= np.uint16(0x0080)
    a3 = nudge(a2, below(a2, "bfloat16", 0x7A, 541, 4), 542)
    return Vector(
        "positions-classed",
        "classed positions (feature positions-classed): bfloat16, float32, float16 and float64 "
        "steps of small weights, rice next to classed in one manifest, class changes decoded "
        "by the next version",
        5,
        [
            (0, state(a0, b0, c0, d0, e0, f0)),
            (1, state(a1, b1, c1, d1, e1, f1)),
            (2, state(a2, b1, c1, d1, e1, f1)),
            (3, state(a3, b1, c1, d1, e1, f1)),
        ],
        features=("positions-classed",),
    )


def step_ulps(bits: np.ndarray, positions: np.ndarray, seed: int, width: int) -> np.ndarray:
    """A copy of float ``bits`` with each listed element moved by one or two steps in value
    order (up or down, across zero too): what an optimizer step does to most weights."""
    kind = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    top, ones = kind(1) << kind(8 * width - 1), ~kind(0)
    out = bits.astype(kind)
    r = raw(seed, positions.size)
    step = np.where(r & np.uint64(3), 1, 2).astype(np.int64)
    step = np.where((r >> np.uint64(8)) & np.uint64(1), step, -step)
    x = out[positions]
    u = x ^ np.where(x & top, ones, top).astype(kind)
    with np.errstate(over="ignore"):
        u = (u.astype(np.uint64) + step.astype(np.uint64)).astype(kind)
    out[positions] = u ^ np.where(u & top, top, ones).astype(kind)
    return out.astype(bits.dtype)


def float_family(*t: np.ndarray) -> State:
    """The tensors of the ulp vectors: a bfloat16, float32, float16 and float64 tensor, a
    second bfloat16 one and an int16 one (``t``: their bits; the float64 one's size is that
    of its bits)."""
    a, b, c, d, e, f = t
    return {
        "model.layers.0.mlp.gate_proj.weight": Spec("bfloat16", (64, 64), a),
        "model.layers.0.self_attn.v_proj.weight": Spec("float32", (32, 32), b),
        "model.layers.0.mlp.up_proj.weight": Spec("float16", (1024,), c),
        "model.layers.0.master": Spec("float64", (d.size,), d),
        "model.layers.0.self_attn.o_proj.weight": Spec("bfloat16", (32, 32), e),
        "model.layers.0.steps": Spec("int16", (512,), f),
    }


def values_ulp() -> Vector:
    """Values as ulp differences from the old bits (feature ``values-ulp``, FORMAT.md §7.5)."""
    a0 = weights(601, "bfloat16", 64 * 64)
    b0 = weights(602, "float32", 32 * 32)
    c0 = weights(603, "float16", 1024)
    d0 = weights(604, "float64", 256)
    e0 = weights(605, "bfloat16", 1024)
    f0 = uniform_bits(606, "int16", 512)

    # v1: one- and two-ulp steps of the four float dtypes (ulp wins); e changed by random
    # XORs (ulp loses: rans or planes); f an integer tensor (never ulp)
    a1 = step_ulps(a0, scattered(611, 4096, 200), 612, 2)
    b1 = step_ulps(b0, scattered(613, 1024, 60), 614, 4)
    c1 = step_ulps(c0, scattered(615, 1024, 50), 616, 2)
    d1 = step_ulps(d0, scattered(617, 256, 40), 618, 8)
    e1 = flip(e0, scattered(619, 1024, 40), 620, 0x7FFF)
    f1 = flip(f0, scattered(621, 512, 30), 622, 0x3)
    # v2: steps across zero: +0.0 and -0.0 and the smallest subnormals of a
    a2 = put(a1, [0, 1, 2, 3], [0x0000, 0x8000, 0x0001, 0x8001])
    a2 = step_ulps(a2, np.concatenate([np.arange(4), scattered(631, 4096, 100, lo=4)]), 632, 2)
    # v3: a second step of b
    b3 = step_ulps(b1, scattered(641, 1024, 80), 642, 4)
    return Vector(
        "values-ulp",
        "ulp values (feature values-ulp): one- and two-ulp steps of bfloat16, float16, "
        "float32 and float64 tensors, steps across zero, rans and planes next to ulp; "
        "manifests stored compressed (manifest-zstd)",
        6,
        [
            (0, float_family(a0, b0, c0, d0, e0, f0)),
            (1, float_family(a1, b1, c1, d1, e1, f1)),
            (2, float_family(a2, b1, c1, d1, e1, f1)),
            (3, float_family(a2, b3, c1, d1, e1, f1)),
        ],
        features=("values-rans", "values-ulp", "manifest-zstd"),
    )


def implicit_parents() -> Vector:
    """The states of ``xor-deltas`` (unchanged tensors, a version without changes) with
    the parent fingerprints left to the parent's table, an ``overwrite`` tensor among them."""
    deltas = xor_deltas()
    return Vector(
        "implicit-parents",
        "the versions of xor-deltas published with implicit parent fingerprints (feature "
        "implicit-parents): every delta entry's parent_fingerprint null, the layer norm sent "
        "as overwrite",
        7,
        deltas.versions,
        ops={"model.layers.0.input_layernorm.weight": "overwrite"},
        features=("implicit-parents",),
    )


_FIELDS = {
    "bfloat16": (7, 0xFF),
    "float16": (10, 0x1F),
    "float32": (23, 0xFF),
    "float64": (52, 0x7FF),
}


def step_scaled(
    bits: np.ndarray, positions: np.ndarray, seed: int, dtype: str, origin: int
) -> np.ndarray:
    """A copy of float ``bits`` with each listed element moved by one update size: 1 to 3
    units of ``2^s`` ulps plus ``s`` random low bits, up or down, ``s = min(mantissa + 1,
    max(0, origin - e))`` for the old exponent ``e`` (the ulp distance of one step doubles
    for each exponent below ``origin``)."""
    width = BY_NAME[dtype].width
    shift, mask = _FIELDS[dtype]
    kind = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    top, ones = kind(1) << kind(8 * width - 1), ~kind(0)
    out = bits.astype(kind)
    x = out[positions]
    e = ((x.astype(np.uint64) >> np.uint64(shift)) & np.uint64(mask)).astype(np.int64)
    s = np.clip(origin - e, 0, shift + 1).astype(np.uint64)
    r = raw(seed, positions.size)
    units = np.uint64(1) + r % np.uint64(3)
    low = (r >> np.uint64(8)) & ((np.uint64(1) << s) - np.uint64(1))
    step = (units << s) + low
    down = (r >> np.uint64(63)) == 1
    u = (x ^ np.where(x & top, ones, top).astype(kind)).astype(np.uint64)
    with np.errstate(over="ignore"):
        u = np.where(down, u - step, u + step).astype(kind)
    out[positions] = u ^ np.where(u & top, top, ones).astype(kind)
    return out.astype(bits.dtype)


def values_ulp_shift() -> Vector:
    """Values as ulp differences split by the old exponent (feature ``values-ulp-shift``,
    FORMAT.md §7.6)."""
    a0 = weights(701, "bfloat16", 64 * 64)
    b0 = weights(702, "float32", 32 * 32)
    c0 = weights(703, "float16", 1024)
    d0 = weights(704, "float64", 512)
    e0 = weights(705, "bfloat16", 1024)
    f0 = uniform_bits(706, "int16", 512)

    # v1: updates of one size in value for the four float dtypes (ulp-shift wins); one-ulp
    # steps of e (no shift pays: ulp); f an integer tensor (rans)
    a1 = step_scaled(a0, scattered(711, 4096, 300), 712, "bfloat16", 0x7C)
    b1 = step_scaled(b0, scattered(713, 1024, 80), 714, "float32", 0x7C)
    c1 = step_scaled(c0, scattered(715, 1024, 60), 716, "float16", 0x0C)
    d1 = step_scaled(d0, scattered(717, 512, 60), 718, "float64", 0x3FC)
    e1 = step_ulps(e0, scattered(719, 1024, 60), 720, 2)
    f1 = flip(f0, scattered(721, 512, 30), 722, 0x3)
    # v2: a again, with changes across zero, the smallest subnormals (shifts at the cap,
    # 8 bits) and random XORs (large y beside the small ones)
    a2 = put(a1, [0, 1, 2, 3], [0x0000, 0x8000, 0x0001, 0x8001])
    a2 = step_scaled(
        a2, np.concatenate([np.arange(4), scattered(731, 4096, 200, lo=8)]), 732, "bfloat16", 0x7C
    )
    a2 = flip(a2, np.array([4, 5, 6, 7]), 733, 0x7FFF)
    # v3: a second step of d, decoded against the exponents v1 left
    d3 = step_scaled(d1, scattered(741, 512, 90), 742, "float64", 0x3FB)
    return Vector(
        "values-ulp-shift",
        "ulp-shift values (feature values-ulp-shift): updates of one size in value of "
        "bfloat16, float16, float32 and float64 tensors, shifts at the cap and across zero, "
        "ulp and rans next to ulp-shift",
        8,
        [
            (0, float_family(a0, b0, c0, d0, e0, f0)),
            (1, float_family(a1, b1, c1, d1, e1, f1)),
            (2, float_family(a2, b1, c1, d1, e1, f1)),
            (3, float_family(a2, b1, c1, d3, e1, f1)),
        ],
        features=("values-rans", "values-ulp", "values-ulp-shift"),
    )


def checkpoint_files() -> Vector:
    """Checkpoint files (FORMAT.md §3.5.6) beside the tensors of a base and its deltas: sent
    once and listed again, changed, dropped, and a version without files."""
    a0 = weights(1001, "bfloat16", 256)
    b0 = weights(1002, "float32", 16)
    a1 = nudge(a0, scattered(1003, 256, 6), 1004)
    a2 = nudge(a1, scattered(1005, 256, 6), 1006)
    b3 = nudge(b0, scattered(1007, 16, 2), 1008)
    a4 = nudge(a2, scattered(1009, 256, 6), 1010)

    def state(a: np.ndarray, b: np.ndarray) -> State:
        return {
            "model.embed_tokens.weight": Spec("bfloat16", (16, 16), a),
            "model.norm.weight": Spec("float32", (16,), b),
        }

    config = b'{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":16}'
    tokenizer_config = b'{"bos_token":"<s>","eos_token":"</s>","model_max_length":64}'
    config2 = config[:-1] + b',"rope_theta":500000.0}'
    template = b"{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\n"
    return Vector(
        "checkpoint-files",
        "checkpoint files beside the tensors (feature checkpoint-files): a base carrying "
        "config.json and tokenizer_config.json, a delta listing them again (not sent again), "
        "a delta with a new config.json, a second base that drops tokenizer_config.json and "
        "adds chat_template.jinja, and a delta without files",
        9,
        [
            (0, state(a0, b0)),
            (1, state(a1, b0)),
            (2, state(a2, b0)),
            (3, state(a2, b3)),
            (4, state(a4, b3)),
        ],
        base_every=3,
        files=[
            {"config.json": config, "tokenizer_config.json": tokenizer_config},
            None,
            {"config.json": config2, "tokenizer_config.json": tokenizer_config},
            {"chat_template.jinja": template, "config.json": config},
            {},
        ],
    )


def default_codings() -> Vector:
    """What a writer sends by default (FORMAT.md §12): every writer feature while no reader
    record limits it, each coding per tensor only where it is smaller; then reader records,
    one of a reader that cannot read its old bits, and no coding against the old bits."""
    a0 = weights(1101, "bfloat16", 64 * 64)
    b0 = weights(1102, "bfloat16", 32 * 32)
    c0 = weights(1103, "float32", 256)
    d0 = uniform_bits(1104, "int16", 512)
    e0 = weights(1105, "bfloat16", 32 * 32)

    def state(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> State:
        return {
            "model.embed_tokens.weight": Spec("bfloat16", (64, 64), a),
            "model.layers.0.mlp.down_proj.weight": Spec("bfloat16", (32, 32), b),
            "model.layers.0.input_layernorm.weight": Spec("float32", (256,), c),
            "model.layers.0.steps": Spec("int16", (512,), d),
            "lm_head.weight": Spec("bfloat16", (32, 32), e0),
        }

    # v1: an optimizer step of the small weights of a (classed positions, values by update
    # size), random XORs of b (rans or planes), one-ulp steps of a run of c (ranges, ulp), an
    # integer tensor d (rice, rans), e unchanged
    a1 = step_scaled(a0, below(a0, "bfloat16", 0x7A, 1111, 3), 1112, "bfloat16", 0x7C)
    b1 = flip(b0, scattered(1113, 1024, 40), 1114, 0x7FFF)
    c1 = step_ulps(c0, run(100, 40), 1115, 4)
    d1 = flip(d0, scattered(1116, 512, 30), 1117, 0x3)
    # v2: a second step of a, decoded against the bits v1 left
    a2 = step_scaled(a1, below(a1, "bfloat16", 0x7A, 1121, 3), 1122, "bfloat16", 0x7C)
    # v3 (after a reader that cannot read its old bits recorded so): a third step of a and
    # more one-ulp steps of c, coded without the old bits
    a3 = step_scaled(a2, below(a2, "bfloat16", 0x7A, 1131, 3), 1132, "bfloat16", 0x7C)
    c3 = step_ulps(c1, run(10, 30), 1133, 4)
    updated = _stamp(CLOCK_START - timedelta(days=1))
    return Vector(
        "default-codings",
        "the writer's default features (FORMAT.md §12): with no reader records, every "
        "feature, each coding per tensor where it is smaller (classed positions and update-"
        "sized values for a step of small weights, rans or planes for random XORs, ranges "
        "and ulp values for a run of one-ulp steps, rice and rans for an integer tensor, "
        "compressed manifests with implicit parents); before v3 a reader records that it "
        "cannot read its old bits (and one record lists no features): v3 uses no coding "
        "against the old bits",
        10,
        [
            (0, state(a0, b0, c0, d0)),
            (1, state(a1, b1, c1, d1)),
            (2, state(a2, b1, c1, d1)),
            (3, state(a3, b1, c3, d1)),
        ],
        features=None,
        records={
            3: [
                ReaderRecord(
                    reader_id="engine-0",
                    updated=updated,
                    reads_baseline=False,
                    features=tuple(sorted(KNOWN_FEATURES)),
                ),
                ReaderRecord(reader_id="trainer-eval", updated=updated),
            ]
        },
    )


def _per_tensor_states() -> tuple[list[tuple[int, State]], tuple[str, ...]]:
    """The versions of the vectors of codings against the old bits per tensor, and the names
    of their q_proj, k_proj, up_proj, input_layernorm and steps tensors."""
    q0 = weights(1201, "bfloat16", 64 * 64)
    k0 = weights(1202, "bfloat16", 32 * 32)
    u0 = weights(1203, "bfloat16", 32 * 32)
    n0 = weights(1204, "float32", 256)
    d0 = uniform_bits(1205, "int16", 512)
    q, k, u = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    )
    n, d = "model.layers.0.input_layernorm.weight", "model.layers.0.steps"

    def state(*t: np.ndarray) -> State:
        return {
            q: Spec("bfloat16", (64, 64), t[0]),
            k: Spec("bfloat16", (32, 32), t[1]),
            u: Spec("bfloat16", (32, 32), t[2]),
            n: Spec("float32", (256,), t[3]),
            d: Spec("int16", (512,), t[4]),
        }

    def stepped(bits: np.ndarray, seed: int) -> np.ndarray:
        return step_scaled(bits, below(bits, "bfloat16", 0x7A, seed, 3), seed + 1, "bfloat16", 0x7C)

    # v1 and v2: steps of the small weights of q, k and u (classed positions and ulp-shift
    # values pay for each), one-ulp steps of a run of n (ulp values), flipped low bits of d
    q1, k1, u1 = stepped(q0, 1211), stepped(k0, 1213), stepped(u0, 1215)
    n1, d1 = step_ulps(n0, run(20, 40), 1217, 4), flip(d0, scattered(1218, 512, 30), 1219, 0x3)
    q2, k2, u2 = stepped(q1, 1221), stepped(k1, 1223), stepped(u1, 1225)
    n2 = step_ulps(n1, run(120, 30), 1227, 4)
    versions = [
        (0, state(q0, k0, u0, n0, d0)),
        (1, state(q1, k1, u1, n1, d1)),
        (2, state(q2, k2, u2, n2, d1)),
    ]
    return versions, (q, k, u, n, d)


def _engine_records(first: dict[str, Any], second: dict[str, Any]) -> list[ReaderRecord]:
    """The reader records of the per-tensor vectors, written a day before the chain: two
    engines that read the old bits of some tensors only (``first``, with its features
    listed; ``second``, without: every feature), each saying which in the members given,
    and a trainer's evaluation that reads every tensor's."""
    updated = _stamp(CLOCK_START - timedelta(days=1))
    return [
        ReaderRecord(
            reader_id="engine-0",
            updated=updated,
            reads_baseline=False,
            features=tuple(sorted(KNOWN_FEATURES)),
            **first,
        ),
        ReaderRecord(reader_id="engine-1", updated=updated, reads_baseline=False, **second),
        ReaderRecord(reader_id="trainer-eval", updated=updated),
    ]


def baseline_names() -> Vector:
    """Codings against the old bits per tensor (FORMAT.md §3.6 ``baseline_names``, §12.1):
    reader records that read the old bits of only some tensors; a writer's default codes
    against the old bits exactly the tensors every record reads the old bits of."""
    versions, (q, k, _, n, d) = _per_tensor_states()
    return Vector(
        "baseline-names",
        "codings against the old bits per tensor (FORMAT.md §3.6 baseline_names, §12.1): "
        "before v1 two reader records that read the old bits of some tensors only, listed in "
        "baseline_names (engine-0: k_proj, input_layernorm, q_proj, steps; engine-1: "
        "input_layernorm, q_proj, steps) and one that reads them all; the writer's default "
        "codes q_proj (classed, ulp-shift) and input_layernorm (ulp) against the old bits, and "
        "k_proj and up_proj, whose steps are alike, without them; v2 decodes against the bits "
        "v1 left",
        11,
        versions,
        features=None,
        records=_listing_records(q, k, n, d),
    )


def _listing_records(
    q: str, k: str, n: str, d: str, *, reads_changed: bool = False
) -> dict[int, list[ReaderRecord]]:
    """The records of baseline-names, put before v1: engine-0 lists k_proj, input_layernorm,
    q_proj and steps, engine-1 all but k_proj (and, with ``reads_changed``, says it reads
    the old bits of each changed element of the rest)."""
    second: dict[str, Any] = {"baseline_names": tuple(sorted((n, q, d)))}
    if reads_changed:
        second["reads_changed"] = True
    return {1: _engine_records({"baseline_names": tuple(sorted((k, n, q, d)))}, second)}


def baseline_except() -> Vector:
    """Codings against the old bits of every tensor but some (FORMAT.md §3.6
    ``baseline_except``, §12.1): two reader records that each read the old bits of every
    tensor but one; a writer's default codes against the old bits every tensor but those
    two."""
    versions, (_, k, u, _, _) = _per_tensor_states()
    return Vector(
        "baseline-except",
        "codings against the old bits of every tensor but some (FORMAT.md §3.6 "
        "baseline_except, §12.1): the versions of baseline-names; before v1 two reader records "
        "that read the old bits of every tensor but those they list in baseline_except "
        "(engine-0: k_proj; engine-1: up_proj) and one that reads them all; the writer's "
        "default codes q_proj (classed, ulp-shift) and input_layernorm (ulp) against the old "
        "bits, and k_proj and up_proj, whose steps are alike, without them",
        12,
        versions,
        features=None,
        records={1: _engine_records({"baseline_except": (k,)}, {"baseline_except": (u,)})},
    )


def reads_changed() -> Vector:
    """``ulp`` values for the tensors every record reads the changed elements of (FORMAT.md
    §3.6 ``reads_changed``, §12.1): the records of baseline-names, but the engine whose list
    leaves out ``k_proj`` reads the old bits of each changed element it holds of every
    tensor (a tensor-parallel engine)."""
    versions, (q, k, _, n, d) = _per_tensor_states()
    return Vector(
        "reads-changed",
        "ulp values for the tensors whose changed elements every record reads (FORMAT.md "
        "§3.6 reads_changed, §12.1): the versions and records of baseline-names, but "
        "engine-1 also says reads_changed (it reads the old bits of each changed element it "
        "holds); the writer's default codes q_proj (classed, ulp-shift) and input_layernorm "
        "(ulp) against the old bits as there, and k_proj, which engine-0 reads whole and "
        "engine-1 at its changed elements, with ulp values but neither classed positions nor "
        "ulp-shift; up_proj without them",
        13,
        versions,
        features=None,
        records=_listing_records(q, k, n, d, reads_changed=True),
    )


VECTORS: tuple[Callable[[], Vector], ...] = (
    base_only,
    xor_deltas,
    mixed,
    values_rans,
    positions_classed,
    values_ulp,
    implicit_parents,
    values_ulp_shift,
    checkpoint_files,
    default_codings,
    baseline_names,
    baseline_except,
    reads_changed,
)

# ------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------


class _Clock:
    """Fixed instants, one second apart, recorded as they are read."""

    def __init__(self) -> None:
        self.readings: list[datetime] = []

    def __call__(self) -> datetime:
        moment = CLOCK_START + timedelta(seconds=len(self.readings))
        self.readings.append(moment)
        return moment


class _Ids:
    """A fixed id sequence; running out is an error (the writer asked for more than planned)."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self._next: Iterator[str] = iter(ids)
        self.used = 0

    def __call__(self) -> str:
        try:
            value = next(self._next)
        except StopIteration:
            raise RuntimeError("the vector's id list is exhausted") from None
        self.used += 1
        return value


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _objects(store_dir: Path) -> list[dict[str, object]]:
    found = []
    for path in sorted(p for p in store_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        key = path.relative_to(store_dir).as_posix()
        found.append({"key": key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return sorted(found, key=lambda o: str(o["key"]))


def _entries(store_dir: Path, version: int) -> dict[str, dict[str, object]]:
    """What the store's manifests say about each tensor of a version (informative)."""
    chain = Chain(open_store(store_dir))
    loaded = chain.record(version)
    out: dict[str, dict[str, object]] = {}
    for manifest in chain.manifests(loaded):
        for entry in manifest.entries:
            out[entry.name] = {
                "op": entry.op,
                "changed": entry.changed,
                "positions": entry.positions.coding if entry.positions else None,
                "values": entry.values.coding if entry.values else None,
                "shard": None
                if entry.values is None
                else manifest.shards[entry.values.shard].path.rsplit("/", 1)[1],
            }
    return out


def write_vector(vector: Vector, out: Path) -> dict[str, object]:
    """Write one vector's store and expected.json under ``out/<name>/``; returns expected."""
    folder = out / vector.name
    store_dir = folder / "store"
    if store_dir.exists():
        shutil.rmtree(store_dir)
    folder.mkdir(parents=True, exist_ok=True)
    clock, ids = _Clock(), _Ids(vector.ids())
    options: dict[str, object] = {}
    options["shard_bytes"] = vector.shard_bytes
    if vector.features is not None:  # the vectors before default-codings pass them always
        options["features"] = vector.features
    writer = DeltaWriter(
        store_dir, base_every=vector.base_every, ops=vector.ops, clock=clock, ids=ids, **options
    )
    versions = []
    listed: dict[str, bytes] = {}
    for number, (step, state) in enumerate(vector.versions):
        given = vector.files[number] if vector.files else None
        for record in vector.records.get(number, ()):
            (store_dir / "readers").mkdir(exist_ok=True)
            (store_dir / "readers" / f"{record.reader_id}.json").write_bytes(record.to_json())
        info = writer.publish(
            [(name, spec.tensor()) for name, spec in state.items()], step=step, files=given
        )
        assert info.version == number
        listed = listed if given is None else given
        tensors = {}
        for name, spec in state.items():
            tensors[name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "fingerprint": tensor_fingerprint(spec.tensor()),
                "sha256": hashlib.sha256(spec.raw_bytes()).hexdigest(),
            }
        expected_state = state_fingerprint(
            (n, t["dtype"], tuple(t["shape"]), t["fingerprint"]) for n, t in tensors.items()
        )
        if expected_state != info.state_fingerprint:
            raise AssertionError(f"{vector.name} v{number}: the writer's state fingerprint differs")
        versions.append(
            {
                "version": number,
                "kind": info.kind,
                "step": step,
                "state_fingerprint": expected_state,
                "tensors": tensors,
            }
        )
        if vector.files:  # the version's checkpoint files, by name
            versions[-1]["files"] = {
                name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                for name, data in sorted(listed.items())
            }
    for version in versions:
        entries = _entries(store_dir, int(version["version"]))  # type: ignore[arg-type]
        tensors = version["tensors"]
        assert isinstance(tensors, dict) and set(entries) == set(tensors)
        version["entries"] = {name: entries[name] for name in tensors}
    assert ids.used == len(ids.ids), "the writer used fewer ids than planned"
    expected = {
        "vector": vector.name,
        "description": vector.description,
        "format_version": 1,
        "zstd": {
            "library": ".".join(str(v) for v in zstandard.ZSTD_VERSION),
            "python-zstandard": zstandard.__version__,
        },
        "writer": {
            "world_size": 1,
            "base_every": vector.base_every,
            "ops": vector.ops,
            "shard_bytes": writer.shard_bytes,
            "zstd_level": writer.zstd_level,
            **({"features": list(vector.features)} if vector.features else {}),
            **({"features": "default"} if vector.features is None else {}),
            "ids": ids.ids,
            "clock": [_stamp(m) for m in clock.readings],
        },
        **(
            {
                "readers": {
                    str(n): [f"readers/{r.reader_id}.json" for r in records]
                    for n, records in vector.records.items()
                }
            }
            if vector.records
            else {}
        ),
        **_readable(vector),
        "versions": versions,
        "objects": _objects(store_dir),
    }
    text = json.dumps(expected, indent=1) + "\n"
    (folder / "expected.json").write_text(text, encoding="utf-8")
    return expected


def _readable(vector: Vector) -> dict[str, object]:
    """For a vector whose records list ``baseline_names`` or ``baseline_except``: the tensors
    of each version from the records on whose old bits every record reads (FORMAT.md §3.6),
    by version."""
    if not any(
        r.baseline_names or r.baseline_except is not None
        for records in vector.records.values()
        for r in records
    ):
        return {}
    out: dict[str, list[str]] = {}
    out_changed: dict[str, list[str]] = {}
    held: dict[str, ReaderRecord] = {}
    for number, (_, state) in enumerate(vector.versions):
        held.update({r.reader_id: r for r in vector.records.get(number, ())})
        if not held:
            continue
        names = set(state)
        changed = set(state)
        for record in held.values():
            if record.baseline_except is not None:
                names -= set(record.baseline_except)
                if not record.reads_changed:
                    changed -= set(record.baseline_except)
            elif not record.reads_baseline:
                names &= set(record.baseline_names or ())
                if not record.reads_changed:
                    changed &= set(record.baseline_names or ())
        out[str(number)] = sorted(names)
        if any(r.reads_changed for r in held.values()):
            out_changed[str(number)] = sorted(changed)
    return {"baseline_names": out, **({"changed_names": out_changed} if out_changed else {})}


def check_coverage(expected: list[dict[str, object]]) -> None:
    """The vectors must keep covering what spec/vectors/README.md promises."""
    ops, codings, dtypes, kinds, value_codings = set(), set(), set(), set(), set()
    facts = set()
    for vector in expected:
        bases = 0
        writer = vector["writer"]
        assert isinstance(writer, dict)
        if "implicit-parents" in writer.get("features", ()):
            facts.add("implicit parents")
        if writer.get("features") == "default" and vector.get("readers"):
            facts.add("default features with reader records")
        readable = vector.get("baseline_names", {})
        read_changed = vector.get("changed_names", readable)
        assert isinstance(readable, dict) and isinstance(read_changed, dict)
        for version in vector["versions"]:  # type: ignore[union-attr]
            if str(version["version"]) not in readable:
                continue
            entries = version["entries"].items()
            whole = {
                n for n, e in entries if e["positions"] == "classed" or e["values"] == "ulp-shift"
            }
            ulp = {n for n, e in entries if e["values"] == "ulp"}
            listed = set(readable[str(version["version"])])
            changed = set(read_changed[str(version["version"])])
            assert whole <= listed, f"coded against the old bits, not read: {whole - listed}"
            assert ulp <= changed, f"ulp values, changed elements not read: {ulp - changed}"
            if ulp - listed:
                facts.add("ulp values for tensors read at their changed elements only")
            plain = {
                name
                for name, e in version["entries"].items()
                if e["op"] == "xor" and e["changed"] and name not in listed
            }
            if (whole | ulp) and plain:
                facts.add("codings against the old bits for some tensors of a version")
        versions = vector["versions"]
        assert isinstance(versions, list)
        listings = [v["files"] for v in versions if "files" in v]
        for before, after in itertools.pairwise(listings):
            if before and after == before:
                facts.add("files listed again")
            if any(before[n] != after[n] for n in set(before) & set(after)):
                facts.add("a file changed")
            if set(before) - set(after):
                facts.add("a file dropped")
        for version in vector["versions"]:  # type: ignore[union-attr]
            kinds.add(version["kind"])
            bases += version["kind"] == "base"
            if version["kind"] == "delta" and all(
                e["changed"] == 0 for e in version["entries"].values()
            ):
                facts.add("version without changes")
            used = {e["values"] for e in version["entries"].values() if e["values"]}
            if used >= {"planes", "rans"}:
                facts.add("planes next to rans")
            if "ulp" in used and used & {"planes", "rans"}:
                facts.add("ulp next to rans or planes")
            if "ulp-shift" in used and used >= {"ulp", "rans"}:
                facts.add("ulp-shift next to ulp and rans")
            placed = {e["positions"] for e in version["entries"].values() if e["positions"]}
            if placed >= {"rice", "classed"}:
                facts.add("rice next to classed")
            for name, entry in version["entries"].items():
                tensor = version["tensors"][name]
                if entry["values"]:
                    value_codings.add(entry["values"])
                if entry["values"] == "rans" and entry["op"] == "full":
                    facts.add("rans in a base")
                dtypes.add(tensor["dtype"])
                ops.add(entry["op"])
                if entry["positions"]:
                    codings.add(entry["positions"])
                if version["kind"] == "delta" and entry["op"] == "full":
                    facts.add("full in a delta")
                if entry["op"] == "overwrite" and entry["changed"] == 0:
                    facts.add("unchanged overwrite")
                if entry["shard"] not in (None, "shard-00000-00000.dcrs"):
                    facts.add("second shard")
                if tensor["shape"] == []:
                    facts.add("0-d tensor")
                if 0 in tensor["shape"]:
                    facts.add("empty tensor")
        if bases >= 2:
            facts.add("second base")
    missing = []
    missing += sorted({"xor", "overwrite", "full"} - ops)
    missing += sorted({"rice", "ranges", "classed"} - codings)
    missing += sorted({"planes", "rans", "ulp", "ulp-shift"} - value_codings)
    missing += sorted(set(BY_NAME) - dtypes)
    missing += sorted({"base", "delta"} - kinds)
    missing += sorted(
        {
            "version without changes",
            "full in a delta",
            "unchanged overwrite",
            "second shard",
            "0-d tensor",
            "empty tensor",
            "second base",
            "planes next to rans",
            "rans in a base",
            "rice next to classed",
            "ulp next to rans or planes",
            "implicit parents",
            "ulp-shift next to ulp and rans",
            "files listed again",
            "a file changed",
            "a file dropped",
            "default features with reader records",
            "codings against the old bits for some tensors of a version",
            "ulp values for tensors read at their changed elements only",
        }
        - facts
    )
    if missing:
        raise AssertionError(f"the vectors no longer cover: {', '.join(missing)}")


def generate(out: Path) -> list[dict[str, object]]:
    """Write every vector under ``out`` and check their coverage; returns the expectations."""
    out.mkdir(parents=True, exist_ok=True)
    expected = [write_vector(make(), out) for make in VECTORS]
    check_coverage(expected)
    return expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=HERE, help="output folder (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    for vector in generate(args.out):
        total = sum(int(o["size"]) for o in vector["objects"])  # type: ignore[union-attr]
        print(
            f"{vector['vector']}: {len(vector['versions'])} versions, "  # type: ignore[arg-type]
            f"{len(vector['objects'])} objects, {total} bytes"  # type: ignore[arg-type]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
