"""ModuleTarget: versions applied through a runtime's own loader, bit-equal to a dense load.

The runtime below loads like vLLM: fused qkv and gate_up with tensor-parallel narrows,
a row-parallel projection narrowed on dim 1, tied embeddings, a norm loaded into an
fp32 parameter from bf16, a loader that scales, experts of other ranks skipped, and a
copy whose destinations overlap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget, TargetError
from dcr_format.chain.chain import Chain
from dcr_format.errors import ApplyError, BaselineMismatchError, OverwriteRequiredError
from dcr_format.store.store import open_store
from dcr_format.testing.processes import in_threads

H, Q, KV, FF, V = 8, 8, 4, 12, 16
SPECS = {
    "model.embed_tokens.weight": (V, H),
    "lm_head.weight": (V, H),
    "q_proj.weight": (Q, H),
    "k_proj.weight": (KV, H),
    "v_proj.weight": (KV, H),
    "o_proj.weight": (H, Q),
    "gate_proj.weight": (FF, H),
    "up_proj.weight": (FF, H),
    "down_proj.weight": (H, FF),
    "norm.weight": (H,),
    "scaled.weight": (H, H),
    **{f"experts.{e}.weight": (H, H) for e in range(4)},
    "overlap.weight": (8,),
}
XOR_NAMES = {
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    *(f"experts.{e}.weight" for e in range(4)),
}
OVERWRITE_NAMES = set(SPECS) - XOR_NAMES


class Runtime(nn.Module):
    """A vLLM-like model: its own layout, and a loader that places canonical names."""

    def __init__(self, tp_rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp = tp_rank, tp

        def param(*shape: int, dtype: torch.dtype = torch.bfloat16) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.embed = param(V, H)  # tied: embed_tokens and lm_head
        self.qkv = param((Q + 2 * KV) // tp, H)
        self.o = param(H, Q // tp)
        self.gate_up = param(2 * FF // tp, H)
        self.down = param(H, FF // tp)
        self.norm = param(H, dtype=torch.float32)
        self.scaled = param(H, H)
        self.experts = param(4 // tp, H, H)
        self.overlap = param(6)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        r, tp = self.tp_rank, self.tp
        loaded = set()
        for name, w in weights:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                self.embed.data.copy_(w)
            elif name in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
                size = {"q": Q, "k": KV, "v": KV}[name[0]] // tp
                at = {"q": 0, "k": Q, "v": Q + KV}[name[0]] // tp
                self.qkv.data.narrow(0, at, size).copy_(w.narrow(0, r * size, size))
            elif name == "o_proj.weight":
                cols = Q // tp
                self.o.data.copy_(w.narrow(1, r * cols, cols))
            elif name in ("gate_proj.weight", "up_proj.weight"):
                size = FF // tp
                at = 0 if name.startswith("gate") else size
                self.gate_up.data[at : at + size].copy_(w[r * size : (r + 1) * size])
            elif name == "down_proj.weight":
                cols = FF // tp
                self.down.data.copy_(w[:, r * cols : (r + 1) * cols])
            elif name == "norm.weight":
                self.norm.data.copy_(w)  # bf16 into fp32: a cast
            elif name == "scaled.weight":
                self.scaled.data.copy_(w * 2)
            elif name.startswith("experts."):
                expert = int(name.split(".")[1])
                per_rank = 4 // tp
                if expert // per_rank != r:
                    continue  # another rank's expert
                self.experts.data[expert % per_rank].copy_(w.t())
            elif name == "overlap.weight":
                self.overlap.data[0:4].copy_(w[0:4])
                self.overlap.data[2:6].copy_(w[4:8])  # overwrites elements 2 and 3
            else:
                raise KeyError(f"unknown weight {name}")
            loaded.add(name)
        return loaded


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {n: torch.randn(*s, generator=gen).bfloat16() for n, s in SPECS.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def step(state: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """A sparse "optimizer step": a few elements of every tensor move."""
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        new = tensor.clone()
        new.view(-1)[k % 5 :: 6] += 0.125 * (k + 1)
        out[name] = new
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def bits_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().reshape(-1).view(torch.uint8).clone() for n, p in module.state_dict().items()
    }


def dense(state: dict[str, torch.Tensor], rank: int = 0, tp: int = 1) -> dict[str, torch.Tensor]:
    module = Runtime(rank, tp)
    module.load_weights(state.items())
    return bits_of(module)


def assert_module(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    want = dense(state, module.tp_rank, module.tp)
    got = bits_of(module)
    for name in want:
        assert torch.equal(got[name], want[name]), f"parameter {name} differs from a dense load"


class LaneSum:
    """A reduce_lanes for reader ranks that are threads."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=60)
        self.parts: list[dict] = [{} for _ in range(ranks)]

    def rank(self, r: int):  # type: ignore[no-untyped-def]
        def reduce(lanes: dict) -> dict:
            self.parts[r] = dict(lanes)
            self.barrier.wait()
            total: dict[str, list[int]] = {}
            for part in self.parts:
                for name, values in part.items():
                    sums = total.setdefault(name, [0] * len(values))
                    for i, v in enumerate(values):
                        sums[i] += v
            self.barrier.wait()
            return {name: tuple(v) for name, v in total.items()}

        return reduce


