"""Codec benchmark: size and speed of real per-step deltas against their entropy bound.

A thin entry point: the measurement lives in :mod:`dcr_format.bench.codec`
(shared with ``dcr bench``).

    .venv/bin/python benchmarks/codec_bench.py [--size medium] [--quick] [--json]
"""

from __future__ import annotations

from dcr_format.bench.codec import (  # noqa: F401 (re-exported for callers of this script)
    COLUMNS,
    TARGETS,
    entropy_bound,
    format_table,
    main,
    measure_speed,
    measure_step,
    run,
)

if __name__ == "__main__":
    raise SystemExit(main())
