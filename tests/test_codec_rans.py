"""The ``rans`` value coding (FORMAT.md §7.3, §7.4): bit-exact against the spec's reference
coder, strict on hostile streams, used only where allowed, and gated by its feature."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr_format.chain.chain import Chain
from dcr_format.codings import rans, values
from dcr_format.codings.positions import encode_positions
from dcr_format.delta.delta import XOR, apply_delta, decode_delta, encode_tensor
from dcr_format.errors import ArgumentError, SchemaError, UnsupportedFeatureError, ValuesError
from dcr_format.format import features, schema
from dcr_format.format.dtypes import info_for
from dcr_format.store.store import open_store
from dcr_format.sync._plan import stream_limits

SPEC_VALUES = [1, 1, 3, 1, 1, 7, 1, 1, 3, 1, 0x8001, 1, 1, 1, 3, 1]
SPEC_STREAM = "02050101160602000020b5a900000000800701"


def ulp_like(seed: int, count: int, width: int = 2) -> np.ndarray:
    """XOR values of an optimizer step: mostly 1, 3, 7 (one-ulp carries), some others."""
    rng = np.random.default_rng(seed)
    carries = rng.geometric(0.5, count)
    out = (np.left_shift(1, np.minimum(carries, 8 * width - 1)) - 1).astype(np.uint64)
    noise = rng.random(count) < 0.02
    out[noise] = rng.integers(1, 1 << (8 * width), int(noise.sum()), dtype=np.uint64)
    return out.astype(f"<u{width}")


def test_worked_example_of_the_spec() -> None:
    data = np.array(SPEC_VALUES, dtype="<u2")
    model, _ = rans.choose_model(data)
    assert model.table.tolist() == [1, 3] and model.freqs.tolist() == [22, 6, 4]
    assert model.bits == 5
    stream = rans.encode_rans(data, model)
    assert stream.hex() == SPEC_STREAM
    assert rans._encode_reference(data, model) == stream
    for decode in (rans.decode_rans, rans._decode_reference):
        assert decode(bytes.fromhex(SPEC_STREAM), count=16, width=2).tolist() == SPEC_VALUES


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["ulp", "uniform", "constant", "two"])
def test_both_coders_match_the_reference_coder(
    width: int, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(width * 10 + len(kind))
    count = 1500
    if kind == "ulp":
        data = ulp_like(width, count, width)
    elif kind == "uniform":
        high = np.iinfo(np.dtype(f"<u{width}")).max
        data = rng.integers(0, high, count, dtype=np.uint64, endpoint=True).astype(f"<u{width}")
    elif kind == "constant":
        data = np.full(count, 5, dtype=f"<u{width}")
    else:
        top = np.iinfo(np.dtype(f"<u{width}")).max  # the largest table step of the width
        data = rng.choice(np.array([9, top], dtype=f"<u{width}"), count, p=[0.9, 0.1])
    model, estimate = rans.choose_model(data)
    stream = rans.encode_rans(data, model)  # the compiled coder
    assert stream == rans._encode_reference(data, model)
    monkeypatch.setenv("DCR_KERNELS", "torch")  # constriction's AnsCoder
    assert rans.encode_rans(data, model) == stream
    monkeypatch.delenv("DCR_KERNELS")
    assert abs(len(stream) - estimate) <= 8  # the estimate is the writer's guide
    if len(stream) < count * width:  # decodable only where shorter than planes (rule 1)
        for decode in (rans.decode_rans, rans._decode_reference):
            out = decode(stream, count=count, width=width)
            assert out.dtype == np.dtype(f"<u{width}") and np.array_equal(out, data)


@pytest.mark.parametrize("bits", [1, 9, 14, 16, 20, 23, 24])
def test_both_coders_agree_at_every_precision(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(bits)
    size = min(40, (1 << bits) - 1)
    table = np.sort(rng.choice(1 << 16, size, replace=False)).astype("<u2")
    counts = rng.integers(1, 1000, size + 1)
    model = rans.Model(table, rans.quantize(counts, bits), bits)
    symbols = rng.choice(size + 1, 5000, p=counts / counts.sum())
    outside = np.setdiff1d(np.arange(1 << 16), table)[0]  # a value the table lacks: an escape
    data = np.where(symbols < size, table[np.minimum(symbols, size - 1)], outside).astype("<u2")
    stream = rans.encode_rans(data, model)
    assert stream == rans._encode_reference(data, model)
    monkeypatch.setenv("DCR_KERNELS", "torch")
    assert rans.encode_rans(data, model) == stream


@pytest.mark.parametrize("bits", [2, 14, 23])
def test_a_dominant_symbol_codes_as_the_reference_does(bits: int) -> None:
    """One symbol of almost all the probability keeps the state near the top of its range
    (below ``f << 40``), where the compiled coder's multiply by a reciprocal must still
    give the division's quotient."""
    rng = np.random.default_rng(bits)
    table = np.array([3, 9], dtype="<u2")
    counts = np.array([(1 << bits) - 3, 1, 1])
    model = rans.Model(table, rans.quantize(counts, bits), bits)
    data = np.where(rng.random(20000) < 0.999, 3, rng.choice([9, 700], 20000)).astype("<u2")
    stream = rans.encode_rans(data, model)
    assert stream == rans._encode_reference(data, model)
    assert np.array_equal(rans.decode_rans(stream, count=data.size, width=2), data)


