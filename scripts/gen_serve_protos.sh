#!/usr/bin/env bash
# Regenerate src/tensorkiln/serve/proto/kserve.binpb, the compiled descriptors of the vendored
# KServe v2 / Triton protocol definitions beside it (from github.com/triton-inference-server/common,
# protobuf/, BSD-3-Clause). tensorkiln builds its message classes from this descriptor set at
# import, in a pool of its own, so it needs no generated Python code tied to one protobuf release
# and does not clash with tritonclient's copies of the same messages.
#   pip install grpcio-tools && bash scripts/gen_serve_protos.sh
set -euo pipefail
cd "$(dirname "$0")/../src/tensorkiln/serve/proto"
python -m grpc_tools.protoc -I. --include_imports --descriptor_set_out=kserve.binpb \
    model_config.proto grpc_service.proto health.proto
echo "wrote $(pwd)/kserve.binpb"
