"""Triton's statistics extension (`/v2/models/.../stats`, gRPC ModelStatistics), read with
tritonclient: counts that match the requests sent, durations that add up; and unknown routes
answered in JSON like every other error (perf_analyzer parses them)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from tests.serve import test_grpc, test_http  # noqa: E402
from tests.serve.test_repository import _model  # noqa: E402


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_statistics_count_what_was_served(tmp_path, protocol):
    _model(tmp_path)  # dynamic batching
    _model(tmp_path, name="plain", config="max_batch_size: 8")
    module, serving = (
        (httpclient, test_http.serving) if protocol == "http" else (grpcclient, test_grpc.serving)
    )
    rng = np.random.default_rng()
    rows = [int(r) for r in rng.integers(1, 4, 7)]
    with serving(tmp_path) as (url, _):
        client = module.InferenceServerClient(url)
        for n in rows:
            x = module.InferInput("input", [n, 1, 8, 8], "FP32")
            x.set_data_from_numpy(rng.standard_normal((n, 1, 8, 8)).astype(np.float32))
            client.infer("plain", [x])
        bad = module.InferInput("input", [1, 2, 8, 8], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 2, 8, 8), np.float32))
        with pytest.raises(Exception, match="shape"):
            client.infer("plain", [bad])
        kw = {"as_json": True} if protocol == "grpc" else {}
        stats = client.get_inference_statistics("plain", **kw)["model_stats"]
        assert len(stats) == 1 and stats[0]["name"] == "plain" and stats[0]["version"] == "1"
        s = stats[0]
        inference = s["inference_stats"]
        # (gRPC's JSON writes 64-bit counts as strings)
        assert int(s["inference_count"]) == sum(rows)
        assert int(s["execution_count"]) == len(rows)  # (no batching: a run per request)
        assert int(inference["success"]["count"]) == len(rows)
        assert int(inference["fail"]["count"]) == 1
        assert int(inference["compute_infer"]["count"]) == len(rows)
        success_ns, compute_ns = (
            int(inference["success"]["ns"]),
            int(inference["compute_infer"]["ns"]),
        )
        assert 0 < compute_ns <= success_ns
        batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in s["batch_stats"]}
        assert batches == {n: rows.count(n) for n in set(rows)}
        every = client.get_inference_statistics(**kw)["model_stats"]
        assert sorted(m["name"] for m in every) == ["digits", "plain"]
        with pytest.raises(Exception, match="unknown model 'nothing'"):
            client.get_inference_statistics("nothing")


def test_unknown_routes_are_answered_in_json(tmp_path):
    _model(tmp_path)
    with test_http.serving(tmp_path) as (url, _):
        for method, path, status in [("GET", "/v2/nothing", 404), ("PUT", "/v2", 405)]:
            req = urllib.request.Request(f"http://{url}{path}", method=method)
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(req, timeout=30)
            assert caught.value.code == status
            assert "error" in json.loads(caught.value.read())
