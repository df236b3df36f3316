"""The projection part: publishing from a trainer's own layout, local diffs projected to
canonical positions (``DeltaWriter(..., layout=...)``).

``publish`` takes the rank's *local* tensors (tensor-parallel shards, fused ``qkv``,
...) described by a :class:`~dcr_format.chain.layout.Layout`. Each step the part diffs every
local tensor against its own baseline (the local tensors of the last committed
version), carries the changed local positions of every region it owns to canonical
flat indices arithmetically, and publishes them. No canonical tensor is built on the
trainer, except transiently when a writer reopens an existing chain (the baseline is
then cut from the canonical tensors).

A canonical tensor held by one rank (whole, a stacked expert, a conversion's output)
is published as an ordinary entry; one split over ``parts`` ranks as ``parts`` piece
entries (FORMAT.md §4.8), each with the fingerprint lanes of its region, which the
readers and the committer add up. Deltas use ``xor`` (``overwrite`` where configured in
``ops`` or requested by a reader record); unlike the canonical part, a delta never
switches a tensor to ``full`` by size. Bases and new tensors are ``full``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from dcr_format.chain.chain import Chain, LoadedRecord, TensorState, get_verified
from dcr_format.chain.layout import Layout, Piece
from dcr_format.codings.positions import encode_positions
from dcr_format.codings.values import encode_values
from dcr_format.delta.delta import (
    FULL,
    OVERWRITE,
    XOR,
    Delta,
    PendingDelta,
    changed_positions,
    decode_delta,
)
from dcr_format.delta.fingerprint import fingerprint_from_lanes, lanes_after_change, lanes_at
from dcr_format.errors import ArgumentError, ShardError, VersionNotFoundError
from dcr_format.format.dtypes import bits_to_numpy, bits_view, info_for
from dcr_format.format.schema import PIECES_FEATURE, Entry, Manifest, PositionsRef, ValuesRef
from dcr_format.format.schema import Piece as PieceInfo
from dcr_format.format.shard import decode_shard
from dcr_format.publish._part import Attempt, ShardWriter, Tensors, Written, pairs
from dcr_format.targets.dict import StateDictTarget

_Region = tuple[str, int]  # canonical name, part


@dataclass(frozen=True)
class _LocalChange:
    """How one local baseline advances once the commit exists."""

    positions: torch.Tensor | None  # changed flat positions; None: ``values`` is the tensor
    values: torch.Tensor


@dataclass(frozen=True)
class _Diff:
    """This publish's local tensors against the local baselines."""

    local: dict[str, torch.Tensor]  # as given (after conversions)
    flats: dict[str, torch.Tensor]  # their bits, flat, on the baseline device
    changed: dict[str, torch.Tensor | None]  # changed flat positions; None: not comparable


