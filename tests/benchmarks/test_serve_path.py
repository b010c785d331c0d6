"""benchmarks/serve_path.py's smoke run: on the cpu backend (a small conv net), the served
answers are first checked against the engine's own, then each stage is timed (the timing itself
is for the GPU host)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("grpc")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_path.py"


def test_each_stage_is_timed_after_the_answers_agree() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--calls", "3", "--gaps-ms", "0,1", "--instances", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if "p50" in line]
    stages = ("engine run", "server core, 1 instance(s)", "gRPC service handler, 1 instance(s)")
    for stage in stages:
        for gap in ("0", "1"):
            assert any(line.startswith(f"{stage}, gap {gap} ms: p50 ") for line in lines), lines
