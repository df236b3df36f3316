"""The rollout side: plan, fetch, verify, stage, and only then apply."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from dcr_format.bases import alternative_bases, load_base
from dcr_format.chain import (
    Chain,
    LoadedRecord,
    TensorState,
    get_verified,
    sha256_hex,
    state_table,
    table_fingerprint,
    tensor_changes,
    timestamp,
    utc_now,
)
from dcr_format.codec.delta import FULL, OVERWRITE, XOR, DecodedDelta, decode_delta
from dcr_format.codec.dtypes import info_for
from dcr_format.codec.shard import decode_shard
from dcr_format.errors import (
    ApplyError,
    BaselineMismatchError,
    ChainBrokenError,
    FingerprintMismatchError,
    GroupAbortError,
    IntegrityError,
    SchemaError,
    ShardError,
    StoreError,
    TargetError,
    VersionNotFoundError,
)
from dcr_format.fingerprint import (
    fingerprint_from_lanes,
    lanes_after_change,
)
from dcr_format.readers.group import ReaderGroup
from dcr_format.readers.targets import Change, Resident, Target, Transaction
from dcr_format.schema import Entry, Manifest, ReaderRecord
from dcr_format.store import Store, open_store

MAX_SHARD_DECODED_BYTES = 16 << 30  # refuse to inflate a single shard past this
_READER_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_log = logging.getLogger(__name__)


class SyncResult(BaseModel):
    """What one :meth:`DeltaReader.sync` did.

    ``unverified``: tensors the sync changed (or, with ``verify="all"``, held) whose
    fingerprints the target could not check because it cannot read them back in
    canonical coordinates (a module whose loader transforms them, FORMAT.md §8.4).
    """

    model_config = ConfigDict(frozen=True)

    version: int
    previous: int | None
    applied_versions: tuple[int, ...]
    payload_bytes: int
    fetch_seconds: float
    apply_seconds: float
    unverified: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Step:
    """One version of a plan, fetched and decoded."""

    loaded: LoadedRecord
    table: dict[str, TensorState]
    changes: list[tuple[Entry, DecodedDelta]]
    base: bool  # a full snapshot: a base version, or the alternative base of a delta version


@dataclass(frozen=True)
class _Prepared:
    """A sync's plan, fetched and decoded, before anything is applied."""

    steps: list[_Step]
    payload: int
    plan: list[int]
    incremental: bool
    previous: int | None
    fetch_seconds: float


