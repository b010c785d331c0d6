"""INT8/FP8 engines on the reference backend, end to end: calibrate, quantize, run.

The oracle is onnxruntime running, with its optimizations off (so it computes exactly what the
nodes say), the float model with QuantizeLinear/DequantizeLinear written in by this test: the
activations at the scales the calibration cache holds, the weights quantized here per output
channel with numpy. tensorkiln's quantized layers sum the quantized products exactly and must
agree with that float emulation to float32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.errors import BuildError
from tensorkiln.ir import DType

ort = pytest.importorskip("onnxruntime")

QMAX = {"int8": 127.0, "fp8": 448.0}
ELEM = {"int8": TensorProto.INT8, "fp8": TensorProto.FLOAT8E4M3FN}
ZERO = {"int8": np.int8(0), "fp8": np.zeros((), ml_dtypes.float8_e4m3fn)}
LAYERS = ("conv1", "conv2", "fc")  # (name, data input) pairs below
DATA_INPUT = {"conv1": "x", "conv2": "r1", "fc": "flat"}
# _model's INT8 engine calibrated on three batches of four against onnxruntime's fp32 run:
# relative L2 3% at the median, 6% at the 90th percentile and up to 14% over 40 draws (with
# the entropy calibrator); a wrong graph or a skipped dequantization is off by about 1
INT8_ERROR = 0.25


def _model(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv+Relu, depthwise Conv+Relu, Flatten, Gemm (transB): three quantizable layers."""
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    b1 = (rng.standard_normal(8) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((8, 1, 3, 3)) * 0.5).astype(np.float32)
    b2 = (rng.standard_normal(8) * 0.1).astype(np.float32)
    w3 = (rng.standard_normal((10, 8 * 8 * 8)) * 0.05).astype(np.float32)
    b3 = (rng.standard_normal(10) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], "conv2", pads=[1] * 4, group=8),
        helper.make_node("Relu", ["c2"], ["r2"], "relu2"),
        helper.make_node("Flatten", ["r2"], ["flat"], "flatten"),
        helper.make_node("Gemm", ["flat", "w3", "b3"], ["y"], "fc", transB=1),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in
             ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"), (w3, "w3"), (b3, "b3"))]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _quantize_weight(w: np.ndarray, precision: str) -> tuple[np.ndarray, np.ndarray]:
    amax = np.abs(w.reshape(w.shape[0], -1)).max(axis=1).astype(np.float64)
    scale = (amax / QMAX[precision]).astype(np.float32)
    y = np.clip(w / scale.reshape(-1, *[1] * (w.ndim - 1)), -QMAX[precision], QMAX[precision])
    q = np.rint(y).astype(np.int8) if precision == "int8" else y.astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def _qdq_model(model: onnx.ModelProto, scales: dict[str, float], precision: str) -> onnx.ModelProto:
    """``model`` with Q/DQ before each layer's data input and its weight (oracle, written here)."""
    g = onnx.ModelProto()
    g.CopyFrom(model)
    graph = g.graph
    weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    zero = numpy_helper.from_array(ZERO[precision], "zp")
    new_inits = [zero]
    new_nodes = []
    for node in graph.node:
        if node.name in DATA_INPUT:
            x, w = node.input[0], node.input[1]
            s = numpy_helper.from_array(np.float32(scales[x]), f"{x}_s")
            wq, ws = _quantize_weight(weights[w], precision)
            new_inits += [s, numpy_helper.from_array(ws, f"{w}_s")]
            q = numpy_helper.from_array(wq, f"{w}_q") if precision == "int8" else _f8(wq, f"{w}_q")
            new_inits.append(q)
            new_nodes += [
                helper.make_node("QuantizeLinear", [x, f"{x}_s", "zp"], [f"{x}_q"]),
                helper.make_node("DequantizeLinear", [f"{x}_q", f"{x}_s", "zp"], [f"{x}_dq"]),
                helper.make_node("DequantizeLinear", [f"{w}_q", f"{w}_s"], [f"{w}_dq"], axis=0),
            ]
            node.input[0], node.input[1] = f"{x}_dq", f"{w}_dq"
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    graph.initializer.extend(new_inits)
    onnx.checker.check_model(g)
    return g


def _f8(q: np.ndarray, name: str) -> onnx.TensorProto:
    return helper.make_tensor(
        name, TensorProto.FLOAT8E4M3FN, q.shape, q.view(np.uint8).tobytes(), raw=True
    )


def _run_ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _build(path: Path, precision: str, **calibration) -> object:
    config = BuilderConfig()
    config.set_flag(precision)
    for k, v in calibration.items():
        setattr(config, k, v)
    return Builder("reference").build(path, config)


