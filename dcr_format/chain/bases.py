"""Alternative bases (spec/FORMAT.md §14): full snapshots of delta versions, outside the chain.

``dcr compact --at V`` writes the complete state of committed version ``V`` as
one more base a reader may start from:

    bases/<V 20 digits>.json                         base record (create-if-absent, last)
    bases/<V 20 digits>/<attempt>/manifest-<rank>.json
    bases/<V 20 digits>/<attempt>/shard-<rank>-<index>.dcrs

The record names the sha256 of ``commits/<V>.json`` and repeats its state
fingerprint, so the snapshot is bound into the hash chain: a reader validates
it exactly like a commit base and then continues with version ``V+1``, whose
parent hash is that same commit record. Readers that do not know ``bases/``
ignore it, and the chain stays valid without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, FailFast, Field

from dcr_format.chain.chain import (
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    Chain,
    LoadedRecord,
    ManifestAllowance,
    TensorState,
    attempt_prefix,
    check_manifest,
    check_manifest_refs,
    check_owner,
    commit_key,
    get_verified,
    manifest_key,
    sha256_hex,
    shard_key,
    state_table,
    table_fingerprint,
)
from dcr_format.errors import ChainBrokenError, ObjectNotFoundError, SchemaError
from dcr_format.format.schema import (
    FORMAT_VERSION,
    Hex32,
    Manifest,
    ManifestRef,
    Sha256,
    Stats,
    Timestamp,
    Version,
    parse,
    parse_manifest,
)
from dcr_format.store.store import Store

BASES_PREFIX = "bases/"
_BASE_RECORD_KEY = re.compile(r"^bases/([0-9]{20})\.json$")


def base_record_key(version: int) -> str:
    """Key of the alternative base record of version ``version``."""
    return commit_key(version, under=BASES_PREFIX)


def base_attempt_prefix(version: int, attempt: str) -> str:
    """Prefix under which one compaction attempt of ``version`` writes its objects."""
    return attempt_prefix(version, attempt, under=BASES_PREFIX)


def base_manifest_key(version: int, attempt: str, rank: int) -> str:
    """Key of one rank's manifest of an alternative base."""
    return manifest_key(version, attempt, rank, under=BASES_PREFIX)


def base_shard_key(version: int, attempt: str, rank: int, index: int) -> str:
    """Key of one rank's ``index``-th shard of an alternative base."""
    return shard_key(version, attempt, rank, index, under=BASES_PREFIX)


class BaseRecord(BaseModel):
    """``bases/<V>.json``: an alternative base of committed version ``V``."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    format_version: int = FORMAT_VERSION
    required_features: tuple[str, ...] = ()
    chain_id: Hex32
    version: Version
    commit_sha256: Sha256
    """sha256 of the stored bytes of ``commits/<V>.json``."""
    created: Timestamp
    attempt: Hex32
    world_size: Annotated[int, Field(ge=1, le=1 << 20)]
    manifests: Annotated[tuple[ManifestRef, ...], FailFast()]  # one error, not one per item
    state_fingerprint: Sha256
    """MUST equal the state fingerprint of version ``V``'s commit record."""
    stats: Stats

    def to_json(self) -> bytes:
        """Canonical serialisation: compact JSON, fields in declaration order."""
        return self.model_dump_json().encode()


@dataclass(frozen=True)
class LoadedBase:
    """A validated alternative base: its record, manifests and state table."""

    record: BaseRecord
    sha256: str
    size: int
    manifests: list[Manifest]
    table: dict[str, TensorState]


def alternative_bases(store: Store) -> list[int]:
    """Versions that have an alternative base record, ascending (from listing ``bases/``)."""
    found = []
    for key in store.list(BASES_PREFIX):
        match = _BASE_RECORD_KEY.match(key)
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


