"""Codec benchmark: size and speed of real per-step deltas against their entropy bound.

Trains the toy model (``dcr_format.toymodel``) at several learning rates chosen
so that about 0.5%, 1%, 3% and 5% of the bf16 elements change per step, and
for every measured step encodes the whole model's delta as one shard, exactly
as a writer would, then reports:

- changed elements and change rate;
- stored shard bytes (after the shard's zstd frame) per changed element, and
  their ratio to the dense bf16 checkpoint (2 bytes per element);
- the ratio to the empirical entropy bound: positions as independent per-tensor
  Bernoulli draws (``numel * H2(changed / numel)`` bits per tensor), values as
  ``changed * H`` where H is the order-0 entropy of the step's XOR values as
  16-bit symbols; and each half's ratio alone (position stream bytes against
  the position bound, value streams compressed alone at the shard's zstd level
  against the value bound);
- ``xor`` against ``overwrite``: the same step with every tensor's op forced to
  ``overwrite`` (goal: ``xor`` at least 30% smaller at ~1% change);
- encode and decode+apply throughput relative to a plain ``torch.clone`` of the
  same dense bf16 bytes, timed in the same run (median of several repetitions);
- for information, the order-0 entropy of the signed difference in ulps (bf16
  bits mapped to ordered integers) next to the XOR entropy.

Entry points: ``benchmarks/codec_bench.py`` (this module's :func:`main`) and
the suite (``dcr bench``, :mod:`dcr_format.bench.suite`), which reuses
:func:`entropy_bound` and :func:`measure_speed`::

    .venv/bin/python benchmarks/codec_bench.py [--size medium] [--quick] [--json]

``--quick`` (the CI smoke test) uses the tiny model and two measured steps.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import zstandard

from dcr_format.codec.delta import (
    OVERWRITE,
    XOR,
    EncodedTensor,
    apply_delta,
    decode_delta,
    encode_tensor,
)
from dcr_format.codec.dtypes import info_for
from dcr_format.codec.shard import ZSTD_LEVEL, compress, decode_shard, encode_shard
from dcr_format.toymodel import Trainer

# (target change rate, AdamW learning rate). Calibrated on the toy models at the
# measured steps (after WARMUP steps; Adam's first steps move weights the most).
# The actual rate is measured and reported; it drifts down slowly with the step.
TARGETS: tuple[tuple[float, float], ...] = (
    (0.005, 2.6e-7),
    (0.01, 5.9e-7),
    (0.03, 2.2e-6),
    (0.05, 4.1e-6),
)
WARMUP = 3
GOAL_RATE = 0.01
GOAL_VS_BOUND = 1.15
GOAL_XOR_SAVING = 0.30


def _binary_entropy(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1.0 - p) * math.log2(1.0 - p))


def _entropy_bits(symbols: np.ndarray) -> float:
    """Order-0 empirical entropy in bits per symbol."""
    if symbols.size == 0:
        return 0.0
    _, counts = np.unique(symbols, return_counts=True)
    probs = counts / symbols.size
    return float(-(probs * np.log2(probs)).sum())


def _huffman_bits(symbols: np.ndarray) -> float:
    """Mean code length in bits of an optimal static prefix code for ``symbols``."""
    if symbols.size == 0:
        return 0.0
    counts = np.unique(symbols, return_counts=True)[1].tolist()
    if len(counts) == 1:
        return 1.0
    heapq.heapify(counts)
    total = 0
    while len(counts) > 1:
        merged = heapq.heappop(counts) + heapq.heappop(counts)
        total += merged
        heapq.heappush(counts, merged)
    return total / symbols.size


def _zstd_bits(data: bytes, count: int, **params: int) -> float:
    """Bits per value of ``data`` compressed with the shard's zstd level and ``params``."""
    cparams = zstandard.ZstdCompressionParameters.from_level(ZSTD_LEVEL, **params)
    return 8 * len(zstandard.ZstdCompressor(compression_params=cparams).compress(data)) / count


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bits (int16) -> int32 whose order is the float order (-0 just below +0)."""
    as_int = bits.to(torch.int32)
    return torch.where(as_int < 0, -1 - (as_int & 0x7FFF), as_int)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _encode_all(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], op: str
) -> list[tuple[str, EncodedTensor]]:
    return [(name, encode_tensor(new[name], old[name], op=op)) for name in new]


def _shard_streams(encoded: list[tuple[str, EncodedTensor]]) -> dict[str, bytes]:
    streams: dict[str, bytes] = {}
    for i, (_, enc) in enumerate(encoded):
        if enc.changed:
            assert enc.positions is not None and enc.values is not None
            streams[f"{i}.p"] = enc.positions
            streams[f"{i}.v"] = enc.values
    return streams


def _decode_apply(
    stored: bytes,
    decoded_size: int,
    encoded: list[tuple[str, EncodedTensor]],
    targets: dict[str, torch.Tensor],
) -> None:
    streams = decode_shard(stored, decoded_size=decoded_size)
    for i, (name, enc) in enumerate(encoded):
        if not enc.changed:
            continue
        target = targets[name]
        assert enc.positions_coding is not None and enc.values_coding is not None
        delta = decode_delta(
            enc.op,
            info_for(target.dtype),
            target.numel(),
            enc.changed,
            positions=(enc.positions_coding, streams[f"{i}.p"]),
            values=(enc.values_coding, streams[f"{i}.v"]),
        )
        apply_delta(target, delta)


@dataclass(frozen=True)
class EntropyBound:
    """The empirical entropy bound of one step's delta (bf16 state dicts)."""

    changed: int
    positions_bits: float
    """Per-tensor Bernoulli positions: sum of ``numel * H2(changed / numel)``."""
    values_bits: float
    """``changed * H`` with H the order-0 entropy of the XOR values as 16-bit symbols."""
    h_xor: float
    h_ulp: float
    xor_symbols: np.ndarray

    @property
    def bytes(self) -> float:
        return (self.positions_bits + self.values_bits) / 8


