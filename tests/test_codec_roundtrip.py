"""Property tests: every codec round trip is bit-exact for every dtype and bit pattern."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mutated_streams import coded, outcome
from mutated_streams import kernels as coded_on
from safetensors import safe_open
from safetensors.numpy import load as safetensors_load

from dcr_format.codings import positions as pos_codec
from dcr_format.codings.ulp import FLOAT_DTYPES
from dcr_format.codings.values import decode_values, encode_values
from dcr_format.delta.delta import (
    FULL,
    OVERWRITE,
    XOR,
    DecodedDelta,
    apply_delta,
    changed_positions,
    decode_delta,
    encode_tensor,
    undo_delta,
)
from dcr_format.format.dtypes import BY_NAME, BY_TORCH, DTYPE_NAMES, UNSIGNED_NP, bits_view
from dcr_format.format.names import PLANES, POSITION_CODINGS, RANGES, RICE
from dcr_format.format.shard import (
    SHARD_FORMAT,
    decode_shard,
    encode_shard,
    pack_streams,
    unpack_streams,
)

PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# (exponent bits, mantissa bits) of each floating dtype, to build special bit patterns
FLOAT_LAYOUT = {
    "float16": (5, 10),
    "bfloat16": (8, 7),
    "float32": (8, 23),
    "float64": (11, 52),
    "float8_e4m3fn": (4, 3),
    "float8_e5m2": (5, 2),
}


def special_patterns(name: str) -> list[int]:
    """Bit patterns of the values codecs get wrong: NaN payloads, -0.0, +-inf, subnormals."""
    bits = 8 * BY_NAME[name].width
    if name == "bool":
        return [0, 1]
    top = 1 << (bits - 1)
    if name not in FLOAT_LAYOUT:
        return [0, 1, (1 << bits) - 1, top, top - 1]
    exp_bits, man_bits = FLOAT_LAYOUT[name]
    exp_all = ((1 << exp_bits) - 1) << man_bits
    man_all = (1 << man_bits) - 1
    quiet = 1 << (man_bits - 1)
    base = [
        0,  # +0.0 (and -0.0 with the sign below)
        exp_all,  # inf (e4m3fn: a finite value)
        exp_all | 1,  # signalling NaN, smallest payload
        exp_all | quiet,  # canonical quiet NaN
        exp_all | quiet | 1,  # quiet NaN with a payload
        exp_all | man_all,  # NaN, all payload bits
        1,  # smallest subnormal
        man_all,  # largest subnormal
        1 << man_bits,  # smallest normal
        (exp_all - (1 << man_bits)) | man_all,  # largest finite
    ]
    return base + [v | top for v in base]


def random_bits(rng: np.random.Generator, name: str, n: int, special_rate: float) -> np.ndarray:
    """``n`` unsigned bit patterns: uniform over every pattern, with specials mixed in."""
    width = BY_NAME[name].width
    out = np.frombuffer(rng.bytes(n * width), dtype=UNSIGNED_NP[width]).copy()
    if name == "bool":
        out &= 1
    if n and special_rate:
        specials = np.array(special_patterns(name), dtype=UNSIGNED_NP[width])
        where = rng.random(n) < special_rate
        out[where] = rng.choice(specials, int(where.sum()))
    return out


def to_tensor(bits: np.ndarray, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of format dtype ``name`` holding exactly ``bits`` (no value conversion)."""
    info = BY_NAME[name]
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[info.width]
    flat = torch.from_numpy(np.ascontiguousarray(bits).view(signed).copy())
    return flat.view(info.torch_dtype).reshape(shape)


def to_bits(tensor: torch.Tensor) -> np.ndarray:
    """The unsigned bit patterns of a tensor, row-major."""
    width = BY_TORCH[tensor.dtype].width
    flat = bits_view(tensor.contiguous()).reshape(-1)
    return flat.numpy().view(UNSIGNED_NP[width]).copy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_view(a), bits_view(b))


SHAPES = [(), (0,), (1,), (3, 0, 2), (7,), (13,), (2, 3, 5), (1, 1, 1), (257,), (64, 33)]


