"""Codings against the old bits per tensor (FORMAT.md §3.6 ``baseline_names``, §12.1): a reader
that reads the old bits of only some tensors lists them in its record, and a writer codes
against the old bits exactly the tensors every recorded reader reads them of."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_positions_classed import coded_against_old_bits
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget, StateDictTarget
from dcr_format.chain.chain import Chain
from dcr_format.errors import SchemaError
from dcr_format.format import schema
from dcr_format.format.schema import MAX_BASELINE_NAMES, ReaderRecord, parse
from dcr_format.publish import _commit
from dcr_format.store.store import open_store
from dcr_format.sync.group import ReaderGroup

UPDATED = "2026-01-01T00:00:00Z"


def _record(store: str, reader_id: str, **fields: object) -> None:
    record = ReaderRecord(reader_id=reader_id, updated=UPDATED, **fields)  # type: ignore[arg-type]
    open_store(store).put(f"readers/{reader_id}.json", record.to_json())


def _twins() -> list[dict[str, torch.Tensor]]:
    """A base and two steps of tensors where the codings against the old bits pay, each twice
    (``w`` and ``w2``: steps of small bfloat16 weights, classed positions and update-sized
    values; ``u`` and ``u2``: float32 one-ulp steps, ulp values), and an int16 tensor."""
    gen = torch.Generator().manual_seed(11)
    master = torch.randn(96, 96, generator=gen) * 0.02
    ulps = (torch.rand(4096, generator=gen) + 1.0).view(torch.int32)
    counts = torch.randint(0, 1 << 14, (4096,), generator=gen, dtype=torch.int16)
    states = []
    for _ in range(3):
        w, u = master.bfloat16(), ulps.clone().view(torch.float32)
        states.append({"w": w, "w2": w.clone(), "u": u, "u2": u.clone(), "k": counts.clone()})
        master = master - 2e-3 * torch.sign(torch.randn(96, 96, generator=gen)) * (
            master.abs() < 0.01
        )
        ulps[torch.randint(0, 4096, (120,), generator=gen)] += 1
        counts[torch.randint(0, 4096, (120,), generator=gen)] ^= 3
    return states


@pytest.mark.parametrize("threads", [2, 1])  # 1: the stream a device writer codes, on the host
def test_a_writer_codes_against_the_old_bits_only_the_names_every_record_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr("dcr_format.delta.pipeline.CODING_THREADS", threads)
    free = str(tmp_path / "free")
    writer = DeltaWriter(free)
    for state in _twins():
        writer.publish(state)
    both = {"w", "w2", "u", "u2"}
    assert coded_against_old_bits(free, 1) == both == coded_against_old_bits(free, 2)

    store = str(tmp_path / "store")
    _record(store, "engine-a", reads_baseline=False, baseline_names=("k", "u", "w"))
    _record(store, "engine-b", reads_baseline=False, baseline_names=("u", "w", "w2"))
    _record(store, "eval")  # reads every tensor's old bits
    caplog.set_level(logging.INFO, logger="dcr_format.publish.writer")
    writer = DeltaWriter(store)
    for state in _twins():
        writer.publish(state)
    assert coded_against_old_bits(store, 1) == {"u", "w"} == coded_against_old_bits(store, 2)
    said = caplog.records[-1].getMessage()
    assert "positions-classed, values-ulp, values-ulp-shift only for the 2 tensors" in said
    assert "reader records limiting them: engine-a, engine-b" in said
    # the twins coded plain take more bytes than those coded against the old bits
    chain = Chain(open_store(store))
    sizes = {e.name: e.encoded_bytes for m in chain.manifests(chain.record(1)) for e in m.entries}
    assert sizes["w"] < sizes["w2"] and sizes["u"] < sizes["u2"]
    held: dict[str, torch.Tensor] = {}
    DeltaReader(store, StateDictTarget(held)).sync()
    for name, tensor in _twins()[-1].items():
        assert torch.equal(held[name].view(torch.uint8), tensor.view(torch.uint8)), name

    # a record of a reader that reads no old bits (no list) leaves every tensor plain
    _record(store, "old-engine", reads_baseline=False)
    writer.publish(_twins()[1])
    assert not coded_against_old_bits(store, 3)


# --- a module behind an engine-like loader ---------------------------------------------------

R, C = 64, 128
NAMES = ("q", "k", "v", "o", "gate", "up", "scaled", "norm")
WHOLE = {"q", "k", "v", "o"}  # placed whole into one contiguous run of a parameter


class Engine(nn.Module):
    """Loads like an engine: q, k and v fused into one parameter (row blocks) and o whole,
    placed whole; gate split over two parameters, up transposed, scaled multiplied and norm
    cast to float32, none of which a reader can read the canonical bits of."""

    def __init__(self) -> None:
        super().__init__()

        def param(*shape: int, dtype: torch.dtype = torch.bfloat16) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.qkv, self.o = param(3 * R, C), param(R, C)
        self.gate_a, self.gate_b, self.up_t = param(R // 2, C), param(R // 2, C), param(C, R)
        self.scaled, self.norm = param(R, C), param(C, dtype=torch.float32)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, w in weights:
            if name in ("q", "k", "v"):
                at = "qkv".index(name) * R
                self.qkv.data[at : at + R].copy_(w)
            elif name == "o":
                self.o.data.copy_(w)
            elif name == "gate":
                self.gate_a.data.copy_(w[: R // 2])
                self.gate_b.data.copy_(w[R // 2 :])
            elif name == "up":
                self.up_t.data.copy_(w.t())
            elif name == "scaled":
                self.scaled.data.copy_(w * 2)
            else:
                self.norm.data.copy_(w)
        return {name for name, _ in weights}


def _bits(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().reshape(-1).view(torch.uint8).clone() for n, p in module.named_parameters()
    }


def _steps(count: int) -> list[dict[str, torch.Tensor]]:
    """A base and ``count`` optimizer-like steps: about 1% of the weights move by a small
    update each step (bfloat16 of float32 masters)."""
    gen = torch.Generator().manual_seed(5)
    masters = {n: torch.randn(C if n == "norm" else (R, C), generator=gen) * 0.02 for n in NAMES}
    states = []
    for _ in range(count + 1):
        states.append({n: m.bfloat16() for n, m in masters.items()})
        for m in masters.values():
            moved = torch.rand(m.shape, generator=gen) < 0.02
            m += moved * 1e-4 * torch.sign(torch.randn(m.shape, generator=gen))
    return states


def _sync_module(store: str, plain: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Publish the steps with a module reader syncing each; returns the bytes of the deltas'
    shards and of the entries of the names placed whole.
    ``plain``: the reader records that it reads no old bits (the record without a list)."""
    states = _steps(3)
    writer = DeltaWriter(store)
    writer.publish(states[0])
    module = Engine()
    target = ModuleTarget(module, load_weights=module.load_weights)
    if plain:
        monkeypatch.setattr(target, "baseline_names", lambda: frozenset())
        monkeypatch.setattr(target, "baseline_except", lambda names: None)
    reader = DeltaReader(store, target)
    reader.sync()
    record = json.loads(open_store(store).get(open_store(store).list("readers/")[0]))
    assert record["reads_baseline"] is False
    assert record.get("baseline_names") == (None if plain else sorted(WHOLE))
    total = whole = 0
    chain = Chain(open_store(store))
    for number, state in enumerate(states[1:], start=1):
        writer.publish(state)
        coded = coded_against_old_bits(store, number)
        assert not coded if plain else (coded and coded <= WHOLE)
        assert reader.sync().version == number
        dense = Engine()
        dense.load_weights(state.items())
        want, got = _bits(dense), _bits(module)
        assert all(torch.equal(got[n], want[n]) for n in want), number
        manifests = chain.manifests(chain.record(number))
        total += sum(s.size for m in manifests for s in m.shards)
        whole += sum(e.encoded_bytes for m in manifests for e in m.entries if e.name in WHOLE)
    return total, whole