def entropy_bound(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> EntropyBound:
    """Positions as independent per-tensor Bernoulli draws plus order-0 XOR value entropy."""
    pos_bound_bits = 0.0
    changed = 0
    xor_parts, ulp_parts = [], []
    for name, tensor in new.items():
        old_bits = old[name].view(torch.int16).reshape(-1)
        new_bits = tensor.view(torch.int16).reshape(-1)
        mask = old_bits != new_bits
        count = int(mask.sum())
        changed += count
        pos_bound_bits += tensor.numel() * _binary_entropy(count / tensor.numel())
        if count:
            o, n = old_bits[mask], new_bits[mask]
            xor_parts.append((o ^ n).numpy().view(np.uint16))
            ulp_parts.append((_ordered(n) - _ordered(o)).numpy())
    xor_symbols = np.concatenate(xor_parts) if xor_parts else np.empty(0, np.uint16)
    ulp_symbols = np.concatenate(ulp_parts) if ulp_parts else np.empty(0, np.int32)
    h_xor = _entropy_bits(xor_symbols)
    return EntropyBound(
        changed=changed,
        positions_bits=pos_bound_bits,
        values_bits=changed * h_xor,
        h_xor=h_xor,
        h_ulp=_entropy_bits(ulp_symbols),
        xor_symbols=xor_symbols,
    )


def measure_speed(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], *, reps: int
) -> dict[str, float]:
    """Encode and decode+apply time of the ``xor`` delta against ``torch.clone`` of the dense
    bytes, interleaved per repetition (after checking that decode+apply is bit-exact)."""
    dense_bytes = sum(t.numel() * t.element_size() for t in new.values())
    xor_enc = _encode_all(old, new, XOR)
    xor_stored, xor_decoded = encode_shard(_shard_streams(xor_enc))
    targets: dict[str, torch.Tensor] = {}

    def reset() -> None:
        targets.clear()
        targets.update({name: t.clone() for name, t in old.items()})

    reset()
    _decode_apply(xor_stored, xor_decoded, xor_enc, targets)
    for name, tensor in new.items():
        if not torch.equal(targets[name].view(torch.int16), tensor.view(torch.int16)):
            raise AssertionError(f"decode+apply of {name} is not bit-exact")

    # Interleaved: each repetition times clone, encode and decode+apply back to back and
    # the ratios are taken per repetition, so load from other processes cancels out.
    values = list(new.values())
    clone_t, encode_t, decode_t = [], [], []
    for _ in range(reps):
        reset()
        clone_t.append(_timed(lambda: [t.clone() for t in values]))
        encode_t.append(_timed(lambda: encode_shard(_shard_streams(_encode_all(old, new, XOR)))))
        decode_t.append(_timed(lambda: _decode_apply(xor_stored, xor_decoded, xor_enc, targets)))
    targets.clear()
    t_clone = statistics.median(clone_t)
    t_encode = statistics.median(encode_t)
    t_decode = statistics.median(decode_t)
    return {
        "clone_s": t_clone,
        "encode_s": t_encode,
        "decode_apply_s": t_decode,
        "clone_gbps": dense_bytes / t_clone / 1e9,
        "encode_gbps": dense_bytes / t_encode / 1e9,
        "decode_apply_gbps": dense_bytes / t_decode / 1e9,
        "encode_vs_clone": statistics.median(c / e for c, e in zip(clone_t, encode_t, strict=True)),
        "decode_apply_vs_clone": statistics.median(
            c / d for c, d in zip(clone_t, decode_t, strict=True)
        ),
    }


