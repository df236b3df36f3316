"""The ``values-ulp-shift`` feature (FORMAT.md §7.6): ulp differences whose low bits, the
ones the old value's exponent adds, go raw; the rest rANS-coded. The compiled loops against
the numpy reference, the writer's rules and hostile streams (chains end to end, an edited
target, manifests that break the rules and a reader without the feature are checked with
``values-ulp``'s, in ``test_values_ulp.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcr_format.codings import rans, ulp, ulp_shift, values
from dcr_format.delta.delta import DecodedDelta, apply_change, decode_delta, encode_tensor, resolve
from dcr_format.errors import (
    ValuesError,
)
from dcr_format.format import features
from dcr_format.format.dtypes import info_for
from dcr_format.format.names import EXPONENT_FIELDS

FEATURES = ["values-rans", "values-ulp", "values-ulp-shift"]
CODINGS = features.EncodeOptions.allowing(FEATURES).codings
KINDS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32, "float64": np.uint64}


def scaled_change(
    rng: np.random.Generator, dtype: str, n: int, origin: int
) -> tuple[np.ndarray, np.ndarray]:
    """Old bits of ``dtype`` over a range of exponents around ``origin`` (subnormals, zeros
    and a few random patterns among them) and new bits one update size away: about
    ``2^(origin - e)`` ulps, with random low bits, up or down (mostly one unit: one ulp at
    and above ``origin``)."""
    kind = KINDS[dtype]
    width = np.dtype(kind).itemsize
    shift, mask = EXPONENT_FIELDS[dtype]
    exponents = np.clip(origin + rng.integers(-12, 4, n), 0, mask - 1).astype(np.uint64)
    mantissa = rng.integers(0, 2**63, n, dtype=np.uint64) & np.uint64((1 << shift) - 1)
    sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(8 * width - 1)
    old = (sign | (exponents << np.uint64(shift)) | mantissa).astype(kind)
    old[:4] = np.array([0, 1 << (8 * width - 1), 1, (1 << (8 * width - 1)) + 1], dtype=kind)
    s = np.clip(origin - exponents.astype(np.int64), 0, shift + 1).astype(np.uint64)
    units = rng.choice(np.array([1, 1, 1, 1, 1, 2, 3], dtype=np.uint64), n)  # mostly 1
    steps = (units << s) + (
        rng.integers(0, 2**63, n, dtype=np.uint64) & ((np.uint64(1) << s) - np.uint64(1))
    )
    down = rng.integers(0, 2, n).astype(bool)
    u = ulp._order(old, width).astype(np.uint64)
    with np.errstate(over="ignore"):
        moved = np.where(down, u - steps, u + steps).astype(kind)
    new = ulp._unorder(moved, width)
    new[4:40] = rng.integers(0, 2**63, 36, dtype=np.uint64).astype(kind)  # any pattern
    new[new == old] ^= kind(1)
    return old, new


@pytest.mark.parametrize("dtype", sorted(KINDS))
def test_the_compiled_loops_equal_the_reference(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(len(dtype))
    width = np.dtype(KINDS[dtype]).itemsize
    origin = {"bfloat16": 120, "float16": 14, "float32": 120, "float64": 1015}[dtype]
    old, new = scaled_change(rng, dtype, 20_000, origin)
    z = ulp.to_ulp(old, new)
    chosen = ulp_shift.choose_origin(old, z, dtype)
    assert chosen is not None and abs(chosen - origin) <= 1
    results = []
    for kernels in ("", "torch"):  # compiled, then the numpy reference
        monkeypatch.setenv("DCR_KERNELS", kernels)
        for e0 in (chosen, 0, 1, EXPONENT_FIELDS[dtype][1] + 1):
            y, low = ulp_shift.split(old, z, e0, dtype)
            assert y.dtype == z.dtype
            assert np.array_equal(ulp_shift.join(old, y, e0, low, dtype), z)
            results.append((y.tobytes(), low, ulp_shift.choose_origin(old, z, dtype)))
        shifts = ulp_shift.shifts_of(ulp_shift.exponents_of(old, dtype), chosen, dtype)
        assert int(shifts.max()) == EXPONENT_FIELDS[dtype][0] + 1  # the cap is reached
        y, low = ulp_shift.split(old, z, chosen, dtype)
        assert len(low) == (int(shifts.sum()) + 7) // 8
        assert int(y.astype(np.uint64).max()) < 1 << (8 * width)
    assert results[:4] == results[4:]


def test_the_spec_example() -> None:
    """FORMAT.md §7.6's example: origin 125, shifts 0, 1 and 2."""
    old = np.array([0x3E80, 0x3E00, 0x3D80], dtype=np.uint16)
    new = np.array([0x3E82, 0x3E05, 0x3D7D], dtype=np.uint16)
    z = ulp.to_ulp(old, new)
    y, low = ulp_shift.split(old, z, 125, "bfloat16")
    assert y.tolist() == [4, 4, 1] and low == b"\x03"
    assert np.array_equal(ulp_shift.join(old, y, 125, low, "bfloat16"), z)


