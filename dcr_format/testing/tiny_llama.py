"""A tiny Llama for the engine tests and benchmarks: its config, a word-level tokenizer, a
trainer that publishes AdamW steps, and a checkpoint of any version, all made locally (no hub);
the bits an engine's fused parameters should hold; a shard corrupted on purpose. A tiny
mixture-of-experts model (Qwen3-MoE) shares the tokenizer, trainer and checkpoints.

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
# greedy generation reads these (words of the tokenizer)
PROMPTS = ["the quick brown fox", "seven small birds sing", "every morning bright sun"]


def _transformers() -> Any:
    """transformers, untyped here: its stubs differ between the environments that run this."""
    import transformers

    return transformers


def llama_config(
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    tied: bool = False,
    max_positions: int = 128,
    **extra: Any,
) -> Any:
    """A bf16 Llama config whose special tokens are :func:`save_tokenizer`'s (pad 0, bos 1,
    eos 2); ``extra`` goes to ``LlamaConfig`` as it is."""
    return _transformers().LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )


def tiny_config(*, tied: bool) -> Any:
    """A Llama small enough for a shared CPU, with real q/k/v fusion (4 heads, 2 kv heads)."""
    return llama_config(
        vocab=VOCAB_SIZE,
        hidden=128,
        intermediate=128,
        layers=2,
        heads=4,
        kv_heads=2,
        tied=tied,
        architectures=["LlamaForCausalLM"],
        head_dim=32,
    )


def tiny_moe_config() -> Any:
    """A Qwen3-MoE as small as :func:`tiny_config`: 4 experts on every layer, 2 routed per
    token; expert sizes multiples of 32, so that vLLM's CPU MoE kernel pads nothing."""
    return _transformers().Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["Qwen3MoeForCausalLM"],
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
    """fp32 masters of a tiny Llama (or of ``config``'s model) stepped by AdamW; publishes bf16
    exports with DeltaWriter."""

    def __init__(self, store: str, *, tied: bool, seed: int = 0, config: Any = None) -> None:
        from dcr_format import DeltaWriter

        torch.manual_seed(seed)
        config = tiny_config(tied=tied) if config is None else config
        model_class = getattr(_transformers(), config.architectures[0])
        self.model = model_class(config).float()
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


def checkpoint(store: str, version: int, out: Path, *, tied: bool, config: Any = None) -> Path:
    """`dcr replay` of ``version`` into ``out`` plus the config (default: the tiny Llama's)
    and tokenizer an engine needs."""
    from dcr_format import replay

    replay(store, version, out)
    (tiny_config(tied=tied) if config is None else config).save_pretrained(out)
    save_tokenizer(out)
    return out


def first_version(tmp: Path, *, tied: bool, config: Any = None) -> tuple[str, Trainer, Path]:
    """A fresh trainer's store under ``tmp`` with version 0 published, and a checkpoint of
    that version for an engine to start on: ``(store, trainer, checkpoint)``; ``config``:
    the model's (default: the tiny Llama's)."""
    store = str(tmp / "store")
    trainer = Trainer(store, tied=tied, config=config)
    trainer.publish(0)
    return store, trainer, checkpoint(store, 0, tmp / "ckpt", tied=tied, config=config)


def fused_bits(model: torch.nn.Module) -> list[list[int]]:
    """The bits of an engine's fused ``qkv_proj`` and ``gate_up_proj`` weights, in layer
    order (``model`` is the engine's Llama)."""
    out = []
    layers: Any = model.model.layers  # type: ignore[union-attr]
    for layer in layers:
        for p in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight):
            out.append(p.detach().contiguous().view(torch.int16).reshape(-1).tolist())
    return out


def want_fused(state: dict[str, torch.Tensor], *, rank: int = 0, ranks: int = 1) -> list[list[int]]:
    """What :func:`fused_bits` gives on tensor-parallel ``rank`` of ``ranks`` when the engine
    holds ``state`` (canonical tensors): each rank fuses its rows of q, k, v (gate, up)."""

    def part(t: torch.Tensor) -> torch.Tensor:
        size = t.shape[0] // ranks
        return t[rank * size : (rank + 1) * size]

    out = []
    layers = tiny_config(tied=False).num_hidden_layers
    for i in range(layers):
        p = f"model.layers.{i}"
        qkv = [part(state[f"{p}.self_attn.{x}_proj.weight"]) for x in "qkv"]
        gate_up = [part(state[f"{p}.mlp.{x}_proj.weight"]) for x in ("gate", "up")]
        for pieces in (qkv, gate_up):
            out.append(torch.cat(pieces).contiguous().view(torch.int16).reshape(-1).tolist())
    return out


def corrupt_shard(store: str, version: int) -> None:
    """Flip one byte in the middle of the first shard of ``version``."""
    shards = sorted((Path(store) / "objects" / f"{version:020d}").rglob("shard-*.dcrs"))
    assert shards
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(data))
