"""Fingerprints of canonical tensors and of whole states (spec/FORMAT.md, "Fingerprints").

A tensor fingerprint is computed with integer torch operations on whatever device
holds the tensor; only a few scalars reach the host, and the result is the same
on every device because every operation is exact 64-bit integer arithmetic.

For element ``i`` with bits ``v`` (unsigned), and each lane ``l`` with prime ``p``:

    s = v mod p                       (8-byte elements: (hi mod p)*(2^32 mod p) + lo)
    g = (s + c_l)^5 mod p             (x -> x^5 permutes Z_p since gcd(5, p-1) = 1)
    r = 1 + ((a*(i mod (p-1)) + b_l) mod (p-1))    (never 0, injective for i < p-1)
    lane_l = sum_i g*r mod p

A single changed bit changes exactly one ``g`` (a permutation) times a non-zero
``r`` modulo a prime, so it always changes the lane. A swap of two elements with
bits ``x != y`` changes a lane by ``(g(x)-g(y))(r(i)-r(j))``, non-zero unless
``x == y mod p``; the lanes' primes multiply past 2^62 (two lanes) or 2^93 (three
lanes, 8-byte dtypes), so by the Chinese remainder theorem some lane changes.
The fingerprint is the first 16 bytes of sha256 over the dtype, shape and lanes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import torch

from dcr_format.codec.dtypes import bits_view, info_for

__all__ = ["state_fingerprint", "tensor_fingerprint"]

_PRIMES = (2147483647, 2147483629, 2147483587)
_A = 1664525
_B = (12345, 67890, 13579)
_C = (1013904223, 22695477, 134775813)
_CHUNK_CPU = 1 << 16  # small enough that every temporary stays in cache
_CHUNK_DEVICE = 1 << 24  # large enough to amortise kernel launches
_MASKS = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}
_R_BASE: dict[tuple[torch.device, int], torch.Tensor] = {}


def _r_base(device: torch.device, lane: int, chunk: int) -> torch.Tensor:
    """``(a*k + b_l) mod (p-1)`` for ``k`` in ``[0, chunk)``, cached per device."""
    key = (device, lane)
    cached = _R_BASE.get(key)
    if cached is None or cached.numel() < chunk:
        m = _PRIMES[lane] - 1
        cached = (torch.arange(chunk, dtype=torch.int64, device=device) * _A + _B[lane]) % m
        _R_BASE[key] = cached
    return cached


def _lanes(tensor: torch.Tensor) -> list[int]:
    info = info_for(tensor.dtype)
    flat = bits_view(tensor.detach()).reshape(-1)
    primes = _PRIMES if info.width == 8 else _PRIMES[:2]
    device = flat.device
    step = _CHUNK_CPU if device.type == "cpu" else _CHUNK_DEVICE
    acc = torch.zeros(len(primes), dtype=torch.int64, device=device)
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step].to(torch.int64)
        count = chunk.numel()
        if info.width < 8:
            chunk = chunk & _MASKS[info.width]
            hi = lo = None
        else:
            hi = (chunk >> 32) & 0xFFFFFFFF
            lo = chunk & 0xFFFFFFFF
        for lane, p in enumerate(primes):
            m = p - 1
            s = chunk % p if hi is None else ((hi % p) * ((1 << 32) % p) + lo) % p
            x = (s + _C[lane]) % p
            x2 = x * x % p
            g = x2 * x2 % p * x % p
            # r(i) for i = start + k: (a*(start mod m) + a*k + b) mod m, shifted into [1, m]
            r = (_r_base(device, lane, step)[:count] + (_A * (start % m)) % m) % m + 1
            acc[lane] = (acc[lane] + (g * r % p).sum()) % p
    return [int(v) for v in acc.tolist()]


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    """Fingerprint (32 hex digits) of a tensor's dtype, shape and exact bits, on its device."""
    info = info_for(tensor.dtype)
    shape = ",".join(str(d) for d in tensor.shape)
    lanes = _lanes(tensor)
    digest = hashlib.sha256()
    digest.update(f"dcr-fp-1\0{info.name}\0{shape}\0".encode())
    digest.update(struct.pack(f"<{len(lanes)}Q", *lanes))
    return digest.hexdigest()[:32]


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
