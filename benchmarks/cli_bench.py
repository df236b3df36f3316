"""Wall time of ``dcr`` commands, each in a fresh process, beside ``python -c pass``.

Run: ``python benchmarks/cli_bench.py [--mb 50] [--rate 0.01] [--steps 5] [--repeat 7]``.

Reports the median over ``--repeat`` runs of ``python -c pass``, ``dcr --version`` and
``dcr log``, and the median over ``--steps`` steps of a warm ``dcr publish`` and ``dcr pull``
of a bf16 checkpoint of ``--mb`` MB with ``--rate`` of its elements changed per step (the
first publish and pull, which may compile kernels into numba's cache, are not counted).
Each figure is also given over the ``python -c pass`` of the same interpreter, the start-up
every command pays; the goals are checked against those. Beside each wall time, the CPU
time (user + system, every thread) the command used: on a machine other work keeps busy,
that is the steadier figure.

With ``--breakdown``, where a warm publish and pull spend their CPU time: the start-up
pieces, each in a fresh process as the command runs them (the interpreter, torch with numpy
and the package's modules the command imports, with the garbage collector off and frozen
after, then numba's import and its first-use setup), the compiled kernels loaded from
numba's on-disk cache (how many, and their time), and the work alone (a publish and pull of
one more step in a process that already ran one, so nothing is imported or loaded).

The commands run with Python's bytecode caches as an installed package has them:
``PYTHONDONTWRITEBYTECODE`` is dropped from their environment, so the first command writes
the caches of a source checkout and the others read them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DCR = [sys.executable, "-c", "import sys; from dcr_format.cli.main import main; main(sys.argv[1:])"]
GOALS = {"--version": 0.3, "log": 0.6}  # seconds over `python -c pass`
GOAL_PUBLISH_PULL = 1.5  # seconds, a warm publish and pull together


_CPU: list[float] = []  # CPU seconds of each command run, in order
# the commands' environment: bytecode caches written and read (module docstring)
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(argv: list[str]) -> float:
    """Wall seconds of one run of ``argv`` (its CPU seconds are appended to ``_CPU``)."""
    cpu = _children_cpu()
    started = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, env=_ENV)
    elapsed = time.perf_counter() - started
    _CPU.append(_children_cpu() - cpu)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(argv[3:])} failed:\n{run.stderr}")
    return elapsed


def _median(argv: list[str], repeat: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``repeat`` runs."""
    walls = [_timed(argv) for _ in range(repeat)]
    return statistics.median(walls), statistics.median(_CPU[-repeat:])


# Run in a child process (argv: ckpt store cache into seed rate steps): a publish and a pull
# of the checkpoint as saved, then of ``steps`` more steps in the same process; prints JSON:
# each run's wall and CPU seconds, the kernels each loaded from numba's cache with their
# seconds, the seconds numba's first-use setup took, and the package modules the commands
# imported.
_PROBE = """
import json, os, sys, threading, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `dcr` sets it, before OpenMP loads
sys.path.insert(0, {here!r})
ckpt, store, cache, into, seed, rate, steps = sys.argv[1:8]
import cli_bench, torch
from safetensors.torch import load_file, save_file
import numba.core.caching
from numba.core.registry import cpu_target
began = time.process_time()
cpu_target.typing_context.refresh()
cpu_target.target_context.refresh()
setup = time.process_time() - began
loads, lock, original = [], threading.Lock(), numba.core.caching.Cache.load_overload
def load_overload(self, sig, target_context):
    began = time.perf_counter()
    try:
        return original(self, sig, target_context)
    finally:
        with lock:
            loads.append((self._py_func.__qualname__, time.perf_counter() - began))
numba.core.caching.Cache.load_overload = load_overload
from dcr_format.cli.main import main
def run(*argv):
    del loads[:]
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        main(list(argv))
    except SystemExit as exc:
        if exc.code:
            raise
    return {{"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
            "loads": list(loads)}}
publish = ("publish", ckpt, "--store", store, "--cache-dir", cache)
pull = ("pull", "--store", store, "--into", into)
first = [run(*publish), run(*pull)]
tensors, again = load_file(ckpt + "/model.safetensors"), []
gen = torch.Generator().manual_seed(int(seed))
for _ in range(int(steps)):
    cli_bench._step(tensors, float(rate), gen)
    save_file(tensors, ckpt + "/model.safetensors")
    again.append([run(*publish), run(*pull)])
modules = sorted(m for m in sys.modules if m.startswith("dcr_format."))
print(json.dumps({{"first": first, "again": again, "setup": setup, "modules": modules}}))
"""


def _imports_numba(module: str) -> bool:
    """Whether a module of the package imports numba: the compiled kernels (the codings'
    ``_<coding>_kernels`` among them) and how they run."""
    name = module.rsplit(".", 1)[1]
    return name in ("_launch", "_native_bits") or (
        name.endswith("_kernels") and "triton" not in name
    )


_SETUP = (
    "from numba.core.registry import cpu_target; "
    "cpu_target.typing_context.refresh(); cpu_target.target_context.refresh()"
)


