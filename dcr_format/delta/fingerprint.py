"""Fingerprints of canonical tensors and of whole states (spec/FORMAT.md, "Fingerprints").

A tensor fingerprint is computed with integer torch operations on whatever device
holds the tensor; only a few scalars reach the host, and the result is the same
on every device because every operation is exact 64-bit integer arithmetic with
no overflow.

For element ``i`` (row-major flat index) with bits ``v`` read as an unsigned
integer, and each lane ``l`` with prime ``p_l`` (two lanes for dtypes of up to 4
bytes, three for 8-byte dtypes):

    s = v mod p_l             (8-byte elements: ((hi mod p_l)*(2^32 mod p_l) + lo) mod p_l)
    g = (s + c_l)^5 mod p_l   (x -> x^5 permutes Z_p since gcd(5, p-1) = 1)
    r = (i mod 2^30) + 1      (never 0 mod p_l, distinct for i, j less than 2^30 apart)
    lane_l = sum_i g*r mod p_l

A single changed bit changes exactly one ``g`` (a permutation of residues, and
``v < 2^32`` is its own residue pair across two primes) times a non-zero ``r``
modulo a prime, so some lane changes. A swap of elements with bits ``x != y``
changes lane ``l`` by ``(g(x)-g(y))(r(i)-r(j))``, non-zero unless
``x == y mod p_l``; the primes multiply past 2^62 (two lanes) or 2^93 (three),
so by the Chinese remainder theorem some lane changes. The fingerprint is the
first 16 bytes of sha256 over the dtype, shape and lanes.

Evaluation: elements go in rows of 2^16; per row the device sums ``g`` and
``g*col`` (both exact in int64), and ``sum g*r`` is recombined from them modulo
``p``. For 1- and 2-byte dtypes ``g`` comes from a 65536-entry table per lane.

CPU tensors go through compiled loops (:mod:`dcr_format.kernels.numba_kernels`, numba: one
parallel pass of per-row uint64 sums, reduced before they can overflow) when numba
imports and ``DCR_KERNELS`` is not ``torch``; the torch code here is the reference
they match exactly. Lane deltas of a change (``sum (g(new) - g(old)) * r``, from
:meth:`dcr_format.delta.backend.Backend.diff_with_lanes` or ``apply_with_lanes``) are added
to lanes with :func:`apply_lane_deltas`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from dcr_format.format.dtypes import bits_to_numpy, bits_view, info_for
from dcr_format.kernels.native import native_kernels

__all__ = [
    "LANE_PRIMES",
    "add_lanes",
    "apply_lane_deltas",
    "fingerprint_from_lanes",
    "lanes_after_change",
    "lanes_at",
    "state_fingerprint",
    "tensor_fingerprint",
    "tensor_lanes",
]

_PRIMES = (2147483647, 2147483629, 2147483587)
LANE_PRIMES = _PRIMES  # lane l of a fingerprint is a residue modulo LANE_PRIMES[l]
_C = (1013904223, 22695477, 134775813)
_R_PERIOD = 1 << 30
_ROW = 1 << 16  # row length on accelerators: keeps sum(g * col) below 2^62 in int64
_ROW_CPU = 1 << 10  # row length on the CPU: sums stay below 2^51, exact in a float64 matmul
_ROWS_CPU = 1024  # rows per chunk on the CPU: temporaries of a few MB
_ROWS_DEVICE = 256  # rows per chunk on accelerators: amortises kernel launches
_MASKS = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}
_CACHE: dict[tuple[str, torch.device, int], torch.Tensor] = {}


def _pow5(s: torch.Tensor, lane: int) -> torch.Tensor:
    p = _PRIMES[lane]
    x = (s + _C[lane]) % p
    x2 = x * x % p
    return x2 * x2 % p * x % p


def _cached(kind: str, device: torch.device, arg: int) -> torch.Tensor:
    """Per-device constants: ``col``/``weights`` of a row length, ``g``/``gf`` tables of a lane."""
    key = (kind, device, arg)
    value = _CACHE.get(key)
    if value is None:
        if kind == "col":
            value = torch.arange(arg, dtype=torch.int64, device=device)
        elif kind == "weights":  # [1, col] per column: one float64 matmul gives both sums
            col = torch.arange(arg, dtype=torch.float64, device=device)
            value = torch.stack([torch.ones_like(col), col], dim=1)
        elif kind == "g":  # g for every 16-bit symbol
            value = _pow5(torch.arange(1 << 16, dtype=torch.int64, device=device), arg)
        else:  # "gf": the same table as float64 (exact: every value is below 2^31)
            value = _cached("g", device, arg).to(torch.float64)
        _CACHE[key] = value
    return value


def _split(symbols: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """High and low 32-bit halves of 8-byte symbols (computed once for every lane)."""
    if width != 8:
        return None
    return (symbols >> 32) & 0xFFFFFFFF, symbols & 0xFFFFFFFF


def _g(
    symbols: torch.Tensor, split: tuple[torch.Tensor, torch.Tensor] | None, width: int, lane: int
) -> torch.Tensor:
    """g = (s + c)^5 mod p of unsigned symbols (masked to their width), same shape."""
    p = _PRIMES[lane]
    if width <= 2:
        table = _cached("g", symbols.device, lane)
        return table.index_select(0, symbols.reshape(-1)).view(symbols.shape)
    if split is None:
        return _pow5(symbols % p, lane)
    hi, lo = split
    return _pow5(((hi % p) * ((1 << 32) % p) + lo) % p, lane)


def _float_sums(device: torch.device) -> bool:
    """Row sums by float64 matmul (CPU BLAS) or by int64 reductions (accelerators)."""
    return device.type == "cpu"


def _lane_sums(
    symbols: torch.Tensor, width: int, lanes: int, first: int, row: int
) -> list[torch.Tensor]:
    """Per lane, sum of g*r mod p over a (rows, cols) block whose first flat index is ``first``."""
    rows, cols = symbols.shape
    device = symbols.device
    # r = (first mod 2^30) + row_index*row + col + 1; chunks never straddle a multiple of 2^30
    row_base = (first % _R_PERIOD) + 1 + torch.arange(rows, dtype=torch.int64, device=device) * row
    out = []
    split = _split(symbols, width)
    for lane in range(lanes):
        p = _PRIMES[lane]
        if _float_sums(device):
            # every partial sum is an integer below 2^53, so a float64 matmul (BLAS) is exact
            if width <= 2:
                table = _cached("gf", device, lane)
                gf = table.index_select(0, symbols.reshape(-1)).view(symbols.shape)
            else:
                gf = _g(symbols, split, width, lane).to(torch.float64)
            sums = (gf @ _cached("weights", device, row)[:cols]).to(torch.int64)
            s0, s1 = sums[:, 0] % p, sums[:, 1] % p
        else:  # accelerators: int64 sums (no integer matmul there)
            g = _g(symbols, split, width, lane)
            col = _cached("col", device, row)[:cols]
            s0 = g.sum(dim=1) % p  # sum_col g      < 2^47 before the mod
            s1 = (g * col).sum(dim=1) % p  # sum_col g*col  < 2^61 before the mod
        out.append(((s1 + (row_base % p) * s0 % p) % p).sum() % p)
    return out


def _symbols(bits: torch.Tensor, width: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Unsigned symbols of integer bit views (8-byte ones stay as their bits).

    ``dtype`` int32 is enough (and cheaper) for 1- and 2-byte widths.
    """
    symbols = bits.to(dtype)
    return symbols & _MASKS[width] if width < 8 else symbols


