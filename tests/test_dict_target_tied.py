"""StateDictTarget over tied weights: ``policy.state_dict()`` whose ``lm_head.weight`` is the
same storage as the embedding takes every delta once (an XOR applied through both names would
cancel), stays bit-exact through AdamW steps, and refuses tensors that overlap in part."""

from __future__ import annotations

import pytest
import torch
from conftest import bits
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, StateDictTarget, TargetError
from dcr_format.errors import AliasedTensorError
from dcr_format.targets.change import Resident

VOCAB, HIDDEN = 64, 16


class _TiedLM(nn.Module):
    """A tiny language model whose output projection is its embedding (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.relu(self.mlp(self.embed_tokens(ids))))
        return self.lm_head(hidden)


def _train_and_sync(
    store: str,
    trainer: nn.Module,
    policy: nn.Module,
    steps: int,
    verify: str,
    features: tuple[str, ...] = (),
):
    """Publish ``trainer`` (bf16 export of fp32 masters) after each AdamW step and sync the
    policy's tied state dict; every sync must be bit-exact. Returns the number of syncs."""
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)

    def export() -> dict[str, torch.Tensor]:
        return {n: t.detach().bfloat16() for n, t in trainer.state_dict().items()}

    writer = DeltaWriter(store, features=features)
    writer.publish(export(), step=0)
    state = policy.state_dict()
    tied = state["lm_head.weight"]
    assert tied.untyped_storage().data_ptr() == state["embed_tokens.weight"].data_ptr()
    reader = DeltaReader(store, StateDictTarget(state), verify=verify)  # type: ignore[arg-type]
    syncs = 0
    for step in range(steps + 1):
        if step:
            ids = torch.randint(0, VOCAB, (4, 8), generator=gen)
            loss = nn.functional.cross_entropy(trainer(ids).reshape(-1, VOCAB), ids.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            writer.publish(export(), step=step)
        result = reader.sync()
        syncs += 1
        assert result.unverified == ()
        want = export()
        got = policy.state_dict()
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(bits(got[name]), bits(want[name])), f"{name} at step {step}"
        # the policy still sees the update through its own tied parameter
        assert policy.lm_head.weight.data_ptr() == policy.embed_tokens.weight.data_ptr()
    return syncs


BASELINE_CODED = ("values-rans", "positions-classed", "values-ulp")


@pytest.mark.parametrize("features", [(), BASELINE_CODED])
@pytest.mark.parametrize("verify", ["touched", "all"])
def test_tied_module_follows_adamw_steps_bit_exact(tmp_path, verify, features):
    """Also with codings against the old bits: the tie's second name must be completed
    against the bits before the first name changed the shared storage."""
    torch.manual_seed(0)
    trainer = _TiedLM()
    torch.manual_seed(1)  # the policy's own init, overwritten by the base
    policy = _TiedLM().bfloat16()
    store = str(tmp_path / "store")
    assert _train_and_sync(store, trainer, policy, 5, verify, features) == 6
    if features:  # the tied tensors really were coded against their old bits
        from dcr_format.chain.chain import Chain
        from dcr_format.store.store import open_store

        chain = Chain(open_store(store))
        codings = {
            (e.positions.coding if e.positions else None, e.values.coding if e.values else None)
            for v in range(1, 6)
            for m in chain.manifests(chain.record(v))
            for e in m.entries
            if e.name == "embed_tokens.weight"
        }
        assert any(p == "classed" or v == "ulp" for p, v in codings), codings


@pytest.mark.parametrize("features", [(), BASELINE_CODED])
def test_tiny_llama_with_tied_embeddings_bit_exact(tmp_path, features):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    trainer = transformers.LlamaForCausalLM(config)
    torch.manual_seed(1)
    policy = transformers.LlamaForCausalLM(config).bfloat16()
    store = str(tmp_path / "store")
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)

    def export() -> dict[str, torch.Tensor]:
        return {n: t.detach().bfloat16() for n, t in trainer.state_dict().items()}

    writer = DeltaWriter(store, features=features)
    writer.publish(export(), step=0)
    state = policy.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    reader = DeltaReader(store, StateDictTarget(state))
    reader.sync()
    for step in range(1, 5):
        batch = torch.randint(0, VOCAB, (2, 12), generator=gen)
        trainer(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        writer.publish(export(), step=step)
        result = reader.sync()
        assert result.applied_versions == (step,)
        got, want = policy.state_dict(), export()
        for name in want:
            assert torch.equal(bits(got[name]), bits(want[name])), f"{name} at step {step}"


def test_tied_names_given_different_bits_are_refused_and_rolled_back(tmp_path):
    store = str(tmp_path / "store")
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(8, 4, generator=gen).bfloat16()
    writer = DeltaWriter(store)
    writer.publish({"embed.weight": embed, "lm_head.weight": embed.clone()})
    shared = torch.zeros(8, 4, dtype=torch.bfloat16)
    target = StateDictTarget({"embed.weight": shared, "lm_head.weight": shared})
    reader = DeltaReader(store, target)
    reader.sync()
    before = bits(shared)
    untied = embed.clone()
    untied[0, 0] += 1
    other = embed.clone()
    other[1, 1] -= 1
    writer.publish({"embed.weight": untied, "lm_head.weight": other})
    with pytest.raises(TargetError, match="tied"):
        reader.sync()
    assert torch.equal(bits(shared), before)
    assert target.resident().version == 0


def test_disjoint_views_of_one_buffer_are_independent(tmp_path):
    """A flat buffer holding several tensors side by side (no overlap) is not a tie."""
    store = str(tmp_path / "store")
    gen = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(6, 4, generator=gen), "b": torch.randn(10, generator=gen)}
    writer = DeltaWriter(store)
    writer.publish(state)
    flat = torch.zeros(34)
    tensors = {"a": flat[:24].view(6, 4), "b": flat[24:]}
    reader = DeltaReader(store, StateDictTarget(tensors))
    reader.sync()
    for step in range(3):
        state["a"][step, 1] += 1.5
        state["b"][step] -= 0.25
        writer.publish(state)
        reader.sync()
        for name in state:
            assert torch.equal(bits(tensors[name]), bits(state[name]))


