"""Reader records over time (FORMAT.md §3.6): a syncing reader writes its record again every
hour, and again at once after a version it could not take, so an operator can remove the
records of readers that are gone (``dcr readers``, :func:`dcr_format.tools.remove_readers`)
without stranding one that still runs."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_cli_workflow import _heavy_modules
from test_reader_record_parts import SIZE, _Cast

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget, StateDictTarget
from dcr_format.chain.chain import Chain, timestamp, utc_now
from dcr_format.chain.readers import part_id
from dcr_format.cli.main import cli
from dcr_format.errors import (
    ArgumentError,
    BaselineCodingError,
    CapabilityError,
    OverwriteRequiredError,
)
from dcr_format.format.schema import ReaderRecord
from dcr_format.publish._commit import read_reader_records
from dcr_format.store.store import Capabilities, Store, open_store
from dcr_format.sync import _commit
from dcr_format.tools import readers, remove_readers

NOW = utc_now().replace(microsecond=0)  # the command measures ages on this machine's clock
LONG = "e" * 128  # a reader id whose parts' ids give way to a digest of it


def _put(store: Store, record_id: str, age: timedelta, **fields: object) -> None:
    updated = timestamp(NOW - age)
    record = ReaderRecord(reader_id=record_id, updated=updated, **fields)  # type: ignore[arg-type]
    store.put(f"readers/{record_id}.json", record.to_json())


def _fill(store: Store) -> None:
    """Records of six readers: one in parts, a second rank (with a part), one of long id in
    parts, one that asks for fewer features, a fresh one, and two that writers skip."""
    day, minute = timedelta(days=1), timedelta(minutes=1)
    listed = {"reads_baseline": False, "baseline_names": ("q", "v")}
    _put(store, "engine", 9 * day, overwrite=("a", "b"), **listed)
    _put(store, "engine.part1", 9 * day, overwrite=("c",), **listed)
    _put(store, "engine.rank1", 9 * day, overwrite=("d",), reads_baseline=False)
    _put(store, "engine.rank1.part1", 9 * day, overwrite=("e",), reads_baseline=False)
    _put(store, LONG, 1.5 * day, overwrite=("f",))
    _put(store, part_id(LONG, 1), 1.5 * day, overwrite=("g",))
    _put(store, "eval", 3 * day, features=("values-rans", "manifest-zstd"))
    _put(store, "fresh", 5 * minute, overwrite=("h",))
    store.put("readers/broken.json", b'{"format_version": 1')
    other = ReaderRecord(reader_id="someone-else", updated=timestamp(NOW))
    store.put("readers/stolen.json", other.to_json())


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = open_store(str(tmp_path / "store"))
    _fill(store)
    return store


def test_the_listing_shows_each_reader_once_with_what_it_asks(store: Store) -> None:
    report = readers(store, now=NOW)
    rows = {r.reader_id: r for r in report.readers}
    assert list(rows) == sorted(rows)
    assert set(rows) == {"broken", "engine", "engine.rank1", LONG, "eval", "fresh", "stolen"}
    engine = rows["engine"]
    assert engine.keys == ("readers/engine.json", "readers/engine.part1.json")
    assert (engine.overwrite, engine.reads_old_bits, engine.baseline_names) == (3, "listed", 2)
    assert engine.age_seconds == 9 * 86400 and not engine.live and engine.problem is None
    rank = rows["engine.rank1"]
    assert rank.keys == ("readers/engine.rank1.json", "readers/engine.rank1.part1.json")
    assert (rank.overwrite, rank.reads_old_bits) == (2, "none")
    assert rows[LONG].keys == (f"readers/{LONG}.json", f"readers/{part_id(LONG, 1)}.json")
    assert rows[LONG].overwrite == 2 and rows[LONG].reads_old_bits == "all"
    assert rows["eval"].features == ("values-rans", "manifest-zstd")
    assert "positions-classed" in rows["eval"].lacks and rows["engine"].lacks == ()
    assert rows["fresh"].live and rows["fresh"].age_seconds == 300
    # the records writers skip are listed, saying why, so they can be removed
    assert "SchemaError" in (rows["broken"].problem or "")
    assert "names reader 'someone-else'" in (rows["stolen"].problem or "")
    assert not rows["broken"].live and rows["broken"].overwrite == 0
    # what writers honour is what the listing says
    wishes = read_reader_records(store)
    assert len(wishes.overwrite) == sum(r.overwrite for r in rows.values())


def test_removing_a_reader_takes_its_parts_and_nothing_else(store: Store) -> None:
    result = remove_readers(store, ["engine", LONG, "broken"], now=NOW)
    assert [r.reader_id for r in result.removed] == sorted(["broken", "engine", LONG])
    assert result.deleted_keys == 5 and result.live == []
    left = set(store.list("readers/"))
    assert "readers/engine.rank1.part1.json" in left and "readers/engine.json" not in left
    assert not any(LONG[:100] in key for key in left)
    assert {r.reader_id for r in readers(store, now=NOW).readers} == {
        "engine.rank1",
        "eval",
        "fresh",
        "stolen",
    }
    # a live reader's record can be removed too: the result says it will come back
    assert remove_readers(store, ["fresh"], now=NOW).live == ["fresh"]


def test_removing_by_age_keeps_the_readers_written_since(store: Store) -> None:
    planned = remove_readers(store, older_than=timedelta(days=2.5), now=NOW, dry_run=True)
    assert [r.reader_id for r in planned.removed] == ["engine", "engine.rank1", "eval"]
    assert len(store.list("readers/")) == 10  # a dry run deletes nothing
    done = remove_readers(store, older_than=timedelta(days=2.5), now=NOW)
    assert done.removed == planned.removed and not done.dry_run
    assert {r.reader_id for r in readers(store, now=NOW).readers} == {
        "broken",
        LONG,
        "fresh",
        "stolen",
    }
    assert remove_readers(store, older_than=timedelta(days=30), now=NOW).removed == []


def test_bad_requests_are_named_errors(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ArgumentError, match=r"no reader 'engine\.part1'.*dcr readers"):
        remove_readers(store, ["engine", "engine.part1"])
    assert len(store.list("readers/")) == 10  # nothing deleted for a bad request
    with pytest.raises(ArgumentError, match="0 or more"):
        remove_readers(store, older_than=timedelta(hours=-1))
    with pytest.raises(ArgumentError, match="name the readers"):
        remove_readers(store)
    cannot = Capabilities(atomic_create=True, listing=True, delete=False)
    monkeypatch.setattr(Store, "capabilities", property(lambda self: cannot))
    with pytest.raises(CapabilityError, match="cannot list and delete"):
        remove_readers(store, ["engine"])
    assert remove_readers(store, ["engine"], dry_run=True).deleted_keys == 2


# --- the reader's side -------------------------------------------------------------------


class _Clock:
    """``time.monotonic`` as the reader records see it, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_syncing_reader_writes_its_record_again_after_an_hour_and_not_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(_commit, "monotonic", clock)
    path = str(tmp_path / "store")
    DeltaWriter(path).publish({"w": torch.zeros(8)})
    reader = DeltaReader(path, StateDictTarget({}), reader_id="rollout")
    store = reader.store
    listings: list[str] = []
    listing = Store.list

    def counted(self: Store, prefix: str = "") -> list[str]:
        listings.append(prefix)
        return listing(self, prefix)

    monkeypatch.setattr(Store, "list", counted)

    def updated() -> str:
        return ReaderRecord.model_validate_json(store.get("readers/rollout.json")).updated

    reader.sync()
    first = updated()
    clock.now += _commit.RECORD_REFRESH_SECONDS - 1
    reader.sync()
    assert updated() == first  # within the hour: nothing written
    clock.now += 2
    listings.clear()
    reader.sync()
    assert updated() > first  # the same request, written again
    assert "readers/" not in listings  # a refresh lists nothing (no parts to drop)
    again = updated()
    reader.sync()
    assert updated() == again