@pytest.mark.parametrize("kernels", ["", "torch"])  # compiled (one call), numpy reference
def test_the_origin_is_the_rule_evaluated_one_origin_at_a_time(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCR_KERNELS", kernels)
    rng = np.random.default_rng(5)
    for trial in range(40):
        dtype = ("bfloat16", "float16", "float32")[trial % 3]
        shift, mask = EXPONENT_FIELDS[dtype]
        n = int(rng.integers(1, 3000))
        exponents = rng.integers(max(0, mask // 2 - 8), mask // 2 + 8, n).astype(np.uint64)
        old = (exponents << np.uint64(shift)).astype(KINDS[dtype])
        # below a random exponent the changes are mostly larger than one ulp
        cut = int(rng.integers(mask // 2 - 6, mask // 2 + 6))
        far = rng.random(n) < np.where(exponents.astype(np.int64) < cut, 0.8, 0.2)
        z = np.where(far, rng.integers(3, 40, n), rng.integers(1, 3, n)).astype(KINDS[dtype])
        gains = {}
        for e0 in range(1, mask + 2):
            below = exponents.astype(np.int64) < e0
            gains[e0] = int(below.sum()) - 2 * int((below & (z <= 2)).sum())
        best = max(gains.values())
        expected = min(e for e, g in gains.items() if g == best) if best > 0 else None
        assert ulp_shift.choose_origin(old, z, dtype) == expected
    # every change one ulp away: no shift pays
    old = np.full(100, 0x3C00, dtype=np.uint16)
    assert ulp_shift.choose_origin(old, np.full(100, 2, np.uint16), "bfloat16") is None


def test_the_writer_codes_the_candidate_of_least_estimate() -> None:
    rng = np.random.default_rng(8)
    old, new = scaled_change(rng, "bfloat16", 5000, 120)
    one_ulp = ulp._unorder((ulp._order(old, 2) + np.uint16(1)).astype(np.uint16), 2)
    for after, expected in ((new, "ulp-shift"), (one_ulp, "ulp")):
        xor, z = old ^ after, ulp.to_ulp(old, after)
        coding, stream = values.encode_xor_values(
            xor, z, old=old, dtype="bfloat16", codings=CODINGS
        )
        assert coding == expected
        plain = values.encode_xor_values(xor, z, codings=("rans", "ulp"))
        assert len(stream) <= len(plain[1])
        if expected == "ulp-shift":
            assert len(stream) < 0.9 * len(plain[1])
            parsed = ulp_shift.parse(stream, count=old.size, width=2, dtype="bfloat16")
            y = rans.decode_rans(parsed.coded, count=old.size, width=2)
            back = ulp_shift.join(old, y, parsed.origin, parsed.low, "bfloat16")
            assert np.array_equal(back, z)
    # not allowed, or no old bits given: never ulp-shift
    xor, z = old ^ new, ulp.to_ulp(old, new)
    without = ("rans", "ulp")
    assert values.encode_xor_values(xor, z, old=old, dtype="bfloat16", codings=without)[0] == "ulp"
    assert values.encode_xor_values(xor, z, codings=CODINGS)[0] == "ulp"


def _stream() -> tuple[np.ndarray, np.ndarray, bytes]:
    rng = np.random.default_rng(13)
    old, new = scaled_change(rng, "bfloat16", 400, 122)
    z = ulp.to_ulp(old, new)
    coding, stream = values.encode_xor_values(
        old ^ new, z, old=old, dtype="bfloat16", codings=CODINGS
    )
    assert coding == "ulp-shift"
    return old, z, stream


def _decoded(old: np.ndarray, stream: bytes) -> np.ndarray:
    parsed = ulp_shift.parse(stream, count=old.size, width=2, dtype="bfloat16")
    y = rans.decode_rans(parsed.coded, count=old.size, width=2)
    return ulp_shift.join(old, y, parsed.origin, parsed.low, "bfloat16")


@pytest.mark.parametrize("kernels", ["", "torch"])
def test_hostile_streams_are_refused(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCR_KERNELS", kernels)
    old, z, stream = _stream()
    assert np.array_equal(_decoded(old, stream), z)
    parsed = ulp_shift.parse(stream, count=old.size, width=2, dtype="bfloat16")
    head = stream[: len(stream) - len(parsed.low)]
    low = bytes(parsed.low)
    origin = int.from_bytes(stream[:2], "little")
    assert 0 < origin <= 256 and len(low) > 1
    broken = {
        "as long as planes": stream + bytes(2 * old.size - len(stream)),
        "header cut": stream[:1],
        "origin past the exponents": (257).to_bytes(2, "little") + stream[2:],
        "length past the end": stream[:2] + rans.length_bytes(len(stream)) + stream[3:],
        "overlong length": stream[:2] + b"\x80\x80\x80\x80\x80\x01" + stream[3:],
        "low bits cut": head + low[:-1],
        "a byte after the low bits": head + low + b"\x00",
        "a padding bit set": head + low[:-1] + bytes([low[-1] | 0x80]),
    }
    total = int(
        ulp_shift.shifts_of(ulp_shift.exponents_of(old, "bfloat16"), origin, "bfloat16").sum()
    )
    if total % 8 == 0:  # no padding bits to set: the last case says nothing
        del broken["a padding bit set"]
    for name, data in broken.items():
        with pytest.raises(ValuesError):
            _decoded(old, data)
        assert name
    # a shifted value too large for its element's shift (y >= 2^(16 - s))
    y = rans.decode_rans(parsed.coded, count=old.size, width=2)
    shifts = ulp_shift.shifts_of(ulp_shift.exponents_of(old, "bfloat16"), origin, "bfloat16")
    k = int(np.argmax(shifts))
    y = y.copy()
    y[k] = np.uint16(0xFFFF)
    with pytest.raises(ValuesError, match="too large"):
        ulp_shift.join(old, y, origin, low, "bfloat16")


def test_decode_refuses_ulp_shift_where_ulp_cannot_be() -> None:
    stream = _stream()[2]
    info = info_for(torch.bfloat16)
    for op in ("overwrite", "full"):
        with pytest.raises(ValuesError, match="xor entries"):
            decode_delta(op, info, 400, 400, positions=None, values=("ulp-shift", stream))
    with pytest.raises(ValuesError, match="xor entries"):
        decode_delta(
            "xor", info_for(torch.int16), 400, 400, positions=None, values=("ulp-shift", stream)
        )


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_tensor_round_trips_through_encode_decode_and_resolve(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways a reader completes the change: ulp differences stepped by the compiled apply,
    or XOR bits (the reference kernels)."""
    monkeypatch.setenv("DCR_KERNELS", kernels)
    gen = torch.Generator().manual_seed(4)
    for dtype, mantissa in ((torch.bfloat16, 7), (torch.float16, 10), (torch.float32, 23)):
        old = (torch.randn(50_000, generator=gen) * 0.02).to(dtype)
        step = 0.06 * 2.0**-mantissa  # a few ulps of the typical weight, more of small ones
        moved = old.double() + step * torch.randn(50_000, generator=gen, dtype=torch.float64)
        keep = torch.rand(50_000, generator=gen) < 0.97
        new = torch.where(keep, old, moved.to(dtype))
        enc = encode_tensor(new, old, options=features.EncodeOptions.allowing(FEATURES))
        assert enc.values_coding == "ulp-shift", dtype
        assert enc.positions is not None and enc.values is not None
        delta = decode_delta(
            "xor",
            info_for(dtype),
            new.numel(),
            enc.changed,
            positions=(str(enc.positions_coding), enc.positions),
            values=("ulp-shift", enc.values),
        )
        assert delta.needs_target and delta.shift is not None
        bits = info_for(dtype).bits_dtype
        target = old.clone()
        done = resolve(delta, target)
        # joined: plain ulp differences the CPU apply steps in its pass (or XOR bits where
        # the kernels do not take the change)
        assert isinstance(done, DecodedDelta) and done.positions is not None
        assert done.before is None  # not asked to keep them
        applied = apply_change(target, done)
        assert torch.equal(target.view(bits), new.view(bits))
        # kept: the old bits the select read go with the change, and the apply (which
        # then reads none) gives the same bits, before and lanes
        target = old.clone()
        kept = resolve(delta, target, keep_before=True)
        assert kept.before is None or torch.equal(
            kept.before, old.view(bits).reshape(-1)[kept.positions]
        )
        assert (kept.before is not None) == (kernels == "auto")
        again = apply_change(target, kept)
        assert torch.equal(target.view(bits), new.view(bits))
        assert applied.before is not None and again.before is not None
        assert torch.equal(again.before, applied.before)
        assert again.lane_deltas == applied.lane_deltas


def test_the_compiled_join_refuses_each_break_as_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled join reads the low bits 32 at a time where 4 bytes are left: low bits
    cut at every length, one to nine bytes after them, each padding bit set and a value
    too large for its shift anywhere are refused with the reference's error, and the
    unbroken bits still join (for every float width: float64's shifts pass 32 bits)."""
    rng = np.random.default_rng(61)
    for dtype, origin in (("bfloat16", 122), ("float32", 122), ("float64", 1015)):
        old, new = scaled_change(rng, dtype, 300, origin)
        z = ulp.to_ulp(old, new)
        chosen = ulp_shift.choose_origin(old, z, dtype)
        assert chosen is not None
        y, low = ulp_shift.split(old, z, chosen, dtype)
        shifts = ulp_shift.shifts_of(ulp_shift.exponents_of(old, dtype), chosen, dtype)
        total = int(shifts.sum())
        cases = [("whole", y, low)]
        cases += [(f"cut {n}", y, low[:n]) for n in range(len(low))]
        cases += [(f"{n} after", y, low + bytes(n)) for n in range(1, 10)]
        cases += [
            (f"padding {b}", y, low[:-1] + bytes([low[-1] | 1 << b]))
            for b in range(total % 8, 8)
            if total % 8
        ]
        for k in (0, int(np.argmax(shifts)), old.size - 1):
            if shifts[k]:
                big = y.copy()
                big[k] = np.iinfo(big.dtype).max
                cases.append((f"too large at {k}", big, low))
        for name, ys, bits in cases:
            outcome = []
            for kernels in ("", "torch"):
                monkeypatch.setenv("DCR_KERNELS", kernels)
                try:
                    outcome.append(ulp_shift.join(old, ys, chosen, bits, dtype).tobytes())
                except ValuesError as error:
                    outcome.append(str(error))
            assert outcome[0] == outcome[1], (dtype, name)
            assert (outcome[0] == z.tobytes()) == (name == "whole"), (dtype, name)


def test_the_split_and_join_of_many_changes_on_threads_equal_one_pass() -> None:
    """Past ``ULP_SERIAL`` changes the split and the join run in tasks, each placing its low
    bits from the sum of the shifts before it (tasks share the bytes where one ends inside
    a byte): the same ``y`` and low bits as one pass in this thread, the same differences,
    and for a broken stream the same error as one pass (the first in change order)."""
    from dcr_format.codings import _ulp_kernels as native

    rng = np.random.default_rng(67)
    n = native.ULP_SERIAL + 2 * native.ULP_TASK + 123
    for dtype, origin in (("bfloat16", 122), ("float16", 14), ("float64", 1015)):
        shift, mask = EXPONENT_FIELDS[dtype]
        cap = ulp_shift.shift_cap(dtype)
        old, new = scaled_change(rng, dtype, n, origin)
        z = ulp.to_ulp(old, new)
        for e0 in (ulp_shift.choose_origin(old, z, dtype), 0, 1):
            assert e0 is not None
            shifts = ulp_shift.shifts_of(ulp_shift.exponents_of(old, dtype), e0, dtype)
            starts = np.concatenate(([0], np.cumsum(shifts)))[:: native.ULP_TASK]
            y1, low1 = np.empty_like(z), np.zeros((n * cap + 7) // 8, np.uint8)
            y2, low2 = np.empty_like(z), np.full((n * cap + 7) // 8, 0xA5, np.uint8)
            used1 = native.split_shifted(old, z, e0, shift, mask, cap, y1, low1)
            used2 = native.split_low(old, z, e0, shift, mask, cap, y2, low2)
            assert used1 == used2 == (int(shifts.sum()) + 7) // 8
            assert np.array_equal(y1, y2) and np.array_equal(low1[:used1], low2[:used2])
            if e0 > 1:  # tasks that begin inside a byte, so some bytes are shared
                assert (starts[1:] % 8).any()
            low = low1[:used1]
            joined = np.empty_like(z)
            assert native.join_low(old, y1, e0, shift, mask, cap, low, joined) == 0
            assert np.array_equal(joined, z)
        e0 = ulp_shift.choose_origin(old, z, dtype)
        assert e0 is not None
        y, low_bytes = ulp_shift.split(old, z, e0, dtype)
        low = np.frombuffer(low_bytes, np.uint8)
        shifts = ulp_shift.shifts_of(ulp_shift.exponents_of(old, dtype), e0, dtype)
        nonzero = np.flatnonzero(shifts)
        edges = [k for k in nonzero if k % native.ULP_TASK in (0, 1, native.ULP_TASK - 1)]
        big_at = [int(nonzero[0]), *edges[:4], int(nonzero[-1])]
        cases: list[tuple[str, np.ndarray, np.ndarray]] = [("whole", y, low)]
        cases += [(f"cut {c}", y, low[:c]) for c in (0, 1, low.size // 3, low.size - 1)]
        cases += [(f"{c} after", y, np.concatenate([low, np.zeros(c, np.uint8)])) for c in (1, 5)]
        if int(shifts.sum()) % 8:
            padded = low.copy()
            padded[-1] |= 0x80
            cases.append(("padding", y, padded))
        for k in big_at:
            big = y.copy()
            big[k] = np.iinfo(big.dtype).max
            cases.append((f"too large at {k}", big, low))
            cases.append((f"too large at {k} and cut", big, low[: low.size // 2]))
        for name, ys, bits in cases:
            one, many = np.empty_like(z), np.empty_like(z)
            serial = native.join_shifted(old, ys, e0, shift, mask, cap, bits, one)
            tasks = native.join_low(old, ys, e0, shift, mask, cap, bits, many)
            assert serial == tasks, (dtype, name)
            assert (serial == 0) == (name == "whole"), (dtype, name)
            if serial == 0:
                assert np.array_equal(one, many)