def read_base_record(chain: Chain, version: int) -> tuple[BaseRecord, str, int]:
    """Fetch and parse ``bases/<version>.json``; checks its chain and version only."""
    key = base_record_key(version)
    data = chain.store.get(key, max_size=MAX_RECORD_BYTES)
    record = parse(BaseRecord, data, what=key)
    optional = "remove it (it is optional)"
    check_owner(record, key, chain.header.chain_id, version, mixed=optional, wrong=optional)
    check_manifest_refs(record, key, version, under=BASES_PREFIX)
    return record, sha256_hex(data), len(data)


def _base_manifest(
    chain: Chain, record: BaseRecord, ref: ManifestRef, allowance: ManifestAllowance
) -> Manifest:
    if ref.size > MAX_MANIFEST_BYTES:
        raise SchemaError(
            f"{ref.path} is declared as {ref.size} bytes, over the {MAX_MANIFEST_BYTES} byte "
            "manifest limit; the base record is corrupt or hostile"
        )
    data = get_verified(chain.store, ref.path, size=ref.size, sha256=ref.sha256)
    manifest = parse_manifest(data, what=ref.path, admit=allowance.admitter(ref))
    for index, shard in enumerate(manifest.shards):
        expected = base_shard_key(record.version, record.attempt, ref.rank, index)
        if shard.path != expected:
            raise SchemaError(f"{ref.path} names shard {shard.path}, not {expected}")
    # every other rule is that of a commit base's manifest: check it with the shard names
    # mapped to where a commit would keep them
    as_commit = manifest.model_copy(
        update={
            "shards": tuple(
                s.model_copy(
                    update={"path": shard_key(record.version, record.attempt, ref.rank, i)}
                )
                for i, s in enumerate(manifest.shards)
            )
        }
    )
    check_manifest(
        as_commit,
        record.chain_id,
        record.version,
        "base",
        record.attempt,
        ref.rank,
        record.world_size,
        ref.path,
    )
    return manifest


def load_base(
    chain: Chain,
    commit: LoadedRecord,
    *,
    map_fn: Callable[[Callable[[ManifestRef], Manifest], Iterable[ManifestRef]], Iterable[Manifest]]
    | None = None,
) -> LoadedBase:
    """Load and validate the alternative base of ``commit``'s version, as a commit base.

    Checks the record against the commit record (its sha256 and state fingerprint),
    every manifest (size, sha256, schema, membership; all entries ``full``), and
    that the manifests add up to the state fingerprint. Shards are checked when
    they are fetched. ``map_fn`` (e.g. a thread pool's ``map``) fetches manifests.
    """
    version = commit.record.version
    key = base_record_key(version)
    try:
        record, sha256, size = read_base_record(chain, version)
    except ObjectNotFoundError:
        raise ObjectNotFoundError(
            f"the alternative base {key} is gone; retry (the reader plans again)"
        ) from None
    if record.commit_sha256 != commit.sha256:
        raise ChainBrokenError(
            f"{key} was made from another commit record of version {version} (commit sha256 "
            "differs): remove it and compact again"
        )
    if record.state_fingerprint != commit.record.state_fingerprint:
        raise ChainBrokenError(
            f"{key} does not hold the state of version {version} (state fingerprint differs): "
            "remove it and compact again"
        )
    refs = sorted(record.manifests, key=lambda r: r.rank)
    allowance = ManifestAllowance(key, refs)
    load = lambda ref: _base_manifest(chain, record, ref, allowance)  # noqa: E731
    manifests = list(map_fn(load, refs) if map_fn is not None else map(load, refs))
    table = state_table(manifests)
    if table_fingerprint(table) != record.state_fingerprint:
        raise ChainBrokenError(
            f"the manifests of {key} do not add up to its state fingerprint: remove it and "
            "compact again"
        )
    return LoadedBase(record, sha256, size, manifests, table)


__all__ = [
    "BASES_PREFIX",
    "BaseRecord",
    "LoadedBase",
    "alternative_bases",
    "base_attempt_prefix",
    "base_manifest_key",
    "base_record_key",
    "base_shard_key",
    "load_base",
    "read_base_record",
]
