#!/usr/bin/env bash
# On a Hopper GPU, from the repository root: the 8-bit convolution kernels' checks and times, then
# ResNet-50's INT8 and FP8 engines against PyTorch (#14's target). Each step runs under its own
# time limit, so that a kernel that hangs or faults costs its step only; logs go to $OUT (or
# ./gpu-logs), and each step's last lines are printed.
#
#   scripts/gpu_quant_round.sh check    # GPU tests: CUTLASS kernels first, then the stem kernels,
#                                       # the stem-pool layer and the pools, a quantized ResNet
#                                       # stage's engine (and benchmarks/qconv_stem.py); at most
#                                       # 580 s
#   scripts/gpu_quant_round.sh stem     # the stem kernel's and the pools' part of check alone (no
#                                       # kernel library needed: while a new checkout builds one)
#   scripts/gpu_quant_round.sh check_more  # the other 8-bit GPU tests, then Gluon's
#   scripts/gpu_quant_round.sh time     # benchmarks/qconv_3x3.py: 8-bit 3x3 kernels vs cuDNN fp16
#   scripts/gpu_quant_round.sh models   # ResNet-50, every layer quantized (--quantize-all), alone
#   scripts/gpu_quant_round.sh choice   # ResNet-50 with the per-layer precision choice, alone
#   scripts/gpu_quant_round.sh int8     # ResNet-50's INT8 engine alone (every layer quantized),
#                                       # the GPU's clocks, power and throttle reasons logged
#                                       # every 2 s beside it (clocks.csv)
#   scripts/gpu_quant_round.sh compare  # the target's run: both 8-bit engines and the best PyTorch
#                                       # (eager channels-last, and torch.compile's three modes)
#                                       # in one process, on the same inputs; max-autotune right
#                                       # after eager (its compile the longest, about 270 s, and
#                                       # the best PyTorch figure for ResNet-50 so far), default
#                                       # compile last, so that a call's time limit cuts the
#                                       # mode that has never been the best
#
# Engine builds stop at a tactic that runs past --tactic-timeout (150 s here; the first compile
# of a kernel included), naming it, with the timing cache saved: rerun with
# `--tactic-exclude NAME` (or the library built without it) rather than losing the call's time.
# A new checkout has no kernel library: build it first (scripts/build_cutlass_library.sh).
# compare leaves torch.compile's caches in $OUT/inductor.tgz (where they fit in 16 MiB): copied
# to build/ and carried, the next compare call starts from them.
#
# Arguments after the step's name go to its benchmark (time, models, choice, compare), for
# example `models --tactic-sources triton,cutlass,cudnn,cublas,cublaslt` to leave Gluon out.
# The CUTLASS kernel library (benchmarks/cutlass_gemm_build.py) is read from
# $TENSORKILN_CUTLASS_KERNELS (default build/cutlass_rt). QUANT_ROUND_LIMIT scales every step's
# limit (default 1.0).
set -uo pipefail
part=${1:-check}
shift || true
extra=("$@")
case "$part" in check | stem | check_more | time | models | choice | int8 | compare) ;; *)
    echo "usage: $0 check|stem|check_more|time|models|choice|int8|compare" >&2
    exit 2
    ;;
esac
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TENSORKILN_CUTLASS_KERNELS=${TENSORKILN_CUTLASS_KERNELS:-build/cutlass_rt}
out=${OUT:-gpu-logs}
scale=${QUANT_ROUND_LIMIT:-1.0}
mkdir -p "$out"
if [ "$part" != stem ] && [ ! -f "$TENSORKILN_CUTLASS_KERNELS/manifest.json" ]; then
    echo "no kernel library at $TENSORKILN_CUTLASS_KERNELS (build it with" \
        "scripts/build_cutlass_library.sh, or set TENSORKILN_CUTLASS_KERNELS)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader

# step NAME SECONDS COMMAND...: run COMMAND under a limit, its output in $out/NAME.log
step() {
    local name=$1 limit
    limit=$(awk -v s="$2" -v f="$scale" 'BEGIN { printf "%d", s * f }')
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    local how="exit $rc"
    [ $rc -eq 124 ] && how="TIMED OUT after ${limit}s"
    [ $rc -eq 3 ] && how="STOPPED at a tactic that did not finish (exit 3)"
    echo "== $name: $how, $((SECONDS - t0)) s"
    grep -E "^FAILED|Fatal Python|Error|did not finish within" "$out/$name.log" | head -5
    tail -4 "$out/$name.log"
}