def _native_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled kernels when every tensor is on the CPU and they are enabled."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return native_kernels()


_NATIVE_TABLES: dict[int, np.ndarray] = {}


def native_table(width: int) -> np.ndarray:
    """The compiled kernels' g table of a width: (65536, 2) uint32 for 1- and 2-byte
    symbols (the torch tables, lanes side by side), empty (0, 2) for wider ones."""
    key = 2 if width <= 2 else 0
    table = _NATIVE_TABLES.get(key)
    if table is None:
        if key:
            cpu = torch.device("cpu")
            lanes = [_cached("g", cpu, lane).numpy() for lane in range(2)]
            table = np.ascontiguousarray(np.stack(lanes, axis=1).astype(np.uint32))
        else:
            table = np.empty((0, 2), dtype=np.uint32)
        _NATIVE_TABLES[key] = table
    return table


def _host_positions(positions: torch.Tensor) -> np.ndarray:
    return positions.reshape(-1).to(torch.int64).contiguous().numpy()


def tensor_lanes(tensor: torch.Tensor) -> tuple[int, ...]:
    """The fingerprint's lane values of a tensor (one full pass on its device)."""
    return tuple(_lanes(tensor))


def lanes_after_change(
    lanes: tuple[int, ...], positions: torch.Tensor, old_bits: torch.Tensor, new_bits: torch.Tensor
) -> tuple[int, ...]:
    """Lanes after the elements at ``positions`` change from ``old_bits`` to ``new_bits``.

    The lanes are sums of ``g(v_i) * r(i)`` modulo primes, so a change updates them by
    ``(g(new) - g(old)) * r(i)`` over the changed elements only: O(changed) work.
    """
    width = old_bits.element_size()
    native = _native_for(positions, old_bits, new_bits)
    if native is not None and len(lanes) == (3 if width == 8 else 2):
        deltas = native.position_lanes(
            _host_positions(positions),
            bits_to_numpy(old_bits.reshape(-1)),
            bits_to_numpy(new_bits.reshape(-1)),
            native_table(width),
            len(lanes),
        )
        return apply_lane_deltas(lanes, deltas)
    device = old_bits.device
    out = list(lanes)
    step = 1 << 20  # sum of step values below 2^31 stays far below 2^63
    for start in range(0, positions.numel(), step):
        pos = positions[start : start + step].to(device=device, dtype=torch.int64)
        old = _symbols(old_bits[start : start + step], width)
        new = _symbols(new_bits[start : start + step], width)
        r = pos % _R_PERIOD + 1
        old_split, new_split = _split(old, width), _split(new, width)
        for lane in range(len(out)):
            p = _PRIMES[lane]
            diff = (_g(new, new_split, width, lane) - _g(old, old_split, width, lane)) % p
            out[lane] = (out[lane] + int((diff * r % p).sum()) % p) % p
    return tuple(out)


