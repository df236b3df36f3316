"""Fetching a plan: parallel verified gets of its shards, inflated and decoded.

Each :class:`~dcr_format.sync._plan.DecodeJob` runs on a worker of the reader's
pool: it fetches its shards through the store interface (a relay store serves them
from a peer), checks each against the size and sha256 its manifest records, inflates
them within the reader's decode budget, decodes the job's entries and drops the
shards, so only decoded deltas outlive the job. Nothing here touches the target.

With ``early`` (:func:`fetch_changes`), the calling thread receives each entry as soon as
its job decoded it and may complete it against the live target (read only) while the
workers decode the entries after it, instead of waiting for the whole version; it is also
told once every job has fetched and verified its shards, so that it may start applying
the entries decoded from then on while the workers decode the rest. Entries it says it
takes later (small tensors') stay with their job until the job ends.

A target that keeps the goal's checkpoint files gets those it lacks, each checked against
its size and sha256 (:func:`fetch_files`), before any shard; a sync that decodes a base or
several versions holds at most an eighth of the model inflated (:class:`SyncBudget`).
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dcr_format.chain.chain import TensorChange, TensorState, get_verified, tensor_changes
from dcr_format.codings.rans import decode_rans_pair
from dcr_format.delta.delta import (
    FULL,
    OVERWRITE,
    XOR,
    DecodedDelta,
    Delta,
    decode_delta,
    rans_part,
)
from dcr_format.errors import SchemaError, ShardError
from dcr_format.format.budget import DecodeBudget
from dcr_format.format.dtypes import info_for
from dcr_format.format.schema import Entry, Manifest
from dcr_format.format.shard import decode_shard
from dcr_format.store.store import Store
from dcr_format.sync._plan import DecodeJob, FetchPlan, StepPlan
from dcr_format.system.memory import give_back_freed

# a pool's map: runs the function over the items in parallel, results in order
MapFn = Callable[
    [Callable[[DecodeJob], dict[int, Delta]], Iterable[DecodeJob]],
    Iterable[dict[int, Delta]],
]
Streams = dict[tuple[int, int], dict[str, memoryview]]
# given each whole entry as soon as it is decoded (on the calling thread): the delta to keep
Take = Callable[[Entry, Delta], Delta]


@dataclass(frozen=True)
class Early:
    """How :func:`fetch_changes` hands decoded entries to the calling thread while its jobs
    run: they run on ``pool``; ``take`` gets each whole entry as it is decoded;
    ``verified``, where given, is called once every job has fetched and checked all of its
    shards and none failed so far (before the entries decoded after that are taken), and
    from then on every whole entry is taken, also those decoded after the last job ended
    (else those are left to the caller); ``decoders``, where given, is how many jobs
    decode at once (the other cores are left for what is done with the entries);
    ``later``, where given, says which entries are never taken but left to the caller:
    the jobs keep them, so the calling thread is not woken for them while it waits."""

    pool: Executor
    take: Take
    verified: Callable[[], None] | None = None
    decoders: int | None = None
    later: Callable[[Entry], bool] | None = None


@dataclass(frozen=True)
class FetchedStep:
    """One version of a plan, fetched and decoded: each wanted tensor's change (pieces
    merged into whole-tensor changes)."""

    plan: StepPlan
    changes: list[tuple[Entry, Delta]]

    @property
    def table(self) -> dict[str, TensorState]:
        """The version's state table."""
        return self.plan.table

    @property
    def base(self) -> bool:
        """Whether the step is a full snapshot (tensors it lacks are dropped)."""
        return self.plan.base


def fetch_step(
    store: Store,
    step: StepPlan,
    map_fn: MapFn,
    budget: DecodeBudget,
    *,
    early: Early | None = None,
) -> FetchedStep:
    """Fetch, verify and decode one step of a plan (``map_fn``: a thread pool's map;
    ``early``: see :func:`fetch_changes`)."""
    return FetchedStep(step, fetch_changes(store, step.fetch, map_fn, budget, early=early))


@dataclass(frozen=True)
class CheckpointFiles:
    """A version's checkpoint files (FORMAT.md §3.5.6) for a target that keeps them: every
    file's sha256 by name, and the verified bytes of those the target does not hold."""

    listed: Mapping[str, str]
    fetched: Mapping[str, bytes]


