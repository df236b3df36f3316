"""The ``rans`` value coding (feature ``values-rans``, spec/FORMAT.md §7.3).

The values of one entry (XOR bits of an ``xor`` entry, new bits otherwise) are mapped to
symbols of a small alphabet: the ``S`` (at most 255) most frequent values of the entry, in
a table carried in the stream, plus one *escape* symbol for every other value, whose bits
follow the coded part raw (in ``planes`` layout). The symbols are coded with a static
model (integer frequencies at a precision ``Q <= 24`` bits, also in the stream) by the
rANS coder of the ``constriction`` library: ``AnsCoder`` with a 64-bit state, 32-bit words
and 24-bit probabilities. The frequencies go to constriction as floats ``F - 1`` that sum
to ``2**24 - (S + 1)``, so its quantisation reproduces exactly the integer model (every
step of it is exact integer arithmetic in double precision): the stream is bit-identical
on every platform and to the pure-Python coder kept here as the reference
(:func:`_encode_reference`, :func:`_decode_reference`). Where numba is usable, a compiled
coder and decoder (:mod:`dcr_format.codings._rans_kernels`) do the same arithmetic in one
loop each, without constriction's per-call model set-up; the tests hold all three equal.

On the ``+-1`` ulp changes that dominate optimizer steps this codes a changed bf16 element
in 2-3 bits where zstd over byte planes needs 4-5.

Decoding treats the stream as hostile: sizes, table order, frequencies (each at least 1,
summing below ``2**Q``), the word count and the escape count are checked before or after
the single decode call, and a stream that does not end exactly where the coder does (no
words left, state back at zero) is refused. Every failure is a :class:`ValuesError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from dcr_format.codings.planes import from_planes, to_planes
from dcr_format.errors import ValuesError
from dcr_format.format.npviews import UNSIGNED_NP
from dcr_format.kernels.native import compiled

PRECISION = 24  # constriction's default model precision (probabilities of 24 bits)
MAX_TABLE = 255
MAX_MODEL_BITS = 24  # readers: Q in [1, 24]
WRITER_MODEL_BITS = 14  # the reference writer's largest Q (FORMAT.md §7.4: a 16 KiB decode table)
MIN_VALUES = 16  # fewer values: the reference writer keeps ``planes`` (the header dominates)
MAX_VALUES = 1 << 28  # more: the word count could pass the 4-byte varint (FORMAT.md §7.4)
SAMPLE_ABOVE = 1 << 20  # more values: a strided sample decides whether to try rANS at all
_SAMPLE_SIZE = 1 << 16
_TABLE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 255)
_TABLE_SIZES_NP = np.array(_TABLE_SIZES, dtype=np.int64)
_MAX_VARINT_BYTES = 4  # frequencies and the word count are < 2**28
_MAX_TABLE_VARINT_BYTES = 10  # table steps are < 2**64
_STATE_LOW = 1 << 32


@dataclass(frozen=True)
class Model:
    """A static model: the table of values (increasing) and the frequencies at precision
    ``bits`` of the table symbols and, last, of the escape symbol (each >= 1, summing to
    ``2**bits``)."""

    table: np.ndarray  # unsigned, strictly increasing
    freqs: np.ndarray  # int64, len(table) + 1 entries
    bits: int

    def header(self, width: int) -> bytes:
        """The stream's model part: S, Q, the table and the table frequencies."""
        table = self.table.astype(np.uint64)
        steps = np.diff(table, prepend=np.uint64(0))
        steps[1:] -= np.uint64(1)
        coded = _varints(np.concatenate((steps, self.freqs[:-1].astype(np.uint64))))
        return bytes((len(self.table), self.bits)) + coded


