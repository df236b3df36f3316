"""The compiled (numba) CPU loops against the numpy/torch reference, bit for bit.

Each test runs the native path (``DCR_KERNELS`` unset: ``auto``) and the reference
(``DCR_KERNELS=torch``, or the reference functions themselves) on the same input and
compares the results exactly, including the errors hostile position streams raise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from dcr_format.codings import positions as pc
from dcr_format.delta import dispatch
from dcr_format.delta import fingerprint as fp
from dcr_format.delta.staged import put_staged, unput_staged
from dcr_format.errors import PositionsError
from dcr_format.format.dtypes import BY_NAME, UNSIGNED_NP, bits_view
from dcr_format.kernels import reference
from dcr_format.kernels.native import native_kernels

native = pytest.importorskip("dcr_format.kernels.numba_kernels")  # numba is a dependency
rice_native = pytest.importorskip("dcr_format.codings._rice_kernels")
prange = pytest.importorskip("numba").prange

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FORMAT_DTYPES = ("bool", "uint8", "int8", "int16", "float16", "bfloat16")
FORMAT_DTYPES += ("int32", "float32", "int64", "float64", "float8_e4m3fn", "float8_e5m2")


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("DCR_KERNELS", raising=False)


def torch_mode(monkeypatch):
    monkeypatch.setenv("DCR_KERNELS", "torch")


def random_bits(n: int, width: int, rng: np.random.Generator) -> torch.Tensor:
    raw = np.frombuffer(rng.bytes(n * width), UNSIGNED_NP[width]).copy()
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[width]
    return torch.from_numpy(raw.view(signed))


def random_positions(rng: np.random.Generator, count: int, numel: int) -> np.ndarray:
    if numel <= 1 << 24:
        return np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
    picked = np.unique(rng.integers(0, numel, count, dtype=np.int64))
    return picked.astype(np.int64)


def position_cases() -> list[tuple[str, np.ndarray, int]]:
    rng = np.random.default_rng(5)
    cases = [("one at 0", np.array([0], np.int64), 1), ("one last", np.array([99], np.int64), 100)]
    for density in (0.9, 0.3, 0.01, 0.0001):
        numel = 200_000
        count = max(1, int(numel * density))
        cases.append((f"random {density}", random_positions(rng, count, numel), numel))
    runs = np.concatenate([np.arange(s, s + 40) for s in range(0, 100_000, 1000)])
    cases.append(("runs", runs.astype(np.int64), 100_000))
    cases.append(("dense", np.arange(50_000, dtype=np.int64), 50_000))
    cases.append(("k past 32", random_positions(rng, 300, 1 << 50), 1 << 50))
    cases.append(
        ("k near 62", np.array([0, (1 << 62) + 5, (1 << 62) + 9], np.int64), (1 << 63) - 1)
    )
    cases.append(("huge first gap", np.array([1 << 40, (1 << 40) + 1], np.int64), 1 << 41))
    return cases


CASES = position_cases()


# --- Rice and the choice of coding ----------------------------------------------------


@pytest.mark.parametrize("name,positions,numel", CASES, ids=[c[0] for c in CASES])
def test_rice_and_choice_match_the_reference(name, positions, numel):
    want = pc._encode_rice_reference(positions)
    assert pc.encode_rice(positions) == want
    assert pc.encode_positions(positions) == pc._encode_positions_reference(positions)
    got = pc.decode_rice(want, count=positions.size, numel=numel)
    assert got.dtype == np.int64 and np.array_equal(got, positions)
    gaps = pc.rice_gaps(want, count=positions.size, numel=numel)
    ref_gaps = pc._rice_gaps_reference(want, count=positions.size, numel=numel)
    assert gaps.dtype == np.uint64 and np.array_equal(gaps, ref_gaps)


def test_rice_decode_at_every_word_edge_and_remainder_width():
    """The decoder reads the unary bits a word at a time and each remainder as one shift of
    a word where 8 bytes fit: streams whose unary part ends at or near a word edge, and
    remainders of every width (those past 56 bits, and those at the stream's end, go
    byte by byte), decode as the reference does."""
    rng = np.random.default_rng(17)
    for k in (0, 1, 5, 8, 31, 55, 56, 57, 62):
        for count in (1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65):
            top = min(1 << k, (1 << 56) // count)  # positions stay below 2^63
            low = rng.integers(0, top, count, dtype=np.int64) if k else np.zeros(count, int)
            gaps = low + (rng.integers(0, 3, count) << k if k < 50 else 0)
            positions = np.cumsum(gaps + 1) - 1
            numel = int(positions[-1]) + 1 + int(rng.integers(0, 5))
            data = _rice_with_k(gaps.tolist(), k)
            want = pc._decode_rice_reference(data, count=count, numel=numel)
            assert np.array_equal(want, positions)  # the stream is what the test means
            assert np.array_equal(pc.decode_rice(data, count=count, numel=numel), positions)
            got = pc.rice_gaps(data, count=count, numel=numel)
            assert np.array_equal(got, pc._rice_gaps_reference(data, count=count, numel=numel))


def _rice_with_k(gaps: list[int], k: int) -> bytes:
    """A rice stream of ``gaps`` with parameter ``k`` (header, unary part, remainders)."""
    unary = []
    for g in gaps:
        unary += [0] * (g >> k) + [1]
    rem = [(g >> (k - 1 - b)) & 1 for g in gaps for b in range(k)]
    head = np.packbits(np.array(unary, np.uint8)).tobytes()
    tail = np.packbits(np.array(rem, np.uint8)).tobytes() if rem else b""
    return pc._RICE_HEADER.pack(k, len(gaps), len(head)) + head + tail


def test_choice_ties_and_sizes_are_exact():
    """The planned sizes are the sizes of the streams the reference builds."""
    rng = np.random.default_rng(9)
    for trial in range(200):
        numel = int(rng.integers(1, 3000))
        count = int(rng.integers(1, numel + 1))
        positions = random_positions(rng, count, numel)
        if trial % 3 == 0:  # runs, where ranges competes
            start = int(rng.integers(0, 50))
            positions = np.arange(start, start + count, dtype=np.int64)[: max(1, count // 2)]
        plan = pc._Plan.of(positions)
        assert plan is not None
        assert plan.rice_size == len(pc._encode_rice_reference(positions))
        assert plan.ranges_size == len(pc.encode_ranges(positions))
        assert plan.k == pc._best_rice_k(pc._gaps(positions))
        want = pc._encode_positions_reference(positions)
        assert pc.encode_positions(positions) == want
        choice = pc.PositionsChoice(positions)  # the size known before anything is encoded
        assert (choice.coding, choice.size) == (want[0], len(want[1]))
        assert choice.encode() == want[1]


def test_empty_positions():
    empty = np.empty(0, np.int64)
    assert pc.encode_rice(empty) == pc._encode_rice_reference(empty)
    assert pc.encode_positions(empty) == pc._encode_positions_reference(empty)
    assert pc.decode_rice(pc.encode_rice(empty), count=0, numel=10).size == 0


def _outcome(fn, *args, **kwargs):
    try:
        return ("ok", fn(*args, **kwargs).tolist())
    except PositionsError as error:
        return ("error", str(error))


def _kernel_accepts(data: bytes, count: int, numel: int, positions: bool) -> bool | None:
    """Whether the compiled checks accept a stream (None: its header is rejected first)."""
    try:
        k, unary_len, body = pc._rice_header(memoryview(data), count)
    except PositionsError:
        return None
    if count == 0:
        return True
    array = np.frombuffer(body, dtype=np.uint8)
    result = rice_native.rice_decode(array, unary_len, count, k, numel, positions=positions)
    return result is not None


def hostile_streams() -> list[tuple[bytes, int, int]]:
    rng = np.random.default_rng(3)
    streams = []
    for numel, count in ((1000, 30), (100_000, 500), (64, 64), (1 << 40, 20)):
        valid = pc._encode_rice_reference(random_positions(rng, count, numel))
        streams.append((valid, count, numel))
        for _ in range(60):
            data = bytearray(valid)
            kind = int(rng.integers(0, 5))
            if kind == 0:  # flip bits in the body
                for _ in range(int(rng.integers(1, 4))):
                    at = int(rng.integers(17, len(data)))
                    data[at] ^= 1 << int(rng.integers(0, 8))
            elif kind == 1:  # a zeroed body byte (a lost terminator)
                data[int(rng.integers(17, len(data)))] = 0
            elif kind == 2:  # a different k (sizes stay consistent only sometimes)
                data[0] = int(rng.integers(0, 64))
            elif kind == 3:  # a smaller numel: positions out of range
                streams.append((valid, count, int(rng.integers(1, numel))))
                continue
            else:  # a byte of ones: extra terminators
                data[int(rng.integers(17, len(data)))] = 0xFF
            streams.append((bytes(data), count, numel))
    # crafted: trailing unary byte, huge quotient, wrap-around of the running end
    streams.append((struct_rice(0, 2, b"\xc0\x00", b""), 2, 100))
    streams.append((struct_rice(1, 1, b"\x00\x00\x01", b"\x00"), 1, 20))
    streams.append((struct_rice(62, 2, b"\x80\x00\x00\x00\x01", b"\xff" * 16), 2, (1 << 63) - 1))
    streams.append((struct_rice(62, 2, b"\x40\x00\x00\x00\x01", b"\xff" * 16), 2, (1 << 63) - 1))
    return streams


def struct_rice(k: int, count: int, unary: bytes, rem: bytes) -> bytes:
    return pc._RICE_HEADER.pack(k, count, len(unary)) + unary + rem


def test_hostile_rice_streams_get_the_same_answer_on_both_paths(monkeypatch):
    for data, count, numel in hostile_streams():
        native_pos = _outcome(pc.decode_rice, data, count=count, numel=numel)
        native_gaps = _outcome(pc.rice_gaps, data, count=count, numel=numel)
        ref_pos = _outcome(pc._decode_rice_reference, data, count=count, numel=numel)
        ref_gaps = _outcome(pc._rice_gaps_reference, data, count=count, numel=numel)
        assert native_pos == ref_pos and native_gaps == ref_gaps
        # the kernel itself rejects exactly the streams the reference rejects (the
        # fallback above would hide a kernel that rejected too much)
        for positions, ref in ((True, ref_pos), (False, ref_gaps)):
            accepted = _kernel_accepts(data, count, numel, positions)
            if accepted is not None:
                assert accepted == (ref[0] == "ok")
    torch_mode(monkeypatch)
    assert native_kernels() is None
    for data, count, numel in hostile_streams()[:40]:
        assert _outcome(pc.decode_rice, data, count=count, numel=numel) == _outcome(
            pc._decode_rice_reference, data, count=count, numel=numel
        )


def test_hostile_streams_include_both_outcomes():
    """The hostile set is not vacuous: some streams decode, most fail, for several reasons."""
    outcomes = [
        _outcome(pc._decode_rice_reference, data, count=count, numel=numel)
        for data, count, numel in hostile_streams()
    ]
    errors = {message for kind, message in outcomes if kind == "error"}
    assert any(kind == "ok" for kind, _ in outcomes)
    assert len(errors) >= 5


def test_torch_mode_and_lazy_import(monkeypatch):
    assert native_kernels() is native
    torch_mode(monkeypatch)
    assert native_kernels() is None
    code = "import sys, dcr_format, dcr_format.cli.main; assert 'numba' not in sys.modules"
    env = {k: v for k, v in os.environ.items() if k != "DCR_KERNELS"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# --- fingerprint ----------------------------------------------------------------------


def random_tensor(name: str, n: int, rng: np.random.Generator) -> torch.Tensor:
    info = BY_NAME[name]
    bits = random_bits(n, info.width, rng)
    if name == "bool":
        bits &= 1
    return bits.view(info.torch_dtype)


@pytest.mark.parametrize("name", FORMAT_DTYPES)
def test_full_pass_matches_torch(name, monkeypatch):
    rng = np.random.default_rng(len(name))
    sizes = (0, 1, 1023, 65535, 65536, 65537, 3 * 65536 + 17)
    tensors = [random_tensor(name, n, rng) for n in sizes]
    tensors.append(random_tensor(name, 6 * 70_001, rng).view(6, 70_001).t())  # non-contiguous
    tensors.append(random_tensor(name, 0, rng).view(0, 5))
    got = [fp.tensor_lanes(t) for t in tensors]
    fingerprints = [fp.tensor_fingerprint(t) for t in tensors]
    torch_mode(monkeypatch)
    assert got == [fp.tensor_lanes(t) for t in tensors]
    assert fingerprints == [fp.tensor_fingerprint(t) for t in tensors]


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("first", [0, 5, (1 << 30) - 70_000, (1 << 31) - 3, (1 << 40) + 65530])
def test_full_pass_from_any_first_index_crosses_the_period(width, first, monkeypatch):
    """A pass whose element 0 has flat index ``first`` (rows then straddle 2^30 multiples
    and row boundaries) equals the per-position sums of the torch ``lanes_at``."""
    rng = np.random.default_rng(width)
    bits = random_bits(140_001, width, rng)
    lanes = 3 if width == 8 else 2
    sym = bits.numpy().view(UNSIGNED_NP[width])
    got = native.full_lanes(sym, fp.native_table(width), lanes, first)
    torch_mode(monkeypatch)
    positions = torch.arange(first, first + bits.numel(), dtype=torch.int64)
    assert got == fp.lanes_at(positions, bits)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_position_lanes_match_torch(width, monkeypatch):
    rng = np.random.default_rng(10 + width)
    positions = torch.from_numpy(random_positions(rng, 150_000, 1 << 33))
    positions = torch.cat([positions, torch.arange((1 << 30) - 10, (1 << 30) + 10)]).unique()
    old, new = (
        random_bits(positions.numel(), width, rng),
        random_bits(positions.numel(), width, rng),
    )
    lanes = tuple(range(7, 7 + (3 if width == 8 else 2)))
    got = (fp.lanes_at(positions, new), fp.lanes_after_change(lanes, positions, old, new))
    empty = fp.lanes_at(positions[:0], new[:0])
    torch_mode(monkeypatch)
    assert got == (fp.lanes_at(positions, new), fp.lanes_after_change(lanes, positions, old, new))
    assert empty == fp.lanes_at(positions[:0], new[:0]) == (0,) * len(lanes)


@pytest.mark.parametrize("name", FORMAT_DTYPES)
def test_torch_fingerprint_paths_keep_their_coverage(name, monkeypatch):
    """On the CPU, test_fingerprint's chunking and accelerator-evaluation tests now reach
    the compiled loops; here the same checks run on the torch paths they were written for."""
    import test_fingerprint as tfp  # the slow Python reference of the documented algorithm

    torch_mode(monkeypatch)
    tfp.test_accelerator_evaluation_matches_reference_on_cpu(name, monkeypatch)
    for row, rows in ((7, 2), (3, 1), (29, 2)):
        tfp.set_chunking(monkeypatch, row, rows)
        for n in tfp.SIZES:
            tensor = tfp.random_tensor(name, (n,), seed=300 + n)
            assert fp.tensor_fingerprint(tensor) == tfp.reference_fingerprint(tensor)
    monkeypatch.delenv("DCR_KERNELS")
    tensor = tfp.random_tensor(name, (2, 3, 50), seed=9)
    assert fp.tensor_fingerprint(tensor) == tfp.reference_fingerprint(tensor)  # native


def test_apply_lane_deltas_is_lane_addition():
    assert fp.apply_lane_deltas((1, 2), (fp.LANE_PRIMES[0] - 1, 5)) == (0, 7)
    with pytest.raises(ValueError):
        fp.apply_lane_deltas((1, 2), (1, 2, 3))


# --- fused diff and apply -------------------------------------------------------------


def changed_pair(n: int, width: int, rate: float, rng: np.random.Generator):
    old = random_bits(n, width, rng)
    new = old.clone()
    mask = torch.from_numpy(rng.random(n) < rate)
    flips = random_bits(int(mask.sum()), width, rng) | 1  # never zero: a real change
    new[mask] ^= flips
    return old, new


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("rate", [0.0, 0.003, 0.2, 1.0])
def test_fused_diff_matches_the_reference(width, rate, monkeypatch):
    rng = np.random.default_rng(int(rate * 1000) + width)
    old, new = changed_pair(native.TASK + 3 * 65536 + 101, width, rate, rng)  # two tasks
    for base in (0, (1 << 30) - 100_000):
        for want_new, want_xor in ((True, True), (True, False), (False, True), (False, False)):
            got = dispatch.diff(old, new, want_new=want_new, want_xor=want_xor, base=base)
            want = reference.diff(old, new, want_new=want_new, want_xor=want_xor, base=base)
            for a, b in zip(
                (got.positions, got.new_values, got.xor_values),
                (want.positions, want.new_values, want.xor_values),
                strict=True,
            ):
                assert (a is None) == (b is None)
                assert a is None or (a.dtype == b.dtype and torch.equal(a, b))
        found, deltas = dispatch.diff_with_lanes(old, new, base=base)
        assert torch.equal(found.positions, reference.diff(old, new, base=base).positions)
        monkeypatch.setenv("DCR_KERNELS", "torch")
        ref_found, ref_deltas = dispatch.diff_with_lanes(old, new, base=base)
        monkeypatch.delenv("DCR_KERNELS")
        assert deltas == ref_deltas and torch.equal(found.xor_values, ref_found.xor_values)
    # with base 0 the deltas carry the old tensor's lanes to the new tensor's
    deltas = dispatch.diff_with_lanes(old, new)[1]
    assert fp.apply_lane_deltas(fp.tensor_lanes(old), deltas) == fp.tensor_lanes(new)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 129, 65539, native.TASK + 70])
@pytest.mark.parametrize("pattern", ["sparse", "dense", "bursts", "ends"])
def test_masked_scan_finds_every_change_in_order(width, n, pattern):
    """The 64-element masks (and the element loop of a last partial group) find exactly
    the differing positions, in order, at any offset; the one-pass outputs are the bits
    there, and ``advance`` makes ``old`` equal ``new``."""
    kind = UNSIGNED_NP[width]
    table = fp.native_table(width)
    lanes = 3 if width == 8 else 2
    rng = np.random.default_rng(n + len(pattern) + width)
    old = rng.integers(0, 1 << 16, n + 8, dtype=np.uint64).astype(kind)
    new = old.copy()
    if pattern == "sparse":
        mask = rng.random(n + 8) < 0.004
    elif pattern == "dense":
        mask = rng.random(n + 8) < 0.3
    elif pattern == "bursts":  # dense stretches between empty ones
        mask = (np.arange(n + 8) // 3000) % 2 == 1
        mask &= rng.random(n + 8) < 0.5
    else:  # the first and last elements of each group of 64 and of the array
        mask = np.zeros(n + 8, dtype=bool)
        mask[::64] = True
        mask[63::64] = True
        mask[n - 1 : n] = True
    # every bit of a change, the top bit alone included
    flips = rng.integers(1, 1 << 16, int(mask.sum()), dtype=np.uint64).astype(kind)
    flips[flips == 0] = 1  # (1-byte lanes: a multiple of 256 would be no change)
    flips[::7] = np.array(1 << (8 * width - 1), dtype=np.uint64).astype(kind)
    new[mask] ^= flips
    for start in (0, 1, 2, 4):
        a, b = old[start : start + n], new[start : start + n]
        want = np.flatnonzero(a != b)
        (positions, new_bits, xor_bits), deltas = native.diff(a, b, 0, (True, True), table, lanes)
        assert np.array_equal(positions, want)
        assert np.array_equal(new_bits, b[want]) and np.array_equal(xor_bits, a[want] ^ b[want])
        moved = a.copy()
        again, again_deltas = native.diff(moved, b, 7, (False, False), table, lanes, advance=True)
        assert np.array_equal(again[0], want + 7) and again[1].size == again[2].size == 0
        assert np.array_equal(moved, b) and len(again_deltas) == len(deltas) == lanes


@pytest.mark.parametrize("name", ["bfloat16", "float32", "float64", "uint8"])
def test_diff_with_lanes_updates_a_fingerprint(name):
    rng = np.random.default_rng(1)
    info = BY_NAME[name]
    old, new = changed_pair(100_000, info.width, 0.05, rng)
    old_t, new_t = old.view(info.torch_dtype), new.view(info.torch_dtype)
    found, deltas = dispatch.diff_with_lanes(bits_view(old_t), bits_view(new_t), want_new=False)
    assert found.new_values is None and found.xor_values is not None
    assert fp.apply_lane_deltas(fp.tensor_lanes(old_t), deltas) == fp.tensor_lanes(new_t)
    assert dispatch.diff_with_lanes(old, new, lanes=False)[1] == ()


def test_diff_of_non_contiguous_views():
    rng = np.random.default_rng(2)
    old, new = changed_pair(2 * 90_001, 2, 0.1, rng)
    old2, new2 = old.view(2, -1).t(), new.view(2, -1).t()
    got = dispatch.diff(old2.reshape(-1), new2.reshape(-1))
    want = reference.diff(old2.reshape(-1), new2.reshape(-1))
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.xor_values, want.xor_values)
    found, deltas = dispatch.diff_with_lanes(old2, new2)
    assert torch.equal(found.positions, want.positions)
    assert deltas == dispatch.diff_with_lanes(old2.reshape(-1), new2.reshape(-1))[1]


def test_no_kernel_sums_more_lane_terms_than_the_fold_allows() -> None:
    """The lane sums fold each term below 2^38 and reduce only at the end of a task or
    chunk: the fused diff's tasks and the apply's chunks hold at most LANE_TERMS changes,
    and that many of the largest folded terms stay below 2^64."""
    largest = (1 << 31) - 1 + 61 * ((1 << 31) - 1)  # t mod 2^31, plus c (t >> 31), t < 2^62
    assert largest < 1 << 38 and native.LANE_TERMS * largest < 1 << 64
    assert max(native.TASK, native._CHUNK) <= native.LANE_TERMS


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("op", ["xor", "overwrite"])
def test_fused_apply_matches_the_reference_and_undoes(width, op, monkeypatch):
    rng = np.random.default_rng(width)
    old, new = changed_pair(3 * 65536 + 7, width, 0.3, rng)
    base = (1 << 30) - 65536
    found = reference.diff(old, new, base=base)
    values = found.xor_values if op == "xor" else found.new_values
    target = old.clone()
    before, deltas = dispatch.apply_with_lanes(target, found.positions, values, op=op, base=base)
    assert torch.equal(target, new)
    assert torch.equal(before, old[found.positions - base])
    ref_target = old.clone()
    ref_before = reference.scatter(ref_target, found.positions, values, op=op, save=True, base=base)
    assert torch.equal(ref_target, target) and torch.equal(ref_before, before)
    monkeypatch.setenv("DCR_KERNELS", "torch")
    ref_target = old.clone()
    ref = dispatch.apply_with_lanes(ref_target, found.positions, values, op=op, base=base)
    monkeypatch.delenv("DCR_KERNELS")
    assert deltas == ref[1] and torch.equal(ref[0], before)
    assert deltas == dispatch.diff_with_lanes(old, new, base=base)[1]
    # undo: xor again, or overwrite with the bits read before
    undo = values if op == "xor" else before
    _, back = dispatch.apply_with_lanes(target, found.positions, undo, op=op, base=base)
    assert torch.equal(target, old)
    assert fp.apply_lane_deltas(deltas, back) == (0,) * len(deltas)


def test_scatter_uses_the_same_apply():
    rng = np.random.default_rng(4)
    old, new = changed_pair(70_000, 2, 0.2, rng)
    found = reference.diff(old, new)
    target = old.clone()
    assert dispatch.scatter(target, found.positions, found.xor_values, op="xor") is None
    assert torch.equal(target, new)
    saved = dispatch.scatter(target, found.positions, found.xor_values, op="xor", save=True)
    assert torch.equal(target, old) and torch.equal(saved, new[found.positions])


def test_apply_refuses_positions_out_of_range():
    flat = torch.zeros(100, dtype=torch.int16)
    values = torch.ones(3, dtype=torch.int16)
    for bad, base in (([3, 5, 100], 0), ([-1, 5, 9], 0), ([9, 20, 30], 10)):
        with pytest.raises(IndexError):
            dispatch.apply_with_lanes(flat, torch.tensor(bad), values, op="xor", base=base)
    assert int(flat.abs().sum()) == 0
    # unsorted, first and last in range: nothing is written (nor past the end)
    flat[1] = 7
    for op in ("xor", "overwrite"):
        with pytest.raises(IndexError, match="strictly increasing"):
            dispatch.apply_with_lanes(flat, torch.tensor([1, 1000, 2]), values, op=op)
        assert flat.tolist() == [0, 7] + [0] * 98
    with pytest.raises(ValueError):
        dispatch.apply_with_lanes(flat, torch.tensor([1]), values[:1], op="add")


FORK_CHILD = """
import os, sys, numba, torch
from dcr_format.delta import fingerprint as fp
from dcr_format.kernels import _launch as launch
from dcr_format.delta import dispatch
from dcr_format.kernels.native import native_kernels
native = native_kernels()
assert native is not None
x = torch.arange(1 << 18, dtype=torch.int32)
old = torch.zeros(3 * native.TASK, dtype=torch.int16)
new = old.clone()
new[::97] = 1
parent = fp.tensor_lanes(x), dispatch.diff_with_lanes(old, new)  # parallel kernels
layer = numba.threading_layer()
pid = os.fork()
if pid == 0:
    # no parallel region in a child of a process that ran one under OpenMP
    assert launch._Launches.serial_only == (layer == "omp"), layer
    found, deltas = dispatch.diff_with_lanes(old, new)
    same = fp.tensor_lanes(x) == parent[0] and deltas == parent[1][1]
    os._exit(0 if same and torch.equal(found.positions, parent[1][0].positions) else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _doubled_sum(a):  # type: ignore[no-untyped-def]
    """Code numba's parallel pipeline would turn into parallel loops: an array made by
    numpy and a slice copy (the kernels have no array expressions: numba compiles those
    in a pipeline of its own)."""
    b = np.zeros(a.size)
    b[:] = a
    total = 0.0
    for i in range(b.size):
        total += 2 * b[i]
    return total


def _prange_sum(a):  # type: ignore[no-untyped-def]
    """A kernel body: its loop over tasks a ``prange``, a reduction across them."""
    total = 0
    for i in prange(a.size):
        total += a[i]
    return total


def test_serial_forms_make_no_parallel_loop():
    """A serial form goes through numba's parallel pipeline with every transformation into
    a parallel loop off: it compiles without numba's warning (errors here) and raises if
    any parallel loop appeared; so does a second one made from the same options (numba
    empties a dict of options as it reads it), at two signatures."""
    from dcr_format.kernels._launch import parallel_kernel

    for kernel in (parallel_kernel(_doubled_sum), parallel_kernel(_doubled_sum)):
        for dtype in (np.float64, np.int32):
            assert kernel.serial(np.arange(5, dtype=dtype)) == 20
        assert len(kernel.serial.signatures) == 2
        assert kernel.parallel.signatures == []  # only what was asked is compiled


def test_one_body_gives_both_forms():
    """:func:`parallel_kernel` compiles one ``prange`` body in parallel and serially, with
    the same results, the serial form under a name of its own (numba's disk cache files
    machine code by name: a shared one would hand one form the other's code)."""
    from dcr_format.kernels._launch import parallel_kernel

    kernel = parallel_kernel(_prange_sum)
    a = np.arange(10_000, dtype=np.int64)
    assert kernel.parallel(a) == kernel.serial(a) == int(a.sum())
    assert kernel.parallel.py_func is _prange_sum
    assert kernel.serial.py_func.__qualname__ == "_prange_sum_serial"
    assert kernel.serial.py_func.__code__ is _prange_sum.__code__


def test_forked_children_can_run_kernels():
    """With GNU OpenMP numba terminates a forked child at its first parallel kernel: a
    child forked after one ran gets the same results from the serial twins."""
    env = {k: v for k, v in os.environ.items() if k not in ("DCR_KERNELS", "NUMBA_THREADING_LAYER")}
    for layer in (None, "workqueue"):
        run_env = env if layer is None else {**env, "NUMBA_THREADING_LAYER": layer}
        result = subprocess.run(
            [sys.executable, "-c", FORK_CHILD],
            env=run_env,
            timeout=120,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_parallel_kernels_from_many_threads():
    rng = np.random.default_rng(6)
    old, new = changed_pair(300_000, 2, 0.05, rng)
    want = reference.diff(old, new)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                got = dispatch.diff(old, new)
                assert torch.equal(got.positions, want.positions)
                fp.tensor_lanes(old)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_diff_that_advances_the_old_tensor(width, mode, monkeypatch):
    """``advance`` leaves ``old`` equal to ``new`` and changes nothing else of the result."""
    if mode == "torch":
        torch_mode(monkeypatch)
    rng = np.random.default_rng(40 + width)
    old, new = changed_pair(2 * 65536 + 13, width, 0.02, rng)
    for base in (0, 5):
        moved = old.clone()
        found, deltas = dispatch.diff_with_lanes(moved, new, base=base, advance=True)
        want, want_deltas = dispatch.diff_with_lanes(old, new, base=base)
        assert torch.equal(moved, new) and deltas == want_deltas
        assert torch.equal(found.positions, want.positions)
        assert torch.equal(found.xor_values, want.xor_values)
        assert torch.equal(found.new_values, want.new_values)
    with pytest.raises(ValueError, match="contiguous"):
        dispatch.diff_with_lanes(old[:-1].view(2, -1).t(), new[:-1].view(2, -1).t(), advance=True)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("op", ["xor", "overwrite"])
def test_staged_change_reads_what_apply_would_write(width, op, monkeypatch):
    """stage_change gives apply_with_lanes' before bits, the bits it writes and its lane
    deltas, on both paths, and never writes; an overwrite of ``after`` is the change."""
    rng = np.random.default_rng(50 + width)
    old, new = changed_pair(3 * 65536 + 5, width, 0.05, rng)
    found = reference.diff(old, new)
    values = found.xor_values if op == "xor" else found.new_values
    results = []
    for mode in ("auto", "torch"):
        if mode == "torch":
            torch_mode(monkeypatch)
        flat = old.clone()
        before, after, deltas = dispatch.stage_change(flat, found.positions, values, op=op)
        assert torch.equal(flat, old)  # read only
        applied = old.clone()
        want_before, want_deltas = dispatch.apply_with_lanes(
            applied, found.positions, values, op=op
        )
        assert torch.equal(before, want_before) and torch.equal(after, new[found.positions])
        assert deltas == want_deltas
        dispatch.scatter(flat, found.positions, after, op="overwrite")
        assert torch.equal(flat, new)
        results.append((before, after, deltas))
    assert results[0][2] == results[1][2] and torch.equal(results[0][1], results[1][1])
    monkeypatch.delenv("DCR_KERNELS")
    with pytest.raises(IndexError):
        dispatch.stage_change(old, found.positions + old.numel(), values, op=op)


@pytest.mark.parametrize("name", ["bfloat16", "float32", "uint8"])
@pytest.mark.parametrize("op", ["xor", "overwrite"])
def test_staged_change_then_put_is_apply_change(name, op):
    """stage_change + put_staged leave the tensor as apply_change does, with its lane
    deltas; unput_staged restores it; full changes are refused."""
    from dcr_format.delta import delta as dl

    info = BY_NAME[name]
    rng = np.random.default_rng(60)
    old, new = changed_pair(70_001, info.width, 0.03, rng)
    found = reference.diff(old, new)
    values = found.xor_values if op == "xor" else found.new_values
    change = dl.DecodedDelta(op, found.positions, values)
    live = old.view(info.torch_dtype).clone()
    staged = dl.stage_change(live, change)
    assert torch.equal(bits_view(live), old)
    replaced = put_staged(live, staged)
    assert torch.equal(replaced, staged.before)
    applied = old.view(info.torch_dtype).clone()
    done = dl.apply_change(applied, change)
    assert torch.equal(bits_view(live), bits_view(applied)) and torch.equal(bits_view(live), new)
    assert staged.lane_deltas == done.lane_deltas and torch.equal(staged.before, done.before)
    unput_staged(live, staged, replaced)
    assert torch.equal(bits_view(live), old)
    with pytest.raises(ValueError, match="full"):
        dl.stage_change(live, dl.DecodedDelta("full", None, new))


def _stats_reference(pos: np.ndarray, klo: int, khi: int):
    gaps = np.diff(pos, prepend=-1) - 1
    sums = [int((gaps >> k).sum()) for k in range(klo, khi + 1)]
    starts = np.flatnonzero((gaps != 0) | (np.arange(pos.size) == 0))
    lengths = np.diff(np.append(starts, pos.size))
    return sums, len(starts), int(gaps.max()), int(lengths.max())


@pytest.mark.parametrize("layout", ["spread", "runs across tasks", "one run"])
def test_rice_stats_merge_runs_across_parallel_tasks(layout):
    """Sums, runs, the largest gap and the longest run match a numpy reference when runs
    cross the parallel tasks' boundaries (_STATS_CHUNK positions each), even a whole task long."""
    rng = np.random.default_rng(70)
    task = rice_native._STATS_CHUNK
    if layout == "spread":
        pos = np.unique(rng.integers(0, 1 << 32, 3 * task + 17, dtype=np.int64))
    elif layout == "runs across tasks":  # runs of ~1000 with random gaps, one spanning a task
        gaps = np.where(rng.random(3 * task + 5) < 0.001, rng.integers(1, 50, 3 * task + 5), 0)
        gaps[task - 10 : 2 * task + 10] = 0
        pos = np.cumsum(gaps + 1) - 1
    else:
        pos = np.arange(5, 5 + 2 * task + 3, dtype=np.int64)
    sums, runs, widest, longest = rice_native.rice_stats(pos, 2, 7)
    want = _stats_reference(pos, 2, 7)
    assert (sums.tolist(), runs, widest, longest) == want


@pytest.mark.parametrize("width", [1, 2, 8])
def test_long_tensors_are_diffed_a_slab_at_a_time(width, monkeypatch):
    """Past SLAB elements the diff goes slab by slab (bounded scratch) with the same
    positions, bits, lane deltas and advance as one pass."""
    rng = np.random.default_rng(80 + width)
    old, new = changed_pair(5 * 65536 + 3, width, 0.01, rng)
    table = fp.native_table(width)
    lanes = 3 if width == 8 else 2
    o, w = old.numpy().view(UNSIGNED_NP[width]), new.numpy().view(UNSIGNED_NP[width])
    whole = native.diff(o, w, 11, (True, True), table, lanes)
    monkeypatch.setattr(native, "SLAB", 2 * 65536)  # three slabs, the last a short one
    moved = o.copy()
    slabs = native.diff(moved, w, 11, (True, True), table, lanes, advance=True)
    assert all(np.array_equal(a, b) for a, b in zip(whole[0], slabs[0], strict=True))
    assert whole[1] == slabs[1] and np.array_equal(moved, w)


@pytest.mark.parametrize("want", [(True, True), (False, True), (False, False)])
def test_diff_gathers_the_outputs_of_many_tasks(want):
    """Tensors past one task (TASK elements) are scanned by parallel tasks that each
    write from their own offset; the gathered outputs are numpy's, in order, with a task
    that found nothing in the middle."""
    rng = np.random.default_rng(91)
    task = native.TASK
    old, new = changed_pair(3 * task + 777, 2, 0.01, rng)
    new[task : 2 * task] = old[task : 2 * task]  # task 1: no change
    o, w = old.numpy().view(np.uint16), new.numpy().view(np.uint16)
    (pos, new_bits, xor_bits), _ = native.diff(o, w, 5, want, fp.native_table(2), 2)
    where = np.flatnonzero(o != w)
    assert np.array_equal(pos, where + 5)
    assert np.array_equal(new_bits, w[where] if want[0] else w[:0])
    assert np.array_equal(xor_bits, (o ^ w)[where] if want[1] else w[:0])


@pytest.mark.parametrize("n", [0, 5, (1 << 22) // 8 + 3])
def test_sparse_scratch_is_a_writable_array_of_its_length(n):
    """The diff's scratch (private maps without huge pages past 4 MiB) behaves as an
    np.empty array: its length and dtype, writable, each one its own memory."""
    a = native._sparse_empty(n, np.dtype(np.int64))
    b = native._sparse_empty(n, np.dtype(np.int64))
    assert a.shape == (n,) and a.dtype == np.int64 and a.flags.writeable
    if n:
        a[-1], b[-1] = 7, 9
        a[0] = 1
        assert (a[0], a[-1], b[-1]) == (1, 7, 9)


def test_diff_scratch_is_kept_per_thread_and_dropped_past_its_cap(monkeypatch):
    """The diff's scratch stays with its thread between calls (its pages stay faulted in),
    other threads get their own, and a call that leaves more than _POOL_BYTES resident
    drops it; the results never depend on it."""
    rng = np.random.default_rng(12)
    table = fp.native_table(2)
    old, new = changed_pair(2 * native.TASK + 9, 2, 0.01, rng)
    o, w = old.numpy().view(np.uint16), new.numpy().view(np.uint16)
    want = np.flatnonzero(o != w)
    assert np.array_equal(native.diff(o, w, 0, (True, True), table, 2)[0][0], want)
    keys = [(0, np.dtype(np.int64)), (1, np.dtype(np.uint16)), (2, np.dtype(np.uint16))]
    held = {key: native._POOL.arrays[key] for key in keys}  # (earlier tests may add others)
    assert all(a.shape[0] >= o.shape[0] for a in held.values())
    again = native.diff(o, w, 0, (True, True), table, 2)
    assert np.array_equal(again[0][0], want)
    assert all(native._POOL.arrays[key] is held[key] for key in keys)  # reused, not remade
    seen: list[dict[object, np.ndarray]] = []
    thread = threading.Thread(target=lambda: seen.append(dict(native._POOL.arrays)))
    thread.start()
    thread.join()
    assert seen == [{}]  # a thread that has not diffed holds nothing
    monkeypatch.setattr(native, "_POOL_BYTES", 1000)
    dense = w ^ np.uint16(1)
    (positions, _, xor_bits), _ = native.diff(o, dense, 0, (False, True), table, 2)
    assert np.array_equal(positions, np.flatnonzero(o != dense))
    assert np.array_equal(xor_bits, (o ^ dense)[positions])
    assert native._POOL.arrays == {}  # past the cap: dropped after the call
    assert np.array_equal(native.diff(o, w, 0, (True, True), table, 2)[0][0], want)
    # a tensor of one task: the same rule, whether its task reaches further than before
    # or not (each call checks what stays resident against the cap)
    monkeypatch.setattr(native, "_POOL_BYTES", 1 << 40)
    small_old, small_new = o[: native.TASK], dense[: native.TASK]
    found, lanes = native.diff(small_old, small_new, 0, (True, True), table, 2)
    assert np.array_equal(found[0], np.flatnonzero(small_old != small_new))
    assert np.array_equal(found[1], small_new[found[0]])
    assert np.array_equal(found[2], (small_old ^ small_new)[found[0]])
    before, after = (torch.from_numpy(x.view(np.int16)) for x in (small_old, small_new))
    assert fp.apply_lane_deltas(fp.tensor_lanes(before), lanes) == fp.tensor_lanes(after)
    assert native._POOL.arrays != {}
    monkeypatch.setattr(native, "_POOL_BYTES", 1000)
    native.diff(small_old, small_old ^ np.uint16(1), 0, (False, True), table, 2)
    assert native._POOL.arrays == {}  # reached further: kept, then past the cap
    native.diff(small_old, small_new, 0, (True, True), table, 2)
    assert native._POOL.arrays == {}  # dropped again: its reach alone is past the cap
    monkeypatch.setattr(native, "_POOL_BYTES", 1 << 40)
    native.diff(small_old, small_new, 0, (True, True), table, 2)
    monkeypatch.setattr(native, "_POOL_BYTES", 1000)
    native.diff(small_old[:10], small_new[:10], 0, (True, True), table, 2)
    assert native._POOL.arrays == {}  # reached no further, but what stays is past the cap


def test_diff_scratch_of_a_repeated_call_is_the_pools_own_arrays():
    """A diff of the same length, dtype and outputs as the last one takes the same scratch
    arrays at once; once a longer diff (or the cap) remade the pool's arrays, the next call
    takes views of the new ones, never the arrays the pool let go."""
    pool = native._Pool()
    first, nbytes = pool.scratch(100, np.dtype(np.uint16), (True, False))
    assert [a.shape[0] for a in first] == [100, 100, 0] and nbytes == 8 + 2
    again, _ = pool.scratch(100, np.dtype(np.uint16), (True, False))
    assert all(a is b for a, b in zip(first, again, strict=True))
    pool.scratch(1000, np.dtype(np.uint16), (True, True))  # remakes the arrays
    later, nbytes = pool.scratch(100, np.dtype(np.uint16), (True, False))
    assert nbytes == 10 and not np.shares_memory(later[0], first[0])
    assert np.shares_memory(later[0], pool.arrays[0, np.dtype(np.int64)])
    pool.reached = 1 << 40
    pool._cap(8)  # past the cap: dropped, and so is the last call's scratch
    assert pool.arrays == {} and pool.last is None


def test_flat_keeps_a_one_dimensional_tensor_and_flattens_others():
    """:func:`flat` is ``reshape(-1)``, without the reshape where there is nothing to do."""
    from dcr_format.format.dtypes import flat, flat_bits

    line = torch.arange(6, dtype=torch.int16)
    assert flat(line) is line
    grid = line.reshape(2, 3)
    assert torch.equal(flat(grid), line) and flat(grid).data_ptr() == line.data_ptr()
    halves = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert flat_bits(halves).dtype == torch.int16 and flat_bits(halves).shape == (6,)
