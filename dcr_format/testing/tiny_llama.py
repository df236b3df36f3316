"""A tiny Llama for the engine tests and benchmarks: its config, a word-level tokenizer, a
trainer that publishes AdamW steps, and a checkpoint of any version, all made locally (no hub).

The vLLM and SGLang tiers share it; each engine's own environment stays in its harness.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing softly in "
    "green trees near an old river bank and every morning bright sun rises slowly"
).split()
VOCAB_SIZE = 128


def _transformers() -> Any:
    """transformers, untyped here: its stubs differ between the environments that run this."""
    import transformers

    return transformers


def tiny_config(*, tied: bool) -> Any:
    """A Llama small enough for a shared CPU, with real q/k/v fusion (4 heads, 2 kv heads)."""
    return _transformers().LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def save_tokenizer(out: Path) -> None:
    """A word-level tokenizer over WORDS, built and saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    for i in range(len(vocab), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = _transformers().PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)


class Trainer:
    """fp32 masters of a tiny Llama stepped by AdamW; publishes bf16 exports with DeltaWriter."""

    def __init__(self, store: str, *, tied: bool, seed: int = 0) -> None:
        from dcr_format import DeltaWriter

        torch.manual_seed(seed)
        self.model = _transformers().LlamaForCausalLM(tiny_config(tied=tied)).float()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(seed)
        self.writer = DeltaWriter(store)
        self.tied = tied

    def export(self) -> dict[str, torch.Tensor]:
        """Canonical bf16 tensors (the tied lm_head is not a tensor of its own)."""
        from dcr_format.integrations.vllm import canonical_state

        return canonical_state(self.model)

    def step(self) -> None:
        """One AdamW step on a random batch."""
        batch = torch.randint(4, VOCAB_SIZE, (2, 16), generator=self.gen)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def publish(self, step: int) -> int:
        """Publish the bf16 export as the next version; returns its number."""
        info = self.writer.publish(self.export(), step=step)
        return info.version


def checkpoint(store: str, version: int, out: Path, *, tied: bool) -> Path:
    """`dcr replay` of ``version`` into ``out`` plus the config and tokenizer an engine needs."""
    from dcr_format import replay

    replay(store, version, out)
    tiny_config(tied=tied).save_pretrained(out)
    save_tokenizer(out)
    return out
