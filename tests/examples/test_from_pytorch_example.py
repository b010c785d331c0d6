"""examples/from_pytorch.py runs from any folder, agrees with eager PyTorch, and round-trips."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxscript")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "from_pytorch.py"


def test_the_from_pytorch_example_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    err = re.search(r"from eager PyTorch, batches 1/8/64: ([0-9.e+-]+)", proc.stdout)
    assert err and float(err.group(1)) < 1e-4, proc.stdout
    assert "saved and loaded: same outputs: True" in proc.stdout
