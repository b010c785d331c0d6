"""Engine input and output types (precision/io.py; trtexec's --inputIOFormats/--outputIOFormats).

An fp16 engine declared fp16 in and out has no input or output cast layer and takes and gives
float16; an fp32 engine declared fp16 in gets one cast. Results are checked against onnxruntime
on the same values; wrong formats and wrong feeds are one-line errors naming the tensor.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.engine import Engine
from tensorkiln.errors import InputError
from tensorkiln.precision.io import parse_formats
from tests.cli.helpers import ort_outputs


def io_model(path) -> str:
    """y = relu(x @ w + b) + x2 (floats) and a passthrough of an int64 input's shape math:
    z = ids + 1 (int64)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8)).astype(np.float32) / 3
    b = rng.standard_normal(8).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("Add", ["r", "x2"], ["y"]),
        helper.make_node("Add", ["ids", "one"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "io",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [4]),
            helper.make_tensor_value_info("x2", TensorProto.FLOAT, [4, 8]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8]),
            helper.make_tensor_value_info("z", TensorProto.INT64, [4]),
        ],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(b, "b"),
            numpy_helper.from_array(np.array(1, np.int64), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, path)
    return str(path)


def _feeds(rng) -> dict:
    return {
        "x": rng.standard_normal((4, 8)).astype(np.float32),
        "ids": rng.integers(0, 100, 4).astype(np.int64),
        "x2": rng.standard_normal((4, 8)).astype(np.float32),
    }


def _halved(feeds: dict) -> dict:
    return {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}


def _build(path, precision=None, inputs=(), outputs=(), backend="cuda"):
    cfg = BuilderConfig()
    if precision:
        cfg.set_flag(precision)
    cfg.input_io_formats, cfg.output_io_formats = list(inputs), list(outputs)
    device = {"device": "cpu"} if backend == "cuda" else {}
    return Builder(backend, **device).build(path, cfg, progress=False)


def test_fp16_engine_with_fp16_io_has_no_casts(tmp_path):
    pytest.importorskip("torch")
    path = io_model(tmp_path / "m.onnx")
    engine = _build(path, "fp16", ["fp16:chw"], ["fp16:chw"])
    types = {v.name: v.dtype.name for v in (*engine.graph.inputs, *engine.graph.outputs)}
    assert types == {"x": "FLOAT16", "ids": "INT64", "x2": "FLOAT16", "y": "FLOAT16", "z": "INT64"}
    assert not [n.name for n in engine.graph.nodes if "__cast" in n.name or "__io" in n.name]
    feeds = _feeds(np.random.default_rng())
    half = _halved(feeds)
    want = ort_outputs(path, {k: v.astype(np.float32) if v.dtype == np.float16 else v
                              for k, v in half.items()})  # fmt: skip
    got = engine.create_execution_context().infer(half)
    assert got["y"].dtype == np.float16 and got["z"].dtype == np.int64
    err = np.linalg.norm(got["y"].astype(np.float64) - want["y"]) / np.linalg.norm(want["y"])
    assert err < 2e-3
    np.testing.assert_array_equal(got["z"], want["z"])
    # float32 feeds are refused, naming the input and the type it takes
    with pytest.raises(InputError, match="'x' expects dtype float16"):
        engine.create_execution_context().infer(feeds)


def test_fp32_engine_with_fp16_input_casts_once_and_round_trips(tmp_path):
    path = io_model(tmp_path / "m.onnx")
    engine = _build(path, None, ["fp16", "int64", "fp32"], [], backend="reference")
    casts = [n for n in engine.graph.nodes if n.op == "Cast"]
    assert [n.name for n in casts] == ["x__io_in"]
    assert engine.graph.inputs[0].dtype.name == "FLOAT16"
    engine.save(tmp_path / "m.engine")
    loaded = Engine.load(tmp_path / "m.engine")
    assert loaded.graph.inputs[0].dtype.name == "FLOAT16"
    feeds = _feeds(np.random.default_rng())
    feeds["x"] = feeds["x"].astype(np.float16)
    want = ort_outputs(path, {**feeds, "x": feeds["x"].astype(np.float32)})
    got = loaded.create_execution_context().infer(feeds)
    assert got["y"].dtype == np.float32
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-5)
    assert loaded.build["config"]["input_io_formats"] == ["fp16", "int64", "fp32"]


def test_fp32_engine_with_fp16_output_casts_it(tmp_path):
    path = io_model(tmp_path / "m.onnx")
    engine = _build(path, None, [], ["fp16", "int64"], backend="reference")
    assert engine.graph.outputs[0].dtype.name == "FLOAT16"
    feeds = _feeds(np.random.default_rng())
    got = engine.create_execution_context().infer(feeds)["y"]
    want = ort_outputs(path, feeds)["y"]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want.astype(np.float16))


@pytest.mark.parametrize(
    "inputs,message",
    [
        (["fp16", "fp16", "fp16"], "input 'ids' is int64"),  # a float type for an int input
        (["fp16", "fp16"], "2 formats for 3 inputs"),
        (["int64"], "must be a float type"),
        (["fp16:hwc"], "layout 'hwc'"),
        (["fp12"], "unknown type 'fp12'"),
        (["fp64"], "must be a float type .*, not 'double'"),  # (float64 stays as it is)
        (["fp16,"], "empty format"),
    ],
)
def test_bad_formats_are_clear_errors(tmp_path, inputs, message):
    path = io_model(tmp_path / "m.onnx")
    with pytest.raises(InputError, match=message):
        _build(path, None, inputs, [], backend="reference")


def test_formats_parse_as_trtexec_writes_them():
    assert parse_formats("fp16:chw,FP32,int64, bf16:linear", "f") == [
        "fp16",
        "fp32",
        "int64",
        "bf16",
    ]
    assert parse_formats("float16,half,float", "f") == ["fp16", "fp16", "fp32"]
    assert parse_formats("float64,fp64,double", "f") == ["double"] * 3
