"""Per-tensor deltas: choose an op, encode its streams, decode and apply them.

Ops (spec/FORMAT.md, "Ops"):

- ``xor``: positions of changed elements and ``old ^ new`` bits there. Smallest;
  the receiver must hold exactly the parent's bits.
- ``overwrite``: the same positions and the new bits. Safe to re-apply.
- ``full``: every element's bits, no positions.

An ``xor`` entry's positions may be coded against the old bits (``classed``, feature
``positions-classed``, FORMAT.md §6.5), and its values as ulp differences from them
(``ulp``, feature ``values-ulp``, §7.5; ``ulp-shift``, feature ``values-ulp-shift``, §7.6,
which also shifts them by the old value's exponent): where the writer is allowed a coding and it is
shorter, :func:`encode_diff` keeps it, and :func:`decode_delta` then returns a change that
:func:`resolve` completes against the tensor it is about to be applied to.

Diffing and applying run on the tensors' own device, through one
:class:`~dcr_format.delta.backend.Backend` per tensor (Triton kernels for CUDA tensors, the
compiled loops for CPU ones, or their torch reference: the results are bit-identical),
chosen where a function starts on a tensor or given by its caller; stream coding runs on the
host over the compacted payload only, which leaves a GPU through pinned memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import zstandard

from dcr_format.codings.classed import (
    EXPONENT_FIELDS,
    ClassedStream,
    encode_classed_counted,
    parse_classed,
    with_ranks,
)
from dcr_format.codings.positions import PositionsChoice, plain_size_floor
from dcr_format.codings.rans import decode_rans
from dcr_format.codings.ulp import FLOAT_DTYPES, from_ulp, to_ulp, ulp_of_change
from dcr_format.codings.ulp_shift import join, parse
from dcr_format.codings.values import decode_values, encode_values, encode_xor_values
from dcr_format.delta.backend import Backend, to_device, to_host
from dcr_format.delta.backends import backend_for
from dcr_format.delta.classed_change import decode_classed_at, device_classed, device_positions
from dcr_format.delta.positions import decode_positions_to
from dcr_format.delta.staged import StagedChange
from dcr_format.errors import PositionsError, TargetError, ValuesError
from dcr_format.format.dtypes import (
    UNSIGNED_NP,
    DtypeInfo,
    bits_to_numpy,
    bits_view,
    flat_bits,
    info_for,
    numpy_to_bits,
)
from dcr_format.format.features import NO_CODINGS, EncodeOptions
from dcr_format.format.names import (
    CLASSED,
    FULL,
    OPS,
    OVERWRITE,
    PLANES,
    RANS,
    ULP,
    ULP_SHIFT,
    XOR,
)
from dcr_format.kernels.reference import Diff

# Above this change rate the encoder also tries ``full`` and keeps the smaller.
FULL_CANDIDATE_RATE = 0.2


@dataclass(frozen=True)
class DecodedDelta:
    """One tensor's change, ready to apply: its positions (None for ``full``) and the bits
    it puts there (``xor``: old ^ new; ``overwrite``, ``full``: the new bits).

    ``ulp``: the values are zigzag ulp differences from the old bits instead of XOR bits (a
    resolved ``ulp`` change where the backend reads the old bits, steps them and writes the
    new ones in one pass: :func:`apply_change`, :func:`stage_change`). ``before``: the old
    bits at the positions where :func:`resolve` read them and was asked to keep them (its
    caller applies the change right after, to the same bits), so that :func:`apply_change`
    does not read them again. ``rows``: the exponent rows of the old bits a ``classed``
    change was resolved against (given or counted), for its caller to move to the new bits
    after applying (:func:`dcr_format.delta.classed_change.rows_after`)."""

    op: str
    positions: torch.Tensor | None  # int64, strictly increasing (None: full)
    values: torch.Tensor  # the dtype's integer bits view
    ulp: bool = False
    before: torch.Tensor | None = None
    rows: np.ndarray | None = None

    @property
    def needs_target(self) -> bool:
        """False: nothing left to read from the target before this applies."""
        return False

    @property
    def nbytes(self) -> int:
        """Bytes the change holds (its positions, values and kept old bits)."""
        held = (self.positions, self.values, self.before)
        return sum(t.numel() * t.element_size() for t in held if t is not None)


@dataclass(frozen=True)
class PendingDelta:
    """One tensor's ``xor`` change decoded but coded against the old bits it applies to:
    :func:`resolve` completes it against them into a :class:`DecodedDelta`.

    ``classed``: its positions coded by the old bits' exponent classes (``positions`` None
    until resolved; FORMAT.md §6.5). ``ulp``: its values are zigzag ulp differences from the
    old bits (§7.5), and with ``shift``, the stream's origin and packed low bits, shifted
    differences that the old values' exponents complete (``ulp-shift``, §7.6). ``rows``: the
    exponent rows of the old bits where the caller kept them
    (:func:`dcr_format.codings.classed.exponent_rows`), so that :func:`resolve` need not
    count them."""

    op: str
    positions: torch.Tensor | None  # int64, strictly increasing; None: ``classed``
    values: torch.Tensor  # the dtype's integer bits view (ulp differences where ``ulp``)
    classed: ClassedStream | None = None
    ulp: bool = False
    shift: tuple[int, bytes] | None = None
    rows: np.ndarray | None = None

    @property
    def needs_target(self) -> bool:
        """True: :func:`resolve` must read the target's old bits before this applies."""
        return True