class ProjectionPart:
    """A writer rank's part given by ``layout``: local tensors in, canonical entries out."""

    def __init__(
        self, layout: Layout, *, rank: int = 0, device: torch.device, ops: Mapping[str, str]
    ) -> None:
        self.layout = layout
        self.rank = rank  # the writer rank: whose manifests a restart rebuilds from
        self.device = device
        self.ops = ops
        self._regions = layout.regions()
        # the local tensors that place an owned region: the only ones diffed and kept
        self._owned_locals = {p.local for pieces in self._regions.values() for p in pieces}
        self._local: dict[str, torch.Tensor] = {}
        self._region_lanes: dict[_Region, tuple[int, ...]] = {}
        self._region_dtypes: dict[_Region, torch.dtype] = {}

    @property
    def baseline(self) -> Mapping[str, torch.Tensor]:
        """The local tensors' exact bits at the last commit."""
        return self._local

    def owns(self, name: str) -> bool:
        """Whether this rank publishes some region of canonical tensor ``name``."""
        return any(canonical == name for canonical, _ in self._regions)

    def check_manifest(self, manifest: Manifest, rank: int, key: str) -> None:
        """Layout writers place whole tensors where their layouts say (FORMAT.md §4.6 is
        for writers without a layout); a tensor listed twice is still refused when the
        committer combines the manifests."""

    def restore(self, chain: Chain, latest: LoadedRecord, table: dict[str, TensorState]) -> None:
        """The local baselines of version ``latest``: replayed from this rank's own regions
        where every version since the last base lists them as this layout places them
        (:meth:`_replay_regions`), else cut from the canonical tensors."""
        if not self._replay_regions(chain, latest):
            self._restore_canonical(chain, latest)

    def _replay_regions(self, chain: Chain, latest: LoadedRecord) -> bool:
        """Rebuild the owned regions from their own entries alone (from the last base to
        ``latest``), reading only this rank's manifests and the shards that hold them: no
        other region, and no canonical tensor, is read or built. False (nothing kept) where
        some version does not list every owned region in this rank's manifest as this
        layout's part, a region does not end at the fingerprint its last entry gives, or the
        versions since the base were removed."""
        records = since_base(chain, latest)
        if records is None:
            return False
        local: dict[str, torch.Tensor] = {}
        last: dict[_Region, Entry] = {}
        for loaded in reversed(records):
            refs = [r for r in loaded.record.manifests if r.rank == self.rank]
            found = self._region_entries([chain.manifest(loaded, r) for r in refs])
            if found is None:
                return False
            streams = _region_streams(chain, found.values())
            for key, (manifest, entry) in found.items():
                if not self._replay_entry(key, entry, streams[manifest.rank], local):
                    return False
                last[key] = entry
        lanes: dict[_Region, tuple[int, ...]] = {}
        dtypes: dict[_Region, torch.dtype] = {}
        for key, pieces in self._regions.items():
            entry = last[key]
            positions, bits = [], []
            for piece in pieces:
                local_idx, canonical_idx = piece.region()
                positions.append(canonical_idx)
                bits.append(bits_view(local[piece.local]).reshape(-1)[local_idx])
            lanes[key] = lanes_at(torch.cat(positions), torch.cat(bits))
            dtype = info_for(entry.dtype).torch_dtype
            expected = entry.piece.lanes_after if entry.piece is not None else None
            if expected is not None and tuple(expected) != lanes[key]:
                return False
            if (
                expected is None
                and fingerprint_from_lanes(dtype, tuple(entry.shape), lanes[key])
                != entry.fingerprint
            ):
                return False
            dtypes[key] = dtype
        self._local = {n: t.to(self.device) for n, t in local.items()}
        self._region_lanes, self._region_dtypes = lanes, dtypes
        return True

    def _region_entries(
        self, manifests: list[Manifest]
    ) -> dict[_Region, tuple[Manifest, Entry]] | None:
        """The entry of each owned region in one version, or None where one is missing or
        the version splits the tensor otherwise."""
        found: dict[_Region, tuple[Manifest, Entry]] = {}
        for manifest in manifests:
            for entry in manifest.entries:
                key = (entry.name, entry.piece.index if entry.piece is not None else 0)
                pieces = self._regions.get(key)
                if pieces is None:
                    continue
                count = entry.piece.count if entry.piece is not None else 1
                if count != pieces[0].parts or tuple(entry.shape) != pieces[0].shape:
                    return None
                found[key] = (manifest, entry)
        return found if len(found) == len(self._regions) else None

    def _replay_entry(
        self,
        key: _Region,
        entry: Entry,
        streams: dict[int, dict[str, memoryview]],
        local: dict[str, torch.Tensor],
    ) -> bool:
        """Apply one region entry (``streams``: its rank's inflated shards by index) to the
        local tensors placing it; False where it cannot be replayed so."""
        info = info_for(entry.dtype)
        numel = math.prod(entry.shape)
        op = OVERWRITE if entry.op == FULL and entry.piece is not None else entry.op
        delta = decode_region_entry(entry, streams)
        if isinstance(delta, PendingDelta):
            return False  # coded against old bits: only a reader of whole tensors resolves it
        positions = delta.positions
        if positions is None:
            positions = torch.arange(numel, dtype=torch.int64)
        placed = 0
        for piece in self._regions[key]:
            tensor = local.get(piece.local)
            if tensor is None or tensor.dtype != info.torch_dtype:
                if entry.op != FULL:
                    return False
                tensor = local[piece.local] = torch.zeros(piece.local_shape, dtype=info.torch_dtype)
            inside, k = piece.canonical_view.locate(positions)
            local_idx = piece.local_view.elements(k[inside])
            flat = bits_view(tensor).reshape(-1)
            values = delta.values[inside]
            if op == XOR:
                flat[local_idx] ^= values
            else:
                flat[local_idx] = values
            placed += int(inside.sum())
        return placed == positions.numel()

    def _restore_canonical(self, chain: Chain, latest: LoadedRecord) -> None:
        """Cut the local baselines from the canonical tensors of version ``latest``."""
        from dcr_format.sync.reader import DeltaReader  # a restart's replay only

        names = {canonical for canonical, _ in self._regions}
        target = StateDictTarget({}, device=self.device)
        DeltaReader(chain.store, target, select=names.__contains__).sync(to=latest.record.version)
        self._local = self.layout.scatter(target.tensors)
        for key, pieces in self._regions.items():
            canonical = target.tensors.get(key[0])
            if canonical is None or tuple(canonical.shape) != pieces[0].shape:
                continue  # published as a new tensor next time
            positions = torch.cat([p.canonical_view.elements() for p in pieces])
            bits = bits_view(canonical).reshape(-1)[positions.to(canonical.device)]
            self._region_lanes[key] = lanes_at(positions, bits)
            self._region_dtypes[key] = canonical.dtype

    # --- publish -----------------------------------------------------------------------

    def write(self, tensors: Tensors, attempt: Attempt) -> Written:
        """Diff the local tensors, project the owned regions' changes, upload the shards."""
        diff = self._diff(tensors, attempt.base)
        shards = attempt.shards()
        entries: list[Entry] = []
        lanes: dict[_Region, tuple[int, ...]] = {}
        dtypes: dict[_Region, torch.dtype] = {}
        try:
            for key, pieces in self._regions.items():
                entry, lanes[key], dtypes[key] = self._region_entry(
                    key, pieces, diff, attempt, len(entries), shards
                )
                entries.append(entry)
                shards.maybe_flush()
            shards.finish()  # every shard is up (full ones went up while coding)
        finally:
            shards.close()
        pieces_used = any(e.piece is not None for e in entries)
        manifest = attempt.manifest(shards, entries, (PIECES_FEATURE,) if pieces_used else ())
        changes = self._local_changes(diff)

        def advance() -> None:
            self._advance(changes, lanes, dtypes)

        return Written(manifest, advance)

    def _diff(self, tensors: Tensors, base: bool) -> _Diff:
        given: dict[str, torch.Tensor] = {}
        for name, tensor in pairs(tensors):
            if name in given:
                raise ArgumentError(f"tensor {name!r} was given twice in one publish")
            given[name] = tensor
        local = self.layout.local_tensors(given)
        flats: dict[str, torch.Tensor] = {}
        changed: dict[str, torch.Tensor | None] = {}
        for name, tensor in local.items():
            info_for(tensor.dtype)  # refuses dtypes the format cannot carry
            if name not in self._owned_locals:
                continue  # another replica publishes what it places
            tensor = tensor.to(self.device).contiguous()
            flats[name] = bits_view(tensor).reshape(-1)
            old = self._local.get(name)
            if old is not None and old.dtype == tensor.dtype and old.shape == tensor.shape:
                changed[name] = None if base else changed_positions(old, tensor)
            else:
                changed[name] = None
        return _Diff(local, flats, changed)

    def _region_entry(
        self,
        key: _Region,
        pieces: list[Piece],
        diff: _Diff,
        attempt: Attempt,
        index: int,
        shards: ShardWriter,
    ) -> tuple[Entry, tuple[int, ...], torch.dtype]:
        """The entry of one owned region, its lanes after the change and its dtype."""
        canonical = key[0]
        dtype = diff.local[pieces[0].local].dtype
        if any(diff.local[p.local].dtype != dtype for p in pieces):
            raise ArgumentError(f"the local tensors placing {canonical!r} differ in dtype")
        before = None if attempt.base else self._region_lanes.get(key)
        configured = self.ops.get(canonical)
        if (
            before is None
            or self._region_dtypes.get(key) != dtype
            or configured == FULL
            or any(diff.changed[p.local] is None for p in pieces)
        ):
            entry, after = self._full_entry(pieces, diff.flats, dtype, index, shards)
        else:
            op = configured or (OVERWRITE if canonical in attempt.overwrite else XOR)
            entry, after = self._delta_entry(pieces, diff, dtype, op, before, index, shards)
        return entry, after, dtype

    def _full_entry(
        self,
        pieces: list[Piece],
        flats: dict[str, torch.Tensor],
        dtype: torch.dtype,
        index: int,
        shards: ShardWriter,
    ) -> tuple[Entry, tuple[int, ...]]:
        """Every element of the region: a ``full`` entry (a full piece lists its positions)."""
        canonical_parts, values_parts = [], []
        for piece in pieces:
            local_idx, canonical_idx = piece.region()
            flat = flats[piece.local]
            canonical_parts.append(canonical_idx)
            values_parts.append(flat[local_idx.to(flat.device)])
        positions = torch.cat(canonical_parts)
        values = torch.cat(values_parts)
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            order = torch.argsort(positions)  # (an order-preserving placement needs none)
            positions, values = positions[order], values[order]
        first = pieces[0]
        if positions.numel() > 1 and bool((positions[1:] == positions[:-1]).any()):
            raise ArgumentError(f"the layout places elements of {first.canonical!r} twice")
        after = lanes_at(positions, values)
        if first.parts > 1:
            entry = _entry(first, dtype, FULL, positions, values, None, after, index, shards)
            return entry, after
        numel = 1
        for dim in first.shape:
            numel *= dim
        if positions.numel() != numel:  # sorted and distinct: covering means all of them
            raise ArgumentError(
                f"the layout covers {positions.numel()} of the {numel} elements of "
                f"{first.canonical!r}; a tensor held by one rank must be covered exactly"
            )
        return _entry(first, dtype, FULL, None, values, None, after, index, shards), after

    def _delta_entry(
        self,
        pieces: list[Piece],
        diff: _Diff,
        dtype: torch.dtype,
        op: str,
        before: tuple[int, ...],
        index: int,
        shards: ShardWriter,
    ) -> tuple[Entry, tuple[int, ...]]:
        """The region's changed elements, projected from the local diffs."""
        canonical_parts, old_parts, new_parts = [], [], []
        for piece in pieces:
            local_changed = diff.changed[piece.local]
            assert local_changed is not None
            local_idx, canonical_idx = piece.project(local_changed.cpu())
            local_idx = local_idx.to(diff.flats[piece.local].device)
            canonical_parts.append(canonical_idx)
            old_parts.append(bits_view(self._local[piece.local]).reshape(-1)[local_idx])
            new_parts.append(diff.flats[piece.local][local_idx])
        positions = torch.cat(canonical_parts)
        old, new = torch.cat(old_parts), torch.cat(new_parts)
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            order = torch.argsort(positions)  # (an order-preserving placement needs none)
            positions = positions[order]
            old, new = old[order.to(old.device)], new[order.to(new.device)]
        after = lanes_after_change(before, positions, old, new) if positions.numel() else before
        values = new if op == OVERWRITE else old ^ new
        return (
            _entry(pieces[0], dtype, op, positions, values, before, after, index, shards),
            after,
        )

    # --- advance -----------------------------------------------------------------------

    def _local_changes(self, diff: _Diff) -> dict[str, _LocalChange]:
        """How each local baseline will advance (taken now: the caller may reuse its tensors)."""
        advance: dict[str, _LocalChange] = {}
        for name, flat in diff.flats.items():
            positions = diff.changed[name]
            if positions is None:
                advance[name] = _LocalChange(None, diff.local[name].to(self.device).clone())
            else:
                advance[name] = _LocalChange(positions, flat[positions])
        return advance

    def _advance(
        self,
        changes: dict[str, _LocalChange],
        lanes: dict[_Region, tuple[int, ...]],
        dtypes: dict[_Region, torch.dtype],
    ) -> None:
        """The commit exists: bring the local baselines and region lanes to it."""
        for name, change in changes.items():
            if change.positions is None:
                self._local[name] = change.values
            else:
                bits_view(self._local[name]).reshape(-1)[change.positions] = change.values
        self._region_lanes = lanes
        self._region_dtypes = dtypes


