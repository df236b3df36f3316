"""The sharded part: publishing a ``torch.distributed`` state dict of ``DTensor`` objects as
each rank holds it, without gathering a tensor.

Given tensors that are ``DTensor`` objects (FSDP2, tensor parallelism, both on a 2-D
mesh, HSDP), a :class:`~dcr_format.DeltaWriter` without a layout derives one from the
tensors themselves: each ``DTensor``'s local shard is placed in its canonical tensor by
its device mesh and placements (:func:`~dcr_format.chain.placement.placed`), and every plain
tensor is a whole tensor among ``world_size`` replicas, owned by the canonical part's
rule (``crc32(name) mod world_size``). The projection part (``publish/_projection.py``)
then diffs each local shard against the rank's own baseline of it and publishes the
changes in canonical coordinates; a local shard that is one run of its canonical tensor's
flat elements (``Shard(0)`` of a row-major tensor, a replica, a whole tensor) is diffed
instead in one fused pass (:func:`~dcr_format.delta.dispatch.diff_with_lanes`, positions
offset to canonical ones, lane deltas at canonical positions). Only the commit protocol's
small messages cross ranks.
"""

from __future__ import annotations

import itertools
import math
import sys
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from dcr_format.chain.chain import Chain, LoadedRecord, TensorState
from dcr_format.chain.layout import Layout, Piece, whole
from dcr_format.chain.placement import placed as placed_pieces
from dcr_format.delta.delta import FULL, OVERWRITE, XOR, PendingDelta, changed_positions
from dcr_format.delta.dispatch import diff_with_lanes
from dcr_format.delta.fingerprint import apply_lane_deltas, fingerprint_from_lanes, lanes_at
from dcr_format.errors import ArgumentError
from dcr_format.format.dtypes import bits_view, info_for
from dcr_format.format.schema import PIECES_FEATURE, Entry, Manifest, check_tensor_name
from dcr_format.publish._part import Attempt, ShardWriter, Tensors, Written, pairs
from dcr_format.publish._projection import (
    ProjectionPart,
    _Diff,
    _entry,
    _LocalChange,
    _Region,
    _region_streams,
    decode_region_entry,
    since_base,
)


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed`` ``DTensor`` (without importing the
    distributed package where it was never loaded)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(tensor, dtensor)


def peek_sharded(tensors: Tensors) -> tuple[bool, Tensors]:
    """Whether ``tensors`` holds ``DTensor`` objects (a mapping: any of them; a stream: its
    first), and the tensors to publish (a stream with its first pair put back)."""
    if isinstance(tensors, Mapping):
        return any(is_dtensor(t) for t in tensors.values()), tensors
    stream: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    first = next(stream, None)
    if first is None:
        return False, ()
    return is_dtensor(first[1]), itertools.chain((first,), stream)


@dataclass
class _RegionBits:
    """A region replayed from the store: its canonical positions (sorted) and their bits."""

    dtype: torch.dtype
    positions: torch.Tensor
    bits: torch.Tensor


