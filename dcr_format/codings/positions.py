"""Position streams: sorted, unique flat element indices of one tensor.

Two codings (spec/FORMAT.md, "Position codings"); the encoder keeps the smaller:

- ``rice``: gaps between successive positions, Rice-coded (unary quotients in one
  bit stream, fixed-width remainders in another). Near the entropy bound for the
  scattered changes of an optimizer step.
- ``ranges``: maximal runs of consecutive positions as (gap, length - 1) pairs in
  the narrowest unsigned little-endian width. Wins on long contiguous runs.

Decoders treat their input as hostile: every count, width and offset is checked
before anything is allocated from it.

Rice coding, Rice decoding and the choice of coding run as compiled loops
(:mod:`dcr_format.codings._rice_kernels`, numba) when numba imports and ``DCR_KERNELS`` is
not ``torch``; the numpy code here is the reference they reproduce byte for byte. A
stream the compiled decoder rejects is decoded again by the reference, which raises
the error (so both paths raise the same :class:`PositionsError`, message included).
"""

from __future__ import annotations

import math
import struct
from types import ModuleType

import numpy as np

from dcr_format.errors import PositionsError
from dcr_format.format.names import POSITION_CODINGS, RANGES, RICE
from dcr_format.kernels.native import compiled

_RICE_HEADER = struct.Struct("<BQQ")  # k, count, unary byte length
_RANGES_HEADER = struct.Struct("<BBQ")  # gap width, length width, number of runs
_WIDTHS = (1, 2, 4, 8)
MAX_RICE_K = 62


def _kernels() -> ModuleType | None:
    """The compiled ``rice`` kernels (:mod:`dcr_format.codings._rice_kernels`), or None where
    the reference runs (:func:`~dcr_format.kernels.native.compiled`)."""
    return compiled("dcr_format.codings._rice_kernels")


def _narrowest_width(max_value: int) -> int:
    for width in _WIDTHS:
        if max_value < (1 << (8 * width)):
            return width
    raise AssertionError("value does not fit in 64 bits")


def _gaps(positions: np.ndarray) -> np.ndarray:
    """Zero-based gaps: ``g[0] = p[0]``, ``g[i] = p[i] - p[i-1] - 1``."""
    gaps = np.empty(positions.shape, dtype=np.uint64)
    if positions.size:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:], casting="unsafe")
        gaps[1:] -= np.uint64(1)
    return gaps


def _best_rice_k(gaps: np.ndarray) -> int:
    """The k in [0, 62] that minimises the exact Rice-coded bit count of ``gaps``."""
    if gaps.size == 0:
        return 0
    best_k, best_bits = 0, None
    for k in _k_window(float(gaps.mean())):
        bits = int((gaps >> np.uint64(k)).sum()) + gaps.size * (1 + k)
        if best_bits is None or bits < best_bits:
            best_k, best_bits = k, bits
    return best_k


def _rice_k_guess(mean: float) -> int:
    """``floor(log2(max(mean * 0.6931, 1)))``: numpy's logarithm of that double, floored.

    Off the powers of two, that floor is the exponent :func:`math.frexp` gives less one,
    whatever the logarithm's last-place rounding (a scalar numpy call costs about 1.5 us,
    and a writer asks this twice a tensor); within a relative ``2**-30`` of one, where a
    rounding could decide it, numpy's logarithm is taken."""
    x = max(mean * 0.6931, 1.0)
    fraction, exponent = math.frexp(x)  # x = fraction * 2**exponent, 0.5 <= fraction < 1
    if _FRACTION_LOW < fraction < _FRACTION_HIGH:
        return exponent - 1
    return max(0, int(np.floor(np.log2(x))))


_FRACTION_LOW = 0.5 * (1.0 + 2.0**-30)
_FRACTION_HIGH = 1.0 - 2.0**-31


def rice_k_guesses(counts: np.ndarray, last: np.ndarray) -> np.ndarray:
    """:func:`_rice_k_guess` of each of several rank sequences at once (int64; 0 where a
    sequence is empty), from their lengths and last ranks: the mean gap of ``n`` ranks
    ending at ``e`` is ``(e - (n - 1)) / n``. The same doubles as the scalar guess (numpy
    takes one loop for both), so the same guesses."""
    n = np.maximum(counts, 1).astype(np.float64)  # an empty sequence's guess is masked below
    mean = (last - (counts - 1)).astype(np.float64) / n
    guess = np.floor(np.log2(np.maximum(mean * 0.6931, 1.0)))  # at least 0
    return np.where(counts > 0, guess, 0.0).astype(np.int64)