def lanes_at(positions: torch.Tensor, bits: torch.Tensor) -> tuple[int, ...]:
    """Lanes of the elements at flat ``positions`` with ``bits`` alone (every other element
    counted as absent): the part of a tensor's lanes that those elements contribute.

    The lanes are sums over elements, so the lanes of disjoint parts of a tensor add up
    (:func:`add_lanes`) to the lanes of the whole: this is how a region held by one writer
    rank, or by one tensor-parallel reader rank, carries its share of a fingerprint.
    """
    width = bits.element_size()
    lanes = 3 if width == 8 else 2
    native = _native_for(positions, bits)
    if native is not None:
        sums: tuple[int, ...] = native.position_lanes(
            _host_positions(positions),
            None,
            bits_to_numpy(bits.reshape(-1)),
            native_table(width),
            lanes,
        )
        return sums
    out = [0] * lanes
    step = 1 << 20  # sum of step values below 2^31 stays far below 2^63
    for start in range(0, positions.numel(), step):
        pos = positions[start : start + step].to(device=bits.device, dtype=torch.int64)
        symbols = _symbols(bits[start : start + step], width)
        r = pos % _R_PERIOD + 1
        split = _split(symbols, width)
        for lane in range(lanes):
            p = _PRIMES[lane]
            out[lane] = (out[lane] + int((_g(symbols, split, width, lane) * r % p).sum()) % p) % p
    return tuple(out)


def add_lanes(*parts: Iterable[int]) -> tuple[int, ...]:
    """Lanes of the union of disjoint parts of one tensor: their lanes summed mod each prime."""
    rows = [tuple(part) for part in parts]
    if not rows:
        raise ValueError("add_lanes needs at least one part")
    count = len(rows[0])
    if any(len(row) != count for row in rows) or count not in (2, 3):
        raise ValueError("every part must carry the same number of lanes (2 or 3)")
    return tuple(sum(row[lane] for row in rows) % _PRIMES[lane] for lane in range(count))


