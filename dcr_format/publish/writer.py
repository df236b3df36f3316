"""The trainer side: diff against the baseline, publish shards and a manifest, commit jointly.

:class:`DeltaWriter` runs a publish: rank 0 picks the attempt id and reads the reader
records, every rank writes its part (shards and manifest), rank 0 commits
(``publish/_commit.py``) and every rank then advances its baseline. What a rank's part
is comes from the part it is given: canonical tensors owned by name (the default,
``publish/_canonical.py``), DTensors (``publish/_sharded.py``) or local tensors placed by
a :class:`~dcr_format.chain.layout.Layout` (``layout=``, ``publish/_projection.py``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from pathlib import Path

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
from dcr_format.delta.delta import FULL, OPS
from dcr_format.errors import (
    ArgumentError,
    ChainBrokenError,
    CommitError,
    DcrError,
    MissingTensorError,
    ObjectTooLargeError,
    UnchangedVersionError,
)
from dcr_format.format.dtypes import info_for
from dcr_format.format.features import (
    BASELINE_FEATURES,
    CHECKPOINT_FILES_FEATURE,
    IMPLICIT_PARENTS_FEATURE,
    MANIFEST_ZSTD_FEATURE,
    VALUES_ULP_FEATURE,
    WRITER_FEATURES,
    writer_features,
)
from dcr_format.format.schema import (
    CheckpointFile,
    CommitRecord,
    Manifest,
    ManifestRef,
    Stats,
    implicit_parents,
    stored_manifest,
)
from dcr_format.format.shard import ZSTD_LEVEL, ZSTD_MAX_LEVEL, ZSTD_MIN_LEVEL
from dcr_format.publish._cache import BaselineCache
from dcr_format.publish._canonical import CanonicalPart, SameAsBaseline, held_while_unchanged
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
)
from dcr_format.publish._projection import ProjectionPart
from dcr_format.publish._sharded import ShardedPart, peek_sharded
from dcr_format.publish.coordinate import Coordinator, SoloCoordinator
from dcr_format.store.store import Store, open_store
from dcr_format.system.collector import collector_off
from dcr_format.system.options import duration, whole

# A shard is compressed and uploaded on a background thread while the next tensors are
# coded, so the last shard is the only upload a publish waits for. A writer cuts shards at a
# quarter of its previous publish (DeltaWriter._shard_limit), at most shard_bytes (default
# 32 MiB: a version of a 1T-parameter model at 1% is then ~500 objects across its ranks) and
# at least MIN_SHARD_BYTES.
DEFAULT_SHARD_BYTES = 32 << 20
MIN_SHARD_BYTES = 4 << 20  # the smallest shard a writer cuts by itself (see _shard_limit)
_log = logging.getLogger(__name__)


class DeltaWriter:
    """Publishes every training step of one writer rank as a version of the chain.

    ``tensors`` given to :meth:`publish` are canonical (Hugging Face) tensors; this
    rank encodes those it owns (see :func:`~dcr_format.owner`) and ignores the rest, so a rank
    may be handed everything or only its own. The baseline (exact bits of the last
    committed version of the owned tensors) lives on ``baseline_device`` and
    advances only once the commit record is known to exist.

    With ``layout``, :meth:`publish` takes this rank's *local* tensors instead
    (tensor-parallel shards, fused matrices, ...) placed by the
    :class:`~dcr_format.chain.layout.Layout`; each rank passes its own layout, the baseline
    is the local tensors, and ``cache_dir`` is not supported (reopening a chain
    restores the baseline from the store). The same holds for ``DTensor`` shards, which
    a publish refuses with ``cache_dir`` set.

    With ``reader_records`` (default), rank 0 reads the reader records
    (``readers/*.json``) at every delta publish (and every base, with the default features)
    and every rank sends the tensors they name as ``overwrite`` (readers whose load path
    casts or scales them) and uses the features they read.

    ``features`` (FORMAT.md §12) are the writer features: ``values-rans`` (entropy-coded
    values), ``positions-classed``, ``values-ulp`` and ``values-ulp-shift`` (positions and
    values of ``xor`` entries coded against the old bits), ``manifest-zstd`` (compressed
    manifests), ``implicit-parents`` (delta manifests without parent fingerprints). Each
    coding is used per tensor only where it is smaller. By default (None) every publish uses
    each feature that every reader record lists (a record without a list reads all six;
    without records, all six), so a chain is as small as its readers can read. An explicit
    set is used as given (``()``: the plain codings every reader reads), except that the
    codings against the old bits are never sent while a reader record says its reader
    cannot read them. :attr:`last_features` holds what the last publish used.
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
        commit_timeout: float | timedelta = 600.0,
        clock: Callable[[], datetime] = utc_now,
        ids: Callable[[], str] = new_id,
        reader_records: bool = True,
        layout: Layout | None = None,
        features: Iterable[str] | None = None,
    ) -> None:
        _check_options(rank, world_size, base_every, coordinator, ops)
        # the writer features (FORMAT.md §12) it was given; None: those its readers read
        self.features = None if features is None else writer_features(features)
        self.last_features: frozenset[str] | None = None  # what the last publish used
        # ... and its tensors against old bits (the names, or None: all but the second)
        self._last_baseline: tuple[frozenset[str] | None, frozenset[str]] | None = None
        # rank 0: the ranks' pieces of a delta disagreed, so the next version is a base
        self._rebase = False
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
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        try:
            self.baseline_device = torch.device(baseline_device)
        except (RuntimeError, TypeError):
            raise ArgumentError(
                f"baseline_device {baseline_device!r} is not a torch device; use 'cpu' or 'cuda'"
            ) from None
        self.shard_bytes = whole(shard_bytes, "shard_bytes", low=1)
        self.zstd_level = whole(zstd_level, "zstd_level", low=ZSTD_MIN_LEVEL, high=ZSTD_MAX_LEVEL)
        self._last_streams: int | None = None  # stream bytes this rank wrote last publish
        self.commit_timeout = duration(commit_timeout, "commit_timeout").total_seconds()
        if self.commit_timeout < 0:
            raise ArgumentError(f"commit_timeout must be zero or more, not {commit_timeout}")
        self.clock, self.ids = clock, ids
        self.reader_records = reader_records
        self.layout = layout
        self._part: Part
        if layout is None:
            cache = (
                None if self.cache_dir is None else BaselineCache(self.cache_dir, rank, world_size)
            )
            self._part = CanonicalPart(
                rank=rank,
                world_size=world_size,
                device=self.baseline_device,
                ops=self.ops,
                cache=cache,
            )
        else:
            self._part = ProjectionPart(
                layout, rank=rank, device=self.baseline_device, ops=self.ops
            )
        # the baseline of a reopened chain, cut once the part is known (see _settle)
        self._unrestored: tuple[Chain, LoadedRecord, dict[str, TensorState]] | None = None
        self._opened = False
        self._version: int | None = None
        self._record: LoadedRecord | None = None
        # the baseline version's table: in full on rank 0 (the committer), else this rank's
        self._table: dict[str, TensorState] = {}
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
        """Continue an existing chain from committed version ``latest``. Rank 0 (the
        committer) reads every rank's manifest of it; another rank of a job of the same
        size reads only its own, which lists every tensor it published (a job of thousands
        of ranks would otherwise read the square of that many manifests at a restart)."""
        record = self.chain.record(latest)
        if self.rank == 0 or record.record.world_size != self.world_size:
            manifests = self.chain.manifests(record)
            table = state_table(manifests)
        else:  # the whole tensors it published (its pieces are rebuilt from its own entries)
            refs = [ref for ref in record.record.manifests if ref.rank == self.rank]
            manifests = [self.chain.manifest(record, ref) for ref in refs]
            table = {
                e.name: TensorState(e.name, e.dtype, tuple(e.shape), e.fingerprint, m.rank)
                for m in manifests
                for e in m.entries
                if e.piece is None
            }
        self._unrestored = (self.chain, record, table)
        self._record, self._table, self._version = record, table, latest
        self._files = next((m.files for m in manifests if m.rank == 0), ())

    def _settle(self, tensors: Tensors | None = None) -> Tensors | None:
        """Pick the part ``tensors`` need (``DTensor`` objects, without a layout: the sharded
        part) and cut its baseline of a reopened chain; returns the tensors to publish."""
        if self.layout is None and tensors is not None and not isinstance(self._part, ShardedPart):
            sharded, tensors = peek_sharded(tensors)
            if sharded and self.cache_dir is not None:
                raise ArgumentError(
                    "a writer publishing DTensor shards keeps no baseline cache (a restarted "
                    "rank rebuilds its shards from the store); leave cache_dir unset"
                )
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
        base: bool = False,
    ) -> CommitInfo:
        """Publish the next version from canonical ``tensors`` (with a layout: this rank's
        local tensors) and commit it with every rank.

        ``base``: write this version as a full base (as ``base_every`` does on its
        schedule), which may drop tensors of the previous version; with several ranks,
        rank 0's ``base`` decides for all.

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

        The cyclic collector is held off while it runs: a publish makes a few objects per
        tensor that live until the commit, none of them in cycles, and the full collections
        they would set off walk the trainer's whole heap again and again.
        """
        with collector_off():
            return self._publish(tensors, step, files, allow_empty, base)

    def _publish(
        self,
        tensors: Tensors,
        step: int | None,
        files: Files | None,
        allow_empty: bool,
        base: bool = False,
    ) -> CommitInfo:
        """:meth:`publish`, with the collector held off."""
        if not allow_empty and self.world_size != 1:
            raise ArgumentError(
                "allow_empty=False needs a single writer rank; publish with allow_empty=True"
            )
        try:
            check_publish(tensors, step)  # bad input fails the version before it begins
        except DcrError:
            self._abandon()
            raise
        chosen = None if files is None or self.rank != 0 else files_to_publish(files)
        self._open()
        self._note_step(step)
        try:
            settled = self._settle(tensors)
        except DcrError:
            self._abandon()
            raise
        assert settled is not None
        attempt = self._begin(base, step)
        clock = time.perf_counter
        started = clock()
        try:
            listed = self._put_files(chosen)
            if (
                not allow_empty
                and attempt.base
                and self._record is not None
                and listed == self._files
                and isinstance(self._part, CanonicalPart)
            ):  # a base found unchanged before it is uploaded in full
                settled = held_while_unchanged(settled, self._part.baseline)
            written = self._part.write(settled, attempt)
            unchanged = not allow_empty and self._unchanged(written, listed)
        except SameAsBaseline:
            raise self._unchanged_error(attempt.version) from None  # nothing was uploaded
        except BaseException:
            self._abort(attempt.version, attempt.id)  # no manifest of ours: it cannot commit
            raise
        if unchanged:
            self._refuse_unchanged(written, attempt)
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

    def _note_step(self, step: int | None) -> None:
        """Log a warning where ``step`` does not come after the newest version's step: a
        mistyped step, or a trainer resumed from an earlier checkpoint (then expected). The
        step is informational (FORMAT.md §3.4), so the version is published as given."""
        newest = None if self._record is None else self._record.record
        if self.rank == 0 and step is not None and newest is not None and newest.step is not None:
            if step <= newest.step:
                _log.warning(
                    "step %d is not after step %d of version %d, the newest; publishing it "
                    "as given (check the step, unless the trainer resumed from an earlier "
                    "checkpoint)",
                    step,
                    newest.step,
                    newest.version,
                )

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

    def _unchanged(self, written: Written, listed: tuple[CheckpointFile, ...]) -> bool:
        """Whether the written version's tensors equal the newest version's, bit for bit,
        and its files are the same."""
        if self._record is None or listed != self._files:
            return False
        table = state_table([written.manifest])
        return table_fingerprint(table) == self._record.record.state_fingerprint

    def _refuse_unchanged(self, written: Written, attempt: Attempt) -> None:
        """Revert the baseline and raise :class:`UnchangedVersionError`. The attempt is
        marked abandoned only where it uploaded a shard: with one writer rank (the only
        kind that refuses an unchanged version) no other rank waits for the marker, and an
        attempt that put no object leaves nothing in the store."""
        written.revert()
        if written.manifest.shards:
            self._abort(attempt.version, attempt.id)
        raise self._unchanged_error(attempt.version)

    @staticmethod
    def _unchanged_error(version: int) -> UnchangedVersionError:
        return UnchangedVersionError(
            f"the tensors equal version {version - 1}'s bit for bit: version {version} "
            "would change nothing, so nothing was committed (allow_empty commits it anyway)"
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

    def _begin(
        self, asked: bool = False, step: int | None = None, *, abandon: bool = False
    ) -> Attempt:
        """The attempt of the next version; rank 0 picks its id, whether it is a base
        (``asked``, the version's first, or ``base_every``'s turn) and reads the reader
        records once, and every rank uses its answer (FORMAT.md §8.4): the tensors to send
        as ``overwrite`` (deltas only) and the features the readers read.

        Rank 0 also sends its ``step``: a rank publishing another step is out of step with
        rank 0 (a loop that skipped or repeated a publish), so it abandons the attempt and
        raises :class:`ArgumentError`, and no rank commits. ``abandon``: this rank is about
        to abandon the attempt for its own error, so nothing is compared."""
        version = 0 if self._version is None else self._version + 1
        mine = None
        if self.rank == 0:
            due = self.base_every is not None and version % self.base_every == 0
            base = asked or version == 0 or due or self._rebase
            # a base has no overwrite, but its features are the readers' too
            records = self.reader_records and (not base or self.features is None)
            wishes = read_reader_records(self.store) if records else ReaderWishes()
            mine = (self.ids(), wishes, base, None if abandon else (step,))
        attempt, wishes, base, first = self.coordinator.broadcast(mine, rank=self.rank)
        if not abandon and first is not None and first != (step,):
            self._abort(version, attempt)
            raise ArgumentError(
                f"writer rank {self.rank} publishes step {step} while rank 0 publishes step "
                f"{first[0]}; call publish on every rank with the same step"
            )
        features = wishes.features_for(self.features)
        self._explain(version, features, wishes)
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
            overwrite=frozenset() if base else wishes.overwrite,
            features=features,
            baseline_names=wishes.baseline_names,
            baseline_except=wishes.baseline_except,
            changed_names=wishes.changed_names,
            changed_except=wishes.changed_except,
        )

    def _explain(self, version: int, features: frozenset[str], wishes: ReaderWishes) -> None:
        """Log (rank 0, info) the writer features a publish uses whenever they change, and
        why features are left out or used for some tensors only."""
        against = sorted(features & BASELINE_FEATURES)
        # (None, frozenset()): for every tensor
        some = (
            (None, frozenset()) if not against else (wishes.baseline_names, wishes.baseline_except)
        )
        if (features, some) == (self.last_features, self._last_baseline):
            return
        self.last_features, self._last_baseline = features, some
        if self.rank != 0:
            return
        left = ", ".join(sorted(WRITER_FEATURES - features))
        only = ""
        names, excluded = some
        if names is not None:
            only = (
                f"; {', '.join(against)} only for the {len(names)} tensors every reader "
                "record reads the old bits of"
            )
        elif excluded:
            only = (
                f"; {', '.join(against)} for every tensor but {len(excluded)} whose old bits "
                "a reader record does not read"
            )
        if only and VALUES_ULP_FEATURE in features and wishes.changed != wishes.baseline:
            only += (
                f", {VALUES_ULP_FEATURE} also for those whose changed elements every reader "
                "record reads"
            )
        explicit = self.features is not None
        why = "as given by features=" if explicit else "the default: every feature its readers read"
        if (only or (left and not explicit)) and wishes.limiting:
            more = ", ..." if len(wishes.limiting) > 8 else ""
            why += f"; reader records limiting them: {', '.join(wishes.limiting[:8])}{more}"
        _log.info(
            "version %d on uses writer features %s%s%s (%s)",
            version,
            ", ".join(sorted(features)) or "none",
            f", not {left}" if left else "",
            only,
            why,
        )

    def _upload_manifest(self, manifest: Manifest, attempt: Attempt) -> tuple[bytes, Manifest]:
        """Upload this rank's manifest (compressed when the writer is allowed
        ``manifest-zstd``, a delta's parent fingerprints left to the parent's table when it
        is allowed ``implicit-parents``); returns its bytes as uploaded and the manifest
        they hold."""
        if IMPLICIT_PARENTS_FEATURE in attempt.features and manifest.kind == "delta":
            manifest = implicit_parents(manifest)
        if MANIFEST_ZSTD_FEATURE in attempt.features:
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
        if attempt.kind == "delta":
            try:
                _check_pieces_agree(manifests, attempt.version)
            except CommitError:
                self._rebase = True  # the one way every rank gets back in step
                raise
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
            total_elements=sum(math.prod(t.shape) for t in table.values()),
            changed_elements=sum(e.changed for m in manifests for e in m.entries),
            payload_bytes=sum(s.size for m in manifests for s in m.shards)
            + sum(ref.size for _, ref in found),
            dense_bytes=sum(math.prod(t.shape) * info_for(t.dtype).width for t in table.values()),
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

    def _abandon(self) -> None:
        """Abandon the next version before this rank begins it, so that the other ranks,
        which wait for its manifest, stop at once."""
        if self.world_size > 1:
            self._open()
            attempt = self._begin(abandon=True)
            self._abort(attempt.version, attempt.id)

    def _advance(
        self, written: Written, loaded: LoadedRecord, table: dict[str, TensorState]
    ) -> None:
        """The commit exists: bring the baseline to the committed bits."""
        written.advance()
        self._record = loaded
        self._version = loaded.record.version
        if self.rank == 0:
            self._table = table
            self._rebase = self._rebase and loaded.record.kind != "base"


def _check_pieces_agree(manifests: list[Manifest], version: int) -> None:
    """Refuse a delta whose ranks sent parts of one tensor some in full and some as changes
    (FORMAT.md §4.8 rule 3): a rank that could not rebuild its part of the previous version
    sends it in full, and only a base brings every rank back in step (rank 0 makes the next
    version one)."""
    full: dict[str, set[int]] = {}
    changed: set[str] = set()
    for manifest in manifests:
        for entry in manifest.entries:
            if entry.piece is None:
                continue
            if entry.op == FULL:
                full.setdefault(entry.name, set()).add(manifest.rank)
            else:
                changed.add(entry.name)
    mixed = sorted(changed & set(full))
    if mixed:
        ranks = sorted(full[mixed[0]])
        raise CommitError(
            f"writer ranks {ranks} sent their part of {mixed[0]!r} (and {len(mixed) - 1} more "
            f"tensors) in full, the other ranks as changes: those ranks could not rebuild "
            f"their part of version {version - 1}; the next publish writes a base, which "
            "brings every rank back in step"
        )


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
