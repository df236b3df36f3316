"""Fingerprints: a slow reference of the documented algorithm, and the properties it claims."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcr_format.delta.fingerprint as fp
from dcr_format.delta.fingerprint import state_fingerprint, tensor_fingerprint
from dcr_format.format.dtypes import BY_NAME, DTYPE_NAMES, UNSIGNED_NP

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def element_bits(tensor: torch.Tensor) -> list[int]:
    """Unsigned bit pattern of every element, row-major, read straight from the bytes."""
    width = tensor.element_size()
    if tensor.numel() == 0:  # torch gives empty tensors strides a byte view refuses
        return []
    raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return [int.from_bytes(raw[i : i + width], "little") for i in range(0, len(raw), width)]


def reference_fingerprint(tensor: torch.Tensor) -> str:
    """The module docstring's algorithm, element by element in Python integers."""
    name = next(n for n, info in BY_NAME.items() if info.torch_dtype == tensor.dtype)
    primes = fp._PRIMES if tensor.element_size() == 8 else fp._PRIMES[:2]
    values = element_bits(tensor)
    lanes = []
    for lane, p in enumerate(primes):
        acc = 0
        for i, v in enumerate(values):
            g = pow((v % p + fp._C[lane]) % p, 5, p)
            r = (i % (1 << 30)) + 1
            acc = (acc + g * r) % p
        lanes.append(acc)
    shape = ",".join(str(d) for d in tensor.shape)
    digest = hashlib.sha256(f"dcr-fp-1\0{name}\0{shape}\0".encode())
    digest.update(struct.pack(f"<{len(lanes)}Q", *lanes))
    return digest.hexdigest()[:32]


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of format dtype ``name`` with uniformly random bit patterns (NaNs included)."""
    info = BY_NAME[name]
    n = int(np.prod(shape, dtype=np.int64))
    bits = np.frombuffer(np.random.default_rng(seed).bytes(n * info.width), UNSIGNED_NP[info.width])
    bits = bits.copy()
    if name == "bool":
        bits &= 1
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[info.width]
    return torch.from_numpy(bits.view(signed)).view(info.torch_dtype).reshape(shape)


def from_bits(name: str, bits: list[int]) -> torch.Tensor:
    info = BY_NAME[name]
    array = np.array(bits, dtype=UNSIGNED_NP[info.width])
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[info.width]
    return torch.from_numpy(array.view(signed)).view(info.torch_dtype)


def with_bits(tensor: torch.Tensor, index: int, xor: int) -> torch.Tensor:
    """A copy of ``tensor`` whose element ``index`` (row-major) has its bits xor-ed."""
    out = tensor.clone()
    width = out.element_size()
    flat = out.reshape(-1).view(torch.uint8)
    for b in range(width):
        flat[index * width + b] ^= (xor >> (8 * b)) & 0xFF
    return out


def set_chunking(monkeypatch, row: int, rows: int) -> None:
    """Rows of ``row`` elements, ``rows`` rows per CPU chunk, with fresh caches."""
    monkeypatch.setattr(fp, "_ROW_CPU", row)
    monkeypatch.setattr(fp, "_ROWS_CPU", rows)
    monkeypatch.setattr(fp, "_CACHE", {})


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Rows of 7 elements, 2 rows per chunk, then restore."""
    set_chunking(monkeypatch, 7, 2)
    yield


SIZES = [0, 1, 2, 6, 7, 8, 13, 14, 15, 50]


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_matches_reference(name):
    for n in SIZES:
        tensor = random_tensor(name, (n,), seed=n)
        assert tensor_fingerprint(tensor) == reference_fingerprint(tensor)
    for shape in [(), (3, 0), (2, 3, 4), (1, 1)]:
        tensor = random_tensor(name, shape, seed=1)
        assert tensor_fingerprint(tensor) == reference_fingerprint(tensor)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_matches_reference_across_chunk_boundaries(name, tiny_chunks):
    for n in SIZES:
        tensor = random_tensor(name, (n,), seed=100 + n)
        assert tensor_fingerprint(tensor) == reference_fingerprint(tensor)


