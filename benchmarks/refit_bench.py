"""End-to-end refit, dense checkpoint copy against dcr publish + sync, through one store.

Weights are model-shaped bf16 tensors; each step adds an Adam-like update of
size ``lr`` to fp32 masters and exports bf16, with ``lr`` searched so the share
of bf16 elements whose bits change lands on the target rate. Per step:

- dense: serialise the whole checkpoint as safetensors, ``put`` it, ``get`` it
  back, deserialise it and copy it into a resident replica;
- dcr: ``DeltaWriter.publish`` of the step (diff, encode, upload, commit) plus
  ``DeltaReader.sync`` on a reader at the previous version (fetch, verify, apply).

Both go through the same :class:`~dcr_format.Store` (a local directory or an
S3 server), so the two differ only in what they move and compute.

    .venv/bin/python benchmarks/refit_bench.py [--mb 300] [--json] [--quick]
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dcr_format.store.store import Store

RATES = (0.005, 0.01, 0.03, 0.05)
DENSE_KEY = "dense/model.safetensors"


def model_shapes(total_mb: float, experts: int = 0) -> dict[str, tuple[int, ...]]:
    """Llama-like canonical tensors adding up to about ``total_mb`` of bf16 (small sizes get
    narrower layers, so even a few MB is a model of several layers).

    ``experts`` > 0: a mixture-of-experts layout of about the same bytes, each layer's MLP
    split into that many experts (gate, up and down projections of ``ff // experts`` rows
    or columns each) behind a router: many more, smaller tensors (tens of thousands in a
    real MoE checkpoint), which is where a tensor's fixed cost shows."""
    if experts < 0:
        raise ValueError(f"experts must be 0 or more, not {experts}")
    d, ff, vocab = 1024, 2816, 16384
    while d > 64 and 2 * (2 * vocab * d + 4 * d * d + 3 * d * ff) > total_mb * 1e6:
        d, ff, vocab = d // 2, ff // 2, vocab // 2
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d)}
    per_layer = 4 * d * d + 3 * d * ff + 2 * d
    layers = max(1, int((total_mb * 1e6 / 2 - 2 * vocab * d) // per_layer))
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (d, d)
        if experts:
            width = max(1, ff // experts)
            shapes[f"{p}.mlp.gate.weight"] = (experts, d)  # the router
            for e in range(experts):
                shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (width, d)
                shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (width, d)
                shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (d, width)
        else:
            shapes[f"{p}.mlp.gate_proj.weight"] = (ff, d)
            shapes[f"{p}.mlp.up_proj.weight"] = (ff, d)
            shapes[f"{p}.mlp.down_proj.weight"] = (d, ff)
        shapes[f"{p}.input_layernorm.weight"] = (d,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (vocab, d)
    return shapes


class SyntheticTrainer:
    """fp32 masters with Adam-like steps (every element moves by about ``lr``), on
    ``device`` (made on the CPU, the same weights on every device; a device's steps draw
    from its own generator)."""

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], seed: int = 0, device: str = "cpu"
    ) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.masters = {
            n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=self.gen) * 0.02).to(
                device
            )
            for n, s in shapes.items()
        }
        on_cpu = torch.device(device).type == "cpu"
        self._steps = self.gen if on_cpu else torch.Generator(device).manual_seed(seed + 1)

    def step(self, lr: float) -> None:
        for tensor in self.masters.values():
            direction = torch.randn(
                tensor.shape, generator=self._steps, device=tensor.device
            ).sign_()
            tensor.add_(direction, alpha=lr)

    def export(self) -> dict[str, torch.Tensor]:
        return {n: t.to(torch.bfloat16) for n, t in self.masters.items()}


def change_rate(lr: float) -> float:
    """Share of bf16 elements whose bits change for one step of size ``lr`` (sampled)."""
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(1 << 20, generator=gen) * 0.02
    before = master.to(torch.bfloat16)
    after = (master + torch.randn(master.shape, generator=gen).sign() * lr).to(torch.bfloat16)
    return float((before.view(torch.int16) != after.view(torch.int16)).float().mean())


@functools.cache
def lr_for(rate: float) -> float:
    """Bisect (in log space) the step size that changes ``rate`` of the elements."""
    low, high = 1e-9, 1e-2
    for _ in range(24):  # (1e7) ** (2 ** -24): a step size within a millionth
        mid = (low * high) ** 0.5
        if change_rate(mid) < rate:
            low = mid
        else:
            high = mid
    return math.sqrt(low * high)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in b
    )


