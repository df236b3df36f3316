"""gc removing the versions a reader is fetching: the sync plans again and starts from the
newest base; nothing is half-applied, and where it cannot plan again the error says what
happened and what to do."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, snapshot

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, compact, gc
from dcr_format.errors import ApplyError, ObjectNotFoundError, VersionNotFoundError

SHAPE = (128, 256)


def _chain(root: Path, rates: dict[int, float]) -> tuple[dict[str, torch.Tensor], ...]:
    """Versions 0..6 of four bf16 tensors (version v changes ``rates.get(v, 0.02)`` of the
    elements), an alternative base at 5; the state of every version."""
    gen = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(SHAPE, generator=gen).bfloat16() for i in range(4)}
    writer = DeltaWriter(root)
    states = []
    for version in range(7):
        if version:
            for tensor in state.values():
                hit = torch.rand(SHAPE, generator=gen) < rates.get(version, 0.02)
                tensor[hit] = (tensor[hit].float() * 1.01 + 1e-3).bfloat16()
        writer.publish(state, step=version)
        states.append(snapshot(state))
    compact(root, at=5)
    return tuple(states)


def _reader_at(root: Path, state: dict[str, torch.Tensor]) -> tuple[DeltaReader, dict]:
    held = snapshot(state)
    reader = DeltaReader(root, StateDictTarget(held))
    reader.sync(0)
    return reader, held


def _gc_on_get(reader: DeltaReader, root: Path, when: Callable[[str], bool]) -> list[str]:
    """Make the reader's store run gc (keep 2 versions) right before the first get of a key
    ``when`` takes; the keys it fired on."""
    fired: list[str] = []
    get = reader.store.get

    def hooked(key: str, **kwargs):  # type: ignore[no-untyped-def]
        if not fired and when(key):
            fired.append(key)
            gc(root, keep_last=2, grace=0, commit_timeout=0)
        return get(key, **kwargs)

    reader.store.get = hooked  # type: ignore[method-assign]
    return fired


def _version_objects(version: int, kind: str) -> Callable[[str], bool]:
    prefix = f"objects/{version:020d}/"
    return lambda key: key.startswith(prefix) and kind in key


@pytest.mark.parametrize(
    "when",
    [
        pytest.param(_version_objects(1, "manifest"), id="while-planning"),
        pytest.param(_version_objects(1, "shard"), id="while-fetching-the-first-version"),
        pytest.param(_version_objects(4, "shard"), id="while-applying-version-by-version"),
    ],
)
def test_a_sync_whose_versions_gc_removes_starts_again_from_the_newest_base(
    tmp_path: Path, when: Callable[[str], bool]
) -> None:
    root = tmp_path / "store"
    states = _chain(root, {})
    reader, held = _reader_at(root, states[0])
    fired = _gc_on_get(reader, root, when)
    result = reader.sync()
    assert fired, "gc never ran: the hook's key was not fetched"
    assert reader.versions() == [5, 6]
    assert result.version == 6 and result.previous == 0 and result.applied_versions == (5, 6)
    assert_same_bits(held, states[6])
    assert reader.sync().applied_versions == ()


def test_an_applied_preparation_whose_versions_gc_removes_is_refused_by_name(
    tmp_path: Path,
) -> None:
    """A preparation of several versions too large to hold decoded fetches the rest while
    it is applied: gc removing them then rolls the apply back, says what happened, and a
    new preparation starts from the base."""
    root = tmp_path / "store"
    states = _chain(root, {1: 0.4, 2: 0.4, 3: 0.4, 4: 0.4})
    reader, held = _reader_at(root, states[0])
    prepared = reader.prepare()
    assert prepared.plan == (1, 2, 3, 4, 5, 6)
    _gc_on_get(reader, root, _version_objects(4, "shard"))
    removed = r"versions 1\.\.4 of .* were removed \(dcr gc\) .*; sync again"
    with pytest.raises(VersionNotFoundError, match=removed):
        reader.apply(prepared)
    assert_same_bits(held, states[0])  # rolled back
    assert reader.apply(reader.prepare()).applied_versions == (5, 6)
    assert_same_bits(held, states[6])


def test_an_object_missing_from_a_version_the_chain_still_holds_is_not_taken_for_gc(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    states = _chain(root, {})
    reader, held = _reader_at(root, states[0])
    shard = next((root / "objects" / f"{2:020d}").glob("*/shard-*"))
    shard.unlink()
    with pytest.raises((ObjectNotFoundError, ApplyError), match="no object"):
        reader.sync()
    assert_same_bits(held, states[0])