def test_chunk_size_does_not_change_the_fingerprint(monkeypatch):
    tensors = [random_tensor(name, (29,), seed=5) for name in DTYPE_NAMES]
    default = [tensor_fingerprint(t) for t in tensors]
    for row, rows in ((1, 1), (2, 3), (7, 1), (7, 4), (28, 1), (29, 2), (30, 1)):
        set_chunking(monkeypatch, row, rows)
        assert [tensor_fingerprint(t) for t in tensors] == default


def test_matches_reference_past_the_default_cpu_chunk():
    n = fp._ROW_CPU * fp._ROWS_CPU + fp._ROW_CPU + 5
    tensor = random_tensor("uint8", (n,), seed=3)
    assert tensor_fingerprint(tensor) == reference_fingerprint(tensor)


def test_known_answer():
    """Pinned so a change of algorithm or framing cannot pass unnoticed."""
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_fingerprint(tensor) == reference_fingerprint(tensor)
    assert tensor_fingerprint(tensor) == KNOWN_ARANGE_F32


KNOWN_ARANGE_F32 = "90edca7be13c495cbbeb6b5c16a29f4f"


# --- properties ---------------------------------------------------------------------------


@st.composite
def tensors(draw, *, min_numel: int = 0):
    name = draw(st.sampled_from(DTYPE_NAMES))
    shape = tuple(draw(st.lists(st.integers(1 if min_numel else 0, 9), min_size=1, max_size=3)))
    return random_tensor(name, shape, draw(st.integers(0, 2**32 - 1)))


@PROPERTY
@given(tensors(min_numel=1), st.data())
def test_any_single_bit_flip_changes_the_fingerprint(tensor, data):
    index = data.draw(st.integers(0, tensor.numel() - 1))
    bit = data.draw(st.integers(0, 8 * tensor.element_size() - 1))
    flipped = with_bits(tensor, index, 1 << bit)
    assert tensor_fingerprint(flipped) != tensor_fingerprint(tensor)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_bit_of_an_element_matters(name):
    tensor = random_tensor(name, (3,), seed=9)
    seen = {tensor_fingerprint(tensor)}
    for bit in range(8 * tensor.element_size()):
        seen.add(tensor_fingerprint(with_bits(tensor, 1, 1 << bit)))
    assert len(seen) == 1 + 8 * tensor.element_size()


@PROPERTY
@given(tensors(min_numel=1), st.data())
def test_swapping_two_different_elements_changes_the_fingerprint(tensor, data):
    bits = element_bits(tensor)
    pairs = [(i, j) for i in range(len(bits)) for j in range(i) if bits[i] != bits[j]]
    if not pairs:  # every element equal: make one differ
        tensor = with_bits(tensor, 0, 1)
        bits = element_bits(tensor)
        pairs = [(0, j) for j in range(1, len(bits))]
    if not pairs:
        return
    i, j = data.draw(st.sampled_from(pairs))
    swapped = tensor.clone()
    flat = swapped.reshape(-1)
    original = tensor.reshape(-1)
    flat[i], flat[j] = original[j], original[i]
    assert element_bits(swapped)[i] == bits[j]
    assert tensor_fingerprint(swapped) != tensor_fingerprint(tensor)


