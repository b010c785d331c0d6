"""benchmarks/grpc_floor.py's stand-in services (grpcio's aio and thread-pool servers, and the
C++ one where gRPC C++ is installed): recorded from a real gRPC server over the digits model, each
answers tritonclient with the real server's metadata and config, the recorded response (the real
engine's result for the recorded input) and statistics that count its requests; the timing
itself needs Triton's perf_analyzer and is not run here."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("grpc")

from tests.serve.helpers import free_port  # noqa: E402
from tests.serve.test_grpc import serving  # noqa: E402
from tests.serve.test_repository import _model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "grpc_floor.py"


def _bench():
    spec = importlib.util.spec_from_file_location("grpc_floor_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    return bench


@pytest.fixture(scope="module")
def cpp_stand_in(tmp_path_factory) -> Path:
    """The C++ stand-in, built from benchmarks/grpc_floor_cpp (where gRPC C++ is installed)."""
    tools = ("g++", "protoc", "grpc_cpp_plugin", "pkg-config")
    if not all(shutil.which(t) for t in tools):
        pytest.skip(
            "gRPC C++ is not installed (apt-get install libgrpc++-dev protobuf-compiler-grpc)"
        )
    binary = tmp_path_factory.mktemp("cpp") / "grpc_floor_stand_in"
    built = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "grpc_floor_cpp" / "build.sh"), str(binary)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if (
        built.returncode != 0
        and "pkg-config" in built.stderr
        and ("grpc++" in built.stderr or "protobuf" in built.stderr)
    ):
        pytest.skip("gRPC C++'s or protobuf's pkg-config files are missing "
                    "(apt-get install libgrpc++-dev libprotobuf-dev)")  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    return binary


@pytest.mark.parametrize("mode", ["aio", "sync", "c++"])
def test_the_stand_in_answers_as_the_recorded_server(tmp_path, mode, request) -> None:
    bench = _bench()
    repo = tmp_path / "repo"
    _model(repo)
    recorded = tmp_path / "recorded.bin"
    with serving(repo) as (url, _):
        bench._record(url, "digits", recorded)
        real = grpcclient.InferenceServerClient(url)
        meta = real.get_model_metadata("digits", as_json=True)
        config = real.get_model_config("digits", as_json=True)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'src'}")
    cmd = [sys.executable, str(SCRIPT), "--stub", str(recorded), str(port), mode]
    if mode == "c++":
        cmd = [str(request.getfixturevalue("cpp_stand_in")), str(recorded), str(port)]
    stub = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert stub.stdout.readline().strip() == "ready"
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_ready() and client.is_model_ready("digits")
        assert client.get_model_metadata("digits", as_json=True) == meta
        assert client.get_model_config("digits", as_json=True) == config
        x = np.random.default_rng().standard_normal((1, 1, 8, 8)).astype(np.float32)
        x_in = grpcclient.InferInput("input", [1, 1, 8, 8], "FP32")
        x_in.set_data_from_numpy(x)
        first = client.infer("digits", [x_in], request_id="a")
        second = client.infer("digits", [x_in], request_id="b")
        assert first.get_response().id == "a" and second.get_response().id == "b"
        logits = first.as_numpy("logits")
        assert logits.shape == (1, 10) and np.all(np.isfinite(logits))
        np.testing.assert_array_equal(second.as_numpy("logits"), logits)  # (recorded)
        stats = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
        assert stats["inference_count"] == "2" and stats["version"] == "1"
    finally:
        stub.terminate()
        stub.wait(20)
