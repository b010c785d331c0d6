"""Ops the cuda backend runs on the host (kernels/cuda/host_ops.py), built and run by the cuda
backend on CPU tensors and checked against onnxruntime on fresh random inputs, one case per
family, including the opset-dependent meanings of the single LabelEncoder and DFT kernels."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

pytest.importorskip("torch")

from tensorkiln.builder import Builder
from tests.kernels.ort_oracle import run_ort

ML = "ai.onnx.ml"


def _model(nodes, inputs, outputs, opset: int, ml_opset: int | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "host_ops", inputs, outputs)
    opsets = [helper.make_opsetid("", opset)]
    if ml_opset is not None:
        opsets.append(helper.make_opsetid(ML, ml_opset))
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _info(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    dtype = helper.np_dtype_to_tensor_dtype(value.dtype)
    return helper.make_tensor_value_info(name, dtype, list(value.shape))


def _out(name: str) -> onnx.ValueInfoProto:
    return helper.make_value_info(name, onnx.TypeProto())


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 1e-5) -> None:
    want = run_ort(model, feeds)
    engine = Builder("cuda", device="cpu").build(model, progress=False)
    got = engine.create_execution_context().infer(feeds)
    for out, expected in zip(model.graph.output, want):
        value = np.asarray(got[out.name])
        assert value.shape == expected.shape and value.dtype == expected.dtype, out.name
        if expected.dtype.kind == "f":
            np.testing.assert_allclose(value, expected, rtol=rtol, atol=rtol, err_msg=out.name)
        else:
            np.testing.assert_array_equal(value, expected, err_msg=out.name)


@pytest.mark.parametrize("opset", [17, 20])
def test_dft_axis_attribute_then_input(opset):
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 6, 5, 1)).astype(np.float32)
    if opset == 17:
        node = helper.make_node("DFT", ["x"], ["y"], axis=2)
        feeds, inputs = {"x": x}, [_info("x", x)]
    else:
        axis = np.array(2, dtype=np.int64)
        node = helper.make_node("DFT", ["x", "", "axis"], ["y"])
        feeds, inputs = {"x": x, "axis": axis}, [_info("x", x), _info("axis", axis)]
    _check(_model([node], inputs, [_out("y")], opset), feeds, rtol=1e-4)


def test_label_encoder_v1_strings_to_ints():
    rng = np.random.default_rng()
    classes = ["cat", "dog", "eel", "fox"]
    x = np.array(rng.choice([*classes, "gnu"], size=(3, 4)).tolist(), dtype=object)
    node = helper.make_node(
        "LabelEncoder", ["x"], ["y"], domain=ML, classes_strings=classes, default_int64=-7
    )
    model = _model([node], [_info("x", x)], [_out("y")], 17, ml_opset=1)
    _check(model, {"x": x})


def test_label_encoder_v2_and_scaler_on_numbers():
    rng = np.random.default_rng()
    keys = rng.permutation(20)[:6].astype(np.float32)
    x = rng.choice(np.concatenate([keys, [99.0]]), size=(4, 3)).astype(np.float32)
    scale, offset = rng.uniform(0.5, 2, 3).tolist(), rng.standard_normal(3).tolist()
    nodes = [
        helper.make_node(
            "LabelEncoder",
            ["x"],
            ["codes"],
            domain=ML,
            keys_floats=keys.tolist(),
            values_int64s=rng.integers(-50, 50, 6).tolist(),
        ),
        helper.make_node("Scaler", ["x"], ["scaled"], domain=ML, scale=scale, offset=offset),
    ]
    model = _model([nodes[0], nodes[1]], [_info("x", x)], [_out("codes"), _out("scaled")], 17, 2)
    _check(model, {"x": x})


def test_sequence_round_trip_and_loss():
    rng = np.random.default_rng()
    a, b = (
        rng.standard_normal((2, 3)).astype(np.float32),
        rng.standard_normal((4, 3)).astype(np.float32),
    )
    labels = rng.integers(0, 3, size=(6,)).astype(np.int64)
    nodes = [
        helper.make_node("SequenceConstruct", ["a", "b"], ["seq"]),
        helper.make_node("SequenceLength", ["seq"], ["n"]),
        helper.make_node("ConcatFromSequence", ["seq"], ["cat"], axis=0),
        helper.make_node("SoftmaxCrossEntropyLoss", ["cat", "labels"], ["loss"]),
    ]
    inputs = [_info("a", a), _info("b", b), _info("labels", labels)]
    model = _model(nodes, inputs, [_out("n"), _out("cat"), _out("loss")], 17)
    _check(model, {"a": a, "b": b, "labels": labels})


def test_window_from_a_size_input():
    size = np.array(np.random.default_rng().integers(3, 40), dtype=np.int64)
    node = helper.make_node("HannWindow", ["size"], ["w"], periodic=0)
    _check(_model([node], [_info("size", size)], [_out("w")], 17), {"size": size})


def test_random_like_runs_on_the_host_and_returns_a_device_tensor():
    """A host op's output comes back as a tensor of the input's dtype, on the input's device."""
    import torch

    from tensorkiln.kernels.registry import invoke, lookup

    rng = np.random.default_rng()
    low, high = sorted(rng.uniform(-3, 3, 2).tolist())
    x = torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float16))
    entry = lookup("RandomUniformLike", "", 22, "cuda")
    (y,) = invoke(entry, [x], {"low": low, "high": high}, 1)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float16 and y.shape == x.shape
    assert y.device == x.device
    values = y.float().numpy()  # (rounding to float16 is monotonic: bounds rounded alike)
    assert values.min() >= np.float16(low) and values.max() <= np.float16(high)
    assert values.std() > 0.1 * (high - low)
