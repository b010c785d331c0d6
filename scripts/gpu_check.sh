#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, from the repository root: the GPU-only tests, then ONNX's
# backend suite on the cuda backend (plain, and through optimized engines). Logs go to $OUT (or
# ./gpu-logs); a summary is printed. About 3 minutes on an H200.
set -uo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-gpu-logs}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -X faulthandler -m pytest -q -rf --tb=short --durations=5 -m gpu tests \
    -p no:cacheprovider >"$out/gpu_tests.log" 2>&1
rc=$?
echo "gpu tests (exit $rc; 134 means the process aborted):"
grep -E "^FAILED|^E  |passed|failed|Fatal Python" "$out/gpu_tests.log" | tail -20
for suite in test_onnx_backend_cuda test_onnx_backend_cuda_optimized; do
    python3 -m pytest -q "tests/conformance/$suite.py" -p no:cacheprovider -rf >"$out/$suite.log" 2>&1
    echo "$suite:"
    grep -E "^FAILED|passed|failed" "$out/$suite.log" | tail -20
done
