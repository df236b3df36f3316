"""The trainer side: diff against the baseline, publish shards and a manifest, commit jointly.

:class:`DeltaWriter` runs a publish: rank 0 picks the attempt id and reads the reader
records, every rank writes its part (shards and manifest), rank 0 commits
(``writers/_commit.py``) and every rank then advances its baseline. What a rank's part
is comes from the part it is given: canonical tensors owned by name (this module's
:class:`CanonicalPart`, the default) or local tensors placed by a
:class:`~dcr_format.chain.layout.Layout` (``layout=``, ``writers/_projection.py``).
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from dcr_format.chain.chain import (
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    Chain,
    LoadedRecord,
    TensorChange,
    TensorState,
    manifest_key,
    new_id,
    sha256_hex,
    state_table,
    table_fingerprint,
    tensor_changes,
    timestamp,
    utc_now,
)
from dcr_format.chain.layout import Layout
from dcr_format.delta import dispatch
from dcr_format.delta.delta import (
    FULL,
    OPS,
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
    tensor_fingerprint,
    tensor_lanes,
)
from dcr_format.delta.pipeline import encode_stream
from dcr_format.errors import (
    ArgumentError,
    ChainBrokenError,
    DcrError,
    IncompleteVersionError,
    IntegrityError,
    MissingTensorError,
    ObjectTooLargeError,
    TargetError,
    UnchangedVersionError,
    UnsupportedDtypeError,
)
from dcr_format.format.dtypes import bits_view, info_for
from dcr_format.format.features import (
    BASELINE_FEATURES,
    CHECKPOINT_FILES_FEATURE,
    IMPLICIT_PARENTS_FEATURE,
    MANIFEST_ZSTD_FEATURE,
    POSITIONS_CLASSED_FEATURE,
    EncodeOptions,
    features_for,
    writer_features,
)
from dcr_format.format.schema import (
    CheckpointFile,
    CommitRecord,
    Entry,
    Manifest,
    ManifestRef,
    Stats,
    implicit_parents,
    stored_manifest,
)
from dcr_format.format.shard import ZSTD_LEVEL
from dcr_format.kernels.reference import Diff
from dcr_format.publish._commit import (
    ReaderWishes,
    abort,
    await_commit,
    create_commit,
    gather_manifests,
    read_reader_records,
    require_atomic_create,
)
from dcr_format.publish._files import Files, file_refs, files_to_publish
from dcr_format.publish._info import CommitInfo
from dcr_format.publish._part import (
    Attempt,
    Part,
    Tensors,
    Written,
    check_publish,
    encoded_entry,
    pairs,
)
from dcr_format.publish._projection import ProjectionPart
from dcr_format.publish._sharded import ShardedPart, is_dtensor, peek_sharded
from dcr_format.publish.coordinate import Coordinator, SoloCoordinator
from dcr_format.store.store import Store, open_store
from dcr_format.sync.reader import DeltaReader
from dcr_format.targets.targets import StateDictTarget

# A shard is compressed and uploaded on a background thread while the next tensors are
# coded, so the last shard is the only upload a publish waits for. A writer cuts shards at a
# quarter of its previous publish (DeltaWriter._shard_limit), at most shard_bytes (default
# 32 MiB: a version of a 1T-parameter model at 1% is then ~500 objects across its ranks) and
# at least MIN_SHARD_BYTES.
DEFAULT_SHARD_BYTES = 32 << 20
MIN_SHARD_BYTES = 4 << 20  # the smallest shard a writer cuts by itself (see _shard_limit)
_log = logging.getLogger(__name__)


def owner(name: str, world_size: int) -> int:
    """The writer rank that publishes canonical tensor ``name``: crc32(UTF-8 name) mod W."""
    return zlib.crc32(name.encode()) % world_size


class DeltaWriter:
    """Publishes every training step of one writer rank as a version of the chain.

    ``tensors`` given to :meth:`publish` are canonical (Hugging Face) tensors; this
    rank encodes those it owns (see :func:`owner`) and ignores the rest, so a rank
    may be handed everything or only its own. The baseline (exact bits of the last
    committed version of the owned tensors) lives on ``baseline_device`` and
    advances only once the commit record is known to exist.

    With ``layout``, :meth:`publish` takes this rank's *local* tensors instead
    (tensor-parallel shards, fused matrices, ...) placed by the
    :class:`~dcr_format.chain.layout.Layout`; each rank passes its own layout, the baseline
    is the local tensors, and ``cache_dir`` is not supported (reopening a chain
    restores the baseline from the store).

    With ``reader_records`` (default), rank 0 reads the reader records
    (``readers/*.json``) at every delta publish and every rank sends the tensors
    they name as ``overwrite`` (readers whose load path casts or scales them).

    ``features`` (FORMAT.md §12; each makes the chain unreadable to readers without it):
    ``values-rans`` (entropy-coded values), ``positions-classed``, ``values-ulp`` and
    ``values-ulp-shift`` (positions and values of ``xor`` entries coded against the old
    bits; not sent while a reader record says its reader cannot read them),
    ``manifest-zstd`` (compressed manifests), ``implicit-parents`` (delta manifests without
    parent fingerprints). Each coding is used per tensor only where it is smaller.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        base_every: int | None = None,
        coordinator: Coordinator | None = None,
        ops: Mapping[str, str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        baseline_device: str | torch.device = "cpu",
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        zstd_level: int = ZSTD_LEVEL,
        commit_timeout: float = 600.0,
        clock: Callable[[], datetime] = utc_now,
        ids: Callable[[], str] = new_id,
        reader_records: bool = True,
        layout: Layout | None = None,
        features: Iterable[str] = (),
    ) -> None:
        _check_options(rank, world_size, base_every, coordinator, ops)
        # codec features (FORMAT.md §12) canonical entries may use where they are smaller
        self.features = writer_features(features)
        if layout is not None and cache_dir is not None:
            raise ArgumentError(
                "a writer with a layout keeps no baseline cache; leave cache_dir unset"
            )
        self.store = open_store(store)
        self.chain = Chain(self.store)
        self.rank, self.world_size = rank, world_size
        self.base_every = base_every
        self.coordinator = coordinator or SoloCoordinator()
        self.ops = dict(ops or {})
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.baseline_device = torch.device(baseline_device)
        self.shard_bytes, self.zstd_level = shard_bytes, zstd_level
        self._last_streams: int | None = None  # stream bytes this rank wrote last publish
        self.commit_timeout = commit_timeout
        self.clock, self.ids = clock, ids
        self.reader_records = reader_records
        self.layout = layout
        self._part: Part
        if layout is None:
            cache = (
                None if self.cache_dir is None else _BaselineCache(self.cache_dir, rank, world_size)
            )
            self._part = CanonicalPart(
                rank=rank,
                world_size=world_size,
                device=self.baseline_device,
                ops=self.ops,
                cache=cache,
                features=self.features,
            )
        else:
            self._part = ProjectionPart(layout, device=self.baseline_device, ops=self.ops)
        # the baseline of a reopened chain, cut once the part is known (see _settle)
        self._unrestored: tuple[Chain, LoadedRecord, dict[str, TensorState]] | None = None
        self._opened = False
        self._version: int | None = None
        self._record: LoadedRecord | None = None
        self._table: dict[str, TensorState] = {}  # committer: full table of the baseline version
        self._files: tuple[CheckpointFile, ...] = ()  # rank 0: the baseline version's files
        # seconds of the last publish by stage: diff, coding and shard uploads; manifest and
        # commit (waiting for every rank); baseline advance and cache
        self.timings: dict[str, float] = {}

    # --- state ----------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The committed version the baseline holds (None before the first publish)."""
        self._open()
        self._settle()
        return self._version

    @property
    def baseline(self) -> Mapping[str, torch.Tensor]:
        """The exact bits at :attr:`version` of the owned tensors (with a layout: of the
        local tensors); read-only by convention."""
        self._open()
        self._settle()
        return self._part.baseline

    def owns(self, name: str) -> bool:
        """Whether this rank publishes (some of) canonical tensor ``name``."""
        self._settle()
        return self._part.owns(name)

    def _open(self) -> None:
        if self._opened:
            return
        # Refuse before writing anything where create-if-absent is not atomic (probes S3).
        capabilities = require_atomic_create(
            self.store,
            f"cannot publish to {self.store.url}: conditional writes are not honoured by "
            "this server, so two writers could both commit one version; pass "
            "single_writer=True (one writer only): DeltaWriter(Store(url, single_writer=True))",
        )
        if not self.chain.exists():
            self.chain.create(
                clock=self.clock,
                chain_id=self.ids(),
                conditional_writes=capabilities.conditional_writes,
            )
        latest = self.chain.latest()
        if latest is not None:
            self._restore(latest)
        self._opened = True

    def _restore(self, latest: int) -> None:
        """Continue an existing chain from committed version ``latest``."""
        record = self.chain.record(latest)
        manifests = self.chain.manifests(record)
        table = state_table(manifests)
        self._unrestored = (self.chain, record, table)
        self._record, self._table, self._version = record, table, latest
        self._files = next((m.files for m in manifests if m.rank == 0), ())

    def _settle(self, tensors: Tensors | None = None) -> Tensors | None:
        """Pick the part ``tensors`` need (``DTensor`` objects, without a layout: the sharded
        part) and cut its baseline of a reopened chain; returns the tensors to publish."""
        if self.layout is None and tensors is not None and not isinstance(self._part, ShardedPart):
            sharded, tensors = peek_sharded(tensors)
            if sharded:
                self._part = ShardedPart(
                    rank=self.rank,
                    world_size=self.world_size,
                    device=self.baseline_device,
                    ops=self.ops,
                )
                if self._record is not None:  # the new part's baseline comes from the store
                    self._unrestored = (self.chain, self._record, self._table)
        if self._unrestored is not None:
            self._part.restore(*self._unrestored)
            self._unrestored = None
        return tensors

    # --- publish ----------------------------------------------------------------------

    def publish(
        self,
        tensors: Tensors,
        *,
        step: int | None = None,
        files: Files | None = None,
        allow_empty: bool = True,
    ) -> CommitInfo:
        """Publish the next version from canonical ``tensors`` (with a layout: this rank's
        local tensors) and commit it with every rank.

        ``files`` are the checkpoint's small files the version carries besides its tensors
        (config, generation config, tokenizer files, chat template: FORMAT.md §3.5.6), so
        that a directory a reader pulls loads with ``from_pretrained``: a mapping of file
        name to bytes, or a Hugging Face checkpoint directory (its small files are taken,
        :func:`~dcr_format.publish._files.directory_files`). None keeps the previous
        version's files; ``{}`` drops them. Each file is uploaded only when its bytes are
        not among the previous version's (they are stored by sha256). Rank 0 publishes
        them; other ranks' ``files`` are ignored.

        Raises :class:`CommitConflictError` if another writer committed this version first
        (the baseline is unchanged), :class:`IncompleteVersionError` if a rank did not
        deliver, and :class:`CommitStateUnknownError` if the commit's outcome is unknown.
        Input no version can carry (a bad name, something not a dense tensor with data, a
        dtype the format lacks) is refused by name before anything is written
        (:func:`~dcr_format.publish._part.check_input`).
        With ``allow_empty=False`` (one writer rank only), a version whose tensors equal the
        newest version's bit for bit, with the same files, commits nothing and raises
        :class:`UnchangedVersionError`.
        """
        if not allow_empty and self.world_size != 1:
            raise ArgumentError(
                "allow_empty=False needs a single writer rank; publish with allow_empty=True"
            )
        try:
            check_publish(tensors)  # bad input fails the version before it begins
        except DcrError:
            if self.world_size > 1:  # the other ranks wait for this one: abort the attempt
                self._open()
                attempt = self._begin()
                self._abort(attempt.version, attempt.id)
            raise
        chosen = None if files is None or self.rank != 0 else files_to_publish(files)
        self._open()
        settled = self._settle(tensors)
        assert settled is not None
        attempt = self._begin()
        clock = time.perf_counter
        started = clock()
        try:
            listed = self._put_files(chosen)
            written = self._part.write(settled, attempt)
            if not allow_empty:
                self._refuse_unchanged(written, attempt, listed)
        except BaseException:
            self._abort(attempt.version, attempt.id)  # no manifest of ours: it cannot commit
            raise
        encoded = clock()
        try:
            manifest = written.manifest
            if listed:  # rank 0's manifest lists the version's files
                features = tuple(sorted({*manifest.required_features, CHECKPOINT_FILES_FEATURE}))
                manifest = manifest.model_copy(
                    update={"files": listed, "required_features": features}
                )
            own, uploaded = self._upload_manifest(manifest, attempt)
            if self.rank == 0:
                loaded, table = self._commit(attempt, step, own, uploaded)
            else:
                loaded = await_commit(self.chain, attempt.version, attempt.id, self.commit_timeout)
                table = {}
        except BaseException:
            written.revert()  # not committed (or not known to be): the baseline stays
            raise
        committed = clock()
        self._last_streams = sum(ref.decoded_size for ref in written.manifest.shards)
        self._advance(written, loaded, table)
        self._files = listed
        self.timings = {
            "encode_upload_s": encoded - started,
            "commit_s": committed - encoded,
            "advance_s": clock() - committed,
        }
        return CommitInfo.from_record(loaded.record)

    def _put_files(self, files: dict[str, bytes] | None) -> tuple[CheckpointFile, ...]:
        """Upload the files whose bytes the previous version does not hold (``files/<sha256>``)
        and return the version's listing (None: the previous version's files; rank 0 only)."""
        if self.rank != 0:
            return ()
        if files is None:
            return self._files
        listed = file_refs(files)
        held = {ref.sha256 for ref in self._files}
        for ref in listed:
            if ref.sha256 not in held:
                self.store.put(ref.key, files[ref.name])
                held.add(ref.sha256)
        return listed

    def _refuse_unchanged(
        self, written: Written, attempt: Attempt, listed: tuple[CheckpointFile, ...]
    ) -> None:
        """Raise :class:`UnchangedVersionError` (baseline reverted) where the written
        version's tensors equal the newest version's, bit for bit, and its files are the
        same."""
        if self._record is None or listed != self._files:
            return
        table = state_table([written.manifest])
        if table_fingerprint(table) != self._record.record.state_fingerprint:
            return
        written.revert()
        raise UnchangedVersionError(
            f"the tensors equal version {self._record.record.version}'s bit for bit: version "
            f"{attempt.version} would change nothing, so nothing was committed (allow_empty "
            "commits it anyway)"
        )

    def _shard_limit(self) -> int:
        """Where this publish cuts shards: a quarter of what the rank's last publish wrote
        (steps of one run are alike), between ``MIN_SHARD_BYTES`` and ``shard_bytes``. Each
        shard uploads while the next is coded, so the last shard is all a publish waits
        for; a quarter keeps that wait to about a quarter of the upload."""
        if self._last_streams is None:
            return self.shard_bytes
        return max(
            min(self._last_streams // 4, self.shard_bytes), min(MIN_SHARD_BYTES, self.shard_bytes)
        )

    def _begin(self) -> Attempt:
        """The attempt of the next version; rank 0 picks its id and reads the reader records
        once, and every rank uses its answer (FORMAT.md §8.4)."""
        version = 0 if self._version is None else self._version + 1
        base = version == 0 or (self.base_every is not None and version % self.base_every == 0)
        mine = None
        if self.rank == 0:
            records = self.reader_records and not base
            mine = (self.ids(), read_reader_records(self.store) if records else ReaderWishes())
        attempt, wishes = self.coordinator.broadcast(mine, rank=self.rank)
        return Attempt(
            store=self.store,
            chain_id=self.chain.header.chain_id,
            version=version,
            kind="base" if base else "delta",
            id=attempt,
            rank=self.rank,
            world_size=self.world_size,
            shard_bytes=self._shard_limit(),
            zstd_level=self.zstd_level,
            overwrite=wishes.overwrite,
            reads_baseline=wishes.reads_baseline,
        )

    def _upload_manifest(self, manifest: Manifest, attempt: Attempt) -> tuple[bytes, Manifest]:
        """Upload this rank's manifest (compressed when the writer is allowed
        ``manifest-zstd``, a delta's parent fingerprints left to the parent's table when it
        is allowed ``implicit-parents``); returns its bytes as uploaded and the manifest
        they hold."""
        if IMPLICIT_PARENTS_FEATURE in self.features and manifest.kind == "delta":
            manifest = implicit_parents(manifest)
        if MANIFEST_ZSTD_FEATURE in self.features:
            features = tuple(sorted({*manifest.required_features, MANIFEST_ZSTD_FEATURE}))
            manifest = manifest.model_copy(update={"required_features": features})
        text = manifest.to_json()
        if len(text) > MAX_MANIFEST_BYTES:  # readers would refuse it (FORMAT.md Appendix C)
            self._abort(attempt.version, attempt.id)
            raise ObjectTooLargeError(
                f"the manifest of rank {self.rank} would be {len(text)} bytes, over the "
                f"{MAX_MANIFEST_BYTES}-byte limit readers enforce; publish with more writer ranks"
            )
        own = stored_manifest(manifest, text)  # compressed where it lists manifest-zstd
        # a manifest upload that fails may still have landed, so it must not mark the attempt
        # abandoned (the committer may commit it)
        self.store.put(manifest_key(attempt.version, attempt.id, self.rank), own)
        return own, manifest

    # --- commit -------------------------------------------------------------------------

    def _commit(
        self, attempt: Attempt, step: int | None, own: bytes, uploaded: Manifest
    ) -> tuple[LoadedRecord, dict[str, TensorState]]:
        """Wait for every rank's manifest, check them, and create the commit record
        (``own``: this rank's manifest as uploaded, ``uploaded`` the manifest it holds)."""
        version = attempt.version
        try:
            found = gather_manifests(
                attempt,
                own=own,
                timeout=self.commit_timeout,
                check=self._part.check_manifest,
                own_manifest=uploaded,
            )
            table = self._check_version([m for m, _ in found], attempt)
        except Exception:
            self._abort(version, attempt.id)
            raise
        record = self._record_for(attempt, step, found, table)
        data = record.to_json()
        if len(data) > MAX_RECORD_BYTES:  # readers would refuse it (FORMAT.md Appendix C)
            self._abort(version, attempt.id)
            raise ObjectTooLargeError(
                f"the commit record of version {version} would be {len(data)} bytes, over the "
                f"{MAX_RECORD_BYTES}-byte limit readers enforce; publish with fewer writer ranks"
            )
        create_commit(self.store, version, data)
        return LoadedRecord(record, sha256_hex(data), len(data)), table

    def _check_version(self, manifests: list[Manifest], attempt: Attempt) -> dict[str, TensorState]:
        """The version's state table; a delta's pieces must add up to the parent's tensors
        and a delta must not drop a tensor."""
        changes = tensor_changes(manifests)  # pieces combined (FORMAT.md §4.8)
        table = state_table(manifests)
        if attempt.kind == "delta":
            version = attempt.version
            self._check_parent(changes, version)
            dropped = sorted(set(self._table) - set(table))
            if dropped:
                raise MissingTensorError(
                    f"version {version} lacks {len(dropped)} tensors of version {version - 1} "
                    f"(first: {dropped[0]!r}); publish every tensor or write a base"
                )
        return table

    def _check_parent(self, changes: dict[str, TensorChange], version: int) -> None:
        """Pieces of a tensor must add up to the parent's fingerprint (their lanes sum over
        regions: a gap or an overlap between the ranks' regions shows here)."""
        for name, change in changes.items():
            if not change.pieces or change.full:
                continue
            row = self._table.get(name)
            if row is None or row.fingerprint != change.parent_fingerprint:
                raise ChainBrokenError(
                    f"the pieces of {name!r} do not add up to version {version - 1}'s tensor: "
                    "the writer ranks' layouts overlap or leave a gap"
                )

    def _record_for(
        self,
        attempt: Attempt,
        step: int | None,
        found: list[tuple[Manifest, ManifestRef]],
        table: dict[str, TensorState],
    ) -> CommitRecord:
        """The commit record of the attempt, naming every rank's manifest."""
        manifests = [m for m, _ in found]
        stats = Stats(
            tensors=len(table),
            total_elements=sum(_numel(t.shape) for t in table.values()),
            changed_elements=sum(e.changed for m in manifests for e in m.entries),
            payload_bytes=sum(s.size for m in manifests for s in m.shards)
            + sum(ref.size for _, ref in found),
            dense_bytes=sum(_numel(t.shape) * info_for(t.dtype).width for t in table.values()),
        )
        version = attempt.version
        return CommitRecord(
            required_features=tuple(sorted({f for m in manifests for f in m.required_features})),
            chain_id=attempt.chain_id,
            version=version,
            kind=attempt.kind,
            parent=None if version == 0 else version - 1,
            parent_sha256=None if self._record is None else self._record.sha256,
            step=step,
            created=timestamp(self.clock()),
            attempt=attempt.id,
            world_size=self.world_size,
            manifests=tuple(ref for _, ref in found),
            state_fingerprint=table_fingerprint(table),
            stats=stats,
        )

    def _abort(self, version: int, attempt: str) -> None:
        abort(self.store, version, attempt)

    def _advance(
        self, written: Written, loaded: LoadedRecord, table: dict[str, TensorState]
    ) -> None:
        """The commit exists: bring the baseline to the committed bits."""
        written.advance()
        self._record = loaded
        self._version = loaded.record.version
        if self.rank == 0:
            self._table = table


def _check_options(
    rank: int,
    world_size: int,
    base_every: int | None,
    coordinator: Coordinator | None,
    ops: Mapping[str, str] | None,
) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ArgumentError(f"rank {rank} is not in [0, world_size={world_size})")
    if base_every is not None and base_every < 1:
        raise ArgumentError("base_every must be a positive number of versions")
    if world_size > 1 and coordinator is None:
        raise ArgumentError(
            "world_size > 1 needs a coordinator (ThreadCoordinator, TorchDistributedCoordinator)"
        )
    for name, op in (ops or {}).items():
        if op not in OPS:
            raise ArgumentError(f"op {op!r} for {name!r} is not one of {', '.join(OPS)}")


# --- the canonical part ---------------------------------------------------------------------

_Item = tuple[str, torch.Tensor, "torch.Tensor | None"]  # name, new tensor, baseline


@dataclass(frozen=True)
class _Pending:
    """One tensor's change, held until the commit is known to exist."""

    delta: DecodedDelta | None  # None: no bits changed
    fingerprint: str
    lanes: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    rows: np.ndarray | None = None  # exponent rows of the new bits, where they were counted


class CanonicalPart:
    """A writer rank's part of canonical tensors: those this rank owns (:func:`owner`)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        ops: Mapping[str, str],
        cache: _BaselineCache | None,
        features: frozenset[str] = frozenset(),
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.device, self.ops, self.cache = device, ops, cache
        self.features = features  # codec features its entries may use (values-rans)
        self._baseline: dict[str, torch.Tensor] = {}
        self._fingerprints: dict[str, str] = {}
        self._lanes: dict[str, tuple[int, ...]] = {}  # fingerprint lanes of the baseline
        # exponent rows of the baseline (host tensors the writer considered classed
        # positions for), so that the next step need not count them again
        self._rows: dict[str, np.ndarray] = {}

    @property
    def baseline(self) -> Mapping[str, torch.Tensor]:
        """The owned tensors' exact bits at the last commit."""
        return self._baseline

    def owns(self, name: str) -> bool:
        """Whether this rank publishes ``name``."""
        return owner(name, self.world_size) == self.rank

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
        target = self._from_cache(chain, version, owned)
        if target is None:
            target = StateDictTarget({})
            DeltaReader(chain.store, target, select=self.owns).sync(to=version)
        self._baseline = {n: t.to(self.device) for n, t in target.tensors.items()}
        self._fingerprints = {n: s.fingerprint for n, s in owned.items()}
        self._rows = {}

    def _from_cache(
        self, chain: Chain, version: int, owned: dict[str, TensorState]
    ) -> StateDictTarget | None:
        """The cached baseline brought to ``version`` and checked, or None."""
        if self.cache is None:
            return None
        target = self.cache.load(chain.header.chain_id)
        if target is None:
            return None
        try:
            synced = DeltaReader(chain.store, target, select=self.owns, verify="all").sync(
                to=version
            )
        except (IntegrityError, TargetError):
            return None  # a stale or damaged cache: replay from the store instead
        if set(target.tensors) != set(owned):
            return None
        # a cache already at `version` was not checked by the sync (nothing to apply)
        if not synced.applied_versions and any(
            _cached_fingerprint(t) != owned[n].fingerprint for n, t in target.tensors.items()
        ):
            return None
        return target

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
            features = self.features
            if not attempt.reads_baseline:  # a reader cannot decode codings against old bits
                features -= BASELINE_FEATURES
            rows = self._rows.get if POSITIONS_CLASSED_FEATURE in features else None
            coded = encode_stream(
                items,
                advanced,
                None if rows is None else lambda i: rows(i[0]),
                options=EncodeOptions.allowing(features),
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
                )
            missing = sorted(set(self._baseline) - set(pending))
            if missing and not attempt.base:
                raise MissingTensorError(
                    f"{len(missing)} tensors of version {attempt.version - 1} were not given "
                    f"(first: {missing[0]!r}); pass every tensor each step"
                )
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
            tensor = tensor.detach()
            info_for(tensor.dtype)  # refuses dtypes the format cannot carry
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
        self._rows = {n: change.rows for n, change in pending.items() if change.rows is not None}
        if self.cache is None:
            return
        try:
            self.cache.save(attempt.chain_id, attempt.version, self._baseline, self._fingerprints)
        except Exception as exc:  # the version is committed: the cache is only an optimisation
            self.cache.drop(attempt.chain_id)
            _log.warning(
                "version %d is committed, but the baseline cache in %s could not be written "
                "(%s); a restarted writer will rebuild its baseline from the store",
                attempt.version,
                self.cache.root,
                exc,
            )


class _BaselineCache:
    """A rank's baseline on local disk (safetensors plus a JSON of version and fingerprints),
    so a restarted writer need not replay the chain."""

    def __init__(self, root: Path, rank: int, world_size: int) -> None:
        self.root, self.rank, self.world_size = root, rank, world_size

    def _paths(self, chain_id: str) -> tuple[Path, Path]:
        folder = self.root / chain_id / f"rank-{self.rank:05d}-of-{self.world_size:05d}"
        return folder / "baseline.safetensors", folder / "baseline.json"

    def save(
        self,
        chain_id: str,
        version: int,
        baseline: Mapping[str, torch.Tensor],
        fingerprints: Mapping[str, str],
    ) -> None:
        """Replace the cache (the tensors first, the JSON naming their version last)."""
        from safetensors.torch import save_file

        tensor_path, meta_path = self._paths(chain_id)
        tensor_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tensor_path.with_suffix(".tmp")
        save_file({n: t.detach().cpu().contiguous() for n, t in baseline.items()}, str(tmp))
        os.replace(tmp, tensor_path)
        meta = {"version": version, "fingerprints": dict(fingerprints)}
        tmp_meta = meta_path.with_suffix(".tmp")
        tmp_meta.write_text(json.dumps(meta))
        os.replace(tmp_meta, meta_path)

    def drop(self, chain_id: str) -> None:
        """Remove a cache that may be half written (best effort: a miss costs a replay)."""
        for path in self._paths(chain_id):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    def load(self, chain_id: str) -> StateDictTarget | None:
        """A StateDictTarget at the cached version, or None when the cache is absent or
        unreadable (the caller checks it against the chain)."""
        tensor_path, meta_path = self._paths(chain_id)
        if not tensor_path.exists() or not meta_path.exists():
            return None
        try:
            from safetensors.torch import load_file

            meta = json.loads(meta_path.read_text())
            tensors = load_file(str(tensor_path))
            version = int(meta["version"])
        except Exception:
            return None  # an unreadable cache is just a miss
        return StateDictTarget(tensors, version=version, chain_id=chain_id)


def _cached_fingerprint(tensor: torch.Tensor) -> str | None:
    """Fingerprint of a tensor loaded from the cache (None for a dtype the format lacks)."""
    try:
        return tensor_fingerprint(tensor)
    except UnsupportedDtypeError:
        return None


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
