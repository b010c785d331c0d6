#!/usr/bin/env bash
# Builds grpc_floor.py's C++ stand-in: a bare KServe v2 gRPC service (gRPC C++, generated from
# the project's KServe protos) answering ModelInfer with a recorded response.
#   bash benchmarks/grpc_floor_cpp/build.sh [OUT]     (default OUT: build/grpc_floor_stand_in)
# Needs a C++17 compiler, protoc, grpc_cpp_plugin and gRPC C++ (Debian/Ubuntu:
# apt-get install g++ libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/build/grpc_floor_stand_in}"
gen="$(mktemp -d)"
trap 'rm -rf "$gen"' EXIT
for tool in protoc grpc_cpp_plugin pkg-config g++; do
  command -v "$tool" > /dev/null || { echo "build.sh: $tool not found (see the header)" >&2; exit 1; }
done
protos="$root/src/tensorkiln/serve/proto"
protoc -I"$protos" --cpp_out="$gen" --grpc_out="$gen" \
  --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" \
  "$protos/grpc_service.proto" "$protos/model_config.proto"
mkdir -p "$(dirname "$out")"
# shellcheck disable=SC2046  # (pkg-config's flags are separate words)
g++ -O2 -std=c++17 -I"$gen" "$here/stand_in.cc" "$gen/grpc_service.pb.cc" \
  "$gen/grpc_service.grpc.pb.cc" "$gen/model_config.pb.cc" \
  $(pkg-config --cflags --libs grpc++ protobuf) -o "$out"
echo "$out"