class DeltaReader:
    """Keeps a target at a version of the chain in ``store``, bit-exact.

    ``select`` limits the reader to the canonical names it returns True for (a
    partial target, such as one writer rank's baseline). ``verify`` is
    ``"touched"`` (check fingerprints of tensors a sync changes, before and after)
    or ``"all"`` (every selected tensor). ``reader_id`` names the reader record
    (``readers/<reader_id>.json``) in which the reader tells writers the tensors its
    target can take only as ``overwrite`` (a module whose loader casts or scales
    them); without it such a record is named after its content.
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        target: Target,
        *,
        select: Callable[[str], bool] | None = None,
        verify: Literal["touched", "all"] = "touched",
        max_workers: int = 8,
        max_shard_bytes: int = MAX_SHARD_DECODED_BYTES,
        group: Any = None,
        reader_id: str | None = None,
    ) -> None:
        if verify not in ("touched", "all"):
            raise ValueError("verify must be 'touched' or 'all'")
        if reader_id is not None and not _READER_ID.match(reader_id):
            raise ValueError(f"reader_id {reader_id!r} must match {_READER_ID.pattern}")
        self.store = open_store(store)
        self.chain = Chain(self.store)
        self.target = target
        self.select = select or (lambda name: True)
        self.verify = verify
        self.max_workers = max_workers
        self.max_shard_bytes = max_shard_bytes
        # ranks sharing the target stage, verify and apply together (all or none)
        # a RelayStore (readers/relay.py) closes its epoch wherever the ranks agree
        epoch = getattr(self.store, "end_epoch", None)
        self.group = (
            ReaderGroup.solo(before_agreeing=epoch)
            if group is None
            else ReaderGroup(group, before_agreeing=epoch)
        )
        self._last_table: tuple[str, dict[str, TensorState]] | None = None  # (record sha, table)
        self.reader_id = reader_id
        self._recorded: tuple[str, frozenset[str]] | None = None  # last reader record written

    def versions(self) -> list[int]:
        """Committed versions of the chain, ascending."""
        return self.chain.versions()

    # --- planning --------------------------------------------------------------------------

    def _plan(
        self, resident: Resident | None, goal: int, committed: list[int]
    ) -> tuple[list[int], int | None]:
        """The versions to apply; the second item is the first version when it starts from
        that version's alternative base (None otherwise)."""
        have = set(committed)
        if resident is not None and all(v in have for v in range(resident.version, goal + 1)):
            return list(range(resident.version + 1, goal + 1)), None
        # the newest base at or before the goal with every version after it committed: a
        # base version, or a delta version with an alternative base (FORMAT.md §14)
        alternatives = set(alternative_bases(self.store))
        version = goal
        while version in have:
            if version in alternatives:
                return list(range(version, goal + 1)), version
            if self.chain.record(version).record.kind == "base":
                return list(range(version, goal + 1)), None
            version -= 1
        raise VersionNotFoundError(
            f"no base at or before version {goal} is left in {self.store.url}; "
            "compact the chain or pick a newer version"
        )

    def sync(self, to: int | None = None) -> SyncResult:
        """Bring the target to version ``to`` (default: the newest committed version).

        Everything is fetched and verified before the target is touched; a failure
        during the apply rolls every change back. In a reader group every rank
        syncs to the same version, and all ranks apply it or none does.
        """
        committed = self.chain.versions()
        latest = committed[-1] if committed else -1
        goal = self.group.min(latest if to is None else to)
        prepared: _Prepared | None = None
        with self.group.stage("fetching and verifying"):
            prepared = self._prepare(goal, committed)
            self._record_overwrites()  # what the target learnt while staging (FORMAT.md §3.6)
        if prepared is None:  # already there; still take part in the group's stages
            with self.group.stage("checking its target"):
                pass
            with self.group.stage("applying"):
                pass
            return SyncResult(
                version=goal,
                previous=goal,
                applied_versions=(),
                payload_bytes=0,
                fetch_seconds=0.0,
                apply_seconds=0.0,
            )
        started = time.perf_counter()
        unverified = self._apply(prepared.steps, self.target.resident(), prepared.incremental)
        return SyncResult(
            version=goal,
            previous=prepared.previous,
            applied_versions=tuple(prepared.plan),
            payload_bytes=prepared.payload,
            fetch_seconds=prepared.fetch_seconds,
            apply_seconds=time.perf_counter() - started,
            unverified=tuple(sorted(unverified)),
        )

    def prewarm(self, version: int | None = None) -> frozenset[str]:
        """Learn how the target takes every tensor of ``version`` (default: the newest)
        without changing it, and record the names it needs as ``overwrite``.

        Run it before the trainer publishes its first delta, so that writers send
        ``overwrite`` for those names from the start. Returns the names.
        """
        committed = self.chain.versions()
        if not committed:
            raise VersionNotFoundError(f"{self.store.url} has no committed version yet")
        loaded = self.chain.record(committed[-1] if version is None else version)
        for name, row in state_table(self.chain.manifests(loaded)).items():
            self._wants(name, row.dtype, row.shape)
        self._record_overwrites()
        return self.target.overwrite_names()

    def _wants(self, name: str, dtype: str, shape: tuple[int, ...]) -> bool:
        """Selected, and a tensor the target takes at all (not another rank's shard)."""
        return self.select(name) and self.target.accepts(
            name, info_for(dtype).torch_dtype, tuple(shape)
        )

    def _record_overwrites(self) -> None:
        """Tell writers which tensors the target needs as ``overwrite`` (``readers/<id>.json``).

        Written when the set changes (an explicit ``reader_id`` also records an empty
        set once, so a stale list is cleared); without a ``reader_id`` the record is named
        after its content, so readers that need the same names share one record.
        """
        names = self.target.overwrite_names()
        if self.reader_id is None and not names:
            return
        reader_id = self.reader_id or "auto-" + sha256_hex("\n".join(sorted(names)).encode())[:16]
        if self._recorded == (reader_id, names):
            return
        record = ReaderRecord(
            reader_id=reader_id, updated=timestamp(utc_now()), overwrite=tuple(sorted(names))
        )
        try:
            self.store.put(f"readers/{reader_id}.json", record.to_json())
        except StoreError as exc:  # a read-only reader: writers then cannot be told
            _log.warning("could not write reader record readers/%s.json: %s", reader_id, exc)
            return
        self._recorded = (reader_id, names)

    def _prepare(self, goal: int, committed: list[int]) -> _Prepared | None:
        """Plan and fetch everything for ``goal``; None when the target is already there."""
        header = self.chain.header
        resident = self.target.resident()
        if resident is not None and resident.chain_id != header.chain_id:
            raise TargetError(
                f"the target holds chain {resident.chain_id}, the store {header.chain_id}; "
                "use a fresh target for this store"
            )
        if not committed:
            raise VersionNotFoundError(f"{self.store.url} has no committed version yet")
        if goal not in committed:
            raise VersionNotFoundError(f"version {goal} is not committed in {self.store.url}")
        previous = resident.version if resident is not None else None
        if previous == goal:
            return None
        if previous is not None and previous > goal:
            raise TargetError(
                f"the target is at version {previous}, newer than {goal}; "
                "replay older versions into a fresh target"
            )
        plan, alternative = self._plan(resident, goal, committed)
        # incremental: the plan continues from the resident version (else it starts at a base)
        incremental = (
            resident is not None
            and plan[0] == resident.version + 1
            and resident.version in set(committed)
        )
        started = time.perf_counter()
        steps, payload = self._fetch(plan, resident if incremental else None, alternative)
        return _Prepared(steps, payload, plan, incremental, previous, time.perf_counter() - started)

    # --- fetch and stage ---------------------------------------------------------------------

    def _fetch(
        self, plan: list[int], resident: Resident | None, alternative: int | None = None
    ) -> tuple[list[_Step], int]:
        parent: LoadedRecord | None = None
        parent_table: dict[str, TensorState] | None = None
        if resident is not None and plan[0] == resident.version + 1:
            parent = self.chain.record(resident.version)
            if self._last_table is not None and self._last_table[0] == parent.sha256:
                parent_table = self._last_table[1]
            else:
                parent_table = state_table(self.chain.manifests(parent))
        steps: list[_Step] = []
        payload = 0
        with ThreadPoolExecutor(self.max_workers) as pool:
            for version in plan:
                loaded = self.chain.record(version)
                if parent is not None:
                    self.chain.check_link(parent, loaded)
                if version == alternative:  # validated like a commit base (FORMAT.md §14)
                    snapshot = load_base(self.chain, loaded, map_fn=pool.map)
                    manifests, table = snapshot.manifests, snapshot.table
                    payload += sum(ref.size for ref in snapshot.record.manifests)
                else:
                    manifests = list(
                        pool.map(
                            lambda ref, ld=loaded: self.chain.manifest(ld, ref),
                            sorted(loaded.record.manifests, key=lambda r: r.rank),
                        )
                    )
                    table = state_table(manifests)
                    if table_fingerprint(table) != loaded.record.state_fingerprint:
                        raise ChainBrokenError(
                            f"the manifests of version {version} do not add up to its state "
                            "fingerprint; "
                            "the store is corrupt: run `dcr verify`"
                        )
                    if loaded.record.kind == "delta" and parent_table is not None:
                        _check_continuity(parent_table, manifests, version)
                    payload += sum(ref.size for ref in loaded.record.manifests)
                changes, nbytes = self._decode_version(manifests, pool)
                payload += nbytes
                is_base = version == alternative or loaded.record.kind == "base"
                steps.append(_Step(loaded, table, changes, is_base))
                parent, parent_table = loaded, table
        return steps, payload

    def _decode_version(
        self, manifests: list[Manifest], pool: ThreadPoolExecutor
    ) -> tuple[list[tuple[Entry, DecodedDelta]], int]:
        jobs = []
        for manifest in manifests:
            wanted = [
                e
                for e in manifest.entries
                if e.changed > 0 and self._wants(e.name, e.dtype, tuple(e.shape))
            ]
            needed = sorted(
                {ref.shard for e in wanted for ref in (e.positions, e.values) if ref is not None}
            )
            for index in needed:
                jobs.append((manifest, index))

        def load(job: tuple[Manifest, int]) -> tuple[tuple[int, int], dict[str, memoryview], int]:
            manifest, index = job
            ref = manifest.shards[index]
            if ref.decoded_size > self.max_shard_bytes:
                raise ShardError(
                    f"{ref.path} declares {ref.decoded_size} decoded bytes, over the "
                    f"{self.max_shard_bytes} limit; the manifest is hostile or raise the limit"
                )
            stored = get_verified(self.store, ref.path, size=ref.size, sha256=ref.sha256)
            return (
                (manifest.rank, index),
                decode_shard(stored, decoded_size=ref.decoded_size),
                ref.size,
            )

        streams: dict[tuple[int, int], dict[str, memoryview]] = {}
        nbytes = 0
        for key, decoded, size in pool.map(load, jobs):
            streams[key] = decoded
            nbytes += size
        changes = []
        for manifest in manifests:
            for entry in manifest.entries:
                if not self._wants(entry.name, entry.dtype, tuple(entry.shape)):
                    continue
                changes.append((entry, _decode_entry(entry, manifest, streams)))
        return _merge_pieces(changes, manifests), nbytes

    # --- verify and apply ---------------------------------------------------------------------

    def _apply(self, steps: list[_Step], resident: Resident | None, incremental: bool) -> set[str]:
        """Apply the staged steps; returns the names the target could not verify."""
        txn = self.target.begin()
        undo: list[Callable[[], None]] = []
        try:
            with self.group.stage("checking its target"):
                lanes, unverified = self._check_baseline(steps, txn, incremental)
                txn.prepare(
                    [
                        Change(e.name, info_for(e.dtype).torch_dtype, tuple(e.shape), d)
                        for step in steps
                        for e, d in step.changes
                    ]
                )
            touched = set(lanes)
            with self.group.stage("applying"):
                for step in steps:
                    if step.base or not incremental:
                        for name in txn.names():
                            if self.select(name) and name not in step.table:
                                txn.drop(name)
                    for entry, delta in step.changes:
                        if entry.op != FULL and entry.changed == 0:
                            continue
                        info = info_for(entry.dtype)
                        applied = txn.apply(
                            Change(entry.name, info.torch_dtype, tuple(entry.shape), delta)
                        )
                        undo.append(applied.undo)
                        if entry.op == FULL:
                            lanes[entry.name] = applied.lanes
                            if entry.changed == 0:
                                continue
                        else:
                            # the fingerprint follows the change (O(changed)), from the bits
                            # read back from the target
                            known = lanes.get(entry.name)
                            lanes[entry.name] = (
                                None
                                if known is None or applied.positions is None
                                else lanes_after_change(
                                    known, applied.positions, applied.before, applied.after
                                )
                            )
                        touched.add(entry.name)
                final = steps[-1].table
                # tensors a later base removed are gone, not checked
                selected = {n for n, row in final.items() if self._wants(n, row.dtype, row.shape)}
                check = selected if self.verify == "all" else touched & selected
                mismatch = (
                    "after applying; the target was rolled back: run `dcr verify` on the store"
                )
                found: dict[str, tuple[int, ...]] = {}
                for name in sorted(check):
                    row = final[name]
                    spec = txn.spec(name)
                    if spec != (info_for(row.dtype).torch_dtype, row.shape):
                        raise FingerprintMismatchError(
                            f"tensor {name!r} does not match version "
                            f"{steps[-1].loaded.record.version} {mismatch}"
                        )
                    raw = txn.lanes(name) if self.verify == "all" else lanes.get(name)
                    if raw is None:
                        unverified.add(name)  # the target cannot read it back (FORMAT.md §8.4)
                    else:
                        found[name] = raw
                complete = txn.complete_lanes(found)
                for name in sorted(found):
                    row = final[name]
                    whole = complete.get(name)
                    if whole is None:
                        unverified.add(name)
                        continue
                    dtype = info_for(row.dtype).torch_dtype
                    if fingerprint_from_lanes(dtype, row.shape, whole) != row.fingerprint:
                        raise FingerprintMismatchError(
                            f"tensor {name!r} does not match version "
                            f"{steps[-1].loaded.record.version} {mismatch}"
                        )
                extra = sorted(n for n in txn.names() if self.select(n) and n not in final)
                if extra:  # FORMAT.md 11.4.3: the target holds exactly the goal's selected names
                    raise TargetError(
                        f"the target holds {len(extra)} tensors that version "
                        f"{steps[-1].loaded.record.version} lacks (first: {extra[0]!r}); remove "
                        "them, pass select= to leave them alone, or pull into a fresh target"
                    )
            last = steps[-1].loaded
            txn.commit(Resident(last.record.chain_id, last.record.version))
            self._last_table = (last.sha256, final)
        except BaseException as exc:
            for undo_change in reversed(undo):
                undo_change()
            txn.abort()
            if isinstance(exc, (IntegrityError, TargetError, GroupAbortError)):
                raise
            if isinstance(exc, Exception):
                raise ApplyError(f"applying failed and was rolled back: {exc}") from exc
            raise
        return unverified

    def _check_baseline(
        self, steps: list[_Step], txn: Transaction, incremental: bool
    ) -> tuple[dict[str, tuple[int, ...] | None], set[str]]:
        """Before mutating: every delta lands on exactly the bits it was made against.

        Returns the fingerprint lanes of every resident tensor a delta changes, as the
        target read them (None where it cannot), and the names it could not check.
        """
        first_seen: dict[str, Entry] = {}
        # deltas land on the resident bits if any step changes them before a full write,
        # not only when the first step that lists the tensor does
        changing: set[str] = set()
        rewritten: set[str] = set()
        for step in steps:
            for entry, _ in step.changes:
                first_seen.setdefault(entry.name, entry)
                if entry.op == FULL:
                    rewritten.add(entry.name)
                elif entry.changed > 0 and entry.name not in rewritten:
                    changing.add(entry.name)
        raw: dict[str, tuple[int, ...]] = {}
        unverified: set[str] = set()
        for name, entry in first_seen.items():
            if entry.op == FULL:
                continue
            info = info_for(entry.dtype)
            if txn.spec(name) != (info.torch_dtype, tuple(entry.shape)):
                raise BaselineMismatchError(
                    f"the target lacks tensor {name!r} as {entry.dtype}{list(entry.shape)}; "
                    "pull into a fresh target"
                )
            if name not in changing and self.verify != "all":
                continue
            resident = txn.lanes(name)
            if resident is None:
                unverified.add(name)
            else:
                raw[name] = resident
        complete = txn.complete_lanes(raw)
        for name in raw:
            entry = first_seen[name]
            whole = complete.get(name)
            if whole is None:
                unverified.add(name)
                continue
            dtype = info_for(entry.dtype).torch_dtype
            if fingerprint_from_lanes(dtype, tuple(entry.shape), whole) != (
                entry.parent_fingerprint
            ):
                raise BaselineMismatchError(
                    f"tensor {name!r} in the target is not the bits of version "
                    f"{steps[0].loaded.record.version - 1}; it was changed outside dcr: "
                    "pull into a fresh target"
                )
        checked: dict[str, tuple[int, ...] | None] = {n: raw.get(n) for n in changing}
        return checked, unverified


