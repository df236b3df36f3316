"""The ``classed`` position coding (FORMAT.md §6.5): exact round trips against the old bits,
the compiled kernels equal to the numpy reference byte for byte, hostile streams refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dcr_format.codings import classed
from dcr_format.codings.positions import encode_positions
from dcr_format.errors import PositionsError


def masters(seed: int, count: int) -> np.ndarray:
    """fp32 master weights, N(0, 0.02)."""
    return (np.random.default_rng(seed).standard_normal(count) * 0.02).astype(np.float32)


def bf16(master: np.ndarray) -> np.ndarray:
    """The bf16 bits a trainer publishes (truncated)."""
    return (master.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def weights(seed: int, count: int) -> np.ndarray:
    """bf16 bits of N(0, 0.02) weights (old values)."""
    return bf16(masters(seed, count))


def step_positions(old: np.ndarray, seed: int, lr: float = 1e-6) -> np.ndarray:
    """Where a step of ``lr`` on fp32 masters (the old bits plus a random fraction of an ulp)
    changes the bf16 bits: more often for small weights, whose spacing is finer."""
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 1 << 16, old.size, dtype=np.uint32)
    master = ((old.astype(np.uint32) << np.uint32(16)) | low).view(np.float32)
    moved = master + (lr * rng.choice([-1.0, 1.0], old.size)).astype(np.float32)
    return np.flatnonzero(bf16(moved) != old)


@pytest.fixture(params=["native", "reference"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "reference":
        monkeypatch.setenv("DCR_KERNELS", "torch")
    return str(request.param)


def test_round_trip_and_smaller_than_plain_positions(kernels: str) -> None:
    old = weights(1, 200_000)
    positions = step_positions(old, 2)
    assert 0.005 < positions.size / old.size < 0.2
    stream = classed.encode_classed(positions, old, "bfloat16")
    _, plain = encode_positions(positions)
    assert len(stream) < 0.9 * len(plain)  # the old value predicts the change
    back = classed.decode_classed(stream, old, "bfloat16", count=positions.size, numel=old.size)
    assert back.dtype == np.int64 and np.array_equal(back, positions)


def test_compiled_kernels_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    old = weights(3, 50_000)
    for seed, positions in enumerate(
        (step_positions(old, 4), np.array([0]), np.array([49_999]), np.arange(0, 50_000, 7))
    ):
        native = classed.encode_classed(positions, old, "bfloat16")
        monkeypatch.setenv("DCR_KERNELS", "torch")
        reference = classed.encode_classed(positions, old, "bfloat16")
        monkeypatch.delenv("DCR_KERNELS")
        assert native == reference, seed


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_other_float_widths(dtype: str, kernels: str) -> None:
    rng = np.random.default_rng(5)
    width = {"float16": 2, "float32": 4, "float64": 8}[dtype]
    values = (rng.standard_normal(5000) * 0.02).astype(f"<f{width}")
    old = values.view(f"<u{width}")
    positions = np.sort(rng.choice(5000, 300, replace=False))
    stream = classed.encode_classed(positions, old, dtype)
    back = classed.decode_classed(stream, old, dtype, count=300, numel=5000)
    assert np.array_equal(back, positions)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_other_float_widths_code_the_reference_s_bytes(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled passes (the members of every class from one load of a group of 2, 4 or
    8-byte bits) code the reference's stream and decode its positions, across a partial
    group; from the new bits and the XOR bits too, where changes move elements between
    classes (in the last, partial group as well)."""
    rng = np.random.default_rng(6)
    width = {"float16": 2, "float32": 4, "float64": 8}[dtype]
    values = (rng.standard_normal(3000 + 37) * 0.02).astype(f"<f{width}")
    values[::97] *= 300  # exponents far from the rest, for more classes
    old = values.view(f"<u{width}")
    exponent = classed.exponents(old, dtype)
    chance = np.clip(0.05 * (np.median(exponent) + 4 - exponent), 0.01, 0.9)  # small ones more
    partial = old.size // 64 * 64  # the last, partial group changes throughout
    chance[partial:] = 1
    positions = np.flatnonzero(rng.random(old.size) < chance)
    shift = classed.EXPONENT_FIELDS[dtype][0]
    steps = rng.choice(np.array([-1, 0, 1]), positions.size) << shift  # exponents move by one
    new = old.copy()
    new[positions] = (old[positions].astype(np.int64) + steps + 1).astype(old.dtype)
    xor = old[positions] ^ new[positions]
    native = classed.encode_classed(positions, old, dtype)
    stream = classed.parse_classed(native, count=positions.size, dtype=dtype)
    was, now = (
        classed.classes_of(bits[positions], dtype, stream.base, stream.classes)
        for bits in (old, new)
    )
    assert (was != now).sum() > 50 and (was != now)[positions >= partial].any()
    from_new = classed.encode_classed(positions, new, dtype, xor=xor)
    back = classed.decode_classed(native, old, dtype, count=positions.size, numel=old.size)
    monkeypatch.setenv("DCR_KERNELS", "torch")
    assert classed.encode_classed(positions, old, dtype) == native == from_new
    assert np.array_equal(back, positions)


def test_only_float_dtypes_have_classes() -> None:
    with pytest.raises(PositionsError):
        classed.encode_classed(np.array([1]), np.zeros(4, "<u2"), "int16")
    with pytest.raises(PositionsError):
        classed.decode_classed(b"\x01\x00\x00\x01", np.zeros(4, "<u2"), "int16", count=1, numel=4)


def _good() -> tuple[bytes, np.ndarray, np.ndarray]:
    old = weights(6, 4000)
    positions = step_positions(old, 7)
    return classed.encode_classed(positions, old, "bfloat16"), old, positions