@st.composite
def tensor_pairs(draw, names=DTYPE_NAMES):
    """(name, old, new, expected changed positions) over every dtype (of ``names``), shape
    and change set."""
    name = draw(st.sampled_from(names))
    shape = tuple(
        draw(
            st.one_of(
                st.sampled_from(SHAPES),
                st.lists(st.integers(0, 12), min_size=1, max_size=3).map(tuple),
            )
        )
    )
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    special_rate = draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))
    old_bits = random_bits(rng, name, n, special_rate)
    kind = draw(st.sampled_from(["none", "one", "range", "scatter", "all"]))
    mask = np.zeros(n, dtype=bool)
    if n and kind == "one":
        mask[draw(st.integers(0, n - 1))] = True
    elif n and kind == "range":
        start = draw(st.integers(0, n - 1))
        mask[start : start + draw(st.integers(1, n))] = True
    elif kind == "scatter":
        mask = rng.random(n) < draw(st.sampled_from([0.001, 0.01, 0.1, 0.5, 0.9]))
    elif kind == "all":
        mask[:] = True
    width = BY_NAME[name].width
    style = draw(st.sampled_from(["random", "low", "special"]))
    flip = np.frombuffer(rng.bytes(n * width), dtype=UNSIGNED_NP[width]).copy()
    if name == "bool":
        flip[:] = 1
    elif style == "low":  # the usual optimizer step: a few low mantissa bits
        flip &= UNSIGNED_NP[width].type(0x7)
    flip[flip == 0] = 1
    new_bits = old_bits.copy()
    new_bits[mask] ^= flip[mask]
    if style == "special" and n:
        candidates = random_bits(rng, name, n, 1.0)
        take = mask & (candidates != old_bits)
        new_bits[take] = candidates[take]
    old = to_tensor(old_bits, name, shape)
    new = to_tensor(new_bits, name, shape)
    return name, old, new, np.flatnonzero(mask)


def through_shard(encoded, info, numel) -> DecodedDelta:
    """Carry an encoded tensor's streams through a real shard, then decode them."""
    streams = {}
    if encoded.positions is not None:
        streams["t.p"] = encoded.positions
    if encoded.values is not None:
        streams["t.v"] = encoded.values
    stored, size = encode_shard(streams)
    got = decode_shard(stored, decoded_size=size)
    assert {k: bytes(v) for k, v in got.items()} == streams
    return decode_delta(
        encoded.op,
        info,
        numel,
        encoded.changed,
        positions=(encoded.positions_coding, got["t.p"]) if "t.p" in got else None,
        values=(encoded.values_coding, got["t.v"]) if "t.v" in got else None,
    )


# --- whole-tensor deltas -----------------------------------------------------------


@PROPERTY
@given(tensor_pairs(), st.sampled_from([None, XOR, OVERWRITE, FULL]))
def test_delta_round_trip_is_bit_exact(pair, op):
    name, old, new, expected = pair
    info = BY_NAME[name]
    assert changed_positions(old, new).tolist() == expected.tolist()
    encoded = encode_tensor(new, old, op=op)
    if op is None:
        assert encoded.op in (XOR, FULL)
    else:
        assert encoded.op == op
    if encoded.op == FULL:
        assert encoded.changed == new.numel()
    else:
        assert encoded.changed == expected.size
    old_before = old.clone()
    delta = through_shard(encoded, info, new.numel())
    target = old.clone()
    saved = apply_delta(target, delta)
    assert same_bits(target, new)
    undo_delta(target, delta, saved)
    assert same_bits(target, old)
    assert same_bits(old, old_before)  # encoding never touches its inputs


@settings(PROPERTY, max_examples=240)
@given(st.one_of(tensor_pairs(FLOAT_DTYPES), tensor_pairs()))  # floats have the most codings
def test_every_pair_of_codings_round_trips_any_bits(pair):
    """Each position coding with each value coding the dtype allows, those coded against
    the old bits included (``classed``, ``ulp``, ``ulp-shift``), brings the old bits to the
    new ones exactly (NaN payloads, -0.0, infinities, subnormals, the extremes), decoded on
    the compiled kernels and on the reference; and both code the same streams."""
    name, old, new, expected = pair
    with coded_on("torch"):
        cases = coded(old, new)
    with coded_on("native"):
        assert [(c.positions, c.values) for c in coded(old, new)] == [
            (c.positions, c.values) for c in cases
        ]
    if not expected.size:
        assert cases == []
        return
    positions = {c.codings[0] for c in cases}
    assert positions == (
        {"rice", "ranges", "classed"} if name in FLOAT_DTYPES else {"rice", "ranges"}
    )
    assert "planes" in {c.codings[1] for c in cases}
    for case in cases:
        for which in ("native", "torch"):
            with coded_on(which):
                got = outcome(case, case.positions[1], case.values[1], case.changed, False)
            assert got == to_bits(new).tobytes(), (case.codings, which)


@PROPERTY
@given(tensor_pairs())
def test_overwrite_is_idempotent(pair):
    """Re-applying an overwrite (a retry) still gives the new bits."""
    name, old, new, _ = pair
    delta = through_shard(encode_tensor(new, old, op=OVERWRITE), BY_NAME[name], new.numel())
    target = old.clone()
    apply_delta(target, delta)
    apply_delta(target, delta)
    assert same_bits(target, new)


