"""The ``positions-classed`` feature end to end (FORMAT.md §6.5): a writer allowed it codes
xor positions against the old bits where that is shorter, a reader decodes them against the
tensor it applies to (one version or several per sync, staged or not), and every failure is
refused before the target changes: a target that cannot read its old bits, one edited
outside dcr, a manifest that breaks the rules, a reader without the feature."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget, StateDictTarget
from dcr_format.chain.chain import Chain
from dcr_format.errors import (
    BaselineCodingError,
    BaselineMismatchError,
    SchemaError,
    UnsupportedFeatureError,
)
from dcr_format.format import schema
from dcr_format.store.store import open_store
from dcr_format.tools import diff

FEATURE = "positions-classed"


class Trainer:
    """fp32 masters published as bf16: each step moves every master by about ``lr``, so
    small weights (fine bf16 spacing) change their bits far more often than large ones."""

    def __init__(self, seed: int, shapes: dict[str, tuple[int, ...]], lr: float = 2e-6) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.masters = {n: torch.randn(*s, generator=self.gen) * 0.02 for n, s in shapes.items()}
        self.lr = lr

    def state(self) -> dict[str, torch.Tensor]:
        return {n: m.to(torch.bfloat16) for n, m in self.masters.items()}

    def step(self) -> dict[str, torch.Tensor]:
        for master in self.masters.values():
            noise = torch.randn(master.shape, generator=self.gen)
            master += self.lr * torch.sign(noise)
        return self.state()


SHAPES = {"a.weight": (64, 512), "b.weight": (128, 256), "norm.weight": (512,)}


def entries(store: Path | str, version: int) -> dict[str, dict[str, object]]:
    chain = Chain(open_store(store))
    return {
        e.name: {"op": e.op, "positions": e.positions.coding if e.positions else None}
        for m in chain.manifests(chain.record(version))
        for e in m.entries
    }


def coded_against_old_bits(store: Path | str, version: int) -> set[str]:
    """The entries of ``version`` coded against the old bits (classed, ulp or ulp-shift)."""
    chain = Chain(open_store(store))
    return {
        e.name
        for m in chain.manifests(chain.record(version))
        for e in m.entries
        if (e.positions is not None and e.positions.coding == "classed")
        or (e.values is not None and e.values.coding in ("ulp", "ulp-shift"))
    }


def against_old_bits(store: Path | str, version: int) -> bool:
    """Whether some entry of ``version`` is coded against the old bits."""
    return bool(coded_against_old_bits(store, version))


def shard_bytes(store: Path | str, version: int) -> int:
    chain = Chain(open_store(store))
    return sum(s.size for m in chain.manifests(chain.record(version)) for s in m.shards)


def equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(
        torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want
    )


@pytest.fixture(params=["native", "reference"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "reference":
        monkeypatch.setenv("DCR_KERNELS", "torch")
    return str(request.param)


def test_classed_chain_is_smaller_and_reads_back_exactly(tmp_path: Path, kernels: str) -> None:
    plain_store, classed_store = tmp_path / "plain", tmp_path / "classed"
    plain = DeltaWriter(plain_store, features=())  # the plain codings
    classed = DeltaWriter(classed_store, features=[FEATURE])
    trainer = Trainer(1, SHAPES)
    states = [trainer.state()]
    for writer in (plain, classed):
        writer.publish(states[0])
    one_by_one = StateDictTarget({})
    reader = DeltaReader(classed_store, one_by_one)
    reader.sync()
    for version in range(1, 4):
        states.append(trainer.step())
        for writer in (plain, classed):
            writer.publish(states[-1])
        if version == 2:
            prepared = reader.prepare()  # staged against the live tensors, then written
            assert prepared._staged
            reader.apply(prepared)
        else:
            reader.sync()
        assert equal(one_by_one.tensors, states[-1])
    codings = entries(classed_store, 3)
    assert codings["a.weight"] == {"op": "xor", "positions": "classed"}
    assert all(c["positions"] != "classed" for c in entries(plain_store, 3).values())
    record = Chain(open_store(classed_store)).record(3).record
    assert record.required_features == (FEATURE,)
    assert shard_bytes(classed_store, 3) < 0.92 * shard_bytes(plain_store, 3)
    # several versions in one sync: each decodes against the bits the previous one left
    fresh = StateDictTarget({})
    DeltaReader(classed_store, fresh).sync(to=0)
    result = DeltaReader(classed_store, fresh).sync()
    assert result.applied_versions == (1, 2, 3) and equal(fresh.tensors, states[-1])
    # dcr diff reports an upper bound from the declared counts, and the exact count on demand
    report = diff(classed_store, 0, 3)
    row = next(r for r in report.tensors if r.name == "a.weight")
    assert not row.exact
    exact = next(r for r in diff(classed_store, 0, 3, exact=True).tensors if r.name == "a.weight")
    want = int(
        (states[0]["a.weight"].view(torch.int16) != states[3]["a.weight"].view(torch.int16)).sum()
    )
    assert exact.exact and exact.elements == want <= row.elements


@pytest.mark.parametrize("audit", [True, False])
def test_an_edited_target_is_refused_and_left_as_it_was(tmp_path: Path, audit: bool) -> None:
    store = tmp_path / "store"
    writer = DeltaWriter(store, features=[FEATURE])
    trainer = Trainer(2, SHAPES)
    writer.publish(trainer.state())
    target = StateDictTarget({})
    reader = DeltaReader(store, target)
    reader.sync()
    writer.publish(trainer.step())
    assert entries(store, 1)["a.weight"]["positions"] == "classed"
    tensor = target.tensors["a.weight"]
    tensor.view(-1)[:4096] *= 2  # outside dcr: moves elements between classes
    edited = tensor.clone()
    # audited: the lanes catch it first; trusted: the positions do not decode against the
    # edited bits, or the tensor does not match afterwards and is rolled back and diagnosed
    with pytest.raises(BaselineMismatchError):
        reader.sync(audit=audit)
    assert torch.equal(target.tensors["a.weight"].view(torch.int16), edited.view(torch.int16))
    assert target.resident().version == 0


@pytest.mark.parametrize("feature", [FEATURE, "values-ulp", "values-ulp-shift"])
def test_a_module_target_asks_for_plain_codings_where_it_cannot_read_old_bits(
    tmp_path: Path, feature: str
) -> None:
    import test_module_target as tm  # the vLLM-like runtime and its checkpoint

    store = str(tmp_path / "store")
    features = [feature, "values-rans"]
    writer = DeltaWriter(store, features=features)
    gen = torch.Generator().manual_seed(3)
    state = {n: (torch.randn(*s, generator=gen) * 0.02).bfloat16() for n, s in tm.SPECS.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    writer.publish(state)
    module = tm.Runtime()
    reader = DeltaReader(store, ModuleTarget(module, load_weights=module.load_weights))
    reader.sync()
    reader.prewarm()  # records its overwrite names and the names whose old bits it reads
    records = [json.loads(open_store(store).get(k)) for k in open_store(store).list("readers/")]
    assert [r["reads_baseline"] for r in records] == [False]
    # the names the loader places whole; not the transposed experts, the tied, cast, scaled
    # or overlapping ones
    whole = {n for n in tm.XOR_NAMES if not n.startswith("experts.")}
    assert records[0]["baseline_names"] == sorted(whole)

    def stepped(scale: float, everywhere: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in state.items():
            old = tensor.float()
            moved = old + scale * torch.randn(tensor.shape, generator=gen)
            small = old.abs() < 0.01
            out[name] = torch.where(small | everywhere, moved, old).bfloat16()
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    # a writer reading the records codes against the old bits only the names placed whole
    # (and ulp values of any name: the module reads the old bits of each changed element)
    assert records[0]["reads_changed"] is True
    first = stepped(1e-3)
    writer.publish(first)
    coded = coded_against_old_bits(store, 1)
    placed = {n for n in tm.XOR_NAMES if n.startswith("experts.")}
    assert coded <= (whole | placed if feature == "values-ulp" else whole)
    assert coded or feature != FEATURE
    assert reader.sync().version == 1
    tm.assert_module(module, first)
    # one that ignores them (overwrite configured by hand) sends such codings for the experts
    # too, which the module refuses before anything changes (it holds no canonical old bits
    # of a transposed tensor to decode with)
    overwrite = {name: "overwrite" for name in tm.OVERWRITE_NAMES}
    ignoring = DeltaWriter(store, features=features, reader_records=False, ops=overwrite)
    second = stepped(2e-3) if feature == FEATURE else stepped(2e-4, everywhere=True)
    ignoring.publish(second)
    assert coded_against_old_bits(store, 2) - whole
    if feature == "values-ulp":  # completed at each element the module holds, transposed too
        assert reader.sync().version == 2
        tm.assert_module(module, second)
        return
    before = tm.bits_of(module)
    with pytest.raises(BaselineCodingError, match=feature):
        reader.sync()
    after = tm.bits_of(module)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert reader.target.resident().version == 1


def test_manifests_that_break_the_rules_are_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    writer = DeltaWriter(store, features=[FEATURE])
    trainer = Trainer(4, {"a.weight": (64, 512)})
    writer.publish(trainer.state())
    writer.publish(trainer.step())
    chain = Chain(open_store(store))
    loaded = chain.record(1)
    ref = loaded.record.manifests[0]
    raw = json.loads(open_store(store).get(ref.path))
    assert raw["entries"][0]["positions"]["coding"] == "classed"
    from dcr_format.chain.chain import check_manifest

    def check(tree: dict[str, object]) -> None:
        manifest = schema.parse(schema.Manifest, json.dumps(tree).encode(), what="m")
        record = loaded.record
        check_manifest(
            manifest, record.chain_id, 1, "delta", record.attempt, ref.rank, 1, "manifest"
        )

    check(raw)
    no_feature = json.loads(json.dumps(raw))
    no_feature["required_features"] = []
    with pytest.raises(SchemaError, match="positions-classed"):
        check(no_feature)
    overwrite = json.loads(json.dumps(raw))
    overwrite["entries"][0]["op"] = "overwrite"
    with pytest.raises(SchemaError, match="only xor entries"):
        check(overwrite)
    integer = json.loads(json.dumps(raw))
    integer["entries"][0]["dtype"] = "int16"
    with pytest.raises(SchemaError, match="only xor entries"):
        check(integer)


def test_a_reader_without_the_feature_refuses_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    writer = DeltaWriter(store, features=[FEATURE])
    trainer = Trainer(5, {"a.weight": (64, 512)})
    writer.publish(trainer.state())
    target = StateDictTarget({})
    DeltaReader(store, target).sync()
    writer.publish(trainer.step())
    monkeypatch.setattr(schema, "KNOWN_FEATURES", schema.KNOWN_FEATURES - {FEATURE})
    with pytest.raises(UnsupportedFeatureError, match="positions-classed"):
        DeltaReader(store, target).sync()
    assert target.resident().version == 0
