#!/usr/bin/env bash
# Build the CUTLASS kernel library that the cutlass tactics load (benchmarks/cutlass_gemm_build.py)
# on a machine without a GPU: the CuTe DSL into its own folder (pip --target, kept out of the
# project's environment), then every kernel compiled ahead of time for sm_90a (about 7 minutes
# on two cores). The library is a build output, not part of the repository: build it in a new
# checkout before a GPU round, and carry build/cutlass_rt there.
#
#   scripts/build_cutlass_library.sh EXAMPLE [OUT]   # (OUT.work: the build's intermediates)
#
# EXAMPLE: CUTLASS's examples/python/CuTeDSL/cute/hopper/kernel/dense_gemm/
# dense_gemm_fp8_gelu_persistent.py (github.com/NVIDIA/cutlass; the figures in
# benchmarks/RESULTS.md are of commit 7107b0553, whose text the build's patches match), for example
#   git -C cutlass show 7107b0553:examples/python/CuTeDSL/cute/hopper/kernel/dense_gemm/dense_gemm_fp8_gelu_persistent.py > /tmp/example.py
# OUT: the library's folder (default build/cutlass_rt). CUTE_DSL_DIR: where the DSL is installed
# (default /tmp/cute-dsl); CUTE_DSL_VERSION: its version (default 4.8.1). Further arguments to
# the build go in CUTLASS_BUILD_ARGS (for example "--residual-tiles=" to leave out the
# two-buffer residual kernels).
set -euo pipefail
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
    echo "usage: $0 EXAMPLE [OUT]  (EXAMPLE: CUTLASS's dense_gemm_fp8_gelu_persistent.py)" >&2
    exit 2
fi
example=$1
out=${2:-build/cutlass_rt}
dsl=${CUTE_DSL_DIR:-/tmp/cute-dsl}
version=${CUTE_DSL_VERSION:-4.8.1}
if [ ! -d "$dsl/nvidia_cutlass_dsl" ]; then
    echo "installing nvidia-cutlass-dsl $version into $dsl"
    python -m pip install -q --target "$dsl" "nvidia-cutlass-dsl[cu13]==$version"
fi
# (the build's sources, headers and objects in OUT.work; OUT gets what the tactics load: the
# shared library and its manifest, about 18 MB, which is what a GPU machine needs carried)
work=$out.work
mkdir -p "$work" "$out"
# shellcheck disable=SC2086  # (CUTLASS_BUILD_ARGS: several arguments)
PYTHONPATH="$dsl:$dsl/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}" \
    python benchmarks/cutlass_gemm_build.py --kernel "$example" --out "$work" ${CUTLASS_BUILD_ARGS:-}
python - "$work" "$out" <<'EOF'
import json, shutil, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
manifest = json.loads((work / "manifest.json").read_text())
for name in ("manifest.json", manifest["library"]):
    shutil.copy2(work / name, out / name)
size = sum((out / n).stat().st_size for n in ("manifest.json", manifest["library"]))
print(f"{out}: {len(manifest['kernels'])} kernels, {size / 1e6:.1f} MB")
EOF