def _breakdown(
    ckpt: Path, store: Path, cache: Path, into: Path, rate: float, repeat: int, tensors
) -> list[str]:  # type: ignore[no-untyped-def]
    """Lines saying where a warm publish and pull spend their CPU time (module docstring)."""
    import torch
    from safetensors.torch import save_file

    _step(tensors, rate, torch.Generator().manual_seed(2))
    save_file(tensors, str(ckpt / "model.safetensors"))
    code = _PROBE.format(here=str(Path(__file__).resolve().parent))
    argv = [sys.executable, "-c", code, str(ckpt), str(store), str(cache), str(into), "3"]
    run = subprocess.run([*argv, str(rate), str(repeat)], capture_output=True, text=True, env=_ENV)
    if run.returncode != 0:
        raise SystemExit(f"the in-process probe failed:\n{run.stderr}")
    probe = json.loads(run.stdout.splitlines()[-1])
    modules = ", ".join(m for m in probe["modules"] if not _imports_numba(m))
    kernels = ", ".join(m for m in probe["modules"] if _imports_numba(m))
    # as cli.main.command_imports runs them; each piece freezes what it imported, as the
    # command does, so that no piece pays a collection at exit the command does not
    imports = "import gc; gc.disable(); import torch"
    imported = f"{imports}; import {modules}; gc.freeze(); gc.enable()"
    pieces = [
        ("python -c pass", "pass"),
        ("+ torch, numpy", f"{imports}; gc.freeze()"),
        ("+ the package's modules", imported),
        ("+ numba, the kernel modules", f"{imported}; import numba, {kernels}"),
        ("+ numba's setup", f"{imported}; import numba, {kernels}; {_SETUP}"),
    ]
    runs: list[list[float]] = [[] for _ in pieces]
    for _ in range(repeat):  # rounds over the pieces: other work's load falls on all alike
        for piece, cpu in zip(pieces, runs, strict=True):
            _timed([sys.executable, "-c", piece[1]])
            cpu.append(_CPU[-1])
    cpus = [min(cpu) for cpu in runs]  # the least of several runs: the cost without noise
    lines = [
        "where a warm publish and pull spend their CPU (start-up pieces: fresh processes, the",
        f"least of {repeat} runs; '+' rows: what each adds to the row above; both commands",
        "import the same pieces but for a few of the package's modules):",
    ]
    before = 0.0
    for (name, _), cpu in zip(pieces, cpus, strict=True):
        lines.append(f"  {name:<34}{cpu - before:7.3f}s")
        before = cpu
    lines.append(f"  {'start-up before the command runs':<34}{cpus[-1]:7.3f}s")
    for i, name in enumerate(("publish", "pull")):
        loads = probe["first"][i]["loads"]
        slowest = max(loads, key=lambda load: load[1]) if loads else ("-", 0.0)
        cpu = statistics.median(step[i]["cpu"] for step in probe["again"])
        wall = statistics.median(step[i]["wall"] for step in probe["again"])
        lines.append(
            f"  {name}: {len(loads)} kernels loaded from numba's cache in "
            f"{sum(s for _, s in loads):.3f} s wall (slowest {slowest[0]}: {slowest[1]:.3f} s); "
            f"the work alone {cpu:.3f} s cpu, {wall:.3f} s wall (median of {repeat} steps)"
        )
    lines.append(f"  numba's first-use setup, in process: {probe['setup']:.3f} s cpu")
    return lines


def _checkpoint(mb: float, seed: int):  # type: ignore[no-untyped-def]
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
    parser.add_argument(
        "--breakdown", action="store_true", help="also where a publish and pull spend their time"
    )
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="dcr-cli-bench-") as tmp:
        root = Path(tmp)
        store, ckpt, into = root / "store", root / "ckpt", root / "pulled"
        cache = ["--cache-dir", str(root / "cache")]
        ckpt.mkdir()
        tensors = _checkpoint(args.mb, seed=0)
        gen = torch.Generator().manual_seed(1)

        def publish() -> tuple[float, float]:
            save_file(tensors, str(ckpt / "model.safetensors"))
            wall = _timed([*DCR, "publish", str(ckpt), "--store", str(store), *cache])
            return wall, _CPU[-1]

        def pull() -> tuple[float, float]:
            wall = _timed([*DCR, "pull", "--store", str(store), "--into", str(into)])
            return wall, _CPU[-1]

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
        breakdown = []
        if args.breakdown:
            cache_dir = root / "cache"
            breakdown = _breakdown(ckpt, store, cache_dir, into, args.rate, args.repeat, tensors)

    def median(values: list[float]) -> float:
        return statistics.median(values)

    pub = median([p[0] for p, _ in steps]), median([p[1] for p, _ in steps])
    pul = median([q[0] for _, q in steps]), median([q[1] for _, q in steps])
    both = median([p[0] + q[0] for p, q in steps]), median([p[1] + q[1] for p, q in steps])
    print(f"checkpoint: {args.mb:g} MB bf16, {args.rate:.1%} of elements changed per step")
    print(f"{'':<20}{'wall':>8}  {'cpu':>7}")
    print(f"{'python -c pass':<20}{python[0]:7.3f}s  {python[1]:6.3f}s")
    rows = [("dcr --version", version, GOALS["--version"]), ("dcr log", log, GOALS["log"])]
    for name, (wall, cpu), goal in rows:
        over = wall - python[0]
        mark = "ok" if over <= goal else "OVER"
        print(
            f"{name:<20}{wall:7.3f}s  {cpu:6.3f}s  (+{over:.3f} s over python; goal "
            f"+{goal} s: {mark})"
        )
    for name, (p, q) in (("first publish, pull", first), ("first delta", warm)):
        print(f"{name:<20}{p[0]:7.3f}s + {q[0]:.3f}s wall, {p[1]:.3f}s + {q[1]:.3f}s cpu")
    mark = "ok" if both[0] <= GOAL_PUBLISH_PULL else "OVER"
    print(
        f"{'warm publish, pull':<20}{pub[0]:7.3f}s + {pul[0]:.3f}s wall, together "
        f"{both[0]:.3f}s (goal {GOAL_PUBLISH_PULL} s: {mark}); cpu {pub[1]:.3f}s + "
        f"{pul[1]:.3f}s (median of {args.steps} steps)"
    )

    if breakdown:
        print("\n".join(breakdown))


if __name__ == "__main__":
    main()
