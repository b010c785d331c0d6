"""Triton's own perf_analyzer (the C++ tool, fetched by scripts/get_perf_analyzer.sh) drives
`tensorkiln serve` over HTTP and gRPC, with and without system shared memory, as it drives
tritonserver: every request succeeds, and the server-side statistics it reads are reported."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.http")

from tests.serve.helpers import free_port, wait_until
from tests.serve.test_cli_serve import _cli, httpclient
from tests.serve.test_repository import _model

BINARY = Path(
    os.environ.get(
        "TENSORKILN_PERF_ANALYZER",
        Path(__file__).resolve().parents[2] / ".perf_analyzer" / "perf_analyzer",
    )
)
pytestmark = pytest.mark.skipif(
    not BINARY.is_file(), reason="no perf_analyzer (bash scripts/get_perf_analyzer.sh)"
)


def test_perf_analyzer_measures_tensorkiln_serve(tmp_path):
    _model(tmp_path / "repo")
    http_port, grpc_port = free_port(), free_port()
    proc = _cli("--model-repository", str(tmp_path / "repo"), "--http-port", str(http_port),
                "--http-address", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-address",
                "127.0.0.1", "--allow-metrics", "false", "--allow-shared-memory", "true",
                "--engine-cache", str(tmp_path / "cache"))  # fmt: skip
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        wait_until(lambda: client.is_model_ready("digits"), proc)
        for protocol, port, extra in [
            ("http", http_port, []),
            ("grpc", grpc_port, []),
            ("grpc", grpc_port, ["--shared-memory", "system"]),
        ]:
            report = tmp_path / f"{protocol}{len(extra)}.csv"
            run = subprocess.run(
                [str(BINARY), "-m", "digits", "-u", f"127.0.0.1:{port}", "-i", protocol,
                 "-b", "2", "--concurrency-range", "1:2", "--measurement-interval", "500",
                 "--stability-percentage", "999", "--max-trials", "3",
                 "-f", str(report), *extra],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            rows = list(csv.DictReader(report.open()))
            assert [r["Concurrency"] for r in rows] == ["1", "2"]
            for r in rows:
                assert float(r["Inferences/Second"]) > 0
                assert int(r["Server Compute Infer"]) > 0  # (read from the statistics extension)
            assert "Successful request count" in run.stdout
        assert not [n for n in os.listdir("/dev/shm") if "perf" in n.lower()]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
