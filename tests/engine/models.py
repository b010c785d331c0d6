"""Small ONNX models for the engine and builder tests, with feeds of fresh random inputs.

Each maker returns a ModelProto; :func:`random_feeds` draws inputs of the declared shapes (symbolic
dims bound by ``dims``). Weights come from a fixed seed so a model is the same on every call.
"""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DIGITS = EXAMPLES / "digits_cnn.onnx"
LIGHT_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"


def _model(nodes, name, inputs, outputs, inits=(), opset: int = OPSET) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _w(rng: np.random.Generator, name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def mlp(batch: int | str = "N") -> onnx.ModelProto:
    """x[batch, 16] -> Gemm -> Relu -> MatMul + Add -> Softmax."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["m"], name="fc2"),
        helper.make_node("Add", ["m", "b2"], ["logits"], name="bias2"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
    ]
    inits = [_w(rng, "w1", 32, 16), _w(rng, "b1", 32), _w(rng, "w2", 32, 10), _w(rng, "b2", 10)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16])
    outs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10]),
        helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, 10]),
    ]
    return _model(nodes, "mlp", [x], outs, inits)


def cnn(batch: int | str = "N") -> onnx.ModelProto:
    """x[batch, 3, 12, 12] -> Conv/Relu/MaxPool -> Conv/Relu -> AveragePool -> Flatten -> Gemm."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "c1w", "c1b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node(
            "MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node("Conv", ["p1", "c2w", "c2b"], ["c2"], name="conv2", strides=[1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node(
            "AveragePool", ["r2"], ["p2"], name="pool2", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node("Flatten", ["p2"], ["f"], name="flatten", axis=1),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1),
    ]
    inits = [
        _w(rng, "c1w", 8, 3, 3, 3),
        _w(rng, "c1b", 8),
        _w(rng, "c2w", 16, 8, 3, 3),
        _w(rng, "c2b", 16),
        _w(rng, "fw", 10, 16 * 2 * 2),
        _w(rng, "fb", 10),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 12, 12])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])
    return _model(nodes, "cnn", [x], [y], inits)


def control_flow() -> onnx.ModelProto:
    """An If choosing between two branches that read outer values, and a Loop summing x n times."""
    rng = np.random.default_rng(3)
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["t_out"], name="then_mul")],
        "then",
        [],
        [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [2, 4])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Sub", ["x", "scale"], ["e_out"], name="else_sub")],
        "else",
        [],
        [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [2, 4])],
    )
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
            helper.make_node("Add", ["acc_in", "chosen"], ["acc_out"], name="body_add"),
            helper.make_node("Cast", ["i"], ["i_f"], name="body_cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", ["acc_out", "i_f"], ["scan_out"], name="body_scan"),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2, 4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("scan_out", TensorProto.FLOAT, [2, 4]),
        ],
    )
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["pos"], name="positive"),
        helper.make_node(
            "If", ["pos"], ["chosen"], name="branch", then_branch=then_g, else_branch=else_g
        ),
        helper.make_node("Loop", ["trips", "", "zeros"], ["acc", "scans"], name="loop", body=body),
    ]
    inits = [
        _w(rng, "scale", 2, 4),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(3, np.int64), "trips"),
        numpy_helper.from_array(np.zeros((2, 4), np.float32), "zeros"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    outs = [
        helper.make_tensor_value_info("chosen", TensorProto.FLOAT, [2, 4]),
        helper.make_tensor_value_info("acc", TensorProto.FLOAT, [2, 4]),
        helper.make_tensor_value_info("scans", TensorProto.FLOAT, [3, 2, 4]),
    ]
    return _model(nodes, "control_flow", [x], outs, inits)


def typed_constants() -> onnx.ModelProto:
    """Constants of string, bool, int64, float16, bfloat16, int4 and float8, each used by a node."""
    strings = np.array([["kiln", "engine"], ["ünïcode", ""]], dtype=object)
    int4 = np.array([-8, -1, 0, 3, 7, 5, -3], dtype=ml_dtypes.int4)
    bf16 = np.array([1.5, -2.25, 3.0e5, 0.1], dtype=ml_dtypes.bfloat16)
    f8 = np.array([0.5, -1.75, 448.0], dtype=ml_dtypes.float8_e4m3fn)
    f8_value = helper.make_tensor(
        "f8", TensorProto.FLOAT8E4M3FN, [3], f8.view(np.uint8).tobytes(), raw=True
    )
    consts = [
        helper.make_node(
            "Constant", [], ["words"], name="c_str", value=numpy_helper.from_array(strings)
        ),
        helper.make_node("Constant", [], ["f8c"], name="c_f8", value=f8_value),
        helper.make_node(
            "Constant",
            [],
            ["mask"],
            name="c_bool",
            value=numpy_helper.from_array(np.array([True, False, True, True]), "mask_v"),
        ),
    ]
    nodes = [
        *consts,
        helper.make_node("Identity", ["words"], ["words_out"], name="strings"),
        helper.make_node("Greater", ["x", "zero16"], ["xpos"], name="gt"),
        helper.make_node("And", ["xpos", "mask"], ["both"], name="and"),
        helper.make_node("Add", ["n", "i64"], ["n_out"], name="add_i64"),
        helper.make_node("Add", ["h", "f16"], ["h_out"], name="add_f16"),
        helper.make_node("Cast", ["bf"], ["bf_f32"], name="cast_bf16", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["bf_f32", "xf"], ["bf_out"], name="mul_bf16"),
        helper.make_node("DequantizeLinear", ["q4", "q4_scale"], ["q4_out"], name="dq_int4"),
        helper.make_node("Cast", ["f8c"], ["f8_out"], name="cast_f8", to=TensorProto.FLOAT),
    ]
    inits = [
        numpy_helper.from_array(np.array(0.0, np.float16), "zero16"),
        numpy_helper.from_array(np.array([2**40, -3, 0, 7], np.int64), "i64"),
        numpy_helper.from_array(np.array([0.5, -1.0, 65504.0, 1e-3], np.float16), "f16"),
        helper.make_tensor(
            "bf", TensorProto.BFLOAT16, [4], bf16.view(np.uint16).tolist(), raw=False
        ),
        helper.make_tensor("q4", TensorProto.INT4, [7], int4.astype(np.int8).tolist()),
        numpy_helper.from_array(np.array(0.25, np.float32), "q4_scale"),
    ]
    ins = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4]),
        helper.make_tensor_value_info("n", TensorProto.INT64, [4]),
        helper.make_tensor_value_info("h", TensorProto.FLOAT16, [4]),
        helper.make_tensor_value_info("xf", TensorProto.FLOAT, [4]),
    ]
    outs = [
        helper.make_tensor_value_info("words_out", TensorProto.STRING, [2, 2]),
        helper.make_tensor_value_info("both", TensorProto.BOOL, [4]),
        helper.make_tensor_value_info("n_out", TensorProto.INT64, [4]),
        helper.make_tensor_value_info("h_out", TensorProto.FLOAT16, [4]),
        helper.make_tensor_value_info("bf_out", TensorProto.FLOAT, [4]),
        helper.make_tensor_value_info("q4_out", TensorProto.FLOAT, [7]),
        helper.make_tensor_value_info("f8_out", TensorProto.FLOAT, [3]),
    ]
    return _model(nodes, "typed_constants", ins, outs, inits)