def manifest_ops(store: str, version: int) -> dict[str, str]:
    chain = Chain(open_store(store))
    return {e.name: e.op for m in chain.manifests(chain.record(version)) for e in m.entries}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("reduce", [True, False])
def test_chain_through_the_loader_equals_dense_loads(tmp_path, tp, reduce):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    modules = [Runtime(r, tp) for r in range(tp)]
    lanes = LaneSum(tp)
    readers = [
        DeltaReader(
            store,
            ModuleTarget(
                modules[r],
                load_weights=modules[r].load_weights,
                reduce_lanes=lanes.rank(r) if reduce else None,
            ),
            reader_id=f"rollout-{r}",
        )
        for r in range(tp)
    ]
    results = in_threads(lambda r: readers[r].sync(), tp)
    for module in modules:
        assert_module(module, state)
    for k in range(4):
        state = step(state, k)
        writer.publish(state)
        results = in_threads(lambda r: readers[r].sync(), tp)
        for module in modules:
            assert_module(module, state)
        # the reader records reached the writer before the first delta: no xor is refused
        ops = manifest_ops(store, k + 1)
        assert {n for n, op in ops.items() if op == "overwrite"} == OVERWRITE_NAMES
        for result in results:
            unverified = set(result.unverified)
            assert unverified >= {"norm.weight", "scaled.weight", "overlap.weight"}
            sharded = XOR_NAMES - {f"experts.{e}.weight" for e in range(4)}
            if tp > 1 and not reduce:
                assert unverified >= sharded  # partial lanes, nobody to add them up with
            else:
                assert not unverified & XOR_NAMES  # read back through the placements


def test_prewarm_classifies_every_name(tmp_path):
    module = Runtime(1, 2)
    target = ModuleTarget(module, load_weights=module.load_weights)
    before = bits_of(module)
    plans = target.prewarm({n: (torch.bfloat16, s) for n, s in SPECS.items()})
    assert bits_of(module).keys() == before.keys()
    assert all(torch.equal(bits_of(module)[n], before[n]) for n in before)  # nothing written
    kinds = {n: p.kind for n, p in plans.items()}
    assert {n for n, k in kinds.items() if k == "absent"} == {
        "experts.0.weight",
        "experts.1.weight",
    }
    assert {n for n, k in kinds.items() if k == "xor"} == XOR_NAMES - {
        "experts.0.weight",
        "experts.1.weight",
    }
    assert {n for n, k in kinds.items() if k == "overwrite"} == OVERWRITE_NAMES
    assert "tied" in plans["lm_head.weight"].reason
    assert "twice" in plans["overlap.weight"].reason
    assert "transforms" in plans["norm.weight"].reason
    assert not plans["q_proj.weight"].whole and plans["norm.weight"].whole  # a shard, whole
    assert target.overwrite_names() == OVERWRITE_NAMES


