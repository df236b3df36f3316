"""A small real torch transformer and an RL-like trainer that produces realistic deltas.

Used by ``dcr demo`` and by the benchmarks. The model is a decoder-only,
Llama-like transformer (RMSNorm, rotary attention, SwiGLU MLP, untied head) in
pure torch, named so its ``state_dict`` keys look like a Hugging Face
checkpoint's::

    model.embed_tokens.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.norm.weight
    lm_head.weight

Master weights are fp32; :meth:`Trainer.export_bf16` gives the bf16 copy a
trainer would publish. One AdamW step at RL learning rates (around 1e-6) moves
each fp32 master by about ``lr``, far below the bf16 spacing of a typical
weight (about 1e-4 at magnitude 0.02), so only a small fraction of bf16
elements change their bits per step. That fraction grows a little slower
than linearly with ``lr`` (about ``lr**0.85``), and it falls over the first
steps as Adam's second moment averages out the gradient noise (the first
step moves every master by a full ``lr``).
Measured fraction of bf16 elements whose bits change, ``small`` model, seed 0:

=======  ======  =====================  ==================================
lr       step 1  steps 2 .. 12          later
=======  ======  =====================  ==================================
3e-7     1.25%   0.85% falling to 0.40%
1e-6     3.5%    2.4% falling to 1.1%   ~1.0% by step 30 (``tiny`` model)
3e-6     8.4%    5.8% falling to 2.9%
1e-5     20.5%   14.7% falling to 7.5%
=======  ======  =====================  ==================================

The ``tiny`` and ``medium`` models change at nearly the same rates (all
sizes share the N(0, 0.02^2) initialisation, and the rate is set by ``lr``
against the bf16 spacing of the weights).

Everything is deterministic given ``seed``: initialisation and batches come
from private :class:`torch.Generator` objects (the global RNG is not touched),
and there is no dropout. Results are reproducible for a fixed torch build and
thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SIZES", "ModelConfig", "Trainer", "build_model", "param_count"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a toy model and of the batches a :class:`Trainer` feeds it."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    batch: int
    seq: int


#: Named sizes. Parameter counts (all fp32 masters, bf16 exports have the same count):
#:
#: - ``tiny``: 902,016 parameters (for tests; a step takes ~15 ms on 2 CPU cores)
#: - ``small``: 16,913,280 parameters (``dcr demo``: ~0.25 s per step on 2 CPU cores)
#: - ``medium``: 81,801,984 parameters (benchmarks: ~3 s per step on 2 CPU cores)
SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab=1024, d_model=128, n_layers=3, n_heads=4, d_ff=384, batch=4, seq=32),
    "small": ModelConfig(
        vocab=8192, d_model=384, n_layers=6, n_heads=6, d_ff=1024, batch=4, seq=64
    ),
    "medium": ModelConfig(
        vocab=16384, d_model=768, n_layers=8, n_heads=12, d_ff=2048, batch=4, seq=128
    ),
}

_INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (initialised to one)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension and scale."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(f"d_model {d_model} must split into {n_heads} heads of even size")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally over the sequence dimension of ``x`` (batch, seq, d_model)."""
        b, t, d = x.shape
        q, k, v = (
            proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos, sin = _rotary(t, self.head_dim)
        cos, sin = cos.to(x.device, x.dtype), sin.to(x.device, x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, d))
        return projected


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual connections."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.self_attn = Attention(d_model, n_heads)
        self.mlp = MLP(d_model, d_ff)
        self.input_layernorm = RMSNorm(d_model)
        self.post_attention_layernorm = RMSNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One transformer block."""
        x = x + self.self_attn(self.input_layernorm(x))
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of the names)."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(DecoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states (batch, seq, d_model) for token ids (batch, seq)."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        hidden: torch.Tensor = self.norm(x)
        return hidden


class CausalLM(nn.Module):
    """Decoder-only language model: ``model`` backbone plus an untied ``lm_head``."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.model = Backbone(vocab, d_model, n_layers, n_heads, d_ff)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq)."""
        logits: torch.Tensor = self.lm_head(self.model(tokens))
        return logits