def test_hostile_streams_are_refused(kernels: str) -> None:
    stream, old, positions = _good()
    count, numel = int(positions.size), int(old.size)

    def refused(data: bytes, *, n: int = count, bits: np.ndarray = old) -> None:
        with pytest.raises(PositionsError):
            classed.decode_classed(data, bits, "bfloat16", count=n, numel=numel)

    refused(b"")
    refused(b"\x00" + stream[1:])  # no classes
    refused(b"\x11" + stream[1:])  # 17 classes
    refused(stream[:-1])  # truncated body
    refused(stream + b"\x00")  # trailing bytes
    refused(stream, n=count + 1)  # counts do not add up
    refused(stream, n=0)
    refused(stream, bits=old[:-1])  # not the tensor's old bits
    refused(stream[:3] + b"\x80" * 11 + stream[3:])  # a varint over 10 bytes
    rng = np.random.default_rng(8)
    for _ in range(200):  # random damage: a PositionsError or the right number of positions
        data = bytearray(stream)
        data[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
        try:
            out = classed.decode_classed(bytes(data), old, "bfloat16", count=count, numel=numel)
        except PositionsError:
            continue
        assert out.size == count and bool(np.all(np.diff(out) > 0)) and int(out[-1]) < numel


def test_a_class_cannot_hold_more_positions_than_elements(kernels: str) -> None:
    old = np.array([0x3F80] * 4 + [0x4080] * 4, dtype="<u2")  # exponents 127 and 129
    # FORMAT.md §6.5's example: K = 3, base 127 (the writer would merge them: K = 1)
    stream = classed.classed_stream(127, 3, np.array([0, 2]), np.array([1, 1]))
    assert stream[:6] == b"\x03\x7f\x00\x01\x00\x01"  # K = 3, base 127, counts 1, 0, 1
    assert np.array_equal(classed.decode_classed(stream, old, "bfloat16", count=2, numel=8), [1, 5])
    assert classed.encode_classed(np.array([1, 5]), old, "bfloat16")[:4] == b"\x01\x7f\x00\x02"
    forged = stream[:3] + b"\x05" + stream[4:]  # 5 positions in the first class of 4
    with pytest.raises(PositionsError, match="more positions than a class"):
        classed.decode_classed(forged, old, "bfloat16", count=6, numel=8)


def test_new_bits_and_xor_code_the_same_stream_as_the_old_bits(kernels: str) -> None:
    """A writer whose diff advanced its baseline holds the new bits and the XOR bits only."""
    old = weights(9, 30_000)
    positions = step_positions(old, 10, lr=3e-6)
    new = old.copy()
    rng = np.random.default_rng(11)
    # flip exponent bits too, so that a change moves elements between classes
    xor = rng.choice(np.array([1, 2, 3, 0x80, 0x100], dtype=np.uint16), positions.size)
    new[positions] ^= xor
    from_old = classed.encode_classed(positions, old, "bfloat16")
    assert classed.encode_classed(positions, new, "bfloat16", xor=xor) == from_old
    after = new[positions]  # the new bits at the positions, as a writer's diff can give them
    assert classed.encode_classed(positions, new, "bfloat16", xor=xor, after=after) == from_old
    assert np.array_equal(classed.old_bits_of(new, positions, xor), old)


def test_layout_is_checked_without_the_old_bits() -> None:
    stream, old, positions = _good()
    parsed = classed.parse_classed(stream, count=positions.size, dtype="bfloat16")
    assert sum(parsed.counts) == positions.size and parsed.data == stream
    back = classed.decode_classed(parsed, old, "bfloat16", count=positions.size, numel=old.size)
    assert np.array_equal(back, positions)
    for bad in (stream[:-1], stream + b"\x00", b"\x00" + stream[1:]):
        with pytest.raises(PositionsError):
            classed.parse_classed(bad, count=positions.size, dtype="bfloat16")
    with pytest.raises(PositionsError):
        classed.parse_classed(stream, count=positions.size, dtype="int16")
    assert len(stream) <= classed.classed_bound(positions.size, old.size)


def test_kernels_across_tasks_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three tasks of the compiled passes (one without positions), a partial last group, and
    changes on task and group edges, with the XOR form: the same bytes and positions."""
    from dcr_format.kernels.numba_kernels import TASK

    n = 2 * TASK + 1000 + 37
    old = weights(12, n)
    positions = step_positions(old, 13, lr=2e-6)
    positions = positions[(positions < TASK // 2) | (positions >= TASK + 5)]  # a gap
    edges = np.array([0, 63, 64, TASK - 1, TASK + 5, 2 * TASK, n - 1], dtype=np.int64)
    positions = np.union1d(positions, edges)
    xor = np.random.default_rng(14).choice(np.array([1, 0x80, 0x101], np.uint16), positions.size)
    new = old.copy()
    new[positions] ^= xor
    native = classed.encode_classed(positions, new, "bfloat16", xor=xor)
    after = new[positions]
    assert classed.encode_classed(positions, new, "bfloat16", xor=xor, after=after) == native
    seen = np.zeros(positions.size, dtype=old.dtype)
    back = classed.decode_classed(
        native, old, "bfloat16", count=positions.size, numel=n, old_at=seen
    )
    assert np.array_equal(seen, old[positions])  # the select pass hands over the old bits
    monkeypatch.setenv("DCR_KERNELS", "torch")
    reference = classed.encode_classed(positions, old, "bfloat16")
    assert native == reference
    assert np.array_equal(back, positions)
    seen[:] = 0
    assert np.array_equal(
        classed.decode_classed(
            reference, old, "bfloat16", count=positions.size, numel=n, old_at=seen
        ),
        positions,
    )
    assert np.array_equal(seen, old[positions])
    with pytest.raises(ValueError, match="one element"):
        classed.decode_classed(
            reference, old, "bfloat16", count=positions.size, numel=n, old_at=seen[1:]
        )


def _estimate(everything: np.ndarray, changed: np.ndarray, count: int, base: int) -> float:
    """FORMAT.md §6.5's writer estimate of one (K, base), written out class by class."""
    total = 0.0
    for c in range(count):
        lo = 0 if c == 0 else base + c
        hi = everything.size if c == count - 1 else base + c + 1
        n, k = int(everything[lo:hi].sum()), int(changed[lo:hi].sum())
        total += 8.0
        if k == n:
            total += 0.0 if k == 0 else 8.0
        elif k:
            p = k / n
            total += 1.03 * n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) + 24.0
    return total