def test_reciprocals_divide_exactly() -> None:
    """Every frequency of up to 14 bits, and others up to 24, against quotients at the
    edges of the range the coder divides (below ``2**63``)."""
    native = pytest.importorskip("dcr_format.codings._rans_kernels")
    from numba import njit

    from dcr_format.kernels._native_bits import mul_high

    @njit(cache=False)
    def wrong(divisors: np.ndarray, dividends: np.ndarray) -> int:  # pragma: no cover
        for d in divisors:
            m, length = native._reciprocal(np.uint64(d))
            for x in dividends:
                for dx in (x, np.uint64(d) * (x // np.uint64(d)), x // np.uint64(d)):
                    for near in (dx, dx - np.uint64(1), dx + np.uint64(1)):
                        near &= np.uint64((1 << 63) - 1)
                        got = (mul_high(near, m) + near) >> length
                        if got != near // np.uint64(d):
                            return int(d)
        return 0

    rng = np.random.default_rng(0)
    divisors = np.concatenate(
        [np.arange(1, 1 << 14), rng.integers(1 << 14, 1 << 24, 2000), [(1 << 24) - 1]]
    ).astype(np.uint64)
    edges = np.array([0, 1, 2, (1 << 40) - 1, 1 << 40, (1 << 54) - 1, (1 << 63) - 1], np.uint64)
    dividends = np.concatenate([edges, rng.integers(0, 1 << 63, 24, dtype=np.uint64)])
    assert dividends.dtype == np.uint64
    assert wrong(divisors, dividends) == 0


def test_a_stream_of_symbol_zero_only_has_no_words() -> None:
    data = np.zeros(64, dtype="<u2")  # the table's first value everywhere: the state stays 0
    model, _ = rans.choose_model(data)
    stream = rans.encode_rans(data, model)
    assert len(stream) == 5 and stream[4] == 0  # S, Q, the table, one frequency, W = 0
    assert np.array_equal(rans.decode_rans(stream, count=64, width=2), data)


def test_quantize_sums_to_the_precision_and_keeps_every_symbol() -> None:
    freqs = rans.quantize(np.array([1000, 1, 0, 3]), 10)
    assert int(freqs.sum()) == 1024 and int(freqs.min()) >= 1
    assert freqs.tolist()[1:] == [1 + 1020 // 1004, 1, 1 + 3 * 1020 // 1004]


# --- hostile streams -----------------------------------------------------------------------


def _spec_stream() -> bytearray:
    return bytearray(bytes.fromhex(SPEC_STREAM))


def _mutations() -> list[tuple[str, bytes, int]]:
    """(what, stream, count) that a reader must refuse; the base stream is the spec's."""
    base = _spec_stream()
    cases: list[tuple[str, bytes, int]] = []

    def with_(offset: int, value: int) -> bytes:
        out = bytearray(base)
        out[offset] = value
        return bytes(out)

    cases.append(("no values", bytes(base), 0))
    cases.append(("not shorter than planes", bytes(base), 9))
    cases.append(("empty", b"", 16))
    cases.append(("header only", bytes(base[:1]), 16))
    cases.append(("table size 0", with_(0, 0), 16))
    cases.append(("precision 0", with_(1, 0), 16))
    cases.append(("precision 25", with_(1, 25), 16))
    cases.append(("2^Q <= S", with_(1, 1), 16))
    cases.append(("table value over the width", bytes(base[:3] + b"\xff\xff\x03" + base[4:]), 16))
    cases.append(("table truncated", bytes(base[:3]), 16))
    cases.append(("overlong table varint", bytes(base[:3] + b"\x81\x00" + base[4:]), 16))
    cases.append(("table varint over 10 bytes", bytes(base[:3] + b"\x80" * 10 + base[3:]), 16))
    cases.append(("zero frequency", with_(4, 0), 16))
    cases.append(("frequencies leave no escape", with_(4, 26), 16))
    cases.append(("overlong frequency", bytes(base[:4] + b"\x96\x00" + base[5:]), 16))
    cases.append(
        ("frequency over 4 bytes", bytes(base[:4] + b"\x80\x80\x80\x80\x01" + base[5:]), 16)
    )
    cases.append(("frequency truncated", bytes(base[:5]), 16))
    cases.append(("overlong word count", bytes(base[:6] + b"\x82\x00" + base[7:]), 16))
    cases.append(("too many words", with_(6, 40), 16))
    cases.append(("words run past the end", with_(6, 5), 16))
    cases.append(("last word zero", bytes(base[:11] + b"\x00" * 4 + base[15:]), 16))
    cases.append(("escapes not whole values", bytes(base[:-1]), 16))
    cases.append(("escape count differs", bytes(base[:-2]), 16))
    # words left over: decode fewer values than were coded (the stream stays shorter)
    cases.append(("words left", bytes(base), 14))  # (15 passes: a trailing symbol 0 is free)
    # a flipped word bit: the decoder runs but does not come back to state 0
    cases.append(("state not zero", with_(8, base[8] ^ 0x10), 16))
    return cases


@pytest.mark.parametrize("what, stream, count", _mutations(), ids=[c[0] for c in _mutations()])
def test_hostile_streams_are_refused(what: str, stream: bytes, count: int) -> None:
    with pytest.raises(ValuesError):
        rans.decode_rans(stream, count=count, width=2)
    with pytest.raises(ValuesError):
        rans._decode_reference(stream, count=count, width=2)
    with pytest.raises(ValuesError):
        values.decode_values("rans", stream, count=count, width=2)


def _streams_for_pairs(width: int) -> list[tuple[bytes, np.ndarray]]:
    """Streams of several lengths (one and many symbols where the width lets a stream be
    shorter than its planes), with escapes, and one at a precision above 16 (decoded by
    search, not by lookup)."""
    out = []
    for seed, count in ((1, 1), (2, 7), (3, 3000), (4, 5001)):
        data = ulp_like(seed, count, width)
        model, _ = rans.choose_model(data)
        if seed == 4:  # a smaller table than the values need: the rest are escapes
            model = rans.Model(model.table[:2], rans.quantize(np.array([5, 4, 3]), 12), 12)
        out.append((rans.encode_rans(data, model), data))
    data = ulp_like(5, 2500, width)
    model, _ = rans.choose_model(data)
    counts = np.array([int((data == v).sum()) for v in model.table] + [0]) + 1
    out.append(
        (rans.encode_rans(data, rans.Model(model.table, rans.quantize(counts, 20), 20)), data)
    )
    return [(stream, data) for stream, data in out if len(stream) < data.size * width]


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_two_streams_at_once_decode_as_each_alone(width: int) -> None:
    """decode_rans_pair alternates the symbols of two streams while both have some: every
    pair of lengths (either longer), escapes in either, a searched table in either."""
    streams = _streams_for_pairs(width)
    assert len(streams) >= 3 and any(stream[1] > 16 for stream, _ in streams)
    for (a, want_a), (b, want_b) in itertools.product(streams, repeat=2):
        got_a, got_b = rans.decode_rans_pair((a, want_a.size), (b, want_b.size), width=width)
        assert got_a is not None and got_b is not None
        assert got_a.dtype == want_a.dtype and np.array_equal(got_a, want_a)
        assert got_b.dtype == want_b.dtype and np.array_equal(got_b, want_b)


@pytest.mark.parametrize("what, stream, count", _mutations(), ids=[c[0] for c in _mutations()])
def test_a_hostile_stream_of_a_pair_is_left_to_decode_alone(
    what: str, stream: bytes, count: int
) -> None:
    """A stream of a pair that breaks a rule comes back as None (decode_rans then gives its
    error), on either side, and its peer decodes all the same."""
    good, want = _streams_for_pairs(2)[2]
    first, second = rans.decode_rans_pair((stream, count), (good, want.size), width=2)
    assert first is None and second is not None and np.array_equal(second, want)
    first, second = rans.decode_rans_pair((good, want.size), (stream, count), width=2)
    assert second is None and first is not None and np.array_equal(first, want)


def test_an_entry_takes_its_rans_values_decoded_ahead() -> None:
    """decode_delta with ``symbols`` (its ulp values' rans stream decoded already, as
    rans_part finds it) gives the change it decodes itself; symbols of another shape or
    width, or for an entry without rans values, are a caller's error."""
    from dcr_format.codings.ulp_shift import assemble
    from dcr_format.delta.delta import rans_part
    from dcr_format.format.names import ULP, ULP_SHIFT

    info = info_for(torch.bfloat16)
    z = ulp_like(9, 500, 2)
    model, _ = rans.choose_model(z)
    coded = rans.encode_rans(z, model)
    positions = encode_positions(np.arange(0, 4 * z.size, 4, dtype=np.int64))
    for coding, stream in ((ULP, coded), (ULP_SHIFT, assemble(3, coded, b""))):
        part = rans_part(XOR, info, z.size, (coding, stream))
        assert part is not None and bytes(part) == coded
        alone = decode_delta(XOR, info, 4096, z.size, positions=positions, values=(coding, stream))
        ahead = decode_delta(
            XOR, info, 4096, z.size, positions=positions, values=(coding, stream), symbols=z.copy()
        )
        assert torch.equal(alone.values, ahead.values) and alone.shift == ahead.shift
        assert torch.equal(alone.positions, ahead.positions)
        for wrong in (z[1:], z.astype(np.uint32)):  # another count, another width
            with pytest.raises(ValueError, match="symbols"):
                decode_delta(
                    XOR, info, 4096, z.size, positions=positions, values=(coding, stream),
                    symbols=wrong,
                )  # fmt: skip
    assert rans_part(XOR, info, z.size, ("rans", coded)) is None
    assert rans_part(XOR, info, z.size, (ULP_SHIFT, b"\x00")) is None  # refused by decode_delta
    assert rans_part(XOR, info_for(torch.int16), z.size, (ULP, coded)) is None
    with pytest.raises(ValueError, match="symbols"):
        decode_delta(
            XOR, info, 4096, z.size, positions=positions, values=("rans", coded), symbols=z
        )


def test_random_garbage_never_escapes_as_another_error() -> None:
    rng = np.random.default_rng(7)
    good = bytes.fromhex(SPEC_STREAM)
    for _ in range(300):
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        try:
            out = rans.decode_rans(bytes(data), count=16, width=2)
        except ValuesError:
            continue
        assert out.shape == (16,)  # a stream that decodes gives exactly its values


# --- the writer's choice and the feature ------------------------------------------------------


def test_planes_unless_rans_is_allowed() -> None:
    data = ulp_like(1, 5000)
    assert values.encode_values(data)[0] == "planes"
    coding, stream = values.encode_values(data, codings=("planes", "rans"))
    assert coding == "rans" and len(stream) < 0.3 * data.size * 2
    allowing = ("planes", *features.EncodeOptions.allowing(["values-rans", "pieces"]).codings)
    assert values.encode_values(data, codings=allowing)[0] == "rans"
    assert values.encode_values(data, codings=("planes",))[0] == "planes"
    out = values.decode_values(coding, stream, count=data.size, width=2)
    assert np.array_equal(out, data)


def test_encode_options_allow_rans_only_where_they_are_passed() -> None:
    data = torch.from_numpy(ulp_like(9, 2000).view(np.int16)).view(torch.bfloat16)
    allowed = features.EncodeOptions.allowing(["values-rans", "manifest-zstd"])
    assert allowed.codings == {"rans"} and allowed.features == ("values-rans",)
    assert encode_tensor(data, options=allowed).values_coding == "rans"
    assert encode_tensor(data).values_coding == "planes"  # nothing carried over


def test_planes_where_rans_does_not_pay() -> None:
    rng = np.random.default_rng(3)
    uniform = rng.integers(0, 1 << 16, 4000, dtype=np.uint64).astype("<u2")
    few = ulp_like(2, rans.MIN_VALUES - 1)
    for data in (uniform, few):
        assert values.encode_values(data, codings=("planes", "rans"))[0] == "planes"


def test_arrays_past_the_word_count_limit_stay_planes() -> None:
    huge = np.broadcast_to(np.uint16(1), (rans.MAX_VALUES + 1,))  # no memory: a view
    assert not rans.worth_trying(huge)
    assert rans.max_words(rans.MAX_VALUES) < 1 << 28  # its word count fits a 4-byte varint


def test_large_arrays_are_sampled_first() -> None:
    rng = np.random.default_rng(4)
    weights = rng.integers(0x3000, 0x4000, rans.SAMPLE_ABOVE + 5, dtype=np.uint64).astype("<u2")
    assert not rans.worth_trying(weights)  # 4096 values: most would escape
    assert rans.worth_trying(ulp_like(5, rans.SAMPLE_ABOVE + 5))


def test_bad_codings_and_features_are_argument_errors() -> None:
    with pytest.raises(ArgumentError):
        values.encode_values(np.zeros(4, "<u2"), codings=("huffman",))
    with pytest.raises(ArgumentError):
        features.writer_features(["positions-classed-typo"])
    assert features.writer_features(["values-rans"]) == {"values-rans"}
    assert features.writer_features(["positions-classed"]) == {"positions-classed"}
    assert features.features_for(["planes", None, "rans"]) == ("values-rans",)
    assert features.features_for(["classed", "rice", "rans"]) == (
        "positions-classed",
        "values-rans",
    )
    assert features.features_for(["planes"]) == ()


def test_decode_delta_applies_a_rans_entry() -> None:
    old = torch.arange(4096, dtype=torch.int16).view(torch.bfloat16)
    xor = ulp_like(6, 300)
    positions = np.sort(np.random.default_rng(6).choice(4096, 300, replace=False))
    coding, stream = values.encode_values(xor, codings=("planes", "rans"))
    assert coding == "rans"
    from dcr_format.codings.positions import encode_positions

    pos_coding, pos_stream = encode_positions(positions)
    delta = decode_delta(
        XOR,
        info_for(torch.bfloat16),
        4096,
        300,
        positions=(pos_coding, pos_stream),
        values=(coding, stream),
    )
    target = old.clone()
    apply_delta(target, delta)
    want = old.view(torch.int16).numpy().view(np.uint16).copy()
    want[positions] ^= xor
    assert np.array_equal(target.view(torch.int16).numpy().view(np.uint16), want)


def _manifest(features: list[str], coding: str = "rans") -> bytes:
    entry = {
        "name": "w",
        "dtype": "bfloat16",
        "shape": [64],
        "op": "xor",
        "changed": 20,
        "positions": {"shard": 0, "key": "0.p", "coding": "rice"},
        "values": {"shard": 0, "key": "0.v", "coding": coding},
        "encoded_bytes": 0,
        "fingerprint": "0" * 32,
        "parent_fingerprint": "1" * 32,
    }
    shard = {
        "path": f"objects/{1:020d}/{'a' * 32}/shard-00000-00000.dcrs",
        "sha256": "0" * 64,
        "size": 10,
        "decoded_size": 100,
    }
    manifest = {
        "format_version": 1,
        "required_features": features,
        "chain_id": "c" * 32,
        "version": 1,
        "kind": "delta",
        "attempt": "a" * 32,
        "rank": 0,
        "world_size": 1,
        "shards": [shard],
        "entries": [entry],
    }
    return json.dumps(manifest, separators=(",", ":")).encode()


def _parse(features: list[str], coding: str = "rans") -> schema.Manifest:
    return schema.parse(schema.Manifest, _manifest(features, coding), what="manifest")


def test_the_feature_gates_the_coding(monkeypatch: pytest.MonkeyPatch) -> None:
    assert schema.VALUES_RANS_FEATURE == features.VALUES_RANS_FEATURE == "values-rans"
    manifest = _parse(["values-rans"])
    assert manifest.entries[0].values is not None
    assert stream_limits(manifest)[0]["0.v"] == 40  # the planes bound: rans is shorter
    # listed without the coding is fine; the coding without the feature is not
    stream_limits(_parse(["values-rans"], "planes"))
    with pytest.raises(SchemaError, match="values-rans"):
        stream_limits(_parse([]))
    # a reader without the feature refuses the manifest before reading its entries
    monkeypatch.setattr(schema, "KNOWN_FEATURES", frozenset({schema.PIECES_FEATURE}))
    with pytest.raises(UnsupportedFeatureError, match="values-rans"):
        _parse(["values-rans"])


def test_table_sizes_of_every_candidate_at_once_equal_one_by_one() -> None:
    rng = np.random.default_rng(11)
    for _ in range(100):
        distinct = np.unique(rng.integers(0, 1 << int(rng.integers(4, 64)), 200, dtype=np.uint64))
        rng.shuffle(distinct)  # most frequent first, in any value order
        sizes = np.unique(rng.integers(1, distinct.size + 1, 6))
        one_by_one = [rans._table_bytes(distinct[:s]) for s in sizes]
        assert rans._tables_bytes(distinct, sizes).tolist() == one_by_one


def test_the_constriction_decoder_agrees_with_the_compiled_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    streams = [(stream, count) for _, stream, count in _mutations()]
    for width in (1, 2, 4):
        data = ulp_like(width + 20, 3000, width)
        model, _ = rans.choose_model(data)
        streams.append((rans.encode_rans(data, model), data.size))
    results = []
    for kernels in ("", "torch"):  # compiled, then constriction's AnsCoder
        monkeypatch.setenv("DCR_KERNELS", kernels)
        outcome = []
        for stream, count in streams:
            width = 2 if len(stream) == len(bytes.fromhex(SPEC_STREAM)) else None
            for w in (width,) if width else (1, 2, 4):
                try:
                    outcome.append(rans.decode_rans(stream, count=count, width=w).tolist())
                except ValuesError:
                    outcome.append("refused")
        results.append(outcome)
    assert results[0] == results[1]
    assert results[0].count("refused") >= len(_mutations())


def test_compiled_and_numpy_varint_readers_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(12)
    cases = [
        bytes(rng.integers(0, 256, int(rng.integers(0, 30)), dtype=np.uint8)) for _ in range(300)
    ]
    cases += [b"\x80" * 9 + b"\x01", b"\x80" * 9 + b"\x02", b"\x81\x00", b"\x7f"]

    def read_all() -> list[object]:
        out: list[object] = []
        for data in cases:
            for count, limit in ((1, 4), (3, 10), (2, 1)):
                try:
                    values, end = rans._read_varints(memoryview(data), 0, count, limit, "table")
                    out.append((values.tolist(), end))
                except ValuesError:  # (the messages may name different first faults)
                    out.append("refused")
        return out

    compiled = read_all()
    monkeypatch.setenv("DCR_KERNELS", "torch")
    assert read_all() == compiled


def test_vectorised_varints_equal_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(13)
    values_ = np.concatenate(
        (
            np.array([0, 127, 128, 16383, 16384, (1 << 64) - 1], dtype=np.uint64),
            rng.integers(0, 1 << 63, 200, dtype=np.uint64)
            >> rng.integers(0, 63, 200).astype(np.uint64),
        )
    )
    one_by_one = b"".join(rans._varint(int(v)) for v in values_)
    assert rans._varints(values_) == one_by_one
    monkeypatch.setenv("DCR_KERNELS", "torch")  # the numpy version
    assert rans._varints(values_) == one_by_one
    sizes = np.arange(1, 256)
    assert [rans._model_bits(m, int(s)) for m in (16, 5000, 1 << 30) for s in sizes] == [
        int(b) for m in (16, 5000, 1 << 30) for b in rans._sizes_bits(m, sizes)
    ]


def test_writer_features_are_checked_and_used(tmp_path: Path) -> None:
    from dcr_format import DeltaReader, DeltaWriter, StateDictTarget

    with pytest.raises(ArgumentError):
        DeltaWriter(tmp_path / "bad", features=["values-ranz"])
    writer = DeltaWriter(tmp_path / "store", features=["values-rans"])
    base = torch.arange(8192, dtype=torch.int16).view(torch.bfloat16).reshape(64, 128)
    writer.publish({"w": base})
    step = base.clone()
    flat = step.view(torch.int16).reshape(-1)
    picked = torch.from_numpy(np.random.default_rng(14).choice(8192, 400, replace=False))
    flat[picked] ^= torch.from_numpy(ulp_like(14, 400).astype(np.int16))
    info = writer.publish({"w": step})
    target = StateDictTarget({})
    DeltaReader(tmp_path / "store", target).sync(to=info.version)
    assert torch.equal(target.tensors["w"].view(torch.int16), step.view(torch.int16))
    record = Chain(open_store(tmp_path / "store")).record(info.version).record
    assert record.required_features == ("values-rans",)


def test_compiled_model_choice_equals_the_numpy_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-call compiled model choice and encoder give the numpy reference's model,
    estimate and stream."""
    rng = np.random.default_rng(15)
    arrays = [
        ulp_like(int(seed), int(rng.integers(16, 6000)), int(w))
        for seed, w in zip(range(40), rng.choice([1, 2, 4, 8], 40), strict=True)
    ]
    arrays += [rng.integers(0, 300, 2000).astype("<u2"), np.full(100, 7, dtype="<u4")]
    # the counting histogram (dense widths 1 and 2), more distinct values than a table holds,
    # equal counts across the cut at 255 (ties go to the smaller value), 64-bit extremes
    arrays += [
        rng.integers(0, 1 << 16, 20_000).astype("<u2"),
        rng.integers(0, 256, 5000).astype("<u1"),
        np.repeat(rng.permutation(np.arange(300, dtype="<u4") * 7919), 3),
        rng.integers(0, np.iinfo(np.uint64).max, 600, dtype=np.uint64, endpoint=True),
        np.array([np.iinfo(np.uint64).max] * 9 + [0] * 9, dtype=np.uint64),
        np.array([3] * 16, dtype="<u1"),
    ]

    def choices() -> list[tuple[list[int], list[int], int, float]]:
        out = []
        for data in arrays:
            model, estimate = rans.choose_model(data)
            out.append((model.table.tolist(), model.freqs.tolist(), model.bits, estimate))
        return out

    compiled = choices()
    streams = [rans.encode_rans(data, rans.choose_model(data)[0]) for data in arrays]
    monkeypatch.setenv("DCR_KERNELS", "torch")
    assert choices() == compiled
    for data, stream in zip(arrays, streams, strict=True):
        model = rans.choose_model(data)[0]
        assert rans.encode_rans(data, model) == stream == rans._encode_reference(data, model)


def test_compiled_estimates_count_each_candidates_table_as_the_reference() -> None:
    """Every candidate's table bytes in the compiled estimates (one walk of the values in
    value order) are the reference's (:func:`rans._tables_bytes`): estimates of the same
    counts under two sets of values differ by their table bytes only, and a table of the
    values 0 .. size - 1 costs a byte a value."""
    native = rans._native()
    if native is None:
        pytest.skip("numba is not usable here")
    rng = np.random.default_rng(23)
    for trial in range(30):
        n = int(rng.integers(1, 400))
        distinct = rng.choice(1 << int(rng.integers(9, 40)), n, replace=False).astype(np.uint64)
        if trial % 3 == 0:  # large steps: varints of several bytes
            distinct = distinct * np.uint64(1 << 20)
        counts = np.sort(rng.integers(1, 1000, n))[::-1].astype(np.int64)
        sizes = np.array(sorted({int(s) for s in rans._TABLE_SIZES if s <= n} | {n}))
        bits = np.full(sizes.size, 20, dtype=np.int64)
        total = int(counts.sum()) + int(rng.integers(0, 50))
        plain = np.arange(n, dtype=np.uint64)  # each candidate's table is 0 .. size - 1
        by_value = np.argsort(np.argsort(distinct)).astype(np.int64)  # each value's rank
        got = native.estimates(distinct, counts, by_value, total, 2, sizes, bits)
        base = native.estimates(plain, counts, np.arange(n, dtype=np.int64), total, 2, sizes, bits)
        assert np.array_equal(got - base + sizes, rans._tables_bytes(distinct, sizes))


def test_compiled_frequency_order_is_the_sort_by_what_each_count_leaves() -> None:
    """The compiled table order (a counting sort where the counts are small, else a sort of
    keys) is the stable sort by decreasing count: ties keep the smaller value first."""
    from dcr_format.codings import _rans_kernels

    if rans._native() is None:
        pytest.skip("numba is not usable here")
    rng = np.random.default_rng(31)
    for trial in range(300):
        n = int(rng.integers(1, 600))
        if trial % 3 == 0:  # a few large counts: the sort of keys
            counts = rng.integers(1, 1 << 20, n)
        else:  # mostly ones and twos, many ties
            counts = rng.geometric(rng.uniform(0.2, 0.9), n)
        counts = counts.astype(np.int64)
        expected = np.lexsort((np.arange(n), -counts))
        got = _rans_kernels._most_frequent_first(counts)
        assert np.array_equal(got, expected)
        assert np.array_equal(got, _rans_kernels._ascending(int(counts.sum()) - counts, n))


def test_compiled_least_estimate_is_the_first_least_of_all_estimates() -> None:
    """The compiled choice estimates only the table sizes its entropy bound does not rule
    out: its pick and estimate are still the first least of every candidate's estimate,
    across widths, value spreads and counts (ties and near ties included)."""
    from dcr_format.codings import _rans_kernels

    if rans._native() is None:
        pytest.skip("numba is not usable here")
    rng = np.random.default_rng(29)
    for trial in range(400):
        width = int(rng.choice([1, 2, 4, 8]))
        n = int(rng.integers(1, 3000))
        kind = trial % 4
        if kind == 0:
            data = rng.geometric(rng.uniform(0.02, 0.9), n)
        elif kind == 1:
            data = rng.integers(0, int(rng.integers(1, 600)), n)
        elif kind == 2:
            data = rng.zipf(rng.uniform(1.2, 3.0), n)
        else:  # small values and a tail of large ones (XOR bits)
            tail = rng.integers(0, 1 << min(62, 8 * width - 1), max(1, n // 7))
            data = np.concatenate([rng.geometric(0.3, n), tail])
        values = (data.astype(np.int64) % (1 << min(62, 8 * width))).astype(f"<u{width}")
        distinct, counts = _rans_kernels._distinct(values, width)
        order = np.lexsort((distinct, -counts))[: rans.MAX_TABLE]
        ranks = np.argsort(np.argsort(distinct))[order].astype(np.int64)
        distinct, counts = distinct[order], counts[order].astype(np.int64)
        sizes = np.array(
            sorted({int(s) for s in rans._TABLE_SIZES if s <= distinct.size} | {distinct.size})
        )
        bits = rans._sizes_bits(values.size, sizes).astype(np.int64)
        every = _rans_kernels.estimates(distinct, counts, ranks, values.size, width, sizes, bits)
        by_value = _rans_kernels._ascending(ranks, int(sizes[-1]))
        best, least = _rans_kernels._least(
            distinct, counts, by_value, values.size, width, sizes, bits
        )
        assert (best, least) == (int(np.argmin(every)), every.min())
        table, _, q, estimate = _rans_kernels.choose(
            values, width, rans._TABLE_SIZES_NP, rans.MAX_TABLE, rans.WRITER_MODEL_BITS
        )
        assert (table.size, q, estimate) == (sizes[best], bits[best], least)


@pytest.mark.parametrize("bits", [17, 24])
def test_precisions_above_the_writers_decode_by_search(bits: int) -> None:
    data = ulp_like(16, 4000)
    model, _ = rans.choose_model(data)
    counts = np.array([int((data == v).sum()) for v in model.table] + [0]) + 1
    precise = rans.Model(model.table, rans.quantize(counts, bits), bits)
    stream = rans.encode_rans(data, precise)
    assert stream == rans._encode_reference(data, precise) and stream[1] == bits
    assert np.array_equal(rans.decode_rans(stream, count=data.size, width=2), data)
    assert np.array_equal(rans._decode_reference(stream, count=data.size, width=2), data)


def _large_past_the_sample(rng: np.random.Generator) -> np.ndarray:
    """70,000 small values with 9,000 large ones where the 64-value sample does not look."""
    values = rng.geometric(0.5, 70_000).astype(np.uint16)
    step = values.size // 64
    where = np.array([i for i in range(1, values.size, 7) if i % step][:9000])
    values[where] = rng.integers(256, 1 << 16, where.size)
    return values


def test_compiled_histogram_equals_the_numpy_one() -> None:
    """The compiled histogram (values below 256 counted in bins, eight per value taken by
    position, the others sorted) gives numpy's values and counts, for few and for many
    distinct values, on both sides of 256, lengths that are not whole rounds of eight, and
    widths 1, 2, 4 and 8."""
    from dcr_format.codings import _rans_kernels

    rng = np.random.default_rng(41)
    cases = [
        rng.geometric(0.3, 9000).astype(np.uint16),
        rng.integers(0, 1 << 16, 70_000).astype(np.uint16),
        np.full(10_000, 65535, dtype=np.uint16),
        rng.integers(0, 256, 5000).astype(np.uint8),
        rng.geometric(0.3, 500).astype(np.uint16),
        rng.integers(0, 1 << 32, 3000).astype(np.uint32),
        rng.integers(250, 262, 1001).astype(np.uint16),  # both sides of the bins
        np.array([255, 256, 255, 256, 0, 65535, 255], dtype=np.uint16),
        np.array([7], dtype=np.uint8),
        rng.geometric(0.5, 12_345).astype(np.uint64) << np.uint64(rng.integers(0, 2)),
        np.concatenate([rng.geometric(0.5, 999), rng.integers(1 << 40, 1 << 62, 17)]).astype(
            np.uint64
        ),
        # many narrow values, mostly large by the sample (a full tensor: one bin per value),
        # or small by the sample with many large ones after it (those counted in bins too)
        rng.integers(0, 1 << 16, 20_000).astype(np.uint16),
        _large_past_the_sample(rng),
    ]
    for data in cases:
        width = data.dtype.itemsize
        distinct, counts = _rans_kernels._distinct(data, width)
        order = np.lexsort((distinct, -counts))[: rans.MAX_TABLE]
        expected = rans._histogram(data, width)
        assert np.array_equal(distinct[order], expected[0])
        assert np.array_equal(counts[order], expected[1])
