"""A reader that reads the old bits of more tensors than a record lists (FORMAT.md §3.6
``baseline_except``): an engine holding thousands of experts whole records the few tensors
whose old bits it does not read, and writers code every other tensor against the old bits."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from test_baseline_names import _RecordBefore
from test_positions_classed import coded_against_old_bits
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget
from dcr_format.errors import SchemaError
from dcr_format.format.features import (
    BASELINE_FEATURES,
    POSITIONS_CLASSED_FEATURE,
    VALUES_ULP_FEATURE,
    WRITER_FEATURES,
    PublishCodings,
)
from dcr_format.format.schema import MAX_BASELINE_NAMES, ReaderRecord, parse
from dcr_format.publish import _commit
from dcr_format.store.store import open_store
from dcr_format.tools import readers

UPDATED = "2026-01-01T00:00:00Z"


def _put(store: str, reader_id: str, **fields: object) -> None:
    record = ReaderRecord(reader_id=reader_id, updated=UPDATED, **fields)  # type: ignore[arg-type]
    open_store(store).put(f"readers/{reader_id}.json", record.to_json())


# --- the record ------------------------------------------------------------------------------


def test_a_record_says_every_tensor_but_the_listed_ones() -> None:
    record = ReaderRecord(
        reader_id="engine", updated=UPDATED, reads_baseline=False, baseline_except=("a", "b")
    )
    tree = json.loads(record.to_json())
    assert tree["baseline_except"] == ["a", "b"] and "baseline_names" not in tree
    assert parse(ReaderRecord, record.to_json(), what="readers/engine.json") == record
    # none listed: every tensor's old bits (still a record that says so without reads_baseline)
    empty = ReaderRecord(reader_id="e", updated=UPDATED, reads_baseline=False, baseline_except=())
    assert json.loads(empty.to_json())["baseline_except"] == []
    # absent from records that do not use it, as before
    assert "baseline_except" not in json.loads(
        ReaderRecord(reader_id="r", updated=UPDATED).to_json()
    )


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"baseline_except": ["w"]}, "only with reads_baseline false"),
        (
            {"reads_baseline": False, "baseline_except": ["w"], "baseline_names": ["u"]},
            "not given together",
        ),
        ({"reads_baseline": False, "baseline_except": ["w", "u"]}, "sorted order"),
        ({"reads_baseline": False, "baseline_except": ["u", "u"]}, "sorted order"),
        (
            {
                "reads_baseline": False,
                "baseline_except": [f"n{i:05d}" for i in range(MAX_BASELINE_NAMES + 1)],
            },
            "at most 4096 items",
        ),
        ({"reads_baseline": False, "baseline_except": ["a\x07b"]}, "should match pattern"),
    ],
)
def test_a_hostile_exception_list_is_refused_and_its_record_ignored(
    tmp_path: Path, fields: dict[str, object], why: str
) -> None:
    tree = json.loads(ReaderRecord(reader_id="bad", updated=UPDATED).to_json())
    tree.update(fields)
    data = json.dumps(tree).encode()
    with pytest.raises(SchemaError, match=why):
        parse(ReaderRecord, data, what="readers/bad.json")
    store = str(tmp_path / "store")
    open_store(store).put("readers/bad.json", data)
    _put(store, "good", reads_baseline=False, baseline_except=("x",))
    wishes = _commit.read_reader_records(open_store(store))
    assert (wishes.baseline_names, wishes.baseline_except) == (None, {"x"})


def test_a_writer_that_does_not_know_the_member_reads_no_old_bits() -> None:
    """It ignores the unknown member (FORMAT.md §3.1) and reads ``reads_baseline`` false: it
    codes every tensor plain, even at the most names the member lists."""
    names = tuple(sorted(f"model.layers.{i}.weight" for i in range(MAX_BASELINE_NAMES)))
    record = ReaderRecord(
        reader_id="engine", updated=UPDATED, reads_baseline=False, baseline_except=names
    )
    before = parse(_RecordBefore, record.to_json(), what="readers/engine.json")
    assert before.reads_baseline is False


def test_writers_code_against_the_old_bits_only_what_every_record_reads(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    _put(store, "moe-engine", reads_baseline=False, baseline_except=("x",))
    wishes = _commit.read_reader_records(open_store(store))
    assert not wishes.reads_baseline and wishes.limiting == ("moe-engine",)
    codings = PublishCodings(WRITER_FEATURES, wishes.baseline)
    assert "classed" in codings.for_tensor("z").codings
    assert "classed" not in codings.for_tensor("x").codings
    # with a record that lists names: their intersection, less the exceptions
    _put(store, "tp-engine", reads_baseline=False, baseline_names=("w", "x", "y"))
    wishes = _commit.read_reader_records(open_store(store))
    assert (wishes.baseline_names, wishes.baseline_except) == ({"w", "y"}, {"x"})
    codings = PublishCodings(WRITER_FEATURES, wishes.baseline)
    assert {n for n in "wxyz" if "classed" in codings.for_tensor(n).codings} == {"w", "y"}
    # and two exception lists: their union
    _put(store, "tp-engine", reads_baseline=False, baseline_except=("y",))
    wishes = _commit.read_reader_records(open_store(store))
    assert (wishes.baseline_names, wishes.baseline_except) == (None, {"x", "y"})
    assert POSITIONS_CLASSED_FEATURE in wishes.features_for(None)


def test_ulp_values_go_to_tensors_every_record_reads_the_changed_elements_of(
    tmp_path: Path,
) -> None:
    """A record saying ``reads_changed`` reads the old bits of each changed element of every
    tensor (a tensor-parallel engine's shards): a tensor every other record reads the old
    bits of may use ``ulp`` values, not ``classed`` positions or ``ulp-shift`` values."""
    store = str(tmp_path / "store")
    _put(store, "whole", reads_baseline=False, baseline_names=("w", "x"))
    _put(store, "tp", reads_baseline=False, baseline_names=("w",), reads_changed=True)
    assert json.loads(open_store(store).get("readers/tp.json"))["reads_changed"] is True
    assert "reads_changed" not in json.loads(open_store(store).get("readers/whole.json"))
    wishes = _commit.read_reader_records(open_store(store))
    assert wishes.baseline == ({"w"}, set()) and wishes.changed == ({"w", "x"}, set())
    codings = PublishCodings(WRITER_FEATURES, wishes.baseline, wishes.changed)
    allowed = {n: codings.for_tensor(n).codings for n in "wxy"}
    assert {"classed", "ulp", "ulp-shift"} <= allowed["w"]
    assert "ulp" in allowed["x"] and not allowed["x"] & {"classed", "ulp-shift"}
    assert not allowed["y"] & {"classed", "ulp", "ulp-shift"}
    # no tensor whose old bits every record reads: ulp only, for the changed ones
    _put(store, "tp", reads_baseline=False, baseline_names=("y",), reads_changed=True)
    wishes = _commit.read_reader_records(open_store(store))
    assert wishes.features_for(None) & BASELINE_FEATURES == {VALUES_ULP_FEATURE}
    # a record without reads_changed that reads nothing: none of them
    _put(store, "cpu", reads_baseline=False)
    wishes = _commit.read_reader_records(open_store(store))
    assert not wishes.features_for(None) & BASELINE_FEATURES


# --- an engine that holds more experts whole than a list of names holds ----------------------

EXPERTS = MAX_BASELINE_NAMES + 40
ROWS, COLS = 4, 16


class MoE(nn.Module):
    """Loads like an engine's fused experts: expert ``e`` whole into ``fused[e]`` (its bits
    a view of the parameter), and ``router`` split over two parameters (no canonical view)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = nn.Parameter(
            torch.zeros(EXPERTS, ROWS, COLS, dtype=torch.bfloat16), requires_grad=False
        )
        self.router_a = nn.Parameter(torch.zeros(8, COLS, dtype=torch.bfloat16), False)
        self.router_b = nn.Parameter(torch.zeros(8, COLS, dtype=torch.bfloat16), False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, w in weights:
            if name == "router":
                self.router_a.data.copy_(w[:8])
                self.router_b.data.copy_(w[8:])
            else:
                self.fused.data[int(name.split(".")[1])].copy_(w)
        return {name for name, _ in weights}


def _states(count: int) -> list[dict[str, torch.Tensor]]:
    """A base and ``count`` steps: small weights of which about a tenth move by a small
    update each step (where classed positions and ulp values pay)."""
    gen = torch.Generator().manual_seed(3)
    masters = {f"experts.{e:05d}": torch.randn(ROWS, COLS, generator=gen) for e in range(EXPERTS)}
    masters["router"] = torch.randn(16, COLS, generator=gen)
    scale = torch.tensor([2.0**-k for k in range(COLS)])  # several exponents in every row
    states = []
    for _ in range(count + 1):
        states.append({n: (m * scale).bfloat16() for n, m in masters.items()})
        for m in masters.values():
            moved = torch.rand(m.shape, generator=gen) < 0.1
            m += moved * 0.02 * m.abs() * torch.sign(torch.randn(m.shape, generator=gen))
    return states


def test_an_engine_with_more_experts_than_a_list_holds_gets_the_smaller_codings_for_all(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = str(tmp_path / "store")
    states = _states(1)
    writer = DeltaWriter(store)
    writer.publish(states[0])
    module = MoE()
    target = ModuleTarget(module, load_weights=module.load_weights)
    reader = DeltaReader(store, target, reader_id="moe")
    reader.sync()
    record = json.loads(open_store(store).get("readers/moe.json"))
    assert record["reads_baseline"] is False and "baseline_names" not in record
    assert record["baseline_except"] == ["router"]
    # the list a record could hold instead: the first 4096 experts
    assert len(target.baseline_names()) == MAX_BASELINE_NAMES
    (row,) = readers(store).readers
    assert (row.reads_old_bits, row.baseline_names) == ("all-but", 1)

    caplog.set_level(logging.INFO, logger="dcr_format.publish.writer")
    writer.publish(states[1])
    assert "for every tensor but 1 whose old bits a reader record does not read" in (
        caplog.records[-1].getMessage()
    )
    coded = coded_against_old_bits(store, 1)
    assert "router" not in coded
    past = {f"experts.{e:05d}" for e in range(MAX_BASELINE_NAMES, EXPERTS)}
    assert coded & past, "no expert past what a list holds was coded against the old bits"
    assert reader.sync().version == 1
    dense = MoE()
    dense.load_weights(list(states[1].items()))
    for name, param in dense.named_parameters():
        got = dict(module.named_parameters())[name]
        assert torch.equal(got.view(torch.int16), param.view(torch.int16)), name


def test_a_target_that_cannot_tell_keeps_the_list(tmp_path: Path) -> None:
    """A target whose exception list would cover no more tensors than its names (or that
    does not say) records the names, as before."""
    store = str(tmp_path / "store")
    states = _states(0)
    small = {n: t for n, t in states[0].items() if n in ("router", "experts.00000")}
    DeltaWriter(store).publish(small)

    module = MoE()
    target = ModuleTarget(module, load_weights=module.load_weights)
    DeltaReader(store, target, reader_id="few").sync()
    record = json.loads(open_store(store).get("readers/few.json"))
    assert record["baseline_names"] == ["experts.00000"] and "baseline_except" not in record
