"""The write of a prepared version's staged changes in one pass (``put_segments``): the
compiled loop over every tensor at once against the torch reference, never writing out of
range, and the reader's use of it (one launch, rolled back whole, verified as before)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import assert_same_bits, scale_elements

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, Transaction
from dcr_format.delta.backend import Backend
from dcr_format.delta.backends import backend_for
from dcr_format.errors import FingerprintMismatchError

kernels = pytest.importorskip("dcr_format.kernels.numba_kernels")
GUARD = 64  # elements around each tensor that no write may reach


def _tensors(dtype: torch.dtype, sizes: list[int], gen: torch.Generator):
    """Tensors of ``sizes`` elements laid out in one buffer with guard zones between them,
    and the buffer."""
    width = torch.empty(0, dtype=dtype).element_size()
    total = sum(sizes) + GUARD * (len(sizes) + 1)
    raw = torch.randint(0, 256, (total * width,), generator=gen, dtype=torch.uint8)
    buffer = raw.view(dtype)
    out, at = [], GUARD
    for size in sizes:
        out.append(buffer[at : at + size])
        at += size + GUARD
    return out, buffer


def _segments(sizes: list[int], gen: torch.Generator, share: float):
    """Sorted positions into each tensor (some none), end to end, and where each starts."""
    parts, starts = [], [0]
    for size in sizes:
        count = int(size * share) if size % 3 else 0
        parts.append(torch.randperm(size, generator=gen)[:count].sort().values)
        starts.append(starts[-1] + count)
    return torch.cat(parts), np.array(starts, dtype=np.int64)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
def test_put_segments_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    chunk = kernels._PUT_CHUNK
    sizes = [5, 3 * chunk + 7, 1, 40, 2 * chunk, 17, 9]  # segments across several tasks
    positions, starts = _segments(sizes, gen, 0.7)
    assert positions.numel() > 2 * chunk
    bits = torch.randint(-100, 100, (positions.numel(),), generator=gen).to(_bits(dtype))
    results = []
    for backend in (backend_for(positions), Backend()):
        tensors, buffer = _tensors(dtype, sizes, torch.Generator().manual_seed(5))
        original = buffer.clone()
        replaced = backend.put_segments(tensors, positions, bits, starts, keep=True)
        results.append(buffer.clone())
        # the bits it replaced, put back, leave every tensor as it was
        assert replaced is not None and replaced.dtype == bits.dtype
        backend.put_segments(tensors, positions, replaced, starts)
        assert torch.equal(_raw(buffer), _raw(original))
        assert backend.put_segments(tensors, positions, bits, starts) is None
        assert torch.equal(_raw(buffer), _raw(results[-1]))
    assert type(backend_for(positions)) is not Backend  # the compiled loop was the first
    assert torch.equal(_raw(results[0]), _raw(results[1]))
    # and it is what it says: each segment's bits at its positions, nothing else changed
    tensors, buffer = _tensors(dtype, sizes, torch.Generator().manual_seed(5))
    want = buffer.clone()
    at = GUARD
    for t, size in enumerate(sizes):
        lo, hi = starts[t], starts[t + 1]
        want_flat = _raw_of(want, dtype)[at : at + size]
        want_flat[positions[lo:hi]] = bits[lo:hi]
        at += size + GUARD
    assert torch.equal(_raw(results[0]), _raw(want))


def _bits(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        torch.empty(0, dtype=dtype).element_size()
    ]


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def _raw_of(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.view(_bits(dtype))


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_a_position_out_of_range_is_refused_and_never_written(backend, where):
    gen = torch.Generator().manual_seed(6)
    sizes = [100, 200, 50]
    tensors, buffer = _tensors(torch.bfloat16, sizes, gen)
    positions, starts = _segments([100, 200, 50], gen, 0.5)
    lo, hi = starts[1], starts[2]
    if where == "first":
        positions[lo] = -3  # would land in the guard before the second tensor
    elif where == "last":
        positions[hi - 1] = 200 + GUARD // 2  # in the guard after it
    else:  # not sorted: found only in the loop, once the positions before it are written
        positions[(lo + hi) // 2] = 200 + 5
    bits = torch.full((positions.numel(),), 7, dtype=torch.int16)
    kernel = backend_for(positions) if backend == "compiled" else Backend()
    before = buffer.clone()
    with pytest.raises(IndexError):
        kernel.put_segments(tensors, positions, bits, starts)
    # refused before any write, or what was written put back: whole or nothing
    assert torch.equal(buffer.view(torch.int16), before.view(torch.int16))


@pytest.fixture
def prepared_dict(synced):
    """``synced`` (a dict target at version 0, version 1 published) and version 1 prepared."""
    reader = synced[0]
    return (*synced, reader.prepare())


def test_a_prepared_version_is_written_in_one_launch(prepared_dict, monkeypatch):
    reader, tensors, state, _, prepared = prepared_dict
    assert len(prepared._staged) > 2
    launches: list[int] = []
    original = kernels.put_all
    monkeypatch.setattr(
        kernels, "put_all", lambda *args: launches.append(args[0].size) or original(*args)
    )
    monkeypatch.setattr(Transaction, "put", lambda *a: pytest.fail("put one by one"))
    reader.apply(prepared)
    widths = {s.bits.after.dtype for s in prepared._staged.values()}
    assert len(launches) == len(widths) and sum(launches) == len(prepared._staged)  # one a width
    assert_same_bits(tensors, state)
    assert not reader.sync().applied_versions


def test_lanes_worked_out_when_staging_are_taken_only_while_they_hold(prepared_dict):
    """The lanes a staged change leaves were worked out when it was staged, from the lanes
    trusted then; the apply takes them only where the lanes it trusts are those, and the
    goal's fingerprints are checked on them as on any others."""
    reader, tensors, state, at_zero, prepared = prepared_dict
    name = next(iter(prepared._staged))
    staged = prepared._staged[name]
    assert staged.lanes is not None
    before, after = staged.lanes
    # worked out from other lanes: not taken, the version is applied and verified
    other = dict(prepared._staged)
    other[name] = replace(staged, lanes=(tuple(x + 1 for x in before), (1,) * len(after)))
    result = reader.apply(replace(prepared, _staged=other))
    assert_same_bits(tensors, state)
    assert name not in result.unverified
    # taken, and checked: wrong lanes after fail the verification, and all is undone
    reader2, tensors2 = _second_reader(reader, at_zero)
    again = reader2.prepare()
    bad = dict(again._staged)
    before2, after2 = bad[name].lanes
    bad[name] = replace(bad[name], lanes=(before2, tuple((x + 1) for x in after2)))
    with pytest.raises(FingerprintMismatchError):
        reader2.apply(replace(again, _staged=bad))
    assert_same_bits(tensors2, at_zero)
    reader2.apply(reader2.prepare())
    assert_same_bits(tensors2, state)


