"""benchmarks/gemm_8bit.py's smoke run: small shapes through Triton's interpreter, every tiling's
8-bit GEMM checked against the float64 product of the same operands before it is timed (the
timing itself is for the GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gemm_8bit.py"


def test_every_tiling_agrees_with_the_exact_product() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--reps", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.strip().startswith("triton")]
    assert len(rows) == 8, done.stdout  # 2 shapes x 2 kinds x 2 tilings
    assert not any("WRONG" in line for line in rows), done.stdout
    # plain and quantized output for the shape without activation, all three for the GELU one
    times = [line.split("):")[1] for line in rows]
    assert all(t.count(" / ") == (2 if "act+q" in r else 1) for r, t in zip(rows, times)), rows
