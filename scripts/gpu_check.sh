#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, from the repository root: the GPU-only tests file by file (each
# under its own time limit, so one slow file cannot hide the others' results), then ONNX's backend
# suite on the cuda backend (plain, and through optimized engines). Logs go to $OUT (or
# ./gpu-logs); a summary is printed. GPU_CHECK_LIMIT sets the seconds per test file (120).
# `gpu_check.sh tests` runs only the test files, `gpu_check.sh conformance` only the suites;
# GPU_CHECK_SHARD=1/2 (then 2/2) runs half of the files.
set -uo pipefail
part=${1:-all}
case "$part" in all | tests | conformance) ;; *) echo "usage: $0 [all|tests|conformance]" >&2; exit 2 ;; esac
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-gpu-logs}
limit=${GPU_CHECK_LIMIT:-120}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
files=""
if [ "$part" != conformance ]; then
    files=$(python3 -m pytest -q -m gpu --collect-only tests -p no:cacheprovider 2>/dev/null \
        | grep "::" | cut -d: -f1 | sort -u)
    # the Triton kernels' own tests, which run on CUDA tensors where there is a GPU
    files="$files tests/kernels/triton/test_quantize.py tests/kernels/triton/test_quant_tactics.py"
fi
# GPU_CHECK_SHARD=i/n: only every n-th file from the i-th (1-based), to split the run
if [ -n "${GPU_CHECK_SHARD:-}" ]; then
    i=${GPU_CHECK_SHARD%/*} n=${GPU_CHECK_SHARD#*/}
    if ! [[ "$i" =~ ^[1-9][0-9]*$ && "$n" =~ ^[1-9][0-9]*$ ]] || [ "$i" -gt "$n" ]; then
        echo "GPU_CHECK_SHARD must be i/n with 1 <= i <= n, not '$GPU_CHECK_SHARD'" >&2
        exit 2
    fi
    files=$(echo $files | tr ' ' '\n' | awk -v i="$i" -v n="$n" 'NR % n == i % n')
fi
for f in $files; do
    log="$out/$(echo "$f" | tr '/' '_' | sed 's/\.py$//').log"
    timeout "$limit" python3 -X faulthandler -m pytest -q -rf --tb=short "$f" \
        -p no:cacheprovider >"$log" 2>&1
    rc=$?
    summary=$(grep -E "passed|failed|error" "$log" | tail -1)
    [ $rc -eq 124 ] && summary="TIMED OUT after ${limit}s (see $log)"
    echo "$f: ${summary:-exit $rc}"
    grep -E "^FAILED|Fatal Python" "$log" | head -5
done
suites="test_onnx_backend_cuda test_onnx_backend_cuda_optimized"
[ "$part" = tests ] && suites=""
# run from the source tree, the project's declared dependencies are not installed for it; the one
# the suites need beyond what a GPU image usually has is RE2 (RegexFullMatch)
if [ -n "$suites" ] && ! python3 -c "import re2" 2>/dev/null; then
    echo "note: google-re2 (a dependency in pyproject.toml) is not importable here, so the" \
        "suites' test_regex_full_match_* cases will fail; pip install google-re2 first" >&2
fi
for suite in $suites; do
    python3 -m pytest -q "tests/conformance/$suite.py" -p no:cacheprovider -rf >"$out/$suite.log" 2>&1
    echo "$suite:"
    grep -E "^FAILED|passed|failed" "$out/$suite.log" | tail -20
done