@pytest.mark.parametrize(
    ("precision", "calibrator"),
    [
        ("int8", "entropy"),
        ("int8", "percentile"),
        ("int8", "mse"),
        ("fp8", "minmax"),
        ("fp8", "mse"),
    ],
)
def test_quantized_engine_matches_onnxruntime_on_the_same_qdq_model(
    tmp_path: Path, precision: str, calibrator: str
) -> None:
    rng = np.random.default_rng()
    model = _model(rng)
    path = tmp_path / "net.onnx"
    onnx.save(model, path)
    calib = [{"x": rng.standard_normal((8, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    cache = tmp_path / "calib.json"
    engine = _build(path, precision, calibration_data=calib, calibration_cache=str(cache),
                    calibrator=calibrator)  # fmt: skip
    layers = {n.name: (n.op, n.precision) for n in engine.graph.nodes if n.name in DATA_INPUT}
    assert layers == {
        "conv1": ("QConvAct", precision),
        "conv2": ("QConvAct", precision),
        "fc": ("QGemmAct", precision),
    }
    import json

    doc = json.loads(cache.read_text())
    assert doc["calibrator"] == calibrator and doc["samples"] == 32
    scales = {k: v["scale"] for k, v in doc["tensors"].items()}
    assert set(scales) == set(DATA_INPUT.values())
    x = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    want = _run_ort(_qdq_model(model, scales, precision), {"x": x})
    float_out = _run_ort(model, {"x": x})
    step = np.abs(want).max() / QMAX[precision]
    err = np.abs(got - want)
    # float32 sums (onnxruntime) against exact ones: a value on a rounding edge of a later
    # quantizer may land one step away, rarely (none in 150 seeds x 5 samples measured here, one
    # in CI), and that sample's outputs all move with it through the dense layer; every other
    # sample agrees to float32 rounding
    off = (err > 1e-4 * np.abs(want).max()).any(axis=tuple(range(1, err.ndim)))
    assert off.sum() <= 1, (off, err.max())
    assert err.max() < 4 * step
    # and quantization did happen: the engine is not the float model
    assert np.abs(got - float_out).max() > 1e-4 * np.abs(float_out).max()
    rel = np.linalg.norm(got - float_out) / np.linalg.norm(float_out)
    assert rel < (0.1 if precision == "int8" else 0.15)  # (a small random net, 32 samples)


def test_the_cache_makes_a_rebuild_skip_calibration(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    path = tmp_path / "net.onnx"
    onnx.save(_model(rng), path)
    cache = tmp_path / "calib.json"
    calib = [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    first = _build(path, "int8", calibration_data=calib, calibration_cache=str(cache))
    assert any("wrote the ranges of 3 tensors" in n for n in first.build["notes"])

    def never():  # calibration data that must not be read
        raise AssertionError("calibration ran although the cache holds every range")
        yield

    second = _build(path, "int8", calibration_data=never(), calibration_cache=str(cache))
    assert any("from the calibration cache" in n for n in second.build["notes"])
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    a = first.create_execution_context().infer({"x": x})["y"]
    b = second.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_array_equal(a, b)
    with pytest.raises(BuildError, match="holds INT8 ranges; this build quantizes to FP8"):
        _build(path, "fp8", calibration_cache=str(cache))
    with pytest.raises(BuildError, match="made by the entropy calibrator, not mse"):
        _build(path, "int8", calibration_cache=str(cache), calibrator="mse")


def test_a_cache_for_another_model_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    path = tmp_path / "net.onnx"
    onnx.save(_model(rng), path)
    cache = tmp_path / "calib.json"
    cache.write_text(
        '{"format": "tensorkiln-calibration", "version": 1, "precision": "int8", '
        '"calibrator": "entropy", "tensors": {"x": {"amax": 2.5}, "other": {"amax": 1.0}}}'
    )
    with pytest.raises(BuildError) as exc:
        _build(path, "int8", calibration_cache=str(cache))
    msg = str(exc.value)
    assert "no range for 2 of the 3 tensors" in msg and "'r1' (read by conv2)" in msg


def test_layers_pinned_to_fp32_stay_float(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    model = _model(rng)
    path = tmp_path / "net.onnx"
    onnx.save(model, path)
    # (32 samples and min-max ranges: this test is about the pinned layer, not a calibrator's
    # choice of ranges; with entropy on one batch of 4, a random net missed the bound in 1 of 20)
    calib = [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)} for _ in range(8)]
    engine = _build(
        path, "int8", calibration_data=calib, layer_precisions={"fc": "fp32"}, calibrator="minmax"
    )
    ops = {n.name: (n.op, n.precision) for n in engine.graph.nodes}
    assert ops["fc"] == ("Gemm", "fp32") and ops["conv1"] == ("QConvAct", "int8")
    # (the count is of every candidate layer, the pinned one among them)
    assert any(
        "int8: 2 of 3 convolution/GEMM layers quantized, 1 kept at a higher precision" in n
        for n in engine.build["notes"]
    ), engine.build["notes"]
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    want = _run_ort(model, {"x": x})
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < INT8_ERROR


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_cuda_backend_builds_the_same_quantized_engine(tmp_path: Path, precision: str) -> None:
    """The cuda backend's kernels (on CPU tensors here) with the reference build's calibration
    cache: the same quantized layers and, to float32 rounding, the same outputs; with fp16 allowed
    too, the quantized layers give fp16 and the rest runs in fp16 (TensorRT's --best)."""
    pytest.importorskip("torch")
    rng = np.random.default_rng()
    path = tmp_path / "net.onnx"
    onnx.save(_model(rng), path)
    cache = tmp_path / "calib.json"
    calib = [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    ref = _build(path, precision, calibration_data=calib, calibration_cache=str(cache))
    config = BuilderConfig()
    config.set_flag(precision)
    config.calibration_cache = str(cache)
    cuda = Builder("cuda", device="cpu").build(path, config)
    ops = {n.name: (n.op, n.precision) for n in cuda.graph.nodes if n.name in DATA_INPUT}
    assert ops == {n.name: (n.op, n.precision) for n in ref.graph.nodes if n.name in DATA_INPUT}
    x = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    want = ref.create_execution_context().infer({"x": x})["y"]
    got = np.asarray(cuda.create_execution_context().infer({"x": x})["y"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    config.set_flag("fp16")
    mixed = Builder("cuda", device="cpu").build(path, config)
    quantized = [n for n in mixed.graph.nodes if n.op in ("QConvAct", "QGemmAct")]
    # fp16 out, or the next layer's 8-bit input where the layer quantizes it (fuse_requantize)
    eight_bit = "INT8" if precision == "int8" else "FLOAT8E4M3FN"
    kinds = [n.outputs[0].dtype.name for n in quantized]
    assert len(quantized) == 3 and set(kinds) == {"FLOAT16", eight_bit}, kinds
    half = np.asarray(mixed.create_execution_context().infer({"x": x})["y"], np.float32)
    # (fp16 activations move a few values across rounding edges: an E4M3 step is 6% of a value)
    bound = 3e-2 if precision == "int8" else 5e-2  # (measured over 15 seeds: <= 0.012, 0.022)
    assert np.linalg.norm(half - want) / np.linalg.norm(want) < bound


def test_int8_with_fp16_takes_every_kind_of_calibration_source(tmp_path: Path) -> None:
    """With fp16 allowed too, the overflow guard reads the calibration data after quantization:
    a list twice, a generator not at all (it is spent), trtexec's random source anew."""
    pytest.importorskip("torch")
    from tensorkiln.precision.calib_data import RandomCalibration

    rng = np.random.default_rng()
    path = tmp_path / "net.onnx"
    onnx.save(_model(rng), path)
    batch = [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)} for _ in range(2)]
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    for source in (batch, iter(batch), RandomCalibration()):
        config = BuilderConfig()
        config.set_flag("int8")
        config.set_flag("fp16")
        config.calibration_data = source
        engine = Builder("cuda", device="cpu").build(path, config)
        assert sum(n.op in ("QConvAct", "QGemmAct") for n in engine.graph.nodes) == 3
        y = np.asarray(engine.create_execution_context().infer({"x": x})["y"], np.float32)
        assert np.all(np.isfinite(y))


def test_the_report_names_quantized_layers_left_on_the_exact_default() -> None:
    """A quantized layer on its float64 default kernel is right but slow on a GPU (every FP8
    convolution of a ResNet-50 ran so once, unnoticed): the build report says which and why."""
    from tensorkiln.builder.precision_choice import (
        quantized_defaults_notes as _quantized_defaults_notes,
    )

    layers = [
        {"name": "a", "op": "tensorkiln.QConvAct", "tactic": "triton_qconv_x"},
        {"name": "b", "op": "tensorkiln.QConvAct", "tactic": "default"},
        {
            "name": "c",
            "op": "tensorkiln.QGemmAct",
            "tactic": "default",
            "candidates": ["d", "t"],
            "rejected": {"t": "relative error 3e-2 vs the float32 oracle"},
        },
        {
            "name": "d",
            "op": "tensorkiln.QConvAct",
            "tactic": "default",
            "candidates": ["d", "t"],
            "fallback": "the default kernel failed on the tuning inputs: X",
        },
        {"name": "e", "op": "Relu", "tactic": "default"},
    ]
    (note,) = _quantized_defaults_notes(layers)
    assert note.startswith("3 of 4 quantized layers run the exact default kernel")
    assert "b: no tensor-core tactic takes its shapes and types" in note
    assert "c: every candidate refused (t: relative error 3e-2" in note
    assert "d: the default kernel failed on the tuning inputs: X" in note
    assert _quantized_defaults_notes(layers[:1] + layers[4:]) == []


def _one_batch_int8(tmp_path: Path, choose: bool | None) -> tuple[Path, BuilderConfig]:
    """_model saved under ``tmp_path`` and an INT8 config calibrated on one random batch, with
    ``choose_precision_per_layer`` = ``choose``."""
    rng = np.random.default_rng()
    path = tmp_path / "net.onnx"
    onnx.save(_model(rng), path)
    config = _choice_config("int8", [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)}])
    config.choose_precision_per_layer = choose
    return path, config


def _choice_config(precision: str, calib) -> BuilderConfig:
    config = BuilderConfig()
    config.set_flag(precision)
    config.set_flag("fp16")
    config.calibration_data = calib
    config.choose_precision_per_layer = True
    return config


def test_layers_measured_slower_quantized_stay_in_the_float_precision(
    tmp_path: Path, monkeypatch
) -> None:
    """--best as TensorRT does it: a quantized layer the autotuner measured no faster than its
    float form is built in the float precision, from the same calibration (data read once,
    given here as a one-shot iterator); the report names it, the others stay quantized, and
    the engine still agrees with onnxruntime."""
    pytest.importorskip("torch")
    from tensorkiln.builder import builder as builder_module

    rng = np.random.default_rng()
    model = _model(rng)
    path = tmp_path / "net.onnx"
    onnx.save(model, path)
    batches = [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    seen = []

    def choice(layers, *a):
        names = sorted(x["name"] for x in layers if x["op"].endswith(("QConvAct", "QGemmAct")))
        seen.append(names)
        return {
            n: {"quantized_ms": 1.0, "quantize_ms": 0.0, "float_ms": 0.5 if n == "conv2" else 2.0,
                "kept": "float" if n == "conv2" else "quantized"}
            for n in names
        }  # fmt: skip

    monkeypatch.setattr(builder_module, "compare_layers", choice)
    builder = Builder("cuda", device="cpu")
    engine = builder.build(path, _choice_config("int8", iter(batches)))
    # compared on the fully quantized build, then once more on the build without conv2
    assert seen == [["conv1", "conv2", "fc"], ["conv1", "fc"]]
    ops = {n.name: (n.op, n.precision) for n in engine.graph.nodes if n.name in DATA_INPUT}
    assert ops["conv2"] == ("ConvAct", "fp16"), ops
    assert ops["conv1"][0] == "QConvAct" and ops["fc"][0] == "QGemmAct", ops
    assert any("1 layers kept in fp16" in n and "conv2" in n for n in engine.build["notes"])
    assert any("int8: 2 of 3 convolution/GEMM layers quantized, 1 kept" in n
               for n in engine.build["notes"]), engine.build["notes"]  # fmt: skip
    assert "3 layers timed both ways" in builder.last_report.summary()
    x = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    got = np.asarray(engine.create_execution_context().infer({"x": x})["y"], np.float32)
    want = _run_ort(model, {"x": x})
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < INT8_ERROR


@pytest.mark.parametrize("rounds", [4, 1])
def test_a_layer_whose_input_quantization_is_no_longer_fused_is_compared_again(
    tmp_path: Path, monkeypatch, rounds: int
) -> None:
    """In the fully quantized build conv1's epilogue writes the int8 input of conv2, so conv2
    pays no quantization; kept in float, conv1 writes float and a QuantizeLinear of its own runs
    before conv2, which makes conv2 slower than its float form too. The builder compares again
    on the new build and keeps conv2 in float as well (fc, cheap enough with its quantization,
    stays int8); with the rounds bounded at 1 it stops after the first comparison."""
    pytest.importorskip("torch")
    from tensorkiln.builder import builder as builder_module

    quantized_ms = {"conv1": 2.0, "conv2": 0.8, "fc": 0.5}
    quantize_ms = {"x_quantize": 0.5, "r1_quantize": 0.5, "flat_quantize": 0.1}
    seen = []
    monkeypatch.setattr(builder_module, "_CHOICE_ROUNDS", rounds)
    engine, builder, model, rng = _build_on_timings(
        tmp_path, monkeypatch, quantized_ms, quantize_ms,
        lambda layers, _made: seen.append(
            sorted(x["name"] for x in layers if x["op"] == "QuantizeLinear")),
    )  # fmt: skip
    ops = {n.name: n.op for n in engine.graph.nodes if n.name in DATA_INPUT}
    choice_made = builder.last_report.precision_choice
    if rounds == 1:
        assert seen == [["flat_quantize", "x_quantize"]]
        assert ops == {"conv1": "ConvAct", "conv2": "QConvAct", "fc": "QGemmAct"}, ops
        assert choice_made["conv2"]["quantize_ms"] == 0.0  # (its quantization was fused then)
    else:  # the first build, the one without conv1, the one without conv1 and conv2
        assert seen == [["flat_quantize", "x_quantize"], ["flat_quantize", "r1_quantize"],
                        ["flat_quantize"]]  # fmt: skip
        assert ops == {"conv1": "ConvAct", "conv2": "ConvAct", "fc": "QGemmAct"}, ops
        assert choice_made["conv2"] == {"quantized_ms": 1.3, "quantize_ms": 0.5,
                                        "float_ms": 1.0, "kept": "float",
                                        "tactic": choice_made["conv2"]["tactic"]}  # fmt: skip
        assert any("2 layers kept in fp16" in n and "conv1, conv2" in n
                   for n in engine.build["notes"]), engine.build["notes"]  # fmt: skip
    assert choice_made["conv1"]["kept"] == "float" and choice_made["fc"]["kept"] == "quantized"
    x = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    got = np.asarray(engine.create_execution_context().infer({"x": x})["y"], np.float32)
    want = _run_ort(model, {"x": x})
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < INT8_ERROR


def _build_on_timings(tmp_path: Path, monkeypatch, quantized_ms: dict, quantize_ms: dict, seen):
    """An INT8 build of _model whose precision choice runs the real comparison over these
    timings (each quantized layer's, each QuantizeLinear's, 1 ms for every layer in float),
    ``seen(layers, choice)`` called each round; (engine, builder, model, rng)."""
    from tensorkiln.builder import builder as builder_module

    real_choice = builder_module.compare_layers

    def choice(layers, floats):
        layers = [dict(layer) for layer in layers]  # (the engine keeps the real records)
        for layer in layers:
            ms = quantized_ms.get(layer["name"], quantize_ms.get(layer["name"]))
            if ms is not None:
                layer["tactic"], layer["timings_ms"] = "t", {"t": ms}
        made = real_choice(layers, dict.fromkeys(quantized_ms, 1.0))
        seen(layers, made)
        return made

    monkeypatch.setattr(builder_module, "compare_layers", choice)
    monkeypatch.setattr(builder_module, "build_ms", _fake_build_ms(quantized_ms, quantize_ms))
    rng = np.random.default_rng()
    model = _model(rng)
    path = tmp_path / "net.onnx"
    onnx.save(model, path)
    batches = [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    builder = Builder("cuda", device="cpu")
    return builder.build(path, _choice_config("int8", iter(batches))), builder, model, rng


def _fake_build_ms(quantized_ms: dict, quantize_ms: dict):
    """build_ms over the tests' timings: a layer's quantized time when it is quantized, 1 ms in
    float, a QuantizeLinear's own."""

    def build_ms(layers: list[dict]) -> float:
        total = 0.0
        for layer in layers:
            name, op = layer.get("name"), layer.get("op", "").rpartition(".")[2]
            if name in quantized_ms:
                total += quantized_ms[name] if op.startswith("Q") else 1.0
            elif op == "QuantizeLinear":
                total += quantize_ms[name]
        return total

    return build_ms


def test_a_chain_faster_quantized_as_a_whole_stays_quantized(tmp_path: Path, monkeypatch) -> None:
    """Layer by layer, conv1 loses quantized (1.1 ms and its input's quantization 0.1, against
    1.0 in float); kept in float, it hands conv2 a QuantizeLinear of its own, and conv2 loses
    too (0.5 + 0.5). But the fully quantized build measures 2.3 ms against the settled one's
    2.6: the builder keeps every layer quantized and says why."""
    pytest.importorskip("torch")

    quantized_ms = {"conv1": 1.1, "conv2": 0.5, "fc": 0.5}
    quantize_ms = {"x_quantize": 0.1, "r1_quantize": 0.5, "flat_quantize": 0.1}
    rounds = []
    engine, builder, model, rng = _build_on_timings(
        tmp_path, monkeypatch, quantized_ms, quantize_ms,
        lambda _layers, made: rounds.append(
            sorted(n for n, c in made.items() if c["kept"] == "float")),
    )  # fmt: skip
    assert rounds[:2] == [["conv1"], ["conv2"]], rounds  # (the layer-by-layer choice)
    ops = {n.name: n.op for n in engine.graph.nodes if n.name in DATA_INPUT}
    assert ops == {"conv1": "QConvAct", "conv2": "QConvAct", "fc": "QGemmAct"}, ops
    notes = engine.build["notes"]
    assert any("every layer kept quantized" in n and "2.300 ms against 2.600 ms" in n
               for n in notes), notes  # fmt: skip
    assert not any("kept in fp16" in n for n in notes), notes
    made = builder.last_report.precision_choice
    assert made["conv1"]["kept"] == made["conv2"]["kept"] == "quantized"
    assert made["conv1"]["overruled"] == "whole build"
    x = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    got = np.asarray(engine.create_execution_context().infer({"x": x})["y"], np.float32)
    want = _run_ort(model, {"x": x})
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < INT8_ERROR


def test_the_choice_keeps_the_fastest_of_its_rounds(monkeypatch) -> None:
    """The stem loses quantized even inside the 8-bit chain (3.0 ms against 1.0); kept in float,
    it hands `a` a QuantizeLinear of its own and `a` loses (0.5 + 0.3 against 0.7), which hands
    `b` one and `b` loses too. Of the builds made (whole 4.0 ms, stem in float 2.3, stem and a
    2.5, all three 2.4) the one with only the stem in float is kept: its graph, its layer
    records and notes, and `a` and `b` marked as overruled."""
    from tensorkiln.builder import builder as builder_module
    from tensorkiln.ir import Graph

    quantized_ms = {"stem": 3.0, "a": 0.5, "b": 0.5}
    floats = {"stem": 1.0, "a": 0.7, "b": 0.7}
    after = {"stem": "a", "a": "b"}  # (kept in float, a layer hands the next its own quantize)

    def layers(slower: set[str]) -> list[dict]:
        out = []
        for name, q in quantized_ms.items():
            if name in slower:
                out.append({"name": name, "op": "tensorkiln.ConvAct", "tactic": "t",
                            "timings_ms": {"t": floats[name]}})  # fmt: skip
                continue
            out.append({"name": name, "op": "tensorkiln.QConvAct", "tactic": "t",
                        "timings_ms": {"t": q}})  # fmt: skip
            if any(after.get(f) == name for f in slower):
                out.append({"name": f"{name}_quantize", "op": "QuantizeLinear", "tactic": "t",
                            "timings_ms": {"t": 0.3}})  # fmt: skip
        return out

    def choice(records, _floats):  # (each layer against its float form, its quantize counted)
        ms = {x["name"]: x["timings_ms"]["t"] for x in records}
        made = {}
        for x in records:
            if x["op"] == "tensorkiln.QConvAct":
                n = x["name"]
                slow = ms[n] + ms.get(f"{n}_quantize", 0.0) >= floats[n]
                made[n] = {"kept": "float" if slow else "quantized"}
        return made

    monkeypatch.setattr(builder_module, "compare_layers", choice)
    report = builder_module.BuildReport()
    report.layers = layers(set())
    report.notes = ["before"]
    report.precision_choice = choice(report.layers, floats)
    state = {"slower": set(), "graphs": []}

    def quantize(graph, slower):
        state["slower"] = set(slower)
        state["graphs"].append(graph)
        return [f"quantized without {sorted(slower)}"]

    def lower(graph):
        report.layers = layers(state["slower"])
        return "fp16"

    class Bar:
        def advance(self, _name):
            pass

    graph, precision = builder_module._settle_precision(
        Graph("g"), floats, report, ["before"], Bar(), "int8", "fp16", quantize, lower
    )
    assert len(state["graphs"]) == 3  # (stem; stem and a; all three)
    assert graph is state["graphs"][0] and precision == "fp16"
    assert [x["name"] for x in report.layers] == ["stem", "a", "a_quantize", "b"]
    assert report.notes[:2] == ["before", "quantized without ['stem']"]
    assert any("1 layers kept in fp16" in n and "stem" in n for n in report.notes), report.notes
    assert any("this mix measured 2.300 ms" in n and "2.400 ms" in n for n in report.notes)
    assert report.precision_choice["stem"]["kept"] == "float"
    for name in ("a", "b"):
        assert report.precision_choice[name] == {"kept": "quantized", "overruled": "faster build"}


def test_the_precision_choice_compares_each_layer_with_its_float_form(
    tmp_path: Path, monkeypatch
) -> None:
    """compare_layers: a quantized layer whose chosen tactic measured no faster than the
    float engine's same-named layer is named; faster ones, layers with no measurement, and
    other ops are not."""
    from tensorkiln.builder import builder as builder_module

    quantized = [
        {"name": "a", "op": "tensorkiln.QConvAct", "tactic": "t", "timings_ms": {"t": 2.0}},
        {"name": "b", "op": "tensorkiln.QConvAct", "tactic": "u", "timings_ms": {"u": 0.5}},
        {"name": "c", "op": "tensorkiln.QGemmAct", "tactic": "default"},  # (not measured)
        {"name": "d", "op": "tensorkiln.QGemmAct", "tactic": "v", "timings_ms": {"v": 1.0}},
        {"name": "q", "op": "QuantizeLinear", "tactic": "w", "timings_ms": {"w": 9.0}},
    ]
    floats = [
        {"name": "a", "op": "tensorkiln.ConvAct", "tactic": "f", "timings_ms": {"f": 1.0}},
        {"name": "b", "op": "tensorkiln.ConvAct", "tactic": "f", "timings_ms": {"f": 1.0}},
        {"name": "c", "op": "tensorkiln.GemmAct", "tactic": "f", "timings_ms": {"f": 1.0}},
        {"name": "d", "op": "MatMul", "tactic": "default", "timings_ms": {"default": 1.0}},
        {"name": "q", "op": "Relu", "tactic": "f", "timings_ms": {"f": 1.0}},
    ]

    def lower(graph, config, backend, policy, report, bar, cache):
        report.layers = floats
        return "fp16"

    monkeypatch.setattr(builder_module, "_lower", lower)
    float_ms = builder_module._float_layer_ms(None, None, None, None, None)
    assert float_ms == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}  # (q is no float GEMM/conv)
    choice = builder_module.compare_layers(quantized, float_ms)
    assert {n for n, c in choice.items() if c["kept"] == "float"} == {"a", "d"}
    assert set(choice) == {"a", "b", "d"}  # (c was not measured quantized: not compared)
    assert choice["b"] == {"quantized_ms": 0.5, "quantize_ms": 0.0, "float_ms": 1.0,
                           "kept": "quantized", "tactic": "u"}  # fmt: skip
    assert choice["a"]["tactic"] == "t" and choice["d"]["tactic"] == "v"


def test_the_precision_choice_counts_a_quantize_that_feeds_only_that_layer() -> None:
    """A QuantizeLinear read by one quantized layer only is part of that layer's cost (kept in
    float, the layer would not need it); one shared by two layers is nobody's."""
    from tensorkiln.builder import builder as builder_module

    def q(name, out, ms):
        return {"name": name, "op": "QuantizeLinear", "tactic": "t", "timings_ms": {"t": ms},
                "inputs": ["x", "s"], "outputs": [out]}  # fmt: skip

    def layer(name, a, ms):
        return {"name": name, "op": "tensorkiln.QGemmAct", "tactic": "t", "timings_ms": {"t": ms},
                "inputs": [a, "sa", "w", "sw"], "outputs": [name + "_y"]}  # fmt: skip

    quantized = [
        q("q_own", "xa", 0.6), layer("a", "xa", 0.5),  # 0.5 + 0.6 >= 1.0: slower
        q("q_shared", "xs", 0.6), layer("b", "xs", 0.5), layer("c", "xs", 0.5),  # 0.5 < 1.0
    ]  # fmt: skip
    choice = builder_module.compare_layers(quantized, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert {n for n, c in choice.items() if c["kept"] == "float"} == {"a"}
    assert choice["a"]["quantize_ms"] == 0.6 and choice["b"]["quantize_ms"] == 0.0


def test_a_quantized_build_times_its_standalone_quantizations(tmp_path: Path, monkeypatch) -> None:
    """A QuantizeLinear has no tactics to choose between, but what it costs is part of the
    quantized layer it feeds: an INT8 build that chooses precisions per layer times its default
    kernel (and the comparison counts it); one that does not choose, and a float build, leave a
    layer without tactics untimed."""
    pytest.importorskip("torch")
    from tensorkiln.builder import builder as builder_module

    real_choice = builder_module.compare_layers
    keep = lambda layers, floats: {}  # noqa: E731  (every layer stays quantized: one lowering)
    monkeypatch.setattr(builder_module, "compare_layers", keep)
    path, config = _one_batch_int8(tmp_path, choose=True)
    builder = Builder("cuda", device="cpu")
    builder.build(path, config)
    layers = {x["name"]: x for x in builder.last_report.layers}
    quantize = [x for x in layers.values() if x["op"] == "QuantizeLinear"]
    assert {x["name"] for x in quantize} == {"x_quantize", "flat_quantize"}, list(layers)
    for x in quantize:
        assert x["tactic"] == "default" and x["timings_ms"]["default"] > 0, x
    choice = real_choice(list(layers.values()), {"conv1": 1e3, "conv2": 1e3, "fc": 1e3})
    assert choice["fc"]["quantize_ms"] == layers["flat_quantize"]["timings_ms"]["default"]
    assert choice["conv1"]["quantize_ms"] == layers["x_quantize"]["timings_ms"]["default"]

    config.choose_precision_per_layer = False
    builder.build(path, config)
    quantize = [x for x in builder.last_report.layers if x["op"] == "QuantizeLinear"]
    assert quantize and not any("timings_ms" in x for x in quantize)

    plain = BuilderConfig()
    plain.set_flag("fp16")
    builder.build(path, plain)
    untimed = [x for x in builder.last_report.layers if "candidates" not in x]
    assert untimed and not any("timings_ms" in x for x in untimed)


def test_the_precision_choice_is_off_on_a_cpu_device_by_default(tmp_path: Path) -> None:
    """On a CPU device the kernels timed are not the GPU's: unless asked, every layer is
    quantized and no float engine is tuned beside the quantized one."""
    pytest.importorskip("torch")
    path, config = _one_batch_int8(tmp_path, choose=None)
    builder = Builder("cuda", device="cpu")
    engine = builder.build(path, config)
    assert "precision choice" not in builder.last_report.phases
    assert sum(n.op in ("QConvAct", "QGemmAct") for n in engine.graph.nodes) == 3


def _residual_model(rng: np.random.Generator, projection: bool = False) -> onnx.ModelProto:
    """Two residual blocks as a ResNet's: r0 = Relu(conv0(x)); r1 = Relu(conv2(Relu(conv1(r0)))
    + r0); r2 = Relu(conv4(Relu(conv3(r1))) + r1); then pool and a Gemm. ``projection``: the
    first block adds a 1x1 convolution of its input, ``short0(r0)``, instead of r0 (a ResNet
    stage's first block)."""
    c = 8
    inits, nodes = [], []

    def conv(name: str, x: str, y: str, cin: int, act: bool = True, k: int = 3) -> None:
        scale = 0.5 / np.sqrt(cin * k * k)
        w = (rng.standard_normal((c, cin, k, k)) * scale).astype(np.float32)
        b = (rng.standard_normal(c) * 0.1).astype(np.float32)
        inits.extend(
            [numpy_helper.from_array(w, f"{name}_w"), numpy_helper.from_array(b, f"{name}_b")]
        )
        out = f"{name}_out" if act else y
        pads = [k // 2] * 4
        nodes.append(
            helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [out], name, pads=pads)
        )
        if act:
            nodes.append(helper.make_node("Relu", [out], [y], f"{name}_relu"))

    conv("conv0", "x", "r0", 3)
    for k, (i, o) in enumerate((("r0", "r1"), ("r1", "r2"))):
        conv(f"conv{2 * k + 1}", i, f"h{k}", c)
        conv(f"conv{2 * k + 2}", f"h{k}", f"s{k}_conv", c, act=False)
        if projection and k == 0:
            conv("short0", i, "p0", c, act=False, k=1)
            i = "p0"
        nodes.append(helper.make_node("Add", [f"s{k}_conv", i], [f"s{k}"], f"add{k}"))
        nodes.append(helper.make_node("Relu", [f"s{k}"], [o], f"relu_add{k}"))
    return _with_classifier(rng, nodes, inits, "r2", c, "resnet", 8, "pool")


def _with_classifier(rng, nodes, inits, source: str, c: int, name: str, side: int, pool: str):
    """The model of ``nodes`` (input x: n x 3 x side x side) then a global average pool (node
    ``pool``) of ``source`` (c channels), Flatten ("flat") and a 10-way Gemm ("fc") to y."""
    w = (rng.standard_normal((10, c)) * 0.3).astype(np.float32)
    inits = [
        *inits, numpy_helper.from_array(w, "fc_w"),
        numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"),
    ]  # fmt: skip
    nodes = [
        *nodes,
        helper.make_node("GlobalAveragePool", [source], ["p"], pool),
        helper.make_node("Flatten", ["p"], ["flat"], "flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["y"], "fc", transB=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, side, side])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 10])
    graph = helper.make_graph(nodes, name, [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_residual_blocks_quantize_as_tensorrt_runs_them(tmp_path: Path, precision: str) -> None:
    """A block's input, quantized for the next convolution, is its residual too: the block's
    last convolution reads it quantized and the block before writes it quantized, so no
    QuantizeLinear runs between blocks. The oracle: onnxruntime's run of the explicit Q/DQ
    model written here from the calibration cache's scales, with the residual read through the
    same Q/DQ pair as the next convolution's input."""
    model, cache, engine = _residual_build(tmp_path, precision)
    layers = {n.name: n for n in engine.graph.nodes}
    code = {"int8": 3, "fp8": 17}[precision]
    for k in range(2):
        last = layers[f"conv{2 * k + 2}"]
        assert last.op == "QConvAct" and len(last.inputs) == 8
        assert last.inputs[5].dtype == (DType.INT8 if precision == "int8" else DType.FLOAT8E4M3FN)
    assert layers["conv2"].attrs["out_dtype"] == code  # (block 1's output, written quantized)
    _no_layer_output_quantized_apart(engine)
    _agrees_with_its_qdq_model(engine, model, cache, precision, (5, 3, 8, 8))


def _residual_build(tmp_path: Path, precision: str, projection: bool = False):
    """_residual_model, calibrated (min-max, a cache) and built on the reference backend: the
    model, the cache's path and the engine."""
    rng = np.random.default_rng()
    model = _residual_model(rng, projection)
    path = tmp_path / "resnet.onnx"
    onnx.save(model, path)
    calib = [{"x": rng.standard_normal((8, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    cache = tmp_path / "calib.json"
    engine = _build(path, precision, calibration_data=calib, calibration_cache=str(cache),
                    calibrator="minmax")  # fmt: skip
    return model, cache, engine


def _no_layer_output_quantized_apart(engine) -> None:
    """No QuantizeLinear reads a quantized layer's output (each writes its own quantized)."""
    made_by = {v: n for n in engine.graph.nodes for v in n.outputs}
    for q in (n for n in engine.graph.nodes if n.op == "QuantizeLinear"):
        assert q.inputs[0] not in made_by or made_by[q.inputs[0]].op != "QConvAct", q.name


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_shortcut_convolution_hands_its_residual_over_quantized(
    tmp_path: Path, precision: str
) -> None:
    """A block whose shortcut is a convolution adds two convolutions' outputs: one of them
    becomes the other's residual, and it is quantized too (calibrated with the layers' inputs),
    so the layer that makes it writes it in 8 bits and the one that adds it reads it so, as
    TensorRT's INT8 ResNets do; no QuantizeLinear runs on its own. The oracle: onnxruntime's
    run of the explicit Q/DQ model written from the calibration cache's scales."""
    model, cache, engine = _residual_build(tmp_path, precision, projection=True)
    (shared,) = {"s0_conv", "p0"} & set(_cache_scales(cache))  # (whichever the fusion picked)
    layers = {n.name: n for n in engine.graph.nodes}
    eight_bit = DType.INT8 if precision == "int8" else DType.FLOAT8E4M3FN
    adds, makes = ("short0", "conv2") if shared == "s0_conv" else ("conv2", "short0")
    assert layers[adds].op == "QConvAct" and layers[adds].inputs[5].dtype == eight_bit
    assert layers[makes].attrs["out_dtype"] == {"int8": 3, "fp8": 17}[precision]
    _no_layer_output_quantized_apart(engine)
    _agrees_with_its_qdq_model(engine, model, cache, precision, (5, 3, 8, 8))


def test_a_cache_without_the_residual_ranges_still_fits(tmp_path: Path) -> None:
    """A calibration cache written before residuals were quantized has the layers' inputs only:
    it still builds, and the residual is read in float."""
    import json

    rng = np.random.default_rng()
    path = tmp_path / "resnet.onnx"
    onnx.save(_residual_model(rng, projection=True), path)
    calib = [{"x": rng.standard_normal((8, 3, 8, 8)).astype(np.float32)} for _ in range(2)]
    cache = tmp_path / "calib.json"
    _build(path, "int8", calibration_data=calib, calibration_cache=str(cache))
    doc = json.loads(cache.read_text())
    for name in ("s0_conv", "p0"):
        doc["tensors"].pop(name, None)
    cache.write_text(json.dumps(doc))
    config = BuilderConfig()
    config.set_flag("int8")
    config.calibration_cache = str(cache)
    builder = Builder("reference")
    engine = builder.build(path, config)
    assert any("no range for 1 residual tensor(s) (" in n for n in builder.last_report.notes)
    residuals = [n.inputs[5] for n in engine.graph.nodes
                 if n.op == "QConvAct" and len(n.inputs) > 5 and n.inputs[5] is not None]  # fmt: skip
    # (the second block's residual is the next layer's input, quantized for it anyway)
    assert sorted(v.dtype.name for v in residuals) == ["FLOAT", "INT8"]


def _stem_model(rng: np.random.Generator) -> onnx.ModelProto:
    """A ResNet's stem: Relu(conv0(x)), a 3x3 max pool of stride 2, then Relu(conv1(.)), pool
    and a Gemm."""
    inits = []
    for name, cin in (("conv0", 3), ("conv1", 8)):
        w = (rng.standard_normal((8, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)
        b = (rng.standard_normal(8) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"{name}_w"), numpy_helper.from_array(b, f"{name}_b")]
    nodes = [
        helper.make_node("Conv", ["x", "conv0_w", "conv0_b"], ["c0"], "conv0", pads=[1] * 4),
        helper.make_node("Relu", ["c0"], ["r0"], "relu0"),
        helper.make_node(
            "MaxPool", ["r0"], ["m"], "pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4
        ),
        helper.make_node("Conv", ["m", "conv1_w", "conv1_b"], ["c1"], "conv1", pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
    ]
    return _with_classifier(rng, nodes, inits, "r1", 8, "stem", 12, "gap")


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_pool_after_a_quantized_layer_pools_8_bit_values(
    tmp_path: Path, precision: str, backend: str
) -> None:
    """Q(MaxPool(y)) = MaxPool(Q(y)): the stem writes its output quantized at the scale of the
    pool's output (the next layer's input), and the pool reads and writes 8 bits; no
    QuantizeLinear but the input's runs. On the cuda backend the stem and its pool are one
    layer (QConvPool, named as the stem), which writes the pooled 8 bits itself. The oracle:
    onnxruntime's run of the explicit Q/DQ model (the quantization after the pool) written from
    the calibration cache's scales."""
    if backend == "cuda":
        pytest.importorskip("torch")
    rng = np.random.default_rng()
    model = _stem_model(rng)
    path = tmp_path / "stem.onnx"
    onnx.save(model, path)
    calib = [{"x": rng.standard_normal((8, 3, 12, 12)).astype(np.float32)} for _ in range(2)]
    cache = tmp_path / "calib.json"
    config = BuilderConfig()
    config.set_flag(precision)
    config.calibration_data, config.calibration_cache = calib, str(cache)
    config.calibrator = "minmax"
    config.choose_precision_per_layer = False
    engine = Builder(backend, device="cpu").build(path, config)
    layers = {n.name: n for n in engine.graph.nodes}
    eight_bit = DType.INT8 if precision == "int8" else DType.FLOAT8E4M3FN
    assert layers["conv0"].outputs[0].dtype == eight_bit
    if backend == "cuda":
        assert layers["conv0"].op == "QConvPool" and "pool" not in layers
        assert layers["conv1"].inputs[0] is layers["conv0"].outputs[0]  # (the pool's, 8-bit)
    else:
        assert layers["conv0"].op == "QConvAct"
        assert layers["pool"].inputs[0].dtype == layers["pool"].outputs[0].dtype == eight_bit
    # (the input's QuantizeLinear, and the classifier's after the average pool)
    quantized = sorted(n.inputs[0].name for n in engine.graph.nodes if n.op == "QuantizeLinear")
    assert quantized == ["flat", "x"]
    _agrees_with_its_qdq_model(engine, model, cache, precision, (5, 3, 12, 12))


def _cache_scales(cache: Path) -> dict[str, float]:
    import json

    return {k: v["scale"] for k, v in json.loads(cache.read_text())["tensors"].items()}


def _agrees_with_its_qdq_model(engine, model, cache: Path, precision: str, shape) -> None:
    """``engine`` against onnxruntime's run of ``model`` with the explicit Q/DQ pairs of the
    calibration cache's scales, on fresh inputs of ``shape``: equal but where a value on a later
    quantizer's rounding edge lands one step away (rarely: one image at most)."""
    oracle = _qdq_model_of(model, _cache_scales(cache), precision)
    x = np.random.default_rng().standard_normal(shape).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    want = _run_ort(oracle, {"x": x})
    err = np.abs(got - want)
    off = (err > 1e-4 * np.abs(want).max()).any(axis=1)
    assert off.sum() <= 1 and err.max() < 4 * np.abs(want).max() / QMAX[precision]


def _qdq_model_of(
    model: onnx.ModelProto, scales: dict[str, float], precision: str
) -> onnx.ModelProto:
    """``model`` with one Q/DQ pair per calibrated tensor, read by every layer that takes it as
    its data input and by the residual adds of it; weights per output channel."""
    g = onnx.ModelProto()
    g.CopyFrom(model)
    graph = g.graph
    weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    inits = [numpy_helper.from_array(ZERO[precision], "zp")]
    nodes = list(graph.node)
    for x, s in scales.items():
        inits.append(numpy_helper.from_array(np.float32(s), f"{x}_s"))
        nodes += [helper.make_node("QuantizeLinear", [x, f"{x}_s", "zp"], [f"{x}_q"]),
                  helper.make_node("DequantizeLinear", [f"{x}_q", f"{x}_s", "zp"], [f"{x}_dq"])]  # fmt: skip
    for node in list(nodes):
        if node.op_type in ("Conv", "Gemm") and node.input[0] in scales:
            w = node.input[1]
            wq, ws = _quantize_weight(weights[w], precision)
            q = numpy_helper.from_array(wq, f"{w}_q") if precision == "int8" else _f8(wq, f"{w}_q")
            inits += [q, numpy_helper.from_array(ws, f"{w}_s")]
            nodes.append(
                helper.make_node("DequantizeLinear", [f"{w}_q", f"{w}_s"], [f"{w}_dq"], axis=0)
            )
            node.input[0], node.input[1] = f"{node.input[0]}_dq", f"{w}_dq"
        if node.op_type == "Add":
            for j, v in enumerate(node.input):
                if v in scales:
                    node.input[j] = f"{v}_dq"
    known = (
        {i.name for i in graph.input}
        | {t.name for t in graph.initializer}
        | {t.name for t in inits}
    )
    ordered = []  # (topological order, as ONNX wants it)
    while nodes:
        ready = [n for n in nodes if all(i in known for i in n.input if i)]
        assert ready, "the oracle's graph has a cycle"
        for n in ready:
            nodes.remove(n)
            ordered.append(n)
            known.update(n.output)
    del graph.node[:]
    graph.node.extend(ordered)
    graph.initializer.extend(inits)
    onnx.checker.check_model(g)
    return g


def test_a_layer_kept_in_float_reads_its_residual_in_float(tmp_path: Path) -> None:
    """The accuracy budget's switch of a residual convolution takes its residual back to float
    with its data input and weight (a budget no quantized layer meets keeps them all float)."""
    rng = np.random.default_rng()
    path = tmp_path / "resnet.onnx"
    onnx.save(_residual_model(rng), path)
    calib = [{"x": rng.standard_normal((8, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    engine = _build(path, "int8", calibration_data=calib, accuracy_budget="0.00001")
    for name in ("conv2", "conv4"):
        (layer,) = [n for n in engine.graph.nodes if n.name == name]
        assert layer.op == "ConvAct" and layer.inputs[3].dtype == DType.FLOAT
