"""GPU check of the device path: kernel throughput against a device copy, and bit-exactness.

Builds a model-shaped set of bf16 tensors (a Llama-like stack: hidden 4096, MLP
14336, 8 layers, vocabulary 32000: 4.4 GB), makes a "next step" of it in which
about 1% and then 5% of the elements change (an fp32 update of RL size rounded
back to bf16, so changes are the usual +-1 ulp with a tail), and measures in the
same run, as medians of a few repetitions:

- ``copy``: a device-to-device copy of every tensor (the yardstick);
- ``compare+compact``: the writer's diff of every tensor (count kernel, prefix
  sum, compaction kernel writing int64 positions, new and XOR bits);
- ``compact+copy-out``: the same through the writer's pipeline, including the
  copies of positions and XOR bits into pinned host memory;
- ``apply``: the reader's XOR scatter of every tensor's change into a copy of
  the old weights.

Throughputs are dense checkpoint bytes per second, and are also printed as
ratios to the copy. Bit-exactness: every diff equals the torch reference
(``torch.nonzero`` and gathers) and the applied copy equals the new weights bit
for bit. Needs only torch and Triton; runs in well under 5 minutes on one GPU.

Usage::

    benchmarks/gpu_check.sh [--json] [--kernels auto|triton|torch]
    benchmarks/gpu_check.sh --dry-run [--kernels torch|triton]   # CPU, tiny (CI smoke run)

``--dry-run`` uses the CPU and a tiny model; with ``--kernels triton`` it runs
Triton's interpreter. Exit status: 0 when bit-exact, 1 when not, 2 without CUDA
(and without ``--dry-run``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RATES = (0.01, 0.05)
FULL_SHAPE = {"hidden": 4096, "mlp": 14336, "layers": 8, "vocab": 32000}
TINY_SHAPE = {"hidden": 64, "mlp": 176, "layers": 2, "vocab": 300}
MIN_FULL_BYTES = 4 * 10**9


def _load_dcr_cuda() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """dcr_format's dispatch, reference and pipeline, needing only torch (+ Triton)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import dcr_format  # noqa: F401  (the whole package, when its dependencies are here)
    except ImportError:
        # only torch and Triton on this machine: the device kernels need nothing else
        stub = types.ModuleType("dcr_format")
        stub.__path__ = [str(ROOT / "dcr_format")]
        sys.modules["dcr_format"] = stub
    from dcr_format.delta import dispatch
    from dcr_format.kernels import reference

    try:
        from dcr_format.delta import pipeline
    except ImportError:  # the pipeline's encoder needs the codec's dependencies
        pipeline = None
    return dispatch, reference, pipeline  # type: ignore[return-value]


