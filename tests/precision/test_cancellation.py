"""Cancellation-prone subgraphs stay float32 on fp16 engines: a LayerNorm written with its variance
as E[x^2] - E[x]^2 (as jax2tf and TensorFlow export it), built for the cuda backend's kernels on
CPU tensors in fp16, against onnxruntime in float32."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.precision import cancellation_prone
from tests.passes.util import graph_of, model

pytest.importorskip("torch")

F = TensorProto.FLOAT
D = 256
RNG = np.random.default_rng(11)


def _layer_norm(square: str = "Mul", reduce: str = "ReduceMean", subtract: bool = True):
    """x -> (x - E[x]) / sqrt(E[x^2] - E[x]^2 + eps) * gamma + beta -> MatMul; the variance
    without its ``- E[x]^2`` (an RMS norm, nothing cancels) when not ``subtract``."""
    w = RNG.standard_normal((D, 16)).astype(np.float32) / 16
    gamma = RNG.uniform(0.5, 1.5, D).astype(np.float32)
    beta = RNG.standard_normal(D).astype(np.float32)
    sq = (
        helper.make_node("Mul", ["x", "x"], ["sq"])
        if square == "Mul"
        else helper.make_node("Pow", ["x", "two"], ["sq"])
    )
    if reduce == "ReduceMean":  # axes an attribute (opset 17), and an input for ReduceSum
        sums = [
            helper.make_node("ReduceMean", [v], [s], axes=[-1], keepdims=1)
            for v, s in (("x", "s1"), ("sq", "s2"))
        ]
    else:
        sums = [
            helper.make_node("ReduceSum", [v, "axes"], [s]) for v, s in (("x", "s1"), ("sq", "s2"))
        ]
    nodes = [
        sq,
        *sums,
        helper.make_node("Div", ["s1", "n"], ["mean"]),
        helper.make_node("Div", ["s2", "n"], ["meansq"]),
        helper.make_node("Mul", ["mean", "mean"], ["mean2"]),
        helper.make_node("Sub", ["meansq", "mean2"], ["var"])
        if subtract
        else helper.make_node("Identity", ["meansq"], ["var"]),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Sub", ["x", "mean"], ["centered"]),
        helper.make_node("Div", ["centered", "std"], ["normed"]),
        helper.make_node("Mul", ["normed", "gamma"], ["scaled"]),
        helper.make_node("Add", ["scaled", "beta"], ["ln"]),
        helper.make_node("MatMul", ["ln", "w"], ["y"]),
    ]
    n = np.array(1.0 if reduce == "ReduceMean" else D, np.float32)
    consts = {"two": np.array(2.0, np.float32), "n": n, "eps": np.array(1e-5, np.float32)}
    consts["axes"] = np.array([-1], np.int64)
    consts.update(gamma=gamma, beta=beta, w=w)
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 8, D])],
        [helper.make_tensor_value_info("y", F, [2, 8, 16])],
        [numpy_helper.from_array(a, k) for k, a in consts.items()],
    )


def _inputs() -> np.ndarray:
    # a large mean beside a unit spread: E[x^2] ~ 1600, where float16's spacing is 1
    return (40 + RNG.standard_normal((2, 8, D))).astype(np.float32)


def _fp16_error(m, x: np.ndarray, builder: Builder | None = None, flag: str = "fp16") -> float:
    """Relative L2 of the engine built with ``flag`` against onnxruntime in float32."""
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    config = BuilderConfig(optimization_level=3)
    config.set_flag(flag)
    builder = builder or Builder("cuda", device="cpu")
    engine = builder.build(m, config, progress=False)
    got = engine.create_execution_context().infer({"x": x})["y"]
    got = got.detach().float().numpy() if hasattr(got, "detach") else np.asarray(got)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize(
    ("square", "reduce"), [("Mul", "ReduceMean"), ("Pow", "ReduceSum"), ("Mul", "ReduceSum")]
)
def test_fp16_variance_matches_onnxruntime_fp32(square: str, reduce: str) -> None:
    m = _layer_norm(square, reduce)
    builder = Builder("cuda", device="cpu")
    assert _fp16_error(m, _inputs(), builder) < 1e-2
    notes = [n for n in builder.last_report.notes if "kept in fp32" in n]
    assert len(notes) == 1 and "E[x^2] - E[x]^2" in notes[0]


def test_bf16_variance_matches_onnxruntime_fp32() -> None:
    # bfloat16 has 8 bits: the variance would cancel even sooner than in float16
    assert _fp16_error(_layer_norm(), _inputs(), flag="bf16") < 3e-2


def test_fp16_without_the_rule_loses_the_variance(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure the rule fixes: with nothing kept in fp32 the variance comes out negative or
    zero, and the output is NaN or garbage."""
    import tensorkiln.precision.policy

    monkeypatch.setattr(tensorkiln.precision.policy, "cancellation_prone", lambda graph: {})
    err = _fp16_error(_layer_norm(), _inputs())
    assert np.isnan(err) or err > 0.1


def test_region_stops_at_the_square_root() -> None:
    g = graph_of(_layer_norm())
    kept = {n.outputs[0].name for n in cancellation_prone(g)}
    assert kept == {"sq", "s1", "s2", "mean", "meansq", "mean2", "var", "var_eps", "std"}
    assert not kept & {"centered", "normed", "ln", "y"}  # past the Sqrt: fp16


def test_rms_norm_keeps_nothing() -> None:
    assert cancellation_prone(graph_of(_layer_norm(subtract=False))) == {}


def _integer_matmul():
    """x -> DynamicQuantizeLinear -> MatMulInteger (int32 sums in the millions) -> Cast to float
    -> times the scales: the pattern of onnxruntime's dynamic quantization."""
    # (7-bit weights: onnxruntime's uint8 x int8 MatMulInteger on AVX2 without VNNI adds pairs
    # of products in saturating int16, and larger weights make the oracle itself wrong)
    w = RNG.integers(20, 64, (D, 16)).astype(np.int8)
    w_scale = np.array(0.01, np.float32)
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
        helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["accf"], to=F),
        helper.make_node("Mul", ["xs", "w_scale"], ["scale"]),
        helper.make_node("Mul", ["accf", "scale"], ["y"]),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 8, D])],
        [helper.make_tensor_value_info("y", F, [2, 8, 16])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_scale, "w_scale")],
    )


def test_fp16_integer_accumulator_stays_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _integer_matmul()
    x = RNG.uniform(0, 4, (2, 8, D)).astype(np.float32)
    builder = Builder("cuda", device="cpu")
    assert _fp16_error(m, x, builder) < 1e-2
    assert any("32/64-bit integer" in n for n in builder.last_report.notes)
    import tensorkiln.precision.policy  # without the rule the int32 sums overflow float16 to inf

    monkeypatch.setattr(tensorkiln.precision.policy, "cancellation_prone", lambda graph: {})
    err = _fp16_error(m, x)
    assert np.isnan(err) or err > 0.1
