"""``tensorkiln serve`` as a user runs it: a process serving a repository, queried with
tritonclient, stopped with SIGTERM (exit 0); bad flags and repositories are clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
pytest.importorskip("aiohttp")

from tensorkiln.builder import Builder  # noqa: E402
from tests.serve.helpers import free_port as _free_port  # noqa: E402
from tests.serve.helpers import wait_until  # noqa: E402
from tests.serve.test_repository import DIGITS, _model  # noqa: E402


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    env = {**(env or os.environ), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tensorkiln", "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("transport", ["grpcio", "native"])
def test_serve_answers_tritonclient_and_stops_cleanly_on_sigterm(transport, tmp_path):
    if transport == "native":
        from tests.serve.test_grpc import native_or_skip

        native_or_skip()
    _model(tmp_path / "repo")
    port, grpc_port, metrics_port = _free_port(), _free_port(), _free_port()
    proc = _cli("--model-repository", str(tmp_path / "repo"), "--http-port", str(port),
                "--http-address", "127.0.0.1", "--grpc-port", str(grpc_port),
                "--metrics-port", str(metrics_port), "--grpc-transport", transport,
                "--grpc-address", "127.0.0.1", "--engine-cache", str(tmp_path / "cache"))  # fmt: skip
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        wait_until(lambda: client.is_model_ready("digits"), proc)
        x = np.random.default_rng().standard_normal((2, 1, 8, 8)).astype(np.float32)
        inp = httpclient.InferInput("input", [2, 1, 8, 8], "FP32")
        inp.set_data_from_numpy(x)
        got = client.infer("digits", [inp]).as_numpy("logits")
        want = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
        np.testing.assert_allclose(got, want.infer({"input": x})["logits"], rtol=1e-5, atol=1e-5)
        grpcclient = pytest.importorskip("tritonclient.grpc")
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        ginp = grpcclient.InferInput("input", [2, 1, 8, 8], "FP32")
        ginp.set_data_from_numpy(x)
        np.testing.assert_allclose(g.infer("digits", [ginp]).as_numpy("logits"), got, rtol=1e-6)
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            text = r.read().decode()
        # two requests of two rows each, over HTTP and gRPC
        assert 'nv_inference_request_success{model="digits",version="1"} 2.0' in text, text
        assert 'nv_inference_count{model="digits",version="1"} 4.0' in text
        # (named as Triton names them: no _total suffix, no _created samples)
        assert "# TYPE nv_inference_count counter" in text and "_total" not in text
        assert "nv_inference_count_created" not in text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "model 'digits' loaded" in out and "Traceback" not in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model-repository", "/no/such/folder"], "is not a folder"),
        (["--model-repository", ".", "--http-port", "0"], "is not a port"),
        (["--model-repository", ".", "--load-model", "x"], "needs --model-control-mode explicit"),
        (["--model-repository", ".", "--grpc-port", "8000"], "two services on one port"),
        (
            ["--model-repository", ".", "--pinned-memory-pool-byte-size", "-1"],
            "--pinned-memory-pool-byte-size -1 must be 0 or more",
        ),
    ],
)
def test_bad_invocations_are_one_line_errors(args, message):
    proc = _cli(*args)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and message in out and "Traceback" not in out, out


def test_a_native_transport_that_cannot_load_is_a_one_line_error(tmp_path):
    env = {**os.environ, "TENSORKILN_GRPC_LIBRARY": str(tmp_path / "missing.so")}
    proc = _cli("--model-repository", str(tmp_path), "--grpc-transport", "native", env=env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert f"--grpc-transport native: TENSORKILN_GRPC_LIBRARY: no library at {tmp_path}" in out


def test_json_logs_are_one_object_per_line(tmp_path):
    import json

    _model(tmp_path, name="broken", config="max_batch_size: -1")
    proc = _cli("--model-repository", str(tmp_path), "--model-control-mode", "explicit",
                "--load-model", "broken", "--http-port", str(_free_port()), "--log-format", "json",
                "--allow-grpc", "false", "--allow-metrics", "false")  # fmt: skip
    out, _ = proc.communicate(timeout=60)
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    failed = [r for r in records if r["level"] == "error" and r["logger"] == "tensorkiln.serve"]
    assert failed and "max_batch_size is -1" in failed[0]["message"], out
    assert {"ts", "level", "logger", "message"} <= set(failed[0])


def test_an_explicitly_asked_model_that_fails_stops_the_start(tmp_path):
    _model(tmp_path, name="broken", config="max_batch_size: -1")
    proc = _cli("--model-repository", str(tmp_path), "--model-control-mode", "explicit",
                "--load-model", "broken", "--http-port", str(_free_port()),
                "--grpc-port", str(_free_port()), "--allow-metrics", "false")  # fmt: skip
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "max_batch_size is -1" in out, out
    assert "Traceback" not in out, out