def test_a_module_reader_gets_the_smaller_codings_for_the_names_placed_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = _sync_module(str(tmp_path / "listed"), False, monkeypatch)
    plain = _sync_module(str(tmp_path / "plain"), True, monkeypatch)
    assert listed[1] < 0.8 * plain[1] and listed[0] < plain[0], (listed, plain)


def test_a_tensor_parallel_rank_lists_only_the_names_it_does_not_hold() -> None:
    """Shards and the names it transforms read no canonical bits; the experts of the other
    rank it never takes, so any coding of them is fine for it."""
    import test_module_target as tm

    module = tm.Runtime(tp_rank=0, tp=2)
    target = ModuleTarget(module, load_weights=module.load_weights)
    target.prewarm({n: (torch.bfloat16, s) for n, s in tm.SPECS.items()})
    assert target.baseline_names() == {"experts.2.weight", "experts.3.weight"}
    assert ModuleTarget(
        module, load_weights=module.load_weights, direct=False
    ).baseline_names() == (frozenset())


def test_a_module_reader_through_its_loader_reads_the_old_bits_of_names_placed_whole(
    tmp_path: Path,
) -> None:
    """Without ``direct`` every change is written through the loader, but a change coded
    against the old bits is still completed against the canonical view (read only); the
    target may switch between the two after its record is written."""
    store = str(tmp_path / "store")
    states = _steps(4)
    writer = DeltaWriter(store)
    writer.publish(states[0])
    module = Engine()
    target = ModuleTarget(module, load_weights=module.load_weights, direct=False)
    reader = DeltaReader(store, target)
    reader.sync()
    assert target.baseline_names() == WHOLE
    for number, state in enumerate(states[1:], start=1):
        writer.publish(state)
        assert coded_against_old_bits(store, number)
        target.direct = number % 2 == 0
        assert reader.sync().version == number
        dense = Engine()
        dense.load_weights(state.items())
        want, got = _bits(dense), _bits(module)
        assert all(torch.equal(got[n], want[n]) for n in want), number


