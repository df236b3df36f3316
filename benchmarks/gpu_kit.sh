#!/usr/bin/env bash
# The GPU checks, for a CUDA machine that has PyTorch, Triton and numba but no network.
#
#   benchmarks/gpu_kit.sh wheels        on a machine with pip's network: the wheels dcr-format
#                                       needs beyond such an image (pydantic, zstandard,
#                                       constriction; CPython 3.12, x86-64 Linux, or the
#                                       version PYTHON_VERSION names) into .whl/
#   benchmarks/gpu_kit.sh run OUTDIR    on the CUDA machine, from the repository's root: those
#                                       wheels installed into a scratch folder, then
#                                       1. benchmarks/gpu_check.py (kernels against a device
#                                          copy, bit-exactness): OUTDIR/gpu_check.json
#                                       2. the test cases that need CUDA: OUTDIR/cuda_tests.log
#                                       3. the steady benchmark on CUDA tensors (a 2 GB model,
#                                          1% and 5%): OUTDIR/steady_cuda.json, and the costs
#                                          `dcr project --costs` takes: OUTDIR/costs_cuda.json,
#                                          with the 1T projection they give in OUTDIR/run.log
#                                       4. the pause of a prepared update on CUDA tensors
#                                          against a dense copy (the 28M model at 3%, a
#                                          206M one at 1%): OUTDIR/run.log
#
# Each step's output also goes to OUTDIR/run.log; a step that fails does not stop the next.
# Versions are those of this checkout's .venv where it has them (what CI tests), else pip's
# newest that the pins in pyproject.toml allow. Exit status: 0 when every step passed.
set -u
cd "$(dirname "$0")/.."

# dcr-format's dependencies such an image holds (tests/test_gpu_kit.py checks that these and
# the wheels below cover pyproject.toml's), and the wheels it needs besides
IMAGE=(torch numpy safetensors fsspec click tqdm numba)
WHEELS=(pydantic pydantic-core annotated-types typing-inspection zstandard constriction)

pinned() {  # NAME: NAME==VERSION as .venv has it, else NAME
    local version
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null)
    if [ -n "$version" ]; then echo "$1==$version"; else echo "$1"; fi
}

case "${1:-}" in
wheels)
    mkdir -p .whl
    grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    for name in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: \
            --python-version "${PYTHON_VERSION:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$(pinned "$name")" || exit 1
    done
    ls .whl
    ;;
run)
    out=${2:?"usage: $0 run OUTDIR"}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/dcr-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/dcr-site:$PWD" PYTHONUNBUFFERED=1
    status=0
    step() {  # NAME COMMAND...: run it, its output into the log
        echo "== $1" | tee -a "$out/run.log"
        local started=$SECONDS
        shift
        "$@" 2>&1 | tee -a "$out/run.log"
        local rc=${PIPESTATUS[0]}
        echo "== rc=$rc in $((SECONDS - started)) s" | tee -a "$out/run.log"
        [ "$rc" -eq 0 ] || status=1
    }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$out/run.log" 2>&1
    step "kernels" sh -c "python3 benchmarks/gpu_check.py --json > '$out/gpu_check.json'"
    step "cuda tests" sh -c "python3 -m pytest -q -p no:cacheprovider -W default \
        tests/test_fingerprint.py tests/test_kernels.py tests/test_backend.py \
        > '$out/cuda_tests.log' 2>&1; rc=\$?; tail -5 '$out/cuda_tests.log'; exit \$rc"
    step "steady on cuda" python3 benchmarks/steady_bench.py --device cuda --mb 2000 \
        --rates 0.01,0.05 --steps 2 --stores local --links '' --json "$out/steady_cuda.json" \
        --save-costs "$out/costs_cuda.json"
    step "projection with those costs" python3 -c \
        "import sys; from dcr_format.cli.main import main; main(sys.argv[1:])" project \
        --params 1T --change 3% --rollout-nodes 64 --link-gbps 5 --costs "$out/costs_cuda.json"
    step "pause on cuda, 28M at 3%" python3 benchmarks/pause_bench.py --device cuda \
        --steps 9 --fraction 0.03 --hidden 512 --ff 1408 --vocab 16000
    step "pause on cuda, 206M at 1%" python3 benchmarks/pause_bench.py --device cuda \
        --steps 5 --fraction 0.01 --layers 12 --hidden 1024 --ff 2816 --vocab 32000
    exit $status
    ;;
*)
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"
    exit 2
    ;;
esac