@pytest.mark.parametrize("name", ["int32", "float32", "int64", "float64"])
def test_swap_of_values_congruent_modulo_one_lane_prime(name):
    """Bits equal modulo the first lane's prime differ modulo the second: still detected."""
    x, y = 5, 5 + fp._PRIMES[0]
    tensor = from_bits(name, [x, 7, 9, y])
    swapped = from_bits(name, [y, 7, 9, x])
    assert tensor_fingerprint(swapped) != tensor_fingerprint(tensor)
    if BY_NAME[name].width == 8:  # congruent modulo both 4-byte lanes' primes: the third lane
        y = 5 + fp._PRIMES[0] * fp._PRIMES[1]
        tensor, swapped = from_bits(name, [x, 7, y]), from_bits(name, [y, 7, x])
        assert tensor_fingerprint(swapped) != tensor_fingerprint(tensor)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_non_contiguous_views_match_contiguous(name):
    base = random_tensor(name, (6, 10), seed=11)
    views = [
        base.t(),
        base[:, ::3],
        base[::2, 1::4],
        base[1:5, 2:9],
        base.t()[::2],
        base.reshape(6, 5, 2).permute(2, 0, 1),
        base[0].expand(4, 10),
        base.flip(0)[::2],
    ]
    for view in views:
        assert tensor_fingerprint(view) == tensor_fingerprint(view.contiguous())
        assert tensor_fingerprint(view) == reference_fingerprint(view.contiguous())


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_shape_is_part_of_the_fingerprint(name):
    tensor = random_tensor(name, (12,), seed=4)
    shapes = [(12,), (3, 4), (4, 3), (2, 6), (12, 1), (1, 12), (2, 2, 3)]
    prints = {tensor_fingerprint(tensor.reshape(shape)) for shape in shapes}
    assert len(prints) == len(shapes)
    scalar = random_tensor(name, (), seed=4)
    assert tensor_fingerprint(scalar) != tensor_fingerprint(scalar.reshape(1))


def test_dtype_is_part_of_the_fingerprint():
    groups = {
        1: ["bool", "uint8", "int8", "float8_e4m3fn", "float8_e5m2"],
        2: ["int16", "float16", "bfloat16"],
        4: ["int32", "float32"],
        8: ["int64", "float64"],
    }
    for names in groups.values():
        base = random_tensor(names[0], (5,), seed=2)
        same_bytes = [base.view(BY_NAME[name].torch_dtype) for name in names]
        assert len({tensor_fingerprint(t) for t in same_bytes}) == len(names)
    # same bytes, other widths
    raw = random_tensor("uint8", (8,), seed=2)
    reinterpretations = [
        raw.view(BY_NAME[n].torch_dtype) for n in ("uint8", "int16", "int32", "int64")
    ]
    assert len({tensor_fingerprint(t) for t in reinterpretations}) == 4


def test_empty_tensors():
    prints = set()
    for name in DTYPE_NAMES:
        for shape in [(0,), (0, 3), (3, 0), (0, 0)]:
            tensor = torch.empty(shape, dtype=BY_NAME[name].torch_dtype)
            assert tensor_fingerprint(tensor) == reference_fingerprint(tensor)
            prints.add(tensor_fingerprint(tensor))
    assert len(prints) == 4 * len(DTYPE_NAMES)


def test_fingerprint_format_and_determinism():
    tensor = random_tensor("bfloat16", (33,), seed=8)
    first = tensor_fingerprint(tensor)
    assert len(first) == 32 and all(c in "0123456789abcdef" for c in first)
    assert tensor_fingerprint(tensor.clone()) == first
    assert tensor_fingerprint(tensor) == first


def test_parameter_with_requires_grad():
    data = random_tensor("float32", (5, 3), seed=6)
    param = torch.nn.Parameter(data.clone(), requires_grad=True)
    assert param.requires_grad and param.device.type == "cpu"
    assert tensor_fingerprint(param) == tensor_fingerprint(data)
    assert param.grad is None and param.requires_grad
    bf16 = torch.nn.Parameter(random_tensor("bfloat16", (4, 4), seed=1))
    assert tensor_fingerprint(bf16) == reference_fingerprint(bf16.detach())


# --- state fingerprints --------------------------------------------------------------------

names = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=12)
entries = st.lists(
    st.tuples(
        names,
        st.sampled_from(DTYPE_NAMES),
        st.lists(st.integers(0, 1000), max_size=3).map(tuple),
        st.text(alphabet="0123456789abcdef", min_size=32, max_size=32),
    ),
    max_size=8,
    unique_by=lambda e: e[0],
)


@PROPERTY
@given(entries, st.randoms(use_true_random=False))
def test_state_fingerprint_is_order_independent(table, random):
    shuffled = list(table)
    random.shuffle(shuffled)
    first = state_fingerprint(table)
    assert len(first) == 64
    assert state_fingerprint(shuffled) == first
    assert state_fingerprint(iter(shuffled)) == first
    assert state_fingerprint(tuple(reversed(table))) == first


