"""A CPU writer codes several tensors at once (``dcr_format.delta.pipeline.encode_stream``).

What must hold: the same results, in the same order, as coding them one by one; the
codings the caller allows reach the pool's threads; an error comes out in its tensor's
place, and no tensor advances its baseline after the stream ended; the pool's threads
run the kernels' serial twins where the pool alone fills the cores.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dcr_format.delta import dispatch, pipeline
from dcr_format.format.features import EncodeOptions
from dcr_format.kernels import _launch
from dcr_format.kernels.reference import Diff

FEATURES = (
    "values-rans",
    "values-ulp",
    "values-ulp-shift",
    "positions-classed",
)


def _model(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Old and new weights of a few shapes (some past one kernel task), about 2% changed."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"a": (700, 1100), "b": (64,), "c": (300, 40), "d": (1 << 19,), "e": (5, 7)}
    old = {n: torch.randn(s, generator=gen).mul(0.02).to(torch.bfloat16) for n, s in shapes.items()}
    new = {}
    for name, tensor in old.items():
        step = torch.randn(tensor.shape, generator=gen).mul(2e-6)
        new[name] = (tensor.float() + step).to(torch.bfloat16)
    new["f32"] = torch.randn(4000, generator=gen)
    old["f32"] = new["f32"].clone()
    old["f32"][::7] += 1.0
    return old, new


def _coded(threads: int, monkeypatch: pytest.MonkeyPatch, seed: int = 1) -> list[tuple]:
    monkeypatch.setattr(pipeline, "CODING_THREADS", threads)
    old, new = _model(seed)
    moved: dict[str, Diff] = {}
    items = [(n, new[n], old[n].clone(), None) for n in new]
    out = list(
        pipeline.encode_stream(
            items,
            lambda key, found: moved.update({key: found}),
            options=EncodeOptions.allowing(FEATURES),
        )
    )
    assert sorted(moved) == sorted(new)  # every baseline advanced in the diff's pass
    for key, _, baseline, _ in items:
        assert torch.equal(baseline.view(torch.uint8), new[key].view(torch.uint8))
    return [
        (
            key,
            e.op,
            e.changed,
            e.positions_coding,
            e.positions,
            e.values_coding,
            e.values,
            e.lane_deltas,
            None if e.rows is None else e.rows.tobytes(),
        )
        for key, e in out
    ]


def test_a_pool_codes_as_one_by_one_in_order(monkeypatch):
    pooled = _coded(2, monkeypatch)
    assert [row[0] for row in pooled] == ["a", "b", "c", "d", "e", "f32"]
    assert pooled == _coded(1, monkeypatch)
    codings = {row[3] for row in pooled} | {row[5] for row in pooled}
    assert "classed" in codings  # the caller's allowed codings reached the pool's threads


def test_one_thread_codes_each_cpu_tensor_in_its_turn_as_the_pipeline_does(monkeypatch):
    """On one thread a CPU stream is coded a tensor at a time without the device pipeline's
    look-ahead (each tensor is read, diffed, told to ``advanced`` and yielded before the
    next is read), and each result is the pipeline's."""
    monkeypatch.setattr(pipeline, "CODING_THREADS", 1)
    old, new = _model(4)
    options = EncodeOptions.allowing(FEATURES)
    events: list[str] = []

    def items(baselines: dict[str, torch.Tensor]):
        for name in new:
            events.append(f"read {name}")
            yield name, new[name], baselines[name], None

    def told(key: str, found: Diff) -> None:
        events.append(f"advanced {key}")

    mine = {n: t.clone() for n, t in old.items()}
    got = []
    for key, encoded in pipeline.encode_stream(items(mine), told, options=options):
        events.append(f"yielded {key}")
        got.append((key, encoded))
    assert events == [f"{what} {n}" for n in new for what in ("read", "advanced", "yielded")]
    theirs = {n: t.clone() for n, t in old.items()}
    piped = list(pipeline._pipelined(items(theirs), lambda key, found: None, None, options))
    assert [key for key, _ in got] == [key for key, _ in piped] == list(new)
    for (_, a), (_, b) in zip(got, piped, strict=True):
        assert (a.op, a.changed, a.positions_coding, a.positions) == (
            b.op,
            b.changed,
            b.positions_coding,
            b.positions,
        )
        assert (a.values_coding, a.values, a.lane_deltas) == (
            b.values_coding,
            b.values,
            b.lane_deltas,
        )
    for name in new:
        assert torch.equal(mine[name].view(torch.uint8), theirs[name].view(torch.uint8))


