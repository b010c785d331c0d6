"""fuse_gemm_act, merge_shared_matmuls and the tensorkiln.GemmAct kernel."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.kernels.reference import elementwise as ew
from tensorkiln.kernels.reference.fused_gemm import gemm, gemm_act
from tensorkiln.passes.fuse_activation import fuse_gelu, fuse_silu
from tensorkiln.passes.fuse_gemm import fuse_gemm_act, merge_shared_matmuls
from tests.passes.util import assert_pass_preserves_outputs, graph_of, model, ops

RNG = np.random.default_rng(11)
F = TensorProto.FLOAT
mk = helper.make_node


def _rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _init(name: str, arr: np.ndarray):
    return numpy_helper.from_array(np.asarray(arr), name)


# ------------------------------------------------------------------------------------- kernel

ACTS = {
    "": lambda y: y,
    "Relu": ew.relu,
    "Gelu": ew.gelu,
    "GeluTanh": lambda y: ew.gelu(y, approximate="tanh"),
    "Sigmoid": ew.sigmoid,
    "Tanh": np.tanh,
    "Swish": ew.swish,
}


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("trans", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_act_kernel_matches_gemm(act: str, trans: tuple[int, int]) -> None:
    ta, tb = trans
    a = _rand(7, 5) if not ta else _rand(5, 7)
    b = _rand(5, 300) if not tb else _rand(300, 5)
    for c in (None, _rand(300), _rand(7, 1), _rand(7, 300)):
        kw = {"alpha": 0.7, "beta": 1.3, "transA": ta, "transB": tb}
        want = ACTS[act](gemm(a, b, c, **kw))
        got = gemm_act(a, b, c, activation=act, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", list(ACTS))
def test_gemm_act_kernel_batched_matmul(act: str) -> None:
    """A of rank 3 and 4 (batch dims folded); several epilogue blocks of rows."""
    for shape in ((2, 300, 16), (2, 3, 40, 16)):
        a, b, c = _rand(*shape), _rand(16, 600), _rand(600)
        want = ACTS[act](np.matmul(a, b) + c)
        # (atol: a float32 sum of 16 products of unit size near 0 is off by ~1e-6 in any order)
        np.testing.assert_allclose(gemm_act(a, b, c, activation=act), want, rtol=1e-5, atol=1e-5)


def test_gemm_act_kernel_float16_and_errors() -> None:
    a, b, c = _rand(4, 8), _rand(8, 3), _rand(3)
    h = gemm_act(
        a.astype(np.float16), b.astype(np.float16), c.astype(np.float16), activation="Relu"
    )
    assert h.dtype == np.float16
    np.testing.assert_allclose(h, ew.relu(a @ b + c), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="last axis"):
        gemm_act(_rand(2, 4, 8), b, _rand(4, 1))
    with pytest.raises(ValueError, match="unknown activation"):
        gemm_act(a, b, activation="Softplus")


# --------------------------------------------------------------------------------------- pass


def _graph(nodes, inputs, out="out", inits=(), opset=17):
    ins = [helper.make_tensor_value_info(n, F, s) for n, s in inputs]
    return graph_of(model(nodes, ins, [helper.make_tensor_value_info(out, F, None)], inits, opset))


def _feeds(graph) -> dict[str, np.ndarray]:
    return {v.name: _rand(*v.shape) for v in graph.inputs}


def _check(graph, apply, expected: list[str], count: int):
    counts = []

    def run(g) -> None:
        fuse_gelu(g)  # activations written out become one node first, as in the PassManager
        fuse_silu(g)
        counts.append(apply(g))

    after = assert_pass_preserves_outputs(graph, run, _feeds(graph))
    assert ops(after) == expected
    assert counts == [count]
    return after


X = [("x", [2, 5, 16])]
W = _init("W", _rand(16, 32))
BIAS = _init("bias", _rand(32))


def test_matmul_bias_relu() -> None:
    nodes = [
        mk("MatMul", ["x", "W"], ["y"]),
        mk("Add", ["bias", "y"], ["b"]),
        mk("Relu", ["b"], ["out"]),
    ]
    g = _graph(nodes, X, inits=[W, BIAS])
    assert ops(g) == ["MatMul", "Add", "Relu"]
    after = _check(g, fuse_gemm_act, ["tensorkiln.GemmAct"], 1)
    assert after.nodes[0].attrs["activation"] == "Relu" and len(after.nodes[0].inputs) == 3


def _gelu_erf(v: str) -> tuple[list, list]:
    nodes = [
        mk("Div", [v, "sqrt2"], ["d"]),
        mk("Erf", ["d"], ["e"]),
        mk("Add", ["e", "one"], ["e1"]),
        mk("Mul", [v, "e1"], ["m"]),
        mk("Mul", ["m", "half"], ["out"]),
    ]
    consts = [("sqrt2", 1.4142135), ("one", 1.0), ("half", 0.5)]
    return nodes, [_init(n, np.float32(c)) for n, c in consts]


def _gelu_tanh(v: str) -> tuple[list, list]:
    nodes = [
        mk("Mul", [v, "half"], ["h"]),
        mk("Pow", [v, "three"], ["p"]),
        mk("Mul", ["p", "coef"], ["q"]),
        mk("Add", [v, "q"], ["s"]),
        mk("Mul", ["s", "k"], ["r"]),
        mk("Tanh", ["r"], ["t"]),
        mk("Add", ["t", "one"], ["t1"]),
        mk("Mul", ["h", "t1"], ["out"]),
    ]
    consts = [("half", 0.5), ("three", 3.0), ("coef", 0.044715), ("k", 0.7978845608), ("one", 1.0)]
    return nodes, [_init(n, np.float32(c)) for n, c in consts]


def test_matmul_bias_gelu_erf_decomposition() -> None:
    """BERT as the TorchScript exporter writes it."""
    act, consts = _gelu_erf("b")
    nodes = [mk("MatMul", ["x", "W"], ["y"]), mk("Add", ["y", "bias"], ["b"]), *act]
    after = _check(
        _graph(nodes, X, inits=[W, BIAS, *consts]), fuse_gemm_act, ["tensorkiln.GemmAct"], 1
    )
    assert after.nodes[0].attrs["activation"] == "Gelu"


def test_gemm_reshape_gelu_tanh_decomposition() -> None:
    """GPT-2's MLP: Gemm -> Reshape -> gelu_new; the activation moves before the Reshape."""
    act, consts = _gelu_tanh("v")
    shape = _init("shape", np.array([2, 5, 32], np.int64))
    nodes = [mk("Gemm", ["x", "W", "bias"], ["y"]), mk("Reshape", ["y", "shape"], ["v"]), *act]
    g = _graph(nodes, [("x", [10, 16])], inits=[W, BIAS, shape, *consts])
    after = _check(g, fuse_gemm_act, ["tensorkiln.GemmAct", "Reshape"], 1)
    assert after.nodes[0].attrs["activation"] == "GeluTanh"