def test_a_running_reader_whose_record_was_removed_writes_it_again_and_takes_the_next_version(
    tmp_path: Path,
) -> None:
    """An engine that casts its tensors asks for them as overwrite; an operator removes its
    record while it runs; the next version comes as xor, which it cannot take: the sync
    fails, the reader writes its record again, and from the next base on it applies every
    version (it used to fail every version from then on)."""
    path = str(tmp_path / "store")
    names = [f"layer{i}.weight" for i in range(4)]
    gen = torch.Generator().manual_seed(3)
    state = {n: torch.randn(SIZE, generator=gen) for n in names}
    writer = DeltaWriter(path, base_every=2)

    def step() -> None:
        for t in state.values():
            t[torch.randint(0, SIZE, (2,), generator=gen)] += 0.25
        writer.publish(state)

    def ops(version: int) -> set[str]:
        chain = Chain(open_store(path))
        return {e.op for m in chain.manifests(chain.record(version)) for e in m.entries}

    writer.publish(state)
    module = _Cast(names)
    reader = DeltaReader(path, ModuleTarget(module, load_weights=module.load_weights))
    assert reader.sync().version == 0
    (row,) = readers(path).readers
    assert row.overwrite == len(names) and row.live
    remove_readers(path, [row.reader_id])
    step()  # version 1: no record asks for overwrite
    assert ops(1) == {"xor"}
    with pytest.raises((OverwriteRequiredError, BaselineCodingError)):  # as coded first
        reader.sync()
    assert [r.keys for r in readers(path).readers] == [row.keys]  # written again
    step()  # version 2: a base
    step()  # version 3: as the record asks
    assert ops(3) == {"overwrite"}
    assert reader.sync().version == 3
    want = torch.cat([state[n] for n in names]).bfloat16()
    assert torch.equal(module.flat.view(torch.int16), want.view(torch.int16))


