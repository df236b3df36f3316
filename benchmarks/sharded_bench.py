"""Publishing an FSDP2-sharded model from every rank: each rank's own shards (no gather) vs
``canonical_state`` (every tensor gathered on every rank) + publish.

    python benchmarks/sharded_bench.py [--worlds 2 4] [--hidden 512] [--layers 4]
        [--vocab 32000] [--steps 3] [--rates 0.01 0.05]

For each world size and each path it starts that many gloo ranks on 127.0.0.1 holding the
same model (a Llama of the given size, fully sharded), changes ``rate`` of every shard's
elements per step and publishes to a local store. Per rank it reports the median publish
seconds (gather included for the gather path), the peak RSS growth over the model's own,
the baseline bytes against the rank's shard bytes, and the bytes moved by collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _model(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _change(model: torch.nn.Module, rate: float, generator: torch.Generator) -> None:
    """Move ``rate`` of every local shard's elements by more than a bf16 step."""
    with torch.no_grad():
        for param in model.parameters():
            local = getattr(param, "_local_tensor", param)
            mask = torch.rand(local.shape, generator=generator) < rate
            local.add_(mask * local.abs().clamp_min(1e-3) * 0.05)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcr_format import DeltaWriter, TorchDistributedCoordinator
    from dcr_format.integrations.vllm import canonical_state, trainer_state
    from dcr_format.testing.collectives import counted_collectives

    rank, world = args.rank, args.world
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    model = _model(args.hidden, args.layers, args.vocab)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard_bytes = sum(getattr(p, "_local_tensor", p).numel() * 2 for p in model.parameters())
    model_bytes = sum(p.numel() * 2 for p in model.parameters())
    rss_before = _rss_mb()
    writer = DeltaWriter(
        args.store, rank=rank, world_size=world, coordinator=TorchDistributedCoordinator()
    )
    generator = torch.Generator().manual_seed(rank)
    rows: dict[str, Any] = {}
    step = 0
    for rate in [0.0, *args.rates]:
        seconds, moved, rates = [], [], []
        for _ in range(1 if rate == 0.0 else args.steps):
            if rate:
                _change(model, rate, generator)
            dist.barrier()
            started = time.perf_counter()
            with counted_collectives(dispatch=args.path == "gather") as gathering:
                if args.path == "sharded":
                    state = trainer_state(model)
                else:
                    state = canonical_state(model)  # DTensors gathered by functional collectives
            with counted_collectives(dispatch=False) as publishing:
                info = writer.publish(state, step=step)
            seconds.append(time.perf_counter() - started)
            rates.append(info.change_rate)
            moved.append(gathering.bytes + gathering.functional_bytes + publishing.bytes)
            del state
            step += 1
        if rate:
            rows[f"{rate:g}"] = {
                "publish_s": statistics.median(seconds),
                "collective_bytes": statistics.median(moved),
                "changed": statistics.median(rates),
            }
    baseline = sum(t.numel() * t.element_size() for t in writer.baseline.values())
    result = {
        "rank": rank,
        "rates": rows,
        "baseline_bytes": baseline,
        "shard_bytes": shard_bytes,
        "model_bytes": model_bytes,
        "peak_rss_growth_mb": _rss_mb() - rss_before,
    }
    Path(args.out).write_text(json.dumps(result))
    os._exit(0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, path: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    store, port = work / f"{path}-{world}", _port()
    procs = []
    for rank in range(world):
        out = work / f"{path}-{world}-{rank}.json"
        command = [
            sys.executable,
            __file__,
            "--worker",
            f"--rank={rank}",
            f"--world={world}",
            f"--port={port}",
            f"--path={path}",
            f"--store={store}",
            f"--out={out}",
            f"--hidden={args.hidden}",
            f"--layers={args.layers}",
            f"--vocab={args.vocab}",
            f"--steps={args.steps}",
            "--rates",
            *map(str, args.rates),
        ]
        procs.append(subprocess.Popen(command, stderr=subprocess.DEVNULL))
    if any(p.wait() for p in procs):
        raise SystemExit(f"a rank of {path} on {world} ranks failed")
    return [json.loads((work / f"{path}-{world}-{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.05])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("rank", "world", "port"):
        parser.add_argument(f"--{hidden}", type=int, default=0, help=argparse.SUPPRESS)
    for hidden in ("path", "store", "out"):
        parser.add_argument(f"--{hidden}", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for world in args.worlds:
            results = {path: run(world, path, args, work) for path in ("sharded", "gather")}
            first = results["sharded"][0]
            print(
                f"\n{world} ranks, model {first['model_bytes'] / 1e6:.0f} MB bf16 "
                f"(medians of {args.steps} steps; per rank: max over ranks)"
            )
            print(
                f"{'path':8} {'rate':>5} {'changed':>8} {'publish s':>10} {'collective MB':>14} "
                f"{'peak RSS +MB':>13} {'baseline/shard':>15}"
            )
            for rate in map(lambda r: f"{r:g}", args.rates):
                line = {}
                for path, ranks in results.items():
                    seconds = max(r["rates"][rate]["publish_s"] for r in ranks)
                    moved = max(r["rates"][rate]["collective_bytes"] for r in ranks)
                    rss = max(r["peak_rss_growth_mb"] for r in ranks)
                    ratio = max(r["baseline_bytes"] / r["shard_bytes"] for r in ranks)
                    changed = ranks[0]["rates"][rate]["changed"]
                    line[path] = seconds
                    print(
                        f"{path:8} {rate:>5} {changed:>8.4f} {seconds:>10.3f} {moved / 1e6:>14.2f} "
                        f"{rss:>13.0f} {ratio:>15.2f}"
                    )
                ratio = line["gather"] / line["sharded"]
                print(f"{'':8} {rate:>5} gather / sharded time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
