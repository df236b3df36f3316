"""Small tensors are coded and applied on the calling thread, large ones on the pools.

A small tensor's coding or apply is mostly Python between short compiled calls; threads
that share the interpreter's lock only hand it to each other, so a model of many small
tensors (a mixture-of-experts checkpoint) published and synced about twice as slowly on a
pool of two, and handing each to a thread of its own costs about as much again. What must
hold: small tensors never reach a pool, large ones still do, and the results are those of
coding and applying one by one.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, snapshot

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.delta import pipeline
from dcr_format.kernels.reference import Diff
from dcr_format.sync import _apply
from dcr_format.system.pools import ONE_THREAD_ELEMENTS

LARGE = ONE_THREAD_ELEMENTS + 1024
SMALL = ("s0", "s1", "s2", "s3", "s4")


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"big0": (LARGE,), "big1": (LARGE,), **{name: (4096,) for name in SMALL}}
    return {
        n: torch.randn(s, generator=gen).mul(0.02).to(torch.bfloat16) for n, s in shapes.items()
    }


def _stepped(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + torch.randn(t.shape, generator=gen).mul(2e-4)).to(torch.bfloat16)
        for n, t in state.items()
    }


def test_the_writer_codes_small_tensors_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(pipeline, "CODING_THREADS", 2)
    old = _state(0)
    new = _stepped(old, 1)
    where: dict[str, str] = {}

    def advanced(key: str, found: Diff) -> None:
        where[key] = threading.current_thread().name

    items = [(n, new[n], old[n].clone(), None) for n in new]
    coded = [key for key, _ in pipeline.encode_stream(items, advanced)]
    assert coded == list(new)  # in order
    caller = threading.current_thread().name
    assert {where[n] for n in SMALL} == {caller}
    assert all(where[n].startswith("dcr-code") for n in ("big0", "big1"))


def test_an_error_of_a_small_tensor_comes_in_its_turn(monkeypatch):
    monkeypatch.setattr(pipeline, "CODING_THREADS", 2)
    old = _state(2)
    new = _stepped(old, 3)
    items = [(n, new[n], old[n].clone(), "bogus" if n == "s1" else None) for n in new]
    got = []
    with pytest.raises(ValueError, match="unknown op"):
        for key, _ in pipeline.encode_stream(items):
            got.append(key)
    assert got == ["big0", "big1", "s0"]  # everything before it, nothing after


def _threads_of_changes(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[int]]:
    """By tensor name, the threads its changes are applied on from now on (filled as a
    sync applies them)."""
    where: dict[str, set[int]] = {}
    real = _apply.EarlyApply._run

    def spy(self, entry, box, pooled):  # type: ignore[no-untyped-def]
        where.setdefault(entry.name, set()).add(threading.get_ident())
        return real(self, entry, box, pooled)

    monkeypatch.setattr(_apply.EarlyApply, "_run", spy)
    return where


Tensors = dict[str, torch.Tensor]


def _synced(tmp_path: Path, seed: int) -> tuple[DeltaWriter, DeltaReader, Tensors, Tensors]:
    """A writer that published a base and a reader of a dict target synced to it: the
    writer, the reader, the target's tensors and the state published."""
    state = _state(seed)
    writer = DeltaWriter(str(tmp_path))
    writer.publish(state)
    held = snapshot(state)
    reader = DeltaReader(str(tmp_path), StateDictTarget(held))
    reader.sync()
    return writer, reader, held, state


def test_a_reader_applies_small_tensors_on_the_calling_thread(monkeypatch, tmp_path):
    monkeypatch.setattr(_apply, "kernel_threads", lambda: 2)  # a pool of two for large ones
    where = _threads_of_changes(monkeypatch)
    writer, reader, held, state = _synced(tmp_path, 4)
    for seed in (5, 6):
        state = _stepped(state, seed)
        writer.publish(state)
        where.clear()
        reader.sync()
        assert_same_bits(held, state)
        small = set().union(*(where[n] for n in SMALL))
        large = set().union(*(where[n] for n in ("big0", "big1")))
        assert small == {threading.get_ident()}  # the sync's own thread, in their turn
        assert not small & large


def test_a_reader_that_writes_with_one_thread_keeps_every_change_on_it(monkeypatch, tmp_path):
    """Where a sync writes with one thread only (device tensors, whose loaders need not
    take calls from two threads at once), small changes go to that thread too."""
    monkeypatch.setattr(_apply, "kernel_threads", lambda: 1)
    where = _threads_of_changes(monkeypatch)
    writer, reader, held, state = _synced(tmp_path, 7)
    state = _stepped(state, 8)
    writer.publish(state)
    where.clear()
    reader.sync()
    assert_same_bits(held, state)
    threads = set().union(*where.values())
    assert len(threads) == 1 and threading.get_ident() not in threads
