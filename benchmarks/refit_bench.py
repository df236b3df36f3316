"""End-to-end refit over the JuiceFS S3 gateway: dense checkpoint copy against dcr publish + sync.

A thin entry point: the measurement lives in :mod:`dcr_format.bench.refit`; the
whole suite (local and S3 stores, several sizes, entropy bound, throughput,
relay fan-out, one table and one PNG) is ``dcr bench``.

    .venv/bin/python benchmarks/refit_bench.py [--mb 300] [--json] [--quick]
"""

from __future__ import annotations

from dcr_format.bench.refit import (  # noqa: F401 (re-exported for callers of this script)
    RATES,
    SyntheticTrainer,
    dense_refit,
    lr_for,
    main,
    model_shapes,
    refit_series,
)

if __name__ == "__main__":
    raise SystemExit(main())
