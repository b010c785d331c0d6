"""benchmarks/serve_trace.py on the CPU: the server traced under Triton's perf_analyzer at
concurrency 1, every request answered by the model traced once, and every stage measured."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve.test_perf_analyzer import BINARY
from tests.serve.test_repository import _model

ROOT = Path(__file__).resolve().parents[2]
B1 = """
name: "digits"
max_batch_size: 16
input [ { name: "input" data_type: TYPE_FP32 dims: [ 1, 8, 8 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 10 ] } ]
"""


def test_every_request_is_traced_through_every_stage(tmp_path) -> None:
    if not BINARY.is_file():
        pytest.skip("no perf_analyzer (bash scripts/get_perf_analyzer.sh)")
    from tests.serve.test_grpc import native_or_skip

    native_or_skip()
    _model(tmp_path / "repo", config=B1)
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_trace.py"), "--perf-analyzer",
         str(BINARY), "--model-repository", str(tmp_path / "repo"), "--model", "digits",
         "--backend", "reference", "--seconds", "1",
         # (the trace is what is checked, not the rate: windows as unsteady as a 2-core
         # machine's, client and server sharing it, must not fail the run)
         "--stability-percentage", "999"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    traced, answered = map(int, re.search(r"(\d+) requests traced \((\d+) answered", out).groups())
    assert traced == answered > 50  # (the model's own count: each request traced once)
    stages = {
        m.group(1): float(m.group(2)) for m in re.finditer(r"^  ([a-z ,-]+): (\d+) us$", out, re.M)
    }
    assert set(stages) == {
        "taken", "to the run", "run", "answer", "reply", "outside", "server, wake-up to reply"
    }  # fmt: skip
    assert all(v > 0 for v in stages.values()), stages
    server = stages.pop("server, wake-up to reply")
    stages.pop("outside")
    assert max(stages.values()) <= server
    p50 = int(re.search(r"perf_analyzer p50: (\d+) us", out).group(1))
    assert server < p50  # (the client's latency holds the server's and the network's)
