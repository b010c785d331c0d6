"""Kernels that serve several opsets with one function (the meaning chosen by ``_opset``, the
defaults resolved from the op's record) against onnxruntime, on fresh random inputs, for the
reference kernels and the cuda backend's torch kernels (on CPU tensors here)."""

from __future__ import annotations

import numpy as np
import pytest

from tensorkiln.kernels.registry import invoke, lookup
from tests.kernels.ort_oracle import one_node_model, run_ort

BACKENDS = ["reference", "cuda"]
rng = np.random.default_rng()


def _run(backend: str, op: str, inputs: dict, attrs: dict, opset: int, n_outputs: int = 1):
    entry = lookup(op, "", opset, backend)
    args = list(inputs.values())
    if backend == "cuda":
        torch = pytest.importorskip("torch")
        args = [None if a is None else torch.from_numpy(a.copy()) for a in args]
    outs = invoke(entry, args, attrs, n_outputs)
    return [o if isinstance(o, np.ndarray) else o.numpy() for o in outs[:n_outputs]]


def _check(backend, op, inputs, attrs, opset, *, rtol=1e-5, atol=1e-6, n_outputs=1):
    expected = run_ort(one_node_model(op, inputs, attrs, n_outputs=n_outputs, opset=opset), inputs)
    got = _run(backend, op, inputs, attrs, opset, n_outputs)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, e.shape, g.dtype, e.dtype)
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_softmax_family_per_opset(backend, op, opset, axis):
    # a 3-D input tells the 2-D coercion of opset 11 from opset 13's single axis
    x = rng.standard_normal((2, 3, 5)).astype(np.float32)
    attrs = {} if axis is None else {"axis": axis}
    _check(backend, op, {"X": x}, attrs, opset)


def _image(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("opset", [10, 11, 13, 18, 19])
def test_resize_per_opset(backend, mode, opset):
    x = _image(1, 2, 4, 5)
    scales = np.array([1.0, 1.0, 2.0, 1.5], dtype=np.float32)
    if opset == 10:
        inputs = {"X": x, "scales": scales}
    elif opset == 11:
        inputs = {"X": x, "roi": np.array([], dtype=np.float32), "scales": scales}
    else:
        inputs = {"X": x, "roi": None, "scales": scales}
    _check(backend, "Resize", inputs, {"mode": mode}, opset, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resize_half_pixel_symmetric_needs_opset_19(backend):
    x = _image(1, 1, 3, 4)
    inputs = {"X": x, "roi": None, "scales": np.array([1, 1, 1.5, 2], dtype=np.float32)}
    attrs = {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}
    _check(backend, "Resize", inputs, attrs, 19, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="Resize-18: coordinate_transformation_mode"):
        _run(backend, "Resize", inputs, attrs, 18)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opset", [6, 13])
def test_clip_bounds_as_attributes_or_inputs(backend, opset):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    lo, hi = sorted(rng.uniform(-1, 1, 2).astype(np.float32))
    if opset < 11:
        _check(backend, "Clip", {"X": x}, {"min": float(lo), "max": float(hi)}, opset)
    else:
        bounds = {"min": np.array(lo, np.float32), "max": np.array(hi, np.float32)}
        _check(backend, "Clip", {"X": x, **bounds}, {}, opset)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization_per_opset(backend, opset):
    x = _image(2, 4, 3, 3)
    groups = 2
    n = groups if opset < 21 else x.shape[1]  # one scale per group, then one per channel
    scale = rng.standard_normal(n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    inputs = {"X": x, "scale": scale, "bias": bias}
    _check(
        backend, "GroupNormalization", inputs, {"num_groups": groups}, opset, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opset", [9, 15])
def test_batch_normalization_inference_per_opset(backend, opset):
    x = _image(2, 3, 4, 4)
    c = x.shape[1]
    scale, bias, mean = (rng.standard_normal(c).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.5, 2.0, c).astype(np.float32)
    inputs = {"X": x, "scale": scale, "B": bias, "mean": mean, "var": var}
    _check(backend, "BatchNormalization", inputs, {}, opset, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opset", [7, 16])
def test_prelu_per_opset(backend, opset):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    slope = rng.uniform(0.05, 0.5, (3, 1)).astype(np.float32)
    _check(backend, "PRelu", {"X": x, "slope": slope}, {}, opset)


def test_one_kernel_serves_every_opset():
    for op, opsets in {
        "Softmax": (1, 11, 13, 21),
        "Resize": (10, 11, 13, 18, 19),
        "Upsample": (7, 9),
        "GridSample": (16, 20),
        "BatchNormalization": (7, 9, 14, 15),
        "GroupNormalization": (18, 21),
        "Dropout": (7, 10, 12, 13),
        "Clip": (6, 11, 13),
        "PRelu": (6, 7, 16),
    }.items():
        for backend in BACKENDS:
            fns = {lookup(op, "", v, backend).fn for v in opsets}
            assert len(fns) == 1, f"{op} on {backend}: {len(fns)} kernels"