class _Partial(StateDictTarget):
    """A dict target that says it reads the old bits of ``readable`` only."""

    readable: frozenset[str] = frozenset({"w"})

    def reads_baseline(self) -> bool:
        return False

    def baseline_names(self) -> frozenset[str]:
        return self.readable


def test_a_reader_rewrites_its_record_when_the_names_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    states = _twins()
    writer.publish(states[0])
    target = _Partial({})
    reader = DeltaReader(store, target, reader_id="rollout-1")

    def listed() -> object:
        return json.loads(open_store(store).get("readers/rollout-1.json")).get("baseline_names")

    reader.sync()
    assert listed() == ["w"]
    target.readable = frozenset({"u", "w", "w2"})
    writer.publish(states[1])
    reader.sync()  # the record is written while the sync stages, before the next publish
    assert listed() == ["u", "w", "w2"]
    writer.publish(states[2])
    assert coded_against_old_bits(store, 2) == {"u", "w", "w2"}
    # a target giving more names than a record holds: the first in order are listed
    monkeypatch.setattr("dcr_format.sync._commit.MAX_BASELINE_NAMES", 2)
    target.readable = frozenset({"u", "w", "w2", "k"})
    reader.sync()
    assert listed() == ["k", "u"]


@pytest.mark.parametrize(
    ("names", "why"),
    [
        ([f"n{i:05d}" for i in range(MAX_BASELINE_NAMES + 1)], "at most 4096 items"),
        (["a\x07b"], "should match pattern"),
        (["__metadata__"], "reserved"),
        ([""], "at least 1 character"),
        (["w", "u"], "sorted order"),
        (["u", "u"], "sorted order"),
        ("w", "valid array"),
        ([1], "valid string"),
    ],
)
def test_a_hostile_list_is_refused_and_its_record_ignored(
    tmp_path: Path, names: object, why: str
) -> None:
    tree = json.loads(
        ReaderRecord(reader_id="bad", updated=UPDATED, reads_baseline=False).to_json()
    )
    tree["baseline_names"] = names
    data = json.dumps(tree).encode()
    with pytest.raises(SchemaError, match=why):
        parse(ReaderRecord, data, what="readers/bad.json")
    store = open_store(str(tmp_path / "store"))
    store.put("readers/bad.json", data)
    _record(str(tmp_path / "store"), "good", reads_baseline=False, baseline_names=("u", "w"))
    assert _commit.read_reader_records(store).baseline_names == {"u", "w"}


def test_a_list_with_every_tensor_readable_is_refused() -> None:
    tree = json.loads(ReaderRecord(reader_id="r", updated=UPDATED).to_json())
    tree["baseline_names"] = ["w"]
    with pytest.raises(SchemaError, match="only with reads_baseline false"):
        parse(ReaderRecord, json.dumps(tree).encode(), what="readers/r.json")


class _RecordBefore(schema._Model):
    """A reader record as a writer that does not know ``baseline_names`` reads it."""

    format_version: int = 1
    reader_id: str
    updated: str
    overwrite: tuple[str, ...] = ()
    reads_baseline: bool = True
    features: tuple[str, ...] | None = None