@pytest.mark.parametrize("name", sorted(OVERWRITE_NAMES))
def test_xor_is_refused_where_the_loader_is_not_a_placement(tmp_path, name):
    store = str(tmp_path / "store")
    # ignores the reader's request; the plain codings, which need no old bits
    writer = DeltaWriter(store, reader_records=False, features=())
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    reader = DeltaReader(store, ModuleTarget(module, load_weights=module.load_weights))
    reader.sync()
    changed = dict(state)
    changed[name] = state[name].clone()
    changed[name].view(-1)[1] += 1
    if name in ("lm_head.weight", "model.embed_tokens.weight"):
        changed["lm_head.weight"] = changed["model.embed_tokens.weight"] = changed[name]
    writer.publish(changed)
    before = bits_of(module)
    with pytest.raises(OverwriteRequiredError, match=name.replace(".", r"\.")):
        reader.sync()
    after = bits_of(module)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert reader.target.resident().version == 0
    # the reader told the writers (auto-named record, content-addressed)
    records = open_store(store).list("readers/")
    assert len(records) == 1
    record = json.loads(open_store(store).get(records[0]))
    assert set(record["overwrite"]) == OVERWRITE_NAMES


def test_xor_names_go_through_without_a_record(tmp_path):
    store = str(tmp_path / "store")
    # a writer that reads no record sends the plain codings only where told: a module
    # target cannot read codings against its old bits
    writer = DeltaWriter(store, reader_records=False, features=())
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    reader = DeltaReader(store, ModuleTarget(module, load_weights=module.load_weights))
    reader.sync()
    changed = dict(state)
    for name in XOR_NAMES:
        changed[name] = state[name].clone()
        changed[name].view(-1)[::5] += 0.5
    writer.publish(changed)
    assert set(manifest_ops(store, 1).values()) == {"xor"}
    result = reader.sync()
    assert result.version == 1 and not result.unverified
    assert_module(module, changed)


def test_a_module_that_joins_late_reads_codings_against_its_placed_bits(tmp_path):
    # a writer with the default features and no record yet codes against the old bits; a
    # module reader that starts afterwards decodes those codings wherever its loader places
    # a name whole (it reads the name's canonical bits there), and applies the chain exactly
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    gen = torch.Generator().manual_seed(5)
    changed = dict(state)
    placed_whole = {n for n in XOR_NAMES if not n.startswith("experts.")}  # not transposed
    for name in placed_whole:
        old = state[name].float()
        moved = old + 1e-3 * torch.randn(old.shape, generator=gen)
        changed[name] = torch.where(old.abs() < 0.01, moved, old).bfloat16()
    writer.publish(changed)
    chain = Chain(open_store(store))
    entries = [e for m in chain.manifests(chain.record(1)) for e in m.entries]
    assert any(e.positions is not None and e.positions.coding == "classed" for e in entries)
    module = Runtime()
    reader = DeltaReader(store, ModuleTarget(module, load_weights=module.load_weights))
    result = reader.sync()
    assert result.version == 1 and set(result.unverified) <= OVERWRITE_NAMES
    assert_module(module, changed)


def declared_at_base(tmp_path):  # type: ignore[no-untyped-def]
    """A chain at version 0 and a module loaded from its checkpoint, declared at version 0."""
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    dense_module = Runtime()
    dense_module.load_weights(state.items())
    module.load_state_dict(dense_module.state_dict())  # a module loaded from the checkpoint
    chain_id = Chain(open_store(store)).header.chain_id
    target = ModuleTarget(module, load_weights=module.load_weights, version=0, chain_id=chain_id)
    return store, writer, state, module, target


def test_prewarm_before_the_first_delta_tells_the_writer(tmp_path):
    store, writer, state, module, target = declared_at_base(tmp_path)
    reader = DeltaReader(store, target, reader_id="warm")
    assert reader.prewarm() == OVERWRITE_NAMES
    state = step(state, 0)
    writer.publish(state)
    assert {n for n, op in manifest_ops(store, 1).items() if op == "overwrite"} == OVERWRITE_NAMES
    reader.sync()
    assert_module(module, state)


