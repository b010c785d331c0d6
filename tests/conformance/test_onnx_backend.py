"""ONNX's backend test suite against the reference backend.

Runs onnx.backend.test.BackendTest: the node cases, the simple, pytorch-converted and
pytorch-operator model cases, and the light model cases (small real CNNs shipped with onnx). Every
exclusion below says why.
"""

from __future__ import annotations

import warnings

import onnx.backend.test

import tensorkiln.onnx_backend as backend
from tests.conformance.exclusions import EXCLUDED

warnings.filterwarnings("ignore", category=RuntimeWarning)

backend_test = onnx.backend.test.BackendTest(backend, __name__)
for pattern in EXCLUDED:
    backend_test.exclude(pattern)

globals().update(backend_test.test_cases)
