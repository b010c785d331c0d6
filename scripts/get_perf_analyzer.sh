#!/bin/bash
# Fetch Triton's perf_analyzer (the C++ load generator) and the two libraries it needs into a
# folder, from the package registries alone: the binary ships in tritonclient 2.41.0's Linux
# wheel, libb64 in Debian's libb64-0d, the CUDA 12 runtime in nvidia-cuda-runtime-cu12 (loaded
# even when no GPU is used). x86-64 Linux.
#   bash scripts/get_perf_analyzer.sh [DIR]      (default: .perf_analyzer)
#   DIR/perf_analyzer -m digits -u localhost:8001 -i grpc --concurrency-range 1:64
set -euo pipefail
dest=$(realpath -m "${1:-.perf_analyzer}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$dest/lib"
cd "$work"
pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
    --python-version 3.12 "tritonclient==2.41.0"
pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    --python-version 3.12 "nvidia-cuda-runtime-cu12==12.9.79"
apt-get download libb64-0d >/dev/null 2>&1 || { echo "apt-get download libb64-0d failed" >&2; exit 1; }
python3 -m zipfile -e tritonclient-2.41.0-*.whl wheel
python3 -m zipfile -e nvidia_cuda_runtime_cu12-*.whl cudart
dpkg -x libb64-0d_*.deb deb
install -m 755 wheel/tritonclient-2.41.0.data/data/bin/perf_analyzer "$dest/perf_analyzer.bin"
cp "$(find cudart -name 'libcudart.so.12' | head -1)" "$dest/lib/"
cp -P deb/usr/lib/x86_64-linux-gnu/libb64.so.0d* "$dest/lib/"
cat > "$dest/perf_analyzer" <<'SH'
#!/bin/sh
here=$(dirname "$(realpath "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/perf_analyzer.bin" "$@"
SH
chmod +x "$dest/perf_analyzer"
"$dest/perf_analyzer" --version >/dev/null 2>&1 || true
echo "perf_analyzer in $dest"
