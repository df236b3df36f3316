"""The canonical part of a publish: the canonical tensors a writer rank owns by name.

:class:`CanonicalPart` keeps the owned tensors' baseline (restored from the local
:class:`~dcr_format.publish._cache.BaselineCache` or replayed from the store), streams the
given tensors through the diff and the codings into entries and shards, and advances or
reverts the baseline once the commit's outcome is known.
"""

from __future__ import annotations

import zlib
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from dcr_format.chain.chain import Chain, LoadedRecord, TensorState
from dcr_format.delta import dispatch
from dcr_format.delta.classed_change import KeptClasses
from dcr_format.delta.delta import (
    FULL,
    OVERWRITE,
    XOR,
    DecodedDelta,
    EncodedTensor,
    apply_delta,
    comparable,
)
from dcr_format.delta.fingerprint import (
    apply_lane_deltas,
    fingerprint_from_lanes,
    lanes_after_change,
    tensor_lanes,
)
from dcr_format.delta.pipeline import encode_stream
from dcr_format.errors import (
    ArgumentError,
    IncompleteVersionError,
    IntegrityError,
    TargetError,
    UnsupportedDtypeError,
)
from dcr_format.format.dtypes import bits_view
from dcr_format.format.features import (
    POSITIONS_CLASSED_FEATURE,
    PublishCodings,
    features_for,
)
from dcr_format.format.schema import Entry, Manifest
from dcr_format.kernels.reference import Diff
from dcr_format.publish._cache import BaselineCache
from dcr_format.publish._part import Attempt, Tensors, Written, encoded_entry, pairs
from dcr_format.publish._sharded import is_dtensor
from dcr_format.targets.dict import StateDictTarget


def owner(name: str, world_size: int) -> int:
    """The writer rank that publishes canonical tensor ``name``: crc32(UTF-8 name) mod W."""
    return zlib.crc32(name.encode()) % world_size


_Item = tuple[str, torch.Tensor, "torch.Tensor | None"]  # name, new tensor, baseline


class SameAsBaseline(Exception):
    """Every tensor given to :func:`held_while_unchanged` equals the baseline bit for bit."""