def _k_window(mean: float) -> range:
    """The Rice parameters §6.2 searches for gaps of this mean: two below its guess to three
    above, within ``[0, MAX_RICE_K]``."""
    guess = _rice_k_guess(mean)
    return range(max(0, guess - 2), min(MAX_RICE_K, guess + 3) + 1)


class _Plan:
    """One compiled pass over positions: the best Rice k and the exact size of each coding."""

    def __init__(self, native: ModuleType, positions: np.ndarray) -> None:
        count = int(positions.size)
        # the gaps sum to p[-1] - (count - 1): below 2^53 numpy's float mean of them is
        # exact, so float(total) / count is that mean bit for bit (same guess, same k)
        total = int(positions[-1]) - (count - 1)
        window = _k_window(float(total) / count)
        low = window.start
        sums, runs, widest, longest = native.rice_stats(positions, low, window.stop - 1)
        best_k, best_bits = 0, None
        for k in window:
            bits = int(sums[k - low]) + count * (1 + k)
            if best_bits is None or bits < best_bits:
                best_k, best_bits = k, bits
        self.native = native
        self.k = best_k
        self.unary_len = (int(sums[best_k - low]) + count + 7) // 8
        self.rem_len = (count * best_k + 7) // 8
        self.rice_size = _RICE_HEADER.size + self.unary_len + self.rem_len
        gap_w, len_w = _narrowest_width(widest), _narrowest_width(longest - 1)
        self.ranges_size = _RANGES_HEADER.size + runs * (gap_w + len_w)

    @staticmethod
    def of(positions: np.ndarray) -> _Plan | None:
        """The plan, or None where the reference must do it (no numba, no positions, and
        gap sums past 2^53, where numpy's float mean may round)."""
        native = _kernels()
        if native is None or positions.size == 0:
            return None
        if int(positions[-1]) - (int(positions.size) - 1) >= 1 << 53:
            return None
        return _Plan(native, positions)


def _encode_rice_planned(positions: np.ndarray, plan: _Plan) -> bytes:
    body: bytes = plan.native.rice_encode(positions, plan.k, plan.unary_len, plan.rem_len)
    return _RICE_HEADER.pack(plan.k, int(positions.size), plan.unary_len) + body


def encode_rice(positions: np.ndarray) -> bytes:
    """Rice-code sorted unique int64 positions."""
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    plan = _Plan.of(positions)
    if plan is not None:
        return _encode_rice_planned(positions, plan)
    return _encode_rice_reference(positions)


