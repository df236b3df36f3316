"""The trainer side: diff against the baseline, publish shards and a manifest, commit jointly."""

from __future__ import annotations

import json
import logging
import os
import re
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from dcr_format.chain import (
    HEAD_KEY,
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    Chain,
    LoadedRecord,
    TensorChange,
    TensorState,
    attempt_prefix,
    check_manifest,
    commit_key,
    manifest_key,
    new_id,
    sha256_hex,
    shard_key,
    state_table,
    table_fingerprint,
    tensor_changes,
    timestamp,
    utc_now,
)
from dcr_format.codec.delta import (
    FULL,
    OPS,
    OVERWRITE,
    DecodedDelta,
    EncodedTensor,
    apply_delta,
)
from dcr_format.codec.dtypes import bits_view, info_for
from dcr_format.codec.shard import ZSTD_LEVEL, encode_shard
from dcr_format.cuda.pipeline import encode_stream
from dcr_format.errors import (
    ArgumentError,
    CapabilityError,
    ChainBrokenError,
    CommitConflictError,
    CommitStateUnknownError,
    FormatError,
    IncompleteVersionError,
    IntegrityError,
    MissingTensorError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreError,
    TargetError,
    UnsupportedDtypeError,
)
from dcr_format.fingerprint import (
    apply_lane_deltas,
    fingerprint_from_lanes,
    lanes_after_change,
    tensor_fingerprint,
    tensor_lanes,
)
from dcr_format.schema import (
    CommitRecord,
    Entry,
    Manifest,
    ManifestRef,
    PositionsRef,
    ReaderRecord,
    ShardRef,
    Stats,
    ValuesRef,
    check_tensor_name,
    parse,
)
from dcr_format.store import Store, open_store
from dcr_format.writers.coordinate import Coordinator, SoloCoordinator

ABORT_MARKER = "ABORTED"
READERS_PREFIX = "readers/"
_READER_KEY = re.compile(r"^readers/([A-Za-z0-9._-]{1,128})\.json$")
MAX_READER_RECORD_BYTES = 64 << 20
DEFAULT_SHARD_BYTES = 256 << 20
_log = logging.getLogger(__name__)


def owner(name: str, world_size: int) -> int:
    """The writer rank that publishes canonical tensor ``name``: crc32(UTF-8 name) mod W."""
    return zlib.crc32(name.encode()) % world_size


class CommitInfo(BaseModel):
    """What one publish committed (the whole version, across every writer rank)."""

    model_config = ConfigDict(frozen=True)

    version: int
    kind: str
    step: int | None
    attempt: str
    created: str
    tensors: int
    changed_elements: int
    total_elements: int
    payload_bytes: int
    dense_bytes: int
    state_fingerprint: str

    @property
    def change_rate(self) -> float:
        """Changed elements over total elements."""
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    @property
    def ratio(self) -> float:
        """Payload bytes over dense bytes."""
        return self.payload_bytes / self.dense_bytes if self.dense_bytes else 0.0

    @classmethod
    def from_record(cls, record: CommitRecord) -> CommitInfo:
        """Summarise a commit record."""
        s = record.stats
        return cls(
            version=record.version,
            kind=record.kind,
            step=record.step,
            attempt=record.attempt,
            created=record.created,
            tensors=s.tensors,
            changed_elements=s.changed_elements,
            total_elements=s.total_elements,
            payload_bytes=s.payload_bytes,
            dense_bytes=s.dense_bytes,
            state_fingerprint=record.state_fingerprint,
        )


def _pairs(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tensors, Mapping):
        yield from tensors.items()
    else:
        yield from tensors


_Item = tuple[str, torch.Tensor, "torch.Tensor | None"]  # name, new tensor, baseline


@dataclass(frozen=True)
class _Pending:
    """One tensor's change, held until the commit is known to exist."""

    delta: DecodedDelta | None  # None: no bits changed
    fingerprint: str
    lanes: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]