# the loader runs for the 5 names it does not only place (xor names go straight into their
# placements): 10 calls over the two versions, the changes placed directly between them
@pytest.mark.parametrize("fail_at", [1, 5, 9])
def test_failure_during_apply_rolls_the_module_back(tmp_path, fail_at):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    calls = [-(10**9)]  # no failure until the test arms it

    def flaky(weights):  # type: ignore[no-untyped-def]
        weights = list(weights)
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("injected loader failure")
        return module.load_weights(weights)

    target = ModuleTarget(module, load_weights=flaky)
    reader = DeltaReader(store, target)
    reader.sync()
    for k in range(2):
        state = step(state, k)
        writer.publish(state)
    before = bits_of(module)
    calls[0] = -(10**9)  # no failure while the new plans are recorded
    target.prewarm({n: (torch.bfloat16, s) for n, s in SPECS.items()})
    calls[0] = 0
    with pytest.raises(ApplyError, match="injected"):
        reader.sync()
    after = bits_of(module)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert target.resident().version == 0
    calls[0] = -(10**9)
    reader.sync()
    assert_module(module, state)


def test_failed_base_restores_the_module(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store, base_every=1)
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    fail = [False]

    def loader(weights):  # type: ignore[no-untyped-def]
        weights = list(weights)
        if fail[0] and weights[0][0] == "overlap.weight":
            raise RuntimeError("injected loader failure")
        return module.load_weights(weights)

    target = ModuleTarget(module, load_weights=loader)
    reader = DeltaReader(store, target)
    reader.sync()
    writer.publish(checkpoint(1))  # a second base
    before = bits_of(module)
    fail[0] = True
    with pytest.raises(ApplyError):
        reader.sync()
    assert all(torch.equal(bits_of(module)[n], before[n]) for n in before)
    fail[0] = False
    reader.sync()
    assert_module(module, checkpoint(1))