def test_a_writer_that_does_not_know_the_list_reads_the_record_as_reading_no_old_bits() -> None:
    """Ignoring the list (an unknown member, FORMAT.md §3.1), it reads ``reads_baseline``
    false and codes every tensor plain, even at the most names a record lists."""
    names = tuple(f"model.layers.{i}.weight" for i in range(MAX_BASELINE_NAMES))
    record = ReaderRecord(
        reader_id="engine",
        updated=UPDATED,
        reads_baseline=False,
        baseline_names=tuple(sorted(names)),
    )
    before = parse(_RecordBefore, record.to_json(), what="readers/engine.json")
    assert before.reads_baseline is False and before.reader_id == "engine"


def _module_bytes_bench() -> Any:
    """``benchmarks/module_bytes_bench.py``, loaded as a module."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "module_bytes_bench.py"
    spec = importlib.util.spec_from_file_location("module_bytes_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _bench_states(
    shapes: dict[str, tuple[int, ...]], *, seed: int
) -> list[dict[str, torch.Tensor]]:
    """A base and two steps of bf16 tensors of ``shapes``: about 5% of each moves a step."""
    gen = torch.Generator().manual_seed(seed)
    masters = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    states = []
    for _ in range(3):
        states.append({n: m.bfloat16() for n, m in masters.items()})
        for m in masters.values():
            m += (torch.rand(m.shape, generator=gen) < 0.05) * 3e-4
    return states


def test_the_module_bytes_benchmark_syncs_an_engine_module_exactly() -> None:
    """``benchmarks/module_bytes_bench.py`` on a one-layer Llama-like state: the engine reads
    the old bits of every name at tp 1, of the whole ones only at tp 2, and every step
    matches a dense load."""
    bench = _module_bytes_bench()
    shapes = {"model.embed_tokens.weight": (64, 32), "model.norm.weight": (32,)}
    for part, shape in (
        ("self_attn.q_proj", (32, 32)),
        ("self_attn.k_proj", (32, 32)),
        ("self_attn.v_proj", (32, 32)),
        ("self_attn.o_proj", (32, 32)),
        ("mlp.gate_proj", (64, 32)),
        ("mlp.up_proj", (64, 32)),
        ("mlp.down_proj", (32, 64)),
        ("input_layernorm", (32,)),
    ):
        shapes[f"model.layers.0.{part}.weight"] = shape
    states = _bench_states(shapes, seed=2)
    assert bench.run(states, listed=True, tp=1)["readable"] == len(shapes)
    assert bench.run(states, listed=True, tp=2)["readable"] == 3  # embeddings and norms
    assert bench.run(states, listed=False, tp=1)["readable"] == 0


def test_the_module_bytes_benchmark_fuses_experts_and_compares_the_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its mixture-of-experts engine fuses every layer's experts like vLLM and matches a dense
    load; with more names placed whole than a list holds (4 here), the record the reader
    writes lists the exceptions (every name readable), the ``capped`` one the 4 largest,
    and the exceptions take fewer bytes."""
    bench = _module_bytes_bench()
    monkeypatch.setattr("dcr_format.targets.module.MAX_BASELINE_NAMES", 4)
    monkeypatch.setattr("dcr_format.sync._commit.MAX_BASELINE_NAMES", 4)
    shapes = {"model.embed_tokens.weight": (64, 32), "model.layers.0.mlp.gate.weight": (8, 32)}
    projections = (("gate_proj", (16, 32)), ("up_proj", (16, 32)), ("down_proj", (32, 16)))
    for e in range(8):
        for proj, shape in projections:
            shapes[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = shape
    states = _bench_states(shapes, seed=4)
    engine = bench.Engine({n: tuple(s) for n, s in shapes.items()})
    assert {n for n in engine.params if "w13" in n or "w2" in n} == {
        "model_layers_0_mlp_w13",
        "model_layers_0_mlp_w2",
    }
    runs = {mode: bench.run(states, listed=mode, tp=1) for mode in ("listed", "capped", "plain")}
    assert [runs[m]["readable"] for m in ("listed", "capped", "plain")] == [len(shapes), 4, 0]
    assert runs["listed"]["median"] < runs["capped"]["median"] < runs["plain"]["median"]


class _Expert(nn.Module):
    """Rank ``rank`` of two expert-parallel ranks: it holds its own expert whole; rank 0 also
    holds rank 1's expert, transposed (no canonical bits to read), rank 1 none of rank 0's."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.mine = nn.Parameter(torch.zeros(R, C, dtype=torch.bfloat16), requires_grad=False)
        self.other_t = nn.Parameter(torch.zeros(C, R, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        loaded = set()
        for name, w in weights:
            if name == f"e{self.rank}":
                self.mine.data.copy_(w)
            elif self.rank == 0:
                self.other_t.data.copy_(w.t())
            else:
                continue  # the other rank's expert
            loaded.add(name)
        return loaded


class _Rank(ReaderGroup):
    """A reader that is rank ``rank`` of a group, without torch.distributed (it agrees with
    nobody: the test syncs the ranks one after the other)."""

    def __init__(self, rank: int) -> None:
        super().__init__(None, solo=True)
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank


def test_ranks_of_a_group_with_one_reader_id_keep_a_record_each(tmp_path: Path) -> None:
    """Ranks holding different parts read the old bits of different tensors: each keeps its
    own record under the group's ``reader_id``, so that a writer codes against the old bits
    only the tensors every rank reads them of (one shared record would hold the last rank's
    list, and the other rank could not decode what the writer codes against it)."""
    gen = torch.Generator().manual_seed(3)
    masters = {n: torch.randn(R, C, generator=gen) * 0.02 for n in ("e0", "e1")}
    states = []
    for _ in range(3):
        states.append({n: m.bfloat16() for n, m in masters.items()})
        for m in masters.values():
            moved = torch.rand(m.shape, generator=gen) < 0.02
            m += moved * 1e-4 * torch.sign(torch.randn(m.shape, generator=gen))
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    writer.publish(states[0])
    modules = [_Expert(r) for r in range(2)]
    readers = []
    for r, module in enumerate(modules):
        target = ModuleTarget(module, load_weights=module.load_weights)
        reader = DeltaReader(store, target, reader_id="rollout")
        reader.group = _Rank(r)
        reader.sync()  # rank 1 writes its record last
        readers.append(reader)
    assert [r.target.baseline_names() for r in readers] == [{"e0"}, {"e0", "e1"}]
    assert _commit.read_reader_records(open_store(store)).baseline_names == {"e0"}
    for number, state in enumerate(states[1:], start=1):
        writer.publish(state)
        # e1's old bits rank 0 reads at each changed element only: its values may still be
        # ulp differences, its positions not classed nor its values ulp-shift
        codings = _codings(store, number)
        assert {n for n, c in codings.items() if c & {"classed", "ulp-shift"}} <= {"e0"}
        assert codings["e1"] <= {"ulp", "rans", "rice", "ranges", "planes", None}
        for reader, module in zip(readers, modules, strict=True):
            assert reader.sync().version == number
            dense = _Expert(module.rank)
            dense.load_weights(state.items())
            want, got = _bits(dense), _bits(module)
            assert all(torch.equal(got[n], want[n]) for n in want), number


def _codings(store: str, version: int) -> dict[str, set[str | None]]:
    """The position and value codings of each entry of ``version``."""
    chain = Chain(open_store(store))
    return {
        e.name: {e.positions and e.positions.coding, e.values and e.values.coding}
        for m in chain.manifests(chain.record(version))
        for e in m.entries
    }


def test_a_record_of_long_names_is_kept_within_what_writers_read(tmp_path: Path) -> None:
    """4096 names of 300 characters are more than a record's 1 MiB: the reader lists the
    first of them that fit, so that writers read the record (one they cannot read they
    ignore, and would code every tensor against the old bits)."""
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    states = _twins()
    writer.publish(states[0])
    target = _Partial({})
    long = {f"x{i:04d}".ljust(300, "y") for i in range(MAX_BASELINE_NAMES - 1)}
    target.readable = frozenset({"w", *long})
    DeltaReader(store, target, reader_id="long").sync()
    data = open_store(store).get("readers/long.json")
    assert len(data) <= schema.MAX_READER_JSON_BYTES
    listed = parse(ReaderRecord, data, what="readers/long.json").baseline_names
    assert listed is not None and listed[0] == "w" and len(listed) > 3000
    writer.publish(states[1])
    assert coded_against_old_bits(store, 1) == {"w"}