def held_while_unchanged(
    tensors: Tensors, baseline: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs of a base that may equal ``baseline``, found so before it is coded.

    While every tensor so far equals its baseline bit for bit, each is held back by name.
    At the first that does not, the held ones are given (as the baseline's own tensors,
    which hold the same bits) before it, and the rest as they come: the publish goes on as
    if given ``tensors``. Where the stream ends with every tensor held and exactly the
    baseline's names given, :class:`SameAsBaseline` is raised, and nothing was coded or
    uploaded. A base is every tensor in full, so finding it unchanged after writing it
    would upload the whole checkpoint for nothing.
    """
    held: dict[str, None] = {}
    stream = pairs(tensors)
    for name, tensor in stream:
        old = baseline.get(name)
        if name not in held and old is not None and _same_bits(tensor, old):
            held[name] = None
            continue
        yield from ((n, baseline[n]) for n in held)
        yield name, tensor
        yield from stream
        return
    if held.keys() == baseline.keys():
        raise SameAsBaseline
    yield from ((n, baseline[n]) for n in held)


def _same_bits(tensor: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain tensor with ``old``'s dtype, shape, device and bits."""
    return (
        not is_dtensor(tensor)
        and tensor.dtype == old.dtype
        and tensor.shape == old.shape
        and tensor.device == old.device
        and torch.equal(bits_view(tensor.detach()), bits_view(old))
    )


@dataclass(frozen=True)
class _Pending:
    """One tensor's change, held until the commit is known to exist."""

    delta: DecodedDelta | None  # None: no bits changed
    fingerprint: str
    lanes: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    rows: np.ndarray | None = None  # exponent rows of the new bits, where they were counted
    classes: tuple[int, int] | None = None  # the classes its ``classed`` positions used


class CanonicalPart:
    """A writer rank's part of canonical tensors: those this rank owns (:func:`owner`)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        ops: Mapping[str, str],
        cache: BaselineCache | None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.device, self.ops, self.cache = device, ops, cache
        self._baseline: dict[str, torch.Tensor] = {}
        self._fingerprints: dict[str, str] = {}
        self._lanes: dict[str, tuple[int, ...]] = {}  # fingerprint lanes of the baseline
        # exponent rows of the baseline (host tensors the writer considered classed
        # positions for), so that the next step need not count them again, and the classes
        # of their last classed positions, which the next step's diff ranks its changes in
        self._rows: dict[str, KeptClasses] = {}

    @property
    def baseline(self) -> Mapping[str, torch.Tensor]:
        """The owned tensors' exact bits at the last commit."""
        return self._baseline

    def owns(self, name: str) -> bool:
        """Whether this rank publishes ``name``."""
        return self.world_size == 1 or owner(name, self.world_size) == self.rank

    def check_manifest(self, manifest: Manifest, rank: int, key: str) -> None:
        """Whole tensors come from their owner rank (FORMAT.md §4.6); pieces follow the
        writers' layout and are checked when combined (§4.8)."""
        for entry in manifest.entries:
            if entry.piece is None and owner(entry.name, self.world_size) != rank:
                raise IncompleteVersionError(f"{key} lists {entry.name!r}, owned by another rank")

    # --- restore ------------------------------------------------------------------------

    def restore(self, chain: Chain, latest: LoadedRecord, table: dict[str, TensorState]) -> None:
        """The baseline of ``latest``: from the local cache if valid, else from the store."""
        owned = {n: s for n, s in table.items() if self.owns(n)}
        version = latest.record.version
        found = self._from_cache(chain, version, owned)
        if found is None:
            from dcr_format.sync.reader import DeltaReader  # a replay: not the usual restart

            target = StateDictTarget({})
            DeltaReader(chain.store, target, select=self.owns).sync(to=version)
            found = target, {}
        target, lanes = found
        self._baseline = {n: t.to(self.device) for n, t in target.tensors.items()}
        self._fingerprints = {n: s.fingerprint for n, s in owned.items()}
        self._lanes = lanes  # where unknown, the next publish reads them from the baseline
        self._rows = {}

    def _from_cache(
        self, chain: Chain, version: int, owned: dict[str, TensorState]
    ) -> tuple[StateDictTarget, dict[str, tuple[int, ...]]] | None:
        """The cached baseline brought to ``version`` and checked, with its fingerprint lanes
        where the cache's are those of ``version``, or None."""
        if self.cache is None:
            return None
        target = self.cache.load(chain.header.chain_id)
        if target is None:
            return None
        resident = target.resident()
        if resident is None or resident.version != version:  # older: brought to it, checked
            from dcr_format.sync.reader import DeltaReader

            try:
                DeltaReader(chain.store, target, select=self.owns, verify="all").sync(to=version)
            except (IntegrityError, TargetError):
                return None  # a stale or damaged cache: replay from the store instead
            if set(target.tensors) != set(owned):
                return None
            return target, {}  # the sync checked the bits it made
        if set(target.tensors) != set(owned):
            return None
        # a cache at ``version``: its bits are checked by their fingerprint lanes against
        # the chain's fingerprints, and the lanes kept for the next publish
        lanes = {n: _cached_lanes(t) for n, t in target.tensors.items()}
        for name, tensor in target.tensors.items():
            found = lanes[name]
            if found is None or owned[name].fingerprint != fingerprint_from_lanes(
                tensor.dtype, tensor.shape, found
            ):
                return None
        return target, {n: found for n, found in lanes.items() if found is not None}

    # --- publish --------------------------------------------------------------------------

    def write(self, tensors: Tensors, attempt: Attempt) -> Written:
        """Encode this rank's tensors and upload its shards."""
        shards = attempt.shards()
        entries: list[Entry] = []
        pending: dict[str, _Pending] = {}
        moved: dict[str, Diff] = {}  # baselines the diff's own pass already advanced (CPU)

        def advanced(item: _Item, found: Diff) -> None:
            moved[item[0]] = found

        coded: Generator[tuple[_Item, EncodedTensor], None, None] | None = None
        try:
            # on CUDA the scan of the next tensor overlaps the copy-out and coding of this one;
            # a full shard uploads on a background thread while the next tensors are coded
            items = self._owned(tensors, attempt)
            features = attempt.features
            codings = PublishCodings(
                features,
                (attempt.baseline_names, attempt.baseline_except),
                (attempt.changed_names, attempt.changed_except),
            )
            rows = self._rows.get if POSITIONS_CLASSED_FEATURE in features else None
            coded = encode_stream(
                items,
                advanced,
                None if rows is None else lambda i: rows(i[0]),
                options=lambda i: codings.for_tensor(i[0]),
            )
            for (name, tensor, old), encoded in coded:
                lanes = self._lanes_after(name, tensor, old, encoded)
                fingerprint = fingerprint_from_lanes(tensor.dtype, tensor.shape, lanes)
                parent = self._fingerprints.get(name) if encoded.op != FULL else None
                entries.append(
                    encoded_entry(
                        name, tensor, encoded, len(entries), shards.add, fingerprint, parent
                    )
                )
                shards.maybe_flush()
                pending[name] = _Pending(
                    encoded.advance,
                    fingerprint,
                    lanes,
                    tensor.dtype,
                    tuple(tensor.shape),
                    encoded.rows,
                    encoded.classes,
                )
            attempt.check_none_dropped(sorted(set(self._baseline) - set(pending)))
            shards.finish()
            manifest = attempt.manifest(
                shards, entries, features_for(r.coding for e in entries for r in e.streams)
            )
        except BaseException:
            if coded is not None:  # tensors still coding advance their baselines first
                coded.close()
            self._revert(moved)
            raise
        finally:
            shards.close()

        def advance() -> None:
            self._advance(pending, attempt, moved)

        return Written(manifest, advance, lambda: self._revert(moved))

    def _owned(
        self, tensors: Tensors, attempt: Attempt
    ) -> Iterator[tuple[_Item, torch.Tensor, torch.Tensor | None, str | None]]:
        """``(item, new, old, op)`` of each owned tensor, as :func:`encode_stream` takes them."""
        seen: set[str] = set()
        for name, tensor in pairs(tensors):
            if is_dtensor(tensor):
                raise ArgumentError(
                    f"{name!r} is a DTensor in a publish that began with plain tensors; give "
                    "a stream's tensors as DTensors from the first (a whole tensor replicated: "
                    "DTensor.from_local(t, mesh, [Replicate()]))"
                )
            if not self.owns(name):
                continue
            if name in seen:
                raise ArgumentError(f"tensor {name!r} was given twice in one publish")
            seen.add(name)
            if tensor.requires_grad:  # pairs() checked it (check_input), dtype included
                tensor = tensor.detach()
            old = self._baseline.get(name)
            op = FULL if attempt.base else self._op_for(name, tensor, old, attempt.overwrite)
            if op != FULL and comparable(tensor, old) and name not in self._lanes:
                assert old is not None  # lanes of the old bits, before the diff advances them
                self._lanes[name] = tensor_lanes(old)
            yield (name, tensor, old), tensor, old, op

    def _op_for(
        self, name: str, tensor: torch.Tensor, old: torch.Tensor | None, overwrite: frozenset[str]
    ) -> str | None:
        """The op of a delta entry: configured, else overwrite where a reader asked for it
        (and a comparable baseline exists), else chosen by size."""
        op = self.ops.get(name)
        if op is None and name in overwrite:
            if old is not None and old.dtype == tensor.dtype and old.shape == tensor.shape:
                return OVERWRITE
        return op

    def _lanes_after(
        self, name: str, tensor: torch.Tensor, old: torch.Tensor | None, encoded: EncodedTensor
    ) -> tuple[int, ...]:
        """Fingerprint lanes of the new tensor: updated from the change alone when possible."""
        delta = encoded.advance
        if old is None or (delta is not None and delta.op == FULL):
            return tensor_lanes(tensor)
        base = self._lanes[name]  # _owned read it before the diff could advance ``old``
        if delta is None:  # no bit changed
            return base
        if encoded.lane_deltas is not None:  # the diff's own pass summed them
            return apply_lane_deltas(base, encoded.lane_deltas)
        # (a diff that advanced ``old`` in its pass always sums them: ``old`` is not read)
        assert delta.positions is not None and delta.op == OVERWRITE
        old_bits = bits_view(old).reshape(-1)[delta.positions]
        return lanes_after_change(base, delta.positions, old_bits, delta.values)

    # --- advance --------------------------------------------------------------------------

    def _revert(self, moved: dict[str, Diff]) -> None:
        """Undo the in-place advance of baselines whose version did not commit (XOR bits
        again at the same positions)."""
        while moved:
            name, found = moved.popitem()
            assert found.xor_values is not None
            flat = bits_view(self._baseline[name]).reshape(-1)
            dispatch.scatter(flat, found.positions, found.xor_values, op=XOR)

    def _advance(
        self, pending: dict[str, _Pending], attempt: Attempt, moved: dict[str, Diff]
    ) -> None:
        """The commit exists: bring the baseline to the committed bits, then cache it."""
        for name in set(self._baseline) - set(pending):
            del self._baseline[name]  # only a base may drop tensors (checked before)
        for name, change in pending.items():
            delta = change.delta
            if delta is None or name in moved:  # no change, or the diff's pass made it
                continue
            if delta.op == FULL:
                self._baseline[name] = (
                    delta.values.to(self.device, copy=True).view(change.dtype).reshape(change.shape)
                )
            else:
                apply_delta(self._baseline[name], delta)
        moved.clear()  # committed: nothing to revert any more
        self._fingerprints = {name: change.fingerprint for name, change in pending.items()}
        self._lanes = {name: change.lanes for name, change in pending.items()}
        self._rows = {
            n: KeptClasses(change.rows, change.classes)
            for n, change in pending.items()
            if change.rows is not None
        }
        if self.cache is not None:
            self.cache.save(attempt.chain_id, attempt.version, self._baseline)


def _cached_lanes(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """Fingerprint lanes of a tensor loaded from the cache (None for a dtype the format
    lacks)."""
    try:
        return tensor_lanes(tensor)
    except UnsupportedDtypeError:
        return None