def _varint(value: int) -> bytes:
    if value < 0x80:  # most word counts and lengths: one or two bytes, without the loop
        return bytes((value,))
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varints(values: np.ndarray) -> bytes:
    """The varints of ``values`` (uint64), concatenated (vectorised :func:`_varint`)."""
    native = _native()
    if native is not None:
        written: bytes = native.write_varints(values.astype(np.uint64)).tobytes()
        return written
    lengths = 1 + np.searchsorted(_VARINT_STEPS, values, side="right")
    offsets = np.arange(int(lengths.max(initial=1)))
    groups = (values[:, None] >> (np.uint64(7) * offsets.astype(np.uint64))[None, :]) & np.uint64(
        0x7F
    )
    more = offsets[None, :] < (lengths[:, None] - 1)
    coded = (groups | np.where(more, np.uint64(0x80), np.uint64(0))).astype(np.uint8)
    out: bytes = coded[offsets[None, :] < lengths[:, None]].tobytes()
    return out


def _read_varint(
    buf: memoryview, offset: int, what: str, limit: int = _MAX_VARINT_BYTES
) -> tuple[int, int]:
    value = 0
    for i in range(limit):
        if offset + i >= len(buf):
            raise ValuesError(f"rans values stream is truncated in its {what}; shard is corrupt")
        byte = buf[offset + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if byte == 0 and i:
                raise ValuesError(f"rans values stream has an overlong {what}; shard is corrupt")
            return value, offset + i + 1
    raise ValuesError(f"rans values stream has a {what} varint too long; the shard is corrupt")


_MAX_LENGTH_BYTES = 5  # a rANS part of 2**28 values of 8 bytes is below 2**31 bytes


def length_bytes(value: int) -> bytes:
    """The minimal varint of a length (at most 5 bytes, so below ``2**35``), as the streams
    that carry a rANS part give its length (FORMAT.md §7.6)."""
    if not 0 <= value < 1 << (7 * _MAX_LENGTH_BYTES):
        raise ValueError(f"length {value} does not fit a varint of {_MAX_LENGTH_BYTES} bytes")
    return _varint(value)


def read_length(buf: memoryview, offset: int) -> tuple[int, int]:
    """A length written by :func:`length_bytes` at ``offset``, and the offset after it;
    a truncated, overlong or too long varint is a :class:`ValuesError`."""
    return _read_varint(buf, offset, "length", _MAX_LENGTH_BYTES)


_VARINT_ERRORS = {
    1: "is truncated in its {what}",
    2: "has a {what} varint too long",
    3: "has an overlong {what}",
    4: "has a {what} over 64 bits",
}


def _read_varints(
    buf: memoryview, offset: int, count: int, limit: int, what: str
) -> tuple[np.ndarray, int]:
    """``count`` minimal varints of at most ``limit`` bytes from ``offset`` (uint64 values,
    checked to fit 64 bits), and the offset after them."""
    native = _native()
    if native is not None:
        values, end, error = native.read_varints(
            np.frombuffer(buf, dtype=np.uint8), offset, count, limit
        )
        if error:
            problem = _VARINT_ERRORS[error].format(what=what)
            raise ValuesError(f"rans values stream {problem}; the shard is corrupt")
        return values, int(end)
    window = np.frombuffer(buf[offset : offset + count * limit], dtype=np.uint8)
    ends = np.flatnonzero(window < 0x80)[:count]
    if ends.size < count:
        raise ValuesError(f"rans values stream is truncated in its {what}; the shard is corrupt")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if int(lengths.max(initial=1)) > limit:
        raise ValuesError(f"rans values stream has a {what} varint too long; the shard is corrupt")
    if bool(np.any((lengths > 1) & (window[ends] == 0))):
        raise ValuesError(f"rans values stream has an overlong {what}; the shard is corrupt")
    used = int(ends[-1]) + 1 if count else 0
    group = np.repeat(np.arange(count), lengths)
    shifts = (np.arange(used) - starts[group]) * 7
    parts = (window[:used] & np.uint8(0x7F)).astype(np.uint64)
    if bool(np.any((shifts == 63) & (parts > 1))):  # a 10th byte beyond bit 63
        raise ValuesError(f"rans values stream has a {what} over 64 bits; the shard is corrupt")
    values = np.add.reduceat(parts << shifts.astype(np.uint64), starts) if count else parts[:0]
    return values.astype(np.uint64), offset + used


def quantize(counts: np.ndarray, bits: int) -> np.ndarray:
    """Integer frequencies (each >= 1, summing to ``2**bits``) of ``counts`` (FORMAT.md §7.3):
    ``1 + floor(c * (2**bits - n) / total)``, the remainder added to the first largest count."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    free = (1 << bits) - counts.size
    freqs = 1 + (counts * free) // total  # counts * free < 2**62: counts < 2**40 elements
    freqs[int(np.argmax(counts))] += (1 << bits) - int(freqs.sum())
    return freqs


def _model_bits(count: int, table_size: int) -> int:
    return min(WRITER_MODEL_BITS, max(count.bit_length(), (table_size + 1).bit_length() + 1))


def _sizes_bits(total: int, sizes: np.ndarray) -> np.ndarray:
    """:func:`_model_bits` of every table size (``bitlen(s + 1) + 1`` is ``2 + floor(log2(s +
    1))``, exact for these small integers)."""
    lengths = np.floor(np.log2(sizes + 1)).astype(np.int64) + 2
    bits: np.ndarray = np.minimum(WRITER_MODEL_BITS, np.maximum(total.bit_length(), lengths))
    return bits


def _histogram(values: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values and their counts, most frequent first (smaller value on ties): the
    reference of the compiled ``_rans_kernels.choose``."""
    if width <= 2 and values.size >= 1 << (8 * width - 3):  # else sorting the values is less
        counts = np.bincount(values, minlength=1 << (8 * width))
        distinct = np.flatnonzero(counts)
        counts = counts[distinct]
    else:
        distinct, counts = np.unique(values, return_counts=True)
    order = np.lexsort((distinct, -counts))[:MAX_TABLE]
    return distinct[order].astype(UNSIGNED_NP[width]), counts[order].astype(np.int64)


_VARINT_STEPS = np.array([1 << shift for shift in range(7, 64, 7)], dtype=np.uint64)


def _varint_bytes(values: np.ndarray) -> int:
    """Total bytes of the varints of ``values`` (unsigned)."""
    wide = values.astype(np.uint64)
    return int(wide.size + np.searchsorted(_VARINT_STEPS, wide, side="right").sum())


def _table_bytes(table: np.ndarray) -> int:
    """Bytes of the table's varints (FORMAT.md §7.3): the first value, then each step less 1."""
    ordered = np.sort(table.astype(np.uint64))
    steps = np.diff(ordered, prepend=np.uint64(0))
    steps[1:] -= np.uint64(1)
    return _varint_bytes(steps)


def _tables_bytes(distinct: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """:func:`_table_bytes` of ``distinct[:s]`` for every ``s`` in ``sizes``, at once."""
    order = np.argsort(distinct, kind="stable")
    ordered = distinct[order].astype(np.uint64)
    chosen = order[None, :] < sizes[:, None]  # in value order: is it among the first s?
    index = np.where(chosen, np.arange(order.size)[None, :], -1)
    previous = np.maximum.accumulate(index, axis=1)
    previous = np.concatenate((np.full((sizes.size, 1), -1), previous[:, :-1]), axis=1)
    before = np.where(previous >= 0, ordered[np.maximum(previous, 0)] + np.uint64(1), 0)
    steps = ordered[None, :] - before.astype(np.uint64)
    lengths = 1 + np.searchsorted(_VARINT_STEPS, steps, side="right")
    total: np.ndarray = np.where(chosen, lengths, 0).sum(axis=1)
    return total


def choose_model(values: np.ndarray) -> tuple[Model, float]:
    """The reference writer's model for ``values`` (FORMAT.md §7.4) and its estimated size in
    bytes: the table size of least estimated cost among the candidates, the smaller on ties
    (every candidate evaluated at once, as arrays)."""
    width = values.dtype.itemsize
    native = _native()
    if native is not None and values.size:  # one compiled call: a few us instead of ~0.1 ms
        table, freqs, bits_, estimate_ = native.choose(
            values, width, _TABLE_SIZES_NP, MAX_TABLE, WRITER_MODEL_BITS
        )
        return Model(table.astype(UNSIGNED_NP[width]), freqs, int(bits_)), float(estimate_)
    distinct, counts = _histogram(values, width)
    total = int(values.size)
    sizes = np.array(
        sorted({s for s in _TABLE_SIZES if s <= distinct.size} | {min(distinct.size, MAX_TABLE)})
    )
    bits = _sizes_bits(total, sizes)
    rows, cols = np.arange(sizes.size), np.arange(int(sizes.max()) + 1)
    in_table = cols[None, :] < sizes[:, None]
    padded = np.zeros(cols.size, dtype=np.int64)
    padded[: counts.size] = counts[: cols.size]
    table_counts = np.where(in_table, padded[None, :], 0)
    escapes = total - table_counts.sum(axis=1)
    all_counts = table_counts.copy()
    all_counts[rows, sizes] = escapes
    used = cols[None, :] <= sizes[:, None]
    free = (np.int64(1) << bits) - (sizes + 1)
    freqs = np.where(used, 1 + (all_counts * free[:, None]) // total, 0)
    first_max = np.argmax(np.where(used, all_counts, -1), axis=1)
    freqs[rows, first_max] += (np.int64(1) << bits) - freqs.sum(axis=1)
    logs = np.log2(np.maximum(freqs, 1).astype(np.float64))
    coded = np.where(all_counts > 0, all_counts * (bits[:, None] - logs), 0.0).sum(axis=1)
    words = np.ceil(coded / 32).astype(np.int64) + 1  # the final state takes one or two
    # frequencies are below 2**24: a varint of 1 to 4 bytes
    extra = (freqs >= 1 << 7).astype(np.int64) + (freqs >= 1 << 14) + (freqs >= 1 << 21)
    freq_bytes = in_table.sum(axis=1) + np.where(in_table, extra, 0).sum(axis=1)
    table_bytes = _tables_bytes(distinct, sizes)
    word_bytes = 1 + (words >= 1 << 7).astype(np.int64) + (words >= 1 << 14) + (words >= 1 << 21)
    estimate = 2 + table_bytes + freq_bytes + word_bytes + 4 * words + width * escapes
    return _chosen(distinct, counts, total, sizes, bits, estimate)


def _chosen(
    distinct: np.ndarray,
    counts: np.ndarray,
    total: int,
    sizes: np.ndarray,
    bits: np.ndarray,
    estimate: np.ndarray,
) -> tuple[Model, float]:
    """The model of the candidate of least estimate (the first, so the smallest, on ties)."""
    best = int(np.argmin(estimate))
    size, chosen_bits = int(sizes[best]), int(bits[best])
    table_counts = counts[:size].astype(np.int64)
    chosen = quantize(np.append(table_counts, total - int(table_counts.sum())), chosen_bits)
    order = np.argsort(distinct[:size], kind="stable")
    table = distinct[:size][order]
    return Model(table, np.append(chosen[:-1][order], chosen[-1]), chosen_bits), float(
        estimate[best]
    )


def worth_trying(values: np.ndarray) -> bool:
    """Whether rANS may beat byte planes: :data:`MIN_VALUES` to :data:`MAX_VALUES` values and, above
    :data:`SAMPLE_ABOVE` values, a strided sample whose estimate is under 85% of the raw
    planes (full tensors of weights are not; deltas of an optimizer step are)."""
    if not MIN_VALUES <= values.size <= MAX_VALUES:
        return False
    if values.size <= SAMPLE_ABOVE:
        return True
    # a copy, not a strided view: the compiled model takes contiguous values only, and a
    # second compiled form for strided ones would double its first compile
    sample = np.ascontiguousarray(values[:: values.size // _SAMPLE_SIZE])
    _, estimate = choose_model(sample)
    return estimate < 0.85 * sample.size * values.dtype.itemsize


def _symbols(values: np.ndarray, table: np.ndarray, width: int) -> np.ndarray:
    """Each value's table index, or ``len(table)`` (the escape) when it is not in the table."""
    escape = table.size
    if width <= 2 and values.size >= 1 << (8 * width - 6):  # else searching is less work
        lut = np.full(1 << (8 * width), escape, dtype=np.int32)
        lut[table.astype(np.int64)] = np.arange(escape, dtype=np.int32)
        symbols: np.ndarray = lut[values]
        return symbols
    index = np.searchsorted(table, values).astype(np.int32)
    clipped = np.minimum(index, escape - 1)
    index[table[clipped] != values] = escape
    return index


def _constriction_model(freqs: np.ndarray, bits: int) -> Any:  # constriction has no stubs
    import constriction

    scaled = freqs.astype(np.int64) << (PRECISION - bits)
    # floats F - 1 summing to 2**24 - n: constriction's "fast" quantisation then computes
    # left cumulatives floor(sum_{k<j}(F_k - 1) * 1.0) + j = sum_{k<j} F_k, exactly
    return constriction.stream.model.Categorical((scaled - 1).astype(np.float64), perfect=False)


def encode_rans(values: np.ndarray, model: Model) -> bytes:
    """The ``rans`` stream of ``values`` (unsigned, at least one) under ``model``: coded by
    the compiled coder (:mod:`dcr_format.codings._rans_kernels`, one call for the symbols,
    words, escapes and table varints) where numba is usable, else by ``constriction`` (the
    same bytes; tests compare both with :func:`_encode_reference`)."""
    native = _native()
    if native is not None:
        varints, words, escaped = native.encode(
            values,
            values.dtype.itemsize,
            model.table.astype(np.uint64, copy=False),
            model.freqs.astype(np.int64, copy=False),
            model.bits,
        )
        head = bytes((len(model.table), model.bits)) + varints.tobytes()
    else:
        import constriction

        symbols = _symbols(values, model.table, values.dtype.itemsize)
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(symbols, _constriction_model(model.freqs, model.bits))
        words = coder.get_compressed()
        escaped = values[symbols == model.table.size]
        head = model.header(values.dtype.itemsize)
    words = np.ascontiguousarray(words, dtype="<u4")
    tail = to_planes(escaped) if escaped.size else b""  # most streams escape nothing
    return b"".join((head, _varint(int(words.size)), words.tobytes(), tail))


def max_words(count: int) -> int:
    """The most 32-bit words ``count`` symbols can take (at most 24 bits each, plus the
    final state of 64 bits)."""
    return (PRECISION * count + 64 + 31) // 32


@dataclass(frozen=True)
class _Parsed:
    table: np.ndarray
    freqs: np.ndarray
    bits: int
    words: np.ndarray  # native uint32
    escapes: memoryview
    escape_count: int


def _parse(data: bytes | memoryview, *, count: int, width: int) -> _Parsed:
    buf = memoryview(data)
    if count < 1:
        raise ValuesError("rans values stream for an entry of no values; the shard is corrupt")
    if len(buf) >= count * width:
        raise ValuesError(
            f"rans values stream of {len(buf)} bytes is not shorter than the {count * width} "
            "bytes of planes; the shard is corrupt"
        )
    if len(buf) < 2:
        raise ValuesError("rans values stream is truncated (no header); the shard is corrupt")
    size, bits = buf[0], buf[1]
    if not 1 <= size <= MAX_TABLE or not 1 <= bits <= MAX_MODEL_BITS or (1 << bits) <= size:
        raise ValuesError(
            f"rans values stream declares {size} symbols at {bits} bits; the shard is corrupt"
        )
    steps, offset = _read_varints(buf, 2, size, _MAX_TABLE_VARINT_BYTES, "table")
    if sum(int(v) + 1 for v in steps.tolist()) - 1 >= 1 << (8 * width):  # exact: Python ints
        raise ValuesError(f"rans value table holds a value over {width} bytes; shard is corrupt")
    table = (np.cumsum(steps + np.uint64(1), dtype=np.uint64) - np.uint64(1)).astype(
        UNSIGNED_NP[width]
    )
    coded, offset = _read_varints(buf, offset, size, _MAX_VARINT_BYTES, "frequencies")
    if int(coded.min()) < 1:
        raise ValuesError("rans model has a zero frequency; the shard is corrupt")
    total = int(coded.sum())  # each < 2**28, at most 255 of them: no wrap
    if total >= 1 << bits:
        raise ValuesError("rans model frequencies leave nothing for the escape; shard is corrupt")
    freqs = np.append(coded.astype(np.int64), (1 << bits) - total)
    words_count, offset = _read_varint(buf, offset, "word count")
    if words_count > max_words(count) or offset + 4 * words_count > len(buf):
        raise ValuesError("rans values stream has more words than it holds or can need")
    words = np.frombuffer(buf[offset : offset + 4 * words_count], dtype="<u4").astype(np.uint32)
    if words_count and int(words[-1]) == 0:
        raise ValuesError("rans values stream ends in a zero word; the shard is corrupt")
    escapes = buf[offset + 4 * words_count :]
    if len(escapes) % width:
        raise ValuesError("rans escaped values are not whole values; the shard is corrupt")
    escape_count = len(escapes) // width
    if escape_count > count:
        raise ValuesError("rans values stream holds more escapes than values; shard is corrupt")
    return _Parsed(table, freqs, bits, words, escapes, escape_count)


def _assemble(parsed: _Parsed, symbols: np.ndarray, count: int, width: int) -> np.ndarray:
    escape = parsed.table.size
    is_escape = symbols == escape
    escaped = int(np.count_nonzero(is_escape))
    if escaped != parsed.escape_count:
        raise ValuesError(
            f"rans values stream codes {escaped} escapes but holds {parsed.escape_count}; "
            "the shard is corrupt"
        )
    out: np.ndarray = parsed.table[np.minimum(symbols, escape - 1)]
    if escaped:
        out[is_escape] = from_planes(parsed.escapes, escaped, width)
    return out


def _native() -> ModuleType | None:
    return compiled("dcr_format.codings._rans_kernels")


STREAM_ERRORS: dict[int, str] = {
    1: "is for an entry of no values",
    2: "is not shorter than its planes",
    3: "is truncated (no header)",
    4: "declares a table size or precision out of range",
    5: "has a table value over the width",
    6: "has a zero frequency",
    7: "has frequencies that leave nothing for the escape",
    8: "has more words than it holds or can need",
    9: "ends in a zero word",
    10: "has escaped values that are not whole values",
    11: "holds more escapes than values",
    12: "has words left after its values",
    13: "codes another number of escapes than it holds",
    **{
        base + code: f"{problem} in its {what}"
        for base, what in ((10, "table"), (20, "frequencies"), (30, "word count"))
        for code, problem in (
            (1, "is truncated"),
            (2, "has a varint too long"),
            (3, "has an overlong varint"),
            (4, "has a varint over 64 bits"),
        )
    },
}
"""What each error number of the compiled stream decoder means (FORMAT.md §7.3's rules)."""


def decode_rans(data: bytes | memoryview, *, count: int, width: int) -> np.ndarray:
    """Decode a ``rans`` stream into ``count`` unsigned values of ``width`` bytes; refuses
    every malformed stream with :class:`ValuesError` (FORMAT.md §7.3)."""
    import constriction

    native = _native()
    if native is not None and count >= 0:
        out = np.empty(count, dtype=UNSIGNED_NP[width])
        error = native.decode_stream(np.frombuffer(data, dtype=np.uint8), count, width, out)
        if error:
            raise ValuesError(f"rans values stream {STREAM_ERRORS[error]}; the shard is corrupt")
        return out
    parsed = _parse(data, count=count, width=width)
    try:
        if parsed.words.size:
            coder = constriction.stream.stack.AnsCoder(parsed.words)
        else:
            coder = constriction.stream.stack.AnsCoder()
        symbols = np.asarray(
            coder.decode(_constriction_model(parsed.freqs, parsed.bits), count), dtype=np.int32
        )
        leftover = coder.pos()
    except (ValueError, RuntimeError, OverflowError) as exc:  # constriction's own refusals
        raise ValuesError(f"rans values stream does not decode ({exc}); shard is corrupt") from None
    if tuple(leftover) != (0, 0):
        raise ValuesError("rans values stream has words left after its values; shard is corrupt")
    return _assemble(parsed, symbols, count, width)


def decode_rans_pair(
    first: tuple[bytes | memoryview, int], second: tuple[bytes | memoryview, int], *, width: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Two ``rans`` streams, each ``(data, count)`` of values of ``width`` bytes, decoded at
    once: their symbols alternate, so that the chain of dependent steps of one fills the
    waits of the other's (a symbol of one stream waits on the one before it). Each comes
    back as :func:`decode_rans` decodes it, or None where it breaks a rule of FORMAT.md
    §7.3, or for both without the compiled decoder: the caller decodes that one alone (for
    its values, or its error)."""
    native = _native()
    (data, count), (data2, count2) = first, second
    if native is None:
        return None, None
    out = np.empty(max(count, 0), dtype=UNSIGNED_NP[width])  # a count below 1 is refused
    out2 = np.empty(max(count2, 0), dtype=UNSIGNED_NP[width])
    error, error2 = native.decode_pair(
        np.frombuffer(data, dtype=np.uint8),
        count,
        out,
        np.frombuffer(data2, dtype=np.uint8),
        count2,
        out2,
        width,
    )
    return (None if error else out), (None if error2 else out2)


# --- pure-Python reference of the coder (FORMAT.md §7.3); tests compare it with the above ---


def _cumulative(freqs: np.ndarray, bits: int) -> tuple[list[int], list[int]]:
    scaled = [int(f) << (PRECISION - bits) for f in freqs]
    starts = [0]
    for f in scaled[:-1]:
        starts.append(starts[-1] + f)
    return scaled, starts


def _encode_reference(values: np.ndarray, model: Model) -> bytes:
    """The stream of :func:`encode_rans`, computed step by step as FORMAT.md §7.3 states."""
    width = values.dtype.itemsize
    symbols = _symbols(values, model.table, width).tolist()
    scaled, starts = _cumulative(model.freqs, model.bits)
    state, words = 0, []
    for s in reversed(symbols):
        if (state >> (64 - PRECISION)) >= scaled[s]:
            words.append(state & 0xFFFFFFFF)
            state >>= 32
        state = ((state // scaled[s]) << PRECISION) | (starts[s] + state % scaled[s])
    if state >= _STATE_LOW:
        words += [state & 0xFFFFFFFF, state >> 32]
    elif state:
        words.append(state)
    escaped = values[np.asarray(symbols, dtype=np.int64) == model.table.size]
    packed = np.asarray(words, dtype="<u4").tobytes()
    return model.header(width) + _varint(len(words)) + packed + to_planes(escaped)


def _decode_reference(data: bytes | memoryview, *, count: int, width: int) -> np.ndarray:
    """The values of a ``rans`` stream, decoded step by step as FORMAT.md §7.3 states."""
    parsed = _parse(data, count=count, width=width)
    scaled, starts = _cumulative(parsed.freqs, parsed.bits)
    words = parsed.words.tolist()
    state = 0
    if words:
        state = words.pop()
        if words:
            state = (state << 32) | words.pop()
    symbols = []
    mask = (1 << PRECISION) - 1
    for _ in range(count):
        quantile = state & mask
        s = int(np.searchsorted(starts, quantile, side="right")) - 1
        symbols.append(s)
        state = (state >> PRECISION) * scaled[s] + quantile - starts[s]
        if state < _STATE_LOW and words:
            state = (state << 32) | words.pop()
    if words or state:
        raise ValuesError("rans values stream has words left after its values; shard is corrupt")
    return _assemble(parsed, np.asarray(symbols, dtype=np.int32), count, width)


__all__ = [
    "MAX_TABLE",
    "Model",
    "choose_model",
    "decode_rans",
    "decode_rans_pair",
    "encode_rans",
    "length_bytes",
    "max_words",
    "quantize",
    "read_length",
    "worth_trying",
]