def decode_region_entry(entry: Entry, streams: dict[int, dict[str, memoryview]]) -> Delta:
    """Decode one entry from its rank's inflated shards (by index); a full piece decodes as
    its region's overwrite."""
    op = OVERWRITE if entry.op == FULL and entry.piece is not None else entry.op

    def stream(ref: PositionsRef | ValuesRef | None) -> tuple[str, memoryview] | None:
        if ref is None:
            return None
        shard = streams.get(ref.shard)
        if shard is None or ref.key not in shard:
            raise ShardError(f"stream {ref.key!r} of {entry.name!r} is missing from its shard")
        return ref.coding, shard[ref.key]

    return decode_delta(
        op,
        info_for(entry.dtype),
        math.prod(entry.shape),
        entry.changed,
        positions=stream(entry.positions),
        values=stream(entry.values),
    )


def since_base(chain: Chain, latest: LoadedRecord) -> list[LoadedRecord] | None:
    """The records from ``latest`` back to the last base, newest first; None where a
    version before it was removed (``gc`` keeps a chain that starts at an alternative
    base, whose parents are gone): a rank's own entries cannot rebuild its regions then."""
    records = [latest]
    while records[-1].record.kind != "base":
        try:
            records.append(chain.record(records[-1].record.version - 1))
        except VersionNotFoundError:
            return None
    return records