# (the Triton kernels' own tests are not marked gpu: they run on CUDA tensors where there is one)
pytest=(python3 -X faulthandler -m pytest -q -rf --tb=short -p no:cacheprovider)
case "$part" in
check)
    # the residual kernels (padded rows, two buffers) and the conv kernels first, alone: a fault
    # or a hang ends this process only; then the stem kernel and the pools
    step cutlass_conv 200 "${pytest[@]}" -x -m gpu tests/gpu/test_cutlass_fp8_gpu.py \
        -k "residual or implicit or pointwise or promoted or strided"
    ;&
stem)
    # (the stem kernels, the stem-pool layer's tactics, the pools; then a quantized ResNet
    # stage's engine, its stem and pool one layer, and replays on the graph's own inputs)
    step stem 160 "${pytest[@]}" tests/kernels/triton/test_quant_tactics.py -k stem \
        tests/kernels/triton/test_pool.py
    step engine 100 "${pytest[@]}" -m gpu tests/gpu/test_quant_gpu.py \
        tests/gpu/test_cuda_engine.py -k "resnet_stage or input_buffers"
    step stem_time 120 python3 benchmarks/qconv_stem.py --reps 10
    ;;
check_more)
    step quant 300 "${pytest[@]}" tests/kernels/triton/test_quant_tactics.py \
        tests/kernels/triton/test_quantize.py tests/gpu/test_cutlass_fp8_gpu.py \
        tests/gpu/test_quant_gpu.py
    step gluon 240 "${pytest[@]}" -m gpu tests/kernels/triton/test_conv_gluon.py
    ;;
time)
    step qconv_3x3 560 python3 benchmarks/qconv_3x3.py --kernels tma,gluon,cutlass --reps 10 \
        "${extra[@]}"
    ;;
models)
    step resnet50_quantize_all 580 python3 benchmarks/gpu_models.py --models resnet50 \
        --batch large --peers tensorkiln-fp8,tensorkiln-int8 --quantize-all --kernels 25 \
        --layers 60 --tactic-timeout 150 "${extra[@]}"
    ;;
choice)
    step resnet50_choice 580 python3 benchmarks/gpu_models.py --models resnet50 --batch large \
        --peers tensorkiln-fp8,tensorkiln-int8 --kernels 25 --tactic-timeout 150 "${extra[@]}"
    ;;
int8)
    # (INT8's tactics timed 1.4-14x their FP8 twins in one build on an H100, on NCHW inputs:
    # int8 weights were held NCHW, now channels-last; the clocks beside the build show whether
    # the card's speed held as well)
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 2000 >"$out/clocks.csv" 2>&1 &
    smi=$!
    step resnet50_int8 560 python3 benchmarks/gpu_models.py --models resnet50 --batch large \
        --peers tensorkiln-int8 --quantize-all --kernels 25 --tactic-timeout 150 "${extra[@]}"
    kill "$smi" 2>/dev/null
    sort -t, -k2 -n "$out/clocks.csv" | head -3
    ;;
compare)
    # torch.compile's caches (Inductor's compiled graphs, Triton's kernels, max-autotune's
    # choices) from an earlier call, carried as build/inductor.tgz: the compiles then mostly
    # hit them (max-autotune-no-cudagraphs alone compiled for about 270 s cold)
    inductor=/tmp/tensorkiln-bench-inductor
    if [ -f build/inductor.tgz ] && [ ! -d "$inductor" ]; then
        tar xzf build/inductor.tgz -C /tmp && echo "Inductor cache: build/inductor.tgz"
    fi
    step resnet50_compare 570 python3 benchmarks/gpu_models.py --models resnet50 --batch large \
        --peers tensorkiln-fp8,tensorkiln-int8,eager,max-autotune,reduce-overhead,compile \
        --quantize-all --tactic-timeout 150 --inductor-cache "$inductor" "${extra[@]}"
    # (back through $OUT for the next call's carry, where it fits a returned file's 16 MiB)
    if [ -d "$inductor" ] && timeout 20 tar czf "$out/inductor.tgz" -C /tmp "${inductor#/tmp/}"; then
        bytes=$(stat -c %s "$out/inductor.tgz")
        echo "Inductor cache: $bytes bytes in $out/inductor.tgz"
        [ "$bytes" -le $((16 * 1024 * 1024)) ] || rm -f "$out/inductor.tgz"
    fi
    ;;
esac
