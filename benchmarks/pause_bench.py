"""The pause of a prepared version, in process: ``DeltaReader.apply`` of what
``DeltaReader.prepare`` staged, against a dense copy of the same tensors.

A Llama-like model (fused ``qkv`` and ``gate_up`` parameters, ``--layers`` layers, 9
tensors a layer plus embedding, final norm and head: 39 tensors at 4 layers) is synced
two ways: a :class:`StateDictTarget` of the canonical tensors, and a :class:`ModuleTarget`
over a module whose loader places them like vLLM's. Every step changes ``--changed``
elements of every tensor (the fixed costs of the pause) or, with ``--fraction``, that
share of them (the write). Per target it prints the medians over ``--steps`` of the
pause, the pause per tensor and per changed element, the processor time of the thread that
applies (the same pause less any wait for a busy host's cores), and a dense ``copy_`` of
the same tensors into the resident ones (the module: its ``load_weights`` of every
tensor), the ratio of each step taken within that step.

    PYTHONPATH=$PWD python benchmarks/pause_bench.py --steps 9
    PYTHONPATH=$PWD python benchmarks/pause_bench.py --steps 9 --fraction 0.03 --hidden 512

Many small tensors (1,803 at 200 layers) show what the pause costs a tensor:

    PYTHONPATH=$PWD python benchmarks/pause_bench.py --steps 7 --layers 200 --hidden 64 \
        --ff 128 --vocab 256

``--device cuda`` keeps the weights, the writer's baseline and the resident tensors on a
GPU (each pause and copy timed until the device's work is done).

``--profile`` prints the top of a cProfile of the module target's applies. ``--lines MB``
instead measures what bounds the write on this machine's memory: compiled loops reading
an array of ``MB`` megabytes of bf16 bits in full, one element of every fourth cache line,
and the sorted random ``--fraction`` of its positions (least of nine runs each).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from dcr_format import DeltaReader, DeltaWriter, ModuleTarget, StateDictTarget


def shapes(layers: int, hidden: int, ff: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """The canonical names and shapes of a Llama with ``layers`` layers."""
    kv = hidden // 2
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (ff, hidden),
            p + "mlp.up_proj.weight": (ff, hidden),
            p + "mlp.down_proj.weight": (hidden, ff),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    out |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return out


class Llama(nn.Module):
    """The engine's layout: ``qkv_proj`` and ``gate_up_proj`` fused, a loader that places."""

    def __init__(self, specs: dict[str, tuple[int, ...]], device: str = "cpu") -> None:
        super().__init__()
        self.params: dict[str, tuple[nn.Parameter, int]] = {}  # name -> (parameter, row)
        fused: dict[str, list[str]] = {}
        for name in specs:
            key = name
            for part, into in _FUSED:
                if f".{part}." in name:
                    key = name.replace(part, into)
            fused.setdefault(key, []).append(name)
        for i, names in enumerate(fused.values()):
            rows = sum(specs[n][0] for n in names)
            shape = (rows, *specs[names[0]][1:])
            param = nn.Parameter(
                torch.zeros(shape, dtype=torch.bfloat16, device=device), requires_grad=False
            )
            self.register_parameter(f"p{i}", param)
            at = 0
            for n in names:
                self.params[n] = (param, at)
                at += specs[n][0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, w in weights:
            param, at = self.params[name]
            param.data.narrow(0, at, w.shape[0]).copy_(w)
            loaded.add(name)
        return loaded


_FUSED = (
    ("q_proj", "qkv_proj"),
    ("k_proj", "qkv_proj"),
    ("v_proj", "qkv_proj"),
    ("gate_proj", "gate_up_proj"),
    ("up_proj", "gate_up_proj"),
)


def step_of(
    state: dict[str, torch.Tensor], k: int, changed: int, fraction: float
) -> tuple[dict[str, torch.Tensor], int]:
    """The next version: ``changed`` elements of every tensor (or ``fraction`` of them)."""
    gen = torch.Generator().manual_seed(1000 + k)
    out, total = {}, 0
    for name, tensor in state.items():
        new = tensor.clone()
        flat = new.view(-1)
        count = max(1, int(flat.numel() * fraction)) if fraction else min(changed, flat.numel())
        at = torch.randperm(flat.numel(), generator=gen)[:count].to(flat.device)
        flat[at] += 0.0625 * (1 + (k % 3))
        total += int((new.view(torch.int16) != tensor.view(torch.int16)).sum())
        out[name] = new
    return out, total


def _finished(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU's kernels run after their call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> None:
    specs = shapes(args.layers, args.hidden, args.ff, args.vocab)
    gen = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    state = {
        n: (torch.randn(*s, generator=gen) * 0.02).bfloat16().to(device) for n, s in specs.items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        writer = DeltaWriter(f"{tmp}/store", baseline_device=device)
        writer.publish(state)
        resident = {n: t.clone() for n, t in state.items()}
        dict_reader = DeltaReader(f"{tmp}/store", StateDictTarget(resident))
        module = Llama(specs, args.device)
        target = ModuleTarget(module, load_weights=module.load_weights)
        module_reader = DeltaReader(f"{tmp}/store", target)
        dict_reader.sync()
        module_reader.sync()
        target.warm()
        readers: dict[str, DeltaReader] = {"dict": dict_reader, "module": module_reader}
        dense: dict[str, Callable[[dict[str, torch.Tensor]], None]] = {
            "dict": lambda new: [resident[n].copy_(t) for n, t in new.items()] and None,
            "module": lambda new: module.load_weights(new.items()) and None,
        }
        rows: dict[str, list[tuple[float, float, int, float]]] = {k: [] for k in readers}
        profile = cProfile.Profile() if args.profile else None
        for k in range(args.steps + 1):  # the first is a warm-up, not counted
            state, total = step_of(state, k, args.changed, args.fraction)
            writer.publish(state)
            for kind, reader in readers.items():
                prepared = reader.prepare()
                _finished(device)
                started, processor = time.perf_counter(), time.thread_time()
                if profile is not None and kind == "module" and k:
                    profile.enable()
                reader.apply(prepared)
                _finished(device)
                if profile is not None:
                    profile.disable()
                pause = time.perf_counter() - started
                processor = time.thread_time() - processor
                started = time.perf_counter()
                dense[kind](state)
                _finished(device)
                copy = time.perf_counter() - started
                if k:
                    rows[kind].append((pause, copy, total, processor))
        n = len(specs)
        print(f"{n} tensors, {sum(t.numel() for t in state.values()):,} elements on {device}, "
              f"medians of {args.steps} steps")  # fmt: skip
        for kind, got in rows.items():
            pause = statistics.median(r[0] for r in got)
            copy = statistics.median(r[1] for r in got)
            ratio = statistics.median(r[0] / r[1] for r in got)
            changed = statistics.median(r[2] for r in got)
            processor = statistics.median(r[3] for r in got)
            print(
                f"{kind:7s} pause {pause * 1e3:7.3f} ms ({pause / n * 1e6:6.1f} us a tensor, "
                f"{pause / changed * 1e9:7.1f} ns a changed element, {changed:,.0f} changed; "
                f"processor {processor * 1e3:7.3f} ms, {processor / n * 1e6:6.1f} us a tensor)"
                f"  dense {copy * 1e3:7.3f} ms  pause/dense {ratio:5.2f}x"
            )
        if profile is not None:
            pstats.Stats(profile).sort_stats(args.sort).print_stats(args.profile)


def memory_reads(megabytes: float, fraction: float) -> None:
    """Print the least time of nine runs of three compiled reads of one bf16 array: every
    element, one element of every fourth 64-byte line, and ``fraction`` of its positions."""
    import numpy as np
    from numba import njit

    @njit(nogil=True)
    def at_positions(flat, positions):  # type: ignore[no-untyped-def]
        total = 0
        for j in range(positions.shape[0]):
            total += flat[positions[j]]
        return total

    @njit(nogil=True)
    def whole(flat):  # type: ignore[no-untyped-def]
        total = 0
        for j in range(flat.shape[0]):
            total += flat[j]
        return total

    @njit(nogil=True)
    def strided(flat, step):  # type: ignore[no-untyped-def]
        total = 0
        for j in range(0, flat.shape[0], step):
            total += flat[j]
        return total

    rng = np.random.default_rng(0)
    size = int(megabytes * 1e6) // 2
    flat = rng.integers(0, 1 << 16, size, dtype=np.uint16)
    count = max(1, int(size * fraction))
    positions = np.sort(rng.choice(size, count, replace=False)).astype(np.int64)
    runs: dict[str, Callable[[], object]] = {
        "every element": lambda: whole(flat),
        "one element of every 4th cache line": lambda: strided(flat, 128),
        f"the {fraction:.1%} changed positions": lambda: at_positions(flat, positions),
    }
    for read in runs.values():
        read()  # compiled before timing
    best = {name: float("inf") for name in runs}
    for _ in range(9):
        for name, read in runs.items():
            started = time.perf_counter()
            read()
            best[name] = min(best[name], time.perf_counter() - started)
    print(f"reading {megabytes:g} MB of bf16 bits (least of 9 runs):")
    for name, seconds in best.items():
        print(f"  {name:40s} {seconds * 1e3:8.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ff", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--changed", type=int, default=8, help="elements a tensor, each step")
    parser.add_argument("--fraction", type=float, default=0.0, help="else: this share changes")
    parser.add_argument("--profile", type=int, default=0, help="print this many cProfile rows")
    parser.add_argument("--sort", default="cumulative", help="the cProfile order")
    parser.add_argument("--lines", type=float, default=0.0, help="MB: the memory reads only")
    parser.add_argument(
        "--device", default="cpu", help="where the weights and the resident tensors live"
    )
    args = parser.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    if args.lines:
        memory_reads(args.lines, args.fraction or 0.01)
        return
    run(args)


if __name__ == "__main__":
    main()