def _region_streams(
    chain: Chain, found: Iterable[tuple[Manifest, Entry]]
) -> dict[int, dict[int, dict[str, memoryview]]]:
    """The inflated shards holding the given entries' streams (only those), verified: by
    rank, then by shard index."""
    from dcr_format.sync._plan import stream_limits  # a projection's restart only

    shards: dict[tuple[int, int], Manifest] = {}
    for manifest, entry in found:
        for ref in entry.streams:
            shards[(manifest.rank, ref.shard)] = manifest
    streams: dict[int, dict[int, dict[str, memoryview]]] = {}
    for (rank, index), manifest in shards.items():
        shard = manifest.shards[index]
        stored = get_verified(chain.store, shard.path, size=shard.size, sha256=shard.sha256)
        streams.setdefault(rank, {})[index] = decode_shard(
            stored, decoded_size=shard.decoded_size, limits=stream_limits(manifest)[index]
        )
    return streams


def _entry(
    piece: Piece,
    dtype: torch.dtype,
    op: str,
    positions: torch.Tensor | None,
    values: torch.Tensor,
    before: tuple[int, ...] | None,
    after: tuple[int, ...],
    index: int,
    shards: ShardWriter,
) -> Entry:
    """The entry of one region; its streams are queued on ``shards``."""
    positions_ref = values_ref = None
    encoded = 0
    changed = int(values.numel())
    if changed:
        if positions is not None:
            coding, data = encode_positions(positions.cpu().numpy())
            key = f"{index}.p"
            positions_ref = PositionsRef(shard=shards.add(key, data), key=key, coding=coding)
            encoded += len(data)
        coding, data = encode_values(bits_to_numpy(values))
        key = f"{index}.v"
        values_ref = ValuesRef(shard=shards.add(key, data), key=key, coding=coding)
        encoded += len(data)
    return Entry(
        name=piece.canonical,
        dtype=info_for(dtype).name,
        shape=piece.shape,
        op=op,
        changed=changed,
        positions=positions_ref,
        values=values_ref,
        encoded_bytes=encoded,
        fingerprint=fingerprint_from_lanes(dtype, piece.shape, after),
        parent_fingerprint=(
            None if op == FULL else fingerprint_from_lanes(dtype, piece.shape, before or ())
        ),
        piece=(
            PieceInfo(index=piece.part, count=piece.parts, lanes_before=before, lanes_after=after)
            if piece.parts > 1
            else None
        ),
    )
