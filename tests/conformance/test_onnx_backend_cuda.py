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
from tests.conformance.exclusions import CUDA_EXCLUDED

warnings.filterwarnings("ignore", category=RuntimeWarning)

backend_test = onnx.backend.test.BackendTest(cuda_backend, __name__)
for pattern in CUDA_EXCLUDED:
    backend_test.exclude(pattern)

globals().update(backend_test.test_cases)