def _merge_pieces(
    changes: list[tuple[Entry, DecodedDelta]], manifests: list[Manifest]
) -> list[tuple[Entry, DecodedDelta]]:
    """The pieces of one tensor (FORMAT.md §4.8) as whole-tensor changes, one per op.

    Full pieces must partition the tensor; the positions of changed pieces must not
    overlap (their unchanged parts are checked by the fingerprints, whose lanes add up).
    """
    if not any(entry.piece is not None for entry, _ in changes):
        return changes
    combined = tensor_changes(manifests)
    out: list[tuple[Entry, DecodedDelta] | str] = []
    pieces: dict[str, list[tuple[Entry, DecodedDelta]]] = {}
    for entry, delta in changes:
        if entry.piece is None:
            out.append((entry, delta))
        else:
            if entry.name not in pieces:
                out.append(entry.name)  # keeps the order of first appearance
            pieces.setdefault(entry.name, []).append((entry, delta))
    merged: list[tuple[Entry, DecodedDelta]] = []
    for item in out:
        if not isinstance(item, str):
            merged.append(item)
            continue
        change = combined[item]
        parts = pieces[item]
        numel = 1
        for dim in change.shape:
            numel *= dim
        info = info_for(change.dtype)
        positions = torch.cat([d.positions for _, d in parts if d.positions is not None])
        values = torch.cat([d.values for _, d in parts])
        order = torch.argsort(positions)
        positions, values = positions[order], values[order]
        if change.full:
            if positions.numel() != numel or not torch.equal(
                positions, torch.arange(numel, dtype=positions.dtype)
            ):
                raise SchemaError(f"the full pieces of tensor {item!r} do not cover it exactly")
            entry = Entry(
                name=item,
                dtype=change.dtype,
                shape=change.shape,
                op=FULL,
                changed=numel,
                fingerprint=change.fingerprint,
            )
            merged.append((entry, DecodedDelta(FULL, None, values.to(info.bits_dtype))))
            continue
        if positions.numel() > 1 and bool((positions[1:] == positions[:-1]).any()):
            raise SchemaError(f"pieces of tensor {item!r} change the same element twice")
        ops = sorted({e.op for e, d in parts if e.changed > 0}) or [XOR]
        for op in ops:
            mine = torch.cat(
                [d.positions for e, d in parts if e.op == op and d.positions is not None]
                or [torch.empty(0, dtype=torch.int64)]
            )
            keep = torch.isin(positions, mine)
            entry = Entry(
                name=item,
                dtype=change.dtype,
                shape=change.shape,
                op=op,
                changed=int(keep.sum()),
                fingerprint=change.fingerprint,
                parent_fingerprint=change.parent_fingerprint,
            )
            merged.append((entry, DecodedDelta(op, positions[keep], values[keep])))
    return merged