def fetch_files(
    store: Store,
    held: Mapping[str, str] | None,
    manifests: tuple[Manifest, ...],
    pool: Executor,
) -> CheckpointFiles | None:
    """The goal's checkpoint files, for a target that keeps them (``held``: the sha256 of
    each file it holds, by name; None: it keeps none): each one it does not hold with the
    same sha256 is fetched and checked (size, then sha256)."""
    if held is None:
        return None
    refs = [ref for manifest in manifests if manifest.rank == 0 for ref in manifest.files]
    wanted = [ref for ref in refs if held.get(ref.name) != ref.sha256]
    found = pool.map(
        lambda ref: get_verified(store, ref.key, size=ref.size, sha256=ref.sha256),
        wanted,
    )
    fetched = {ref.name: data for ref, data in zip(wanted, found, strict=True)}
    return CheckpointFiles({ref.name: ref.sha256 for ref in refs}, fetched)


class SyncBudget(DecodeBudget):
    """One sync's share of the reader's decode budget: at most ``limit`` bytes of its
    inflated shards at once (an eighth of the model: a base's shards are as big as the
    model, and decoding all of them at once would hold it twice), within ``shared``; each
    job gives back the heap pages it freed."""

    gives_back = True

    def __init__(self, shared: DecodeBudget, limit: int) -> None:
        super().__init__(max(1, limit))
        self.shared = shared

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        with super().hold(nbytes), self.shared.hold(nbytes):
            yield


def fetch_changes(
    store: Store,
    plan: FetchPlan,
    map_fn: MapFn,
    budget: DecodeBudget,
    *,
    early: Early | None = None,
) -> list[tuple[Entry, Delta]]:
    """Run every job of ``plan`` in parallel; each wanted tensor's change, pieces merged.

    ``early``: the jobs run on its pool and each entry that is not a piece is handed to its
    ``take`` on this thread as soon as its job decoded it (in the order they are decoded),
    while jobs are still running: this thread would otherwise wait for them (the changes
    after that are left to the caller, which completes each just before it writes it,
    while its bits are in cache). The change keeps what ``take`` returns. Its ``verified``
    is called on this thread once every job has verified its shards. Once a job fails,
    nothing more is handed over or called; the failure of the first failed job (in job
    order) is raised once every job has ended, as without ``early``. A failure of ``take``
    or ``verified`` is raised once the running jobs have ended.

    What the plan's entries decode to is refused past the budget's ceiling before anything
    is fetched (:class:`~dcr_format.errors.DecodeLimitError`).
    """
    budget.refuse_over(plan.output_bytes, "this version's entries")  # before any fetch
    if early is None:
        decoded: dict[int, Delta] = {}
        for part in map_fn(lambda job: _run_job(store, plan, job, budget), plan.jobs):
            decoded.update(part)
    else:
        decoded = _run_jobs_early(store, plan, budget, early)
    changes = [
        (entry, decoded[i] if i in decoded else _decode_entry(entry, manifest, {}))
        for i, (manifest, entry) in enumerate(plan.wanted)
    ]
    return merge_pieces(changes, list(plan.manifests))


def _run_jobs_early(
    store: Store, plan: FetchPlan, budget: DecodeBudget, early: Early
) -> dict[int, Delta]:
    """:func:`fetch_changes`'s jobs on ``early.pool``, each decoded entry handed to
    ``early.take`` here."""
    # a decoded entry; a job that ended (False: it failed, its future holds the error); or
    # None: a job verified its shards
    ready: queue.SimpleQueue[tuple[int, Delta] | bool | None] = queue.SimpleQueue()
    running = [len(plan.jobs)]
    lock = threading.Lock()
    gate = None if early.decoders is None else threading.Semaphore(early.decoders)

    def run(job: DecodeJob) -> dict[int, Delta]:
        ok = False
        try:
            tell = _Tell(lambda i, d: ready.put((i, d)), lambda: ready.put(None), gate, early.later)
            done = _run_job(store, plan, job, budget, tell)
            ok = True
            return done
        finally:
            with lock:
                running[0] -= 1
            ready.put(ok)

    futures = [early.pool.submit(run, job) for job in plan.jobs]
    decoded: dict[int, Delta] = {}
    try:
        ended, verified, failed, opened = 0, 0, False, False
        while ended < len(futures):
            item = ready.get()
            if item is None:
                verified += 1
                if verified == len(futures) and not failed and early.verified is not None:
                    early.verified()
                    opened = True
                continue
            if isinstance(item, bool):
                ended += 1
                failed = failed or not item
                continue
            index, delta = item
            entry = plan.wanted[index][1]
            # every job ended: nothing to wait for any more (unless ``verified`` was called)
            late = failed or not (running[0] or opened)
            keep = late or entry.piece is not None
            decoded[index] = delta if keep else early.take(entry, delta)
            del item, delta  # what was taken is not held here while waiting for the next
    except BaseException:
        for future in futures:  # the running ones end with the pool
            future.cancel()
        raise
    for future in futures:
        decoded.update(future.result())  # the first failed job's error, in job order
    return decoded