def measure_step(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], *, reps: int
) -> dict[str, float | int]:
    """Every metric of one step's delta from ``old`` to ``new`` (bf16 state dicts)."""
    total = sum(t.numel() for t in new.values())
    dense_bytes = 2 * total

    # --- sizes -------------------------------------------------------------
    xor_enc = _encode_all(old, new, XOR)
    ovw_enc = _encode_all(old, new, OVERWRITE)
    changed = sum(enc.changed for _, enc in xor_enc)
    xor_streams = _shard_streams(xor_enc)
    xor_stored, xor_decoded = encode_shard(xor_streams)
    ovw_stored, _ = encode_shard(_shard_streams(ovw_enc))
    pos_raw = sum(len(enc.positions or b"") for _, enc in xor_enc)
    pos_zstd = len(compress(b"".join(enc.positions or b"" for _, enc in xor_enc)))
    val_raw = sum(len(enc.values or b"") for _, enc in xor_enc)
    val_joined = b"".join(enc.values or b"" for _, enc in xor_enc)
    val_zstd = len(compress(val_joined))
    ovw_val_zstd = len(compress(b"".join(enc.values or b"" for _, enc in ovw_enc)))

    # --- entropy bounds ----------------------------------------------------
    bound = entropy_bound(old, new)
    pos_bound_bits = bound.positions_bits
    val_bound_bits = bound.values_bits
    bound_bytes = bound.bytes

    # --- correctness and speed --------------------------------------------
    speed = measure_speed(old, new, reps=reps)

    per = max(changed, 1)
    return {
        "total_elements": total,
        "changed": changed,
        "rate": changed / total,
        "dense_bytes": dense_bytes,
        "xor_bytes": len(xor_stored),
        "xor_decoded_bytes": xor_decoded,
        "overwrite_bytes": len(ovw_stored),
        "bytes_per_changed": len(xor_stored) / per,
        "overwrite_bytes_per_changed": len(ovw_stored) / per,
        "bound_bytes": bound_bytes,
        "bound_bytes_per_changed": bound_bytes / per,
        "vs_dense": len(xor_stored) / dense_bytes,
        "vs_bound": len(xor_stored) / bound_bytes if bound_bytes else float("nan"),
        "pos_bytes": pos_raw,
        "pos_zstd_bytes": pos_zstd,
        "pos_bound_bytes": pos_bound_bits / 8,
        "pos_vs_bound": pos_raw / (pos_bound_bits / 8) if pos_bound_bits else float("nan"),
        "pos_bits_per_changed": 8 * pos_raw / per,
        "val_raw_bytes": val_raw,
        "val_zstd_bytes": val_zstd,
        "val_bound_bytes": val_bound_bits / 8,
        "val_vs_bound": val_zstd / (val_bound_bits / 8) if val_bound_bits else float("nan"),
        "val_bits_per_changed": 8 * val_zstd / per,
        "val_minmatch7_bits_per_changed": _zstd_bits(val_joined, per, min_match=7),
        "val_huffman_bits_per_changed": _huffman_bits(bound.xor_symbols),
        "overwrite_val_zstd_bytes": ovw_val_zstd,
        "xor_vs_overwrite": len(xor_stored) / len(ovw_stored),
        "h_xor_bits": bound.h_xor,
        "h_ulp_bits": bound.h_ulp,
        **speed,
    }