def _check_continuity(
    parent: dict[str, TensorState], manifests: list[Manifest], version: int
) -> None:
    """A delta keeps every tensor of its parent and starts each change from the parent's bits
    (pieces combined: their summed lanes give the parent fingerprint, FORMAT.md §4.8)."""
    listed = tensor_changes(manifests)
    missing = sorted(set(parent) - set(listed))
    if missing:
        raise ChainBrokenError(
            f"delta version {version} drops tensor {missing[0]!r} of its parent; "
            "the store is corrupt: run `dcr verify`"
        )
    for name, entry in listed.items():
        if entry.full:
            continue
        row = parent.get(name)
        if (
            row is None
            or row.dtype != entry.dtype
            or row.shape != tuple(entry.shape)
            or row.fingerprint != entry.parent_fingerprint
        ):
            raise ChainBrokenError(
                f"version {version} changes tensor {name!r} from bits its parent does not "
                "hold; the store is corrupt: run `dcr verify`"
            )


def _decode_entry(
    entry: Entry, manifest: Manifest, streams: dict[tuple[int, int], dict[str, memoryview]]
) -> DecodedDelta:
    info = info_for(entry.dtype)
    numel = 1
    for dim in entry.shape:
        numel *= dim

    def stream(ref) -> tuple[str, memoryview] | None:  # type: ignore[no-untyped-def]
        if ref is None:
            return None
        shard = streams.get((manifest.rank, ref.shard))
        if shard is None or ref.key not in shard:
            raise ShardError(
                f"stream {ref.key!r} of tensor {entry.name!r} is missing from its shard"
            )
        return ref.coding, shard[ref.key]

    return decode_delta(
        OVERWRITE if entry.op == FULL and entry.piece is not None else entry.op,  # a region
        info,
        numel,
        entry.changed,
        positions=stream(entry.positions),
        values=stream(entry.values),
    )