@dataclass(frozen=True)
class _Tell:
    """What a job of :func:`_run_jobs_early` tells as it goes: each ``decoded`` entry,
    that its shards are ``verified`` (before its first entry is decoded); ``gate``, where
    given, is held while it decodes."""

    decoded: Callable[[int, Delta], None]
    verified: Callable[[], None]
    gate: threading.Semaphore | None = None
    later: Callable[[Entry], bool] | None = None

    def keeps(self, entry: Entry) -> bool:
        """Whether the job keeps ``entry``'s change for the caller (returned with the job's
        result) instead of telling it as it is decoded."""
        return self.later is not None and self.later(entry)


def _run_job(
    store: Store,
    plan: FetchPlan,
    job: DecodeJob,
    budget: DecodeBudget,
    tell: _Tell | None = None,
) -> dict[int, Delta]:
    """One job: fetch and inflate its shards within the budget, decode its entries (see
    :class:`_Tell` for what it tells, where given)."""
    with budget.hold(job.decoded_bytes):
        streams: Streams = {}
        for shard in job.shards:
            stored = get_verified(store, shard.path, size=shard.size, sha256=shard.sha256)
            streams[(shard.rank, shard.index)] = decode_shard(
                stored, decoded_size=shard.decoded_size, limits=shard.limits
            )
            del stored
        if tell is not None:
            tell.verified()
        gate = contextlib.nullcontext() if tell is None or tell.gate is None else tell.gate
        wanted = plan.wanted
        decoded: dict[int, Delta] = {}
        entries = list(job.entries)
        for k in range(0, len(entries), 2):  # two at a time: their rans values decode at once
            pair = entries[k : k + 2]
            with gate:
                ahead = _symbols_ahead([wanted[i] for i in pair], streams)
                for i, symbols in zip(pair, ahead, strict=True):
                    decoded[i] = _decode_entry(wanted[i][1], wanted[i][0], streams, symbols)
                    if tell is not None and i != entries[-1] and not tell.keeps(wanted[i][1]):
                        # handed over as soon as decoded: not kept here (the caller keeps what
                        # it takes), so a base's next entry is decoded while this one is written
                        tell.decoded(i, decoded.pop(i))
        del streams  # decoded deltas are copies: the shards go before the budget
        if budget.gives_back:  # else another worker's next shard adds to this one's freed pages
            give_back_freed()
        if tell is not None:  # the last entry once the shards are gone: they are not held
            for i in list(decoded):  # while it is written
                if not tell.keeps(wanted[i][1]):
                    tell.decoded(i, decoded.pop(i))
    return decoded


def _stream(
    entry: Entry, manifest: Manifest, streams: Streams, ref: Any
) -> tuple[str, memoryview] | None:
    """The coding and bytes of one of an entry's streams (``ref``: its positions or values)."""
    if ref is None:
        return None
    shard = streams.get((manifest.rank, ref.shard))
    if shard is None or ref.key not in shard:
        raise ShardError(f"stream {ref.key!r} of tensor {entry.name!r} is missing from its shard")
    return ref.coding, shard[ref.key]


def _op(entry: Entry) -> str:
    """The op an entry's streams decode as: a piece of a full tensor is a region's overwrite."""
    return OVERWRITE if entry.op == FULL and entry.piece is not None else entry.op


