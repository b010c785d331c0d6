"""Activation recognition runs once, before conv and GEMM fusion (passes/fuse_activation.py).

Before: a Conv or MatMul followed by an activation written out as elementwise math. Expected:
one ConvAct / GemmAct carrying the activation, made by the default PassManager (fuse_gelu /
fuse_silu turn the math into one node first, the conv/GEMM fusion takes that node). Outputs are
compared with the unoptimized graph on the reference backend for fresh random inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.passes import PassManager
from tensorkiln.passes.fuse_activation import fuse_gelu
from tests.passes.util import assert_pass_preserves_outputs, assert_structure, graph_of, model, ops

RNG = np.random.default_rng(46)
F = TensorProto.FLOAT
mk = helper.make_node


def init(name: str, value) -> object:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def feeds(graph) -> dict[str, np.ndarray]:
    return {v.name: RNG.standard_normal(v.shape).astype(np.float32) for v in graph.inputs}


def optimize(graph, stats: dict) -> None:
    pm = PassManager(level=3, backend="cuda")
    pm.run(graph)
    stats.update({k: v for k, v in pm.stats.items() if v})


def gelu_erf(v: str, out: str, sqrt2: float = math.sqrt(2.0)) -> tuple[list, list]:
    """x * (1 + erf(x / sqrt 2)) * 0.5, as the TorchScript exporter writes it."""
    nodes = [
        mk("Div", [v, "sqrt2"], ["d"]),
        mk("Erf", ["d"], ["e"]),
        mk("Add", ["e", "one"], ["e1"]),
        mk("Mul", [v, "e1"], ["m"]),
        mk("Mul", ["m", "half"], [out]),
    ]
    return nodes, [init("sqrt2", sqrt2), init("one", 1.0), init("half", 0.5)]


def gelu_tanh_mul_cube(v: str, out: str) -> tuple[list, list]:
    """(0.5 x) (1 + tanh(sqrt(2/pi) (x + 0.044715 x x x))), the cube as two Muls."""
    nodes = [
        mk("Mul", [v, v], ["xx"]),
        mk("Mul", ["xx", v], ["x3"]),
        mk("Mul", ["k", "x3"], ["q"]),
        mk("Add", ["q", v], ["s"]),
        mk("Mul", ["c", "s"], ["t"]),
        mk("Tanh", ["t"], ["th"]),
        mk("Add", ["one", "th"], ["e1"]),
        mk("Mul", ["half", v], ["h"]),
        mk("Mul", ["e1", "h"], [out]),
    ]
    consts = [("k", 0.044715), ("c", math.sqrt(2 / math.pi)), ("one", 1.0), ("half", 0.5)]
    return nodes, [init(n, c) for n, c in consts]


CONV_INITS = [init("W", RNG.standard_normal((8, 4, 3, 3))), init("B", RNG.standard_normal(8))]
X_CONV = helper.make_tensor_value_info("x", F, [1, 4, 6, 6])


def test_conv_then_gelu_erf_becomes_one_conv_act() -> None:
    act, consts = gelu_erf("y", "out")
    nodes = [mk("Conv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1]), *act]
    out = helper.make_tensor_value_info("out", F, [1, 8, 6, 6])
    g = graph_of(model(nodes, [X_CONV], [out], CONV_INITS + consts))
    stats: dict = {}
    after = assert_pass_preserves_outputs(g, lambda h: optimize(h, stats), feeds(g))
    conv = mk("ConvAct", ["x", "W", "B"], ["out"], domain="tensorkiln", pads=[1, 1, 1, 1])
    conv.attribute.append(helper.make_attribute("activation", "Gelu"))
    expected = graph_of(model([conv], [X_CONV], [out], CONV_INITS, fused=True))
    assert_structure(after, expected)
    assert stats["fuse_gelu"] == 1 and stats["fuse_conv_act"] == 1


@pytest.mark.parametrize(("opset", "silu"), [(17, "tensorkiln.SiLU"), (24, "Swish")])
def test_matmul_bias_silu_becomes_one_gemm_act(opset: int, silu: str) -> None:
    x = helper.make_tensor_value_info("x", F, [2, 5, 16])
    out = helper.make_tensor_value_info("out", F, [2, 5, 32])
    inits = [init("W", RNG.standard_normal((16, 32))), init("bias", RNG.standard_normal(32))]
    nodes = [
        mk("MatMul", ["x", "W"], ["y"]),
        mk("Add", ["y", "bias"], ["b"]),
        mk("Sigmoid", ["b"], ["s"]),
        mk("Mul", ["s", "b"], ["out"]),
    ]
    g = graph_of(model(nodes, [x], [out], inits, opset))
    only_act = PassManager(only=["fuse_silu"])
    assert ops(only_act.run(graph_of(model(nodes, [x], [out], inits, opset)))) == [
        "MatMul",
        "Add",
        silu,
    ]
    stats: dict = {}
    after = assert_pass_preserves_outputs(g, lambda h: optimize(h, stats), feeds(g))
    gemm = mk("GemmAct", ["x", "W", "bias"], ["out"], domain="tensorkiln")
    for k, v in {"activation": "Swish", "activation_alpha": 1.0, "beta": 1.0}.items():
        gemm.attribute.append(helper.make_attribute(k, v))
    assert_structure(after, graph_of(model([gemm], [x], [out], inits, opset, fused=True)))
    assert stats["fuse_silu"] == 1 and stats["fuse_gemm_act"] == 1


def test_matmul_gelu_tanh_with_multiplied_cube() -> None:
    x = helper.make_tensor_value_info("x", F, [4, 16])
    out = helper.make_tensor_value_info("out", F, [4, 32])
    w = init("W", RNG.standard_normal((16, 32)))
    act, consts = gelu_tanh_mul_cube("y", "out")
    g = graph_of(model([mk("MatMul", ["x", "W"], ["y"]), *act], [x], [out], [w, *consts]))
    stats: dict = {}
    after = assert_pass_preserves_outputs(g, lambda h: optimize(h, stats), feeds(g), rtol=1e-4)
    gemm = mk("GemmAct", ["x", "W"], ["out"], domain="tensorkiln", activation="GeluTanh")
    assert_structure(after, graph_of(model([gemm], [x], [out], [w], fused=True)))
    assert stats["fuse_gelu"] == 1 and stats["fuse_gemm_act"] == 1


@pytest.mark.parametrize(("sqrt2", "fused"), [(1.41421, True), (1.414, False)])
def test_gelu_constants_within_1e4_relative(sqrt2: float, fused: bool) -> None:
    """The tolerance the conv fusion took for these constants (1.41421: 2.5e-6 off; 1.414: 1.5e-4)."""
    act, consts = gelu_erf("x", "y", sqrt2)
    io = [helper.make_tensor_value_info(n, F, [3, 7]) for n in ("x", "y")]
    g = graph_of(model(act, io[:1], io[1:], consts))
    counts = []
    after = assert_pass_preserves_outputs(g, lambda h: counts.append(fuse_gelu(h)), feeds(g), 1e-4)
    assert counts == [int(fused)]
    assert ops(after) == (["tensorkiln.Gelu"] if fused else ["Div", "Erf", "Add", "Mul", "Mul"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gelu_constants_as_a_reduced_precision_model_stores_them(dtype: str) -> None:
    """A float16 (bfloat16) model stores 0.044715 as 0.04471 (0.04468), 1.6e-4 (7.7e-4) off:
    within the type's spacing, it is GELU's constant as that model has it, and fuses (as a
    half-precision module exported from PyTorch has it); the outputs stay within the type's
    rounding of the unfused graph's."""
    import ml_dtypes

    np_type = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    proto = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.BFLOAT16
    act, consts = gelu_tanh_mul_cube("x", "y")
    consts = [numpy_helper.from_array(numpy_helper.to_array(c).astype(np_type), c.name)
              for c in consts]  # fmt: skip
    io = [helper.make_tensor_value_info(n, proto, [3, 7]) for n in ("x", "y")]
    g = graph_of(model(act, io[:1], io[1:], consts))
    x = {"x": (RNG.standard_normal((3, 7)) * 2).astype(np_type)}
    counts = []
    tol = 1e-2 if dtype == "float16" else 4e-2
    # (a floor of the type's rounding at the outputs' scale: GELU of a negative input is tiny)
    after = assert_pass_preserves_outputs(g, lambda h: counts.append(fuse_gelu(h)), x, tol, tol)
    assert counts == [1] and ops(after) == ["tensorkiln.Gelu"]
    assert after.nodes[0].attrs.get("approximate") == "tanh"
