"""ONNX's backend test suite through the optimizer: every model built at level 3.

Each case checks the optimized engine against the unoptimized graph (1e-5 relative) and against
the suite's expected outputs. The node cases are single ops, so they mostly test that clean-up and
folding leave standard ops alone; the model cases (pytorch-converted, light models) exercise the
fusions.
"""

from __future__ import annotations

import warnings

import onnx.backend.test

from tests.conformance import optimized_backend
from tests.conformance.exclusions import EXCLUDED

warnings.filterwarnings("ignore", category=RuntimeWarning)

backend_test = onnx.backend.test.BackendTest(optimized_backend, __name__)
for pattern in EXCLUDED:
    backend_test.exclude(pattern)

globals().update(backend_test.test_cases)
