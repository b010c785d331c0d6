"""ONNX's backend test suite on the cuda backend (GPU when present, else torch on the CPU).

Same cases and exclusions as the reference backend's run; cases whose ops have no cuda kernel are
skipped with the op's name.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torch")

import onnx.backend.test

from tests.conformance import cuda_backend
from tests.conformance.exclusions import EXCLUDED

warnings.filterwarnings("ignore", category=RuntimeWarning)

backend_test = onnx.backend.test.BackendTest(cuda_backend, __name__)
for pattern in EXCLUDED:
    backend_test.exclude(pattern)
# The expected data of the inverse DFT holds numpy's float32 rounding (1.9e-7) where the exact
# result is 0, under a 1e-7 tolerance; torch.fft returns the exact 0 (the reference backend passes
# only because it is the same numpy code that made the data).
backend_test.exclude(r"^test_dft_inverse(_opset19)?_")

globals().update(backend_test.test_cases)
