"""Publishing from a trainer's own layout: local diffs projected to canonical positions.

:class:`ProjectionWriter` is a :class:`~dcr_format.DeltaWriter` whose ``publish`` takes
the rank's *local* tensors (tensor-parallel shards, fused ``qkv``, ...) described by a
:class:`~dcr_format.layout.Layout`. Each step it diffs every local tensor against its
own baseline (the local tensors of the last committed version), carries the changed
local positions of every region it owns to canonical flat indices arithmetically, and
publishes them. No canonical tensor is built on the trainer, except transiently when a
writer reopens an existing chain (the baseline is then cut from the canonical tensors).

A canonical tensor held by one rank (whole, a stacked expert, a conversion's output)
is published as an ordinary entry; one split over ``parts`` ranks as ``parts`` piece
entries (FORMAT.md §4.8), each with the fingerprint lanes of its region, which the
readers and the committer add up. Deltas use ``xor`` (``overwrite`` where configured in
``ops`` or requested by a reader record); unlike :class:`DeltaWriter`, a delta never
switches a tensor to ``full`` by size. Bases and new tensors are ``full``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dcr_format.chain import state_table
from dcr_format.codec.delta import FULL, OVERWRITE, XOR, changed_positions
from dcr_format.codec.dtypes import bits_to_numpy, bits_view, info_for
from dcr_format.codec.positions import encode_positions
from dcr_format.codec.values import encode_values
from dcr_format.fingerprint import fingerprint_from_lanes, lanes_after_change, lanes_at
from dcr_format.layout import Layout, Piece
from dcr_format.schema import PIECES_FEATURE, Entry, Manifest, PositionsRef, ValuesRef
from dcr_format.schema import Piece as PieceInfo
from dcr_format.store import Store
from dcr_format.writers.writer import DeltaWriter, _pairs, _ShardWriter

__all__ = ["ProjectionWriter"]


@dataclass(frozen=True)
class _LocalChange:
    """How one local baseline advances once the commit exists."""

    positions: torch.Tensor | None  # changed flat positions; None: ``values`` is the tensor
    values: torch.Tensor


@dataclass(frozen=True)
class _Pending:
    locals: dict[str, _LocalChange]
    lanes: dict[tuple[str, int], tuple[int, ...]]
    dtypes: dict[tuple[str, int], torch.dtype]


class ProjectionWriter(DeltaWriter):
    """A :class:`DeltaWriter` that publishes from local tensors placed by ``layout``.

    Every rank of the publish passes its own layout and its own local tensors to
    :meth:`publish`; all other options are those of :class:`DeltaWriter` (``cache_dir``
    is not supported: reopening a chain restores the baseline from the store).
    """

    def __init__(
        self, store: Store | str | os.PathLike[str], layout: Layout, **options: Any
    ) -> None:
        if options.get("cache_dir") is not None:
            raise ValueError("ProjectionWriter keeps no baseline cache; leave cache_dir unset")
        super().__init__(store, **options)
        self.layout = layout
        self._regions = layout.regions()
        self._local: dict[str, torch.Tensor] = {}
        self._region_lanes: dict[tuple[str, int], tuple[int, ...]] = {}
        self._region_dtypes: dict[tuple[str, int], torch.dtype] = {}

    @property
    def baseline(self) -> Mapping[str, torch.Tensor]:
        """The local tensors' exact bits at :attr:`version` (read-only by convention)."""
        self._open()
        return self._local

    def owns(self, name: str) -> bool:
        """Whether this rank publishes some region of canonical tensor ``name``."""
        return any(canonical == name for canonical, _ in self._regions)

    def _check_owners(self, manifest: Manifest, rank: int, key: str) -> None:
        """Layout writers place whole tensors where their layouts say (FORMAT.md §4.6 is
        for writers without a layout); a tensor listed twice is still refused when the
        committer combines the manifests."""

    # --- restore -----------------------------------------------------------------------

    def _restore(self, latest: int) -> None:
        """Continue an existing chain: cut the local baselines from its canonical tensors."""
        from dcr_format.readers.reader import DeltaReader
        from dcr_format.readers.targets import StateDictTarget

        self._record = self.chain.record(latest)
        table = state_table(self.chain.manifests(self._record))
        names = set(self.layout.shapes)
        target = StateDictTarget({}, device=self.baseline_device)
        DeltaReader(self.store, target, select=names.__contains__).sync(to=latest)
        self._local = self.layout.scatter(target.tensors)
        for key, pieces in self._regions.items():
            canonical = target.tensors.get(key[0])
            if canonical is None or tuple(canonical.shape) != pieces[0].shape:
                continue  # published as a new tensor next time
            positions = torch.cat([p.canonical_view.elements() for p in pieces])
            bits = bits_view(canonical).reshape(-1)[positions.to(canonical.device)]
            self._region_lanes[key] = lanes_at(positions, bits)
            self._region_dtypes[key] = canonical.dtype
        self._table = table
        self._version = latest

    # --- publish -----------------------------------------------------------------------

    def _write_part(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        kind: str,
        attempt: str,
    ) -> tuple[_Pending, Manifest]:  # type: ignore[override]
        """Diff the local tensors, project the owned regions' changes, upload the shards."""
        base = kind == "base"
        given: dict[str, torch.Tensor] = {}
        for name, tensor in _pairs(tensors):
            if name in given:
                raise ValueError(f"tensor {name!r} was given twice in one publish")
            given[name] = tensor
        local = self.layout.local_tensors(given)
        flats: dict[str, torch.Tensor] = {}
        changed: dict[str, torch.Tensor | None] = {}
        for name, tensor in local.items():
            info_for(tensor.dtype)  # refuses dtypes the format cannot carry
            tensor = tensor.to(self.baseline_device).contiguous()
            flats[name] = bits_view(tensor).reshape(-1)
            old = self._local.get(name)
            comparable = old is not None and old.dtype == tensor.dtype and old.shape == tensor.shape
            changed[name] = changed_positions(old, tensor) if comparable and not base else None
        shards = _ShardWriter(
            self.store, version, attempt, self.rank, self.shard_bytes, self.zstd_level
        )
        entries: list[Entry] = []
        lanes: dict[tuple[str, int], tuple[int, ...]] = {}
        dtypes: dict[tuple[str, int], torch.dtype] = {}
        try:
            for key, pieces in self._regions.items():
                canonical = key[0]
                dtype = local[pieces[0].local].dtype
                if any(local[p.local].dtype != dtype for p in pieces):
                    raise ValueError(f"the local tensors placing {canonical!r} differ in dtype")
                before = None if base else self._region_lanes.get(key)
                configured = self.ops.get(canonical)
                if (
                    before is None
                    or self._region_dtypes.get(key) != dtype
                    or configured == FULL
                    or any(changed[p.local] is None for p in pieces)
                ):
                    entry, after = self._full_entry(pieces, flats, dtype, len(entries), shards)
                else:
                    op = configured or (OVERWRITE if canonical in self._reader_overwrite else XOR)
                    entry, after = self._delta_entry(
                        pieces, flats, changed, dtype, op, before, len(entries), shards
                    )
                entries.append(entry)
                shards.maybe_flush()
                lanes[key], dtypes[key] = after, dtype
            shards.finish()  # every shard is up (full ones went up while coding)
        finally:
            shards.close()
        advance: dict[str, _LocalChange] = {}
        for name, flat in flats.items():
            positions = changed[name]
            if positions is None:
                advance[name] = _LocalChange(None, local[name].to(self.baseline_device).clone())
            else:
                advance[name] = _LocalChange(positions, flat[positions])
        pieces_used = any(e.piece is not None for e in entries)
        manifest = Manifest(
            required_features=(PIECES_FEATURE,) if pieces_used else (),
            chain_id=self.chain.header.chain_id,
            version=version,
            kind=kind,
            attempt=attempt,
            rank=self.rank,
            world_size=self.world_size,
            shards=tuple(shards.shards),
            entries=tuple(entries),
        )
        return _Pending(advance, lanes, dtypes), manifest

    def _full_entry(
        self,
        pieces: list[Piece],
        flats: dict[str, torch.Tensor],
        dtype: torch.dtype,
        index: int,
        shards: _ShardWriter,
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
        order = torch.argsort(positions)
        positions, values = positions[order], values[order]
        first = pieces[0]
        if positions.numel() > 1 and bool((positions[1:] == positions[:-1]).any()):
            raise ValueError(f"the layout places elements of {first.canonical!r} twice")
        after = lanes_at(positions, values)
        numel = 1
        for dim in first.shape:
            numel *= dim
        if first.parts == 1:
            if positions.numel() != numel:  # sorted and distinct: covering means all of them
                raise ValueError(
                    f"the layout covers {positions.numel()} of the {numel} elements of "
                    f"{first.canonical!r}; a tensor held by one rank must be covered exactly"
                )
            return self._entry_of(
                first, dtype, FULL, None, values, None, after, index, shards
            ), after
        entry = self._entry_of(first, dtype, FULL, positions, values, None, after, index, shards)
        return entry, after

    def _delta_entry(
        self,
        pieces: list[Piece],
        flats: dict[str, torch.Tensor],
        changed: dict[str, torch.Tensor | None],
        dtype: torch.dtype,
        op: str,
        before: tuple[int, ...],
        index: int,
        shards: _ShardWriter,
    ) -> tuple[Entry, tuple[int, ...]]:
        """The region's changed elements, projected from the local diffs."""
        canonical_parts, old_parts, new_parts = [], [], []
        for piece in pieces:
            local_changed = changed[piece.local]
            assert local_changed is not None
            local_idx, canonical_idx = piece.project(local_changed.cpu())
            local_idx = local_idx.to(flats[piece.local].device)
            canonical_parts.append(canonical_idx)
            old_parts.append(bits_view(self._local[piece.local]).reshape(-1)[local_idx])
            new_parts.append(flats[piece.local][local_idx])
        positions = torch.cat(canonical_parts)
        order = torch.argsort(positions)
        positions = positions[order]
        old = torch.cat(old_parts)[order.to(old_parts[0].device)]
        new = torch.cat(new_parts)[order.to(new_parts[0].device)]
        after = lanes_after_change(before, positions, old, new) if positions.numel() else before
        values = new if op == OVERWRITE else old ^ new
        return (
            self._entry_of(pieces[0], dtype, op, positions, values, before, after, index, shards),
            after,
        )

    def _entry_of(
        self,
        piece: Piece,
        dtype: torch.dtype,
        op: str,
        positions: torch.Tensor | None,
        values: torch.Tensor,
        before: tuple[int, ...] | None,
        after: tuple[int, ...],
        index: int,
        shards: _ShardWriter,
    ) -> Entry:
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
                PieceInfo(
                    index=piece.part, count=piece.parts, lanes_before=before, lanes_after=after
                )
                if piece.parts > 1
                else None
            ),
        )

    # --- advance -----------------------------------------------------------------------

    def _advance(  # type: ignore[override]
        self, pending: _Pending, loaded: Any, table: Any, base: bool
    ) -> None:
        """The commit exists: bring the local baselines and region lanes to it."""
        for name, change in pending.locals.items():
            if change.positions is None:
                self._local[name] = change.values
            else:
                bits_view(self._local[name]).reshape(-1)[change.positions] = change.values
        self._region_lanes = dict(pending.lanes)
        self._region_dtypes = dict(pending.dtypes)
        self._record = loaded
        self._version = loaded.record.version
        if self.rank == 0:
            self._table = table