def run(
    *,
    size: str,
    steps: int,
    warmup: int,
    reps: int,
    targets: Sequence[tuple[float, float]],
    seed: int,
) -> dict[str, object]:
    """Train at each target's learning rate and measure ``steps`` steps after ``warmup``."""
    rows: list[dict[str, object]] = []
    params = 0
    for target, lr in targets:
        trainer = Trainer(size=size, lr=lr, seed=seed)
        params = trainer.num_params
        for _ in range(warmup):
            trainer.step()
        old = trainer.export_bf16()
        for _ in range(steps):
            trainer.step()
            new = trainer.export_bf16()
            print(
                f"measuring target {target:.1%} (lr {lr:g}) step {trainer.steps}",
                file=sys.stderr,
                flush=True,
            )
            row: dict[str, object] = {"target_rate": target, "lr": lr, "step": trainer.steps}
            row.update(measure_step(old, new, reps=reps))
            rows.append(row)
            old = new
    return {
        "size": size,
        "params": params,
        "dense_bytes": 2 * params,
        "warmup_steps": warmup,
        "measured_steps": steps,
        "reps": reps,
        "zstd_level": ZSTD_LEVEL,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "goal": _goal(rows),
    }


def _goal(rows: list[dict[str, object]]) -> dict[str, object]:
    """The check at ~1% change: within 1.15x of the bound, xor >= 30% smaller than overwrite."""
    picked = [r for r in rows if r["target_rate"] == GOAL_RATE] or rows
    vs_bound = statistics.mean(float(r["vs_bound"]) for r in picked)  # type: ignore[arg-type]
    xor_ovw = statistics.mean(float(r["xor_vs_overwrite"]) for r in picked)  # type: ignore[arg-type]
    return {
        "target_rate": GOAL_RATE,
        "vs_bound": vs_bound,
        "vs_bound_ok": vs_bound <= GOAL_VS_BOUND,
        "xor_saving": 1.0 - xor_ovw,
        "xor_saving_ok": 1.0 - xor_ovw >= GOAL_XOR_SAVING,
    }


COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, key, format)
    ("target", "target_rate", "{:.1%}"),
    ("lr", "lr", "{:.2g}"),
    ("step", "step", "{}"),
    ("changed", "changed", "{:,}"),
    ("rate", "rate", "{:.3%}"),
    ("B/chg", "bytes_per_changed", "{:.3f}"),
    ("bound B/chg", "bound_bytes_per_changed", "{:.3f}"),
    ("vs dense", "vs_dense", "{:.5f}"),
    ("vs bound", "vs_bound", "{:.3f}"),
    ("pos/bound", "pos_vs_bound", "{:.3f}"),
    ("val/bound", "val_vs_bound", "{:.3f}"),
    ("pos b/chg", "pos_bits_per_changed", "{:.2f}"),
    ("val b/chg", "val_bits_per_changed", "{:.2f}"),
    ("val b/chg mm7", "val_minmatch7_bits_per_changed", "{:.2f}"),
    ("val b/chg huff", "val_huffman_bits_per_changed", "{:.2f}"),
    ("xor/ovw", "xor_vs_overwrite", "{:.3f}"),
    ("enc/clone", "encode_vs_clone", "{:.4f}"),
    ("dec+apply/clone", "decode_apply_vs_clone", "{:.4f}"),
    ("enc GB/s", "encode_gbps", "{:.3f}"),
    ("dec GB/s", "decode_apply_gbps", "{:.3f}"),
    ("H xor b", "h_xor_bits", "{:.3f}"),
    ("H ulp b", "h_ulp_bits", "{:.3f}"),
)


def format_table(result: dict[str, object]) -> str:
    """Plain-text report with aligned columns."""
    rows: list[dict[str, object]] = result["rows"]  # type: ignore[assignment]
    cells = [[h for h, _, _ in COLUMNS]]
    cells += [[fmt.format(row[key]) for _, key, fmt in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = [
        f"model {result['size']}: {result['params']:,} bf16 elements "
        f"({cast(int, result['dense_bytes']) / 1e6:.1f} MB dense), warmup {result['warmup_steps']} "
        f"steps, {result['measured_steps']} measured per rate, zstd level {result['zstd_level']}, "
        f"median of {result['reps']} reps, {result['torch_threads']} torch threads",
    ]
    if rows:
        clone = statistics.median(float(r["clone_gbps"]) for r in rows)  # type: ignore[arg-type]
        lines.append(f"torch.clone of the dense bf16 state: {clone:.2f} GB/s")
    lines.append("")
    for i, line in enumerate(cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    goal: dict[str, object] = result["goal"]  # type: ignore[assignment]
    lines += [
        "",
        "B/chg: stored shard bytes per changed element; vs dense: stored / (2 B x elements); "
        "vs bound: stored / entropy bound",
        "pos/bound: position stream bytes / per-tensor H2 bound; val/bound: value streams "
        "zstd'd alone / order-0 XOR entropy",
        "enc/clone, dec+apply/clone: throughput relative to torch.clone of the dense bf16 "
        "bytes (1.0 = as fast, median of per-repetition ratios); enc/dec GB/s: dense bf16 "
        "bytes per second",
        "val b/chg mm7: value streams at the same zstd level with min_match=7; val b/chg huff: "
        "optimal static prefix code of the 16-bit XOR symbols",
        "H xor b / H ulp b: order-0 entropy per changed element of XOR values vs signed "
        "ulp differences",
        "",
        f"goal at {float(goal['target_rate']):.0%} change: vs bound "  # type: ignore[arg-type]
        f"{float(goal['vs_bound']):.3f} (<= {GOAL_VS_BOUND}: "  # type: ignore[arg-type]
        f"{'ok' if goal['vs_bound_ok'] else 'MISSED'}); xor "
        f"{float(goal['xor_saving']):.1%} smaller than overwrite "  # type: ignore[arg-type]
        f"(>= {GOAL_XOR_SAVING:.0%}: {'ok' if goal['xor_saving_ok'] else 'MISSED'})",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small", "medium"))
    parser.add_argument("--steps", type=int, default=None, help="measured steps per rate")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps first")
    parser.add_argument(
        "--reps", type=int, default=None, help="timing repetitions (5; 3 for medium)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps (smoke test)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    size = "tiny" if args.quick else args.size
    steps = args.steps if args.steps is not None else (2 if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else WARMUP)
    reps = args.reps if args.reps is not None else (3 if args.quick or size == "medium" else 5)
    if steps < 1 or warmup < 0 or reps < 1:
        parser.error("--steps and --reps must be >= 1, --warmup >= 0")
    result = run(size=size, steps=steps, warmup=warmup, reps=reps, targets=TARGETS, seed=args.seed)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
