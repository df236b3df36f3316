"""The rollout side: plan, fetch, verify, stage, and only then apply."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from dcr_format.chain import (
    Chain,
    LoadedRecord,
    TensorState,
    get_verified,
    state_table,
    table_fingerprint,
)
from dcr_format.codec.delta import FULL, DecodedDelta, apply_delta, decode_delta, undo_delta
from dcr_format.codec.dtypes import bits_view, info_for
from dcr_format.codec.shard import decode_shard
from dcr_format.errors import (
    ApplyError,
    BaselineMismatchError,
    ChainBrokenError,
    FingerprintMismatchError,
    IntegrityError,
    ShardError,
    TargetError,
    VersionNotFoundError,
)
from dcr_format.fingerprint import (
    fingerprint_from_lanes,
    lanes_after_change,
    tensor_fingerprint,
    tensor_lanes,
)
from dcr_format.readers.targets import Resident, Target, Transaction
from dcr_format.schema import Entry, Manifest
from dcr_format.store import Store, open_store

MAX_SHARD_DECODED_BYTES = 16 << 30  # refuse to inflate a single shard past this


class SyncResult(BaseModel):
    """What one :meth:`DeltaReader.sync` did."""

    model_config = ConfigDict(frozen=True)

    version: int
    previous: int | None
    applied_versions: tuple[int, ...]
    payload_bytes: int
    fetch_seconds: float
    apply_seconds: float


@dataclass(frozen=True)
class _Step:
    """One version of a plan, fetched and decoded."""

    loaded: LoadedRecord
    table: dict[str, TensorState]
    changes: list[tuple[Entry, DecodedDelta]]


class DeltaReader:
    """Keeps a target at a version of the chain in ``store``, bit-exact.

    ``select`` limits the reader to the canonical names it returns True for (a
    partial target, such as one writer rank's baseline). ``verify`` is
    ``"touched"`` (check fingerprints of tensors a sync changes, before and after)
    or ``"all"`` (every selected tensor).
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
    ) -> None:
        if verify not in ("touched", "all"):
            raise ValueError("verify must be 'touched' or 'all'")
        self.store = open_store(store)
        self.chain = Chain(self.store)
        self.target = target
        self.select = select or (lambda name: True)
        self.verify = verify
        self.max_workers = max_workers
        self.max_shard_bytes = max_shard_bytes
        self._last_table: tuple[str, dict[str, TensorState]] | None = None  # (record sha, table)

    def versions(self) -> list[int]:
        """Committed versions of the chain, ascending."""
        return self.chain.versions()

    # --- planning --------------------------------------------------------------------------

    def _plan(self, resident: Resident | None, goal: int, committed: list[int]) -> list[int]:
        have = set(committed)
        if resident is not None and all(v in have for v in range(resident.version, goal + 1)):
            return list(range(resident.version + 1, goal + 1))
        for version in range(goal, -1, -1):
            if version in have and self.chain.record(version).record.kind == "base":
                return list(range(version, goal + 1))
        raise VersionNotFoundError(
            f"no base at or before version {goal} is left in {self.store.url}; "
            "compact the chain or pick a newer version"
        )

    def sync(self, to: int | None = None) -> SyncResult:
        """Bring the target to version ``to`` (default: the newest committed version).

        Everything is fetched and verified before the target is touched; a failure
        during the apply rolls every change back.
        """
        header = self.chain.header
        resident = self.target.resident()
        if resident is not None and resident.chain_id != header.chain_id:
            raise TargetError(
                f"the target holds chain {resident.chain_id}, the store {header.chain_id}; "
                "use a fresh target for this store"
            )
        committed = self.chain.versions()
        if not committed:
            raise VersionNotFoundError(f"{self.store.url} has no committed version yet")
        goal = committed[-1] if to is None else to
        if goal not in committed:
            raise VersionNotFoundError(f"version {goal} is not committed in {self.store.url}")
        previous = resident.version if resident is not None else None
        if previous == goal:
            return SyncResult(
                version=goal,
                previous=previous,
                applied_versions=(),
                payload_bytes=0,
                fetch_seconds=0.0,
                apply_seconds=0.0,
            )
        if previous is not None and previous > goal:
            raise TargetError(
                f"the target is at version {previous}, newer than {goal}; "
                "replay older versions into a fresh target"
            )
        plan = self._plan(resident, goal, committed)
        # incremental: the plan continues from the resident version (else it starts at a base)
        incremental = (
            resident is not None
            and plan[0] == resident.version + 1
            and resident.version in set(committed)
        )
        started = time.perf_counter()
        steps, payload = self._fetch(plan, resident if incremental else None)
        fetched = time.perf_counter()
        self._apply(steps, resident, incremental)
        done = time.perf_counter()
        return SyncResult(
            version=goal,
            previous=previous,
            applied_versions=tuple(plan),
            payload_bytes=payload,
            fetch_seconds=fetched - started,
            apply_seconds=done - fetched,
        )

    # --- fetch and stage ---------------------------------------------------------------------

    def _fetch(self, plan: list[int], resident: Resident | None) -> tuple[list[_Step], int]:
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
                steps.append(_Step(loaded, table, changes))
                parent, parent_table = loaded, table
        return steps, payload

    def _decode_version(
        self, manifests: list[Manifest], pool: ThreadPoolExecutor
    ) -> tuple[list[tuple[Entry, DecodedDelta]], int]:
        jobs = []
        for manifest in manifests:
            wanted = [e for e in manifest.entries if self.select(e.name) and e.changed > 0]
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
                if not self.select(entry.name):
                    continue
                changes.append((entry, _decode_entry(entry, manifest, streams)))
        return changes, nbytes

    # --- verify and apply ---------------------------------------------------------------------

    def _apply(self, steps: list[_Step], resident: Resident | None, incremental: bool) -> None:
        txn = self.target.begin()
        undo: list[tuple[torch.Tensor, DecodedDelta, torch.Tensor | None]] = []
        try:
            lanes = self._check_baseline(steps, txn, incremental)
            touched = set(lanes)
            for step in steps:
                if step.loaded.record.kind == "base" or not incremental:
                    for name in txn.names():
                        if self.select(name) and name not in step.table:
                            txn.drop(name)
                for entry, delta in step.changes:
                    info = info_for(entry.dtype)
                    if entry.op == FULL:
                        tensor = txn.full_tensor(entry.name, info.torch_dtype, tuple(entry.shape))
                    else:
                        tensor = txn.tensor(entry.name)
                        assert tensor is not None  # checked by _check_baseline
                    if entry.changed == 0:
                        continue
                    if entry.op == FULL:
                        saved = apply_delta(tensor, delta)
                        undo.append((tensor, delta, saved))
                        lanes[entry.name] = tensor_lanes(tensor)
                    else:
                        # the fingerprint follows the change: O(changed), read back from the target
                        flat = bits_view(tensor).reshape(-1)
                        assert delta.positions is not None
                        delta = replace(
                            delta,
                            positions=delta.positions.to(flat.device),
                            values=delta.values.to(flat.device),
                        )
                        assert delta.positions is not None
                        before = flat[delta.positions]
                        saved = apply_delta(tensor, delta)
                        undo.append((tensor, delta, saved))
                        lanes[entry.name] = lanes_after_change(
                            lanes[entry.name], delta.positions, before, flat[delta.positions]
                        )
                    touched.add(entry.name)
            final = steps[-1].table
            # tensors a later base removed are gone, not checked
            selected = {n for n in final if self.select(n)}
            check = selected if self.verify == "all" else touched & selected
            for name in sorted(check):
                tensor = txn.tensor(name)
                if tensor is None:
                    found = None
                elif self.verify == "all":
                    found = tensor_fingerprint(tensor)
                else:
                    found = fingerprint_from_lanes(tensor.dtype, tensor.shape, lanes[name])
                if found != final[name].fingerprint:
                    raise FingerprintMismatchError(
                        f"tensor {name!r} does not match version {steps[-1].loaded.record.version} "
                        "after applying; the target was rolled back: run `dcr verify` on the store"
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
            for tensor, delta, saved in reversed(undo):
                undo_delta(tensor, delta, saved)
            txn.abort()
            if isinstance(exc, (IntegrityError, TargetError)):
                raise
            if isinstance(exc, Exception):
                raise ApplyError(f"applying failed and was rolled back: {exc}") from exc
            raise

    def _check_baseline(
        self, steps: list[_Step], txn: Transaction, incremental: bool
    ) -> dict[str, tuple[int, ...]]:
        """Before mutating: every delta lands on exactly the bits it was made against.

        Returns the fingerprint lanes of every resident tensor a delta changes.
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
        checked: dict[str, tuple[int, ...]] = {}
        for name, entry in first_seen.items():
            if entry.op == FULL:
                continue
            tensor = txn.tensor(name)
            info = info_for(entry.dtype)
            if (
                tensor is None
                or tensor.dtype != info.torch_dtype
                or tuple(tensor.shape) != tuple(entry.shape)
            ):
                raise BaselineMismatchError(
                    f"the target lacks tensor {name!r} as {entry.dtype}{list(entry.shape)}; "
                    "pull into a fresh target"
                )
            if not tensor.is_contiguous():
                raise TargetError(
                    f"target tensor {name!r} is not contiguous; pass contiguous tensors"
                )
            if name not in changing and self.verify != "all":
                continue
            resident = tensor_lanes(tensor)
            if fingerprint_from_lanes(tensor.dtype, tensor.shape, resident) != (
                entry.parent_fingerprint
            ):
                raise BaselineMismatchError(
                    f"tensor {name!r} in the target is not the bits of version "
                    f"{steps[0].loaded.record.version - 1}; it was changed outside dcr: "
                    "pull into a fresh target"
                )
            if name in changing:
                checked[name] = resident
        return checked


def _check_continuity(
    parent: dict[str, TensorState], manifests: list[Manifest], version: int
) -> None:
    """A delta keeps every tensor of its parent and starts each change from the parent's bits."""
    listed = {e.name: e for m in manifests for e in m.entries}
    missing = sorted(set(parent) - set(listed))
    if missing:
        raise ChainBrokenError(
            f"delta version {version} drops tensor {missing[0]!r} of its parent; "
            "the store is corrupt: run `dcr verify`"
        )
    for name, entry in listed.items():
        if entry.op == FULL:
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
        entry.op,
        info,
        numel,
        entry.changed,
        positions=stream(entry.positions),
        values=stream(entry.values),
    )