def _encode_rice_reference(positions: np.ndarray) -> bytes:
    """The numpy Rice encoder (the reference of the compiled one)."""
    gaps = _gaps(positions)
    count = int(gaps.size)
    k = _best_rice_k(gaps)
    quotients = gaps >> np.uint64(k)
    ends = np.cumsum(quotients + np.uint64(1), dtype=np.uint64) - np.uint64(1)
    unary_bits = np.zeros(int(ends[-1]) + 1 if count else 0, dtype=np.uint8)
    unary_bits[ends.astype(np.int64)] = 1
    unary = np.packbits(unary_bits).tobytes()
    if k and count:
        shifts = np.arange(k - 1, -1, -1, dtype=np.uint64)
        rem_bits = ((gaps[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
        remainders = np.packbits(rem_bits.reshape(-1)).tobytes()
    else:
        remainders = b""
    return _RICE_HEADER.pack(k, count, len(unary)) + unary + remainders


def _rice_header(buf: memoryview, count: int) -> tuple[int, int, memoryview]:
    """Check a ``rice`` stream's header and sizes: (k, unary byte length, body)."""
    if len(buf) < _RICE_HEADER.size:
        raise PositionsError("rice positions stream is truncated (no header); the shard is corrupt")
    k, declared, unary_len = _RICE_HEADER.unpack_from(buf)
    if declared != count:
        raise PositionsError(
            f"rice positions stream holds {declared} positions but the entry declares {count}"
        )
    if k > MAX_RICE_K:
        raise PositionsError(f"rice parameter k={k} exceeds {MAX_RICE_K}; the shard is corrupt")
    body = buf[_RICE_HEADER.size :]
    rem_len = (count * k + 7) // 8
    if unary_len > len(body) or len(body) - unary_len != rem_len:
        raise PositionsError(
            "rice positions stream sizes do not add up (truncated or padded); the shard is corrupt"
        )
    if count == 0 and unary_len:
        raise PositionsError("rice positions stream has bits but declares no positions")
    # a valid stream needs at least one unary bit per position, so this bounds memory
    if count and unary_len * 8 < count:
        raise PositionsError("rice unary stream is too short for the declared count")
    return k, unary_len, body


def _rice_native(
    data: bytes | memoryview, *, count: int, numel: int, positions: bool
) -> np.ndarray | None:
    """Compiled decoding of a stream (positions or gaps); None where the reference must run
    (no numba, or a stream the compiled checks reject: the reference raises its error)."""
    native = _kernels()
    if native is None:
        return None
    k, unary_len, body = _rice_header(memoryview(data), count)
    if count == 0:
        return np.empty(0, dtype=np.int64 if positions else np.uint64)
    array = np.frombuffer(body, dtype=np.uint8)
    decoded: np.ndarray = native.rice_decode(array, unary_len, count, k, numel, positions=positions)
    return decoded


def rice_gaps(data: bytes | memoryview, *, count: int, numel: int) -> np.ndarray:
    """Parse and check a ``rice`` stream into its zero-based gaps (uint64).

    The host half of decoding: :func:`decode_rice` sums the gaps here, a device
    decoder (:mod:`dcr_format.delta.positions`) sums them on the device.
    """
    gaps = _rice_native(data, count=count, numel=numel, positions=False)
    if gaps is not None:
        return gaps
    return _rice_gaps_reference(data, count=count, numel=numel)


def _rice_gaps_reference(data: bytes | memoryview, *, count: int, numel: int) -> np.ndarray:
    """The numpy parser of :func:`rice_gaps` (the reference of the compiled one)."""
    k, unary_len, body = _rice_header(memoryview(data), count)
    if count == 0:
        return np.empty(0, dtype=np.uint64)
    unary_bits = np.unpackbits(np.frombuffer(body[:unary_len], dtype=np.uint8))
    ones = np.flatnonzero(unary_bits)
    if ones.size != count:
        raise PositionsError(
            f"rice unary stream holds {ones.size} terminators, expected {count}; shard is corrupt"
        )
    if unary_len != int(ones[-1]) // 8 + 1:
        raise PositionsError("rice unary stream has trailing bytes after the last position")
    quotients = np.diff(ones, prepend=-1).astype(np.uint64) - np.uint64(1)
    if not k:
        return quotients
    if int(quotients.max()) > (numel >> k):
        raise PositionsError("rice positions gap exceeds the tensor size; the shard is corrupt")
    rem_bits = np.unpackbits(np.frombuffer(body[unary_len:], dtype=np.uint8))[: count * k]
    weights = np.uint64(1) << np.arange(k - 1, -1, -1, dtype=np.uint64)
    remainders = (rem_bits.reshape(count, k).astype(np.uint64) * weights).sum(
        axis=1, dtype=np.uint64
    )
    gaps: np.ndarray = (quotients << np.uint64(k)) | remainders
    return gaps


def decode_rice(data: bytes | memoryview, *, count: int, numel: int) -> np.ndarray:
    """Decode a ``rice`` stream; see :func:`decode_positions` for the checks."""
    positions = _rice_native(data, count=count, numel=numel, positions=True)
    if positions is not None:
        return positions
    return _decode_rice_reference(data, count=count, numel=numel)


def _decode_rice_reference(data: bytes | memoryview, *, count: int, numel: int) -> np.ndarray:
    """The numpy Rice decoder (the reference of the compiled one)."""
    gaps = _rice_gaps_reference(data, count=count, numel=numel)
    if gaps.size == 0:
        return np.empty(0, dtype=np.int64)
    return _finish(np.cumsum(gaps + np.uint64(1), dtype=np.uint64), numel)


def _finish(ends: np.ndarray, numel: int) -> np.ndarray:
    """Positions from exclusive running ends; checks order (and so wrap-around) and range."""
    # compare the unsigned ends: a running sum that wrapped past 2**64 goes down here
    if ends.size and (int(ends[0]) == 0 or not bool(np.all(ends[1:] > ends[:-1]))):
        raise PositionsError("positions are not strictly increasing; the shard is corrupt")
    if ends.size and int(ends[-1]) > numel:
        raise PositionsError(
            f"position {int(ends[-1]) - 1} is out of range for a tensor of {numel} elements"
        )
    return ends.view(np.int64) - 1


def encode_ranges(positions: np.ndarray) -> bytes:
    """Code sorted unique int64 positions as runs of consecutive indices."""
    if positions.size == 0:
        return _RANGES_HEADER.pack(1, 1, 0)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    run_starts = np.concatenate(([0], breaks))
    run_ends = np.concatenate((breaks, [positions.size]))
    starts = positions[run_starts].astype(np.uint64)
    lengths = (run_ends - run_starts).astype(np.uint64)
    # a uint64 zero: ([0], uint64) would promote to float64 and round positions past 2**53
    previous_end = np.concatenate((np.zeros(1, np.uint64), starts[:-1] + lengths[:-1]))
    gaps = starts - previous_end
    lengths_m1 = lengths - np.uint64(1)
    gap_w = _narrowest_width(int(gaps.max()))
    len_w = _narrowest_width(int(lengths_m1.max()))
    return (
        _RANGES_HEADER.pack(gap_w, len_w, int(starts.size))
        + gaps.astype(f"<u{gap_w}").tobytes()
        + lengths_m1.astype(f"<u{len_w}").tobytes()
    )


def ranges_runs(
    data: bytes | memoryview, *, count: int, numel: int
) -> tuple[np.ndarray, np.ndarray]:
    """Parse and check a ``ranges`` stream into run starts and lengths (int64).

    The host half of decoding: :func:`decode_ranges` expands the runs here, a
    device decoder expands them on the device.
    """
    buf = memoryview(data)
    if len(buf) < _RANGES_HEADER.size:
        raise PositionsError("ranges positions stream is truncated (no header); shard is corrupt")
    gap_w, len_w, runs = _RANGES_HEADER.unpack_from(buf)
    if gap_w not in _WIDTHS or len_w not in _WIDTHS:
        raise PositionsError(f"ranges stream declares widths {gap_w}/{len_w}; expected 1, 2, 4, 8")
    body = buf[_RANGES_HEADER.size :]
    if runs > count or len(body) != runs * (gap_w + len_w):
        raise PositionsError("ranges positions stream size does not match its run count")
    gaps = np.frombuffer(body[: runs * gap_w], dtype=f"<u{gap_w}").astype(np.uint64)
    lengths = np.frombuffer(body[runs * gap_w :], dtype=f"<u{len_w}").astype(np.uint64)
    lengths += np.uint64(1)
    if runs and int(lengths.min()) == 0:  # an 8-byte length of 2**64 - 1 wrapped to 0
        raise PositionsError("ranges stream has a run length that overflows; shard is corrupt")
    if runs and (int(gaps.max()) > numel or int(lengths.max()) > numel):
        raise PositionsError("ranges stream has a run beyond the tensor size; shard is corrupt")
    if runs > 1 and not bool(np.all(gaps[1:] > 0)):
        raise PositionsError("ranges stream has adjacent or overlapping runs; shard is corrupt")
    if int(lengths.sum(dtype=np.uint64)) != count:  # lengths <= numel, runs <= count: no wrap
        raise PositionsError(f"ranges stream covers a different number of positions than {count}")
    if runs == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    ends = np.cumsum(gaps + lengths, dtype=np.uint64)
    if runs > 1 and not bool(np.all(ends[1:] > ends[:-1])):  # unsigned: catches wrap-around
        raise PositionsError("ranges stream overflows; the shard is corrupt")
    if int(ends[-1]) > numel:
        raise PositionsError(f"ranges stream reaches past the tensor's {numel} elements")
    return (ends - lengths).view(np.int64), lengths.view(np.int64)


def decode_ranges(data: bytes | memoryview, *, count: int, numel: int) -> np.ndarray:
    """Decode a ``ranges`` stream; see :func:`decode_positions` for the checks."""
    starts, lengths = ranges_runs(data, count=count, numel=numel)
    if starts.size == 0:
        return np.empty(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(count, dtype=np.int64)


_ENCODERS = {RICE: encode_rice, RANGES: encode_ranges}
_REFERENCE_ENCODERS = {RICE: _encode_rice_reference, RANGES: encode_ranges}
_DECODERS = {RICE: decode_rice, RANGES: decode_ranges}


def plain_size_floor(count: int, last: int, runs: int) -> int:
    """A lower bound on the size of the stream :class:`PositionsChoice` keeps for ``count``
    sorted unique positions, the last ``last``, that make ``runs`` runs of consecutive
    elements, from those three numbers alone (a writer with a smaller stream in another
    coding need not plan the plain ones).

    ``rice`` with parameter ``k`` takes ``ceil(n * k / 8)`` remainder bytes and
    ``ceil((sum(g >> k) + n) / 8)`` unary bytes, where the gaps ``g`` sum to
    ``S = last - (n - 1)``, so ``sum(g >> k) >= (S - n * (2^k - 1)) / 2^k``; the k kept is
    searched around the guess of the mean gap (§6.2), so the least bound over that window
    bounds it. ``ranges`` takes at least two bytes a run.
    """
    if count < 1:
        raise ValueError("a size floor needs at least one position")
    total = last - (count - 1)
    window = _k_window(float(total) / count)
    if total >= 1 << 53:  # a float mean that may round: every k the window could hold
        window = range(MAX_RICE_K + 1)
    rice = None
    for k in window:
        quotients = max(0, -(-(total - count * ((1 << k) - 1)) >> k))
        size = (quotients + count + 7) // 8 + (count * k + 7) // 8
        rice = size if rice is None else min(rice, size)
    assert rice is not None
    return min(_RICE_HEADER.size + rice, _RANGES_HEADER.size + 2 * runs)


def rice_bound(changed: int, numel: int) -> int:
    """The most bytes a ``rice`` stream of ``changed`` of ``numel`` positions can hold and
    still decode: at most ``max(numel, 63 * changed + 1)`` bits over any k (its unary bits
    sum the gaps, which a valid stream keeps under ``numel``), plus its header."""
    return _RICE_HEADER.size + (max(numel, 63 * changed + 1) + 7) // 8 + 2


def ranges_bound(changed: int, numel: int) -> int:
    """The most bytes a ``ranges`` stream of ``changed`` positions can hold and still
    decode: at most 16 bytes a run and a run per position, plus its header."""
    del numel
    return _RANGES_HEADER.size + 16 * changed


class PositionsChoice:
    """The coding :func:`encode_positions` keeps for sorted unique int64 positions and the
    exact size of its stream, the stream itself made only when :meth:`encode` asks (a
    writer that may code the positions otherwise, ``classed``, needs only the size)."""

    def __init__(self, positions: np.ndarray) -> None:
        self._positions = np.ascontiguousarray(positions, dtype=np.int64)
        self._plan = _Plan.of(self._positions)
        self._data: bytes | None = None
        if self._plan is None:  # the reference builds both codings to compare them
            self.coding, self._data = _encode_positions_reference(self._positions)
            self.size = len(self._data)
        elif self._plan.ranges_size <= self._plan.rice_size:  # on a tie "ranges" < "rice"
            self.coding, self.size = RANGES, self._plan.ranges_size
        else:
            self.coding, self.size = RICE, self._plan.rice_size

    def encode(self) -> bytes:
        """The stream (``size`` bytes) in the chosen coding."""
        if self._data is None:
            assert self._plan is not None
            if self.coding == RANGES:
                self._data = encode_ranges(self._positions)
            else:
                self._data = _encode_rice_planned(self._positions, self._plan)
        return self._data


def encode_positions(positions: np.ndarray, *, coding: str | None = None) -> tuple[str, bytes]:
    """Encode sorted unique int64 positions; with ``coding=None`` keep the smaller coding
    (both sizes from one compiled pass, the winner encoded: :class:`PositionsChoice`)."""
    if coding is not None:
        return coding, _ENCODERS[coding](np.ascontiguousarray(positions, dtype=np.int64))
    choice = PositionsChoice(positions)
    return choice.coding, choice.encode()


def _encode_positions_reference(positions: np.ndarray) -> tuple[str, bytes]:
    """Both codings built and the smaller kept (the reference of the planned choice)."""
    candidates = [
        (len(data), name, data)
        for name, data in ((c, _REFERENCE_ENCODERS[c](positions)) for c in POSITION_CODINGS)
    ]
    _, name, data = min(candidates)
    return name, data


def decode_positions(
    coding: str, data: bytes | memoryview, *, count: int, numel: int
) -> np.ndarray:
    """Decode a position stream into a strictly increasing int64 array in ``[0, numel)``.

    Raises :class:`PositionsError` for an unknown coding, a count other than
    ``count``, truncation, trailing bytes, unsorted or duplicate positions,
    positions out of range and arithmetic overflow.
    """
    decoder = _DECODERS.get(coding)
    if decoder is None:
        raise PositionsError(f"unknown position coding {coding!r}; upgrade dcr-format")
    if count < 0 or count > numel or numel >= 1 << 63:  # positions are int64
        raise PositionsError(f"entry declares {count} changed positions for {numel} elements")
    return decoder(data, count=count, numel=numel)