def apply_lane_deltas(lanes: Iterable[int], deltas: Iterable[int]) -> tuple[int, ...]:
    """Lanes after a change whose lane deltas (``sum (g(new) - g(old)) * r`` mod each prime,
    as returned by ``diff_with_lanes`` and ``apply_with_lanes``) are ``deltas``."""
    if type(lanes) is tuple and type(deltas) is tuple and len(lanes) == len(deltas) == 2:
        # the common case (two lanes, widths up to 4 bytes) without add_lanes' generality
        return ((lanes[0] + deltas[0]) % _PRIMES[0], (lanes[1] + deltas[1]) % _PRIMES[1])
    return add_lanes(lanes, deltas)


def fingerprint_from_lanes(dtype: torch.dtype, shape: Iterable[int], lanes: Iterable[int]) -> str:
    """The fingerprint string of a tensor of ``dtype`` and ``shape`` with these lanes."""
    dims = tuple(shape)
    prefix = _PREFIXES.get((dtype, dims))
    if prefix is None:  # the hash of the dtype and shape, kept: a model has few shapes
        info = info_for(dtype)
        prefix = hashlib.sha256()
        prefix.update(f"dcr-fp-1\0{info.name}\0{','.join(str(d) for d in dims)}\0".encode())
        if len(_PREFIXES) >= _MAX_PREFIXES:
            _PREFIXES.clear()
        _PREFIXES[dtype, dims] = prefix
    values = list(lanes)
    digest = prefix.copy()
    digest.update(struct.pack(f"<{len(values)}Q", *values))
    return digest.hexdigest()[:32]


# fingerprint_from_lanes's hash of each (dtype, shape) prefix, copied for every tensor
_PREFIXES: dict[tuple[torch.dtype, tuple[int, ...]], Any] = {}
_MAX_PREFIXES = 4096


def _lanes(tensor: torch.Tensor) -> list[int]:
    info = info_for(tensor.dtype)
    flat = bits_view(tensor.detach()).reshape(-1)
    lanes = 3 if info.width == 8 else 2
    native = _native_for(flat)
    if native is not None:
        return list(native.full_lanes(bits_to_numpy(flat), native_table(info.width), lanes))
    device = flat.device
    cpu = _float_sums(device)
    row = _ROW_CPU if cpu else _ROW
    step = row * (_ROWS_CPU if cpu else _ROWS_DEVICE)
    symbol_dtype = torch.int32 if cpu and info.width <= 2 else torch.int64
    acc = torch.zeros(lanes, dtype=torch.int64, device=device)
    primes = torch.tensor(_PRIMES[:lanes], dtype=torch.int64, device=device)
    n = flat.numel()
    for start in range(0, n, step):
        chunk = _symbols(flat[start : start + step], info.width, symbol_dtype)
        full = chunk.numel() // row * row
        parts = []
        if full:
            parts.append((chunk[:full].view(-1, row), start))
        if full < chunk.numel():
            parts.append((chunk[full:].view(1, -1), start + full))
        for block, first in parts:
            acc = (acc + torch.stack(_lane_sums(block, info.width, lanes, first, row))) % primes
    return [int(v) for v in acc.tolist()]


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    """Fingerprint (32 hex digits) of a tensor's dtype, shape and exact bits, on its device."""
    return fingerprint_from_lanes(tensor.dtype, tensor.shape, _lanes(tensor))


def state_fingerprint(table: Iterable[tuple[str, str, tuple[int, ...], str]]) -> str:
    """Fingerprint (64 hex digits) of a whole state from ``(name, dtype, shape, fingerprint)``.

    sha256 over the UTF-8 lines ``name\\tdtype\\tshape\\tfingerprint\\n`` sorted by name,
    with the shape written as comma-separated decimal dimensions.
    """
    digest = hashlib.sha256()
    for name, dtype, shape, fingerprint in sorted(table):
        dims = ",".join(str(d) for d in shape)
        digest.update(f"{name}\t{dtype}\t{dims}\t{fingerprint}\n".encode())
    return digest.hexdigest()
