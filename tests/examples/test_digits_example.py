"""The quick-start example: examples/digits.py runs, reaches its accuracy, agrees with onnxruntime."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorkiln

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODEL_PATH = EXAMPLES / "digits_cnn.onnx"
TEST_PATH = EXAMPLES / "digits_test.npz"


def test_digits_script_runs_and_reaches_accuracy(tmp_path: Path) -> None:
    # Run from an unrelated folder: the script must find its files relative to itself.
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "digits.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"digits.py failed:\n{proc.stdout}\n{proc.stderr}"
    match = re.search(r"accuracy: ([0-9.]+)", proc.stdout)
    assert match, f"no accuracy line in the output:\n{proc.stdout}"
    assert float(match.group(1)) >= 0.9


def test_quick_start_engine_path(tmp_path: Path) -> None:
    """README's first command: build an engine with the CLI, then run the example on it."""
    engine = tmp_path / "digits.engine"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorkiln",
            "build",
            str(MODEL_PATH),
            "-o",
            str(engine),
            "--min-shapes",
            "input:1x1x8x8",
            "--opt-shapes",
            "input:1x1x8x8",
            "--max-shapes",
            "input:512x1x8x8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "digits.py"), str(engine)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert f"engine: {engine}" in proc.stdout
    assert float(re.search(r"accuracy: ([0-9.]+)", proc.stdout).group(1)) >= 0.9
    assert "argmax agreement 100.00%" in proc.stdout


def test_digits_logits_match_onnxruntime() -> None:
    ort = pytest.importorskip("onnxruntime")
    data = np.load(TEST_PATH)
    images = data["images"]
    session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    expected = session.run(None, {session.get_inputs()[0].name: images})[0]
    with tensorkiln.Runner(MODEL_PATH) as runner:
        got = runner.infer({runner.input_names[0]: images})[runner.output_names[0]]
    assert got.shape == expected.shape == (len(images), 10)
    # atol scaled to the logits: a few float32 ulps of the largest logit.
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    np.testing.assert_array_equal(got.argmax(1), expected.argmax(1))
