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
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, snapshot

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget
from dcr_format.delta import pipeline
from dcr_format.kernels.reference import Diff
from dcr_format.sync import _apply, _fetch
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


def _threads_of_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[dict[str, list[int]], list[str]]:
    """By tensor name, the threads its changes are applied on from now on, and the names
    in the order they are applied (filled as a sync applies them): on the apply pool as
    they are decoded (``EarlyApply._run``), or after the fetch (``_change_entry``)."""
    where: dict[str, list[int]] = {}
    order: list[str] = []
    real_run, real_entry = _apply.EarlyApply._run, _apply.Applying._change_entry

    def run(self, entry, box):  # type: ignore[no-untyped-def]
        where.setdefault(entry.name, []).append(threading.get_ident())
        return real_run(self, entry, box)

    def change_entry(self, sync, entry, delta, **options):  # type: ignore[no-untyped-def]
        if entry.name not in where:  # not given to the pool (which calls this too)
            where[entry.name] = [threading.get_ident()]
        order.append(entry.name)
        return real_entry(self, sync, entry, delta, **options)

    monkeypatch.setattr(_apply.EarlyApply, "_run", run)
    monkeypatch.setattr(_apply.Applying, "_change_entry", change_entry)
    return where, order


def _told(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the changes the fetch jobs hand to the sync's thread as they are
    decoded, from now on."""
    told: list[str] = []
    real = _fetch._run_job

    def run_job(store, plan, job, budget, tell=None):  # type: ignore[no-untyped-def]
        if tell is not None:
            handed = tell.decoded

            def decoded(index, delta):  # type: ignore[no-untyped-def]
                told.append(plan.wanted[index][1].name)
                handed(index, delta)

            tell = replace(tell, decoded=decoded)
        return real(store, plan, job, budget, tell)

    monkeypatch.setattr(_fetch, "_run_job", run_job)
    return told


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


@pytest.mark.parametrize("threads", [2, 1])
def test_a_reader_applies_small_tensors_after_the_fetch_on_the_calling_thread(
    monkeypatch, tmp_path, threads
):
    """Large changes are applied on the apply pool as they are decoded (its one thread
    where the sync writes with one thread only: device tensors); small ones are kept by
    the fetch jobs (never handed over while they decode, which would only pass the
    interpreter's lock back and forth) and applied on the sync's own thread once every
    change given to the pool is done."""
    monkeypatch.setattr(_apply, "kernel_threads", lambda: threads)
    where, order = _threads_of_changes(monkeypatch)
    told = _told(monkeypatch)
    writer, reader, held, state = _synced(tmp_path, 4 + threads)
    for seed in (5, 6):
        state = _stepped(state, seed + 10 * threads)
        writer.publish(state)
        where.clear()
        order.clear()
        told.clear()
        reader.sync()
        assert_same_bits(held, state)
        assert sorted(told) == ["big0", "big1"]  # only the large ones were handed over
        small = {t for n in SMALL for t in where[n]}
        large = {t for n in ("big0", "big1") for t in where[n]}
        assert small == {threading.get_ident()}  # the sync's own thread, in their turn
        assert threading.get_ident() not in large
        assert len(large) <= threads
        assert set(order[-len(SMALL) :]) == set(SMALL)  # after the pool's
