"""``dcr compact --at V``: write an alternative base of version V (FORMAT.md §14).

Late joiners then start at V instead of replaying every delta since the last
base. The version is materialised through a reader (every tensor checked),
written as ``full`` entries under ``bases/<V>/<attempt>/``, and published by
creating ``bases/<V>.json`` last, with create-if-absent.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from datetime import datetime
from functools import partial

import torch

from dcr_format.chain.bases import (
    BaseRecord,
    alternative_bases,
    base_attempt_prefix,
    base_manifest_key,
    base_record_key,
    base_shard_key,
    load_base,
)
from dcr_format.chain.chain import (
    Chain,
    LoadedRecord,
    TensorState,
    commit_key,
    new_id,
    sha256_hex,
    state_table,
    table_fingerprint,
    timestamp,
    utc_now,
)
from dcr_format.delta.delta import FULL, encode_tensor
from dcr_format.errors import ChainBrokenError
from dcr_format.format.dtypes import info_for
from dcr_format.format.features import CHECKPOINT_FILES_FEATURE
from dcr_format.format.schema import CheckpointFile, Entry, Manifest, ManifestRef, Stats, ValuesRef
from dcr_format.format.shard import ZSTD_LEVEL, ZSTD_MAX_LEVEL, ZSTD_MIN_LEVEL
from dcr_format.publish._commit import create_if_absent, require_atomic_create
from dcr_format.publish._part import ShardWriter
from dcr_format.store.store import Store, open_store
from dcr_format.sync.reader import DeltaReader
from dcr_format.system.options import whole
from dcr_format.targets.dict import StateDictTarget
from dcr_format.tools._common import Row, numel
from dcr_format.tools._progress import Progress, counting_store

DEFAULT_SHARD_BYTES = 256 << 20


class CompactResult(Row):
    """What :func:`compact` did."""

    version: int
    created: bool
    """False when the version already was a base or had an alternative base."""
    reason: str
    key: str
    """The base record (or, for a base version, its commit record)."""
    attempt: str | None
    tensors: int
    payload_bytes: int
    dense_bytes: int
    replayed_versions: tuple[int, ...]
    """The versions applied to materialise the version."""


def _writes_counted(store: Store, tick: Callable[[int], object]) -> Store:
    """The same store, reporting the size of every object it writes to ``tick``."""
    counted = copy.copy(store)
    put = store.put

    def put_counted(key: str, data: bytes) -> None:
        put(key, data)
        tick(len(data))

    counted.put = put_counted  # type: ignore[method-assign]  # on this copy only
    return counted


def compact(
    store: Store | str | os.PathLike[str],
    at: int,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    zstd_level: int = ZSTD_LEVEL,
    clock: Callable[[], datetime] = utc_now,
    ids: Callable[[], str] = new_id,
    progress: bool = False,
) -> CompactResult:
    """Write an alternative base of committed version ``at`` that readers may start from.

    Does nothing if ``at`` is a base version or already has a valid alternative
    base (and raises if it has a broken one). Needs the whole version in memory.
    Racing compactions of one version agree on whichever record was created
    first; the loser deletes its own objects. ``progress`` shows how far the replay
    and the write of the base are on stderr (a bar on a terminal, lines off one).
    """
    at = whole(at, "at", low=0)
    shard_bytes = whole(shard_bytes, "shard_bytes", low=1)
    zstd_level = whole(zstd_level, "zstd_level", low=ZSTD_MIN_LEVEL, high=ZSTD_MAX_LEVEL)
    store = open_store(store)
    chain = Chain(store)
    chain.header  # noqa: B018  # refuse a store without a chain
    commit = chain.record(at)
    key = base_record_key(at)
    if commit.record.kind == "base":
        return _unchanged(at, commit.record.stats, "the version is a base", commit_key(at))
    if at in alternative_bases(store):
        existing = load_base(chain, commit)
        return _unchanged(at, existing.record.stats, "the version already has a base", key)
    require_atomic_create(
        store,
        f"cannot compact in {store.url}: it cannot create {key} atomically; open the "
        "store with single_writer=True if no other process writes it",
    )
    tensors: dict[str, torch.Tensor] = {}
    with Progress("compact: replay", unit="B", enabled=progress) as bar:
        reading = counting_store(store, bar.add) if progress else store
        synced = DeltaReader(reading, StateDictTarget(tensors), verify="all").sync(to=at)
    manifests = chain.manifests(commit)
    table = state_table(manifests)
    files = next((m.files for m in manifests if m.rank == 0), ())  # stored once: named again
    attempt = ids()
    with Progress("compact: write base", unit="B", enabled=progress) as bar:
        manifest_ref, manifest = _write_snapshot(
            _writes_counted(store, bar.add) if progress else store,
            at,
            attempt,
            tensors,
            table,
            commit.record.chain_id,
            shard_bytes,
            zstd_level,
            files,
        )
    if table_fingerprint(state_table([manifest])) != commit.record.state_fingerprint:
        raise ChainBrokenError(  # the reader checked every tensor: this is a bug, not the store
            f"the snapshot of version {at} does not add up to its state fingerprint"
        )
    record = _base_record(commit, manifest, manifest_ref, timestamp(clock()), attempt)
    if not create_if_absent(store, key, record.to_json(), retry="run `dcr compact` again"):
        # another compaction won: our objects can never be referenced (FORMAT.md §14.4)
        store.delete_many(store.list(base_attempt_prefix(at, attempt)))
        existing = load_base(chain, commit)
        return _unchanged(at, existing.record.stats, "another compaction created it", key)
    return CompactResult(
        version=at,
        created=True,
        reason="created",
        key=key,
        attempt=attempt,
        tensors=record.stats.tensors,
        payload_bytes=record.stats.payload_bytes,
        dense_bytes=record.stats.dense_bytes,
        replayed_versions=synced.applied_versions,
    )


def _base_record(
    commit: LoadedRecord, manifest: Manifest, ref: ManifestRef, created: str, attempt: str
) -> BaseRecord:
    """The record that publishes the snapshot ``manifest`` as a base of ``commit``."""
    entries = manifest.entries
    stats = Stats(
        tensors=len(entries),
        total_elements=sum(numel(e.shape) for e in entries),
        changed_elements=sum(e.changed for e in entries),
        payload_bytes=sum(s.size for s in manifest.shards) + ref.size,
        dense_bytes=sum(numel(e.shape) * info_for(e.dtype).width for e in entries),
    )
    return BaseRecord(
        required_features=manifest.required_features,
        chain_id=commit.record.chain_id,
        version=commit.record.version,
        commit_sha256=commit.sha256,
        created=created,
        attempt=attempt,
        world_size=1,
        manifests=(ref,),
        state_fingerprint=commit.record.state_fingerprint,
        stats=stats,
    )


def _unchanged(version: int, stats: Stats, reason: str, key: str) -> CompactResult:
    return CompactResult(
        version=version,
        created=False,
        reason=reason,
        key=key,
        attempt=None,
        tensors=stats.tensors,
        payload_bytes=stats.payload_bytes,
        dense_bytes=stats.dense_bytes,
        replayed_versions=(),
    )


def _write_snapshot(
    store: Store,
    version: int,
    attempt: str,
    tensors: dict[str, torch.Tensor],
    table: dict[str, TensorState],
    chain_id: str,
    shard_bytes: int,
    zstd_level: int,
    files: tuple[CheckpointFile, ...],
) -> tuple[ManifestRef, Manifest]:
    """Upload every tensor as a ``full`` entry (shards first, the manifest last), which
    lists the version's checkpoint ``files`` (FORMAT.md §3.5.6)."""
    shards = ShardWriter(
        store, partial(base_shard_key, version, attempt, 0), shard_bytes, zstd_level
    )
    entries = []
    try:
        for index, name in enumerate(sorted(tensors)):
            tensor = tensors[name]
            encoded = encode_tensor(tensor, None, op=FULL)
            values = None
            if encoded.values is not None:
                assert encoded.values_coding is not None
                stream = f"{index}.v"
                values = ValuesRef(
                    shard=shards.add(stream, encoded.values),
                    key=stream,
                    coding=encoded.values_coding,
                )
            entries.append(
                Entry(
                    name=name,
                    dtype=info_for(tensor.dtype).name,
                    shape=tuple(tensor.shape),
                    op=FULL,
                    changed=encoded.changed,
                    values=values,
                    encoded_bytes=encoded.nbytes,
                    fingerprint=table[name].fingerprint,
                )
            )
            shards.maybe_flush()
        shards.finish()
    finally:
        shards.close()
    manifest = Manifest(
        required_features=(CHECKPOINT_FILES_FEATURE,) if files else (),
        chain_id=chain_id,
        version=version,
        kind="base",
        attempt=attempt,
        rank=0,
        world_size=1,
        shards=tuple(shards.shards),
        entries=tuple(entries),
        files=files,
    )
    data = manifest.to_json()
    key = base_manifest_key(version, attempt, 0)
    store.put(key, data)
    return ManifestRef(rank=0, path=key, sha256=sha256_hex(data), size=len(data)), manifest
