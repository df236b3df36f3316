"""Damaged streams of every coding, decoded on the compiled kernels and on the reference.

A reader decodes what a store holds with compiled loops (numba, no bounds checks) where
it can, and the numpy/torch reference is the definition they match. Bytes from a store
may be corrupt or hostile, so both paths must answer damaged streams alike: the same
named refusal (the same :class:`~dcr_format.DcrError` subclass), or the same bits. Any
other exception is a bug, and so is a compiled loop that reads or writes past an array,
which run with ``NUMBA_BOUNDSCHECK=1`` (:func:`bounds_checked`) turns into an
``IndexError`` instead of silent damage.

Each case is one change of one tensor (its old and new bits) and a pair of streams: the
positions in ``rice``, ``ranges`` or ``classed`` (FORMAT.md §6), the values in ``planes``,
``rans``, ``ulp`` or ``ulp-shift`` (§7), every pair the format allows for the tensor's
dtype. A run damages one or both streams, or the entry's change count, many times over,
and decodes each through :func:`~dcr_format.delta.delta.decode_delta`, ``resolve`` (which
completes the codings against the old bits; ``classed`` with and without kept exponent
rows) and ``apply_change`` into a copy of the old tensor.

    # 20 000 damaged streams with bounds checks on (a fresh numba cache: no stale build)
    NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR=$(mktemp -d) .venv/bin/python tests/mutated_streams.py 20000

tests/test_mutated_streams.py runs it short, in the suite and under bounds checks.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from dcr_format.codings import classed, rans, ulp_shift
from dcr_format.codings.planes import to_planes
from dcr_format.codings.positions import encode_positions
from dcr_format.codings.ulp import FLOAT_DTYPES, to_ulp
from dcr_format.delta.delta import PendingDelta, apply_change, decode_delta, resolve
from dcr_format.errors import DcrError
from dcr_format.format.dtypes import bits_to_numpy, bits_view, info_for

POSITIONS = ("rice", "ranges", "classed")
VALUES = ("planes", "rans", "ulp", "ulp-shift")
FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Case:
    """One change coded one way: an ``xor`` entry's streams and the tensor they change."""

    dtype: str
    old: torch.Tensor
    new: torch.Tensor
    changed: int
    positions: tuple[str, bytes]
    values: tuple[str, bytes]

    @property
    def codings(self) -> tuple[str, str]:
        """(positions coding, values coding)."""
        return self.positions[0], self.values[0]


@contextlib.contextmanager
def kernels(which: str) -> Iterator[None]:
    """``DCR_KERNELS`` for the block: ``native`` (the compiled loops) or ``torch``."""
    saved = os.environ.pop("DCR_KERNELS", None)
    if which == "torch":
        os.environ["DCR_KERNELS"] = "torch"
    try:
        yield
    finally:
        os.environ.pop("DCR_KERNELS", None)
        if saved is not None:
            os.environ["DCR_KERNELS"] = saved


def flat_bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bits, flat, as unsigned integers of its width."""
    return bits_to_numpy(bits_view(tensor).reshape(-1))


def _changes(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(old, new) pairs: float tensors stepped as an optimizer steps fp32 masters, a run
    of consecutive changes, a few scattered ones; an int tensor with scattered increments."""
    rng = np.random.default_rng(seed)
    for dtype in FLOATS:
        # bfloat16 also over two exponent rows (the compiled select pass runs two tasks)
        sizes = (3000, classed.ROW_ELEMENTS + 4099) if dtype == torch.bfloat16 else (3000,)
        for numel in sizes:
            old = (torch.from_numpy(rng.standard_normal(numel).astype(np.float32)) * 0.02).to(dtype)
            master = old.double() * (1 + torch.from_numpy(rng.random(numel)) * 2.0**-9)
            lr = torch.from_numpy(rng.standard_normal(numel)) * 3e-5
            yield old, (master + lr).to(dtype)
            runs = old.clone()
            start = int(rng.integers(0, numel - 300))
            runs[start : start + 300] *= 1.5
            yield old, runs
            few = old.clone()
            few[torch.from_numpy(rng.choice(numel, 9, replace=False))] *= -1
            yield old, few
    ints = torch.from_numpy(rng.integers(-1000, 1000, 3000).astype(np.int32))
    bumped = ints.clone()
    bumped[torch.from_numpy(rng.random(3000) < 0.03)] += 1
    yield ints, bumped


def _value_streams(old: np.ndarray, new: np.ndarray, dtype: str) -> Iterator[tuple[str, bytes]]:
    """The values of the change in each coding whose stream the format allows: every coding
    but ``planes`` must be shorter than the raw values (FORMAT.md §7.4, §7.6)."""
    xor = old ^ new
    yield "planes", to_planes(xor)
    coded = [("rans", rans.encode_rans(xor, rans.choose_model(xor)[0]))]
    if dtype in FLOAT_DTYPES:
        z = to_ulp(old, new)
        coded.append(("ulp", rans.encode_rans(z, rans.choose_model(z)[0])))
        origin = ulp_shift.choose_origin(old, z, dtype)
        if origin is None:  # no shift pays for this change: the median exponent shifts some
            origin = int(np.median(ulp_shift.exponents_of(old, dtype))) + 1
        y, low = ulp_shift.split(old, z, origin, dtype)
        shifted = ulp_shift.assemble(origin, rans.encode_rans(y, rans.choose_model(y)[0]), low)
        coded.append(("ulp-shift", shifted))
    yield from ((c, s) for c, s in coded if len(s) < xor.nbytes)


