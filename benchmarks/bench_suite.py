"""The refit benchmark suite (what ``dcr bench`` runs), for a checkout without the command.

.venv/bin/python benchmarks/bench_suite.py [--quick] [--sizes 100,300,1000] [--png FILE]
"""

from __future__ import annotations

from dcr_format.cli.bench import bench

if __name__ == "__main__":
    bench(prog_name="bench_suite.py")