class ShardedPart:
    """A writer rank's part of a state dict, or a stream, of ``DTensor`` objects (and plain
    tensors): its local shards, placed by their placements, each diffed, coded and let go
    as it arrives.

    A ``publish`` holds one given tensor at a time (and what the coding of the shard in
    flight holds); the baseline is the owned shards' bits. A reopened rank replays the
    regions its own manifests listed, from its own shards (:func:`_replay_own`), and
    places them once their tensors arrive; a region whose placement changed is
    published whole.
    """

    def __init__(
        self, *, rank: int, world_size: int, device: torch.device, ops: Mapping[str, str]
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.device, self.ops = device, ops
        # the projection part's entry coding, over this part's own baselines (its layout
        # is empty: the regions come with the tensors)
        self._coder = ProjectionPart(Layout([]), device=device, ops=ops)
        self._placed: dict[str, tuple[Piece, ...]] = {}  # owned pieces of each local tensor
        self._replayed: dict[_Region, _RegionBits] = {}  # restored, not yet placed

    @property
    def baseline(self) -> Mapping[str, torch.Tensor]:
        """The bits of the local shards this rank publishes, at the last commit."""
        return self._coder._local

    def owns(self, name: str) -> bool:
        """Whether this rank published some region of canonical tensor ``name`` last."""
        return name in self._placed or any(key[0] == name for key in self._replayed)

    def check_manifest(self, manifest: Manifest, rank: int, key: str) -> None:
        """Regions follow the placements; the committer checks them when it combines pieces."""

    def restore(self, chain: Chain, latest: LoadedRecord, table: dict[str, TensorState]) -> None:
        """Replay this rank's own regions of ``latest``; each is placed in its local tensor
        when that tensor arrives."""
        self._replayed = _replay_own(chain, latest, self.rank)
        self._coder._local, self._placed = {}, {}

    def write(self, tensors: Tensors, attempt: Attempt) -> Written:
        """Place, diff and code each given tensor as it arrives; upload the shards."""
        coder = self._coder
        shards = attempt.shards()
        entries: list[Entry] = []
        lanes: dict[_Region, tuple[int, ...]] = {}
        dtypes: dict[_Region, torch.dtype] = {}
        changes: dict[str, _LocalChange] = {}
        placed: dict[str, tuple[Piece, ...]] = {}
        seen: set[str] = set()
        try:
            for name, tensor in pairs(tensors):
                check_tensor_name(name)
                if name in seen:
                    raise ArgumentError(f"tensor {name!r} was given twice in one publish")
                seen.add(name)
                coded = self._code(name, tensor, attempt, len(entries), shards)
                del tensor  # held no longer than its coding
                if coded is None:
                    continue  # another replica publishes it
                key, entry, owned, change = coded
                entries.append(entry)
                lanes[key], dtypes[key] = change[1], change[2]
                changes.update(change[0])
                placed[name] = owned
                shards.maybe_flush()
            attempt.check_none_dropped(sorted({n for n in self._placed if n not in placed}))
            shards.finish()
        finally:
            shards.close()
        pieces_used = any(e.piece is not None for e in entries)
        manifest = attempt.manifest(shards, entries, (PIECES_FEATURE,) if pieces_used else ())

        def advance() -> None:
            coder._local = {n: t for n, t in coder._local.items() if n in changes}
            coder._advance(changes, lanes, dtypes)
            self._placed = placed
            self._replayed = {}

        return Written(manifest, advance)

    def _code(
        self, name: str, tensor: torch.Tensor, attempt: Attempt, index: int, shards: ShardWriter
    ) -> (
        tuple[
            _Region,
            Entry,
            tuple[Piece, ...],
            tuple[dict[str, _LocalChange], tuple[int, ...], torch.dtype],
        ]
        | None
    ):
        """Place, diff and code one given tensor (None: another replica publishes it):
        its region, entry, owned pieces, and how its baseline, lanes and dtype advance."""
        if is_dtensor(tensor):
            ranks = tensor.device_mesh._get_root_mesh().size()  # type: ignore[attr-defined]
            if ranks > self.world_size:
                raise ArgumentError(
                    f"{name!r} is sharded over {ranks} ranks but the writer has world_size "
                    f"{self.world_size}; open a DeltaWriter on every rank "
                    f"(world_size={ranks}), each publishing its own shards"
                )
            pieces = placed_pieces(name, tensor)
            local = tensor.to_local()  # type: ignore[attr-defined]
        else:
            pieces = whole(name, tuple(tensor.shape), replica=self.rank, replicas=self.world_size)
            local = tensor
        owned = tuple(p for p in pieces if _owns(p))
        if not owned:
            return None
        key = (name, owned[0].part)
        local = local.detach()
        info_for(local.dtype)  # refuses dtypes the format cannot carry
        self._place_replayed(key, owned, local.dtype)
        run = self._run_entry(key, owned, local, attempt, index, shards)
        if run is not None:
            entry, lanes, change = run
            return key, entry, owned, ({name: change}, lanes, local.dtype)
        diff = self._diff(name, local, owned, attempt.base)
        entry, lanes, dtype = self._coder._region_entry(
            key, list(owned), diff, attempt, index, shards
        )
        return key, entry, owned, (self._coder._local_changes(diff), lanes, dtype)

    def _place_replayed(self, key: _Region, owned: tuple[Piece, ...], dtype: torch.dtype) -> None:
        """Put a replayed region into its local tensor, where its pieces place exactly it."""
        region = self._replayed.pop(key, None)
        if region is None or region.dtype != dtype:
            return
        name = owned[0].local
        tensor = torch.zeros(owned[0].local_shape, dtype=dtype)
        flat = bits_view(tensor).reshape(-1)
        placed = 0
        for piece in owned:
            inside, k = piece.canonical_view.locate(region.positions)
            flat[piece.local_view.elements(k[inside])] = region.bits[inside]
            placed += int(inside.sum())
        if placed != region.positions.numel() or placed != sum(p.local_view.numel for p in owned):
            return  # placed otherwise now: published whole
        self._coder._local[name] = tensor.to(self.device)
        self._coder._region_lanes[key] = lanes_at(region.positions, region.bits)
        self._coder._region_dtypes[key] = dtype
        self._placed[name] = owned

    def _run_entry(
        self,
        key: _Region,
        owned: tuple[Piece, ...],
        local: torch.Tensor,
        attempt: Attempt,
        index: int,
        shards: ShardWriter,
    ) -> tuple[Entry, tuple[int, ...], _LocalChange] | None:
        """The delta entry of a local tensor that is, whole and in order, one run of its
        canonical tensor's flat elements (``Shard(0)`` of a row-major tensor, a replica, a
        whole tensor), from one fused pass over it and its baseline: the changed positions
        offset to canonical ones, their bits and the lane deltas at canonical positions.
        None where the region is placed otherwise or has no comparable baseline (the
        general path then codes it)."""
        coder = self._coder
        piece = owned[0]
        name, dtype = piece.local, local.dtype
        if (
            attempt.base
            or len(owned) != 1
            or not piece.local_view.contiguous
            or not piece.canonical_view.contiguous
            or piece.local_view.offset != 0
            or piece.local_view.numel != local.numel()
        ):
            return None
        before = coder._region_lanes.get(key)
        old = coder._local.get(name)
        configured = self.ops.get(piece.canonical)
        if (
            before is None
            or coder._region_dtypes.get(key) != dtype
            or configured == FULL
            or old is None
            or old.dtype != dtype
            or old.shape != local.shape
            or self._placed.get(name) != owned
        ):
            return None
        op = configured or (OVERWRITE if piece.canonical in attempt.overwrite else XOR)
        start = piece.canonical_view.offset
        new = bits_view(local.to(self.device).contiguous()).reshape(-1)
        found, deltas = diff_with_lanes(
            bits_view(old).reshape(-1), new, want_xor=op != OVERWRITE, base=start
        )
        positions, new_bits = found.positions, found.new_values
        assert new_bits is not None
        values = new_bits if op == OVERWRITE else found.xor_values
        assert values is not None
        after = apply_lane_deltas(before, deltas) if positions.numel() else before
        entry = _entry(piece, dtype, op, positions, values, before, after, index, shards)
        local_positions = positions - start if start else positions
        return entry, after, _LocalChange(local_positions.to(old.device), new_bits)

    def _diff(self, name: str, local: torch.Tensor, owned: tuple[Piece, ...], base: bool) -> _Diff:
        """One local tensor against its baseline (None: not comparable, sent whole)."""
        tensor = local.to(self.device).contiguous()
        flat = bits_view(tensor).reshape(-1)
        old = self._coder._local.get(name)
        changed = None
        if (
            not base
            and old is not None
            and old.dtype == tensor.dtype
            and old.shape == tensor.shape
            and self._placed.get(name) == owned
        ):
            changed = changed_positions(old, tensor)
        return _Diff({name: tensor}, {name: flat}, {name: changed})


def _owns(piece: Piece) -> bool:
    """Whether this rank publishes ``piece``: the replica ``crc32(name) mod replicas``."""
    return zlib.crc32(piece.canonical.encode()) % piece.replicas == piece.replica


def _replay_own(chain: Chain, latest: LoadedRecord, rank: int) -> dict[_Region, _RegionBits]:
    """The regions rank ``rank`` published in ``latest``, replayed from the last version
    that sent each whole, through the rank's own entries and shards only; a region whose
    history does not replay so (another rank sent part of it since it was last sent
    whole, its bits do not end at the fingerprint its last entry gives, or ``gc`` removed
    the versions before an alternative base) is left out (then published whole)."""
    records = since_base(chain, latest)
    if records is None:
        return {}  # the history before an alternative base was removed: each region sent whole
    manifests = {  # this rank's manifest of each version only
        loaded.record.version: [
            chain.manifest(loaded, ref) for ref in loaded.record.manifests if ref.rank == rank
        ]
        for loaded in records
    }
    last = {_key(e): e for m in manifests[latest.record.version] for e in m.entries}
    regions: dict[_Region, _RegionBits] = {}
    broken: set[_Region] = set()
    for loaded in reversed(records):
        found = [
            (m, e) for m in manifests[loaded.record.version] for e in m.entries if _key(e) in last
        ]
        streams = _region_streams(chain, found)
        for manifest, entry in found:
            key = _key(entry)
            if entry.op == FULL:
                broken.discard(key)  # the region starts again from its bits here
            elif key in broken:
                continue
            try:
                _replay_entry(regions, key, entry, streams.get(manifest.rank, {}))
            except _NotReplayable:
                broken.add(key)
                regions.pop(key, None)
    for key in list(regions):
        entry = last[key]
        region = regions[key]
        lanes = lanes_at(region.positions, region.bits)
        if entry.piece is not None:
            ok = tuple(entry.piece.lanes_after or ()) == lanes
        else:
            ok = (
                fingerprint_from_lanes(region.dtype, tuple(entry.shape), lanes) == entry.fingerprint
            )
        if not ok:
            del regions[key]
    return regions


def _key(entry: Entry) -> _Region:
    return entry.name, entry.piece.index if entry.piece is not None else 0


class _NotReplayable(Exception):
    """A region's entry that the rank's own history cannot apply."""


def _replay_entry(
    regions: dict[_Region, _RegionBits],
    key: _Region,
    entry: Entry,
    streams: dict[int, dict[str, memoryview]],
) -> None:
    """Apply one of the rank's entries to its replayed region."""
    delta = decode_region_entry(entry, streams)
    if isinstance(delta, PendingDelta):
        raise _NotReplayable
    info = info_for(entry.dtype)
    if entry.op == FULL:
        positions = delta.positions
        if positions is None:
            positions = torch.arange(math.prod(entry.shape), dtype=torch.int64)
        regions[key] = _RegionBits(info.torch_dtype, positions, delta.values.clone())
        return
    region = regions.get(key)
    if region is None or region.dtype != info.torch_dtype or delta.positions is None:
        raise _NotReplayable
    if delta.positions.numel() == 0:
        return
    at = torch.searchsorted(region.positions, delta.positions)
    if bool((at >= region.positions.numel()).any()) or not torch.equal(
        region.positions[at], delta.positions
    ):
        raise _NotReplayable
    if entry.op == XOR:
        region.bits[at] ^= delta.values
    else:
        region.bits[at] = delta.values
