"""Writer-side overlap: scan tensor i+1 on the device while tensor i leaves it and is coded.

:class:`DeviceDiffPipeline` takes ``(key, new, old)`` (or ``(key, new, old, op)``)
items and yields, in order, each item's compacted change with CPU copies of its
payload. On CUDA, per item, on one of two side streams:

1. *scan*: the counting kernel, the prefix sum of the per-block counts and the
   copy of the changed-element total into pinned memory are queued; nothing waits;
2. *compact*: once that total is on the host (the only wait before compaction),
   the compaction kernel and the device-to-host copies of positions and values
   into pinned buffers are queued;
3. the item is yielded once its copies landed.

Item i+1's scan is queued (on the other stream) right after item i's compaction
and copy-out, before the pipeline waits for those copies, so the scan of i+1
runs on the GPU while i is copied out and then coded on the host (rice/ranges,
byte planes, zstd) by the consumer. What does not overlap: the compaction of
i+1 waits for its own total (one short host wait per tensor), and host coding of
different tensors is sequential. On CPU one fused pass
(:meth:`dcr_format.delta.backend.Backend.diff_with_lanes`) finds the change and also sums
its fingerprint lane deltas, so the writer needs no second pass over the changed
elements. Each item's backend is chosen once, when its scan starts, and codes it to the
end. Results equal :meth:`dcr_format.delta.backend.Backend.diff` bit for bit.

:func:`encode_stream` feeds the pipeline into the host coder and yields exactly
what :func:`dcr_format.delta.delta.encode_tensor` returns for each item. A stream of CPU
tensors is instead coded :data:`CODING_THREADS` tensors at a time on a pool of threads
(yielded in order): much of a tensor's coding runs on one core (model choice, the rANS
coder, the Python between kernels), so one tensor at a time left the other core idle.
Where the pool's threads are as many as numba's, each codes with the serial twins of
the kernels (:func:`dcr_format.kernels._launch.serial_kernels`): the pool then fills the
cores and a parallel region would only contend with it. On a 1 GB model on two vCPUs
that took a publish from 0.46 to 0.40 s at 1% change and from 1.11 to 0.80 s at 5%.
Small tensors (:data:`~dcr_format.system.pools.ONE_THREAD_ELEMENTS`) are coded on the
calling thread, in their turn, while the pool codes the large ones: their coding is
mostly Python, which a second thread only slows (the two hand the interpreter's lock to
each other). A CPU tensor, on the pool, on the calling thread or in a stream of one
coding thread, is coded by :func:`_code_cpu`: the same fused pass and encoder as the
pipeline's, without the pipeline (no device to overlap with).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dcr_format.codings.ulp import FLOAT_DTYPES
from dcr_format.delta.backend import Backend, PendingDiff
from dcr_format.delta.backends import backend_for
from dcr_format.delta.classed_change import KeptClasses, class_plan
from dcr_format.format.dtypes import flat_bits, info_for
from dcr_format.format.features import BASELINE_CODINGS, NO_CODINGS, EncodeOptions
from dcr_format.format.names import CLASSED
from dcr_format.kernels.native import compiled
from dcr_format.kernels.reference import OVERWRITE, ClassPlan, Diff
from dcr_format.system.pools import ONE_THREAD_ELEMENTS, kept_pool

if TYPE_CHECKING:
    from dcr_format.delta.delta import EncodedTensor

Options = EncodeOptions | Callable[[Any], EncodeOptions]
"""The codings an encoder may use: the same for every item, or each item's by its key."""


def _options_of(options: Options, key: Any) -> EncodeOptions:
    return options if isinstance(options, EncodeOptions) else options(key)


FULL = "full"  # dcr_format.delta.delta.FULL (not imported: the pipeline needs only torch)


