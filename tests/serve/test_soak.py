"""The serving targets on the CPU: 64 tritonclient clients for 60 s against the digits engine
(zero errors, every response equal to the engine's own result for that request, the server's
memory flat after warm-up), and 200 malformed requests all answered 4xx with the server still
serving. The server is a `tensorkiln serve` process, as deployed."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")

from tensorkiln.builder import Builder  # noqa: E402
from tests.serve.helpers import free_port as _free_port  # noqa: E402
from tests.serve.helpers import wait_until  # noqa: E402
from tests.serve.test_repository import DIGITS, _model, digit_inputs  # noqa: E402

CLIENTS = 64
SECONDS = float(os.environ.get("TENSORKILN_SOAK_SECONDS", "60"))


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    _model(root / "repo")  # dynamic batching (max 16, preferred 4 and 8), 2 instances
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorkiln", "serve", "--model-repository", str(root / "repo"),
         "--http-port", str(port), "--http-address", "127.0.0.1", "--allow-grpc", "false",
         "--allow-metrics", "false", "--engine-cache", str(root / "cache")],
        stdout=(root / "server.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"127.0.0.1:{port}"
    client = httpclient.InferenceServerClient(url)
    wait_until(lambda: client.is_model_ready("digits"), proc)
    try:
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        out = (root / "server.log").read_text()
        assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_64_clients_for_a_minute(served):
    url, proc = served
    # each client its own inputs, with their answers from the engine run directly
    inputs = digit_inputs(CLIENTS)
    ctx = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
    answers = [ctx.infer({"input": x})["logits"] for x in inputs]
    errors: list[str] = []
    wrong: list[int] = []
    done = [0] * CLIENTS
    # one client object keeping 64 requests in flight, each "client" sending its next request
    # when its last is answered (tritonclient.http's concurrency is greenlets, not threads)
    client = httpclient.InferenceServerClient(url, concurrency=CLIENTS, network_timeout=120)
    tensors = []
    for x in inputs:
        t = httpclient.InferInput("input", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        tensors.append(t)
    pending = [client.async_infer("digits", [t]) for t in tensors]
    warm_until = time.monotonic() + min(10.0, SECONDS / 6)
    rss_warm = None
    end = warm_until + SECONDS
    while time.monotonic() < end:
        for i in range(CLIENTS):
            try:
                got = pending[i].get_result().as_numpy("logits")
                if not np.allclose(got, answers[i], rtol=1e-5, atol=1e-5):
                    wrong.append(i)
                done[i] += 1
            except Exception as exc:
                errors.append(f"client {i}: {exc}")
            pending[i] = client.async_infer("digits", [tensors[i]])
        if rss_warm is None and time.monotonic() >= warm_until:
            rss_warm = _rss_kib(proc.pid)
    rss_end = _rss_kib(proc.pid)
    for p in pending:
        p.get_result()
    client.close()
    assert not errors, errors[:5]
    assert not wrong, f"{len(wrong)} responses differ from the engine's own result"
    assert min(done) > 0, "a client was never served"
    growth = (rss_end - rss_warm) / rss_warm
    assert growth < 0.05, f"server RSS grew {100 * growth:.1f}% ({rss_warm} -> {rss_end} KiB)"
    print(f"{sum(done)} requests in {SECONDS:.0f} s, RSS {rss_warm} -> {rss_end} KiB")


def _fuzzed(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    """One malformed inference request: a body and headers."""
    good = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}]
    }
    kind = rng.randrange(12)
    headers: dict[str, str] = {}
    if kind == 0:  # random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))), headers
    if kind == 1:  # truncated JSON
        text = json.dumps(good)
        return text[: rng.randrange(1, len(text) - 1)].encode(), headers
    body = json.loads(json.dumps(good))
    t = body["inputs"][0]
    if kind == 2:
        t["shape"] = [
            rng.choice([-5, 0, 10**12, 3.5, "x", None]) for _ in range(rng.randrange(1, 20))
        ]
    elif kind == 3:
        t["datatype"] = rng.choice(["FP99", "", "BYTES", "fp32", 7, None, "BF16"])
    elif kind == 4:
        t["data"] = rng.choice([["a"] * 64, [[1, 2], [3]], {"x": 1}, [None] * 64, [1e400] * 64, []])
        if t["data"] == [] or isinstance(t["data"], dict):
            pass
    elif kind == 5:
        t["name"] = rng.choice(["", "inputs", 5, None, "x" * 10000])
    elif kind == 6:
        body["inputs"] = rng.choice([None, {}, "input", [1, 2, 3], [t, t]])
    elif kind == 7:
        t.pop("data")
        t["parameters"] = {"binary_data_size": rng.choice([-1, 10**12, "256", 255, 257])}
        headers["Inference-Header-Content-Length"] = str(len(json.dumps(body)))
    elif kind == 8:
        headers["Inference-Header-Content-Length"] = rng.choice(
            ["-3", "abc", "999999999", "1e3", " 5"]
        )
    elif kind == 9:
        t["shape"] = [rng.randrange(17, 100), 1, 8, 8]
        t["data"] = [0.0] * (t["shape"][0] * 64)
    elif kind == 10:
        body["outputs"] = rng.choice([[{"name": "nope"}], "logits", [{"name": 3}], [{}]])
    else:
        body["parameters"] = rng.choice([[], "x", 5])
    return json.dumps(body).encode(), headers


def test_200_malformed_requests_get_4xx_and_the_server_serves_on(served):
    url, proc = served
    host, port = url.split(":")
    rng = random.Random(int(np.random.default_rng().integers(1 << 31)))
    statuses = []
    for _ in range(200):
        body, headers = _fuzzed(rng)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        path = rng.choice(["/v2/models/digits/infer", "/v2/models/digits/versions/1/infer"])
        conn.request(
            "POST", path, body=body, headers={"Content-Type": "application/json", **headers}
        )
        r = conn.getresponse()
        reply = r.read()
        statuses.append(r.status)
        assert 400 <= r.status < 500, (r.status, body[:200], headers, reply[:300])
        assert b"error" in reply
        conn.close()
    # a huge declared body is refused before it is read
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v2/models/digits/infer")
    conn.putheader("Content-Length", str(10**11))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    assert proc.poll() is None
    client = httpclient.InferenceServerClient(url)
    x = httpclient.InferInput("input", [1, 1, 8, 8], "FP32")
    x.set_data_from_numpy(np.ones((1, 1, 8, 8), np.float32))
    assert client.infer("digits", [x]).as_numpy("logits").shape == (1, 10)
