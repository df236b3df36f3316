"""Canonical coordinates both ways: writer projection and native-loader apply, timed.

Writer side: a tensor-parallel rank holds a fused ``qkv`` shard and a row-parallel
``o_proj`` shard (bf16, about 1% of the elements change per step). It compares

- *projection*: diff the local tensors against their baselines and project the
  changed local positions to canonical flat indices (what :class:`ProjectionWriter`
  does), against
- *materialised*: build the canonical tensors the rank holds from its local tensors
  (before and after the step) and diff those, as a writer without a layout would.

Reader side: a vLLM-like module (fused qkv and gate_up, row-parallel projections)
with a ``load_weights`` loader receives one version of about 1% changed elements
through :class:`ModuleTarget` (xor through the intercepted loader, verification
included), against a dense ``load_weights`` of the same full tensors.

Usage::

    .venv/bin/python benchmarks/layout_bench.py [--hidden 2048] [--tp 4] [--quick] [--json]

``--quick`` (the smoke test) uses small sizes and one repetition.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget, StateDictTarget
from dcr_format.chain.layout import Layout, fused, shard
from dcr_format.delta.delta import changed_positions
from dcr_format.format.dtypes import bits_view

RATE = 0.01


def _timed(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _perturb(tensor: torch.Tensor, rate: float, gen: torch.Generator) -> torch.Tensor:
    new = tensor.clone()
    flat = bits_view(new).reshape(-1)
    count = max(1, int(flat.numel() * rate))
    where = torch.randperm(flat.numel(), generator=gen)[:count]
    flat[where] ^= 1  # the lowest mantissa bit: what an RL-sized step does to bf16
    return new


def bench_projection(hidden: int, tp: int, repeat: int) -> dict:
    """Projection of local diffs against diffing materialised canonical tensors."""
    heads = hidden
    kv = hidden // 4
    gen = torch.Generator().manual_seed(0)
    rank = tp - 1
    layout = Layout(
        [
            *fused(
                "qkv",
                [("q", (heads, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden))],
                dim=0,
                rank=rank,
                size=tp,
            ),
            *shard("o", (hidden, heads), dim=1, rank=rank, size=tp),
        ]
    )
    old = {
        name: torch.randn(shape, generator=gen).bfloat16()
        for name, shape in layout.local_shapes.items()
    }
    new = {name: _perturb(t, RATE, gen) for name, t in old.items()}
    regions = layout.regions()

    def project() -> int:
        changed = {name: changed_positions(old[name], new[name]) for name in old}
        total = 0
        for pieces in regions.values():
            found = [piece.project(changed[piece.local])[1] for piece in pieces]
            total += int(torch.sort(torch.cat(found)).values.numel())
        return total

    def materialised() -> int:
        before = layout.gather(old)
        after = layout.gather(new)
        total = 0
        for name in before:
            total += int(changed_positions(before[name], after[name]).numel())
        return total

    assert project() == materialised()
    local_elements = sum(t.numel() for t in old.values())
    t_project = _timed(project, repeat)
    t_material = _timed(materialised, repeat)
    return {
        "local_elements": local_elements,
        "changed": project(),
        "projection_seconds": t_project,
        "materialised_seconds": t_material,
        "projection_elements_per_s": local_elements / t_project,
        "materialised_elements_per_s": local_elements / t_material,
        "speedup": t_material / t_project,
    }


class _Runtime(nn.Module):
    """A vLLM-like decoder block layout with a placing loader (tensor-parallel rank 0 of 1)."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.hidden, self.layers = hidden, layers
        ff = 2 * hidden
        self.qkv = nn.ParameterList(
            [
                nn.Parameter(torch.zeros(3 * hidden, hidden, dtype=torch.bfloat16))
                for _ in range(layers)
            ]
        )
        self.o = nn.ParameterList(
            [nn.Parameter(torch.zeros(hidden, hidden, dtype=torch.bfloat16)) for _ in range(layers)]
        )
        self.gate_up = nn.ParameterList(
            [nn.Parameter(torch.zeros(2 * ff, hidden, dtype=torch.bfloat16)) for _ in range(layers)]
        )
        self.down = nn.ParameterList(
            [nn.Parameter(torch.zeros(hidden, ff, dtype=torch.bfloat16)) for _ in range(layers)]
        )
        for p in self.parameters():
            p.requires_grad_(False)

    def specs(self) -> dict[str, tuple[int, ...]]:
        h, ff = self.hidden, 2 * self.hidden
        out = {}
        for i in range(self.layers):
            for name, shape in (
                ("q_proj", (h, h)),
                ("k_proj", (h, h)),
                ("v_proj", (h, h)),
                ("o_proj", (h, h)),
                ("gate_proj", (ff, h)),
                ("up_proj", (ff, h)),
                ("down_proj", (h, ff)),
            ):
                out[f"model.layers.{i}.{name}.weight"] = shape
        return out

    def load_weights(self, weights) -> set[str]:  # type: ignore[no-untyped-def]
        h, ff = self.hidden, 2 * self.hidden
        loaded = set()
        for name, w in weights:
            layer = int(name.split(".")[2])
            kind = name.split(".")[3]
            if kind in ("q_proj", "k_proj", "v_proj"):
                at = {"q_proj": 0, "k_proj": h, "v_proj": 2 * h}[kind]
                self.qkv[layer].data.narrow(0, at, h).copy_(w)
            elif kind == "o_proj":
                self.o[layer].data.copy_(w)
            elif kind in ("gate_proj", "up_proj"):
                at = 0 if kind == "gate_proj" else ff
                self.gate_up[layer].data[at : at + ff].copy_(w)
            else:
                self.down[layer].data.copy_(w)
            loaded.add(name)
        return loaded


