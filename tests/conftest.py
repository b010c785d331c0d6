"""Test-wide settings: keep HOME-relative caches (ONNX_HOME, model downloads) in temporary folders."""

from __future__ import annotations

import os
import tempfile

import pytest

_TMP_HOME = tempfile.mkdtemp(prefix="tensorkiln-tests-")
os.environ.setdefault("ONNX_HOME", os.path.join(_TMP_HOME, "onnx"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", os.path.join(_TMP_HOME, "hf"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU, Triton kernels run on torch CPU tensors through Triton's interpreter. Triton reads
# this when a kernel is defined, so it is set before any test module imports one.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