def test_a_module_changed_outside_dcr_is_refused(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    reader = DeltaReader(store, ModuleTarget(module, load_weights=module.load_weights))
    reader.sync()
    writer.publish(step(state, 0))
    with torch.no_grad():
        module.qkv[0, 0] += 1  # q_proj, element 0
    before = bits_of(module)
    with pytest.raises(BaselineMismatchError, match="q_proj"):
        reader.sync()
    assert all(torch.equal(bits_of(module)[n], before[n]) for n in before)


def test_names_the_loader_rejects_are_errors(tmp_path):
    module = Runtime()
    target = ModuleTarget(module, load_weights=module.load_weights)
    with pytest.raises(TargetError, match="rejects tensor 'nope'"):
        target.plan("nope", torch.bfloat16, (2,))

    plain = nn.Linear(3, 2)
    with pytest.raises(TargetError, match="does not know tensor 'nope'"):
        ModuleTarget(plain).plan("nope", torch.float32, (2,))


class Normalising(nn.Module):
    """A loader that derives values from the whole tensor (not pointwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for _, w in weights:
            self.w.data.copy_(w.float() / w.float().abs().max())


def test_a_loader_that_is_not_pointwise_takes_only_full(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 4, generator=gen).bfloat16()
    writer.publish({"w": w})
    module = Normalising()
    target = ModuleTarget(module, load_weights=module.load_weights)
    reader = DeltaReader(store, target)
    reader.sync()
    expected = Normalising()
    expected.load_weights([("w", w)])
    assert torch.equal(module.w, expected.w)
    assert target.plan("w", torch.bfloat16, (4, 4)).kind == "opaque"
    w2 = w.clone()
    w2[0, 0] += 1
    writer.publish({"w": w2}, step=2)
    with pytest.raises(TargetError, match="full only"):
        reader.sync()
    assert torch.equal(module.w, expected.w)


class TiedLinear(nn.Module):
    """A plain torch model loaded with load_state_dict: tied weights and an fp32 norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H, dtype=torch.bfloat16)
        self.head = nn.Linear(H, V, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.embed.weight
        self.norm = nn.Parameter(torch.ones(H, dtype=torch.float32))
        self.proj = nn.Linear(H, H, dtype=torch.bfloat16)


def test_load_state_dict_path(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    source = TiedLinear()
    state = {n: t.detach().clone().bfloat16() for n, t in source.state_dict().items()}
    state["head.weight"] = state["embed.weight"]
    writer.publish(state)
    module = TiedLinear()
    target = ModuleTarget(module)
    reader = DeltaReader(store, target, reader_id="plain")
    reader.sync()
    for k in range(3):
        state = {n: t.clone() for n, t in state.items() if n != "head.weight"}
        for t in state.values():
            t.view(-1)[k::4] += 0.25
        state["head.weight"] = state["embed.weight"]
        writer.publish(state)
        result = reader.sync()
        expected = TiedLinear()
        expected.load_state_dict(state)
        for name, want in expected.state_dict().items():
            assert torch.equal(
                module.state_dict()[name].view(torch.uint8).reshape(-1),
                want.view(torch.uint8).reshape(-1),
            ), name
        assert set(result.unverified) == {"norm", "embed.weight", "head.weight"}
    assert target.overwrite_names() == {"norm", "embed.weight", "head.weight"}
    ops = manifest_ops(store, 3)
    assert ops["proj.weight"] == "xor" and ops["norm"] == ops["head.weight"] == "overwrite"


def test_writer_skips_unreadable_reader_records(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    raw = open_store(store)
    raw.put("readers/broken.json", b"{not json")
    raw.put(
        "readers/other.json",
        b'{"format_version":1,"reader_id":"mismatch","updated":'
        b'"2025-01-02T03:04:05Z","overwrite":["q_proj.weight"]}',
    )
    raw.put(
        "readers/good.json",
        b'{"format_version":1,"reader_id":"good","updated":'
        b'"2025-01-02T03:04:05Z","overwrite":["k_proj.weight"]}',
    )
    writer.publish(step(state, 0))
    ops = manifest_ops(store, 1)
    assert ops["k_proj.weight"] == "overwrite"
    assert ops["q_proj.weight"] == "xor"  # a record under another reader's name is ignored


class Movers(nn.Module):
    """Loaders that copy, permute and scale through temporaries."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16), requires_grad=False)
        self.c = nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16), requires_grad=False)
        self.d = nn.Parameter(torch.zeros(2, 4, 3, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        for name, w in weights:
            if name == "a":
                self.a.data.copy_(w.t().contiguous())  # a bit-preserving copy: still xor
            elif name == "b":
                scaled = w.clone()
                scaled.mul_(2)  # in place on a temporary: a pointwise transform
                self.b.data.copy_(scaled)
            elif name == "c":
                self.c.data.copy_(torch.cat([w[2:], w[:2]]))  # not followed: full only
            elif name == "d":
                self.d.data.copy_(w.unsqueeze(0).expand(2, 4, 3))  # one element, two places


def test_copies_through_temporaries_are_followed(tmp_path):
    module = Movers()
    target = ModuleTarget(module, load_weights=module.load_weights)
    plans = target.prewarm({n: (torch.bfloat16, (4, 3)) for n in "abcd"})
    assert {n: p.kind for n, p in plans.items()} == {
        "a": "xor",
        "b": "overwrite",
        "c": "opaque",
        "d": "xor",
    }
    assert plans["d"].duplicated and plans["d"].whole
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    gen = torch.Generator().manual_seed(7)
    state = {n: torch.randn(4, 3, generator=gen).bfloat16() for n in "abd"}
    writer.publish(state)
    reader = DeltaReader(store, ModuleTarget(module, load_weights=module.load_weights))
    reader.sync()
    for k in range(3):
        state = {n: t.clone() for n, t in state.items()}
        for t in state.values():
            t.view(-1)[k::5] += 1
        writer.publish(state)
        result = reader.sync()
        expected = Movers()
        expected.load_weights(state.items())
        for name in "abd":
            assert torch.equal(
                getattr(module, name).view(torch.int16), getattr(expected, name).view(torch.int16)
            )
        assert set(result.unverified) == {"b"}


def test_a_declared_target_keeps_the_tensors_its_first_delta_left_alone(tmp_path):
    store, writer, state, module, target = declared_at_base(tmp_path)
    reader = DeltaReader(store, target, reader_id="declared")
    reader.prewarm()
    untouched = "o_proj.weight"
    first = step(state, 0)
    first[untouched] = state[untouched]  # delta 1 leaves it alone, delta 2 changes it
    writer.publish(first)
    reader.sync()
    assert_module(module, first)
    second = step(first, 1)
    writer.publish(second)
    reader.sync()
    assert_module(module, second)


def counted(module: Runtime, calls: list[str]):  # type: ignore[no-untyped-def]
    def load_weights(weights):  # type: ignore[no-untyped-def]
        weights = list(weights)
        calls.extend(name for name, _ in weights)
        return module.load_weights(weights)

    return load_weights


def test_placed_names_go_straight_into_storage_without_the_loader(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    modules = {direct: Runtime() for direct in (True, False)}
    calls: dict[bool, list[str]] = {True: [], False: []}
    readers = {
        direct: DeltaReader(
            store,
            ModuleTarget(m, load_weights=counted(m, calls[direct]), direct=direct),
            reader_id=f"direct-{direct}",
        )
        for direct, m in modules.items()
    }
    for reader in readers.values():
        reader.sync()
    for k in range(3):
        state = step(state, k)
        writer.publish(state)
        for direct, reader in readers.items():
            calls[direct].clear()
            result = reader.sync()
            assert not set(result.unverified) & XOR_NAMES  # read back through the placements
            assert_module(modules[direct], state)
        # the loader runs only for the names it transforms or writes twice
        assert set(calls[True]) == OVERWRITE_NAMES
        assert set(calls[False]) == set(SPECS)
    direct, through_loader = (bits_of(m) for m in modules.values())
    assert all(torch.equal(direct[n], through_loader[n]) for n in direct)


def test_a_parameter_whose_storage_moved_is_learned_again(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    reader = DeltaReader(store, ModuleTarget(module, load_weights=module.load_weights))
    reader.sync()
    state = step(state, 0)
    writer.publish(state)
    reader.sync()
    old = module.qkv
    kept = old.detach().clone()
    # the runtime re-creates a fused parameter (e.g. re-processing weights after a load)
    module.qkv = nn.Parameter(old.detach().clone(), requires_grad=False)
    state = step(state, 1)
    writer.publish(state)
    result = reader.sync()
    assert_module(module, state)
    assert torch.equal(old, kept)  # nothing written into the storage the module let go of
    assert not {"q_proj.weight", "k_proj.weight", "v_proj.weight"} & set(result.unverified)


def test_a_change_refused_after_direct_writes_leaves_the_module_as_it_was(tmp_path):
    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    state = checkpoint()
    writer.publish(state)
    module = Runtime()
    target = ModuleTarget(module, load_weights=module.load_weights)
    reader = DeltaReader(store, target)
    reader.sync()
    writer.publish(step(state, 0))
    with torch.no_grad():  # changed outside dcr at a position the delta changes
        module.gate_up.view(-1)[0] += 1
    before = bits_of(module)
    with pytest.raises(BaselineMismatchError, match="gate_proj"):
        reader.sync()  # found after the changes were placed: all of them are undone
    assert all(torch.equal(bits_of(module)[n], before[n]) for n in before)
    assert target.resident().version == 0


WARM = """
import torch
from torch import nn
from dcr_format import ModuleTarget
from dcr_format.kernels import numba_kernels as _native
module = nn.Linear(4, 4, dtype=torch.bfloat16)
target = ModuleTarget(module)
target.prewarm({"weight": (torch.bfloat16, (4, 4)), "bias": (torch.bfloat16, (4,))})
kernels = (_native._change.parallel, _native._change.serial, _native._pair_lanes.serial,
           _native._put_all.parallel, _native._put_all.serial)
assert not any(k.signatures for k in kernels)
target.warm()
assert all(k.signatures for k in kernels), [k.signatures for k in kernels]
"""


@pytest.mark.multiprocess  # a fresh interpreter, whose kernels nothing compiled yet
def test_warm_readies_the_apply_kernels_before_the_first_sync():
    pytest.importorskip("numba")
    env = {k: v for k, v in os.environ.items() if k != "DCR_KERNELS"}
    proc = subprocess.run(
        [sys.executable, "-c", WARM], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
