"""Tests of the normalization and activation fusions (passes/fuse_norm.py) and their kernels."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tensorkiln
from tensorkiln.kernels.reference import fused_norm as K
from tensorkiln.kernels.reference.elementwise import gelu as onnx_gelu
from tensorkiln.kernels.reference.norm import layer_normalization, rms_normalization
from tensorkiln.passes import fuse_activation as A
from tensorkiln.passes import fuse_norm as F
from tests.passes.util import assert_pass_preserves_outputs, graph_of, model, ops

SHAPE = [2, 5, 8]
PASSES = (
    F.fuse_layer_norm,
    F.fold_residual_into_layer_norm,
    F.fuse_rms_norm,
    A.fuse_gelu,
    A.fuse_silu,
    A.fuse_softmax,
)


def optimize(graph) -> int:
    return sum(p(graph) for p in PASSES)


def vi(name: str, shape=SHAPE):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def ints(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.int64), name)


def feeds(*names: str, shape=SHAPE, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(shape).astype(np.float32) for n in names}


def check(m: onnx.ModelProto, expected: list[str], inputs=("x",), shape=SHAPE):
    """Numerically equal after the passes, and the graph is ``expected`` (Constants dropped)."""
    after = assert_pass_preserves_outputs(graph_of(m), optimize, feeds(*inputs, shape=shape))
    assert [o for o in ops(after) if o != "Constant"] == expected
    return after


def reduce_mean(inp: str, out: str, opset: int, axes=(-1,)) -> list[onnx.NodeProto]:
    if opset >= 18:
        return [
            helper.make_node("Constant", [], [out + "_axes"], value=ints("a", list(axes))),
            helper.make_node("ReduceMean", [inp, out + "_axes"], [out]),
        ]
    return [helper.make_node("ReduceMean", [inp], [out], axes=list(axes))]


def layer_norm_nodes(opset=17, square="Pow", divide="Div", axes=(-1,), exponent=2.0):
    """x -> decomposed LayerNorm -> y (scale 's', bias 'b')."""
    nodes = reduce_mean("x", "mean", opset, axes)
    nodes.append(helper.make_node("Sub", ["x", "mean"], ["d"]))
    if square == "Pow":
        nodes.append(helper.make_node("Pow", ["d", "two"], ["sq"]))
    else:
        nodes.append(helper.make_node("Mul", ["d", "d"], ["sq"]))
    nodes += reduce_mean("sq", "var", opset, axes)
    nodes += [
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["std"]),
    ]
    if divide == "Div":
        nodes.append(helper.make_node("Div", ["d", "std"], ["n"]))
    else:
        nodes.append(helper.make_node("Reciprocal", ["std"], ["r"]))
        nodes.append(helper.make_node("Mul", ["r", "d"], ["n"]))
    nodes += [
        helper.make_node("Mul", ["n", "s"], ["ns"]),
        helper.make_node("Add", ["b", "ns"], ["y"]),
    ]
    return nodes


def ln_inits(exponent=2.0, eps=1e-5, width=SHAPE[-1]):
    rng = np.random.default_rng(1)
    return [
        const("two", exponent),
        const("eps", eps),
        const("s", rng.standard_normal(width)),
        const("b", rng.standard_normal(width)),
    ]


# ---------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("square", ["Pow", "Mul"])
@pytest.mark.parametrize("divide", ["Div", "Reciprocal"])
def test_layer_norm_decomposed(opset, square, divide):
    nodes = layer_norm_nodes(opset, square, divide)
    before = ops(graph_of(model(nodes, [vi("x")], [vi("y")], ln_inits(), opset)))
    assert "Sqrt" in before and "ReduceMean" in before  # Before: the decomposition
    after = check(model(nodes, [vi("x")], [vi("y")], ln_inits(), opset), ["tensorkiln.LayerNorm"])
    node = after.nodes[0]
    assert node.attrs["axis"] == -1 and np.isclose(node.attrs["epsilon"], 1e-5)


def test_layer_norm_over_two_trailing_axes():
    nodes = layer_norm_nodes(axes=(1, 2))
    inits = [*ln_inits()[:2], const("s", np.ones((5, 8))), const("b", np.zeros(8))]
    after = check(model(nodes, [vi("x")], [vi("y")], inits), ["tensorkiln.LayerNorm"])
    assert after.nodes[0].attrs["axis"] == -2


def test_layer_norm_without_affine_gets_unit_scale():
    nodes = layer_norm_nodes()[:-2]
    m = model(nodes, [vi("x")], [vi("n")], ln_inits()[:2])
    after = check(m, ["tensorkiln.LayerNorm"])
    assert np.array_equal(after.nodes[0].inputs[1].const, np.ones(8, np.float32))


@pytest.mark.parametrize(
    "case",
    ["exponent3", "not_last_axis", "d_is_output", "eps_not_const", "axes_differ", "mean_used"],
)
def test_layer_norm_negative(case):
    nodes, inits = layer_norm_nodes(), ln_inits()
    outputs, inputs = [vi("y")], [vi("x")]
    if case == "exponent3":
        inits = ln_inits(exponent=3.0)
    elif case == "not_last_axis":
        nodes = layer_norm_nodes(axes=(1,))
        inits = [*ln_inits()[:2], const("s", np.ones((5, 1))), const("b", np.zeros((5, 1)))]
    elif case == "d_is_output":
        outputs.append(vi("d"))
    elif case == "eps_not_const":
        inits, inputs = inits[:1] + inits[2:], [vi("x"), vi("eps", [1])]
    elif case == "axes_differ":
        nodes = layer_norm_nodes()
        nodes[3] = helper.make_node("ReduceMean", ["sq"], ["var"], axes=[1, 2])
    elif case == "mean_used":
        outputs.append(vi("mean", [2, 5, 1]))
    g = graph_of(model(nodes, inputs, outputs, inits))
    before = ops(g)
    names = [i.name for i in inputs]
    extra = {"eps": np.full([1], 1e-5, np.float32)} if case == "eps_not_const" else {}
    fd = {**feeds(*[n for n in names if n != "eps"]), **extra}
    after = assert_pass_preserves_outputs(g, F.fuse_layer_norm, fd)
    assert ops(after) == before


def test_layer_norm_non_constant_scale_stays_outside():
    nodes = layer_norm_nodes()
    m = model(nodes, [vi("x"), vi("s", [8])], [vi("y")], [ln_inits()[i] for i in (0, 1, 3)])
    g = graph_of(m)
    fd = {**feeds("x"), "s": feeds("s", shape=[8])["s"]}
    after = assert_pass_preserves_outputs(g, optimize, fd)
    assert [o for o in ops(after) if o != "Constant"] == ["tensorkiln.LayerNorm", "Mul", "Add"]


def onnx_layer_norm(opset=17, residual_out=False):
    nodes = [
        helper.make_node("Add", ["a", "r"], ["sum"]),
        helper.make_node("LayerNormalization", ["sum", "s", "b"], ["y"], epsilon=1e-6),
    ]
    outputs = [vi("y")] + ([vi("sum")] if residual_out else [])
    return model(nodes, [vi("a"), vi("r")], outputs, ln_inits()[2:], opset)


def test_layer_norm_onnx_with_residual():
    after = check(onnx_layer_norm(), ["tensorkiln.LayerNorm"], inputs=("a", "r"))
    node = after.nodes[0]
    assert [v.name for v in node.inputs if v is not None] == ["a", "s", "b", "r"]
    assert len(node.outputs) == 1 and node.attrs["epsilon"] == pytest.approx(1e-6)


def test_layer_norm_residual_sum_read_elsewhere_is_second_output():
    after = check(onnx_layer_norm(residual_out=True), ["tensorkiln.LayerNorm"], inputs=("a", "r"))
    assert [v.name for v in after.nodes[0].outputs] == ["y", "sum"]


def test_layer_norm_onnx_with_used_mean_output_is_kept():
    node = helper.make_node("LayerNormalization", ["x", "s"], ["y", "mu"])
    m = model([node], [vi("x")], [vi("y"), vi("mu", [2, 5, 1])], ln_inits()[2:3])
    after = assert_pass_preserves_outputs(graph_of(m), optimize, feeds("x"))
    assert ops(after) == ["LayerNormalization"]


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("square", ["Pow", "Mul"])
@pytest.mark.parametrize("divide", ["Div", "Reciprocal"])
def test_rms_norm_decomposed(opset, square, divide):
    sq = (
        helper.make_node("Pow", ["x", "two"], ["sq"])
        if square == "Pow"
        else helper.make_node("Mul", ["x", "x"], ["sq"])
    )
    nodes = [sq, *reduce_mean("sq", "ms", opset)]
    nodes += [
        helper.make_node("Add", ["ms", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["std"]),
    ]
    if divide == "Div":
        nodes.append(helper.make_node("Div", ["x", "std"], ["n"]))
    else:
        nodes += [
            helper.make_node("Reciprocal", ["std"], ["r"]),
            helper.make_node("Mul", ["x", "r"], ["n"]),
        ]
    nodes.append(helper.make_node("Mul", ["s", "n"], ["y"]))
    m = model(nodes, [vi("x")], [vi("y")], ln_inits()[:3], opset)
    after = check(m, ["tensorkiln.RMSNorm"])
    assert after.nodes[0].inputs[1].name == "s"


def test_rms_norm_onnx_op():
    node = helper.make_node("RMSNormalization", ["x", "s"], ["y"], epsilon=1e-6)
    check(model([node], [vi("x")], [vi("y")], ln_inits()[2:3], 23), ["tensorkiln.RMSNorm"])


def test_rms_norm_negative_exponent():
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1]),
        helper.make_node("Add", ["ms", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["std"]),
        helper.make_node("Div", ["x", "std"], ["y"]),
    ]
    g = graph_of(model(nodes, [vi("x")], [vi("y")], ln_inits(exponent=4.0)[:2]))
    after = assert_pass_preserves_outputs(g, optimize, feeds("x"))
    assert "tensorkiln.RMSNorm" not in ops(after)


# ---------------------------------------------------------------- GELU, SiLU


def gelu_erf_nodes(variant: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    if variant == "torchscript":  # x * (1 + erf(x / sqrt2)) * 0.5
        nodes = [
            helper.make_node("Div", ["x", "c"], ["u"]),
            helper.make_node("Erf", ["u"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["e1"]),
            helper.make_node("Mul", ["x", "e1"], ["m"]),
            helper.make_node("Mul", ["m", "half"], ["y"]),
        ]
        return nodes, [const("c", 1.4142135), const("one", 1.0), const("half", 0.5)]
    nodes = [  # (0.5 * x) * (1 + erf(x * (1/sqrt2)))
        helper.make_node("Mul", ["c", "x"], ["u"]),
        helper.make_node("Erf", ["u"], ["e"]),
        helper.make_node("Add", ["one", "e"], ["e1"]),
        helper.make_node("Mul", ["x", "half"], ["h"]),
        helper.make_node("Mul", ["h", "e1"], ["y"]),
    ]
    return nodes, [const("c", 0.70710677), const("one", 1.0), const("half", 0.5)]


@pytest.mark.parametrize("variant", ["torchscript", "half_first"])
@pytest.mark.parametrize(("opset", "expected"), [(17, "tensorkiln.Gelu"), (20, "Gelu")])
def test_gelu_erf(variant, opset, expected):
    nodes, inits = gelu_erf_nodes(variant)
    after = check(model(nodes, [vi("x")], [vi("y")], inits, opset), [expected])
    assert after.nodes[0].attrs["approximate"] == "none"


def gelu_tanh_nodes(cube: str, k: float = 0.044715):
    nodes = [helper.make_node("Mul", ["x", "half"], ["h"])]
    if cube == "Pow":
        nodes.append(helper.make_node("Pow", ["x", "three"], ["p"]))
    else:
        nodes += [
            helper.make_node("Mul", ["x", "x"], ["xx"]),
            helper.make_node("Mul", ["xx", "x"], ["p"]),
        ]
    nodes += [
        helper.make_node("Mul", ["p", "k"], ["q"]),
        helper.make_node("Add", ["x", "q"], ["s"]),
        helper.make_node("Mul", ["s", "c"], ["t"]),
        helper.make_node("Tanh", ["t"], ["th"]),
        helper.make_node("Add", ["th", "one"], ["e1"]),
        helper.make_node("Mul", ["h", "e1"], ["y"]),
    ]
    inits = [const("half", 0.5), const("three", 3.0), const("k", k)]
    return nodes, [*inits, const("c", 0.7978846), const("one", 1.0)]


@pytest.mark.parametrize("cube", ["Pow", "Mul"])
@pytest.mark.parametrize(("opset", "expected"), [(17, "tensorkiln.Gelu"), (20, "Gelu")])
def test_gelu_tanh(cube, opset, expected):
    nodes, inits = gelu_tanh_nodes(cube)
    after = check(model(nodes, [vi("x")], [vi("y")], inits, opset), [expected])
    assert after.nodes[0].attrs["approximate"] == "tanh"


def test_gelu_negative_constants():
    nodes, inits = gelu_tanh_nodes("Pow", k=0.05)
    g = graph_of(model(nodes, [vi("x")], [vi("y")], inits))
    assert "Tanh" in ops(assert_pass_preserves_outputs(g, optimize, feeds("x")))
    nodes, inits = gelu_erf_nodes("torchscript")
    inits[0] = const("c", 1.5)
    g = graph_of(model(nodes, [vi("x")], [vi("y")], inits))
    assert "Erf" in ops(assert_pass_preserves_outputs(g, optimize, feeds("x")))


@pytest.mark.parametrize(("opset", "expected"), [(17, "tensorkiln.SiLU"), (24, "Swish")])
def test_silu(opset, expected):
    nodes = [helper.make_node("Sigmoid", ["x"], ["g"]), helper.make_node("Mul", ["g", "x"], ["y"])]
    check(model(nodes, [vi("x")], [vi("y")], opset=opset), [expected])


def test_silu_negative_other_operand():
    nodes = [helper.make_node("Sigmoid", ["x"], ["g"]), helper.make_node("Mul", ["g", "z"], ["y"])]
    g = graph_of(model(nodes, [vi("x"), vi("z")], [vi("y")]))
    after = assert_pass_preserves_outputs(g, optimize, feeds("x", "z"))
    assert ops(after) == ["Sigmoid", "Mul"]


# ---------------------------------------------------------------- Softmax


def softmax_nodes(with_max: bool, opset: int = 17, axis: int = -1):
    nodes = []
    src = "x"
    if with_max:
        nodes += [
            helper.make_node("ReduceMax", ["x"], ["mx"], axes=[axis]),
            helper.make_node("Sub", ["x", "mx"], ["xs"]),
        ]
        src = "xs"
    nodes.append(helper.make_node("Exp", [src], ["e"]))
    if opset >= 13:
        nodes += [
            helper.make_node("Constant", [], ["ax"], value=ints("ax", [axis])),
            helper.make_node("ReduceSum", ["e", "ax"], ["s"]),
        ]
    else:
        nodes.append(helper.make_node("ReduceSum", ["e"], ["s"], axes=[axis]))
    nodes.append(helper.make_node("Div", ["e", "s"], ["y"]))
    return nodes


@pytest.mark.parametrize("with_max", [True, False])
@pytest.mark.parametrize("opset", [12, 17])
def test_softmax(with_max, opset):
    after = check(
        model(softmax_nodes(with_max, opset), [vi("x")], [vi("y")], opset=opset), ["Softmax"]
    )
    assert after.nodes[-1].inputs[0].name == "x"


def test_softmax_negative_not_last_axis_and_exp_read_elsewhere():
    g = graph_of(model(softmax_nodes(True, axis=1), [vi("x")], [vi("y")]))
    assert "Softmax" not in ops(assert_pass_preserves_outputs(g, optimize, feeds("x")))
    g = graph_of(model(softmax_nodes(False), [vi("x")], [vi("y"), vi("e")]))
    assert "Softmax" not in ops(assert_pass_preserves_outputs(g, optimize, feeds("x")))


# ---------------------------------------------------------------- kernels against unfused ops


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_layer_norm_kernel_matches_reference(dtype):
    rng = np.random.default_rng(7)
    x, r = (rng.standard_normal((3, 4, 16)).astype(dtype) for _ in range(2))
    s, b = (rng.standard_normal(16).astype(dtype) for _ in range(2))
    y, total = K.layer_norm(x, s, b, r, epsilon=1e-6, _n_outputs=2)
    expect = layer_normalization(x + r, s, b, epsilon=1e-6)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    assert y.dtype == dtype and np.array_equal(total, x + r)
    np.testing.assert_allclose(y, expect, rtol=tol, atol=tol)
    np.testing.assert_allclose(
        K.layer_norm(x, s, axis=-2), layer_normalization(x, s, axis=-2), rtol=tol, atol=tol
    )


def test_rms_gelu_silu_kernels_match_reference():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    s = rng.standard_normal(16).astype(np.float32)
    np.testing.assert_allclose(K.rms_norm(x, s), rms_normalization(x, s), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(K.gelu(x, approximate="tanh"), onnx_gelu(x, approximate="tanh"))
    np.testing.assert_allclose(K.silu(x), x / (1 + np.exp(-x)), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- real exported models

MODELS = [
    pytest.param(
        name,
        dynamo,
        id=f"{name}-{'dynamo' if dynamo else 'torchscript'}",
        marks=[pytest.mark.slow] if dynamo else [],  # the dynamo exporter takes 6-10 s a model
    )
    for name in ("bert", "gpt2", "transformer_encoder")
    for dynamo in (False, True)
]


def _real_model(name: str, dynamo: bool, folder: Path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
    try:
        import test_architectures as arch
    finally:
        sys.path.pop(0)
    module, fd = arch.BUILDERS[name](full=False)
    return arch.export(module, fd, folder, dynamo=dynamo), fd


@pytest.mark.parametrize(("name", "dynamo"), MODELS)
def test_real_model_layer_norms(name, dynamo, tmp_path):
    pytest.importorskip("transformers")
    path, fd = _real_model(name, dynamo, tmp_path)
    graph = tensorkiln.import_onnx(str(path))
    n_ln = sum(n.op == "LayerNormalization" for n in graph.nodes)
    fd = {v.name: fd[v.name] for v in graph.inputs}
    after = assert_pass_preserves_outputs(graph, optimize, fd, rtol=1e-5, atol=1e-5)
    counts = collections.Counter(ops(after))
    assert n_ln > 0 and counts["tensorkiln.LayerNorm"] == n_ln and counts["LayerNormalization"] == 0
    fused = [n for n in after.nodes if n.op == "LayerNorm"]
    assert all(len(n.inputs) == 4 and n.inputs[3] is not None for n in fused)  # residual folded
    assert counts["Erf"] == 0 and counts["Pow"] == 0  # GELU decompositions are gone