@dataclass
class Compacted:
    """One item's result: its change on the device and CPU copies of the payload.

    ``diff`` is None when the item had no comparable baseline or asked for ``full``
    (nothing to diff); ``host`` then is None too.
    """

    key: Any
    diff: Diff | None
    host: tuple[torch.Tensor, torch.Tensor] | None  # positions, values to encode (xor or new)
    # fingerprint lane deltas of the change (the CPU's fused pass computes them), else None
    lane_deltas: tuple[int, ...] | None = None
    backend: Backend | None = None  # the one that found the change


@dataclass
class _State:
    key: Any
    op: str | None
    backend: Backend | None = None
    pending: PendingDiff | None = None
    lane_deltas: tuple[int, ...] | None = None
    stream: Any = None  # torch.cuda.Stream when on CUDA
    diff: Diff | None = None
    host: tuple[torch.Tensor, torch.Tensor] | None = None
    copied: Any = None  # torch.cuda.Event when on CUDA


class DeviceDiffPipeline:
    """Iterate ``(key, new, old[, op])`` into :class:`Compacted` with one tensor of lookahead.

    ``op`` ``overwrite`` sends new bits, anything else (``None``, ``xor``) XOR bits;
    ``full`` and incomparable baselines pass through with ``diff=None``.

    With ``advanced``, the CPU's fused pass also brings each (contiguous) ``old`` to
    ``new`` in place and calls ``advanced(key, diff)`` right then; the diff holds the XOR
    bits, so ``old[positions] ^= xor_values`` undoes it, and the new bits only when the
    op is ``overwrite`` (they are what it sends). Device tensors are not advanced.
    ``options``: the codings the items' encoder may use, or each item's by its key (a coding
    against the old bits needs the new bits at the positions, which the CPU's pass then keeps).
    """

    def __init__(
        self,
        items: Iterable[tuple[Any, ...]],
        advanced: Callable[[Any, Diff], None] | None = None,
        options: Options = NO_CODINGS,
    ) -> None:
        self.items = items
        self.advanced = advanced
        self.options = options
        self._streams: list[Any] = []
        self._turn = 0

    def _stream_for(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        if not self._streams:
            self._streams = [torch.cuda.Stream(device=device) for _ in range(2)]
        self._turn ^= 1
        return self._streams[self._turn]

    def _start(self, item: tuple[Any, ...] | None) -> _State | None:
        """Queue the scan of one item (on a side stream on CUDA)."""
        if item is None:
            return None
        key, new, old, op = item if len(item) == 4 else (*item, None)
        state = _State(key, op)
        if op == FULL or old is None or old.dtype != new.dtype or old.shape != new.shape:
            return state
        new_bits, old_bits = flat_bits(new), flat_bits(old)
        want_xor = op != OVERWRITE
        state.backend = backend = backend_for(old_bits, new_bits)
        state.stream = self._stream_for(new_bits.device)
        if state.stream is None:  # one fused pass on the CPU: the change and its lane deltas
            options = _options_of(self.options, key)
            state.diff, state.lane_deltas = _cpu_pass(
                key, new.dtype, new_bits, old_bits, op, backend, self.advanced, options
            )
            return state
        # the inputs come from the consumer's stream; the allocator must not recycle them
        # while the side stream still reads them
        state.stream.wait_stream(torch.cuda.current_stream(new_bits.device))
        for tensor in (new_bits, old_bits):
            tensor.record_stream(state.stream)
        with torch.cuda.stream(state.stream):
            state.pending = backend.start_diff(old_bits, new_bits, want_xor=want_xor)
        return state

    def _compact(self, state: _State) -> None:
        """Queue compaction and the copy-out of the payload (waits for the total only)."""
        if state.pending is None and state.diff is None:
            return
        if state.pending is not None:
            state.diff = self._in_stream(state, state.pending.finish)
            state.pending = None
        found = state.diff
        assert found is not None
        picked = found.new_values if state.op == OVERWRITE else found.xor_values
        assert picked is not None
        if state.stream is None:
            state.host = (found.positions.cpu(), picked.cpu())
            return
        with torch.cuda.stream(state.stream):
            host = []
            for tensor in (found.positions, picked):
                pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                pinned.copy_(tensor, non_blocking=True)
                host.append(pinned)
            state.host = (host[0], host[1])
            state.copied = torch.cuda.Event()
            state.copied.record(state.stream)

    @staticmethod
    def _in_stream(state: _State, fn: Any) -> Any:
        if state.stream is None:
            return fn()
        with torch.cuda.stream(state.stream):
            return fn()

    def _finish(self, state: _State) -> Compacted:
        """Wait for the copy-out; hand the device tensors over to the consumer's stream."""
        if state.copied is not None:
            state.copied.synchronize()
            consumer = torch.cuda.current_stream(state.stream.device)
            consumer.wait_event(state.copied)
            assert state.diff is not None
            for tensor in (state.diff.positions, state.diff.new_values, state.diff.xor_values):
                if tensor is not None:
                    tensor.record_stream(consumer)
        return Compacted(state.key, state.diff, state.host, state.lane_deltas, state.backend)

    def __iter__(self) -> Iterator[Compacted]:
        items = iter(self.items)
        current = self._start(next(items, None))
        while current is not None:
            self._compact(current)
            upcoming = self._start(next(items, None))  # scans while `current` is copied/coded
            yield self._finish(current)
            current = upcoming


def encode_stream(
    items: Iterable[tuple[Any, torch.Tensor, torch.Tensor | None, str | None]],
    advanced: Callable[[Any, Diff], None] | None = None,
    rows: Callable[[Any], KeptClasses | None] | None = None,
    *,
    options: Options = NO_CODINGS,
) -> Generator[tuple[Any, EncodedTensor], None, None]:
    """``(key, encode_tensor(new, old, op=op))`` for each ``(key, new, old, op)``, pipelined
    on CUDA, on a pool of threads where the first tensor is on the CPU (see the module
    docstring); the results come in the items' order either way.

    ``advanced``: CPU baselines ``old`` are brought to ``new`` in the diff's own pass, and
    ``advanced(key, diff)`` is told of each at once (see :class:`DeviceDiffPipeline`; from
    the pool's threads, but never after the stream ended or was closed: it waits for the
    tensors in flight first). ``rows(key)``: what the caller keeps of ``old`` for its
    ``classed`` positions (its exponent rows, see :func:`dcr_format.delta.delta.encode_diff`,
    and its last classes, which a CPU diff ranks the changes in), or None. ``options``: the
    codings the encoder may use (see :func:`dcr_format.delta.delta.encode_tensor`), or each
    item's by its key.
    """
    iterator = iter(items)
    first = next(iterator, None)
    if first is None:
        return
    if first[1].device.type != "cpu":
        yield from _pipelined(itertools.chain((first,), iterator), advanced, rows, options)
    elif CODING_THREADS > 1:
        yield from _pooled(first, iterator, advanced, rows, options)
    else:
        for item in itertools.chain((first,), iterator):
            picked = _options_of(options, item[0])
            if item[1].device.type == "cpu":
                yield item[0], _code_cpu(item, advanced, rows, picked)
            else:
                yield next(_pipelined([item], advanced, rows, picked))


CODING_THREADS = 2
"""Tensors a CPU stream codes at once (:func:`encode_stream`); 1 codes them one by one."""

_AHEAD = 2  # tensors queued per thread, so that a thread never waits for the next one


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's coding pool of ``threads`` threads, kept for its life (a forked child
    makes its own): each thread keeps the diff's scratch pages between steps
    (:mod:`dcr_format.kernels.numba_kernels`)."""
    return kept_pool("dcr-code", threads)


def _code_one(
    item: tuple[Any, torch.Tensor, torch.Tensor | None, str | None],
    advanced: Callable[[Any, Diff], None] | None,
    rows: Callable[[Any], KeptClasses | None] | None,
    serial: ModuleType | None,
    options: EncodeOptions,
) -> tuple[Any, EncodedTensor]:
    """One item, coded on this thread or a pool's (with the kernels' serial twins where
    ``serial``, the launch module, is given): a CPU tensor by :func:`_code_cpu`, another
    through :func:`_pipelined`."""
    with contextlib.nullcontext() if serial is None else serial.serial_kernels():
        if item[1].device.type == "cpu":
            return item[0], _code_cpu(item, advanced, rows, options)
        return next(_pipelined([item], advanced, rows, options))


def _code_cpu(
    item: tuple[Any, torch.Tensor, torch.Tensor | None, str | None],
    advanced: Callable[[Any, Diff], None] | None,
    rows: Callable[[Any], KeptClasses | None] | None,
    options: EncodeOptions,
) -> EncodedTensor:
    """What :func:`_pipelined` yields for one CPU item, without its pipeline: there is no
    device to overlap with, and a small tensor's coding is mostly Python, so the
    pipeline's own steps (its states, its look-ahead) cost about a tenth of it. The same diff
    (:meth:`DeviceDiffPipeline._start`'s CPU pass: the change, its lane deltas and the
    baseline advanced in one pass), told to ``advanced`` at once, then the same encoder."""
    from dcr_format.delta.delta import check_encode_op, encode_diff, encode_tensor

    key, new, old, op = item
    check_encode_op(op)
    if op == FULL or old is None or old.dtype != new.dtype or old.shape != new.shape:
        return encode_tensor(new, old, op=op, options=options)
    new_bits, old_bits = flat_bits(new), flat_bits(old)
    backend = backend_for(old_bits, new_bits)
    kept = None if rows is None else rows(key)
    ranking = None
    if op != OVERWRITE and CLASSED in options.codings:
        ranking = class_plan(kept, info_for(new.dtype).name, new.numel())
    found, lane_deltas = _cpu_pass(
        key, new.dtype, new_bits, old_bits, op, backend, advanced, options, ranking
    )
    picked = found.new_values if op == OVERWRITE else found.xor_values
    assert picked is not None
    return encode_diff(
        new,
        found,
        op=op,
        host=(found.positions, picked),
        lane_deltas=lane_deltas,
        rows=None if kept is None else kept.rows,
        backend=backend,
        options=options,
    )


def _cpu_pass(
    key: Any,
    dtype: torch.dtype,
    new_bits: torch.Tensor,
    old_bits: torch.Tensor,
    op: str | None,
    backend: Backend,
    advanced: Callable[[Any, Diff], None] | None,
    options: EncodeOptions,
    ranking: ClassPlan | None = None,
) -> tuple[Diff, tuple[int, ...] | None]:
    """One fused pass over the flat bits of a CPU item of ``dtype``: its change and lane
    deltas, the baseline advanced where ``advanced`` is given (and told at once: whatever
    fails later can undo it), and the changes' ranks in the classes of ``ranking`` where
    given. Advanced, the XOR bits suffice, unless a coding against the old bits may be
    used (``ulp``, ``classed``): it needs the new bits at the positions too, best taken
    here while each line is at hand (a later gather at 1% change misses the cache on
    every element)."""
    want_xor = op != OVERWRITE
    advance = advanced is not None and old_bits.is_contiguous()
    against_old = (
        want_xor
        and not options.codings.isdisjoint(BASELINE_CODINGS)
        and info_for(dtype).name in FLOAT_DTYPES
    )
    found, lane_deltas = backend.diff_with_lanes(
        old_bits,
        new_bits,
        want_new=not (advance and want_xor) or against_old,
        want_xor=want_xor or advance,
        advance=advance,
        ranking=ranking,
    )
    if advance:
        assert advanced is not None
        advanced(key, found)
    return found, lane_deltas


def _now(code: Callable[[], tuple[Any, EncodedTensor]]) -> Future[tuple[Any, EncodedTensor]]:
    """``code()`` run on this thread, as a finished future: its error, if any, comes out in
    its tensor's turn, as a pool's would."""
    done: Future[tuple[Any, EncodedTensor]] = Future()
    try:
        done.set_result(code())
    except Exception as exc:  # handed over in its turn, as the pool's are
        done.set_exception(exc)
    return done


def _pooled(
    first: tuple[Any, torch.Tensor, torch.Tensor | None, str | None],
    rest: Iterator[tuple[Any, torch.Tensor, torch.Tensor | None, str | None]],
    advanced: Callable[[Any, Diff], None] | None,
    rows: Callable[[Any], KeptClasses | None] | None,
    options: Options,
) -> Iterator[tuple[Any, EncodedTensor]]:
    """:func:`encode_stream` for CPU tensors: up to ``_AHEAD`` per thread in flight, each
    yielded in order; small ones coded on this thread as they are queued.
    Whatever ends the stream (its end, an error, the caller closing it), every tensor in
    flight has finished before control returns: none advances its baseline later."""
    threads = CODING_THREADS
    pool = _pool(threads)
    launch = compiled("_launch")  # numba's, imported where the kernels are used anyway
    serial = launch if launch is not None and launch.kernel_threads() <= threads else None
    pending: deque[Future[tuple[Any, EncodedTensor]]] = deque()
    items = itertools.chain((first,), rest)
    try:
        while True:
            while len(pending) < threads * _AHEAD:
                item = next(items, None)
                if item is None:
                    break
                picked = _options_of(options, item[0])
                if item[1].numel() <= ONE_THREAD_ELEMENTS:
                    pending.append(_now(partial(_code_one, item, advanced, rows, None, picked)))
                else:
                    pending.append(pool.submit(_code_one, item, advanced, rows, serial, picked))
            if not pending:
                return
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        wait(pending)


def _pipelined(
    items: Iterable[tuple[Any, torch.Tensor, torch.Tensor | None, str | None]],
    advanced: Callable[[Any, Diff], None] | None = None,
    rows: Callable[[Any], KeptClasses | None] | None = None,
    options: Options = NO_CODINGS,
) -> Iterator[tuple[Any, EncodedTensor]]:
    """:func:`encode_stream` through :class:`DeviceDiffPipeline`, one item after another."""
    from dcr_format.delta.delta import check_encode_op, encode_diff, encode_tensor

    held: dict[int, tuple[Any, torch.Tensor, torch.Tensor | None, str | None]] = {}
    chosen: dict[int, EncodeOptions] = {}  # each held item's options

    def feed() -> Iterator[tuple[Any, ...]]:
        for index, (key, new, old, op) in enumerate(items):
            check_encode_op(op)
            held[index] = (key, new, old, op)
            chosen[index] = _options_of(options, key)
            yield index, new, old, op

    def tell(index: Any, found: Diff) -> None:
        assert advanced is not None
        advanced(held[index][0], found)

    pipeline = DeviceDiffPipeline(feed(), None if advanced is None else tell, chosen.__getitem__)
    for result in pipeline:
        key, new, old, op = held.pop(result.key)
        picked = chosen.pop(result.key)
        if result.diff is None:  # full, or no comparable baseline (encode_tensor refuses misuse)
            yield key, encode_tensor(new, old, op=op, options=picked)
        else:
            yield (
                key,
                encode_diff(
                    new,
                    result.diff,
                    op=op,
                    host=result.host,
                    lane_deltas=result.lane_deltas,
                    # a device baseline still holds the old bits (the CPU pass advanced its own)
                    baseline=None if new.device.type == "cpu" else old,
                    rows=_kept_rows(rows, key),
                    backend=result.backend,
                    options=picked,
                ),
            )


def _kept_rows(rows: Callable[[Any], KeptClasses | None] | None, key: Any) -> np.ndarray | None:
    """The exponent rows kept of ``key``'s tensor, if any."""
    kept = None if rows is None else rows(key)
    return None if kept is None else kept.rows


__all__ = ["Compacted", "DeviceDiffPipeline", "encode_stream"]
