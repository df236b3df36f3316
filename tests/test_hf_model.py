"""A real Hugging Face model (tiny Llama from a config, no download) kept at every version
of a chain of AdamW steps through its own ``load_state_dict``, bit-equal to a dense load."""

from __future__ import annotations

import pytest
import torch

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget
from dcr_format.chain.chain import Chain
from dcr_format.store.store import open_store

transformers = pytest.importorskip("transformers")  # in the test extra; skip only if absent


def _config():  # type: ignore[no-untyped-def]
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def _model(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    torch.manual_seed(1)  # the reader's own random init, overwritten by the sync
    return transformers.LlamaForCausalLM(_config()).to(dtype).eval()


def _bits(model) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {n: t.detach().reshape(-1).view(torch.uint8) for n, t in model.state_dict().items()}


@pytest.mark.parametrize("reader_dtype", [torch.bfloat16, torch.float32])
def test_tiny_llama_follows_adamw_steps_through_load_state_dict(tmp_path, reader_dtype):
    torch.manual_seed(0)
    trainer = transformers.LlamaForCausalLM(_config())  # fp32 masters
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(0)

    def export() -> dict[str, torch.Tensor]:
        return {n: t.detach().bfloat16() for n, t in trainer.state_dict().items()}

    store = str(tmp_path / "store")
    writer = DeltaWriter(store)
    writer.publish(export(), step=0)
    model = _model(reader_dtype)
    reader = DeltaReader(store, ModuleTarget(model), reader_id="llama")
    reader.sync()
    changed_rates = []
    for step in range(1, 6):
        batch = torch.randint(0, 96, (2, 16), generator=gen)
        loss = trainer(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state = export()
        info = writer.publish(state, step=step)
        changed_rates.append(info.change_rate)
        result = reader.sync()
        dense = _model(reader_dtype)
        dense.load_state_dict(state)
        want, got = _bits(dense), _bits(model)
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"{name} differs at step {step}"
        if reader_dtype == torch.bfloat16:  # placements read back: only the tied pair is not
            assert set(result.unverified) == {"lm_head.weight", "model.embed_tokens.weight"}
        else:  # every tensor is cast into fp32: none can be read back in canonical bits
            chain = Chain(open_store(store))
            touched = {
                e.name
                for m in chain.manifests(chain.record(step))
                for e in m.entries
                if e.changed > 0
            }
            assert set(result.unverified) == touched and touched
    assert all(0 < rate < 1 for rate in changed_rates)
    chain = Chain(open_store(store))
    ops = {e.name: e.op for m in chain.manifests(chain.record(5)) for e in m.entries}
    if reader_dtype == torch.bfloat16:
        assert {n for n, op in ops.items() if op == "overwrite"} == {
            "lm_head.weight",
            "model.embed_tokens.weight",
        }
    else:
        assert set(ops.values()) == {"overwrite"}
