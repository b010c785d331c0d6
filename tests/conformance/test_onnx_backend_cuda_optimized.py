"""ONNX's backend test suite through the optimizer on the cuda backend: every model built at
level 3 runs on the cuda kernels (fused ops included; on torch CPU tensors without a GPU) and is
checked against the unoptimized graph on the reference backend (1e-5 relative) and against the
suite's expected outputs. Tactics are not timed here (the autotuner has its own tests)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torch")

import onnx.backend.test

from tests.conformance import optimized_cuda_backend
from tests.conformance.exclusions import CUDA_EXCLUDED

warnings.filterwarnings("ignore", category=RuntimeWarning)

backend_test = onnx.backend.test.BackendTest(optimized_cuda_backend, __name__)
for pattern in CUDA_EXCLUDED:
    backend_test.exclude(pattern)

globals().update(backend_test.test_cases)