def _symbols_ahead(
    items: list[tuple[Manifest, Entry]], streams: Streams
) -> list[np.ndarray | None]:
    """The ``rans`` values of two entries (``ulp`` or ``ulp-shift``) decoded at once
    (:func:`decode_rans_pair`: a stream alone waits on each symbol's chain of steps), or
    None for an entry left to :func:`decode_delta` alone: any other coding or count, a
    stream that breaks a rule (its error comes from there) or a single entry."""
    if len(items) != 2:
        return [None] * len(items)
    parts = []
    for manifest, entry in items:
        info = info_for(entry.dtype)
        try:
            values = _stream(entry, manifest, streams, entry.values)
        except ShardError:
            return [None, None]
        part = rans_part(_op(entry), info, entry.changed, values)
        if part is None:
            return [None, None]
        parts.append((part, entry.changed, info.width))
    (first, count, width), (second, count2, width2) = parts
    if width != width2:
        return [None, None]
    return list(decode_rans_pair((first, count), (second, count2), width=width))


def _decode_entry(
    entry: Entry, manifest: Manifest, streams: Streams, symbols: np.ndarray | None = None
) -> Delta:
    """Decode one entry from the inflated streams of its rank's shards (``symbols``: its
    ``rans`` values, where :func:`_symbols_ahead` decoded them)."""
    return decode_delta(
        _op(entry),
        info_for(entry.dtype),
        math.prod(entry.shape),
        entry.changed,
        positions=_stream(entry, manifest, streams, entry.positions),
        values=_stream(entry, manifest, streams, entry.values),
        symbols=symbols,
    )


def merge_pieces(
    changes: list[tuple[Entry, Delta]], manifests: list[Manifest]
) -> list[tuple[Entry, Delta]]:
    """The pieces of one tensor (FORMAT.md §4.8) as whole-tensor changes, one per op.

    Full pieces must partition the tensor; the positions of changed pieces must not
    overlap (their unchanged parts are checked by the fingerprints, whose lanes add up).
    """
    if not any(entry.piece is not None for entry, _ in changes):
        return changes
    combined = tensor_changes(manifests)
    order: list[tuple[Entry, Delta] | str] = []
    pieces: dict[str, list[tuple[Entry, Delta]]] = {}
    for entry, delta in changes:
        if entry.piece is None:
            order.append((entry, delta))
        else:
            if entry.name not in pieces:
                order.append(entry.name)  # keeps the order of first appearance
            pieces.setdefault(entry.name, []).append((entry, delta))
    merged: list[tuple[Entry, Delta]] = []
    for item in order:
        if isinstance(item, str):
            merged.extend(_merge_tensor(item, combined[item], pieces[item]))
        else:
            merged.append(item)
    return merged


def _merge_tensor(
    name: str, change: TensorChange, parts: list[tuple[Entry, Delta]]
) -> list[tuple[Entry, Delta]]:
    """One tensor's pieces (``change``: their combination) as one change per op."""
    numel = math.prod(change.shape)
    positions = torch.cat([d.positions for _, d in parts if d.positions is not None])
    values = torch.cat([d.values for _, d in parts])
    order = torch.argsort(positions)
    positions, values = positions[order], values[order]
    if change.full:
        if positions.numel() != numel or not torch.equal(
            positions, torch.arange(numel, dtype=positions.dtype)
        ):
            raise SchemaError(f"the full pieces of tensor {name!r} do not cover it exactly")
        entry = Entry(
            name=name,
            dtype=change.dtype,
            shape=change.shape,
            op=FULL,
            changed=numel,
            fingerprint=change.fingerprint,
        )
        bits = values.to(info_for(change.dtype).bits_dtype)
        return [(entry, DecodedDelta(FULL, None, bits))]
    if positions.numel() > 1 and bool((positions[1:] == positions[:-1]).any()):
        raise SchemaError(f"pieces of tensor {name!r} change the same element twice")
    merged: list[tuple[Entry, Delta]] = []
    for op in sorted({e.op for e, d in parts if e.changed > 0}) or [XOR]:
        mine = torch.cat(
            [d.positions for e, d in parts if e.op == op and d.positions is not None]
            or [torch.empty(0, dtype=torch.int64)]
        )
        keep = torch.isin(positions, mine)
        entry = Entry(
            name=name,
            dtype=change.dtype,
            shape=change.shape,
            op=op,
            changed=int(keep.sum()),
            fingerprint=change.fingerprint,
            parent_fingerprint=change.parent_fingerprint,
        )
        merged.append((entry, DecodedDelta(op, positions[keep], values[keep])))
    return merged