def float8_initializer() -> onnx.ModelProto:
    """A float8 e4m3fn weight dequantized and multiplied into the input (and a float8 e5m2 one)."""
    w8 = np.array([[0.5, -1.75, 448.0], [-0.015625, 3.0, 0.0]], dtype=ml_dtypes.float8_e4m3fn)
    w5 = np.array([1.0, -57344.0, 0.25], dtype=ml_dtypes.float8_e5m2)
    nodes = [
        helper.make_node("DequantizeLinear", ["w8", "s8"], ["w8f"], name="dq_e4m3"),
        helper.make_node("Cast", ["w5"], ["w5f"], name="cast_e5m2", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "w8f"], ["y0"], name="matmul"),
        helper.make_node("Add", ["y0", "w5f"], ["y"], name="add"),
    ]
    inits = [
        helper.make_tensor(
            "w8", TensorProto.FLOAT8E4M3FN, [2, 3], w8.view(np.uint8).tobytes(), raw=True
        ),
        helper.make_tensor(
            "w5", TensorProto.FLOAT8E5M2, [3], w5.view(np.uint8).tobytes(), raw=True
        ),
        numpy_helper.from_array(np.array(0.5, np.float32), "s8"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])
    return _model(nodes, "float8_initializer", [x], [y], inits)


def residual() -> onnx.ModelProto:
    """A diamond: x -> a -> (b, c) -> b + c -> d, and a skip from a to the end; 'a' is also an output."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="proj"),
        helper.make_node("Relu", ["a"], ["b"], name="left"),
        helper.make_node("Sigmoid", ["a"], ["c"], name="right"),
        helper.make_node("Add", ["b", "c"], ["d"], name="join"),
        helper.make_node("Tanh", ["d"], ["e"], name="tanh"),
        helper.make_node("Add", ["e", "a"], ["y"], name="skip"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])
    outs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8]),
        helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 8]),
    ]
    return _model(nodes, "residual", [x], outs, [_w(rng, "w", 8, 8)])


def chain(length: int = 6) -> onnx.ModelProto:
    """x -> Relu -> Neg -> Relu -> ... : each value read only by the next node."""
    ops = ["Relu", "Neg", "Abs", "Sigmoid", "Tanh", "Exp"]
    names = ["x", *[f"t{i}" for i in range(length - 1)], "y"]
    nodes = [
        helper.make_node(ops[i % len(ops)], [names[i]], [names[i + 1]], name=f"step{i}")
        for i in range(length)
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])
    return _model(nodes, "chain", [x], [y])


def light_models() -> list[Path]:
    """The model files of ONNX's light model tests (url under onnx/backend/test/data/light/)."""
    from onnx.backend.test.loader import load_model_tests

    prefix = "onnx/backend/test/data/light/"
    cases = [c for c in load_model_tests(kind="real") if c.url.startswith(prefix)]
    return sorted(LIGHT_DIR / c.url[len(prefix) :] for c in cases)


def input_specs(model: onnx.ModelProto) -> list[tuple[str, np.dtype, list[int | str]]]:
    """(name, numpy dtype, dims) of each graph input that is not an initializer."""
    inits = {i.name for i in model.graph.initializer}
    specs = []
    for i in model.graph.input:
        if i.name in inits:
            continue
        t = i.type.tensor_type
        dims = [d.dim_param or d.dim_value for d in t.shape.dim]
        specs.append((i.name, helper.tensor_dtype_to_np_dtype(t.elem_type), dims))
    return specs


def random_feeds(
    model: onnx.ModelProto, rng: np.random.Generator, dims: dict[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Fresh random inputs of the declared shapes; symbolic dims take ``dims`` (default 1)."""
    dims = dims or {}
    feeds = {}
    for name, dtype, shape in input_specs(model):
        shape = [dims.get(d, 1) if isinstance(d, str) else d for d in shape]
        if np.issubdtype(dtype, np.integer):
            feeds[name] = rng.integers(-100, 100, shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[name] = rng.random(shape) < 0.5
        else:
            feeds[name] = rng.standard_normal(shape).astype(dtype)
    return feeds