def test_the_writer_picks_the_classes_of_least_estimate(kernels: str) -> None:
    """choose_classes (every candidate at once; compiled: integer sums and the search, the
    estimates by numpy) is the rule of FORMAT.md §6.5 evaluated one (K, base) at a time:
    least estimate, the smaller K and then the smaller base on ties."""
    rng = np.random.default_rng(21)
    ks = []
    for trial in range(60):
        width = int(rng.integers(1, 40))
        low = int(rng.integers(0, 256 - width))
        everything = np.zeros(256, dtype=np.int64)
        everything[low : low + width] = rng.integers(0, 5000, width)
        everything[low] = everything[low + width - 1] = max(1, int(rng.integers(1, 5000)))
        rates = rng.uniform(0, 0.3, 256) * (rng.uniform(size=256) < 0.8)
        changed = np.minimum(everything, rng.binomial(everything, rates))
        if trial % 7 == 0:
            changed = everything.copy()  # every element changes somewhere
        top = low + width - 1
        best = None
        for count in range(1, min(16, top - low + 1) + 1):
            for base in range(low, top - count + 2):
                cost = _estimate(everything, changed, count, base)
                if best is None or cost < best[0] - 1e-9:
                    best = (cost, base, count)
        assert best is not None
        assert classed.choose_classes(everything, changed) == best[1:], trial
        ks.append(best[2])
    assert min(ks) == 1 and max(ks) > 4  # merged classes and kept ones both occur
    # one class of unchanged elements next to the few that change: two classes pay
    old = np.array([0x3F80] * 1000 + [0x4080] * 8, dtype="<u2")
    stream = classed.encode_classed(np.array([1001, 1005]), old, "bfloat16")
    assert stream[:3] == b"\x02\x7f\x00"  # K = 2, base 127