def _second_reader(reader: DeltaReader, at_zero: dict[str, torch.Tensor]):
    """Another reader of the same store whose dict target holds version 0."""
    tensors: dict[str, torch.Tensor] = {}
    second = DeltaReader(reader.store.url, StateDictTarget(tensors))
    second.sync(to=0)
    assert_same_bits(tensors, at_zero)
    return second, tensors


def test_exponent_rows_a_staged_change_leaves_are_worked_out_when_staging(synced, monkeypatch):
    """The rows the next ``classed`` change is resolved against are those of the bits the
    write left, worked out while preparing (none in the pause)."""
    import dcr_format.sync._apply as apply_module
    from dcr_format.codings.classed import exponent_rows
    from dcr_format.format.dtypes import bits_to_numpy, bits_view, info_for

    reader, tensors, state, _ = synced
    writer = DeltaWriter(reader.store.url)
    for seed in (None, 12):  # version 1, then a version 2 resolved against the rows v1 left
        if seed is not None:
            scale_elements(state, torch.Generator().manual_seed(seed))
            writer.publish(state)
        prepared = reader.prepare()
        ahead = {n for n, s in prepared._staged.items() if s.rows_after is not None}
        assert ahead  # the default codings code some tensors' positions classed
        with monkeypatch.context() as patched:
            patched.setattr(apply_module, "rows_after", lambda *a: pytest.fail("in the pause"))
            reader.apply(prepared)
        assert_same_bits(tensors, state)
        for name in ahead:
            _, rows = reader._rows[name]
            dtype = info_for(tensors[name].dtype).name
            assert np.array_equal(
                rows, exponent_rows(bits_to_numpy(bits_view(tensors[name])), dtype)
            )


@pytest.mark.parametrize("small", [True, False])
def test_a_batch_of_few_positions_is_written_on_one_thread(small, monkeypatch):
    """Below :data:`SERIAL_PUT` positions a batch is written by the serial kernels (no
    parallel region to start), at or above it by the parallel ones; the same bits either
    way, and its undo puts back the same."""
    from dcr_format.delta import staged as staged_module

    gen = torch.Generator().manual_seed(8)
    sizes = [300, 7, 1000, 64]
    positions, starts = _segments(sizes, gen, 0.3)
    changes = []
    for lo, hi in itertools.pairwise(starts):
        at = positions[lo:hi]
        bits = torch.randint(-100, 100, (at.numel(),), generator=gen).to(torch.int16)
        changes.append(staged_module.StagedChange(at, bits, bits ^ 5, (0, 0)))
    batch, _ = staged_module.batch_staged(changes)
    count = batch.positions.numel()
    monkeypatch.setattr(staged_module, "SERIAL_PUT", count + 1 if small else count)
    serial: list[int] = []
    real = staged_module.serial_kernels
    monkeypatch.setattr(staged_module, "serial_kernels", lambda: serial.append(1) or real())
    tensors, buffer = _tensors(torch.bfloat16, sizes, torch.Generator().manual_seed(9))
    original = buffer.clone()
    replaced = staged_module.put_batch(tensors, batch)
    assert len(serial) == (1 if small else 0)
    reference, again = _tensors(torch.bfloat16, sizes, torch.Generator().manual_seed(9))
    Backend().put_segments(reference, batch.positions, batch.after, batch.starts)
    assert torch.equal(_raw(buffer), _raw(again))
    staged_module.unput_batch(tensors, batch, replaced)
    assert torch.equal(_raw(buffer), _raw(original))