def coded(old: torch.Tensor, new: torch.Tensor) -> list[Case]:
    """The change from ``old`` to ``new`` (contiguous, of one dtype and shape) in every pair
    of codings the format allows for their dtype; none where nothing changed."""
    dtype = info_for(old.dtype).name
    before, after = flat_bits(old), flat_bits(new)
    where = np.flatnonzero(before != after)
    if where.size == 0:
        return []
    positions = [encode_positions(where, coding=c) for c in ("rice", "ranges")]
    if dtype in FLOAT_DTYPES:
        positions.append(("classed", classed.encode_classed(where, before, dtype)))
    return [
        Case(dtype, old, new, int(where.size), stream, values)
        for values in _value_streams(before[where], after[where], dtype)
        for stream in positions
    ]


def cases(seed: int = 0) -> list[Case]:
    """Every change of :func:`_changes` in every pair of codings its dtype allows, coded on
    the reference (so that a run that checks bounds compiles only the decoders)."""
    with kernels("torch"):
        return [case for old, new in _changes(seed) for case in coded(old, new)]


def outcome(case: Case, positions: bytes, values: bytes, changed: int, rows: bool) -> object:
    """What decoding damaged streams into a copy of the old tensor ends in: the name of the
    :class:`DcrError` raised, or the bits the target holds after (any other exception
    propagates). ``rows``: hand a ``classed`` change the old bits' exponent rows, as a
    long-lived reader does."""
    target = case.old.clone()
    info = info_for(case.dtype)
    try:
        delta = decode_delta(
            "xor",
            info,
            target.numel(),
            changed,
            positions=(case.positions[0], positions),
            values=(case.values[0], values),
        )
        if rows and isinstance(delta, PendingDelta) and delta.classed is not None:
            delta = replace(delta, rows=classed.exponent_rows(flat_bits(target), case.dtype))
        apply_change(target, resolve(delta, target))
    except DcrError as exc:
        return type(exc).__name__
    return flat_bits(target).tobytes()


def damage(data: bytes, rng: np.random.Generator) -> bytes:
    """One of: a few flipped bits, a byte set at random or to 0, a cut, inserted random
    bytes, a byte widened to a run of 0xff (overlong varints, huge counts)."""
    out = bytearray(data)
    kind = int(rng.integers(0, 6))
    at = int(rng.integers(0, len(out))) if out else 0
    if kind == 0 and out:
        for _ in range(int(rng.integers(1, 4))):
            out[int(rng.integers(0, len(out)))] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1 and out:
        out[at] = int(rng.integers(0, 256))
    elif kind == 2:
        del out[int(rng.integers(0, len(out) + 1)) :]
    elif kind == 3:
        out[at:at] = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
    elif kind == 4 and out:
        out[at : at + 1] = b"\xff" * int(rng.integers(1, 12))
    elif out:
        out[at] = 0
    return bytes(out)


@dataclass
class Tally:
    """How a run's damaged streams ended, by pair of codings."""

    refused: Counter[tuple[str, str]]
    decoded: Counter[tuple[str, str]]
    differ: list[str]


def run(count: int, seed: int = 0, pool: list[Case] | None = None) -> Tally:
    """Decode ``count`` damaged streams on both paths; every disagreement is listed."""
    pool = cases() if pool is None else pool
    rng = np.random.default_rng(seed)
    tally = Tally(Counter(), Counter(), [])
    for index in range(count):
        case = pool[index % len(pool)]
        positions, values, changed = case.positions[1], case.values[1], case.changed
        what = int(rng.integers(0, 4))
        if what in (0, 2):
            positions = damage(positions, rng)
        if what in (1, 2):
            values = damage(values, rng)
        if what == 3:
            changed = max(1, changed + int(rng.choice([-1, 1, 7])))
        rows = bool(rng.integers(0, 2))
        with kernels("native"):
            native = outcome(case, positions, values, changed, rows)
        with kernels("torch"):
            reference = outcome(case, positions, values, changed, rows)
        if native != reference:
            shown = [o if isinstance(o, str) else "bits" for o in (native, reference)]
            tally.differ.append(f"{case.dtype} {case.codings} case {index}: {shown}")
        (tally.refused if isinstance(native, str) else tally.decoded)[case.codings] += 1
    return tally


def bounds_checked() -> bool:
    """Whether this process's compiled loops check their indices (``NUMBA_BOUNDSCHECK=1``):
    a loop reading past its array raises ``IndexError`` instead of reading memory."""
    from numba import njit

    @njit
    def past(a: np.ndarray) -> int:  # pragma: no cover - compiled
        return int(a[a.size + 3])

    try:
        past(np.zeros(1, dtype=np.int64))
    except IndexError:
        return True
    return False


def main(argv: list[str]) -> int:
    count = int(argv[1]) if len(argv) > 1 else 2000
    checked = bounds_checked()
    tally = run(count, seed=int(argv[2]) if len(argv) > 2 else 0)
    print(f"bounds checked: {checked}")
    for pair in sorted(set(tally.refused) | set(tally.decoded)):
        print(f"{pair}: {tally.refused[pair]} refused, {tally.decoded[pair]} decoded")
    for line in tally.differ:
        print(f"DIFFER {line}")
    return 1 if tally.differ else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
