"""Steady-state refit: a long-lived writer and readers, medians of several steps, over copy_.

A thin entry point: the measurement lives in :mod:`dcr_format.bench.steady`.

    .venv/bin/python benchmarks/steady_bench.py [--mb 1000] [--steps 5] [--links 1,5] [--quick]
"""

from __future__ import annotations

from dcr_format.bench.steady import main

if __name__ == "__main__":
    raise SystemExit(main())
