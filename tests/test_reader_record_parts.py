"""A reader whose ``overwrite`` names pass what one reader record holds (FORMAT.md §3.6: writers
read 1 MiB of a record) writes them in parts, ``<id>.part<k>.json``, each a record of its own:
writers take the union of every record's names, so all of them arrive as ``overwrite``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_baseline_names import _Rank
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget, StateDictTarget
from dcr_format.chain.chain import Chain
from dcr_format.errors import (
    ArgumentError,
    BaselineCodingError,
    CapabilityError,
    OverwriteRequiredError,
)
from dcr_format.format.schema import MAX_READER_JSON_BYTES, ReaderRecord, parse
from dcr_format.publish._commit import read_reader_records
from dcr_format.store.store import Store, open_store

NAME_CHARS = 1000  # a record holds about a thousand names of this length
SIZE = 64  # elements of each tensor


def _names(count: int, stem: str = "experts") -> list[str]:
    return [f"model.layers.{i:05d}.{stem}.w13_scale.".ljust(NAME_CHARS, "s") for i in range(count)]


def _records(store: str) -> dict[str, ReaderRecord]:
    """Every record under ``readers/``, checked as a writer reads it: within 1 MiB, valid,
    and naming its key."""
    found = {}
    for key in open_store(store).list("readers/"):
        data = open_store(store).get(key)
        assert len(data) <= MAX_READER_JSON_BYTES, key
        record = parse(ReaderRecord, data, what=key)
        assert f"readers/{record.reader_id}.json" == key
        found[record.reader_id] = record
    return found


class _Cast(nn.Module):
    """An engine that keeps each float32 tensor of the checkpoint cast to bfloat16, in one
    flat parameter: its loader transforms every name, which it takes only as overwrite."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.index = {name: i for i, name in enumerate(names)}
        self.flat = nn.Parameter(torch.zeros(SIZE * len(names), dtype=torch.bfloat16))

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        loaded = set()
        for name, w in weights:
            i = self.index[name]
            self.flat.data[SIZE * i : SIZE * (i + 1)].copy_(w)
            loaded.add(name)
        return loaded


def test_overwrite_names_past_one_record_all_arrive_as_overwrite(tmp_path: Path) -> None:
    """About 1.1 MB of cast tensor names: the reader (auto-named) writes two records, the
    writer sends every one of those tensors as overwrite, and the reader applies them (with
    one record past 1 MiB the writer ignored it, sent xor, and the reader refused every
    version)."""
    store = str(tmp_path / "store")
    names = _names(1100)
    gen = torch.Generator().manual_seed(5)
    states = [{n: torch.randn(SIZE, generator=gen) for n in names}]
    states.append({n: t.clone() for n, t in states[0].items()})
    for t in states[1].values():  # a few elements of each: xor, were it allowed
        t[torch.randint(0, SIZE, (2,), generator=gen)] += 0.25
    writer = DeltaWriter(store)
    writer.publish(states[0])
    module = _Cast(names)
    reader = DeltaReader(store, ModuleTarget(module, load_weights=module.load_weights))
    assert reader.sync().version == 0
    records = _records(store)
    assert len(records) == 2
    first = min(records, key=len)
    assert first.startswith("auto-") and set(records) == {first, f"{first}.part1"}
    assert read_reader_records(open_store(store)).overwrite == set(names)
    writer.publish(states[1])
    chain = Chain(open_store(store))
    ops = {e.name: e.op for m in chain.manifests(chain.record(1)) for e in m.entries}
    assert ops == dict.fromkeys(names, "overwrite")
    assert reader.sync().version == 1
    want = torch.cat([states[1][n] for n in names]).bfloat16()
    assert torch.equal(module.flat.view(torch.int16), want.view(torch.int16))


class _Casting(StateDictTarget):
    """A dict target that says it takes ``overwrite`` only as overwrite."""

    overwrite: frozenset[str] = frozenset()

    def overwrite_names(self) -> frozenset[str]:
        return self.overwrite


@pytest.mark.parametrize(("reader_id", "rank"), [("engine", 0), ("e" * 128, 0), ("e" * 128, 1)])
def test_a_shrinking_set_drops_the_parts_it_no_longer_needs(
    tmp_path: Path, reader_id: str, rank: int
) -> None:
    """Three records' worth of names, then two, then one (from a new reader): the parts past
    the set's are deleted, another record's part is kept, and every id fits 128 characters
    (a long one gives way to a digest of it)."""
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = {"w": torch.zeros(4)}
    writer.publish(state)
    foreign = ReaderRecord(
        reader_id="engine.rank1.part2", updated="2026-01-01T00:00:00Z", overwrite=("kept",)
    )
    open_store(store).put("readers/engine.rank1.part2.json", foreign.to_json())
    target = _Casting({})

    def sync_with(names: list[str], reader: DeltaReader) -> set[str]:
        target.overwrite = frozenset(names)
        reader.group = _Rank(rank)
        state["w"] += 1
        writer.publish(state)
        reader.sync()
        assert read_reader_records(open_store(store)).overwrite == {"kept", *names}
        return set(_records(store)) - {foreign.reader_id}

    reader = DeltaReader(store, target, reader_id=reader_id)
    long = _names(2600)
    ids = sync_with(long, reader)
    assert len(ids) == 3
    first = reader_id if rank == 0 else reader_id[:122] + ".rank1"
    assert first in ids
    assert all(len(i) <= 128 for i in ids)
    shorter = sync_with(long[:1500], reader)
    assert len(shorter) == 2 and shorter < ids
    again = DeltaReader(store, target, reader_id=reader_id)  # a new process: parts left over
    assert sync_with(long[:10], again) == {first}
    assert sync_with([], again) == {first}