def bench_apply(hidden: int, layers: int, repeat: int) -> dict:
    """One ~1% xor version through ModuleTarget against a dense load_weights."""
    gen = torch.Generator().manual_seed(1)
    module = _Runtime(hidden, layers)
    state = {n: torch.randn(s, generator=gen).bfloat16() for n, s in module.specs().items()}
    elements = sum(t.numel() for t in state.values())
    with tempfile.TemporaryDirectory() as root:
        writer = DeltaWriter(root)
        writer.publish(state)
        target = ModuleTarget(module, load_weights=module.load_weights)
        reader = DeltaReader(root, target)
        reader.sync()
        applies = []
        for _ in range(repeat):
            state = {n: _perturb(t, RATE, gen) for n, t in state.items()}
            writer.publish(state)
            applies.append(reader.sync().apply_seconds)
        dense_module = _Runtime(hidden, layers)
        t_dense = _timed(lambda: dense_module.load_weights(state.items()), repeat)
        # the same versions into a dict of canonical tensors (same checks, no loader)
        canonical: dict[str, torch.Tensor] = {}
        dict_reader = DeltaReader(root, StateDictTarget(canonical))
        dict_reader.sync(to=0)
        t_dict = statistics.median(
            dict_reader.sync(to=v).apply_seconds for v in range(1, repeat + 1)
        )
        same = all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(module.parameters(), dense_module.parameters(), strict=True)
        )
    t_apply = statistics.median(applies)
    return {
        "elements": elements,
        "changed_per_version": int(elements * RATE),
        "module_target_apply_seconds": t_apply,
        "dense_load_weights_seconds": t_dense,
        "state_dict_target_apply_seconds": t_dict,
        "ratio_apply_to_dense": t_apply / t_dense,
        "bit_equal": same,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.repeat = 128, 1, 1
    projection = bench_projection(args.hidden, args.tp, args.repeat)
    apply = bench_apply(args.hidden, args.layers, args.repeat)
    result = {
        "hidden": args.hidden,
        "tp": args.tp,
        "layers": args.layers,
        "change_rate": RATE,
        "projection": projection,
        "apply": apply,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    p, a = projection, apply
    print(
        f"writer, rank {args.tp - 1} of tp={args.tp}, {p['local_elements']:,} local elements, "
        f"{p['changed']:,} changed:"
    )
    print(
        f"  projection of local diffs   {p['projection_seconds'] * 1e3:9.2f} ms  "
        f"{p['projection_elements_per_s'] / 1e6:9.1f} M elements/s"
    )
    print(
        f"  diff of materialised tensors{p['materialised_seconds'] * 1e3:9.2f} ms  "
        f"{p['materialised_elements_per_s'] / 1e6:9.1f} M elements/s  "
        f"(projection {p['speedup']:.1f}x faster)"
    )
    print(f"reader, {a['elements']:,} canonical elements, {a['changed_per_version']:,} changed:")
    print(
        f"  ModuleTarget apply (xor)    {a['module_target_apply_seconds'] * 1e3:9.2f} ms  "
        "(through the intercepted loader, fingerprints verified)"
    )
    print(
        f"  StateDictTarget apply (xor) {a['state_dict_target_apply_seconds'] * 1e3:9.2f} ms  "
        "(canonical tensors, the same checks)"
    )
    print(
        f"  dense load_weights          {a['dense_load_weights_seconds'] * 1e3:9.2f} ms  "
        f"(apply / dense = {a['ratio_apply_to_dense']:.2f}; bit-equal: {a['bit_equal']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
