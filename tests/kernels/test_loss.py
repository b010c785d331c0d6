"""The loss reference kernels against onnxruntime on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.ort_oracle import check_against_ort

SHAPES = [(5, 4), (2, 4, 3, 2)]  # [N, C, d1, ...]


def _case(shape, weighted, ignore_index):
    rng = np.random.default_rng()
    n_classes = shape[1]
    scores = rng.standard_normal(shape).astype(np.float32)
    target = rng.integers(0, n_classes, size=shape[:1] + shape[2:]).astype(np.int64)
    attrs = {}
    if ignore_index is not None:
        # Make sure some targets are ignored (ignore_index may lie outside [0, C)).
        target.reshape(-1)[::3] = ignore_index
        attrs["ignore_index"] = ignore_index
    weight = rng.uniform(0.2, 2.0, size=n_classes).astype(np.float32) if weighted else None
    return scores, target, weight, attrs


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [None, 1, -1])
def test_softmax_cross_entropy(shape, reduction, weighted, ignore_index):
    scores, labels, weights, attrs = _case(shape, weighted, ignore_index)
    inputs = {"scores": scores, "labels": labels, "weights": weights}
    attrs["reduction"] = reduction
    check_against_ort(
        "SoftmaxCrossEntropyLoss", inputs, attrs, n_outputs=2, opset=13, rtol=1e-5, atol=1e-5
    )


def test_softmax_cross_entropy_loss_only_float64():
    scores, labels, _, _ = _case((6, 5), False, None)
    inputs = {"scores": scores.astype(np.float64), "labels": labels}
    check_against_ort("SoftmaxCrossEntropyLoss", inputs, opset=13, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [None, 2, -5])
def test_negative_log_likelihood(shape, reduction, weighted, ignore_index):
    scores, target, weight, attrs = _case(shape, weighted, ignore_index)
    inputs = {"input": scores, "target": target, "weight": weight}
    attrs["reduction"] = reduction
    check_against_ort("NegativeLogLikelihoodLoss", inputs, attrs, opset=13, rtol=1e-5, atol=1e-6)