def test_a_part_that_cannot_be_deleted_is_rewritten_asking_for_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    writer.publish({"w": torch.zeros(4)})
    target = _Casting({})
    target.overwrite = frozenset(_names(1500))
    reader = DeltaReader(store, target, reader_id="engine")
    reader.sync()
    assert set(_records(store)) == {"engine", "engine.part1"}

    def refuse(self: Store, key: str) -> None:
        raise CapabilityError("no delete here")

    monkeypatch.setattr(Store, "delete", refuse)
    target.overwrite = frozenset({"a"})
    reader.prewarm()
    records = _records(store)
    assert records["engine.part1"].overwrite == ()
    assert read_reader_records(open_store(store)).overwrite == {"a"}


class _CastingPartial(_Casting):
    """A casting target that also reads the old bits of ``w`` only."""

    def reads_baseline(self) -> bool:
        return False

    def baseline_names(self) -> frozenset[str]:
        return frozenset({"w"})


def test_every_part_lists_the_old_bits_its_reader_reads(tmp_path: Path) -> None:
    """Writers code against the old bits only the tensors every record reads them of: each
    part lists the reader's ``baseline_names``, or its parts would leave none."""
    store = str(tmp_path / "store")
    DeltaWriter(store).publish({"w": torch.zeros(4)})
    target = _CastingPartial({})
    target.overwrite = frozenset(_names(1500))
    DeltaReader(store, target, reader_id="engine").sync()
    records = _records(store)
    assert len(records) == 2
    assert all(r.baseline_names == ("w",) and not r.reads_baseline for r in records.values())
    wishes = read_reader_records(open_store(store))
    assert wishes.baseline_names == {"w"} and wishes.overwrite == target.overwrite


def test_an_id_ending_like_a_part_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="part"):
        DeltaReader(str(tmp_path / "store"), StateDictTarget({}), reader_id="engine.part2")


def _casting_reader(store: str) -> tuple[DeltaReader, _Cast]:
    module = _Cast(["a.weight", "b.weight"])
    target = ModuleTarget(module, load_weights=module.load_weights)
    return DeltaReader(store, target, reader_id="rollout"), module


def _steps(count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(9)
    states = [{n: torch.randn(SIZE, generator=gen) for n in ("a.weight", "b.weight")}]
    for _ in range(count - 1):
        states.append({n: t.clone() for n, t in states[-1].items()})
        for t in states[-1].values():  # a few elements of each: xor, were it allowed
            t[torch.randint(0, SIZE, (2,), generator=gen)] += 0.25
    return states


def test_readers_sharing_an_id_with_other_needs_are_told_their_record_was_replaced(
    tmp_path: Path,
) -> None:
    """Two readers given one ``reader_id`` whose targets need different things (an engine
    whose loader casts its tensors, and one that takes them as they are) replace each
    other's record, and writers follow the last one written: the casting reader then gets
    changes it cannot take, and its error says why and what to do (before, it said its
    record asks writers not to, which no longer held). Where its own record is in place
    (a version published before it) the error is the plain one."""
    states = _steps(3)
    early = str(tmp_path / "early")
    writer = DeltaWriter(early)
    writer.publish(states[0])
    writer.publish(states[1])  # before any record
    casting, _ = _casting_reader(early)
    assert casting.sync(to=0).version == 0
    with pytest.raises((OverwriteRequiredError, BaselineCodingError)) as plain:
        casting.sync()
    assert "reader_id" not in str(plain.value)

    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    writer.publish(states[0])
    casting, module = _casting_reader(store)
    assert casting.sync().version == 0
    writer.publish(states[1])  # the record asks for overwrite: taken
    assert casting.sync().version == 1
    other = DeltaReader(store, StateDictTarget({}), reader_id="rollout")
    assert other.sync().version == 1  # takes every tensor as it is: an empty request
    assert _records(store)["rollout"].overwrite == ()
    writer.publish(states[2])
    with pytest.raises((OverwriteRequiredError, BaselineCodingError)) as replaced:
        casting.sync()
    message = str(replaced.value)
    assert "readers/rollout.json" in message and "give each its own reader_id" in message
    assert _records(store)["rollout"].overwrite == ()  # left to the other: no tug of war
    want = torch.cat([states[1][n] for n in ("a.weight", "b.weight")]).bfloat16()
    assert torch.equal(module.flat.view(torch.int16), want.view(torch.int16))  # still 1
