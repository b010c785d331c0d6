"""The cuda kernels are checked in exact float32: no TF32 in cuBLAS or cuDNN (cuDNN's default)."""

from __future__ import annotations

import pytest

from tensorkiln.runtime.mathmode import math_mode


@pytest.fixture(autouse=True)
def _full_float32():
    with math_mode("fp32"):
        yield
