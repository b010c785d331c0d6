"""Fixtures for the `tensorkiln` command's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.helpers import CLI, DIGITS, mlp_model


@pytest.fixture
def cli(capsys: pytest.CaptureFixture) -> CLI:
    return CLI(capsys)


@pytest.fixture
def mlp(tmp_path: Path) -> Path:
    return mlp_model(tmp_path / "mlp.onnx")


@pytest.fixture
def digits() -> Path:
    if not DIGITS.exists():
        pytest.skip("examples/digits_cnn.onnx is not there")
    return DIGITS
