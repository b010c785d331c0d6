"""Multi-output ops that declare only some outputs (as exporters write them) run and infer shapes.

The torch dynamo exporter writes a stacked LSTM whose nodes name only ``Y``; other exporters leave
optional outputs as empty strings in the middle (``["Y", "", "Y_c"]``). The node's consumers must get
the declared outputs, on the reference backend and on the cuda kernels (run on CPU tensors here).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tensorkiln
from tensorkiln.builder import Builder

T, B, I, H = 5, 2, 4, 3


def _rand(*shape: int) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def _weights(op: str) -> dict[str, np.ndarray]:
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    return {"W": _rand(1, gates * H, I), "R": _rand(1, gates * H, H), "B": _rand(1, 2 * gates * H)}


# (op, node inputs -> data (graph input "x" and initializers), attributes, opset, declared outputs)
CASES = {
    "lstm_y_only": ("LSTM", ["x", "W", "R", "B"], {"hidden_size": H}, 17, ["Y"]),
    "lstm_y_c_hole": ("LSTM", ["x", "W", "R", "B"], {"hidden_size": H}, 17, ["Y", "", "Y_c"]),
    "lstm_h_only": ("LSTM", ["x", "W", "R", "B"], {"hidden_size": H}, 17, ["", "Y_h"]),
    "gru_y_only": ("GRU", ["x", "W", "R", "B"], {"hidden_size": H}, 17, ["Y"]),
    "gru_h_only": ("GRU", ["x", "W", "R", "B"], {"hidden_size": H}, 17, ["", "Y_h"]),
    "rnn_y_only": ("RNN", ["x", "W", "R", "B"], {"hidden_size": H}, 17, ["Y"]),
    "dropout_output": ("Dropout", ["x"], {}, 17, ["y"]),
    "maxpool_values": ("MaxPool", ["x"], {"kernel_shape": [2]}, 17, ["y"]),
    "layernorm_y": ("LayerNormalization", ["x", "g", "b"], {"axis": -1}, 17, ["y"]),
    "layernorm_y_invstd": (
        "LayerNormalization",
        ["x", "g", "b"],
        {"axis": -1},
        17,
        ["y", "", "inv"],
    ),
    "unique_y_inverse": ("Unique", ["x"], {"sorted": 1}, 17, ["y", "", "inverse"]),
}


def _data(op: str, names: list[str]) -> dict[str, np.ndarray]:
    data: dict[str, np.ndarray] = {"x": _rand(T, B, I)}
    if op in ("LSTM", "GRU", "RNN"):
        data.update(_weights(op))
    if op == "LayerNormalization":
        data["g"], data["b"] = _rand(I), _rand(I)
    if op == "Unique":
        data["x"] = np.random.default_rng().integers(0, 4, (7,)).astype(np.float32)
    return {n: data[n] for n in names}


def _model(case: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The node, then a consumer of each declared output (where the bug showed), as outputs."""
    op, names, attrs, opset, declared = CASES[case]
    data = _data(op, names)
    inits = [numpy_helper.from_array(a, n) for n, a in data.items() if n != "x"]
    nodes = [helper.make_node(op, names, declared, name="multi", **attrs)]
    outputs = []
    for name in filter(None, declared):
        consumer = "Identity" if name == "inverse" else "Neg"
        nodes.append(helper.make_node(consumer, [name], [f"{name}_out"]))
        outputs.append(helper.make_value_info(f"{name}_out", onnx.TypeProto()))
    x = data["x"]
    graph_in = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))]
    graph = helper.make_graph(nodes, case, graph_in, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return model, {"x": x}


def _check(case: str, run) -> None:
    model, feeds = _model(case)
    session = ort.InferenceSession(model.SerializeToString())
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    got = run(model, feeds)
    assert set(got) == set(want)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_backend(case: str) -> None:
    _check(case, lambda m, f: tensorkiln.run_onnx(m, f))


@pytest.mark.parametrize("case", sorted(CASES))
def test_shape_inference_types_declared_outputs(case: str) -> None:
    model, feeds = _model(case)
    graph = tensorkiln.import_onnx(model)
    node = next(n for n in graph.nodes if n.name == "multi")
    assert len(node.outputs) == len(CASES[case][4])
    session = ort.InferenceSession(model.SerializeToString())
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    for v in graph.outputs:
        if all(isinstance(d, int) for d in v.shape or ()):  # (Unique's sizes depend on data)
            assert v.shape == want[v.name].shape, v.name


@pytest.mark.parametrize(
    "case", ["lstm_y_only", "lstm_y_c_hole", "gru_h_only", "layernorm_y_invstd"]
)
def test_cuda_kernels_on_cpu(case: str) -> None:
    def run(model, feeds):
        engine = Builder("cuda", device="cpu").build(model, progress=False)
        out = engine.create_execution_context().infer(feeds)
        return {k: np.asarray(v) for k, v in out.items()}

    _check(case, run)


def _stacked_lstm() -> onnx.ModelProto:
    """Two LSTM layers as the dynamo exporter writes them: only Y, then Squeeze and Transpose."""
    nodes, inits = [], []
    prev, size = "x", I
    for layer in range(2):
        w = {"W": _rand(1, 4 * H, size), "R": _rand(1, 4 * H, H), "B": _rand(1, 8 * H)}
        names = [f"{k}{layer}" for k in w]
        inits += [numpy_helper.from_array(a, n) for n, a in zip(names, w.values())]
        nodes += [
            helper.make_node("LSTM", [prev, *names], [f"Y{layer}"], hidden_size=H),
            helper.make_node("Squeeze", [f"Y{layer}", "one"], [f"s{layer}"]),
        ]
        prev, size = f"s{layer}", H
    nodes.append(helper.make_node("Transpose", [prev], ["y"], perm=[1, 0, 2]))
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "B", I])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "stacked", [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_stacked_lstm_like_dynamo(backend: str) -> None:
    model = _stacked_lstm()
    x = _rand(6, 3, I)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    if backend == "reference":
        got = tensorkiln.run_onnx(model, {"x": x})["y"]
    else:
        engine = Builder("cuda", device="cpu").build(model, progress=False)
        got = np.asarray(engine.create_execution_context().infer({"x": x})["y"])
    assert got.shape == (3, 6, H)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("declared", [["y"], ["y", "", "running_var"]])
def test_batchnorm_training_outputs(declared: list[str]) -> None:
    """onnxruntime refuses (or crashes on) training-mode BatchNormalization with fewer outputs, so
    numpy is the oracle here: batch statistics over every axis but the channel axis 1."""
    x, g, b, mean, var = _rand(T, B, I), _rand(B), _rand(B), _rand(B), np.abs(_rand(B)) + 0.5
    inits = [numpy_helper.from_array(a, n) for n, a in zip(["g", "b", "m", "v"], [g, b, mean, var])]
    nodes = [
        helper.make_node(
            "BatchNormalization", ["x", "g", "b", "m", "v"], declared, training_mode=1
        ),
        helper.make_node("Neg", ["y"], ["y_out"]),
    ]
    outputs = [helper.make_value_info("y_out", onnx.TypeProto())]
    if "running_var" in declared:
        nodes.append(helper.make_node("Neg", ["running_var"], ["var_out"]))
        outputs.append(helper.make_value_info("var_out", onnx.TypeProto()))
    x_in = helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, B, I])
    graph = helper.make_graph(nodes, "bn", [x_in], outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    got = tensorkiln.run_onnx(model, {"x": x})
    m, v = x.mean(axis=(0, 2)), x.var(axis=(0, 2))
    y = (x - m[:, None]) / np.sqrt(v[:, None] + 1e-5) * g[:, None] + b[:, None]
    np.testing.assert_allclose(got["y_out"], -y, rtol=1e-4, atol=1e-5)
    if "running_var" in declared:
        np.testing.assert_allclose(got["var_out"], -(0.9 * var + 0.1 * v), rtol=1e-4, atol=1e-5)