def model_shapes(hidden: int, mlp: int, layers: int, vocab: int) -> list[tuple[str, tuple]]:
    """Canonical names and shapes of a Llama-like decoder."""
    shapes: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (hidden, hidden)),
            (p + "self_attn.v_proj.weight", (hidden, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (mlp, hidden)),
            (p + "mlp.up_proj.weight", (mlp, hidden)),
            (p + "mlp.down_proj.weight", (hidden, mlp)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> tuple[float, object]:
    """Median seconds of ``reps`` runs of ``fn`` (after one warm-up run), and its last result."""
    result = fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _calibrate(sample: torch.Tensor, rate: float, gen: torch.Generator) -> float:
    """The update size that changes about ``rate`` of a bf16 sample's elements."""
    noise = torch.randn(sample.shape, generator=gen, device="cpu").to(sample.device)
    wide = sample.float()
    low, high = 1e-9, 1.0
    for _ in range(40):
        mid = (low * high) ** 0.5
        changed = ((wide + mid * noise).bfloat16() != sample).float().mean().item()
        low, high = (mid, high) if changed < rate else (low, mid)
    return (low * high) ** 0.5


def build_model(shape: dict[str, int], device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """bf16 weights ~ N(0, 0.02) (norms around 1), generated on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    model = {}
    for name, dims in model_shapes(**shape):
        if len(dims) == 1:
            model[name] = (1 + 0.1 * torch.randn(dims, generator=gen, device=device)).bfloat16()
        else:
            model[name] = (0.02 * torch.randn(dims, generator=gen, device=device)).bfloat16()
    return model


def step_model(model: dict[str, torch.Tensor], rate: float, seed: int) -> dict[str, torch.Tensor]:
    """The next step: fp32 update of a size calibrated to change ``rate`` of the elements."""
    device = next(iter(model.values())).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    biggest = max(model.values(), key=lambda t: t.numel()).reshape(-1)
    lr = _calibrate(biggest[: 1 << 20], rate, gen)
    dgen = torch.Generator(device=device).manual_seed(seed + 1)
    out = {}
    for name, tensor in model.items():
        noise = torch.randn(tensor.shape, generator=dgen, device=device)
        out[name] = (tensor.float() + lr * noise).bfloat16()
        del noise
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16).reshape(-1)


def check_rate(
    dispatch: types.ModuleType,
    reference: types.ModuleType,
    pipeline: types.ModuleType | None,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    copy_seconds: float,
    dense: int,
    device: torch.device,
    reps: int,
) -> dict:
    """Measure one change rate; returns its row."""
    pairs = [(_bits(old[n]), _bits(new[n])) for n in old]

    def compare_compact():
        return [dispatch.diff(o, n, want_new=True, want_xor=True) for o, n in pairs]

    diff_seconds, diffs = timed(compare_compact, device, reps)
    changed = sum(d.changed for d in diffs)
    exact = True
    for (o, n), d in zip(pairs, diffs, strict=True):  # the torch reference, tensor by tensor
        ref = reference.diff(o, n, want_new=True, want_xor=True)
        exact &= all(
            torch.equal(a, b)
            for a, b in (
                (d.positions, ref.positions),
                (d.new_values, ref.new_values),
                (d.xor_values, ref.xor_values),
            )
        )
        del ref

    pipeline_seconds = None
    if pipeline is not None:

        def compact_copy_out():
            return [
                c.host
                for c in pipeline.DeviceDiffPipeline(
                    (i, new[name], old[name]) for i, name in enumerate(old)
                )
            ]

        pipeline_seconds, hosts = timed(compact_copy_out, device, reps)
        for d, host in zip(diffs, hosts, strict=True):
            exact &= torch.equal(host[0], d.positions.cpu())
            exact &= torch.equal(host[1], d.xor_values.cpu())
        del hosts

    target = {n: t.clone() for n, t in old.items()}
    flats = [_bits(target[n]) for n in old]

    def apply():
        for flat, d in zip(flats, diffs, strict=True):
            dispatch.scatter(flat, d.positions, d.xor_values, op="xor")

    # warm-up plus `reps` applies: an even number of XORs in all, then one more to land on `new`
    apply_seconds, _ = timed(apply, device, reps if reps % 2 else reps + 1)
    apply()
    _sync(device)
    exact &= all(torch.equal(_bits(target[n]), _bits(new[n])) for n in old)

    def gbps(seconds: float | None) -> float | None:
        return None if seconds is None else dense / seconds / 1e9

    def ratio(seconds: float | None) -> float | None:
        return None if seconds is None else copy_seconds / seconds

    return {
        "target_rate": None,
        "changed": changed,
        "change_rate": changed / sum(t.numel() for t in old.values()),
        "compare_compact_seconds": diff_seconds,
        "compare_compact_gbps": gbps(diff_seconds),
        "compare_compact_ratio": ratio(diff_seconds),
        "pipeline_seconds": pipeline_seconds,
        "pipeline_gbps": gbps(pipeline_seconds),
        "pipeline_ratio": ratio(pipeline_seconds),
        "apply_seconds": apply_seconds,
        "apply_gbps": gbps(apply_seconds),
        "apply_ratio": ratio(apply_seconds),
        "bit_exact": bool(exact),
    }


def time_copy(model: dict[str, torch.Tensor], device: torch.device, reps: int) -> float:
    """Median seconds of a device-to-device copy of every tensor."""
    dst = {n: torch.empty_like(t) for n, t in model.items()}

    def copy():
        for name, tensor in model.items():
            dst[name].copy_(tensor)

    return timed(copy, device, reps)[0]


def run(args: argparse.Namespace) -> dict:
    """Build, measure and check; returns the report."""
    started = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda")
    dispatch, reference, pipeline = _load_dcr_cuda()
    shape = TINY_SHAPE if args.dry_run else FULL_SHAPE
    old = build_model(shape, device, seed=args.seed)
    dense = sum(t.numel() * t.element_size() for t in old.values())
    if not args.dry_run and dense < MIN_FULL_BYTES:
        raise AssertionError(f"the model is {dense} bytes, below the 4 GB the check promises")
    from dcr_format.delta.backends import backend_for

    backend = backend_for(next(iter(old.values()))).name
    reps = 1 if args.dry_run else args.reps

    copy_seconds = time_copy(old, device, reps)
    rows = []
    for index, rate in enumerate(RATES):
        new = step_model(old, rate, seed=args.seed + 10 + index)
        row = check_rate(dispatch, reference, pipeline, old, new, copy_seconds, dense, device, reps)
        row["target_rate"] = rate
        rows.append(row)
        del new
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": name,
        "dry_run": bool(args.dry_run),
        "kernels": backend,
        "dtype": "bfloat16",
        "tensors": len(old),
        "elements": sum(t.numel() for t in old.values()),
        "dense_bytes": dense,
        "reps": reps,
        "copy_seconds": copy_seconds,
        "copy_gbps": dense / copy_seconds / 1e9,
        "rates": rows,
        "bit_exact": all(r["bit_exact"] for r in rows),
        "seconds": time.perf_counter() - started,
    }


def _fmt(gbps: float | None, ratio: float | None) -> str:
    if gbps is None or ratio is None:
        return "n/a (the pipeline needs the whole package)"
    return f"{gbps:8.1f} GB/s = {ratio:5.2f}x copy"


def print_report(report: dict) -> None:
    """The human-readable report."""
    print(
        f"dcr gpu_check: device={report['device']} kernels={report['kernels']} "
        f"dtype={report['dtype']} tensors={report['tensors']} "
        f"dense={report['dense_bytes'] / 1e9:.3f} GB reps={report['reps']}"
        + (" (dry run: CPU, tiny model)" if report["dry_run"] else "")
    )
    print(f"copy (device to device):   {report['copy_gbps']:8.1f} GB/s")
    for row in report["rates"]:
        print(
            f"rate {row['target_rate']:.0%}: changed {row['changed']} "
            f"({row['change_rate']:.2%}) bit-exact: {'yes' if row['bit_exact'] else 'NO'}"
        )
        compare = _fmt(row["compare_compact_gbps"], row["compare_compact_ratio"])
        print(f"  compare+compact:         {compare}")
        print(f"  compact+copy-out:        {_fmt(row['pipeline_gbps'], row['pipeline_ratio'])}")
        print(f"  apply (xor scatter):     {_fmt(row['apply_gbps'], row['apply_ratio'])}")
    print(f"bit-exact: {'PASS' if report['bit_exact'] else 'FAIL'} ({report['seconds']:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model (smoke run)")
    parser.add_argument("--kernels", choices=("auto", "triton", "torch"), default=None)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --dry-run runs the CPU smoke check", file=sys.stderr)
        return 2
    saved = os.environ.get("DCR_KERNELS")
    os.environ["DCR_KERNELS"] = args.kernels or ("torch" if args.dry_run else "auto")
    try:
        report = run(args)
    finally:
        if saved is None:
            del os.environ["DCR_KERNELS"]
        else:
            os.environ["DCR_KERNELS"] = saved
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
