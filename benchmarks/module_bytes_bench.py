"""What a module reader downloads per step, with and without the codings against the old bits.

A reader behind an engine's loader (:class:`ModuleTarget`) reads the exact old bits of the
names its loader places whole into one contiguous run of a parameter, and says so in its
reader record (FORMAT.md §3.6: ``baseline_names``, or ``baseline_except`` where it reads
more tensors than a list of 4096 names holds); the writer's default then codes those names
with the codings against the old bits (``classed`` positions, ``ulp`` and ``ulp-shift``
values). This benchmark trains a small transformers Llama with AdamW at about 1% changed
bf16 elements per step (``codec_bench.LlamaTrainer``), publishes each step with the
writer's default features, and syncs a Llama-like engine module (fused ``qkv_proj`` and
``gate_up_proj`` loaded like vLLM; ``--tp 2``: rank 0 of two, whose shards read no
canonical bits) twice: once with the record the reader writes (``listed``), once with a
record that lists none (``plain``: a reader that reads no old bits). It prints, per mode,
the median bytes the reader fetched per step (``SyncResult.payload_bytes``: manifests and
shards) as a share of the dense bf16 model, and their ratio; every step is checked bit for
bit against a dense load.

``--experts E --mb M``: instead, a mixture-of-experts model of about ``M`` MB of bf16
(``refit_bench.model_shapes``: each layer's MLP as ``E`` experts) stepped by the synthetic
Adam-like trainer at ``--rate``, into an engine that fuses each layer's experts like vLLM
(``w13``: every expert's gate and up rows, ``w2``: its down projection), with a third
mode, ``capped``: a record that lists at most 4096 names (the largest first) and no
exceptions, which is what such an engine could say without ``baseline_except``.

Usage (from a clone)::

    .venv/bin/python benchmarks/module_bytes_bench.py [--size llama-small] [--steps 5]
        [--rate 0.01] [--tp 1] [--json]
    .venv/bin/python benchmarks/module_bytes_bench.py --experts 256 --mb 80 [--steps 3]
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
from refit_bench import SyntheticTrainer, lr_for, model_shapes
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget, open_store

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
        # experts: name -> (param, expert, first row): fused like vLLM's MoE layers
        self.experts: dict[str, tuple[str, int, int]] = {}
        self._fuse_experts(specs)
        fused: dict[str, list[tuple[str, int]]] = {}
        for name, shape in specs.items():
            if name in self.experts:
                continue
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

    def _fuse_experts(self, specs: dict[str, tuple[int, ...]]) -> None:
        """Each layer's ``mlp.experts.<e>.{gate,up,down}_proj`` into ``w13`` ([E, 2w, d]:
        gate rows then up rows) and ``w2`` ([E, d, w]), every expert whole on this rank."""
        layers: dict[str, dict[int, dict[str, tuple[str, tuple[int, ...]]]]] = {}
        for name, shape in specs.items():
            head, sep, tail = name.partition(".mlp.experts.")
            if not sep:
                continue
            expert, proj = tail.split(".")[:2]
            layers.setdefault(head, {}).setdefault(int(expert), {})[proj] = (name, shape)
        if layers and self.tp != 1:
            raise ValueError("the mixture-of-experts engine is one rank (--tp 1)")
        for head, experts in layers.items():
            count = len(experts)
            width, d = experts[0]["gate_proj"][1]
            w13 = (head + ".mlp.w13").replace(".", "_")
            w2 = (head + ".mlp.w2").replace(".", "_")
            self._param(w13, (count, 2 * width, d))
            self._param(w2, (count, d, width))
            for e, projs in experts.items():
                self.experts[projs["gate_proj"][0]] = (w13, e, 0)
                self.experts[projs["up_proj"][0]] = (w13, e, width)
                self.experts[projs["down_proj"][0]] = (w2, e, 0)

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, w in weights:
            if name in self.experts:
                key, e, row = self.experts[name]
                self.params[key].data[e, row : row + w.shape[0]].copy_(w)
                loaded.add(name)
                continue
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


MODES = {
    "listed": "the record the reader writes",
    "capped": "at most 4096 names listed, no exceptions",
    "plain": "record lists none: every tensor plain",
}


def run(states: list[dict[str, torch.Tensor]], *, listed: bool | str, tp: int) -> dict[str, Any]:
    """Publish ``states`` and sync a rank-0 engine module to each; the bytes it fetched.
    ``listed``: a mode of :data:`MODES` (True: ``listed``, False: ``plain``)."""
    mode = listed if isinstance(listed, str) else ("listed" if listed else "plain")
    specs = {n: tuple(t.shape) for n, t in states[0].items()}
    with tempfile.TemporaryDirectory() as root:
        writer = DeltaWriter(root)
        writer.publish(states[0])
        module = Engine(specs, 0, tp)
        target = ModuleTarget(module, load_weights=module.load_weights)
        if mode != "listed":  # the record lists the names alone
            target.baseline_except = lambda names: None  # type: ignore[method-assign]
        if mode == "plain":
            target.baseline_names = frozenset  # type: ignore[method-assign]
        reader = DeltaReader(root, target)
        reader.sync()
        store = open_store(root)  # what the record tells writers: the names they may code
        (key,) = store.list("readers/")  # against the old bits
        record = json.loads(store.get(key))
        unread = record.get("baseline_except")
        readable = len(record.get("baseline_names") or ())
        if unread is not None:
            readable = len(specs) - len(unread)
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
    parser.add_argument("--experts", type=int, default=0, help="a MoE model of this many experts")
    parser.add_argument("--mb", type=float, default=80.0, help="the MoE model's bf16 MB")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.experts:
        synthetic = SyntheticTrainer(model_shapes(args.mb, args.experts), seed=args.seed)
        step_size = lr_for(args.rate)
        states = [synthetic.export()]
        for _ in range(args.steps):
            synthetic.step(step_size)
            states.append(synthetic.export())
        size = f"moe-{args.experts}x ({args.mb:g} MB)"
        modes = ("listed", "capped", "plain")
    else:
        lr = min(LLAMA_TARGETS, key=lambda t: abs(t[0] - args.rate))[1]
        trainer = LlamaTrainer(size=args.size, lr=lr, seed=args.seed)
        for _ in range(WARMUP):
            trainer.step()
        states = [trainer.export_bf16()]
        for _ in range(args.steps):
            trainer.step()
            states.append(trainer.export_bf16())
        size, modes = args.size, ("listed", "plain")
    changed = [
        sum(int((a[n].view(torch.int16) != b[n].view(torch.int16)).sum()) for n in a)
        for a, b in itertools.pairwise(states)
    ]
    numel = sum(t.numel() for t in states[0].values())
    dense = 2 * numel
    results = {mode: run(states, listed=mode, tp=args.tp) for mode in modes}
    out = {
        "size": size,
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
        f"{size}, {numel / 1e6:.1f}M parameters, {len(states[0])} tensors, tp {args.tp}; "
        f"median change {100 * out['change_rate']:.2f}% over {args.steps} steps"
    )
    for mode in modes:
        r, why = results[mode], MODES[mode]
        print(
            f"  {mode:<6} ({why}; {r['readable']} names readable): median "
            f"{r['median']:,} bytes per step, {100 * r['median'] / dense:.3f}% of dense"
        )
    print(f"  listed / plain: {out['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