def build_model(
    *,
    vocab: int = 1024,
    d_model: int = 128,
    n_layers: int = 3,
    n_heads: int = 4,
    d_ff: int = 384,
    seed: int = 0,
) -> CausalLM:
    """A fp32 Llama-like decoder initialised deterministically from ``seed``.

    Linear and embedding weights are drawn from N(0, 0.02^2), norm scales are
    one. The defaults are the ``tiny`` size (902,016 parameters); a model has
    ``2 * vocab * d_model + n_layers * (4 * d_model^2 + 3 * d_model * d_ff +
    2 * d_model) + d_model`` parameters. The global RNG is not used.
    """
    model = CausalLM(vocab, d_model, n_layers, n_heads, d_ff)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
            else:
                param.normal_(0.0, _INIT_STD, generator=generator)
    return model


def param_count(model: nn.Module) -> int:
    """Total number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


class Trainer:
    """An RL-like training loop over a toy model: one AdamW step per :meth:`step`.

    Batches are sequences from a fixed random "teacher" process (each token
    follows its predecessor's preferred successor with probability 0.75, else a
    uniform token) so the next-token loss has a signal to learn and gradients
    keep a consistent direction across steps, as in a policy update. Each step
    draws a fresh batch, like a fresh set of rollouts.

    Sizes (see :data:`SIZES`): ``tiny`` 902,016 parameters, ``small``
    16,913,280, ``medium`` 81,801,984. The optimizer is
    ``torch.optim.AdamW(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)``.
    """

    def __init__(
        self,
        *,
        size: str = "small",
        lr: float = 1e-6,
        seed: int = 0,
        batch: int | None = None,
        seq: int | None = None,
    ) -> None:
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; use one of {', '.join(SIZES)}")
        cfg = SIZES[size]
        self.size = size
        self.config = cfg
        self.lr = lr
        self.seed = seed
        self.batch = cfg.batch if batch is None else batch
        self.seq = cfg.seq if seq is None else seq
        if self.batch < 1 or self.seq < 2:
            raise ValueError("batch must be >= 1 and seq >= 2")
        self.model = build_model(
            vocab=cfg.vocab,
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            d_ff=cfg.d_ff,
            seed=seed,
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=lr,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
            foreach=False,
        )
        teacher = torch.Generator().manual_seed(seed + 0x7EAC)
        self._successor = torch.randperm(cfg.vocab, generator=teacher)
        self._data = torch.Generator().manual_seed(seed + 0xDA7A)
        self.steps = 0
        self.last_loss: float | None = None

    @property
    def num_params(self) -> int:
        """Total number of parameters."""
        return param_count(self.model)

    def _batch(self) -> torch.Tensor:
        vocab = self.config.vocab
        gen = self._data
        follow = torch.rand(self.batch, self.seq, generator=gen) < 0.75
        noise = torch.randint(0, vocab, (self.batch, self.seq), generator=gen)
        tokens = torch.empty(self.batch, self.seq, dtype=torch.long)
        tokens[:, 0] = noise[:, 0]
        for i in range(1, self.seq):
            tokens[:, i] = torch.where(follow[:, i], self._successor[tokens[:, i - 1]], noise[:, i])
        return tokens

    def step(self) -> None:
        """One AdamW step on the next-token loss of a fresh deterministic batch."""
        tokens = self._batch()
        self.model.train()
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        self.last_loss = float(loss.detach())
        if not math.isfinite(self.last_loss):
            raise FloatingPointError(f"loss became {self.last_loss} at step {self.steps}")

    def export_bf16(self) -> dict[str, torch.Tensor]:
        """Canonical name -> contiguous bf16 CPU copy of each fp32 master, in state_dict order."""
        with torch.no_grad():
            return {
                name: tensor.detach().to("cpu", torch.bfloat16, copy=True).contiguous()
                for name, tensor in self.model.state_dict().items()
            }