class _ShardWriter:
    """Collects entry streams into shards of bounded size; each full shard is compressed and
    uploaded on a background thread while the writer encodes the next tensors.

    At most one shard is in flight (the next one waits for it), so memory stays at about two
    shards. :meth:`finish` uploads the last one and re-raises any upload failure.
    """

    def __init__(
        self, store: Store, version: int, attempt: str, rank: int, limit: int, level: int
    ) -> None:
        self.store, self.version, self.attempt, self.rank = store, version, attempt, rank
        self.limit, self.level = limit, level
        self.shards: list[ShardRef] = []
        self._streams: dict[str, bytes] = {}
        self._bytes = 0
        self._count = 0  # shards started (uploaded or in flight)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcr-upload")
        self._inflight: Future[ShardRef] | None = None

    def add(self, key: str, data: bytes) -> int:
        """Queue a stream; returns the index of the shard it lands in."""
        self._streams[key] = data
        self._bytes += len(data)
        return self._count

    def maybe_flush(self) -> None:
        """Start uploading the current shard once it reached the size limit."""
        if self._bytes >= self.limit:
            self._start_upload()

    def _start_upload(self) -> None:
        """Start uploading the current shard, if it holds any stream."""
        if not self._streams:
            return
        self._collect()
        streams, index = self._streams, self._count
        self._streams, self._bytes = {}, 0
        self._count += 1
        self._inflight = self._pool.submit(self._upload, streams, index)

    def _upload(self, streams: dict[str, bytes], index: int) -> ShardRef:
        stored, decoded = encode_shard(streams, level=self.level)
        key = shard_key(self.version, self.attempt, self.rank, index)
        self.store.put(key, stored)
        return ShardRef(path=key, sha256=sha256_hex(stored), size=len(stored), decoded_size=decoded)

    def _collect(self) -> None:
        """Wait for the shard in flight (its failure is raised here)."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self.shards.append(inflight.result())

    def finish(self) -> None:
        """Upload what is left and wait for every upload; the caller then calls close()."""
        self._start_upload()
        self._collect()

    def close(self) -> None:
        """Stop the upload thread (after waiting for a shard in flight)."""
        self._pool.shutdown(wait=True)


class DeltaWriter:
    """Publishes every training step of one writer rank as a version of the chain.

    ``tensors`` given to :meth:`publish` are canonical (Hugging Face) tensors; this
    rank encodes those it owns (see :func:`owner`) and ignores the rest, so a rank
    may be handed everything or only its own. The baseline (exact bits of the last
    committed version of the owned tensors) lives on ``baseline_device`` and
    advances only once the commit record is known to exist.

    With ``reader_records`` (default), rank 0 reads the reader records
    (``readers/*.json``) at every delta publish and every rank sends the tensors
    they name as ``overwrite`` (readers whose load path casts or scales them).
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
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ArgumentError(f"rank {rank} is not in [0, world_size={world_size})")
        if base_every is not None and base_every < 1:
            raise ArgumentError("base_every must be a positive number of versions")
        if world_size > 1 and coordinator is None:
            raise ArgumentError(
                "world_size > 1 needs a coordinator "
                "(ThreadCoordinator, TorchDistributedCoordinator)"
            )
        for name, op in (ops or {}).items():
            if op not in OPS:
                raise ArgumentError(f"op {op!r} for {name!r} is not one of {', '.join(OPS)}")
        self.store = open_store(store)
        self.chain = Chain(self.store)
        self.rank, self.world_size = rank, world_size
        self.base_every = base_every
        self.coordinator = coordinator or SoloCoordinator()
        self.ops = dict(ops or {})
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.baseline_device = torch.device(baseline_device)
        self.shard_bytes, self.zstd_level = shard_bytes, zstd_level
        self.commit_timeout = commit_timeout
        self.clock, self.ids = clock, ids
        self.reader_records = reader_records
        self._reader_overwrite: frozenset[str] = frozenset()  # from readers/*.json (§3.6)
        self._opened = False
        self._version: int | None = None
        self._record: LoadedRecord | None = None
        self._baseline: dict[str, torch.Tensor] = {}
        self._fingerprints: dict[str, str] = {}
        self._lanes: dict[str, tuple[int, ...]] = {}  # fingerprint lanes of the baseline
        self._table: dict[str, TensorState] = {}  # committer: full table of the baseline version
        # seconds of the last publish by stage: diff, coding and shard uploads; manifest and
        # commit (waiting for every rank); baseline advance and cache
        self.timings: dict[str, float] = {}

    # --- state ----------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The committed version the baseline holds (None before the first publish)."""
        self._open()
        return self._version

    @property
    def baseline(self) -> Mapping[str, torch.Tensor]:
        """The owned tensors' exact bits at :attr:`version` (read-only by convention)."""
        self._open()
        return self._baseline

    def owns(self, name: str) -> bool:
        """Whether this rank publishes ``name``."""
        return owner(name, self.world_size) == self.rank

    def _open(self) -> None:
        if self._opened:
            return
        # Refuse before writing anything where create-if-absent is not atomic (probes S3).
        capabilities = self.store.capabilities
        if not capabilities.atomic_create and not self.store.single_writer:
            raise CapabilityError(
                f"cannot publish to {self.store.url}: conditional writes are not honoured by "
                "this server, so two writers could both commit one version; pass "
                "single_writer=True (one writer only): DeltaWriter(Store(url, single_writer=True))"
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
        """Continue an existing chain: baseline from the local cache if valid, else the store."""
        from dcr_format.readers.reader import DeltaReader
        from dcr_format.readers.targets import StateDictTarget

        self._record = self.chain.record(latest)
        manifests = self.chain.manifests(self._record)
        table = state_table(manifests)
        owned = {n: s for n, s in table.items() if self.owns(n)}
        target = self._load_cache()
        if target is not None:
            try:
                synced = DeltaReader(self.store, target, select=self.owns, verify="all").sync(
                    to=latest
                )
            except (IntegrityError, TargetError):
                target = None  # a stale or damaged cache: replay from the store instead
            else:
                # a cache already at `latest` was not checked by the sync (nothing to apply)
                if set(target.tensors) != set(owned) or (
                    not synced.applied_versions
                    and any(
                        _cached_fingerprint(t) != owned[n].fingerprint
                        for n, t in target.tensors.items()
                    )
                ):
                    target = None
        if target is None:
            target = StateDictTarget({})
            DeltaReader(self.store, target, select=self.owns).sync(to=latest)
        self._baseline = {n: t.to(self.baseline_device) for n, t in target.tensors.items()}
        self._table = table
        self._fingerprints = {n: s.fingerprint for n, s in table.items() if self.owns(n)}
        self._version = latest

    # --- publish ----------------------------------------------------------------------

    def publish(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        step: int | None = None,
    ) -> CommitInfo:
        """Publish the next version from canonical ``tensors`` and commit it with every rank.

        Raises :class:`CommitConflictError` if another writer committed this version first
        (the baseline is unchanged), :class:`IncompleteVersionError` if a rank did not
        deliver, and :class:`CommitStateUnknownError` if the commit's outcome is unknown.
        """
        self._open()
        version = 0 if self._version is None else self._version + 1
        base = version == 0 or (self.base_every is not None and version % self.base_every == 0)
        kind = "base" if base else "delta"
        # rank 0 reads the reader records once and every rank uses its answer (FORMAT.md §8.4)
        attempt, overwrite = self.coordinator.broadcast(
            (self.ids(), self._read_reader_records() if not base else frozenset())
            if self.rank == 0
            else None,
            rank=self.rank,
        )
        self._reader_overwrite = frozenset(overwrite)
        clock = time.perf_counter
        started = clock()
        try:
            pending, manifest = self._write_part(tensors, version, kind, attempt)
        except BaseException:
            self._abort(version, attempt)  # no manifest of ours exists: the attempt cannot commit
            raise
        encoded = clock()
        own = manifest.to_json()
        if len(own) > MAX_MANIFEST_BYTES:  # readers would refuse it (FORMAT.md Appendix C)
            self._abort(version, attempt)
            raise ObjectTooLargeError(
                f"the manifest of rank {self.rank} would be {len(own)} bytes, over the "
                f"{MAX_MANIFEST_BYTES}-byte limit readers enforce; publish with more writer ranks"
            )
        # not inside the try: a manifest upload that fails may still have landed, so it must
        # not mark the attempt abandoned (the committer may commit it)
        self.store.put(manifest_key(version, attempt, self.rank), own)
        if self.rank == 0:
            loaded, table = self._commit(version, kind, attempt, step, own)
        else:
            loaded, table = self._await_commit(version, attempt), {}
        committed = clock()
        self._advance(pending, loaded, table, base)
        self.timings = {
            "encode_upload_s": encoded - started,
            "commit_s": committed - encoded,
            "advance_s": clock() - committed,
        }
        return CommitInfo.from_record(loaded.record)

    def _write_part(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        kind: str,
        attempt: str,
    ) -> tuple[dict[str, _Pending], Manifest]:
        """Encode this rank's tensors and upload its shards; returns its manifest to upload."""
        base = kind == "base"
        shards = _ShardWriter(
            self.store, version, attempt, self.rank, self.shard_bytes, self.zstd_level
        )
        entries: list[Entry] = []
        pending: dict[str, _Pending] = {}
        seen: set[str] = set()

        def owned() -> Iterator[tuple[_Item, torch.Tensor, torch.Tensor | None, str | None]]:
            for name, tensor in _pairs(tensors):
                check_tensor_name(name)  # on every rank: a reserved name fails the whole version
                if not self.owns(name):
                    continue
                if name in seen:
                    raise ArgumentError(f"tensor {name!r} was given twice in one publish")
                seen.add(name)
                tensor = tensor.detach()
                info_for(tensor.dtype)  # refuses dtypes the format cannot carry
                old = self._baseline.get(name)
                op = FULL if base else self._op_for(name, tensor, old)
                yield (name, tensor, old), tensor, old, op

        try:
            # on CUDA the scan of the next tensor overlaps the copy-out and coding of this one;
            # a full shard uploads on a background thread while the next tensors are coded
            for (name, tensor, old), encoded in encode_stream(owned()):
                lanes = self._lanes_after(name, tensor, old, encoded)
                fingerprint = fingerprint_from_lanes(tensor.dtype, tensor.shape, lanes)
                entries.append(
                    self._entry(name, tensor, encoded, fingerprint, len(entries), shards)
                )
                shards.maybe_flush()
                pending[name] = _Pending(
                    encoded.advance, fingerprint, lanes, tensor.dtype, tuple(tensor.shape)
                )
            missing = sorted(set(self._baseline) - set(pending))
            if missing and not base:
                raise MissingTensorError(
                    f"{len(missing)} tensors of version {self._version} were not given "
                    f"(first: {missing[0]!r}); pass every tensor each step"
                )
            shards.finish()
        finally:
            shards.close()
        manifest = Manifest(
            chain_id=self.chain.header.chain_id,
            version=version,
            kind=kind,
            attempt=attempt,
            rank=self.rank,
            world_size=self.world_size,
            shards=tuple(shards.shards),
            entries=tuple(entries),
        )
        return pending, manifest

    def _lanes_after(
        self, name: str, tensor: torch.Tensor, old: torch.Tensor | None, encoded: EncodedTensor
    ) -> tuple[int, ...]:
        """Fingerprint lanes of the new tensor: updated from the change alone when possible."""
        delta = encoded.advance
        if old is None or (delta is not None and delta.op == FULL):
            return tensor_lanes(tensor)
        base = self._lanes.get(name)
        if base is None:
            base = self._lanes[name] = tensor_lanes(old)
        if delta is None:  # no bit changed
            return base
        if encoded.lane_deltas is not None:  # the diff's own pass summed them
            return apply_lane_deltas(base, encoded.lane_deltas)
        assert delta.positions is not None
        old_bits = bits_view(old).reshape(-1)[delta.positions]
        return lanes_after_change(base, delta.positions, old_bits, delta.values)

    def _entry(
        self,
        name: str,
        tensor: torch.Tensor,
        encoded: EncodedTensor,
        fingerprint: str,
        index: int,
        shards: _ShardWriter,
    ) -> Entry:
        positions = values = None
        if encoded.positions is not None:
            key = f"{index}.p"
            positions = PositionsRef(
                shard=shards.add(key, encoded.positions), key=key, coding=encoded.positions_coding
            )
        if encoded.values is not None:
            key = f"{index}.v"
            values = ValuesRef(
                shard=shards.add(key, encoded.values), key=key, coding=encoded.values_coding
            )
        return Entry(
            name=name,
            dtype=info_for(tensor.dtype).name,
            shape=tuple(tensor.shape),
            op=encoded.op,
            changed=encoded.changed,
            positions=positions,
            values=values,
            encoded_bytes=encoded.nbytes,
            fingerprint=fingerprint,
            parent_fingerprint=self._fingerprints.get(name) if encoded.op != FULL else None,
        )

    # --- commit -------------------------------------------------------------------------

    def _wait(self, ready: Callable[[], object | None], what: str) -> object:
        deadline = time.monotonic() + self.commit_timeout
        delay = 0.002
        while True:
            result = ready()
            if result is not None:
                return result
            if time.monotonic() >= deadline:
                raise IncompleteVersionError(
                    f"timed out after {self.commit_timeout:.0f} s waiting for {what}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _commit(
        self, version: int, kind: str, attempt: str, step: int | None, own: bytes
    ) -> tuple[LoadedRecord, dict[str, TensorState]]:
        """Wait for every rank's manifest, check them, and create the commit record.

        ``own``: the bytes of this rank's manifest as uploaded. A manifest read back is
        what the record's sha256 will name, so bytes altered in transit (an S3 ranged GET
        carries no checksum) must not be taken: ours must equal ``own``, another rank's
        must read the same twice; otherwise it is read again.
        """
        header = self.chain.header
        found: dict[int, tuple[Manifest, ManifestRef]] = {}

        marker = attempt_prefix(version, attempt) + ABORT_MARKER

        def all_manifests() -> bool | None:
            for rank in range(self.world_size):
                if rank in found:
                    continue
                key = manifest_key(version, attempt, rank)
                try:
                    data = self.store.get(key, max_size=MAX_MANIFEST_BYTES)
                    if data != (
                        own
                        if rank == self.rank
                        else self.store.get(key, max_size=MAX_MANIFEST_BYTES)
                    ):
                        return None  # altered in transit: read it again
                except ObjectNotFoundError:
                    if self.store.exists(marker):
                        raise IncompleteVersionError(
                            f"a writer rank abandoned version {version} before its manifest; "
                            "see that rank's error, then publish again"
                        ) from None
                    return None
                manifest = parse(Manifest, data, what=key)
                check_manifest(
                    manifest, header.chain_id, version, kind, attempt, rank, self.world_size, key
                )
                self._check_owners(manifest, rank, key)
                ref = ManifestRef(rank=rank, path=key, sha256=sha256_hex(data), size=len(data))
                found[rank] = (manifest, ref)
            return True

        try:
            self._wait(all_manifests, f"all {self.world_size} manifests of version {version}")
        except Exception:
            self._abort(version, attempt)
            raise
        manifests = [found[r][0] for r in range(self.world_size)]
        try:
            changes = tensor_changes(manifests)  # pieces combined (FORMAT.md §4.8)
            table = state_table(manifests)
            if kind == "delta":
                self._check_parent(changes, version)
        except Exception:
            self._abort(version, attempt)
            raise
        if kind == "delta":
            dropped = sorted(set(self._table) - set(table))
            if dropped:
                self._abort(version, attempt)
                raise MissingTensorError(
                    f"version {version} lacks {len(dropped)} tensors of version {version - 1} "
                    f"(first: {dropped[0]!r}); publish every tensor or write a base"
                )
        entries = [e for m in manifests for e in m.entries]
        stats = Stats(
            tensors=len(table),
            total_elements=sum(_numel(t.shape) for t in table.values()),
            changed_elements=sum(e.changed for e in entries),
            payload_bytes=sum(s.size for m in manifests for s in m.shards)
            + sum(found[r][1].size for r in found),
            dense_bytes=sum(_numel(t.shape) * info_for(t.dtype).width for t in table.values()),
        )
        features = sorted({f for m in manifests for f in m.required_features})
        record = CommitRecord(
            required_features=tuple(features),
            chain_id=header.chain_id,
            version=version,
            kind=kind,
            parent=None if version == 0 else version - 1,
            parent_sha256=None if self._record is None else self._record.sha256,
            step=step,
            created=timestamp(self.clock()),
            attempt=attempt,
            world_size=self.world_size,
            manifests=tuple(found[r][1] for r in range(self.world_size)),
            state_fingerprint=table_fingerprint(table),
            stats=stats,
        )
        data = record.to_json()
        if len(data) > MAX_RECORD_BYTES:  # readers would refuse it (FORMAT.md Appendix C)
            self._abort(version, attempt)
            raise ObjectTooLargeError(
                f"the commit record of version {version} would be {len(data)} bytes, over the "
                f"{MAX_RECORD_BYTES}-byte limit readers enforce; publish with fewer writer ranks"
            )
        self._create_commit(version, data)
        try:
            self.store.put(HEAD_KEY, str(version).encode())
        except StoreError:
            pass  # HEAD is only a hint
        return LoadedRecord(record, sha256_hex(data), len(data)), table

    def _check_owners(self, manifest: Manifest, rank: int, key: str) -> None:
        """Whole tensors come from their owner rank (FORMAT.md §4.6); pieces follow the
        writers' layout and are checked when combined (§4.8)."""
        for entry in manifest.entries:
            if entry.piece is None and owner(entry.name, self.world_size) != rank:
                raise IncompleteVersionError(f"{key} lists {entry.name!r}, owned by another rank")

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

    def _op_for(self, name: str, tensor: torch.Tensor, old: torch.Tensor | None) -> str | None:
        """The op of a delta entry: configured, else overwrite where a reader asked for it
        (and a comparable baseline exists), else chosen by size."""
        op = self.ops.get(name)
        if op is None and name in self._reader_overwrite:
            if old is not None and old.dtype == tensor.dtype and old.shape == tensor.shape:
                return OVERWRITE
        return op

    def _read_reader_records(self) -> frozenset[str]:
        """Union of the ``overwrite`` lists of every reader record (FORMAT.md §3.6).

        Read by rank 0 at every delta publish (one listing plus one small get per record),
        so a reader's record is honoured from the next version on. A record that cannot be
        read or does not validate is skipped: records are requests, never requirements.
        """
        if not self.reader_records:
            return frozenset()
        try:
            keys = self.store.list(READERS_PREFIX)
        except StoreError:
            return frozenset()
        names: set[str] = set()
        for key in keys:
            match = _READER_KEY.match(key)
            if match is None:
                continue
            try:
                data = self.store.get(key, max_size=MAX_READER_RECORD_BYTES)
                record = parse(ReaderRecord, data, what=key)
            except (StoreError, FormatError):
                continue
            if record.reader_id == match.group(1):
                names.update(record.overwrite)
        return frozenset(names)

    def _create_commit(self, version: int, data: bytes) -> None:
        key = commit_key(version)
        for _ in range(2):
            try:
                self.store.put_if_absent(key, data)
                return
            except ObjectExistsError:
                break
            except StoreError:
                continue  # outcome unknown: re-read below
        try:
            landed = self.store.get(key, max_size=MAX_RECORD_BYTES)
        except ObjectNotFoundError:
            raise CommitStateUnknownError(
                f"could not create {key} and cannot tell whether it landed; keep this attempt's "
                "objects and retry the publish later"
            ) from None
        except StoreError as exc:
            raise CommitStateUnknownError(
                f"could not create or re-read {key} ({exc}); keep this attempt's objects"
            ) from None
        if landed != data:
            raise CommitConflictError(
                f"version {version} was committed by another writer; reopen the writer to "
                "continue from the chain's newest version"
            )

    def _abort(self, version: int, attempt: str) -> None:
        try:
            self.store.put(attempt_prefix(version, attempt) + ABORT_MARKER, b"")
        except StoreError:
            pass

    def _await_commit(self, version: int, attempt: str) -> LoadedRecord:
        marker = attempt_prefix(version, attempt) + ABORT_MARKER

        def outcome() -> LoadedRecord | None:
            if self.store.exists(commit_key(version)):
                return self.chain.record(version)
            if self.store.exists(marker):
                raise IncompleteVersionError(
                    f"the committer abandoned version {version}; see rank 0's error"
                )
            return None

        loaded = self._wait(outcome, f"the commit record of version {version}")
        assert isinstance(loaded, LoadedRecord)
        if loaded.record.attempt != attempt:
            raise CommitConflictError(
                f"version {version} was committed by another writer; reopen the writer"
            )
        return loaded

    def _advance(
        self,
        pending: dict[str, _Pending],
        loaded: LoadedRecord,
        table: dict[str, TensorState],
        base: bool,
    ) -> None:
        """The commit exists: bring the baseline to the committed bits."""
        for name in set(self._baseline) - set(pending):
            del self._baseline[name]  # only a base may drop tensors (checked before)
        for name, change in pending.items():
            delta = change.delta
            if delta is not None:
                if delta.op == FULL:
                    self._baseline[name] = (
                        delta.values.to(self.baseline_device, copy=True)
                        .view(change.dtype)
                        .reshape(change.shape)
                    )
                else:
                    apply_delta(self._baseline[name], delta)
        self._fingerprints = {name: change.fingerprint for name, change in pending.items()}
        self._lanes = {name: change.lanes for name, change in pending.items()}
        self._record = loaded
        self._version = loaded.record.version
        if self.rank == 0:
            self._table = table
        try:
            self._save_cache()
        except Exception as exc:  # the version is committed: the cache is only an optimisation
            self._drop_cache()
            _log.warning(
                "version %d is committed, but the baseline cache in %s could not be written "
                "(%s); a restarted writer will rebuild its baseline from the store",
                self._version,
                self.cache_dir,
                exc,
            )

    # --- local cache ---------------------------------------------------------------------

    def _cache_paths(self) -> tuple[Path, Path] | None:
        if self.cache_dir is None:
            return None
        chain_id = self.chain.header.chain_id
        folder = self.cache_dir / chain_id / f"rank-{self.rank:05d}-of-{self.world_size:05d}"
        return folder / "baseline.safetensors", folder / "baseline.json"

    def _save_cache(self) -> None:
        paths = self._cache_paths()
        if paths is None or self._version is None:
            return
        from safetensors.torch import save_file

        tensor_path, meta_path = paths
        tensor_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tensor_path.with_suffix(".tmp")
        save_file({n: t.detach().cpu().contiguous() for n, t in self._baseline.items()}, str(tmp))
        os.replace(tmp, tensor_path)
        meta = {"version": self._version, "fingerprints": self._fingerprints}
        tmp_meta = meta_path.with_suffix(".tmp")
        tmp_meta.write_text(json.dumps(meta))
        os.replace(tmp_meta, meta_path)

    def _drop_cache(self) -> None:
        """Remove a cache that may be half written (best effort: a miss costs a replay)."""
        paths = self._cache_paths()
        for path in paths or ():
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    def _load_cache(self):  # type: ignore[no-untyped-def]
        """A StateDictTarget at the cached version, or None when the cache is absent or stale."""
        from dcr_format.readers.targets import StateDictTarget

        paths = self._cache_paths()
        if paths is None or not paths[0].exists() or not paths[1].exists():
            return None
        try:
            from safetensors.torch import load_file

            meta = json.loads(paths[1].read_text())
            tensors = load_file(str(paths[0]))
            version = int(meta["version"])
        except Exception:
            return None  # an unreadable cache is just a miss
        return StateDictTarget(tensors, version=version, chain_id=self.chain.header.chain_id)


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