def test_an_error_comes_in_order_after_every_tensor_in_flight_finished(monkeypatch):
    """Tensor "d" is still coding (its baseline's advance held back) when "c" fails: the
    error reaches the caller only once "d" finished, so nothing advances after it."""
    monkeypatch.setattr(pipeline, "CODING_THREADS", 2)
    old, new = _model(2)
    ended, release = threading.Event(), threading.Event()
    late: list[str] = []

    def advanced(key: str, found: Diff) -> None:
        if key == "d":
            release.wait(10)
        if ended.is_set():
            late.append(key)

    items = [(n, new[n], old[n].clone(), "bogus" if n == "c" else None) for n in new]
    got = []
    timer = threading.Timer(0.3, release.set)
    timer.start()
    with pytest.raises(ValueError, match="unknown op"):
        for key, _ in pipeline.encode_stream(items, advanced):
            got.append(key)
    ended.set()
    release.set()
    timer.join()
    pipeline._pool(2).submit(lambda: None).result()  # whatever was queued has run
    time.sleep(0.2)
    assert got == ["a", "b"]
    assert late == []


def test_closing_the_stream_waits_for_the_tensors_in_flight(monkeypatch):
    monkeypatch.setattr(pipeline, "CODING_THREADS", 2)
    old, new = _model(3)
    calls: list[str] = []
    release = threading.Event()

    def advanced(key: str, found: Diff) -> None:
        if key == "b":
            release.wait(10)
        calls.append(key)

    items = [(n, new[n], old[n].clone(), None) for n in new]
    stream = pipeline.encode_stream(items, advanced)
    assert next(stream)[0] == "a"
    timer = threading.Timer(0.3, release.set)
    timer.start()
    stream.close()  # "b" is in flight, held back
    after = list(calls)
    timer.join()
    pipeline._pool(2).submit(lambda: None).result()
    time.sleep(0.2)
    assert "b" in after and calls == after  # nothing advanced once close() returned
    assert len(calls) < len(items)  # items not yet queued were never coded


def test_serial_kernels_start_no_parallel_region(monkeypatch):
    pytest.importorskip("numba")
    launches = []

    class Counting:
        def __enter__(self) -> None:
            launches.append(threading.get_ident())

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(_launch, "_LOCK", Counting())
    rng = np.random.default_rng(0)
    old = torch.from_numpy(rng.integers(0, 1 << 15, 3 << 18).astype(np.int16))
    new = old.clone()
    new[::50] += 1
    with _launch.serial_kernels():
        inside = dispatch.diff(old, new)
    assert launches == []
    outside = dispatch.diff(old, new)
    assert launches  # the same call outside the block runs the parallel kernel
    assert torch.equal(inside.positions, outside.positions)


def test_the_pool_uses_serial_twins_when_it_fills_the_cores(monkeypatch):
    pytest.importorskip("numba")
    seen = []
    real = _launch.serial_kernels

    def spy(on: bool = True):  # type: ignore[no-untyped-def]
        seen.append(on)
        return real(on)

    monkeypatch.setattr(_launch, "serial_kernels", spy)
    monkeypatch.setattr(pipeline, "CODING_THREADS", max(2, _launch.kernel_threads()))
    old, new = _model(4)
    items = [(n, new[n], old[n].clone(), None) for n in new]
    list(pipeline.encode_stream(items))
    assert seen and all(seen)


def test_a_publish_that_fails_while_tensors_code_leaves_every_baseline(monkeypatch, tmp_path):
    """The writer's loop fails at its third tensor while later ones are coding on the pool:
    every baseline is the committed version's bits once publish raised, and stays so; the
    next publish is exact."""
    from conftest import assert_same_bits, snapshot

    from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
    from dcr_format.publish import _canonical as canonical_module
    from dcr_format.store.store import Store

    monkeypatch.setattr(pipeline, "CODING_THREADS", 2)
    store = Store(str(tmp_path))
    old, new = _model(5)
    writer = DeltaWriter(store, features=FEATURES)
    writer.publish(old)
    committed = snapshot(old)
    real = canonical_module.encoded_entry
    calls = []

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0])
        if len(calls) == 3:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(canonical_module, "encoded_entry", failing)
    with pytest.raises(OSError, match="disk full"):
        writer.publish(new)
    assert_same_bits(writer.baseline, committed)
    pipeline._pool(2).submit(lambda: None).result()
    time.sleep(0.2)
    assert_same_bits(writer.baseline, committed)
    monkeypatch.setattr(canonical_module, "encoded_entry", real)
    writer.publish(new)
    target: dict[str, torch.Tensor] = {}
    DeltaReader(store, StateDictTarget(target)).sync()
    assert_same_bits(target, new)


FORK_CHILD = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
from test_coding_pool import _model
from dcr_format.delta import pipeline
old, new = _model(6)
items = lambda: [(n, new[n], old[n].clone(), None) for n in new]
parent = [e.values for _, e in pipeline.encode_stream(items())]  # the pool's threads exist
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)  # torch's own OpenMP threads are not in the child either
    child = [e.values for _, e in pipeline.encode_stream(items())]
    os._exit(0 if child == parent else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_codes_on_a_pool_of_its_own():
    """A child forked after the pool's threads started has none of them: it makes its own
    pool (a tensor queued on the parent's would never run, and the child would hang)."""
    import os
    import subprocess
    import sys

    script = FORK_CHILD.format(tests=os.path.dirname(__file__))
    result = subprocess.run(
        [sys.executable, "-c", script], timeout=120, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