# What :func:`decode_delta` gives: a change ready to apply, or one still to resolve.
Delta = DecodedDelta | PendingDelta


def ready(delta: Delta) -> DecodedDelta:
    """``delta`` as a change ready to apply; a :class:`PendingDelta` is refused (it must be
    resolved against its target first)."""
    if isinstance(delta, PendingDelta):
        raise ValueError("resolve() the change against its target before applying it")
    return delta


@dataclass(frozen=True)
class EncodedTensor:
    """The streams of one tensor's entry, before they go into a shard."""

    op: str
    changed: int
    positions_coding: str | None
    positions: bytes | None
    values_coding: str | None
    values: bytes | None
    # the change as new bits (overwrite or full), or as XOR bits where the diff's own pass
    # already advanced the writer's baseline: what brings a baseline to the new bits
    advance: DecodedDelta | None = None
    # fingerprint lane deltas of the change, when the diff computed them (FORMAT.md §9.1)
    lane_deltas: tuple[int, ...] | None = None
    # the exponent rows of the new bits, where the writer counted or moved them to consider
    # ``classed`` positions (:func:`dcr_format.codings.classed.exponent_rows`): its next
    # step's old rows
    rows: np.ndarray | None = None
    # the classes (base, K) the ``classed`` positions were counted in, where they were: what
    # the next step's diff ranks its changes in (:class:`~dcr_format.kernels.reference.ClassPlan`)
    classes: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        """Encoded bytes before the shard's compression."""
        return len(self.positions or b"") + len(self.values or b"")


def changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices (sorted) where the bits of ``old`` and ``new`` differ."""
    old_bits, new_bits = bits_view(old).reshape(-1), bits_view(new).reshape(-1)
    return backend_for(old_bits, new_bits).changed_positions(old_bits, new_bits)


def _estimate(values: bytes) -> int:
    return len(zstandard.ZstdCompressor(level=1).compress(values))


def check_encode_op(op: str | None) -> None:
    """Refuse an ``op`` the encoder does not know (None chooses by size)."""
    if op is not None and op not in OPS:
        raise ValueError(f"unknown op {op!r}; use one of {', '.join(OPS)}")


def encode_tensor(
    new: torch.Tensor,
    old: torch.Tensor | None = None,
    *,
    op: str | None = None,
    options: EncodeOptions = NO_CODINGS,
) -> EncodedTensor:
    """Encode the change from ``old`` to ``new``.

    ``op=None`` chooses by size: ``full`` when there is no comparable ``old``
    (absent, other dtype or shape), else ``xor``, or ``full`` when the change rate
    is high and ``full`` encodes smaller. ``xor`` and ``overwrite`` need ``old``.
    ``options``: the codings beyond the ones every reader has that the encoder may use
    (where they are smaller); none by default.
    """
    info_for(new.dtype)  # refuses dtypes the format cannot carry
    is_comparable = comparable(new, old)
    check_encode_op(op)
    if op in (XOR, OVERWRITE) and not is_comparable:
        raise ValueError(f"op {op!r} needs a baseline of the same dtype and shape")
    if not is_comparable or op == FULL:
        return _encode_full(new, options)
    assert old is not None
    old_bits, new_bits = bits_view(old).reshape(-1), bits_view(new).reshape(-1)
    backend = backend_for(old_bits, new_bits)
    found = backend.diff(old_bits, new_bits, want_xor=op != OVERWRITE)
    return encode_diff(new, found, op=op, backend=backend, options=options)


def comparable(new: torch.Tensor, old: torch.Tensor | None) -> bool:
    """Whether ``old`` can be the baseline of a positional delta of ``new``."""
    return old is not None and old.dtype == new.dtype and old.shape == new.shape


def encode_diff(
    new: torch.Tensor,
    found: Diff,
    *,
    op: str | None = None,
    host: tuple[torch.Tensor, torch.Tensor] | None = None,
    lane_deltas: tuple[int, ...] | None = None,
    baseline: torch.Tensor | None = None,
    rows: np.ndarray | None = None,
    backend: Backend | None = None,
    options: EncodeOptions = NO_CODINGS,
) -> EncodedTensor:
    """Encode a computed change of ``new`` (the second half of :func:`encode_tensor`).

    ``found`` holds the positions and the XOR bits (``op`` overwrite: the new bits), and
    may hold both, on the tensors' device; the result's ``advance`` carries the new bits
    where it has them, else the XOR bits. ``host`` optionally carries CPU copies of
    the positions and of the values to encode (already fetched, e.g. by a pipeline);
    ``lane_deltas`` the change's fingerprint lane deltas, kept for the writer;
    ``baseline`` the old tensor where it still holds the old bits on a device (there the
    ``classed`` classes and ranks are computed, :meth:`.Backend.class_ranks`);
    ``rows`` the exponent rows of the old bits where the writer keeps them (host tensors;
    the result carries those of the new bits, :attr:`EncodedTensor.rows`); ``backend`` the
    one that found the change (else chosen for ``new``); ``options`` the codings allowed
    (see :func:`encode_tensor`).
    """
    positions, new_values = found.positions, found.new_values
    changed = int(positions.numel())
    if changed == 0:  # the bits and so their rows stay as they are
        return EncodedTensor(
            op or XOR, 0, None, None, None, None, lane_deltas=lane_deltas, rows=rows
        )
    if backend is None:
        backend = backend_for(bits_view(new))
    if host is None:
        picked = new_values if op == OVERWRITE else found.xor_values
        assert picked is not None
        host = (to_host(positions), to_host(picked))
    at = host[0].numpy()
    xor_bits = bits_to_numpy(host[1])  # the XOR bits (new bits for overwrite), on the host
    dtype = info_for(new.dtype).name
    allowed = options.codings
    xor_op = op is None or op == XOR
    # a CPU change that kept its new bits: they and the old bits at the positions (``after ^
    # xor``) serve the ``classed`` positions and the ``ulp`` values alike, taken once here
    after: np.ndarray | None = None
    before: np.ndarray | None = None
    if xor_op and new_values is not None and new.is_cpu and dtype in FLOAT_DTYPES:
        after = bits_to_numpy(new_values)
        before = after ^ xor_bits
    # a backend with the base class's ulp_on_device (never) runs no ulp pass on a device
    ulp_kernels = type(backend).ulp_on_device is not Backend.ulp_on_device
    plain: PositionsChoice | None = None  # §6.4's coding; encoded only if it is kept
    pos_coding, pos_bytes = None, None
    new_rows = None
    classes = None
    if xor_op and _classed_wanted(new, baseline, allowed, dtype):  # host[1]: the XOR bits
        runs = None
        if new.is_cpu:
            if after is None and new_values is not None:
                after = bits_to_numpy(new_values.cpu())
            counted = encode_classed_counted(
                at,
                bits_to_numpy(flat_bits(new)),
                dtype,
                xor=xor_bits,
                after=after,
                rows=rows,
                before=before,
                ranked=found.ranked,
            )
            coded, new_rows, runs, classes = counted
        else:
            assert baseline is not None
            coded = device_classed(bits_view(baseline).reshape(-1), positions, new.dtype, backend)
        # below the floor of every plain coding, those need no plan (a pass over the positions)
        if runs is not None and len(coded) < plain_size_floor(changed, int(at[-1]), runs):
            pos_coding, pos_bytes = CLASSED, coded
        else:
            plain = PositionsChoice(at)
            if len(coded) < plain.size:
                pos_coding, pos_bytes = CLASSED, coded
    if pos_bytes is None:
        if plain is None:
            plain = PositionsChoice(at)
        pos_coding, pos_bytes = plain.coding, plain.encode()
    if xor_op and ULP_SHIFT in allowed and dtype in FLOAT_DTYPES:
        on_device = (
            _device_ulp_of_change(new, found, backend, want_old=True) if ulp_kernels else None
        )
        if on_device is not None:
            differences, before = on_device
        elif before is not None and after is not None:
            differences = to_ulp(before, after)
        else:
            before = _old_of_change(new, positions, xor_bits, found.new_values)
            differences = to_ulp(before, before ^ xor_bits)
        val_coding, val_bytes = encode_xor_values(
            xor_bits, differences, old=before, dtype=dtype, codings=allowed
        )
    elif xor_op and ULP in allowed and dtype in FLOAT_DTYPES:
        on_device = (
            _device_ulp_of_change(new, found, backend, want_old=False) if ulp_kernels else None
        )
        if on_device is not None:
            differences = on_device[0]
        elif before is not None and after is not None:
            differences = to_ulp(before, after)
        else:
            differences = _ulp_differences(new, positions, xor_bits, found.new_values)
        val_coding, val_bytes = encode_xor_values(xor_bits, differences, codings=allowed)
    else:
        val_coding, val_bytes = encode_values(xor_bits, codings=_plain_codings(options))
    if new_values is not None:
        advance = DecodedDelta(OVERWRITE, positions, new_values)
    else:  # a diff that advanced its baseline in its own pass kept only the XOR bits
        assert found.xor_values is not None
        advance = DecodedDelta(XOR, positions, found.xor_values)
    delta = EncodedTensor(
        op or XOR,
        changed,
        pos_coding,
        pos_bytes,
        val_coding,
        val_bytes,
        advance,
        lane_deltas,
        new_rows,
        classes,
    )
    if op is None and changed > FULL_CANDIDATE_RATE * new.numel():
        full = _encode_full(new, options)
        assert full.values is not None and val_bytes is not None
        if _estimate(full.values) < len(pos_bytes) + _estimate(val_bytes):
            return replace(full, rows=new_rows, classes=classes)  # the same new bits
    return delta


def _device_ulp_of_change(
    new: torch.Tensor, found: Diff, backend: Backend, *, want_old: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """The zigzag ulp differences of a change (and, ``want_old``, its old bits) computed on
    the tensors' device by the Triton kernels (:meth:`Backend.ulp_on_device`), then fetched
    to the host for the entropy coder; None where they do not run there."""
    if found.xor_values is None:
        return None
    flat = flat_bits(new)
    if not backend.ulp_on_device(flat):
        return None
    new_values = found.new_values
    z, old = backend.ulp_of_change(
        flat,
        found.positions.to(flat.device),
        found.xor_values.to(flat.device),
        None if new_values is None else new_values.to(flat.device),
        want_old=want_old,
    )
    differences = bits_to_numpy(to_host(z))
    before = bits_to_numpy(to_host(old)) if old is not None else differences[:0]
    return differences, before


def _ulp_differences(
    new: torch.Tensor,
    positions: torch.Tensor,
    xor_bits: np.ndarray,
    new_values: torch.Tensor | None,
) -> np.ndarray:
    """The zigzag ulp differences of a change (``xor_bits``: its XOR bits on the host)."""
    if new_values is None and new.device.type == "cpu":  # new bits read in the same loop
        flat = bits_to_numpy(bits_view(new).reshape(-1))
        return ulp_of_change(flat, to_host(positions).numpy(), xor_bits)
    before = _old_of_change(new, positions, xor_bits, new_values)
    return to_ulp(before, before ^ xor_bits)


def _old_of_change(
    new: torch.Tensor,
    positions: torch.Tensor,
    xor_bits: np.ndarray,
    new_values: torch.Tensor | None,
) -> np.ndarray:
    """The old bits of a change (``xor_bits``: its XOR bits on the host), from its new bits
    where the diff kept them, else read from ``new`` at the positions (O(changed))."""
    if new_values is not None:
        after = bits_to_numpy(to_host(new_values))
    else:
        after = _bits_at(bits_view(new).reshape(-1), positions)
    out: np.ndarray = after ^ xor_bits
    return out


def _bits_at(flat: torch.Tensor, positions: torch.Tensor) -> np.ndarray:
    """The bits of ``flat`` (a flat bit view) at ``positions``, on the host (O(changed): the
    gather runs on the tensor's device)."""
    return bits_to_numpy(to_host(flat[positions.to(flat.device)]))


def _classed_wanted(
    new: torch.Tensor, baseline: torch.Tensor | None, allowed: frozenset[str], dtype: str
) -> bool:
    """Whether ``classed`` positions are ``allowed`` here and can apply to ``new`` (of the
    format dtype ``dtype``): a float tensor in host memory (its new bits and the XOR bits
    give the old ones), or on a device next to its old bits (``baseline``)."""
    return (
        CLASSED in allowed
        and dtype in EXPONENT_FIELDS
        and (new.is_cpu or (baseline is not None and baseline.device == new.device))
    )


def _encode_full(new: torch.Tensor, options: EncodeOptions) -> EncodedTensor:
    bits = bits_view(new).reshape(-1)
    advance = DecodedDelta(FULL, None, bits.clone())
    if new.numel() == 0:  # a full entry of no elements carries no streams
        return EncodedTensor(FULL, 0, None, None, None, None, advance)
    coding, data = encode_values(bits_to_numpy(bits), codings=_plain_codings(options))
    return EncodedTensor(FULL, new.numel(), None, None, coding, data, advance)


def _plain_codings(options: EncodeOptions) -> tuple[str, ...]:
    """The value codings ``options`` allow a stream coded alone (``planes``; ``rans``)."""
    return (PLANES, RANS) if RANS in options.codings else (PLANES,)


def decode_delta(
    op: str,
    info: DtypeInfo,
    numel: int,
    changed: int,
    *,
    positions: tuple[str, bytes | memoryview] | None,
    values: tuple[str, bytes | memoryview] | None,
    device: torch.device | str = "cpu",
    symbols: np.ndarray | None = None,
) -> Delta:
    """Decode an entry's streams (both already checked to exist) onto ``device``; hostile
    input is refused.

    The streams are parsed and checked on the host. For another device the value planes
    are copied over (pinned, asynchronously on CUDA) and the positions are expanded there
    (:func:`dcr_format.delta.positions.decode_positions_to`). ``symbols``, where given: the
    values' ``rans`` stream (:func:`rans_part`) decoded already, as :func:`decode_rans`
    decodes it (:func:`dcr_format.codings.rans.decode_rans_pair` decodes two entries' at
    once).
    """
    device = torch.device(device)
    if changed == 0:
        empty = torch.empty(0, dtype=info.bits_dtype, device=device)
        return DecodedDelta(op, torch.empty(0, dtype=torch.int64, device=device), empty)
    assert values is not None
    ulp = values[0] in (ULP, ULP_SHIFT)
    if ulp and (op != XOR or info.name not in FLOAT_DTYPES):
        raise ValuesError(f"{values[0]} values belong to xor entries of float tensors, not {op!r}")
    shift: tuple[int, bytes] | None = None
    if symbols is not None and (
        not ulp or symbols.shape != (changed,) or symbols.dtype != UNSIGNED_NP[info.width]
    ):
        raise ValueError("symbols must be the entry's rans values, decoded (see rans_part)")
    if values[0] == ULP_SHIFT:  # shifted differences: joined with the low bits by resolve()
        parsed = parse(values[1], count=changed, width=info.width, dtype=info.name)
        raw = symbols
        if raw is None:
            raw = decode_rans(parsed.coded, count=changed, width=info.width)
        shift = (parsed.origin, bytes(parsed.low))
    elif ulp:  # zigzag differences, rANS-coded: XOR bits once resolve() reads the old ones
        raw = symbols
        if raw is None:
            raw = decode_rans(values[1], count=changed, width=info.width)
    else:
        raw = decode_values(values[0], values[1], count=changed, width=info.width)
    vals = to_device(numpy_to_bits(raw, info), device)
    if op == FULL:
        return DecodedDelta(op, None, vals)
    assert positions is not None
    if positions[0] == CLASSED:
        if op != XOR:
            raise PositionsError(f"classed positions belong to xor entries, not {op!r}")
        # the ranks decode now, on the fetch worker; only their select needs the old bits
        stream = with_ranks(parse_classed(positions[1], count=changed, dtype=info.name), numel)
        return PendingDelta(op, None, vals, stream, ulp, shift)
    pos = decode_positions_to(positions[0], positions[1], count=changed, numel=numel, device=device)
    if ulp:
        return PendingDelta(op, pos, vals, None, ulp, shift)
    return DecodedDelta(op, pos, vals)


def rans_part(
    op: str, info: DtypeInfo, changed: int, values: tuple[str, bytes | memoryview] | None
) -> bytes | memoryview | None:
    """The ``rans`` stream :func:`decode_delta` decodes from an entry's values (those of
    ``ulp`` and ``ulp-shift`` entries), or None: other codings, and streams it refuses
    (left to it, for the error)."""
    if values is None or changed < 1 or op != XOR or info.name not in FLOAT_DTYPES:
        return None
    if values[0] == ULP:
        return values[1]
    if values[0] == ULP_SHIFT:
        try:
            return parse(values[1], count=changed, width=info.width, dtype=info.name).coded
        except ValuesError:
            return None
    return None


def resolve(
    delta: Delta,
    target: torch.Tensor,
    *,
    keep_before: bool = False,
    backend: Backend | None = None,
) -> DecodedDelta:
    """``delta`` completed against ``target`` where it was coded against the old bits: its
    positions found (``classed``) and its values turned into XOR bits (``ulp``,
    ``ulp-shift``; or left ulp differences where the backend steps them while writing).
    ``target`` must hold exactly the bits the entry was made against (its parent's), as any
    ``xor`` entry needs. A :class:`DecodedDelta` comes back as it is. A positions stream that
    does not decode against these bits is a :class:`PositionsError`; an ``ulp-shift``
    stream whose low bits do not fit them, a :class:`ValuesError`. A ``classed`` change
    resolved on the host carries the exponent rows it decoded against (``rows``: the
    delta's where they fit the bits, else counted). ``keep_before``: the caller applies the
    result to ``target`` next, with nothing written there in between, so the old bits the
    select pass read at the positions go with it (``before``) and :func:`apply_change` does
    not read them again. ``backend``: the target's (else chosen for it)."""
    if isinstance(delta, DecodedDelta):
        return delta
    if not target.is_contiguous():
        raise TargetError("target tensor is not contiguous; pass contiguous tensors")
    info = info_for(target.dtype)
    flat = bits_view(target).reshape(-1)
    if backend is None:
        backend = backend_for(flat)
    positions = delta.positions
    rows: np.ndarray | None = None  # the exponent rows the classed positions decoded against
    before: np.ndarray | None = None  # the old bits at the positions, where the select read them
    last: int | None = None  # the last position, where the host has it at hand
    if delta.classed is not None and flat.device.type == "cpu":
        held = bits_to_numpy(flat)
        if delta.ulp and delta.shift is not None:
            before = np.empty(sum(delta.classed.counts), dtype=held.dtype)
        found, rows = decode_classed_at(delta.classed, delta.rows, held, info.name, before)
        last = int(found[-1]) if found.size else -1
        positions = torch.from_numpy(found).to(delta.values.device)
    elif delta.classed is not None:  # the class passes on the tensor's device
        positions = device_positions(delta.classed, flat, info.name, backend)
        positions = positions.to(delta.values.device)
    assert positions is not None
    values = delta.values
    if delta.ulp:
        if last is None:  # (reading one element of a tensor costs more than of an array)
            last = int(positions[-1]) if positions.numel() else -1
        if last >= flat.numel():
            raise PositionsError("a position of the change is past the end of the tensor")
        if delta.shift is None:  # stepped while applying, or turned into XOR bits here
            stepped = DecodedDelta(delta.op, positions, values, ulp=True, rows=rows)
            if backend.fuses_ulp(flat, positions):
                return stepped
            return _as_xor(stepped, flat, backend)
        if before is None:  # the shifts come from the old bits' exponents
            before = _bits_at(flat, positions)
        origin, low = delta.shift
        z = join(before, bits_to_numpy(to_host(values)), origin, low, info.name)
        if backend.fuses_ulp(flat, positions):  # joined: plain ulp differences, stepped
            kept = numpy_to_bits(before, info) if keep_before else None
            return DecodedDelta(
                delta.op, positions, numpy_to_bits(z, info), ulp=True, before=kept, rows=rows
            )
        xor = before ^ from_ulp(before, z)
        values = to_device(numpy_to_bits(xor, info), values.device)
    return DecodedDelta(delta.op, positions, values, rows=rows)


@dataclass(frozen=True)
class AppliedBits:
    """What :func:`apply_change` did to one tensor."""

    saved: torch.Tensor | None  # what :func:`undo_delta` needs (old bits for overwrite/full)
    before: torch.Tensor | None  # xor/overwrite: the bits at the positions before the change
    lane_deltas: tuple[int, ...] | None  # xor/overwrite: the change's fingerprint lane deltas
    after: torch.Tensor | None = None  # ulp: the bits the change wrote (else see after_bits)


def _ready_ulp(delta: DecodedDelta) -> torch.Tensor:
    """The positions of a resolved ``ulp`` change."""
    if delta.positions is None:
        raise ValueError("an ulp change has positions")
    return delta.positions


def _as_xor(delta: DecodedDelta, flat: torch.Tensor, backend: Backend) -> DecodedDelta:
    """A resolved ``ulp`` change as XOR bits against ``flat`` (where the kernels do not fuse
    the step with the write), computed on ``flat``'s device."""
    positions = _ready_ulp(delta)
    before = flat[positions.to(flat.device)]
    xor = before ^ _stepped(before, delta.values, backend)
    return DecodedDelta(delta.op, positions, to_device(xor, delta.values.device), rows=delta.rows)


def as_xor(delta: Delta, target: torch.Tensor) -> Delta:
    """A resolved change with ``ulp`` values as the XOR bits it makes against ``target``'s
    bits (read, never written), for a writer that applies plain XOR (a loader's); any other
    change as it is."""
    ready_delta = ready(delta)
    if not ready_delta.ulp:
        return delta
    flat = bits_view(target).reshape(-1)
    return _as_xor(ready_delta, flat, backend_for(flat))


def _stepped(before: torch.Tensor, z: torch.Tensor, backend: Backend) -> torch.Tensor:
    """The bits ``z`` zigzag ulp differences away from ``before`` (a bit view), on
    ``before``'s device: the backend's step where it runs the ``ulp`` passes there or the
    bits are on a device (nothing leaves it), else the host coding's loop."""
    z = z.to(before.device)
    if backend.ulp_on_device(before) or before.device.type != "cpu":
        return backend.ulp_step(before, z)
    return numpy_to_bits(from_ulp(bits_to_numpy(before), bits_to_numpy(z)), info_for(before.dtype))


def after_bits(
    delta: Delta, before: torch.Tensor, *, backend: Backend | None = None
) -> torch.Tensor:
    """The bits a resolved ``xor``/``overwrite``/``ulp`` change puts at its positions, given
    the bits ``before`` there (``backend``: theirs, else chosen for them)."""
    delta = ready(delta)
    values = delta.values.to(before.device)
    if delta.ulp:
        return _stepped(before, values, backend or backend_for(before))
    return before ^ values if delta.op == XOR else values


def apply_change(
    target: torch.Tensor,
    delta: Delta,
    *,
    lanes: bool = True,
    keep_old: bool = True,
    backend: Backend | None = None,
) -> AppliedBits:
    """Apply in place, reading the old bits and (``lanes``) summing the fingerprint lane
    deltas of the change in the same pass (FORMAT.md §9.1), so a reader needs no second
    look. ``keep_old=False``: a ``full`` write keeps no copy of the bits it replaces (the
    tensor was new: nothing to undo). ``backend``: the target's (else chosen for it). A
    :class:`PendingDelta` is refused: :func:`resolve` it first."""
    delta = ready(delta)
    if not target.is_contiguous():
        raise TargetError("target tensor is not contiguous; pass contiguous tensors")
    flat = bits_view(target).reshape(-1)
    if backend is None:
        backend = backend_for(flat)
    if delta.ulp:  # old bits read, stepped and written in one pass where the kernels can
        positions = _ready_ulp(delta).to(flat.device)
        if not backend.fuses_ulp(flat, positions):
            xor = _as_xor(delta, flat, backend)
            done = apply_change(target, xor, lanes=lanes, backend=backend)
            assert done.before is not None
            after = done.before ^ xor.values.to(done.before.device)
            return AppliedBits(done.before, done.before, done.lane_deltas, after)
        z = to_device(delta.values, flat.device)
        before, after, lane_deltas = backend.apply_ulp_with_lanes(
            flat, positions, z, lanes=lanes, before=delta.before
        )
        return AppliedBits(before, before, lane_deltas if lanes else None, after)
    values = to_device(delta.values, flat.device)
    if delta.op == FULL:
        if values.numel() != flat.numel():
            raise TargetError(f"full value count {values.numel()} != tensor size {flat.numel()}")
        old = flat.clone() if keep_old else None
        flat.copy_(values)
        return AppliedBits(old, None, None)
    assert delta.positions is not None
    positions = to_device(delta.positions, flat.device)
    before, lane_deltas = backend.apply_with_lanes(
        flat, positions, values, op=delta.op, lanes=lanes
    )
    return AppliedBits(
        before if delta.op == OVERWRITE else None, before, lane_deltas if lanes else None
    )


def stage_change(
    target: torch.Tensor, delta: Delta, *, backend: Backend | None = None
) -> StagedChange:
    """Read, never write, what :func:`apply_change` would do to ``target`` (one pass over
    the positions), so the tensor can stay in use meanwhile; the write that makes the
    change (:func:`put_staged`) is then a plain scatter of ``after``."""
    delta = ready(delta)
    if delta.op == FULL:
        raise ValueError("a full change has nothing to stage: apply it")
    if not target.is_contiguous():
        raise TargetError("target tensor is not contiguous; pass contiguous tensors")
    flat = bits_view(target).reshape(-1)
    if backend is None:
        backend = backend_for(flat)
    if delta.ulp and not backend.fuses_ulp(flat, _ready_ulp(delta)):
        delta = _as_xor(delta, flat, backend)
    assert delta.positions is not None
    positions = to_device(delta.positions, flat.device)
    values = to_device(delta.values, flat.device)
    op = ULP if delta.ulp else delta.op
    before, after, lane_deltas = backend.stage_change(flat, positions, values, op=op)
    return StagedChange(positions, before, after, lane_deltas)


def apply_delta(target: torch.Tensor, delta: Delta) -> torch.Tensor | None:
    """Apply in place; returns what :func:`undo_delta` needs (old bits for overwrite/full)."""
    return apply_change(target, delta, lanes=False).saved


def undo_delta(target: torch.Tensor, delta: DecodedDelta, saved: torch.Tensor | None) -> None:
    """Revert :func:`apply_delta` (xor is its own inverse; the others restore saved bits)."""
    flat = bits_view(target).reshape(-1)
    if delta.op == FULL:
        assert saved is not None
        flat.copy_(saved)
        return
    assert delta.positions is not None
    positions = to_device(delta.positions, flat.device)
    backend = backend_for(flat)
    if delta.op == XOR and not delta.ulp:  # (a ulp change saved the bits it replaced)
        backend.scatter(flat, positions, to_device(delta.values, flat.device), op=XOR)
    else:
        assert saved is not None
        backend.scatter(flat, positions, saved.to(flat.device), op=OVERWRITE)


__all__ = [
    "FULL",
    "OPS",
    "OVERWRITE",
    "XOR",
    "AppliedBits",
    "DecodedDelta",
    "Delta",
    "EncodedTensor",
    "PendingDelta",
    "after_bits",
    "apply_change",
    "apply_delta",
    "as_xor",
    "changed_positions",
    "comparable",
    "decode_delta",
    "encode_diff",
    "encode_tensor",
    "rans_part",
    "ready",
    "resolve",
    "stage_change",
    "undo_delta",
]