@PROPERTY
@given(tensor_pairs())
def test_without_a_baseline_the_tensor_goes_full(pair):
    name, _, new, _ = pair
    encoded = encode_tensor(new)
    assert encoded.op == FULL and encoded.positions is None
    target = torch.zeros_like(new)
    apply_delta(target, through_shard(encoded, BY_NAME[name], new.numel()))
    assert same_bits(target, new)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_non_contiguous_inputs_use_row_major_positions(name):
    rng = np.random.default_rng(7)
    old = to_tensor(random_bits(rng, name, 6 * 5, 0.2), name, (6, 5))
    new_bits = to_bits(old)
    new_bits[[1, 2, 17]] ^= 1
    new = to_tensor(new_bits, name, (6, 5))
    # the same logical tensors, given as transposed views of transposed storage
    old_t, new_t = old.t().contiguous().t(), new.t().contiguous().t()
    assert not old_t.is_contiguous()
    for op in (XOR, OVERWRITE, FULL):
        encoded = encode_tensor(new_t, old_t, op=op)
        target = old.clone()
        apply_delta(target, through_shard(encoded, BY_NAME[name], new.numel()))
        assert same_bits(target, new)


def test_shape_or_dtype_change_goes_full_and_explicit_delta_is_refused():
    old = torch.zeros(4, dtype=torch.float32)
    assert encode_tensor(torch.ones(5), old).op == FULL
    assert encode_tensor(torch.ones(4, dtype=torch.float16), old).op == FULL
    for op in (XOR, OVERWRITE):
        with pytest.raises(ValueError):
            encode_tensor(torch.ones(5), old, op=op)
        with pytest.raises(ValueError):
            encode_tensor(torch.ones(4), None, op=op)
    with pytest.raises(ValueError):
        encode_tensor(torch.ones(4), old, op="add")