def test_the_compiled_choice_of_classes_is_the_reference_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled sums and search of choose_classes give the numpy reference's (base, K),
    ties included (histograms of few values, so that estimates often come out equal)."""
    rng = np.random.default_rng(23)
    for trial in range(400):
        everything = np.zeros(256, dtype=np.int64)
        width = int(rng.integers(1, 60))
        low = int(rng.integers(0, 256 - width))
        scale = int(rng.choice([3, 50, 100_000]))
        everything[low : low + width] = rng.integers(0, scale, width)
        everything[low] = everything[low + width - 1] = 1 + int(rng.integers(0, scale))
        changed = np.minimum(everything, rng.integers(0, 3, 256) * (trial % 3))
        native = classed.choose_classes(everything, changed)
        monkeypatch.setenv("DCR_KERNELS", "torch")
        reference = classed.choose_classes(everything, changed)
        monkeypatch.delenv("DCR_KERNELS")
        assert native == reference, trial


def test_the_compiled_class_estimates_are_the_reference_s_doubles() -> None:
    """The compiled estimate of every interval (its odds, numpy's logarithms of them, then
    the reference's operations in its order) is _rice_bits + CLASS_HEADER_BITS bit for bit,
    over counts from a few to past 2^40, none or all changed."""
    from dcr_format.codings import _classed_kernels as native

    rng = np.random.default_rng(29)
    totals = np.concatenate(
        [rng.integers(0, 8, 3000), rng.integers(0, 1 << 20, 3000), rng.integers(0, 1 << 44, 3000)]
    ).astype(np.int64)
    changes = (totals * rng.random(totals.size) ** 3).astype(np.int64)
    changes[::11] = 0
    changes[::13] = totals[::13]
    odds = native.interval_odds(totals, changes)
    got = native.interval_costs(totals, changes, odds, np.log2(odds), classed.CLASS_HEADER_BITS)
    want = classed._rice_bits(totals, changes) + classed.CLASS_HEADER_BITS
    assert got.tobytes() == want.tobytes()


def test_class_rice_parts_equal_the_reference_at_every_scale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled Rice plans of every class (sums of gap >> k kept in registers) choose the
    k the reference's plan of each class does, also where the search range is clamped at 0
    and at the largest k: the same stream bytes."""
    rng = np.random.default_rng(31)
    for scale, most in (
        (0, 400),
        (1, 400),
        (3, 400),
        (12, 400),
        (30, 400),
        (50, 400),
        (58, 12),
        (60, 4),
    ):
        per_class = []
        for _ in range(4):  # at most ``most`` ranks a class: the last stays below 2^63
            gaps = rng.integers(0, (1 << scale) + 1, int(rng.integers(1, most)), dtype=np.int64)
            per_class.append(np.cumsum(gaps + 1) - 1)  # strictly increasing ranks
        # the classes interleave in position order; each class's ranks stay in theirs
        classes = rng.permutation(np.repeat(np.arange(4), [r.size for r in per_class]))
        ranks = np.empty(classes.size, dtype=np.int64)
        for c, mine in enumerate(per_class):
            ranks[classes == c] = mine
        native = classed.classed_stream(100, 4, classes, ranks)
        monkeypatch.setenv("DCR_KERNELS", "torch")
        reference = classed.classed_stream(100, 4, classes, ranks)
        monkeypatch.delenv("DCR_KERNELS")
        assert native == reference, scale


def test_class_sizes_from_the_exponent_histogram_give_the_counted_stream() -> None:
    """A writer's class sizes come from its histogram of the changes' old exponents (no
    count of the classes): each class's count for every base and K, K = 1 and the
    dtypes' exponent widths included, and the stream with them given (each class's last
    rank looked for from the end: a class whose only change comes first, an empty class)
    is the stream that counts them, past the size where the parts are coded apart too."""
    rng = np.random.default_rng(41)
    for mask in (0x1F, 0xFF, 0x7FF):
        for _ in range(200):
            exponents = np.clip(rng.normal(mask // 2, 4, int(rng.integers(1, 400))), 0, mask)
            exponents = exponents.astype(np.int64)
            changed = np.bincount(exponents, minlength=mask + 1)
            low, top = int(exponents.min()), int(exponents.max())
            count = int(rng.integers(1, min(16, top - low + 1) + 1))
            base = int(rng.integers(low, top - count + 2))
            want = np.bincount(np.clip(exponents - base, 0, count - 1), minlength=count)
            assert np.array_equal(classed.class_sizes(changed, base, count), want)
            # the compiled writer takes them as the class starts of the changes' one row
            starts = classed._native().class_starts(changed.reshape(1, -1), base, count)
            assert np.array_equal(starts[1], want)
    for n in (3000, 200_000):  # one compiled call; past 65,536 changes the parts apart
        classes = rng.integers(0, 12, n).astype(np.uint8)
        classes[classes == 9] = 8  # an empty class
        classes[classes == 11] = 10
        classes[0] = 11  # a class whose only change is the first
        ranks = np.empty(n, dtype=np.int64)
        for c in range(12):
            mine = classes == c
            ranks[mine] = np.cumsum(rng.integers(1, 40, int(mine.sum()))) - 1
        sizes = np.bincount(classes, minlength=12)
        counted = classed.classed_stream(100, 12, classes, ranks)
        assert classed.classed_stream(100, 12, classes, ranks, sizes=sizes) == counted


def test_rice_parts_decode_in_parallel_as_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream with enough ranks codes and decodes its classes' Rice parts on several
    threads (each class into its own slice): the reference's bytes and ranks, and where
    parts break §6.2 the first broken part is reported (so the error is the reference's)."""
    from dcr_format.codings import _classed_rice_kernels as native

    rng = np.random.default_rng(41)
    count = 6
    wanted = [int(n) for n in rng.integers(3_000, 40_000, count)]
    assert sum(wanted) >= native._PARALLEL_RANKS  # the parallel launch, not its serial form
    sizes = np.array([20 * n + 7 for n in wanted], dtype=np.int64)
    per_class = [np.sort(rng.choice(int(sizes[c]), wanted[c], replace=False)) for c in range(count)]
    classes = rng.permutation(np.repeat(np.arange(count), wanted)).astype(np.uint8)
    ranks = np.empty(classes.size, dtype=np.int64)
    for c, mine in enumerate(per_class):
        ranks[classes == c] = mine
    coded = classed.classed_stream(100, count, classes, ranks)
    stream = classed.parse_classed(coded, count=classes.size, dtype="bfloat16")
    got = classed.class_ranks_of(stream, sizes)
    assert np.array_equal(got, np.concatenate(per_class))
    monkeypatch.setenv("DCR_KERNELS", "torch")
    assert classed.classed_stream(100, count, classes, ranks) == coded
    assert np.array_equal(classed.class_ranks_of(stream, sizes), got)
    monkeypatch.delenv("DCR_KERNELS")
    # classes 1 and 4 made too small for their last rank: part 1 is the one reported
    short = sizes.copy()
    short[[1, 4]] = [per_class[1][-1], per_class[4][-1]]
    parts, ks, unary, offsets = np.array(stream.parts, dtype=np.int64).T.copy()
    out = np.empty(classes.size, dtype=np.int64)
    body = np.frombuffer(stream.data, dtype=np.uint8)
    counts = np.asarray(wanted, dtype=np.int64)[parts]
    assert native.rice_ranks(body, ks, unary, offsets, counts, short[parts], out) == 1
    errors = []
    for mode in ("native", "torch"):
        if mode == "torch":
            monkeypatch.setenv("DCR_KERNELS", "torch")
        with pytest.raises(PositionsError) as caught:
            classed.class_ranks_of(stream, short)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


def test_ranks_decoded_ahead_run_in_this_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`classed.with_ranks` (on a fetch worker, whose siblings fill the cores) decodes
    the class parts in its own thread, asked explicitly (``serial=True``), also past the
    size where :func:`classed.class_ranks_of` uses numba's threads by default."""
    from dcr_format.codings import _classed_rice_kernels as native
    from dcr_format.kernels import _launch

    real = native._rice_parts
    launched = []

    def parallel(*args):  # type: ignore[no-untyped-def]
        launched.append(True)
        real.parallel(*args)

    monkeypatch.setattr(native, "_rice_parts", _launch.Kernel(parallel, real.serial))
    rng = np.random.default_rng(43)
    count = 4
    wanted = [int(n) for n in rng.integers(20_000, 30_000, count)]
    assert sum(wanted) >= native._PARALLEL_RANKS
    sizes = np.array([20 * n + 7 for n in wanted], dtype=np.int64)
    per_class = [np.sort(rng.choice(int(sizes[c]), wanted[c], replace=False)) for c in range(count)]
    classes = rng.permutation(np.repeat(np.arange(count), wanted)).astype(np.uint8)
    ranks = np.empty(classes.size, dtype=np.int64)
    for c, mine in enumerate(per_class):
        ranks[classes == c] = mine
    coded = classed.classed_stream(100, count, classes, ranks)
    stream = classed.parse_classed(coded, count=classes.size, dtype="bfloat16")
    ahead = classed.with_ranks(stream, int(sizes.max()))
    assert ahead.ranks is not None and np.array_equal(ahead.ranks, np.concatenate(per_class))
    assert np.array_equal(classed.class_ranks_of(stream, sizes, serial=True), ahead.ranks)
    assert launched == []
    assert np.array_equal(classed.class_ranks_of(stream, sizes), ahead.ranks)
    assert launched == ([True] if _launch.kernel_threads() > 1 else [])


def test_ranks_decoded_ahead_are_taken_only_where_the_class_sizes_bound_them(
    kernels: str,
) -> None:
    """A reader decodes the Rice parts while it fetches, against the tensor's size; once it
    holds the old bits, the class sizes decide: the same ranks where every class's last
    one lies below its size, else the stream is decoded again and refused as it would be
    without them (the same error). A stream that does not decode against the tensor's size
    comes back without ranks."""
    old = weights(12, 60_000)
    positions = step_positions(old, 13, lr=3e-6)
    count, numel = int(positions.size), int(old.size)
    coded = classed.encode_classed(positions, old, "bfloat16")
    stream = classed.parse_classed(coded, count=count, dtype="bfloat16")
    ahead = classed.with_ranks(stream, numel)
    assert stream.ranks is None and ahead.ranks is not None and not ahead.ranks.flags.writeable
    assert classed.with_ranks(ahead, numel) is ahead
    sizes = np.bincount(
        classed.classes_of(old, "bfloat16", stream.base, stream.classes), minlength=stream.classes
    )
    assert classed.class_ranks_of(ahead, sizes) is ahead.ranks  # taken, not decoded again
    assert np.array_equal(ahead.ranks, classed.class_ranks_of(stream, sizes))
    out = classed.decode_classed(ahead, old, "bfloat16", count=count, numel=numel)
    assert np.array_equal(out, positions)
    # a class one element too small for its last rank: refused with the error of the
    # stream decoded against the sizes alone
    c = stream.parts[0][0]
    short = sizes.copy()
    short[c] = int(ahead.ranks[stream.counts[c] - 1])
    errors = []
    for given in (stream, ahead):
        with pytest.raises(PositionsError) as caught:
            classed.class_ranks_of(given, short)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    # a class whose unary bits lost their terminators decodes against no size: no ranks
    # ahead, and the stream is refused as before
    _, _, unary, offset = stream.parts[-1]
    data = coded[:offset] + bytes(unary) + coded[offset + unary :]
    broken = classed.parse_classed(data, count=count, dtype="bfloat16")
    assert classed.with_ranks(broken, numel).ranks is None
    with pytest.raises(PositionsError):
        classed.decode_classed(broken, old, "bfloat16", count=count, numel=numel)


def test_the_select_plan_is_each_class_s_searchsorted_at_each_task_start() -> None:
    """The select pass's plan: per task and class, where the class's ranks at or past the
    task's start begin (``np.searchsorted`` of the class's ranks), and where each task's
    positions go; with classes without ranks, ranks on a task's start, before the first
    and past the last start, and tasks that take none."""
    from dcr_format.codings import _classed_kernels as native

    rng = np.random.default_rng(11)
    count, tasks = 6, 9
    sizes = np.array([5000, 0, 40, 7000, 1, 3000], dtype=np.int64)
    starts = np.zeros((tasks + 1, count), dtype=np.int64)
    for c in range(count):
        inner = np.sort(rng.integers(0, sizes[c] + 1, tasks - 1))
        starts[:, c] = np.concatenate(([0], inner, [sizes[c]]))
    starts[3:5, 0] = starts[3, 0]  # a task with nothing of class 0
    parts = []
    for c in range(count):
        wanted = int(sizes[c] * (0.9 if c == 2 else 0.05))
        ranks = np.sort(rng.choice(sizes[c], wanted, replace=False)) if wanted else []
        ranks = np.union1d(ranks, starts[1:-1, c][starts[1:-1, c] < sizes[c]][:3])
        parts.append(np.asarray(ranks, dtype=np.int64))
    first = np.zeros(count + 1, dtype=np.int64)
    np.cumsum([p.size for p in parts], out=first[1:])
    ranks = np.concatenate(parts)
    cursor, offsets = native._select_plan(ranks, first, starts, count)
    for c in range(count):
        found = first[c] + np.searchsorted(parts[c], starts[:, c])
        assert cursor[:, c].tolist() == found.tolist()
    assert offsets.tolist() == (cursor - first[:-1]).sum(axis=1).tolist()
    assert offsets[-1] == ranks.size


def _float_bits(dtype: str, n: int, seed: int) -> np.ndarray:
    """Unsigned bits of N(0, 0.02) values of ``dtype`` (some of them zero, some huge)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n) * 0.02
    values[rng.integers(0, n, n // 100)] = 0.0
    values[rng.integers(0, n, n // 100)] *= 1e4
    if dtype == "bfloat16":
        return bf16(values.astype(np.float32))
    kind = {"float16": np.float16, "float32": np.float32, "float64": np.float64}[dtype]
    width = np.dtype(kind).itemsize
    return values.astype(kind).view(f"<u{width}")


def _classed_case(
    old: np.ndarray, dtype: str, positions: np.ndarray, base: int, count: int
) -> classed.ClassedStream:
    """The parsed ``classed`` stream of ``positions`` under classes of ``base`` and
    ``count`` (not the writer's choice: any classes must decode)."""
    classes = classed.classes_of(old, dtype, base, count)
    ranks = np.empty(positions.size, dtype=np.int64)
    for c in range(count):
        members = np.flatnonzero(classes == c)
        mine = classes[positions] == c
        ranks[mine] = np.searchsorted(members, positions[mine])
    data = classed.classed_stream(base, count, classes[positions], ranks)
    return classed.parse_classed(data, count=positions.size, dtype=dtype)


def _select(
    old: np.ndarray, dtype: str, stream: classed.ClassedStream, dense: bool, rows: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray]:
    """``positions_of_ranks`` of the dense or the sparse select pass, and the old bits it
    handed over."""
    from dcr_format.codings import _classed_kernels as native

    shift, mask = classed.EXPONENT_FIELDS[dtype]
    starts = native.class_starts(rows, stream.base, stream.classes)
    ranks = classed.class_ranks_of(stream, starts[-1])
    first = np.zeros(stream.classes + 1, dtype=np.int64)
    np.cumsum(stream.counts, out=first[1:])
    seen = np.zeros(ranks.size, dtype=old.dtype)
    found = native.positions_of_ranks(
        old, shift, mask, stream.base, stream.classes, starts, ranks, first, seen, dense=dense
    )
    return found, seen


def test_class_masks_are_each_class_s_members() -> None:
    """_native_bits.class_masks sets bit q of word c exactly where element start + q is of
    class c (the reference's classes_of), for every float width, unaligned starts, bases
    below, inside and past the exponents, and 1 to 16 classes; words past the last class
    stay empty."""
    from numba import njit

    from dcr_format.kernels import _native_bits

    @njit(cache=False)
    def masks(
        bits: np.ndarray, starts: np.ndarray, shift: int, mask: int, base: int, top: int
    ) -> np.ndarray:
        out = np.zeros((starts.size, 16), dtype=np.uint64)
        for i in range(starts.size):
            _native_bits.class_masks(bits, starts[i], shift, mask, base, top, out[i])
        return out

    for dtype, (shift, mask) in classed.EXPONENT_FIELDS.items():
        bits = _float_bits(dtype, 400, 3)
        starts = np.array([0, 1, 7, 64, 200, 400 - 64], dtype=np.int64)
        for base in (0, 1, mask // 2 - 9, mask - 3, mask + 1):
            for count in (1, 2, 9, 16):
                got = masks(bits, starts, shift, mask, base, count - 1)
                classes = classed.classes_of(bits, dtype, base, count)
                for i, start in enumerate(starts):
                    block = classes[start : start + 64]
                    for c in range(16):
                        want = sum(1 << q for q in range(64) if block[q] == c)
                        assert int(got[i, c]) == want, (dtype, base, count, start, c)


@pytest.mark.parametrize("dtype", sorted(classed.EXPONENT_FIELDS))
def test_the_dense_select_pass_finds_what_the_sparse_one_does(dtype: str) -> None:
    """The dense select pass (a bit per member, deposited onto each group's members) and the
    one that follows each class's next wanted rank find the same positions and hand over
    the same old bits: three tasks with a partial last group, 1 to 16 classes, positions
    on task and group edges, and groups with none, a few and nearly every element wanted
    (the stores past a group's last position, and near the end of a task's share)."""
    from dcr_format.kernels import _native_bits
    from dcr_format.kernels.numba_kernels import TASK

    if not _native_bits.has_deposit():
        pytest.skip("no BMI2 (pdep) on this machine or numba's target: no dense pass")
    n = 2 * TASK + 1000 + 37
    old = _float_bits(dtype, n, 21)
    rows = classed.exponent_rows(old, dtype)
    exponents = classed.exponents(old, dtype)
    low = int(np.percentile(exponents, 5))
    rng = np.random.default_rng(22)
    edges = np.array([0, 63, 64, TASK - 1, TASK, TASK + 5, 2 * TASK, n - 64, n - 1])
    for share, count in ((0.001, 1), (0.05, 9), (0.05, 16), (0.7, 4), (0.3, 12)):
        positions = np.union1d(np.flatnonzero(rng.random(n) < share), edges)
        if share > 0.5:  # a stretch of a task where every element is wanted
            positions = np.union1d(positions, np.arange(TASK + 100, TASK + 400))
        stream = _classed_case(old, dtype, positions, low, count)
        sparse, sparse_seen = _select(old, dtype, stream, False, rows)
        dense, dense_seen = _select(old, dtype, stream, True, rows)
        assert sparse is not None and dense is not None
        assert np.array_equal(dense, positions), (share, count)
        assert np.array_equal(sparse, positions)
        assert np.array_equal(dense_seen, old[positions])
        assert np.array_equal(sparse_seen, old[positions])


def test_the_dense_select_pass_refuses_bits_of_other_classes() -> None:
    """Rows of other bits (two elements of different classes swapped across tasks): the
    dense pass finds its classes do not end where the rows say and answers None (the
    sparse pass counts only the positions, so it finds other ones here, which the
    fingerprint check after applying catches); ranks past a class's size are refused
    before either pass runs."""
    from dcr_format.codings import _classed_kernels as native
    from dcr_format.kernels import _native_bits
    from dcr_format.kernels.numba_kernels import TASK

    if not _native_bits.has_deposit():
        pytest.skip("no BMI2 (pdep) on this machine or numba's target: no dense pass")
    n = 2 * TASK + 500
    old = _float_bits("bfloat16", n, 31)
    positions = np.flatnonzero(np.random.default_rng(32).random(n) < 0.05)
    base = int(np.percentile(classed.exponents(old, "bfloat16"), 5))
    stream = _classed_case(old, "bfloat16", positions, base, 9)
    other = old.copy()
    other[10], other[TASK + 10] = old[TASK + 10], old[10]  # each in the other's task
    assert classed.classes_of(old[[10]], "bfloat16", base, 9) != classed.classes_of(
        old[[TASK + 10]], "bfloat16", base, 9
    )
    stale = classed.exponent_rows(other, "bfloat16")
    assert _select(old, "bfloat16", stream, True, stale)[0] is None
    found = _select(old, "bfloat16", stream, False, stale)[0]
    assert found is None or not np.array_equal(found, positions)
    # rows far from the bits, of the same class sizes (the first two tasks' elements in
    # class order): a class's cursor runs thousands of members past its region in a task,
    # and its reads stay in the task's words
    classes = classed.classes_of(old, "bfloat16", base, 9)
    far = old.copy()
    far[: 2 * TASK] = old[: 2 * TASK][np.argsort(classes[: 2 * TASK], kind="stable")]
    rows_far = classed.exponent_rows(far, "bfloat16")
    assert _select(old, "bfloat16", stream, True, rows_far)[0] is None
    rows = classed.exponent_rows(old, "bfloat16")
    starts = native.class_starts(rows, stream.base, stream.classes)
    ranks = classed.class_ranks_of(stream, starts[-1]).copy()
    first = np.zeros(stream.classes + 1, dtype=np.int64)
    np.cumsum(stream.counts, out=first[1:])
    c = int(np.flatnonzero(np.asarray(stream.counts))[-1])
    ranks[first[c + 1] - 1] = starts[-1, c]  # one past the class's last member
    shift, mask = classed.EXPONENT_FIELDS["bfloat16"]
    for dense in (False, True):
        with pytest.raises(ValueError, match="below its size"):
            native.positions_of_ranks(old, shift, mask, base, 9, starts, ranks, first, dense=dense)


def test_the_dense_select_pass_is_taken_where_it_wins() -> None:
    """By default the dense pass runs from one changed element in DENSE_SHARE on, and only
    where the machine's bit deposit is fast."""
    from dcr_format.codings import _classed_kernels as native

    assert native.dense_wins(1000, 1000 * native.DENSE_SHARE)
    assert not native.dense_wins(999, 1000 * native.DENSE_SHARE)
    assert native._DEPOSIT_FAST == _native_bits_fast()


def _native_bits_fast() -> bool:
    from dcr_format.kernels import _native_bits

    return bool(_native_bits.fast_deposit())


@pytest.mark.parametrize("picker", ["table", "deposit"])
def test_the_select_pass_finds_every_set_bit_of_a_word(picker: str) -> None:
    """The select pass picks the k-th member of a class within a group of 64 from the
    group's mask, with a byte table (_select_bit) or, where the machine has BMI2, one bit
    deposit (deposit_select; the kernels take it where fast_deposit() says so): every k of
    words dense, sparse and at the edges, against the bits listed one by one."""
    from numba import njit

    from dcr_format.codings import _classed_kernels as native
    from dcr_format.kernels import _native_bits

    if picker == "deposit" and not _native_bits.has_deposit():
        pytest.skip("no BMI2 (pdep) on this machine or numba's target: kernels use the table")
    pick = native._select_bit if picker == "table" else _native_bits.deposit_select

    @njit(cache=False)
    def select_all(words: np.ndarray, ks: np.ndarray, out: np.ndarray) -> None:
        for i in range(words.size):
            out[i] = pick(words[i], ks[i])

    rng = np.random.default_rng(5)
    words = rng.integers(0, 2**63, 300, dtype=np.uint64) << np.uint64(1)
    words |= rng.integers(0, 2, 300, dtype=np.uint64)
    words[:100] &= rng.integers(0, 2**63, 100, dtype=np.uint64)  # sparser
    edges = [2**64 - 1, 1, 2**63, 0xFF00, 0x8000000000000001, 0x0101010101010101]
    words = np.concatenate([words[words != 0], np.array(edges, dtype=np.uint64)])
    members = [[i for i in range(64) if int(w) >> i & 1] for w in words]
    pairs = [
        (w, k, bit) for w, bits in zip(words, members, strict=True) for k, bit in enumerate(bits)
    ]
    ws = np.array([p[0] for p in pairs], dtype=np.uint64)
    ks = np.array([p[1] for p in pairs], dtype=np.int64)
    out = np.empty(ws.size, dtype=np.int64)
    select_all(ws, ks, out)
    assert out.tolist() == [p[2] for p in pairs]


def test_fast_deposit_follows_the_machine_and_numba_target(monkeypatch) -> None:
    """The bit deposit is used only on an x86-64 host with BMI2 whose pdep is fast, and only
    while numba compiles for that host (a NUMBA_CPU_NAME target may lack the instruction)."""
    import llvmlite.binding as llvm

    from dcr_format.kernels import _native_bits as bits

    monkeypatch.setattr(bits.config, "CPU_NAME", None)
    monkeypatch.setattr(bits.config, "CPU_FEATURES", None)
    monkeypatch.setattr(bits.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: {"bmi2": True})
    monkeypatch.setattr(llvm, "get_host_cpu_name", lambda: "znver4")
    assert bits.fast_deposit()
    monkeypatch.setattr(llvm, "get_host_cpu_name", lambda: "znver2")  # microcoded pdep
    assert bits.has_deposit() and not bits.fast_deposit()
    monkeypatch.setattr(llvm, "get_host_cpu_name", lambda: "sapphirerapids")
    assert bits.fast_deposit()
    monkeypatch.setattr(bits.config, "CPU_NAME", "generic")
    assert not bits.has_deposit() and not bits.fast_deposit()
    monkeypatch.setattr(bits.config, "CPU_NAME", None)
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: {"bmi2": False})
    assert not bits.fast_deposit()
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: {"bmi2": True})
    monkeypatch.setattr(bits.platform, "machine", lambda: "aarch64")
    assert not bits.fast_deposit()


def test_plain_size_floor_bounds_the_plain_choice() -> None:
    """The floor a writer compares a ``classed`` stream with is never above the size of the
    stream §6.4 keeps (over scattered, clustered and run-heavy positions, and gap sums
    past 2^53), and within 15% of it for scattered positions (where Rice wins: a floor
    worth comparing with)."""
    from dcr_format.codings.positions import PositionsChoice, plain_size_floor

    rng = np.random.default_rng(43)
    close = []
    for trial in range(600):
        numel = int(rng.choice([50, 5_000, 1 << 20, 1 << 40, 1 << 60]))
        count = int(rng.integers(1, min(numel, 3_000) + 1))
        positions = (
            np.sort(rng.choice(numel, count, replace=False))
            if numel < 1 << 30
            else (np.unique(rng.integers(0, numel, count)))
        )
        if trial % 4 == 0:  # runs
            start = int(rng.integers(0, numel - count + 1))
            positions = np.arange(start, start + count)
            keep = rng.random(count) < 0.7
            keep[0] = True
            positions = positions[keep]
        positions = positions.astype(np.int64)
        runs = 1 + int(np.count_nonzero(np.diff(positions) != 1))
        floor = plain_size_floor(positions.size, int(positions[-1]), runs)
        size = PositionsChoice(positions).size
        assert floor <= size, trial
        if trial % 4 and positions.size > 500 and numel < 1 << 30:  # scattered, Rice wins
            close.append(floor / size)
    assert close and min(close) > 0.85, min(close)


def test_the_rank_pass_counts_the_runs_of_the_positions() -> None:
    """``class_ranks`` also counts the positions that directly follow another (across its
    tasks), the runs the writer's size floor takes; the reference path counts the same."""
    from dcr_format.codings import _classed_kernels as native

    rng = np.random.default_rng(47)
    n = 3 * (1 << 18) + 100
    old = rng.integers(0x3C00, 0x4100, n).astype(np.uint16)
    for positions in (
        np.sort(rng.choice(n, 20_000, replace=False)),
        np.concatenate([np.arange((1 << 18) - 5, (1 << 18) + 5), np.arange(n - 40, n)]),
        np.array([0, 1, 2, n - 1]),
    ):
        positions = positions.astype(np.int64)
        rows = classed.exponent_rows(old, "bfloat16")
        starts = native.class_starts(rows, 120, 6)
        at = old[positions]
        _, _, adjacent = native.class_ranks(old, positions, at, 7, 0xFF, 120, 6, starts)
        assert adjacent == int(np.count_nonzero(np.diff(positions) == 1))
        with pytest.raises(ValueError, match="one element per position"):
            native.class_ranks(old, positions, at[1:], 7, 0xFF, 120, 6, starts)
        runs = classed.encode_classed_counted(positions, old, "bfloat16").runs
        assert runs == positions.size - adjacent


def test_a_classed_stream_below_the_floor_plans_no_plain_coding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the ``classed`` stream is smaller than every plain coding can be, the writer
    does not plan those (a pass over the positions): same entry, no plan made; where it is
    not, the plain plan decides as before."""
    import torch

    from dcr_format.delta import delta
    from dcr_format.format import features

    rng = np.random.default_rng(53)
    n = 1 << 16  # weights over four decades: the small ones change, the classes pay
    scale = 10 ** rng.uniform(-4, 0, n)
    base = torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32))
    step = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 1e-7  # ~5% change
    old, new = base.to(torch.bfloat16), (base + step).to(torch.bfloat16)
    made = []
    real = delta.PositionsChoice

    def counting(positions: np.ndarray) -> object:
        made.append(positions.size)
        return real(positions)

    options = features.EncodeOptions.allowing(["positions-classed"])
    want = delta.encode_tensor(new, old, op="xor", options=options)
    monkeypatch.setattr(delta, "PositionsChoice", counting)
    got = delta.encode_tensor(new, old, op="xor", options=options)
    assert got.positions_coding == "classed" and not made
    assert (got.positions, got.values) == (want.positions, want.values)
    monkeypatch.setattr(delta, "plain_size_floor", lambda *args: 0)  # never below it
    again = delta.encode_tensor(new, old, op="xor", options=options)
    assert made and (again.positions, again.values) == (want.positions, want.values)


def test_the_guesses_of_k_at_once_are_each_class_s_own() -> None:
    """A writer guesses every class's Rice k in one array step (rice_k_guesses); each guess
    is the scalar rule's for that class, at powers of two and just under them too."""
    from dcr_format.codings.positions import _rice_k_guess, rice_k_guesses

    rng = np.random.default_rng(21)
    counts = rng.integers(0, 5000, 4000)
    counts[:5] = [0, 1, 1, 2, 3]
    gaps = rng.integers(0, 1 << 40, counts.size) * (rng.random(counts.size) < 0.5)
    last = counts - 1 + gaps
    # means whose 0.6931 multiple lands at and next to powers of two
    edge = np.exp2(rng.integers(1, 40, 300)) / 0.6931
    counts[-300:] = 1
    last[-300:] = np.floor(edge).astype(np.int64) + rng.integers(-1, 2, 300)
    got = rice_k_guesses(counts.astype(np.int64), last.astype(np.int64))
    want = [
        _rice_k_guess(float(e - (n - 1)) / n) if n else 0
        for n, e in zip(counts.tolist(), last.tolist(), strict=True)
    ]
    assert got.dtype == np.int64 and got.tolist() == want
    # the compiled guesses (no logarithm) agree wherever they are sure, and say where not
    from dcr_format.codings import _classed_rice_kernels as native

    sure = np.empty(counts.size, dtype=np.int64)
    unsure = native.rice_guesses(counts.astype(np.int64), last.astype(np.int64), sure)
    assert unsure == int((sure == -1).sum())
    assert (sure[sure != -1] == got[sure != -1]).all() and (sure != -1).mean() > 0.99
    assert (sure[counts == 0] == 0).all() and (sure[last - (counts - 1) < counts] == 0).all()
    # y = mean * 0.6931 within a few ulps of a power of two: unsure (numpy's logarithm
    # decides); 2^-30 away from it: the exponent, the reference's guess
    for power in (1, 10, 35):
        n = 1 << (60 - power)  # mean * n about 2^60: a step of the last rank is 2^-60 of it
        far = round(2.0**power / 0.6931 * n * 2.0**-30)  # 2^-30 of the mean
        for offset in (-3, -1, 0, 1, 3, -far, far):
            e = round(2.0**power / 0.6931 * n) + n - 1 + offset
            one = np.empty(1, dtype=np.int64)
            native.rice_guesses(np.array([n]), np.array([e]), one)
            reference = rice_k_guesses(np.array([n]), np.array([e]))[0]
            near = abs(offset) < 8
            assert one[0] == (-1 if near else reference), (power, offset)


def test_old_bits_given_at_the_positions_code_the_same_stream(kernels: str) -> None:
    """A writer that holds the old bits at the positions already (``before``, the new bits
    there XOR the change) gets the stream, rows and runs of the call that computes them."""
    old = weights(31, 70_000)
    positions = step_positions(old, 32)
    new = old.copy()
    new[positions] ^= np.uint16(1) + (positions % 3).astype(np.uint16)
    xor = (old ^ new)[positions]
    after = new[positions]
    rows = classed.exponent_rows(old, "bfloat16")
    want = classed.encode_classed_counted(
        positions, new, "bfloat16", xor=xor, after=after, rows=rows
    )
    got = classed.encode_classed_counted(
        positions, new, "bfloat16", xor=xor, after=after, rows=rows, before=after ^ xor
    )
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2] == want[2]


def test_the_scalar_guess_of_k_is_numpy_s_next_to_powers_of_two() -> None:
    """The writer's guess of a Rice k floors numpy's logarithm; taken from the double's
    exponent away from the powers of two, it is the same at them, a step either side of
    them and anywhere between."""
    from dcr_format.codings.positions import _rice_k_guess

    def numpy_guess(mean: float) -> int:
        return max(0, int(np.floor(np.log2(max(mean * 0.6931, 1.0)))))

    rng = np.random.default_rng(5)
    means = [*rng.uniform(0.0, 4.0, 2000), *np.exp(rng.uniform(0.0, 44.0, 20_000))]
    for k in range(62):
        for x in (2.0**k, 2.0**k * (1 + 2.0**-30), 2.0**k * (1 - 2.0**-31)):
            at = x / 0.6931
            means += [at, float(np.nextafter(at, 0.0)), float(np.nextafter(at, np.inf))]
    for mean in means:
        assert _rice_k_guess(float(mean)) == numpy_guess(float(mean)), mean