@pytest.mark.parametrize(
    "make",
    [
        lambda buf: {"a": buf[0:10], "b": buf[5:15]},  # overlapping slices
        lambda buf: {"a": buf[0:8], "b": buf[0:8].view(torch.int32)},  # same bytes, other dtype
        lambda buf: {"a": buf[0:16].view(4, 4), "b": buf[0:16].view(4, 4).t()},  # transposed
        lambda buf: {"a": buf[0:16], "b": buf[0:16].view(4, 4)},  # same bytes, other shape
    ],
    ids=["slices", "dtype", "transpose", "shape"],
)
def test_partly_aliased_tensors_are_refused_up_front(make):
    tensors = make(torch.zeros(20))
    with pytest.raises(AliasedTensorError, match="share storage"):
        StateDictTarget(tensors)
    # and at the next sync if they were made to overlap after the target was built
    later: dict[str, torch.Tensor] = {"a": torch.zeros(3)}
    target = StateDictTarget(later)
    later.update(tensors)
    with pytest.raises(AliasedTensorError):
        target.begin()


def test_identical_views_form_one_group_of_three():
    """Three names for one tensor: a change through all three is applied once."""
    from dcr_format.delta.delta import XOR, DecodedDelta
    from dcr_format.targets.change import Change

    shared = torch.arange(8, dtype=torch.int16)
    target = StateDictTarget({"x": shared, "y": shared, "z": shared.view(8)})
    txn = target.begin()
    delta = DecodedDelta(XOR, torch.tensor([1, 5]), torch.tensor([3, 6], dtype=torch.int16))
    applied = [txn.apply(Change(n, torch.int16, (8,), delta)) for n in ("x", "y", "z")]
    assert shared.tolist() == [0, 1 ^ 3, 2, 3, 4, 5 ^ 6, 6, 7]
    for done in applied:  # every name reports the same before/after bits
        assert done.before.tolist() == [1, 5] and done.after.tolist() == [1 ^ 3, 5 ^ 6]
    for done in reversed(applied):
        done.undo()
    assert shared.tolist() == list(range(8))
    txn.commit(Resident("c" * 32, 1, "a" * 64))
    assert target.resident() == Resident("c" * 32, 1, "a" * 64)


def test_state_dict_target_keeps_the_record_hash():
    target = StateDictTarget({}, version=3, chain_id="c" * 32, record_sha256="b" * 64)
    assert target.resident() == Resident("c" * 32, 3, "b" * 64)
    assert StateDictTarget({}, version=3, chain_id="c" * 32).resident().record_sha256 is None
    with pytest.raises(ValueError):
        StateDictTarget({}, version=3, chain_id="c" * 32, record_sha256="nothex")
    with pytest.raises(ValueError):
        StateDictTarget({}, record_sha256="b" * 64)
