"""What a module reader downloads per step, with and without the codings against the old bits.

A reader behind an engine's loader (:class:`ModuleTarget`) reads the exact old bits of the
names its loader places whole into one contiguous run of a parameter, and lists them in its
reader record (FORMAT.md §3.6 ``baseline_names``); the writer's default then codes those
names with the codings against the old bits (``classed`` positions, ``ulp`` and
``ulp-shift`` values). This benchmark trains a small transformers Llama with AdamW at about
1% changed bf16 elements per step (``codec_bench.LlamaTrainer``), publishes each step with
the writer's default features, and syncs a Llama-like engine module (fused ``qkv_proj``
and ``gate_up_proj`` loaded like vLLM; ``--tp 2``: rank 0 of two, whose shards read no
canonical bits) twice: once with the record listing the names (what a reader writes), once
with a record that lists none (a reader that reads no old bits). It prints, per mode, the
median bytes the reader fetched per step (``SyncResult.payload_bytes``: manifests and
shards) as a share of the dense bf16 model, and their ratio; every step is checked bit for
bit against a dense load.

Usage (from a clone)::

    .venv/bin/python benchmarks/module_bytes_bench.py [--size llama-small] [--steps 5]
        [--rate 0.01] [--tp 1] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from typing import Any

import torch
from codec_bench import LLAMA_SIZES, LLAMA_TARGETS, LlamaTrainer
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget

WARMUP = 3


class Engine(nn.Module):
    """Rank ``rank`` of ``tp`` of a Llama-like engine model that loads like vLLM: ``q``,
    ``k``, ``v`` fused by rows into ``qkv_proj`` and ``gate``, ``up`` into ``gate_up_proj``
    (each rank its block of each), ``o_proj`` and ``down_proj`` split by columns, the rest
    (embeddings, norms, ``lm_head``) whole on every rank."""

    def __init__(self, specs: dict[str, tuple[int, ...]], rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp
        self.params = nn.ParameterDict()
        self.where: dict[str, tuple[str, int, int, int]] = {}  # name: (param, dim, at, size)
        fused: dict[str, list[tuple[str, int]]] = {}
        for name, shape in specs.items():
            key, dim = _fused_key(name)
            if key is None:
                self._param(name.replace(".", "_"), shape)
                self.where[name] = (name.replace(".", "_"), -1, 0, 0)
                continue
            fused.setdefault(key, []).append((name, shape[dim] // tp))
            if dim == 1:  # split by columns: a parameter of its own
                self._param(key, (shape[0], shape[1] // tp))
                self.where[name] = (key, 1, 0, shape[1] // tp)
        for key, parts in fused.items():
            if key in self.params:
                continue
            at = 0
            for name, rows in parts:
                self.where[name] = (key, 0, at, rows)
                at += rows
            self._param(key, (at, specs[parts[0][0]][1]))

    def _param(self, key: str, shape: tuple[int, ...]) -> None:
        self.params[key] = nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), False)

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, w in weights:
            key, dim, at, size = self.where[name]
            param = self.params[key].data
            if dim < 0:
                param.copy_(w)
            elif dim == 0:
                param[at : at + size].copy_(w.narrow(0, self.rank * size, size))
            else:
                param.copy_(w.narrow(1, self.rank * size, size))
            loaded.add(name)
        return loaded


def _fused_key(name: str) -> tuple[str | None, int]:
    """The fused parameter a name goes into and the dimension it is split on."""
    layer = name.rsplit(".", 2)[0]
    for part, into, dim in (
        ("self_attn.q_proj", "qkv_proj", 0),
        ("self_attn.k_proj", "qkv_proj", 0),
        ("self_attn.v_proj", "qkv_proj", 0),
        ("self_attn.o_proj", "o_proj", 1),
        ("mlp.gate_proj", "gate_up_proj", 0),
        ("mlp.up_proj", "gate_up_proj", 0),
        ("mlp.down_proj", "down_proj", 1),
    ):
        if name.endswith(part + ".weight"):
            return (layer.rsplit(".", 1)[0] + "." + into).replace(".", "_"), dim
    return None, 0


def _bits(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().reshape(-1).view(torch.int16).clone() for n, p in module.named_parameters()
    }


def run(states: list[dict[str, torch.Tensor]], *, listed: bool, tp: int) -> dict[str, Any]:
    """Publish ``states`` and sync a rank-0 engine module to each; the bytes it fetched."""
    specs = {n: tuple(t.shape) for n, t in states[0].items()}
    with tempfile.TemporaryDirectory() as root:
        writer = DeltaWriter(root)
        writer.publish(states[0])
        module = Engine(specs, 0, tp)
        target = ModuleTarget(module, load_weights=module.load_weights)
        if not listed:
            target.baseline_names = frozenset  # type: ignore[method-assign]
        reader = DeltaReader(root, target)
        reader.sync()
        readable = len(target.baseline_names())
        fetched = []
        for state in states[1:]:
            writer.publish(state)
            fetched.append(reader.sync().payload_bytes)
            dense = Engine(specs, 0, tp)
            dense.load_weights(state.items())
            want, got = _bits(dense), _bits(module)
            if any(not torch.equal(got[n], want[n]) for n in want):
                raise AssertionError("the module differs from a dense load")
    return {"fetched": fetched, "median": statistics.median(fetched), "readable": readable}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="llama-small", choices=tuple(LLAMA_SIZES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rate", type=float, default=0.01, help="target change rate")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (rank 0 syncs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lr = min(LLAMA_TARGETS, key=lambda t: abs(t[0] - args.rate))[1]
    trainer = LlamaTrainer(size=args.size, lr=lr, seed=args.seed)
    for _ in range(WARMUP):
        trainer.step()
    states = [trainer.export_bf16()]
    for _ in range(args.steps):
        trainer.step()
        states.append(trainer.export_bf16())
    changed = [
        sum(int((a[n].view(torch.int16) != b[n].view(torch.int16)).sum()) for n in a)
        for a, b in itertools.pairwise(states)
    ]
    numel = sum(t.numel() for t in states[0].values())
    dense = 2 * numel
    results = {
        mode: run(states, listed=mode == "listed", tp=args.tp) for mode in ("listed", "plain")
    }
    out = {
        "size": args.size,
        "tp": args.tp,
        "params": numel,
        "tensors": len(states[0]),
        "change_rate": statistics.median(changed) / numel,
        "dense_bytes": dense,
        **{mode: {**r, "share_of_dense": r["median"] / dense} for mode, r in results.items()},
        "ratio": results["listed"]["median"] / results["plain"]["median"],
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"{args.size}, {numel / 1e6:.1f}M parameters, {len(states[0])} tensors, tp {args.tp}; "
        f"median change {100 * out['change_rate']:.2f}% over {args.steps} steps"
    )
    for mode, why in (
        ("listed", "record lists the names placed whole"),
        ("plain", "record lists none (every tensor plain)"),
    ):
        r = results[mode]
        print(
            f"  {mode:<6} ({why}; {r['readable']} names readable): median "
            f"{r['median']:,} bytes per step, {100 * r['median'] / dense:.3f}% of dense"
        )
    print(f"  listed / plain: {out['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
