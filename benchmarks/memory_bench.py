"""Peak memory of a publish and of a sync, beyond the caller's own tensors.

A thin entry point: the measurement lives in :mod:`dcr_format.bench.memory`.

    .venv/bin/python benchmarks/memory_bench.py [--mb 256] [--rate 0.01] [--features LIST]
"""

from __future__ import annotations

from dcr_format.bench.memory import main

if __name__ == "__main__":
    raise SystemExit(main())