@pytest.mark.parametrize("kind", ["Sigmoid", "Tanh", "SiLU", "Gelu"])
def test_gemm_activations(kind: str) -> None:
    if kind == "SiLU":
        act = [mk("Sigmoid", ["y"], ["s"]), mk("Mul", ["s", "y"], ["out"])]
    else:
        act = [mk(kind, ["y"], ["out"])]
    nodes = [mk("Gemm", ["x", "W"], ["y"], transB=1, alpha=0.5), *act]
    g = _graph(nodes, [("x", [4, 16])], inits=[_init("W", _rand(32, 16))], opset=20)
    after = _check(g, fuse_gemm_act, ["tensorkiln.GemmAct"], 1)
    assert after.nodes[0].attrs["activation"] == {"SiLU": "Swish"}.get(kind, kind)


# ----------------------------------------------------------------------------- negative cases


def test_two_computed_operands_are_left_alone() -> None:
    """Attention's Q K^T: no constant weight, no fusion."""
    nodes = [
        mk("MatMul", ["q", "k"], ["y"]),
        mk("Add", ["y", "bias"], ["b"]),
        mk("Relu", ["b"], ["out"]),
    ]
    g = _graph(nodes, [("q", [2, 5, 16]), ("k", [2, 16, 32])], inits=[BIAS])
    _check(g, fuse_gemm_act, ["MatMul", "Add", "Relu"], 0)
    _check(g, merge_shared_matmuls, ["MatMul", "Add", "Relu"], 0)


