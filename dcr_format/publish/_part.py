"""What a writer rank contributes to a publish, and the pieces every way of contributing shares.

:class:`~dcr_format.DeltaWriter` runs the publish (attempt id, reader records, commit);
a :class:`Part` is given to it and turns the tensors passed to ``publish`` into this
rank's manifest and shards, and keeps the baseline they are diffed against. There are
two: the canonical part (``publish/_canonical.py``: canonical tensors, owned by name) and
the projection part (``publish/_projection.py``: local tensors placed by a
:class:`~dcr_format.chain.layout.Layout`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from dcr_format.chain.chain import Chain, LoadedRecord, TensorState, sha256_hex, shard_key
from dcr_format.delta.delta import EncodedTensor
from dcr_format.errors import ArgumentError, MissingTensorError
from dcr_format.format.dtypes import info_for
from dcr_format.format.schema import (
    STEP_LIMIT,
    Entry,
    Manifest,
    PositionsRef,
    ShardRef,
    ValuesRef,
    check_tensor_name,
)
from dcr_format.format.shard import encode_shard
from dcr_format.store.store import Store

Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""What ``publish`` takes: a mapping, or ``(name, tensor)`` pairs (streamed once)."""


def pairs(tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of ``tensors``, in the order given, each checked by
    :func:`check_input` as it comes."""
    items: Iterable[object] = tensors.items() if isinstance(tensors, Mapping) else tensors
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ArgumentError(
                f"publish takes a mapping of names to tensors or (name, tensor) pairs, "
                f"not an item of type {type(item).__name__}"
            )
        name, tensor = item
        check_input(name, tensor)
        del item
        yield name, tensor
        del tensor  # a stream's tensor is let go before the next one is asked for


def check_input(name: object, tensor: object) -> None:
    """Refuse a pair that no version can carry (a bad name, something not a dense tensor
    with data, a dtype the format lacks) with a named error, before it is coded."""
    check_tensor_name(name)
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentError(
            f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor; pass tensors"
        )
    if tensor.is_meta:
        raise ArgumentError(
            f"tensor {name!r} is on the meta device and holds no data; "
            "load its values before publishing"
        )
    if tensor.layout != torch.strided:
        raise ArgumentError(
            f"tensor {name!r} has the {tensor.layout} layout; publish it dense (to_dense())"
        )
    info_for(tensor.dtype)  # refuses dtypes the format cannot carry


def check_step(step: object) -> None:
    """Refuse a trainer step a commit record cannot hold (not an integer, or past
    ``STEP_LIMIT`` either way) with :class:`ArgumentError`."""
    if step is None:
        return
    if not isinstance(step, int) or isinstance(step, bool):
        raise ArgumentError(
            f"step {step!r} is a {type(step).__name__}, not an int; "
            "pass the trainer's step as an int (or None)"
        )
    if not -STEP_LIMIT <= step <= STEP_LIMIT:
        raise ArgumentError(
            f"step {step} is outside the range a commit record holds "
            "(-2**62..2**62); pass the trainer's step"
        )


def check_publish(tensors: Tensors, step: object = None) -> None:
    """Check the step, and every pair of a mapping, list or tuple, before a publish begins,
    so that bad input leaves nothing in the store (pairs streamed once are checked as they
    come)."""
    check_step(step)
    if isinstance(tensors, (torch.nn.Module, torch.Tensor, str, bytes)) or not isinstance(
        tensors, Iterable
    ):
        hint = "model.state_dict()" if isinstance(tensors, torch.nn.Module) else "{name: tensor}"
        raise ArgumentError(
            "publish takes a mapping of names to tensors or (name, tensor) pairs, not a "
            f"{type(tensors).__name__}; pass {hint}"
        )
    if isinstance(tensors, (Mapping, list, tuple)):
        for _ in pairs(tensors):
            pass


def encoded_entry(
    name: str,
    tensor: torch.Tensor,
    encoded: EncodedTensor,
    index: int,
    add: Callable[[str, bytes], int],
    fingerprint: str,
    parent_fingerprint: str | None,
) -> Entry:
    """The manifest entry of tensor ``name`` coded as ``encoded``, the ``index``-th entry of
    its manifest: ``add(key, stream)`` queues each of its streams and returns the index of
    the shard it lands in (:meth:`ShardWriter.add`)."""
    positions = values = None
    if encoded.positions is not None:
        assert encoded.positions_coding is not None
        key = f"{index}.p"
        positions = PositionsRef(
            shard=add(key, encoded.positions), key=key, coding=encoded.positions_coding
        )
    if encoded.values is not None:
        assert encoded.values_coding is not None
        key = f"{index}.v"
        values = ValuesRef(shard=add(key, encoded.values), key=key, coding=encoded.values_coding)
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
        parent_fingerprint=parent_fingerprint,
    )


class ShardWriter:
    """Collects entry streams into shards of bounded size; each full shard is compressed and
    uploaded on a background thread while the caller encodes the next tensors.

    At most one shard is in flight (the next one waits for it), so memory stays at about two
    shards. :meth:`finish` uploads the last one and re-raises any upload failure; the
    caller then calls :meth:`close` (in a ``finally``).
    """

    def __init__(self, store: Store, key: Callable[[int], str], limit: int, level: int) -> None:
        self.store, self.key = store, key  # key: the store key of shard ``index``
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
        key = self.key(index)
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


@dataclass(frozen=True)
class Attempt:
    """One rank's share of one publish attempt: where its objects go, what its manifest says."""

    store: Store
    chain_id: str
    version: int
    kind: Literal["base", "delta"]
    id: str
    rank: int
    world_size: int
    shard_bytes: int
    zstd_level: int
    overwrite: frozenset[str]
    """Tensors readers asked to receive as ``overwrite`` (reader records, FORMAT.md §3.6)."""
    features: frozenset[str] = frozenset()
    """The writer features this publish uses (FORMAT.md §12), the same on every rank."""
    baseline_names: frozenset[str] | None = None
    """The tensors that may use the codings decoded against the old bits (every recorded
    reader reads their old bits, FORMAT.md §3.6); None: every tensor but those of
    ``baseline_except``."""
    baseline_except: frozenset[str] = frozenset()
    """Tensors that may not use them: some recorded reader reads the old bits of every
    tensor but these."""
    changed_names: frozenset[str] | None = None
    changed_except: frozenset[str] = frozenset()
    """As ``baseline_names`` and ``baseline_except``, the tensors that may use ``ulp`` (every
    recorded reader reads the old bits of each changed element it holds, FORMAT.md §3.6)."""

    @property
    def base(self) -> bool:
        """Whether this version is a base (every entry ``full``)."""
        return self.kind == "base"

    def check_none_dropped(self, missing: Sequence[str]) -> None:
        """Refuse a delta that leaves out ``missing``, tensors of the previous version this
        rank holds (a delta cannot drop a tensor; a base can)."""
        if missing and not self.base:
            raise MissingTensorError(
                f"{len(missing)} tensors of version {self.version - 1} were not given "
                f"(first: {missing[0]!r}); pass every tensor each step, or publish this "
                "version as a base to drop them (DeltaWriter.publish(..., base=True), "
                "dcr publish --base)"
            )

    def shards(self) -> ShardWriter:
        """A shard writer for this rank's shards of the attempt."""
        return ShardWriter(
            self.store,
            lambda index: shard_key(self.version, self.id, self.rank, index),
            self.shard_bytes,
            self.zstd_level,
        )

    def manifest(
        self, shards: ShardWriter, entries: list[Entry], features: tuple[str, ...] = ()
    ) -> Manifest:
        """This rank's manifest, once every shard is up."""
        return Manifest(
            required_features=features,
            chain_id=self.chain_id,
            version=self.version,
            kind=self.kind,
            attempt=self.id,
            rank=self.rank,
            world_size=self.world_size,
            shards=tuple(shards.shards),
            entries=tuple(entries),
        )


@dataclass(frozen=True)
class Written:
    """A rank's part of a publish, uploaded but not committed."""

    manifest: Manifest
    advance: Callable[[], None]
    """Brings the part's baseline to the written bits; called once the commit exists."""
    revert: Callable[[], None] = lambda: None
    """Puts back the baseline's bits where writing advanced them early (the CPU diff's own
    pass does); called when the version does not commit."""


class Part(Protocol):
    """How a writer rank turns the tensors given to ``publish`` into its manifest."""

    @property
    def baseline(self) -> Mapping[str, torch.Tensor]:
        """The bits the next publish is diffed against (those of the last commit)."""
        ...

    def owns(self, name: str) -> bool:
        """Whether this rank publishes (some of) canonical tensor ``name``."""
        ...

    def check_manifest(self, manifest: Manifest, rank: int, key: str) -> None:
        """Refuse a manifest of rank ``rank`` this kind of part could not have written
        (the committer checks every rank's)."""
        ...

    def restore(self, chain: Chain, latest: LoadedRecord, table: dict[str, TensorState]) -> None:
        """Take the baseline of committed version ``latest`` (whose state is ``table``)."""
        ...

    def write(self, tensors: Tensors, attempt: Attempt) -> Written:
        """Diff ``tensors`` against the baseline and upload this rank's shards."""
        ...
