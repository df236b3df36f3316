"""A target written from the user-facing protocol alone: weights kept as numpy arrays.

The example below (the same code the docs show) implements only ``Target.resident`` and
``Target.begin`` and the six abstract methods of ``Transaction``; the reader applies,
verifies and undoes through them. Versions published by ``DeltaWriter`` arrive bit for bit,
and a refused sync (a damaged store, a fingerprint that does not match after applying)
leaves the arrays and the resident version as they were.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr_format import DeltaReader, DeltaWriter, Resident, Target, Transaction
from dcr_format.chain.chain import Chain
from dcr_format.errors import ChecksumMismatchError, IntegrityError
from dcr_format.store.store import open_store

# --- the example ---------------------------------------------------------------------------


class NumpyTarget(Target):
    """Weights kept as numpy arrays in a plain dict, at the version last synced."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.version: Resident | None = None

    def resident(self) -> Resident | None:
        return self.version

    def begin(self) -> Transaction:
        return NumpyTransaction(self)


class NumpyTransaction(Transaction):
    """Bits change in place through torch views of the arrays; new arrays wait for commit."""

    def __init__(self, target: NumpyTarget) -> None:
        self.target = target
        self.tensors = {n: torch.from_numpy(a) for n, a in target.arrays.items()}

    def names(self) -> set[str]:
        return set(self.tensors)

    def tensor(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def full_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        live = self.tensors.get(name)
        if live is None or live.dtype != dtype or tuple(live.shape) != shape:
            live = self.tensors[name] = torch.empty(shape, dtype=dtype)
        return live

    def drop(self, name: str) -> None:
        self.tensors.pop(name, None)

    def commit(self, resident: Resident) -> None:
        self.target.arrays = {n: t.numpy() for n, t in self.tensors.items()}
        self.target.version = resident

    def abort(self) -> None:
        self.tensors = {}  # the reader has undone the in-place changes; nothing else was kept


# --- the test ------------------------------------------------------------------------------


def _step(state: dict[str, torch.Tensor], seed: int, names: list[str]) -> dict[str, torch.Tensor]:
    """A training step: a few elements of ``names`` move."""
    generator = torch.Generator().manual_seed(seed)
    new = {n: t.clone() for n, t in state.items()}
    for name in names:
        flat = new[name].view(-1)
        at = torch.randint(0, flat.numel(), (max(1, flat.numel() // 20),), generator=generator)
        flat[at] += torch.randn(at.numel(), generator=generator).to(flat.dtype) * 1e-3
    return new


def _assert_holds(target: NumpyTarget, state: dict[str, torch.Tensor]) -> None:
    assert set(target.arrays) == set(state)
    for name, tensor in state.items():
        array = target.arrays[name]
        assert array.dtype == tensor.numpy().dtype and array.shape == tuple(tensor.shape)
        assert array.tobytes() == tensor.numpy().tobytes(), name


def _snapshot(target: NumpyTarget) -> tuple[Resident | None, dict[str, bytes]]:
    return target.resident(), {n: a.tobytes() for n, a in target.arrays.items()}


def test_the_numpy_target_follows_the_chain_bit_for_bit_and_refusals_change_nothing(tmp_path):
    store = str(tmp_path / "store")
    torch.manual_seed(0)
    state = {
        "embed.weight": torch.randn(64, 16),
        "layer.0.weight": torch.randn(16, 16),
        "layer.0.bias": torch.randn(16),
        "norm.weight": torch.randn(16).half(),
    }
    writer = DeltaWriter(store)
    target = NumpyTarget()
    reader = DeltaReader(store, target)

    writer.publish(state)  # version 0, a base
    reader.sync()
    _assert_holds(target, state)
    assert target.resident() is not None and target.resident().version == 0

    for seed in (1, 2):  # two versions, synced in one plan
        state = _step(state, seed, list(state))
        writer.publish(state)
    reader.sync()
    _assert_holds(target, state)
    assert target.resident().version == 2

    # a damaged store: refused before the target is touched
    state = _step(state, 3, list(state))
    writer.publish(state)
    damaged = open_store(store)
    shard = [s.path for m in Chain(damaged).manifests(Chain(damaged).record(3)) for s in m.shards]
    original = damaged.get(shard[-1])
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    damaged.put(shard[-1], bytes(flipped))
    before = _snapshot(target)
    with pytest.raises(ChecksumMismatchError):
        reader.sync()
    assert _snapshot(target) == before
    damaged.put(shard[-1], original)
    reader.sync()
    _assert_holds(target, state)

    # an array edited outside dcr where the next version changes it: the version's changes
    # go in, its check fails, and the reader undoes them through the transaction (the
    # edit is the user's and stays)
    target.arrays["layer.0.bias"] += np.float32(1.0)
    before = _snapshot(target)
    state = _step(state, 4, ["embed.weight", "layer.0.bias"])
    writer.publish(state)
    with pytest.raises(IntegrityError):
        reader.sync()
    assert _snapshot(target) == before
    assert target.resident().version == 3


def test_the_docs_show_this_example() -> None:
    docs = (Path(__file__).resolve().parent.parent / "docs" / "pull.md").read_text()
    for cls in (NumpyTarget, NumpyTransaction):
        assert inspect.getsource(cls) in docs, f"docs/pull.md no longer shows {cls.__name__}"