def test_bias_along_another_axis_is_not_fused() -> None:
    nodes = [mk("MatMul", ["x", "W"], ["y"]), mk("Add", ["y", "c"], ["out"])]
    g = _graph(nodes, X, inits=[W, _init("c", _rand(5, 1))])
    _check(g, fuse_gemm_act, ["MatMul", "Add"], 0)


def test_shared_intermediate_is_not_fused() -> None:
    nodes = [mk("MatMul", ["x", "W"], ["y"]), mk("Relu", ["y"], ["out"]), mk("Neg", ["y"], ["n"])]
    g = _graph(nodes, X, inits=[W])
    g.outputs.append(g.nodes[-1].outputs[0])
    _check(g, fuse_gemm_act, ["MatMul", "Relu", "Neg"], 0)


# ----------------------------------------------------------------------------- shared matmuls


def _qkv(bias: bool, ks=(16, 16, 16)) -> tuple[list, list]:
    nodes, inits, outs = [], [], []
    for i, name in enumerate("qkv"):
        inits.append(_init(f"W{name}", _rand(ks[i], 8 * (i + 1))))
        src = "x" if ks[i] == 16 else "x2"
        nodes.append(mk("MatMul", [src, f"W{name}"], [f"{name}0"]))
        last = f"{name}0"
        if bias:
            inits.append(_init(f"b{name}", _rand(8 * (i + 1))))
            nodes.append(mk("Add", [last, f"b{name}"], [f"{name}1"]))
            last = f"{name}1"
        outs.append(last)
    nodes.append(mk("Concat", outs, ["out"], axis=-1))
    return nodes, inits


def test_merge_qkv_projections_with_bias() -> None:
    nodes, inits = _qkv(bias=True)
    g = _graph(nodes, X, inits=inits)

    def apply(graph) -> int:
        assert fuse_gemm_act(graph) == 3
        return merge_shared_matmuls(graph)

    after = _check(g, apply, ["tensorkiln.GemmAct", "Split", "Concat"], 1)
    assert [v.name for v in after.nodes[1].outputs] == ["q1", "k1", "v1"]
    assert after.nodes[1].outputs[0].shape == (2, 5, 8)


def test_merge_plain_matmuls_and_keep_consumers() -> None:
    nodes, inits = _qkv(bias=False)
    _check(_graph(nodes, X, inits=inits), merge_shared_matmuls, ["MatMul", "Split", "Concat"], 1)


def test_different_inputs_are_not_merged() -> None:
    nodes, inits = _qkv(bias=False, ks=(16, 16, 12))
    g = _graph(nodes, [*X, ("x2", [2, 5, 12])], inits=inits)
    _check(g, merge_shared_matmuls, ["MatMul", "MatMul", "Split", "Concat"], 1)


# ------------------------------------------------------------------------------- real models


@pytest.mark.parametrize(
    "name, dynamo",
    [
        ("bert", False),
        ("bert", True),
        ("gpt2", False),
        ("gpt2", True),
        pytest.param("transformer_encoder", True, marks=pytest.mark.slow),
    ],
)
def test_transformers_keep_their_outputs(name: str, dynamo: bool, tmp_path: Path) -> None:
    import tensorkiln
    from tests.models.test_architectures import BUILDERS, export

    net, feeds = BUILDERS[name]()
    graph = tensorkiln.import_onnx(export(net, feeds, tmp_path, dynamo=dynamo))
    counts = []

    def apply(g) -> None:
        fuse_gelu(g)
        fuse_silu(g)
        counts.append(fuse_gemm_act(g))
        counts.append(merge_shared_matmuls(g))

    after = assert_pass_preserves_outputs(graph, apply, feeds)
    fused = collections.Counter(n.attrs.get("activation") for n in after.nodes if n.op == "GemmAct")
    assert counts[0] >= 2 and fused["Gelu"] + fused["GeluTanh"] + fused["Relu"] == 2
    if name == "bert":
        assert counts[1] == 2  # one Q/K/V merge per layer