# --- automatic op choice --------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([n for n in DTYPE_NAMES if n != "bool"]),
    st.integers(0, 2**32 - 1),
    st.integers(512, 4096),
)
def test_automatic_op_choice(name, seed, n):
    rng = np.random.default_rng(seed)
    width = BY_NAME[name].width
    old_bits = random_bits(rng, name, n, 0.0)
    flip = np.frombuffer(rng.bytes(n * width), dtype=UNSIGNED_NP[width]).copy()
    flip[flip == 0] = 1
    old = to_tensor(old_bits, name, (n,))
    # every element changes to random bits: positions buy nothing, full wins
    everything = encode_tensor(to_tensor(old_bits ^ flip, name, (n,)), old)
    assert everything.op == FULL
    # one percent changes: xor
    some = old_bits.copy()
    picked = rng.choice(n, max(1, n // 100), replace=False)
    some[picked] ^= flip[picked]
    sparse = encode_tensor(to_tensor(some, name, (n,)), old)
    assert sparse.op == XOR and sparse.changed == picked.size


@PROPERTY
@given(tensor_pairs())
def test_overwrite_is_never_chosen_automatically(pair):
    _, old, new, _ = pair
    assert encode_tensor(new, old).op != OVERWRITE
    assert encode_tensor(new).op != OVERWRITE


def test_unchanged_tensor_encodes_to_nothing():
    t = torch.arange(10, dtype=torch.int32)
    encoded = encode_tensor(t.clone(), t)
    assert (encoded.op, encoded.changed, encoded.positions, encoded.values) == (XOR, 0, None, None)
    assert encoded.nbytes == 0


# --- positions ----------------------------------------------------------------------


@st.composite
def position_sets(draw):
    """(sorted unique int64 positions, numel): empty, single, dense runs, scatter, huge."""
    numel = draw(
        st.one_of(st.integers(1, 5000), st.just(2**40), st.integers(1, 2**62), st.just(2**63 - 1))
    )
    chosen: set[int] = set()
    for _ in range(draw(st.integers(0, 4))):  # dense runs
        start = draw(st.integers(0, numel - 1))
        length = draw(st.integers(1, 600))
        chosen.update(range(start, min(numel, start + length)))
    scatter = draw(st.lists(st.integers(0, numel - 1), max_size=300))
    chosen.update(scatter)
    if draw(st.booleans()):
        chosen.update({0, numel - 1})
    return np.array(sorted(chosen), dtype=np.int64), numel


@PROPERTY
@given(position_sets())
def test_positions_round_trip_in_both_codings(case):
    positions, numel = case
    sizes = {}
    for coding in POSITION_CODINGS:
        name, data = pos_codec.encode_positions(positions, coding=coding)
        assert name == coding
        sizes[coding] = len(data)
        got = pos_codec.decode_positions(
            coding, memoryview(data), count=positions.size, numel=numel
        )
        assert got.dtype == np.int64
        assert np.array_equal(got, positions)
    auto, data = pos_codec.encode_positions(positions)
    assert len(data) == min(sizes.values()) == sizes[auto]
    assert np.array_equal(
        pos_codec.decode_positions(auto, data, count=positions.size, numel=numel), positions
    )


@pytest.mark.parametrize(
    "positions",
    [
        [],
        [0],
        [5],
        [2**40 - 1],
        list(range(1000)),
        [*range(10, 20), *range(100, 5000)],
        [3, 2**33, 2**40 - 2, 2**40 - 1],
    ],
)
def test_position_edge_cases_on_a_huge_tensor(positions):
    positions = np.array(positions, dtype=np.int64)
    for coding in (*POSITION_CODINGS, None):
        name, data = pos_codec.encode_positions(positions, coding=coding)
        got = pos_codec.decode_positions(name, data, count=positions.size, numel=2**40)
        assert np.array_equal(got, positions)


def test_positions_past_2_53_stay_exact():
    """Positions beyond float64's exact integers (no float promotion in the coders)."""
    positions = np.array([0, 2**53 + 1, 2**53 + 2, 2**62 + 3, 2**63 - 2], dtype=np.int64)
    for coding in (*POSITION_CODINGS, None):
        name, data = pos_codec.encode_positions(positions, coding=coding)
        got = pos_codec.decode_positions(name, data, count=positions.size, numel=2**63 - 1)
        assert got.tolist() == positions.tolist()


def test_automatic_coding_prefers_ranges_for_runs_and_rice_for_scatter():
    dense = np.arange(10_000, 60_000, dtype=np.int64)
    assert pos_codec.encode_positions(dense)[0] == RANGES
    scatter = np.sort(np.random.default_rng(0).choice(10**7, 5000, replace=False)).astype(np.int64)
    assert pos_codec.encode_positions(scatter)[0] == RICE


# --- values ------------------------------------------------------------------------


@PROPERTY
@given(st.sampled_from([1, 2, 4, 8]), st.integers(0, 2000), st.integers(0, 2**32 - 1))
def test_values_round_trip(width, count, seed):
    rng = np.random.default_rng(seed)
    bits = np.frombuffer(rng.bytes(count * width), dtype=UNSIGNED_NP[width]).copy()
    coding, data = encode_values(bits)
    assert coding == PLANES and len(data) == count * width
    got = decode_values(coding, data, count=count, width=width)
    assert got.dtype == UNSIGNED_NP[width] and got.shape == (count,)
    assert np.array_equal(got, bits)
    assert got.flags.writeable  # owned, so torch.from_numpy takes it without a warning
    got_mv = decode_values(coding, memoryview(data), count=count, width=width)
    assert np.array_equal(got_mv, bits)


def test_values_are_byte_planes_high_byte_first():
    _, data = encode_values(np.array([0x0102, 0x0304], dtype="<u2"))
    assert data == b"\x01\x03\x02\x04"
    _, data = encode_values(np.array([0x0102030405060708], dtype="<u8"))
    assert data == bytes(range(1, 9))
    # signed input keeps its bits
    _, data = encode_values(np.array([-1, 2], dtype=np.int16))
    assert data == b"\xff\x00\xff\x02"


# --- shards -----------------------------------------------------------------------

stream_dicts = st.dictionaries(
    st.text(min_size=0, max_size=24).filter(lambda k: k != "__metadata__"),
    st.binary(max_size=400),
    max_size=8,
)


@PROPERTY
@given(stream_dicts)
def test_shard_round_trip(streams):
    stored, size = encode_shard(streams)
    got = decode_shard(stored, decoded_size=size)
    assert sorted(got) == sorted(streams)
    for key, data in streams.items():
        assert isinstance(got[key], memoryview)
        assert bytes(got[key]) == data
    # deterministic: insertion order and the key set alone decide the bytes
    assert encode_shard(dict(reversed(list(streams.items())))) == (stored, size)


@PROPERTY
@given(stream_dicts)
def test_shard_blob_is_a_safetensors_file(tmp_path_factory, streams):
    blob = pack_streams(streams)
    loaded = safetensors_load(blob)
    assert sorted(loaded) == sorted(streams)
    for key, data in streams.items():
        assert loaded[key].dtype == np.uint8 and loaded[key].shape == (len(data),)
        assert loaded[key].tobytes() == data
    path = tmp_path_factory.mktemp("shard") / "blob.safetensors"
    path.write_bytes(blob)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": SHARD_FORMAT}
    assert {k: bytes(v) for k, v in unpack_streams(blob).items()} == streams


def test_empty_shard():
    stored, size = encode_shard({})
    assert decode_shard(stored, decoded_size=size) == {}
    assert safetensors_load(pack_streams({})) == {}
    assert size % 8 == 0  # the header is padded to 8 bytes, data empty