# --- the command -------------------------------------------------------------------------


def _dcr(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), env={"DCR_DEBUG": None})
    return result.exit_code, result.stdout, result.stderr


def test_the_command_lists_and_removes(store: Store) -> None:
    url = store.url
    code, out, _ = _dcr("readers", "--store", url)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "reader",
        "records",
        "written",
        "age",
        "overwrite",
        "old",
        "bits",
        "features",
        "writers",
    ]
    engine = next(line for line in lines if line.startswith("engine "))
    assert engine.split()[1] == "2" and "2 listed" in engine and "honour" in engine
    assert "lacks implicit-parents" in next(line for line in lines if line.startswith("eval"))
    assert "7 readers" in out and "writers skip broken: SchemaError" in out
    code, out, _ = _dcr("readers", "--store", url, "--format", "json")
    assert code == 0
    listed = json.loads(out)["readers"]
    assert [r["reader_id"] for r in listed][2:4] == ["engine", "engine.rank1"]
    assert listed[2]["keys"] == ["readers/engine.json", "readers/engine.part1.json"]

    code, out, _ = _dcr("readers", "--store", url, "--remove", "engine", "--dry-run")
    assert code == 0 and out.startswith("would remove reader engine: readers/engine.json, ")
    code, out, _ = _dcr("readers", "--store", url, "--remove", "engine", "--remove", "stolen")
    assert code == 0 and "removed reader engine" in out and "removed reader stolen" in out
    assert "live" not in out
    code, out, _ = _dcr("readers", "--store", url, "--remove-older-than", "2d", "--format", "json")
    assert code == 0
    assert {r["reader_id"] for r in json.loads(out)["removed"]} == {"engine.rank1", "eval"}
    code, out, _ = _dcr("readers", "--store", url, "--remove", "fresh")
    assert code == 0 and "note: fresh wrote its record within the hour" in out
    assert "writes its record again within the hour" in out


def test_the_command_refuses_bad_input_in_one_line(store: Store) -> None:
    code, _, err = _dcr("readers", "--store", store.url, "--remove", "nobody")
    assert code == 1 and err.startswith("dcr: error: no reader 'nobody'") and err.count("\n") == 1
    code, _, err = _dcr("readers", "--store", store.url, "--remove-older-than", "7 days")
    assert code == 2 and "cannot read '7 days' as a duration" in err
    code, _, err = _dcr("readers", "--store", store.url, "--dry-run")
    assert code == 2 and "--dry-run applies to --remove" in err
    assert len(store.list("readers/")) == 10


def test_the_command_imports_no_torch(store: Store) -> None:
    out, heavy, _ = _heavy_modules("readers", "--store", store.url)
    assert "7 readers" in out
    assert "torch" not in heavy and "numba" not in heavy
    assert [m for m in heavy if m.startswith("dcr_format.cli.")] == ["dcr_format.cli.maintain"]


def test_the_command_says_whose_old_bits_a_record_of_exceptions_reads(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"))
    _put(store, "moe", timedelta(minutes=5), reads_baseline=False, baseline_except=("a", "b"))
    code, out, _ = _dcr("readers", "--store", store.url)
    assert code == 0 and "all but 2" in next(line for line in out.splitlines() if "moe" in line)
    code, out, _ = _dcr("readers", "--store", store.url, "--format", "json")
    (row,) = json.loads(out)["readers"]
    assert (row["reads_old_bits"], row["baseline_names"]) == ("all-but", 2)


def test_the_command_says_a_record_reads_the_changed_elements_of_the_rest(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"))
    _put(store, "tp", timedelta(minutes=5), reads_baseline=False, reads_changed=True)
    _put(store, "cpu", timedelta(minutes=5), reads_baseline=False)
    code, out, _ = _dcr("readers", "--store", store.url)
    lines = {line.split()[0]: line for line in out.splitlines()[1:] if line.strip()}
    assert code == 0 and "none, changed of the rest" in lines["tp"]
    assert "changed" not in lines["cpu"]
    code, out, _ = _dcr("readers", "--store", store.url, "--format", "json")
    rows = {row["reader_id"]: row for row in json.loads(out)["readers"]}
    assert (rows["tp"]["reads_changed"], rows["cpu"]["reads_changed"]) == (True, False)