@PROPERTY
@given(entries.filter(bool), st.data())
def test_state_fingerprint_changes_with_every_field(table, data):
    before = state_fingerprint(table)
    row = data.draw(st.integers(0, len(table) - 1))
    name, dtype, shape, print_ = table[row]
    taken = {e[0] for e in table}
    changes = [
        (data.draw(names.filter(lambda n: n not in taken)), dtype, shape, print_),
        (name, data.draw(st.sampled_from([d for d in DTYPE_NAMES if d != dtype])), shape, print_),
        (name, dtype, (*shape, 1), print_),
        (name, dtype, shape[:-1] if shape else (0,), print_),
        (name, dtype, shape, print_[:-1] + ("0" if print_[-1] != "0" else "1")),
    ]
    for changed in changes:
        other = [*table[:row], changed, *table[row + 1 :]]
        assert state_fingerprint(other) != before, changed
    assert state_fingerprint(table[:row] + table[row + 1 :]) != before


def test_state_fingerprint_known_layout():
    table = [("b", "int8", (2,), "1" * 32), ("a", "float32", (3, 4), "0" * 32)]
    lines = f"a\tfloat32\t3,4\t{'0' * 32}\nb\tint8\t2\t{'1' * 32}\n"
    assert state_fingerprint(table) == hashlib.sha256(lines.encode()).hexdigest()
    assert state_fingerprint([]) == hashlib.sha256(b"").hexdigest()
    # shape dims are separated, not concatenated
    one = state_fingerprint([("w", "int8", (1, 23), "0" * 32)])
    assert one != state_fingerprint([("w", "int8", (12, 3), "0" * 32)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_device_fingerprint_equals_host(name, monkeypatch):
    for row, rows in ((fp._ROW, fp._ROWS_DEVICE), (7, 2)):
        monkeypatch.setattr(fp, "_ROW", row)
        monkeypatch.setattr(fp, "_ROWS_DEVICE", rows)
        monkeypatch.setattr(fp, "_CACHE", {})
        for n in (0, 1, 7, 15, 1000):
            tensor = random_tensor(name, (n,), seed=n)
            assert tensor_fingerprint(tensor.cuda()) == tensor_fingerprint(tensor)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_accelerator_evaluation_matches_reference_on_cpu(name, monkeypatch):
    """The int64 row sums used on accelerators, run on the CPU, give the same lanes."""
    monkeypatch.setattr(fp, "_float_sums", lambda device: False)
    monkeypatch.setattr(fp, "_ROW", 7)
    monkeypatch.setattr(fp, "_ROWS_DEVICE", 2)
    monkeypatch.setattr(fp, "_CACHE", {})
    for n in SIZES:
        tensor = random_tensor(name, (n,), seed=200 + n)
        assert tensor_fingerprint(tensor) == reference_fingerprint(tensor)


def test_fingerprint_from_lanes_is_its_definition_on_every_call():
    """The kept hash of a (dtype, shape) prefix gives the §9.1 string on the first call and
    on later ones, for any lanes, and shapes given as lists or sizes alike."""

    for dtype, shape, lanes in (
        (torch.bfloat16, (64, 256), (5, 7)),
        (torch.float32, (3,), (1, 2)),
        (torch.float64, (), (1, 2, 3)),
    ):
        name = fp.info_for(dtype).name
        dims = ",".join(str(d) for d in shape)
        digest = hashlib.sha256(f"dcr-fp-1\0{name}\0{dims}\0".encode())
        digest.update(struct.pack(f"<{len(lanes)}Q", *lanes))
        expected = digest.hexdigest()[:32]
        for form in (torch.Size(shape), list(shape), tuple(shape)):
            assert fp.fingerprint_from_lanes(dtype, form, lanes) == expected
        assert fp.fingerprint_from_lanes(dtype, shape, (lanes[0] + 1, *lanes[1:])) != expected
