"""The device kernels: Triton (the interpreter on CPU) against the torch reference, bit for bit.

Triton fixes whether its kernels are interpreted when it is first imported, so on
a machine without CUDA this module sets ``TRITON_INTERPRET=1`` before anything can
import Triton (pytest imports every test module before running any test, and no
other module of the suite imports Triton); ``test_interpreter_is_active`` checks
that this took effect. With CUDA the same tests run the compiled kernels on CUDA
tensors, plus the CUDA-only tests at the end.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import assert_same_bits, flip_bits, make_state, snapshot  # noqa: E402

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget  # noqa: E402
from dcr_format.chain.chain import Chain  # noqa: E402
from dcr_format.codings import positions as pos_codec  # noqa: E402
from dcr_format.codings import ulp  # noqa: E402
from dcr_format.delta import backend as kernels_backend  # noqa: E402
from dcr_format.delta import delta as delta_codec  # noqa: E402
from dcr_format.delta import dispatch  # noqa: E402
from dcr_format.delta.backends import backend_for  # noqa: E402
from dcr_format.delta.delta import (  # noqa: E402
    OVERWRITE,
    XOR,
    apply_delta,
    decode_delta,
    encode_tensor,
    undo_delta,
)
from dcr_format.delta.pipeline import DeviceDiffPipeline, encode_stream  # noqa: E402
from dcr_format.delta.positions import (  # noqa: E402
    decode_positions_split,
    decode_positions_to,
)
from dcr_format.errors import PositionsError  # noqa: E402
from dcr_format.format import names  # noqa: E402
from dcr_format.format.dtypes import info_for  # noqa: E402
from dcr_format.kernels import reference  # noqa: E402
from dcr_format.store.store import open_store  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
WIDTHS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BLOCK = reference.BLOCK
ROOT = Path(__file__).resolve().parent.parent


def _triton_or_skip():
    try:
        import triton  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("triton is not installed in CI: pip install -e '.[test]'")
        pytest.skip("triton is not installed (pip install triton, Linux x86_64)")


@pytest.fixture(scope="module")
def tk():
    """The Triton kernels module (interpreted on CPU)."""
    _triton_or_skip()
    from dcr_format.kernels import triton_kernels

    return triton_kernels


@pytest.fixture
def triton_mode(monkeypatch, tk):
    monkeypatch.setenv("DCR_KERNELS", "triton")
    return tk


def random_bits(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(DEVICE)


def changed_copy(old: torch.Tensor, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """``old`` with a pattern of elements changed (XOR with non-zero bits)."""
    n = old.numel()
    new = old.clone()
    if pattern == "none" or n == 0:
        return new
    if pattern == "all":
        positions = torch.arange(n)
    elif pattern == "edges":  # both ends of every block
        starts = torch.arange(0, n, BLOCK)
        positions = torch.unique(torch.cat([starts, (starts + BLOCK - 1).clamp(max=n - 1)]))
    else:
        rate = {"sparse": 0.01, "half": 0.5}[pattern]
        positions = torch.nonzero(torch.rand(n, generator=gen) < rate).reshape(-1)
    flips = random_bits(positions.numel(), old.dtype, gen)
    flips[flips == 0] = 1
    new[positions.to(DEVICE)] ^= flips
    return new


SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17, 5309]
PATTERNS = ["none", "all", "edges", "sparse", "half"]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


# --- the interpreter, and Triton being optional ------------------------------------------


def test_interpreter_is_active(tk):
    """On CPU the kernels must be interpreted (TRITON_INTERPRET=1 before Triton's import)."""
    if not CUDA:
        assert tk.INTERPRETED, (
            "triton was imported before TRITON_INTERPRET=1 was set: some module of the suite "
            "imports triton before tests/test_kernels.py is collected"
        )


def test_import_and_cpu_path_work_without_triton(tmp_path):
    """`import dcr_format` never imports Triton, and works where it is not installed."""
    script = textwrap.dedent(
        """
        import sys

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "triton":
                    raise ModuleNotFoundError("No module named 'triton'")

        sys.meta_path.insert(0, NoTriton())
        import os
        import torch
        import dcr_format
        from dcr_format.delta.delta import apply_delta, encode_tensor, decode_delta
        from dcr_format.format.dtypes import info_for
        from dcr_format.delta.backend import KernelsUnavailableError
        from dcr_format.delta import dispatch
        old = torch.randn(1000).bfloat16()
        new = old.clone()
        new[::9] += 1
        enc = encode_tensor(new, old)
        dec = decode_delta(enc.op, info_for(new.dtype), 1000, enc.changed,
                           positions=(enc.positions_coding, enc.positions),
                           values=(enc.values_coding, enc.values))
        apply_delta(old, dec)
        assert torch.equal(old.view(torch.int16), new.view(torch.int16))
        assert "triton" not in sys.modules
        os.environ["DCR_KERNELS"] = "triton"
        try:
            dispatch.diff(old.view(torch.int16), new.view(torch.int16))
        except KernelsUnavailableError as exc:
            assert "pip install triton" in str(exc)
        else:
            raise AssertionError("DCR_KERNELS=triton without triton must fail")
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DCR_KERNELS", "TRITON_INTERPRET")}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_dispatch_rules(monkeypatch, tk):
    cpu = torch.zeros(3, dtype=torch.int16)
    monkeypatch.delenv("DCR_KERNELS", raising=False)
    assert kernels_backend.kernels_mode() == "auto"
    # auto: Triton only for CUDA tensors, the compiled loops for CPU ones
    assert backend_for(cpu).name == "numba"
    monkeypatch.setenv("DCR_KERNELS", "torch")
    assert backend_for(cpu).name == "torch"
    monkeypatch.setenv("DCR_KERNELS", " Triton ")
    assert backend_for(cpu).name == "triton"  # the interpreter
    monkeypatch.setenv("DCR_KERNELS", "cuda")
    with pytest.raises(ValueError, match="DCR_KERNELS"):
        backend_for(cpu)
    if CUDA:
        monkeypatch.setenv("DCR_KERNELS", "auto")
        assert backend_for(cpu.cuda()).name == "triton"


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch, tk):
    monkeypatch.setenv("DCR_KERNELS", "triton")
    monkeypatch.setattr(tk, "INTERPRETED", False)
    with pytest.raises(kernels_backend.KernelsUnavailableError, match="TRITON_INTERPRET=1"):
        backend_for(torch.zeros(3))


# --- compare and compact ------------------------------------------------------------------


@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("size", SIZES)
def test_count_and_compact_match_the_reference(tk, width, size):
    gen = torch.Generator().manual_seed(width * 100003 + size)
    dtype = WIDTHS[width]
    old = random_bits(size, dtype, gen)
    for pattern in PATTERNS:
        new = changed_copy(old, pattern, gen)
        counts = tk.block_counts(old, new)
        assert _same(counts, reference.block_counts(old, new)), pattern
        scanned = tk.scan(old, new)
        total = int(scanned.total[0])
        for want_new, want_xor in ((True, True), (True, False), (False, True), (False, False)):
            got = tk.compact(scanned, total, want_new=want_new, want_xor=want_xor)
            want = reference.diff(old, new, want_new=want_new, want_xor=want_xor)
            assert _same(got.positions, want.positions), (pattern, want_new, want_xor)
            assert _same(got.new_values, want.new_values), (pattern, want_new, want_xor)
            assert _same(got.xor_values, want.xor_values), (pattern, want_new, want_xor)


@pytest.mark.parametrize("base", [2**31 - 7, 2**32 + 5, 2**62])
def test_compact_positions_past_2_31(tk, base):
    """int64 index arithmetic: a slice starting at ``base`` writes positions base + i."""
    gen = torch.Generator().manual_seed(base % 1000)
    old = random_bits(3 * BLOCK + 17, torch.int16, gen)
    new = changed_copy(old, "sparse", gen)
    scanned = tk.scan(old, new)
    got = tk.compact(scanned, int(scanned.total[0]), want_new=True, want_xor=True, base=base)
    want = reference.diff(old, new, base=base)
    assert int(got.positions.min()) >= base
    assert _same(got.positions, want.positions)
    assert _same(got.xor_values, want.xor_values)


# --- scatter (apply and undo) ----------------------------------------------------------------

SCATTER_COUNTS = [0, 1, 1023, 1024, 1025, 3 * 1024 + 5]


@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("count", SCATTER_COUNTS)
def test_scatter_matches_the_reference(tk, width, count):
    assert tk.SCATTER_BLOCK == 1024
    gen = torch.Generator().manual_seed(width * 7919 + count)
    dtype = WIDTHS[width]
    n = max(3 * count, 10)
    target = random_bits(n, dtype, gen)
    positions = torch.randperm(n, generator=gen)[:count].sort().values.to(DEVICE)
    values = random_bits(count, dtype, gen)
    for op in (XOR, OVERWRITE):
        for save in (False, True):
            got, want = target.clone(), target.clone()
            saved = tk.scatter(got, positions, values, op=op, save=save)
            saved_ref = reference.scatter(want, positions, values, op=op, save=save)
            assert _same(got, want), (op, save)
            assert _same(saved, saved_ref), (op, save)


@pytest.mark.parametrize("base", [2**31, 2**40 + 3])
def test_scatter_positions_past_2_31(tk, base):
    gen = torch.Generator().manual_seed(11)
    target = random_bits(5000, torch.int32, gen)
    positions = torch.randperm(5000, generator=gen)[:1500].sort().values.to(DEVICE) + base
    values = random_bits(1500, torch.int32, gen)
    for op in (XOR, OVERWRITE):
        got, want = target.clone(), target.clone()
        saved = tk.scatter(got, positions, values, op=op, save=True, base=base)
        saved_ref = reference.scatter(want, positions, values, op=op, save=True, base=base)
        assert _same(got, want) and _same(saved, saved_ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scatter_refuses_positions_out_of_range(monkeypatch, tk, backend):
    monkeypatch.setenv("DCR_KERNELS", backend)
    flat = torch.zeros(10, dtype=torch.int16, device=DEVICE)
    values = torch.ones(2, dtype=torch.int16, device=DEVICE)
    # (torch indexing takes -1 as the last element; the kernel path refuses it)
    for bad in ([3, 10], [-1, 2]) if backend == "triton" else ([3, 10],):
        positions = torch.tensor(bad, device=DEVICE)
        with pytest.raises(IndexError):
            dispatch.scatter(flat, positions, values, op=XOR)
    assert int(flat.abs().sum()) == 0


# --- range expansion ------------------------------------------------------------------------


def _runs(runs: int, gen: torch.Generator, long: int = 0, first: int = 0):
    lengths = torch.randint(1, 9, (runs,), generator=gen)
    if long and runs:
        lengths[runs // 2] = long
    gaps = torch.randint(1, 50, (runs,), generator=gen)
    gaps[:1] = first
    ends = torch.cumsum(gaps + lengths, 0)
    return (ends - lengths).to(DEVICE), lengths.to(DEVICE), int(lengths.sum())


@pytest.mark.parametrize(
    ("runs", "long", "first"),
    [
        (0, 0, 0),
        (1, 0, 0),
        (1, 1, 5),
        (1, 3 * 1024 + 1, 0),
        (1023, 0, 7),
        (1025, 0, 0),
        (700, 2500, 2**33 + 1),  # starts past 2^32, a run spanning blocks
        (3000, 0, 2**31 - 1),
    ],
)
def test_expand_ranges_matches_the_reference(tk, runs, long, first):
    gen = torch.Generator().manual_seed(runs + long)
    starts, lengths, count = _runs(runs, gen, long, first)
    got = tk.expand_ranges(starts, lengths, count)
    assert _same(got, reference.expand_ranges(starts, lengths, count))
    if count:
        assert int(got[0]) == first


# --- classed positions: classes and ranks on the device -------------------------------------


@pytest.mark.parametrize("size", [1, 1023, 1024, 1025, 3 * 1024 + 17, 20000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_class_ranks_match_the_reference_and_the_host_coding(tk, size, dtype):
    """The Triton class kernels (count per block, rank per change; select per wanted rank)
    against the torch reference, the stream built from them equal to the host coding's
    bytes, and the positions found from it on the device equal to the changes."""
    from dcr_format.codings import classed
    from dcr_format.delta.classed_change import device_classed, device_positions

    gen = torch.Generator().manual_seed(size)
    old = (torch.randn(size, generator=gen) * 0.02).to(dtype)
    old.view(-1)[::7] *= 300  # a wide range of exponents: the clamped classes at both ends
    bits = old.view(info_for(dtype).bits_dtype).reshape(-1).to(DEVICE)
    rate = torch.rand(size, generator=gen) < (0.3 if size < 100 else 0.02)
    rate[size - 1] = True  # the last element, in the last (partial) block
    positions = torch.nonzero(rate).reshape(-1).to(DEVICE)
    name = info_for(dtype).name
    shift, mask = classed.EXPONENT_FIELDS[name]
    for base, count in ((0x70, 12), (0x7A, 1), (0, 16)):
        got = tk.class_ranks(bits, positions, shift, mask, base, count)
        want = reference.class_ranks(bits, positions, shift, mask, base, count)
        assert _same(got[0], want[0]) and _same(got[1], want[1]), (base, count)
    host = bits.cpu().numpy().view(f"<u{info_for(dtype).width}")
    expected = classed.encode_classed(positions.cpu().numpy(), host, name)
    for backend in ("torch", "triton"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("DCR_KERNELS", backend)
            chosen = backend_for(bits, positions)
            assert device_classed(bits, positions, dtype, chosen) == expected, backend
            # and back: the reader's class passes on the device find the same positions
            stream = classed.parse_classed(expected, count=positions.numel(), dtype=name)
            found = device_positions(stream, bits, name, chosen)
            assert _same(found.cpu(), positions.cpu()), backend


# --- positions decoded onto a device ----------------------------------------------------------


def _position_cases() -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(5)
    cases = [(np.empty(0, np.int64), 10), (np.array([0]), 1), (np.array([9]), 10)]
    n = 20000
    cases.append((np.flatnonzero(rng.random(n) < 0.01), n))
    cases.append((np.flatnonzero(rng.random(n) < 0.6), n))
    runs = np.concatenate([np.arange(s, s + 700) for s in (3, 1000, 5000)])
    cases.append((runs, n))
    huge = 1 << 62
    cases.append((np.array([0, 2**31 + 1, 2**53 + 1, huge - 2, huge - 1]), huge))
    return [(np.asarray(p, dtype=np.int64), numel) for p, numel in cases]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("coding", [names.RICE, names.RANGES])
def test_split_position_decoding_matches_the_host(monkeypatch, tk, backend, coding):
    monkeypatch.setenv("DCR_KERNELS", backend)
    for positions, numel in _position_cases():
        _, data = pos_codec.encode_positions(positions, coding=coding)
        count = positions.size
        got = decode_positions_split(coding, data, count=count, numel=numel, device=DEVICE)
        assert got.dtype == torch.int64 and got.device.type == DEVICE.type
        assert got.cpu().tolist() == positions.tolist()
        host = decode_positions_to(coding, data, count=count, numel=numel, device="cpu")
        assert host.tolist() == positions.tolist()


def _hostile_streams() -> list[tuple[str, bytes, int, int]]:
    from test_codec_hostile import ranges_stream, rice_stream

    valid = np.array([0, 1, 2, 7, 100, 101, 999], dtype=np.int64)
    out = [
        (names.RICE, rice_stream([0, 2**62 - 1, 2**62 - 1, 2**62 - 1, 2**62 - 1], 62), 5, 100),
        (names.RICE, rice_stream([2**62 - 1] * 4 + [5], 62), 5, 100),
        (names.RICE, rice_stream([3, 2**40], 30), 2, 2**40),
        (names.RICE, rice_stream([3, 2**40 - 5], 30), 2, 2**40),
        (names.RICE, rice_stream([2**62 - 1, 2**62 - 1], 61), 2, 2**63 - 1),
        (names.RICE, rice_stream([0, 0, 0], 0, count=4), 3, 10),
        (names.RANGES, ranges_stream([0, 0], [1, 0], 1, 1), 3, 10),
        (names.RANGES, ranges_stream([5, 2**64 - 1], [3, 0]), 5, 10),
        (names.RANGES, ranges_stream([0, 1], [2, 2**64 - 1]), 3, 10),
        (names.RANGES, ranges_stream([11], [0], 1, 1), 1, 10),
    ]
    rng = np.random.default_rng(9)
    for coding in (names.RICE, names.RANGES):
        data = pos_codec.encode_positions(valid, coding=coding)[1]
        out.append((coding, data, 7, 1000))
        for count, numel in ((7, 999), (7, 6), (6, 1000), (8, 1000), (-1, 1000), (7, 1 << 63)):
            out.append((coding, data, count, numel))
        for cut in range(len(data)):
            out.append((coding, data[:cut], 7, 1000))
        for _ in range(150):
            raw = bytearray(data)
            for index in rng.integers(0, len(raw), size=int(rng.integers(1, 3))):
                raw[index] = int(rng.integers(0, 256))
            out.append((coding, bytes(raw), 7, 1000))
    return out


def test_split_position_decoding_refuses_what_the_host_refuses(monkeypatch):
    monkeypatch.setenv("DCR_KERNELS", "torch")
    for coding, data, count, numel in _hostile_streams():
        try:
            want = pos_codec.decode_positions(coding, data, count=count, numel=numel).tolist()
        except PositionsError:
            want = None
        try:
            got = decode_positions_split(
                coding, data, count=count, numel=numel, device=DEVICE
            ).tolist()
        except PositionsError:
            got = None
        assert got == want, (coding, data.hex(), count, numel)


def test_decode_delta_onto_a_device_matches_the_host_decode(triton_mode):
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(4000, generator=gen).bfloat16()
    new = old.clone()
    flip_bits(new, gen, 300)
    new[1000:1400] += 1  # a run
    info = info_for(new.dtype)
    for op in (XOR, OVERWRITE, None):
        enc = encode_tensor(new, old, op=op)
        streams = {
            "positions": (enc.positions_coding, enc.positions) if enc.positions else None,
            "values": (enc.values_coding, enc.values),
        }
        host = decode_delta(enc.op, info, new.numel(), enc.changed, **streams)
        dev = decode_delta(enc.op, info, new.numel(), enc.changed, **streams, device=DEVICE)
        assert dev.op == host.op
        assert _same(dev.positions, host.positions) and _same(dev.values, host.values)
        target = old.clone().to(DEVICE)
        apply_delta(target, dev)
        assert torch.equal(target.cpu().view(torch.int16), new.view(torch.int16))


# --- the dispatcher through the codec, and the writer's pipeline --------------------------------


def _pipeline_items(gen: torch.Generator):
    items = []
    for index, (dtype, n) in enumerate(
        [
            (torch.bfloat16, 3000),
            (torch.float32, 1),
            (torch.bool, BLOCK + 1),
            (torch.float64, 700),
            (torch.int8, 0),
            (torch.float16, 2 * BLOCK),
        ]
    ):
        if dtype == torch.bool:
            old = torch.randint(0, 2, (n,), generator=gen).bool()
        else:
            old = random_bits(n, WIDTHS[torch.empty(0, dtype=dtype).element_size()], gen)
            old = old.cpu().view(dtype)
        new = old.clone()
        if n:
            flip_bits(new, gen, max(1, n // 50))
        op = (None, XOR, OVERWRITE)[index % 3]
        items.append((f"t{index}", new.to(DEVICE), old.to(DEVICE), op))
    # passed through: no baseline, another shape, op full
    items.append(("fresh", torch.ones(5, device=DEVICE), None, None))
    items.append(("reshaped", torch.ones(6, device=DEVICE), torch.ones(2, 3, device=DEVICE), None))
    items.append(("full", torch.ones(4, device=DEVICE), torch.zeros(4, device=DEVICE), "full"))
    return items


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pipeline_matches_sequential_diffs_with_one_item_of_lookahead(monkeypatch, tk, backend):
    monkeypatch.setenv("DCR_KERNELS", backend)
    items = _pipeline_items(torch.Generator().manual_seed(1))
    pulled = []

    def source():
        for item in items:
            pulled.append(item[0])
            yield item

    results = []
    for index, result in enumerate(DeviceDiffPipeline(source())):
        assert len(pulled) == min(index + 2, len(items))  # the next item is already scanning
        results.append(result)
    assert [r.key for r in results] == [i[0] for i in items]
    for (_, new, old, op), result in zip(items, results, strict=True):
        if op == "full" or old is None or old.shape != new.shape:
            assert result.diff is None and result.host is None
            continue
        from dcr_format.format.dtypes import bits_view

        want = reference.diff(bits_view(old).reshape(-1), bits_view(new).reshape(-1))
        assert _same(result.diff.positions, want.positions)
        assert _same(result.diff.new_values, want.new_values)
        picked = want.new_values if op == OVERWRITE else want.xor_values
        assert result.host[0].device.type == "cpu"
        assert _same(result.host[0], want.positions) and _same(result.host[1], picked)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_encode_stream_equals_encode_tensor(monkeypatch, tk, backend):
    monkeypatch.setenv("DCR_KERNELS", backend)
    items = _pipeline_items(torch.Generator().manual_seed(2))
    streamed = dict(encode_stream(items))
    monkeypatch.setenv("DCR_KERNELS", "torch")
    for name, new, old, op in items:
        want, got = encode_tensor(new, old, op=op), streamed[name]
        assert (got.op, got.changed, got.positions_coding, got.values_coding) == (
            want.op,
            want.changed,
            want.positions_coding,
            want.values_coding,
        )
        assert got.positions == want.positions and got.values == want.values
        if want.advance is None:
            assert got.advance is None
        else:
            assert got.advance.op == want.advance.op
            assert _same(got.advance.positions, want.advance.positions)
            assert _same(got.advance.values, want.advance.values)
    with pytest.raises(ValueError, match="unknown op"):
        list(encode_stream([("x", torch.ones(2), torch.ones(2), "bogus")]))


def test_codec_apply_and_undo_through_triton(triton_mode):
    gen = torch.Generator().manual_seed(8)
    for dtype in (torch.bfloat16, torch.float32, torch.float64, torch.uint8):
        old = torch.randint(0, 100, (BLOCK + 3,), generator=gen).to(dtype)
        new = old.clone()
        flip_bits(new, gen, 40)
        for op in (XOR, OVERWRITE):
            enc = encode_tensor(new, old, op=op)
            dec = decode_delta(
                enc.op,
                info_for(dtype),
                new.numel(),
                enc.changed,
                positions=(enc.positions_coding, enc.positions),
                values=(enc.values_coding, enc.values),
            )
            target = old.clone().to(DEVICE)
            saved = apply_delta(target, dec)
            assert torch.equal(target.cpu().view(torch.uint8), new.view(torch.uint8))
            undo_delta(target, dec, saved)
            assert torch.equal(target.cpu().view(torch.uint8), old.view(torch.uint8))


# --- the ulp value codings on the device ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_ulp_kernels_match_the_reference_and_the_host_coding(tk, dtype):
    kind = {torch.int16: np.uint16, torch.int32: np.uint32, torch.int64: np.uint64}[dtype]
    gen = torch.Generator().manual_seed(31)
    info = torch.iinfo(dtype)
    n, m = 3 * 1024 + 5, 1500
    new = random_bits(n, dtype, gen).cpu()
    special = torch.tensor([0, info.min, info.max, -1, 1, info.min + 1], dtype=dtype)
    new[: special.numel()] = special  # +-0, NaN payloads, the ends of the order
    positions = torch.sort(torch.randperm(n, generator=gen)[:m]).values
    positions[:6] = torch.arange(6)
    xor = random_bits(m, dtype, gen).cpu()
    xor[6:1000] &= 7  # steps of a few ulps, across +-0 where the sign bit flips too
    xor[6:20] |= info.min
    want_z, want_old = reference.ulp_of_change(new, positions, xor)
    after = new[positions]
    host = ulp.to_ulp((after ^ xor).numpy().view(kind), after.numpy().view(kind))
    assert np.array_equal(want_z.numpy().view(kind), host)
    new_d, pos_d, xor_d = new.to(DEVICE), positions.to(DEVICE), xor.to(DEVICE)
    gathered, old = tk.ulp_of_change(new_d, pos_d, xor_d, None, want_old=True)
    given, none = tk.ulp_of_change(new_d, pos_d, xor_d, after.to(DEVICE), want_old=False)
    assert none is None
    assert _same(gathered, want_z) and _same(given, want_z) and _same(old, want_old)
    # the reader: old bits stepped by the differences, staged (nothing written) or applied
    base = new.clone()
    base[positions] = want_old
    staged = base.to(DEVICE)
    before, stepped = tk.apply_ulp(staged, pos_d, want_z.to(DEVICE), write=False)
    assert _same(staged, base) and _same(before, want_old) and _same(stepped, after)
    ref_before, ref_after = reference.apply_ulp(base.clone(), positions, want_z, write=False)
    assert _same(ref_before, want_old) and _same(ref_after, after)
    from_ulp_host = ulp.from_ulp(want_old.numpy().view(kind), want_z.numpy().view(kind))
    assert np.array_equal(from_ulp_host, after.numpy().view(kind))
    applied = base.to(DEVICE)
    tk.apply_ulp(applied, pos_d, want_z.to(DEVICE), write=True)
    assert _same(applied, new)


def test_ulp_dispatch_runs_on_the_device(triton_mode, monkeypatch):
    gen = torch.Generator().manual_seed(32)
    old = random_bits(2 * 1024, torch.int16, gen).to(DEVICE)
    positions = torch.tensor([3, 70, 900, 2047], device=DEVICE)
    z = torch.tensor([2, 1, 6, 3], dtype=torch.int16, device=DEVICE)
    assert dispatch.ulp_on_device(old) and dispatch.fuses_ulp(old, positions.cpu())
    monkeypatch.setenv("DCR_KERNELS", "torch")
    assert not dispatch.ulp_on_device(old)
    monkeypatch.setenv("DCR_KERNELS", "triton")
    target = old.clone()
    before, after, lanes = dispatch.stage_change(target, positions, z, op=names.ULP)
    assert _same(target, old) and _same(after, reference.ulp_step(before, z))
    got_before, got_after, got_lanes = dispatch.apply_ulp_with_lanes(target, positions.cpu(), z)
    assert _same(got_before, before) and _same(got_after, after) and got_lanes == lanes
    assert _same(target[positions], after)
    assert lanes == kernels_backend.change_lanes(positions, before, after)
    with pytest.raises(IndexError):
        dispatch.apply_ulp_with_lanes(target, torch.tensor([5, 2048], device=DEVICE), z[:2])
    assert _same(target[positions], after)


# --- the whole publish/sync path with the Triton kernels ------------------------------------------


def _count_launches(tk, monkeypatch) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """How many times each Triton kernel is launched from now on, by name."""
    launched: dict[str, int] = {}
    real_launch = tk._launch

    def counting_launch(kernel, *args, **meta):  # type: ignore[no-untyped-def]
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__
        launched[name] = launched.get(name, 0) + 1
        return real_launch(kernel, *args, **meta)

    monkeypatch.setattr(tk, "_launch", counting_launch)
    return launched


def test_publish_and_sync_with_triton_kernels_is_bit_exact(triton_mode, monkeypatch, store_url):
    launched = _count_launches(triton_mode, monkeypatch)
    gen = torch.Generator().manual_seed(21)
    state = make_state(21)
    state["model.layers.0.mlp.down_proj.weight"] = torch.randn(16, 200, generator=gen).bfloat16()
    writer = DeltaWriter(store_url, ops={"model.norm.weight": OVERWRITE})
    early, late = StateDictTarget({}), StateDictTarget({})
    early_reader, late_reader = DeltaReader(store_url, early), DeltaReader(store_url, late)
    states = []
    for version in range(5):
        if version:
            for name in sorted(state)[version % 2 :: 2]:
                flip_bits(state[name], gen, 1 + state[name].numel() // 40)
        writer.publish(state, step=version)
        states.append(snapshot(state))
        early_reader.sync()
        assert_same_bits(early.tensors, state)
    assert late_reader.sync(to=2).applied_versions == (0, 1, 2)
    assert_same_bits(late.tensors, states[2])
    assert late_reader.sync().applied_versions == (3, 4)
    assert_same_bits(late.tensors, states[4])
    assert_same_bits(writer.baseline, states[4])
    for kernel in ("_count_kernel", "_compact_kernel", "_scatter_kernel"):
        assert launched.get(kernel, 0) > 0, launched


def test_publish_and_sync_in_a_fresh_process_through_the_writers_pool(tmp_path):
    """A fresh process whose first use of the Triton kernels comes from the writer's coding
    pool, two threads at once: neither may see the kernels' module half imported."""
    _triton_or_skip()
    script = textwrap.dedent(
        """
        import sys
        import torch
        from dcr_format import DeltaReader, DeltaWriter, StateDictTarget

        url = sys.argv[1]
        gen = torch.Generator().manual_seed(3)
        state = {f"layers.{i}.weight": torch.randn(48, 40, generator=gen).bfloat16()
                 for i in range(6)}
        state["layers.0.bias"] = torch.randn(40, generator=gen)
        writer = DeltaWriter(url)
        target = StateDictTarget({})
        reader = DeltaReader(url, target)
        launched = []
        for version in range(3):
            if version:
                for tensor in state.values():
                    bits = tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)
                    bits[version::7] ^= 1
            writer.publish(state, step=version)
            if version == 1:  # the first diffs imported them on the pool: count launches from now
                from dcr_format.kernels import triton_kernels as tk
                assert tk.INTERPRETED
                real = tk._launch
                tk._launch = lambda kernel, *a, **k: (launched.append(1), real(kernel, *a, **k))[1]
            reader.sync()
            for name, tensor in state.items():
                assert torch.equal(target.tensors[name].view(torch.uint8), tensor.view(torch.uint8))
        assert launched
        print("ok")
        """
    )
    env = dict(os.environ, DCR_KERNELS="triton", TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "store")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "ok"


ULP_FEATURES = ("values-rans", "values-ulp", "values-ulp-shift")


def test_publish_and_sync_with_the_ulp_codings_through_triton(triton_mode, monkeypatch, tmp_path):
    launched = _count_launches(triton_mode, monkeypatch)

    def on_the_host(*args):
        raise AssertionError("a ulp step ran on the host")

    monkeypatch.setattr(delta_codec, "from_ulp", on_the_host)
    gen = torch.Generator().manual_seed(33)
    # fp32 masters published as bf16: one-ulp steps (ulp) and steps scaled by the exponent
    # (ulp-shift) on small tensors, an fp32 one besides
    masters = {
        "a.weight": (torch.randn(64, 96, generator=gen) * 0.02, 2e-6),
        "b.weight": (torch.randn(48, 64, generator=gen) * 0.02, 1e-4),
        "c.weight": (torch.randn(1500, generator=gen), 1e-6),
    }

    def state() -> dict[str, torch.Tensor]:
        return {
            n: m.to(torch.float32 if n == "c.weight" else torch.bfloat16)
            for n, (m, _) in masters.items()
        }

    store = tmp_path / "store"
    writer = DeltaWriter(store, features=ULP_FEATURES)
    synced, staged = StateDictTarget({}), StateDictTarget({})
    synced_reader, staged_reader = DeltaReader(store, synced), DeltaReader(store, staged)
    states = []
    codings: set[str | None] = set()
    for version in range(3):
        if version:
            for master, lr in masters.values():
                master += lr * torch.sign(torch.randn(master.shape, generator=gen))
        states.append(state())
        writer.publish(states[-1])
        if version:
            chain = Chain(open_store(store))
            manifests = chain.manifests(chain.record(version))
            codings |= {e.values.coding for m in manifests for e in m.entries if e.values}
        synced_reader.sync()
        staged_reader.apply(staged_reader.prepare())
        assert_same_bits(synced.tensors, states[-1])
        assert_same_bits(staged.tensors, states[-1])
    assert {"ulp", "ulp-shift"} <= codings, codings
    late = StateDictTarget({})
    DeltaReader(store, late).sync(to=0)
    assert DeltaReader(store, late).sync().applied_versions == (1, 2)
    assert_same_bits(late.tensors, states[-1])
    for kernel in ("_ulp_diff_kernel", "_ulp_apply_kernel"):
        assert launched.get(kernel, 0) > 0, launched


def test_tensor_parallel_shards_prepared_and_written_through_triton(
    triton_mode, monkeypatch, tmp_path
):
    """The ranks of a tensor-parallel module read each shard's change against its
    parameter's storage while preparing and write them with the device kernels in the
    apply, bit-equal to their loader's placement."""
    from test_module_shards import PLACED_ONCE, TP, _published, bits_of, dense, step

    from dcr_format.testing.processes import in_threads

    launched = _count_launches(triton_mode, monkeypatch)
    writer, state, modules, readers = _published(tmp_path)
    state = step(state, 0)
    writer.publish(state)
    prepared = in_threads(lambda r: readers[r].prepare(), TP)
    assert all({n for n, s in p._staged.items() if s.placed} == PLACED_ONCE for p in prepared)
    launched.clear()
    results = in_threads(lambda r: readers[r].apply(prepared[r]), TP)
    assert all(not result.unverified for result in results)
    for r, module in enumerate(modules):
        got, want = bits_of(module), dense(state, r)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert launched.get("_scatter_kernel", 0) > 0, launched


# --- CUDA only ---------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@cuda_only
def test_cuda_pinned_copies_and_streams(monkeypatch, tk):
    monkeypatch.setenv("DCR_KERNELS", "auto")
    gen = torch.Generator().manual_seed(4)
    old = random_bits(10 * BLOCK + 3, torch.int16, gen)
    new = changed_copy(old, "sparse", gen)
    host = kernels_backend.to_host(new)
    assert host.is_pinned() and torch.equal(host, new.cpu())
    back = kernels_backend.to_device(host.clone(), DEVICE)
    assert back.is_cuda and torch.equal(back, new)
    items = [(i, new.view(torch.bfloat16), old.view(torch.bfloat16)) for i in range(6)]
    results = list(DeviceDiffPipeline(items))
    want = reference.diff(old, new)
    for result in results:
        assert result.host[0].is_pinned()
        assert _same(result.diff.positions, want.positions)
        assert _same(result.host[1], want.xor_values)