def dense_refit(
    store: Store, tensors: dict[str, torch.Tensor], replica: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Copy the whole checkpoint through ``store`` into ``replica``; times of each part."""
    from safetensors.torch import load, save

    started = time.perf_counter()
    blob = save(tensors)
    serialised = time.perf_counter()
    store.put(DENSE_KEY, blob)
    uploaded = time.perf_counter()
    fetched = store.get(DENSE_KEY)
    downloaded = time.perf_counter()
    for name, tensor in load(fetched).items():
        replica[name].copy_(tensor)
    loaded = time.perf_counter()
    store.delete(DENSE_KEY)
    return {
        "dense_s": loaded - started,
        "dense_serialise_s": serialised - started,
        "dense_upload_s": uploaded - serialised,
        "dense_download_s": downloaded - uploaded,
        "dense_load_s": loaded - downloaded,
        "dense_bytes_moved": float(len(blob) + len(fetched)),
    }


def refit_series(
    store: Store,
    shapes: dict[str, tuple[int, ...]],
    rates: Sequence[float] = RATES,
    *,
    label: str,
    bound: bool = False,
    seed: int = 0,
    progress: Callable[[str], None] = lambda message: None,
) -> list[dict[str, Any]]:
    """Publish a base, then one step per rate; each step refits dense and with dcr.

    ``bound``: also compute the entropy bound of each step's delta (needs the previous
    export in memory). The reader and the dense replica start from the base.
    """
    from codec_bounds import entropy_bound

    from dcr_format.publish.writer import DeltaWriter
    from dcr_format.sync.reader import DeltaReader
    from dcr_format.targets.dict import StateDictTarget

    trainer = SyntheticTrainer(shapes, seed=seed)
    writer = DeltaWriter(store)
    replica: dict[str, torch.Tensor] = {}
    reader = DeltaReader(store, StateDictTarget(replica))
    weights = trainer.export()
    writer.publish(weights, step=0)
    reader.sync()
    dense_replica = {n: t.clone() for n, t in weights.items()}
    rows = []
    for step, rate in enumerate(rates, start=1):
        previous = weights
        trainer.step(lr_for(rate))
        weights = trainer.export()
        progress(f"refit {label}: {rate:.1%} change")
        row: dict[str, Any] = {"store": label, "target_rate": rate}
        row.update(dense_refit(store, weights, dense_replica))
        started = time.perf_counter()
        info = writer.publish(weights, step=step)
        published = time.perf_counter()
        result = reader.sync()
        synced = time.perf_counter()
        row.update(
            {
                "dense_mb": info.dense_bytes / 1e6,
                "dense_bytes": info.dense_bytes,
                "changed": info.changed_elements,
                "change_rate": info.change_rate,
                "publish_s": published - started,
                "sync_s": synced - published,
                "dcr_s": synced - started,
                "delta_bytes": info.payload_bytes,
                "dcr_bytes_moved": info.payload_bytes + result.payload_bytes,
                "speedup": row["dense_s"] / (synced - started),
                "bit_exact": _same_bits(replica, weights) and _same_bits(dense_replica, weights),
            }
        )
        if bound:
            found = entropy_bound(previous, weights)
            row["bound_bytes"] = found.bytes
            row["delta_vs_bound"] = info.payload_bytes / found.bytes if found.bytes else None
        rows.append(row)
        del previous
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``benchmarks/refit_bench.py``: dense vs dcr over the JuiceFS S3 gateway, one size."""
    import argparse
    import json
    import tempfile
    from pathlib import Path

    from bench_gateway import juicefs_store

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--mb", type=float, default=300.0, help="model size in MB of bf16")
    parser.add_argument("--quick", action="store_true", help="small model, two rates (CI smoke)")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    rates = RATES[:2] if args.quick else RATES
    with (
        tempfile.TemporaryDirectory(prefix="dcr-refit-") as work,
        juicefs_store(Path(work)) as (store, _),
    ):
        rows = refit_series(store, model_shapes(20.0 if args.quick else args.mb), rates, label="s3")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"refit over the JuiceFS S3 gateway on 127.0.0.1, model {rows[0]['dense_mb']:.0f} MB")
    header = ("rate", "dense s", "publish s", "sync s", "dcr s", "dcr MB", "dense/dcr", "exact")
    print("  ".join(f"{h:>10}" for h in header))
    for r in rows:
        cells = (
            f"{r['change_rate']:.2%}",
            f"{r['dense_s']:.2f}",
            f"{r['publish_s']:.2f}",
            f"{r['sync_s']:.2f}",
            f"{r['dcr_s']:.2f}",
            f"{r['dcr_bytes_moved'] / 1e6:.2f}",
            f"{r['speedup']:.1f}x",
            "yes" if r["bit_exact"] else "NO",
        )
        print("  ".join(f"{c:>10}" for c in cells))
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
