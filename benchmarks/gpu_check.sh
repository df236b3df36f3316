#!/usr/bin/env bash
cd "$(dirname "$0")/.." && exec "${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}" benchmarks/gpu_check.py "$@"
