"""Compiled (numba) CPU loops against the numpy/torch reference they replace.

    .venv/bin/python benchmarks/native_bench.py [--elements 67108864] [--repeats 5]

Measures, on a bf16 tensor of ``--elements`` elements, interleaving the variants of
each measurement and reporting medians:

- Rice encode and decode, ns per changed element, at 1% change (reference numpy vs
  compiled), and ``encode_positions`` (both codings built vs one planned pass);
- the full fingerprint pass (``tensor_lanes``), as a ratio to ``copy_`` of the same
  bytes into a preallocated buffer (torch reference vs compiled);
- ``dispatch.diff`` at 1% and 5% change (torch reference vs the fused pass), and
  ``diff_with_lanes`` (the fused pass with the lane deltas) against the reference
  diff followed by ``lanes_after_change``;
- applying the change: ``reference.scatter`` + ``lanes_after_change`` vs the fused
  ``apply_with_lanes``;
- ``classed`` positions (FORMAT.md §6.5) at 1% and 5%, as ratios to ``copy_``: a writer's
  stream from kept exponent rows (``encode_classed_counted``: the rank pass over every
  element) and a reader's decode with kept rows (``decode_classed``: the select pass);
  with ``--threads 1`` and then more, how the passes scale with cores against ``copy_``.

Warm-up calls compile the kernels (or load them from numba's cache) before timing.
``--threads N`` sets torch's and numba's thread counts; ``--cpu-time`` reports process
CPU time instead of wall time (steadier on a machine shared with other work; with one
thread it is the single-core cost).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from dcr_format.codings import classed
from dcr_format.codings import positions as pc
from dcr_format.delta import dispatch
from dcr_format.delta import fingerprint as fp
from dcr_format.kernels import reference
from dcr_format.kernels.native import native_kernels

_CLOCK = time.perf_counter


def _timed(fn: Callable[[], object]) -> float:
    start = _CLOCK()
    fn()
    return _CLOCK() - start


def interleaved(
    variants: dict[str, Callable[[], object]], repeats: int, env: dict[str, str] | None = None
) -> dict[str, float]:
    """Median seconds of each variant, run in turn ``repeats`` times after one warm-up.

    ``env`` maps a variant to the ``DCR_KERNELS`` value it runs under (default ``auto``).
    """
    env = env or {}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(repeats + 1):
        for name, fn in variants.items():
            os.environ["DCR_KERNELS"] = env.get(name, "auto")
            elapsed = _timed(fn)
            if rep:
                times[name].append(elapsed)
    os.environ.pop("DCR_KERNELS", None)
    return {name: statistics.median(values) for name, values in times.items()}


def changed_pair(n: int, rate: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16-shaped int16 bit view and a copy with ``rate`` of its elements changed."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=gen).to(torch.bfloat16).view(torch.int16)
    new = old.clone()
    count = int(n * rate)
    picked = torch.randperm(n, generator=gen)[:count]
    new[picked] ^= torch.randint(1, 1 << 7, (count,), generator=gen, dtype=torch.int16)
    return old, new


def bench_rice(n: int, repeats: int) -> None:
    old, new = changed_pair(n, 0.01, 1)
    positions = reference.diff(old, new, want_new=False, want_xor=False).positions.numpy()
    count = positions.size
    data = pc._encode_rice_reference(positions)
    assert pc.encode_rice(positions) == data
    t = interleaved(
        {
            "encode ref": lambda: pc._encode_rice_reference(positions),
            "encode native": lambda: pc.encode_rice(positions),
            "decode ref": lambda: pc._decode_rice_reference(data, count=count, numel=n),
            "decode native": lambda: pc.decode_rice(data, count=count, numel=n),
            "choose ref": lambda: pc._encode_positions_reference(positions),
            "choose native": lambda: pc.encode_positions(positions),
        },
        repeats,
    )
    per = {name: seconds / count * 1e9 for name, seconds in t.items()}
    print(f"Rice, {count} positions of {n} (1%), ns per changed element:")
    for what in ("encode", "decode", "choose"):
        ref, nat = per[f"{what} ref"], per[f"{what} native"]
        print(f"  {what:7s} reference {ref:7.1f}  native {nat:7.1f}  speed-up {ref / nat:5.1f}x")


def bench_fingerprint(n: int, repeats: int) -> None:
    tensor = changed_pair(n, 0.0, 2)[0].view(torch.bfloat16)
    buffer = torch.empty_like(tensor)
    t = interleaved(
        {
            "copy_": lambda: buffer.copy_(tensor),
            "torch": lambda: fp.tensor_lanes(tensor),
            "native": lambda: fp.tensor_lanes(tensor),
        },
        repeats,
        env={"torch": "torch"},
    )
    copy = t["copy_"]
    print(f"Fingerprint full pass, bf16[{n}] ({2 * n / 1e6:.0f} MB), copy_ {copy * 1e3:.1f} ms:")
    print(f"  torch   {t['torch'] * 1e3:8.1f} ms = {t['torch'] / copy:5.1f}x copy_")
    print(f"  native  {t['native'] * 1e3:8.1f} ms = {t['native'] / copy:5.1f}x copy_")
    print(f"  speed-up {t['torch'] / t['native']:.1f}x")


def bench_diff(n: int, repeats: int, rate: float) -> None:
    old, new = changed_pair(n, rate, 3)

    def torch_lanes() -> None:
        found = reference.diff(old, new)
        fp.lanes_after_change((0, 0), found.positions, old[found.positions], found.new_values)

    found = reference.diff(old, new)
    values = found.xor_values
    target = old.clone()

    def apply_torch() -> None:
        before = reference.scatter(target, found.positions, values, op="xor", save=True)
        fp.lanes_after_change((0, 0), found.positions, before, before ^ values)

    def apply_native() -> None:
        dispatch.apply_with_lanes(target, found.positions, values, op="xor")

    t = interleaved(
        {
            "torch diff": lambda: dispatch.diff(old, new),
            "fused diff": lambda: dispatch.diff(old, new),
            "torch diff+lanes": torch_lanes,
            "fused diff+lanes": lambda: dispatch.diff_with_lanes(old, new),
            "torch apply+lanes": apply_torch,
            "fused apply+lanes": apply_native,
        },
        repeats,
        env={"torch diff": "torch", "torch diff+lanes": "torch", "torch apply+lanes": "torch"},
    )
    print(f"Diff of bf16[{n}] at {rate:.0%} change ({found.changed} elements):")
    for what in ("diff", "diff+lanes", "apply+lanes"):
        ref, nat = t[f"torch {what}"], t[f"fused {what}"]
        print(
            f"  {what:11s} torch {ref * 1e3:8.1f} ms  fused {nat * 1e3:8.1f} ms  "
            f"speed-up {ref / nat:5.1f}x"
        )


def bench_classes(n: int, repeats: int, rate: float) -> None:
    old, new = changed_pair(n, rate, 4)
    found = reference.diff(old, new)
    positions = found.positions.numpy()
    old_bits, new_bits = old.numpy().view("uint16"), new.numpy().view("uint16")
    xor = found.xor_values.numpy().view("uint16")
    rows = classed.exponent_rows(old_bits, "bfloat16")
    stream = classed.encode_classed_counted(
        positions, new_bits, "bfloat16", xor=xor, rows=rows
    ).stream
    decoded = classed.decode_classed(
        stream, old_bits, "bfloat16", count=positions.size, numel=n, rows=rows
    )
    if not (decoded == positions).all():
        raise SystemExit("classed positions did not decode to the positions coded")
    source = old.view(torch.bfloat16)
    buffer = torch.empty_like(source)
    t = interleaved(
        {
            "copy_": lambda: buffer.copy_(source),
            "encode": lambda: classed.encode_classed_counted(
                positions, new_bits, "bfloat16", xor=xor, rows=rows
            ),
            "decode": lambda: classed.decode_classed(
                stream, old_bits, "bfloat16", count=positions.size, numel=n, rows=rows
            ),
        },
        repeats,
    )
    copy = t["copy_"]
    print(
        f"Classed positions of bf16[{n}] at {rate:.0%} ({positions.size} changed, "
        f"{len(stream) * 8 / positions.size:.2f} bits each), copy_ {copy * 1e3:.1f} ms:"
    )
    for what in ("encode", "decode"):
        print(f"  {what:7s} {t[what] * 1e3:8.1f} ms = {t[what] / copy:5.2f}x copy_")


def main() -> None:
    """Run every measurement and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 26)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch and numba threads")
    parser.add_argument("--cpu-time", action="store_true", help="process CPU time, not wall")
    args = parser.parse_args()
    if native_kernels() is None:
        raise SystemExit("numba is not installed (or DCR_KERNELS=torch): nothing to compare")
    import numba

    global _CLOCK
    if args.cpu_time:
        _CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    clock = "CPU time" if args.cpu_time else "wall time"
    print(f"{clock}; torch threads {torch.get_num_threads()}, numba threads ", end="")

    print(numba.get_num_threads(), f"of {os.cpu_count()} CPUs")
    bench_rice(args.elements, args.repeats)
    bench_fingerprint(args.elements, args.repeats)
    for rate in (0.01, 0.05):
        bench_diff(args.elements, args.repeats, rate)
    for rate in (0.01, 0.05):
        bench_classes(args.elements, args.repeats, rate)
    print(f"numba threading layer: {numba.threading_layer()}")


if __name__ == "__main__":
    main()
