"""Wall time of ``dcr`` commands, each in a fresh process, beside ``python -c pass``.

Run: ``python benchmarks/cli_bench.py [--mb 50] [--rate 0.01] [--steps 5] [--repeat 7]``.

Reports the median over ``--repeat`` runs of ``python -c pass``, ``dcr --version`` and
``dcr log``, and the median over ``--steps`` steps of a warm ``dcr publish`` and ``dcr pull``
of a bf16 checkpoint of ``--mb`` MB with ``--rate`` of its elements changed per step (the
first publish and pull, which may compile kernels into numba's cache, are not counted).
Each figure is also given over the ``python -c pass`` of the same interpreter, the start-up
every command pays; the goals are checked against those.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DCR = [sys.executable, "-c", "import sys; from dcr_format.cli import main; main(sys.argv[1:])"]
GOALS = {"--version": 0.3, "log": 0.6}  # seconds over `python -c pass`
GOAL_PUBLISH_PULL = 1.5  # seconds, a warm publish and pull together


def _timed(argv: list[str]) -> float:
    started = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(argv[3:])} failed:\n{run.stderr}")
    return elapsed


def _median(argv: list[str], repeat: int) -> float:
    return statistics.median(_timed(argv) for _ in range(repeat))


def _checkpoint(root: Path, mb: float, seed: int):  # type: ignore[no-untyped-def]
    import torch

    numel = int(mb * 1e6) // 2
    per = 1 << 20
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    left, i = numel, 0
    while left > 0:
        n = min(per, left)
        tensors[f"model.layers.{i}.weight"] = (torch.randn(n, generator=gen) * 0.02).to(
            torch.bfloat16
        )
        left -= n
        i += 1
    return tensors


def _step(tensors, rate: float, gen) -> None:  # type: ignore[no-untyped-def]
    import torch

    for t in tensors.values():
        hit = torch.rand(t.numel(), generator=gen) < rate
        # a step that moves the chosen elements by about one bf16 ulp
        t[hit] = (t[hit].float() * (1 + 2**-7)).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="checkpoint size in MB")
    parser.add_argument("--rate", type=float, default=0.01, help="share of elements changed")
    parser.add_argument("--steps", type=int, default=5, help="timed publish+pull steps")
    parser.add_argument("--repeat", type=int, default=7, help="runs of the start-up commands")
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="dcr-cli-bench-") as tmp:
        root = Path(tmp)
        store, ckpt, into = root / "store", root / "ckpt", root / "pulled"
        cache = ["--cache-dir", str(root / "cache")]
        ckpt.mkdir()
        tensors = _checkpoint(root, args.mb, seed=0)
        gen = torch.Generator().manual_seed(1)

        def publish() -> float:
            save_file(tensors, str(ckpt / "model.safetensors"))
            return _timed([*DCR, "publish", str(ckpt), "--store", str(store), *cache])

        def pull() -> float:
            return _timed([*DCR, "pull", "--store", str(store), "--into", str(into)])

        first = publish(), pull()  # the base; may compile kernels into numba's cache
        _step(tensors, args.rate, gen)
        warm = publish(), pull()  # the first delta
        steps = []
        for _ in range(args.steps):
            _step(tensors, args.rate, gen)
            steps.append((publish(), pull()))

        python = _median([sys.executable, "-c", "pass"], args.repeat)
        version = _median([*DCR, "--version"], args.repeat)
        log = _median([*DCR, "log", "--store", str(store)], args.repeat)

    pub = statistics.median(p for p, _ in steps)
    pul = statistics.median(q for _, q in steps)
    both = statistics.median(p + q for p, q in steps)
    print(f"checkpoint: {args.mb:g} MB bf16, {args.rate:.1%} of elements changed per step")
    print(f"python -c pass      {python:7.3f} s")
    rows = [("dcr --version", version, GOALS["--version"]), ("dcr log", log, GOALS["log"])]
    for name, seconds, goal in rows:
        over = seconds - python
        mark = "ok" if over <= goal else "OVER"
        print(f"{name:<19} {seconds:7.3f} s  (+{over:.3f} s over python; goal +{goal} s: {mark})")
    print(f"first publish+pull  {first[0]:7.3f} + {first[1]:.3f} s (base; kernels may compile)")
    print(f"first delta         {warm[0]:7.3f} + {warm[1]:.3f} s")
    mark = "ok" if both <= GOAL_PUBLISH_PULL else "OVER"
    print(
        f"warm publish+pull   {pub:7.3f} + {pul:.3f} s, together {both:.3f} s "
        f"(median of {args.steps}; goal {GOAL_PUBLISH_PULL} s: {mark})"
    )


if __name__ == "__main__":
    main()
