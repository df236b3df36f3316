"""The pause of a module apply, whole tensors against tensor-parallel shards, timed.

A Llama-like decoder (fused ``qkv`` and ``gate_up`` split by rows across ranks,
``o_proj`` and ``down_proj`` split by columns, a vocab-parallel embedding) with a
vLLM-style ``load_weights`` receives versions of about 3% changed bf16 elements through
:class:`ModuleTarget`, once as one rank holding every tensor whole (``--tp 1``: each name
a contiguous run of a parameter) and once as the ranks of a tensor-parallel group (each
name a block of rows or columns), the ranks in threads summing their fingerprint lanes.
It prints the median pause (``SyncResult.apply_seconds``, the slowest rank), the time
per million changed elements each rank holds, and the ratio of the two.

Usage::

    .venv/bin/python benchmarks/module_tp_bench.py [--hidden 512] [--layers 4] [--tp 2]
        [--steps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
from typing import Any

import torch
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget
from dcr_format.format.dtypes import bits_view
from dcr_format.testing.processes import in_threads

RATE = 0.03


class Decoder(nn.Module):
    """Rank ``rank`` of ``tp`` of a Llama-like decoder, loading like vLLM."""

    def __init__(self, hidden: int, layers: int, vocab: int, rank: int, tp: int) -> None:
        super().__init__()
        self.h, self.ff, self.vocab, self.rank, self.tp = hidden, 2 * hidden, vocab, rank, tp
        h, ff = hidden, 2 * hidden

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16), requires_grad=False)

        self.embed = param(vocab // tp, h)
        self.qkv = nn.ParameterList([param(3 * h // tp, h) for _ in range(layers)])
        self.o = nn.ParameterList([param(h, h // tp) for _ in range(layers)])
        self.gate_up = nn.ParameterList([param(2 * ff // tp, h) for _ in range(layers)])
        self.down = nn.ParameterList([param(h, ff // tp) for _ in range(layers)])

    def specs(self, layers: int) -> dict[str, tuple[int, ...]]:
        h, ff = self.h, self.ff
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(layers):
            for name, shape in (
                ("self_attn.q_proj", (h, h)),
                ("self_attn.k_proj", (h, h)),
                ("self_attn.v_proj", (h, h)),
                ("self_attn.o_proj", (h, h)),
                ("mlp.gate_proj", (ff, h)),
                ("mlp.up_proj", (ff, h)),
                ("mlp.down_proj", (h, ff)),
            ):
                out[f"model.layers.{i}.{name}.weight"] = shape
        return out

    def load_weights(self, weights: Any) -> set[str]:
        h, ff, r, tp = self.h, self.ff, self.rank, self.tp
        loaded = set()
        for name, w in weights:
            if name == "model.embed_tokens.weight":
                rows = self.vocab // tp
                self.embed.data.copy_(w.narrow(0, r * rows, rows))
                loaded.add(name)
                continue
            layer, kind = int(name.split(".")[2]), name.split(".")[4]
            if kind in ("q_proj", "k_proj", "v_proj"):
                size = h // tp
                at = {"q_proj": 0, "k_proj": 1, "v_proj": 2}[kind] * size
                self.qkv[layer].data.narrow(0, at, size).copy_(w.narrow(0, r * size, size))
            elif kind == "o_proj":
                cols = h // tp
                self.o[layer].data.copy_(w.narrow(1, r * cols, cols))
            elif kind in ("gate_proj", "up_proj"):
                size = ff // tp
                at = 0 if kind == "gate_proj" else size
                self.gate_up[layer].data[at : at + size].copy_(w[r * size : (r + 1) * size])
            else:
                cols = ff // tp
                self.down[layer].data.copy_(w[:, r * cols : (r + 1) * cols])
            loaded.add(name)
        return loaded


def _perturb(tensor: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    new = tensor.clone()
    flat = bits_view(new).reshape(-1)
    where = torch.randperm(flat.numel(), generator=gen)[: max(1, int(flat.numel() * RATE))]
    flat[where] ^= 1
    return new


class _LaneSum:
    """A reduce_lanes for ranks that are threads of one process."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=600)
        self.parts: list[dict[str, tuple[int, ...]]] = [{} for _ in range(ranks)]

    def rank(self, r: int) -> Any:
        def reduce(lanes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
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


def bench(hidden: int, layers: int, tp: int, steps: int) -> dict[str, float]:
    """Median pause of ``steps`` versions into the ``tp`` ranks of the decoder."""
    vocab = 8 * hidden
    gen = torch.Generator().manual_seed(tp)
    modules = [Decoder(hidden, layers, vocab, r, tp) for r in range(tp)]
    specs = modules[0].specs(layers)
    state = {n: torch.randn(s, generator=gen).bfloat16() for n, s in specs.items()}
    lanes = _LaneSum(tp)
    pauses: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        writer = DeltaWriter(root)
        writer.publish(state)
        readers = []
        for r, module in enumerate(modules):
            target = ModuleTarget(
                module, load_weights=module.load_weights, reduce_lanes=lanes.rank(r)
            )
            readers.append(DeltaReader(root, target, reader_id=f"rank-{r}"))
        in_threads(lambda r: readers[r].sync(), tp)
        for reader in readers:
            reader.target.warm()  # type: ignore[attr-defined]
        for _ in range(steps):
            state = {n: _perturb(t, gen) for n, t in state.items()}
            writer.publish(state)
            prepared = [reader.prepare() for reader in readers]
            results = in_threads(lambda r, p=prepared: readers[r].apply(p[r]), tp)
            assert not any(result.unverified for result in results)
            pauses.append(max(result.apply_seconds for result in results))
    changed = sum(max(1, int(t.numel() * RATE)) for t in state.values()) / tp
    pause = statistics.median(pauses)
    return {"pause_s": pause, "changed_per_rank": changed, "s_per_m_changed": pause / changed * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    whole = bench(args.hidden, args.layers, 1, args.steps)
    sharded = bench(args.hidden, args.layers, args.tp, args.steps)
    out = {
        "tp1": whole,
        f"tp{args.tp}": sharded,
        "ratio_per_changed": sharded["s_per_m_changed"] / whole["s_per_m_changed"],
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key in ("tp1", f"tp{args.tp}"):
            r = out[key]
            assert isinstance(r, dict)
            print(
                f"{key}: pause {r['pause_s'] * 1e3:.1f} ms median, "
                f"{r['changed_per_rank']:.0f} changed per rank, "
                f"{r['s_per_m_changed']:.3f} s per million changed"
            )
        print(f"sharded/whole per changed element: {out['ratio_per_changed']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
