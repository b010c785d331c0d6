"""Tests for passes/fold.py: Before and Expected op lists, outputs equal on fresh random inputs."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.ir.verify import verify
from tensorkiln.passes import PassManager
from tensorkiln.passes.fold import (
    fold_batchnorm,
    fold_mul_add_into_conv_gemm,
    merge_reshapes,
    merge_transposes,
    push_transpose_through_pointwise,
)
from tests.passes.util import assert_pass_preserves_outputs, graph_of, model, ops

F = TensorProto.FLOAT
FOLD_PASSES = [
    "fold_batchnorm",
    "fold_mul_add_into_conv_gemm",
    "push_transpose_through_pointwise",
    "merge_transposes",
    "merge_reshapes",
]


def rand(*shape: int, low: float | None = None) -> np.ndarray:
    rng = np.random.default_rng()
    if low is not None:
        return rng.uniform(low, 1.5, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


def init(name: str, a: np.ndarray):
    return numpy_helper.from_array(np.asarray(a), name)


def inp(name: str, shape) -> object:
    return helper.make_tensor_value_info(name, F, shape)


def out(name: str = "y") -> object:
    return helper.make_tensor_value_info(name, F, None)


def bn_inits(c: int, prefix: str = "bn") -> list:
    return [
        init(f"{prefix}_s", rand(c)),
        init(f"{prefix}_b", rand(c)),
        init(f"{prefix}_m", rand(c)),
        init(f"{prefix}_v", rand(c, low=0.2)),
    ]


def bn(x: str, y: str, prefix: str = "bn", **attrs):
    names = [x, f"{prefix}_s", f"{prefix}_b", f"{prefix}_m", f"{prefix}_v"]
    return helper.make_node("BatchNormalization", names, [y], epsilon=1e-3, **attrs)


def check(m, apply, feeds, expected: list[str] | None, count: int | None = None):
    """Run ``apply`` on the graph of ``m``; ops must become ``expected`` and outputs stay equal."""
    graph = graph_of(m)
    counted = []
    after = assert_pass_preserves_outputs(graph, lambda g: counted.append(apply(g)), feeds)
    if expected is not None:
        assert ops(after) == expected
    if count is not None:
        assert counted == [count]
    assert [v.name for v in after.outputs] == [v.name for v in graph.outputs]
    return after


# ---------------------------------------------------------------- fold_batchnorm


@pytest.mark.parametrize("bias", [True, False])
def test_batchnorm_into_conv(bias: bool) -> None:
    inits = [init("w", rand(8, 2, 3, 3)), *bn_inits(8)] + ([init("b", rand(8))] if bias else [])
    nodes = [
        helper.make_node(
            "Conv", ["x", "w"] + (["b"] if bias else []), ["c"], group=2, pads=[1] * 4
        ),
        bn("c", "y"),
    ]
    m = model(nodes, [inp("x", [2, 4, 5, 5])], [out()], inits)
    check(m, fold_batchnorm, {"x": rand(2, 4, 5, 5)}, ["Conv"], 1)


def test_batchnorm_into_grouped_conv_transpose() -> None:
    # weights [C_in, C_out/group, k, k]: the scale runs along axis 1 within each group
    inits = [init("w", rand(4, 3, 2, 2)), init("b", rand(6)), *bn_inits(6)]
    nodes = [
        helper.make_node("ConvTranspose", ["x", "w", "b"], ["c"], group=2, strides=[2, 2]),
        bn("c", "y"),
    ]
    m = model(nodes, [inp("x", [1, 4, 3, 3])], [out()], inits)
    check(m, fold_batchnorm, {"x": rand(1, 4, 3, 3)}, ["ConvTranspose"], 1)


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (6,), (3, 6), (3, 1), ()])
def test_batchnorm_into_gemm(trans_b: int, c_shape) -> None:
    w = rand(6, 5) if trans_b else rand(5, 6)
    inits = [init("w", w), *bn_inits(6)]
    inputs = ["x", "w"]
    if c_shape is not None:
        inits.append(init("c0", rand(*c_shape)))
        inputs.append("c0")
    gemm = helper.make_node("Gemm", inputs, ["g"], transB=trans_b, alpha=0.7, beta=1.3)
    m = model([gemm, bn("g", "y")], [inp("x", [3, 5])], [out()], inits)
    check(m, fold_batchnorm, {"x": rand(3, 5)}, ["Gemm"], 1)


def test_batchnorm_into_2d_matmul_becomes_gemm() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["g"]), bn("g", "y")]
    m = model(nodes, [inp("x", [3, 5])], [out()], [init("w", rand(5, 6)), *bn_inits(6)])
    check(m, fold_batchnorm, {"x": rand(3, 5)}, ["Gemm"], 1)


def test_batchnorm_after_3d_matmul_is_left_alone() -> None:
    # BatchNormalization normalizes axis 1 (the rows here), not the MatMul's output columns
    nodes = [helper.make_node("MatMul", ["x", "w"], ["g"]), bn("g", "y")]
    m = model(nodes, [inp("x", [2, 6, 5])], [out()], [init("w", rand(5, 6)), *bn_inits(6)])
    check(m, fold_batchnorm, {"x": rand(2, 6, 5)}, ["MatMul", "BatchNormalization"], 0)


def test_batchnorm_chain_after_shared_weight() -> None:
    # two Convs read one weight: each gets its own folded weight, the shared one is untouched
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"]),
        bn("c1", "y1", "a"),
        helper.make_node("Conv", ["x", "w"], ["c2"]),
        bn("c2", "y2", "b"),
    ]
    inits = [init("w", rand(3, 3, 1, 1)), *bn_inits(3, "a"), *bn_inits(3, "b")]
    m = model(nodes, [inp("x", [1, 3, 4, 4])], [out("y1"), out("y2")], inits)
    graph = graph_of(m)
    w_before = graph.initializers[0].const.copy()
    after = check(m, fold_batchnorm, {"x": rand(1, 3, 4, 4)}, ["Conv", "Conv"], 2)
    np.testing.assert_array_equal(graph.initializers[0].const, w_before)
    assert len({n.inputs[1] for n in after.nodes}) == 2


def _conv_bn(extra_nodes=(), outputs=("y",), bn_attrs=None, bn_outputs=("y",), const_bn=True):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node(
            "BatchNormalization",
            ["c", "bn_s", "bn_b", "bn_m", "bn_v"],
            list(bn_outputs),
            **(bn_attrs or {}),
        ),
        *extra_nodes,
    ]
    inits = [init("w", rand(3, 3, 1, 1)), *bn_inits(3)]
    inputs = [inp("x", [1, 3, 4, 4])]
    if not const_bn:
        inits = [i for i in inits if i.name != "bn_s"]
        inputs.append(inp("bn_s", [3]))
    return model(nodes, inputs, [out(o) for o in outputs], inits)


def test_batchnorm_negative_cases() -> None:
    x = {"x": rand(1, 3, 4, 4)}
    # the Conv output is also read elsewhere
    shared = _conv_bn([helper.make_node("Relu", ["c"], ["r"])], outputs=("y", "r"))
    check(shared, fold_batchnorm, x, ["Conv", "BatchNormalization", "Relu"], 0)
    # the Conv output is a graph output
    check(_conv_bn(outputs=("y", "c")), fold_batchnorm, x, ["Conv", "BatchNormalization"], 0)
    # scale is not a constant
    m = _conv_bn(const_bn=False)
    check(m, fold_batchnorm, {**x, "bn_s": rand(3)}, ["Conv", "BatchNormalization"], 0)


def test_batchnorm_training_mode_is_left_alone() -> None:
    m = _conv_bn(bn_attrs={"training_mode": 1}, bn_outputs=("y", "rm", "rv"))
    graph = graph_of(m)
    assert fold_batchnorm(graph) == 0
    assert ops(graph) == ["Conv", "BatchNormalization"]


# ---------------------------------------------------------------- fold_mul_add_into_conv_gemm


@pytest.mark.parametrize("shape", [(4, 1, 1), (1, 4, 1, 1), (), (1,), (1, 1, 1, 1)])
def test_mul_add_into_conv(shape) -> None:
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Mul", ["k", "c"], ["m"]),
        helper.make_node("Add", ["m", "a"], ["y"]),
    ]
    inits = [init("w", rand(4, 3, 3, 3)), init("k", rand(*shape)), init("a", rand(*shape))]
    m = model(nodes, [inp("x", [2, 3, 6, 6])], [out()], inits)
    check(m, fold_mul_add_into_conv_gemm, {"x": rand(2, 3, 6, 6)}, ["Conv"], 2)


def test_sub_into_gemm_and_mul_into_matmul() -> None:
    nodes = [
        helper.make_node("Gemm", ["x", "w", "c0"], ["g"], transB=1),
        helper.make_node("Sub", ["g", "a"], ["s"]),
        helper.make_node("MatMul", ["s", "w2"], ["mm"]),
        helper.make_node("Mul", ["mm", "k"], ["y"]),
    ]
    inits = [init("w", rand(6, 5)), init("c0", rand(6)), init("a", rand(6))]
    inits += [init("w2", rand(6, 7)), init("k", rand(7))]
    m = model(nodes, [inp("x", [3, 5])], [out()], inits)
    check(m, fold_mul_add_into_conv_gemm, {"x": rand(3, 5)}, ["Gemm", "MatMul"], 2)


def test_mul_into_grouped_conv_transpose_and_gemm() -> None:
    nodes = [
        helper.make_node("ConvTranspose", ["x", "w"], ["c"], group=3),
        helper.make_node("Mul", ["c", "k"], ["y"]),
        helper.make_node("Gemm", ["v", "w2"], ["g"], alpha=2.0),
        helper.make_node("Add", ["g", "a"], ["z"]),
    ]
    inits = [init("w", rand(6, 2, 3, 3)), init("k", rand(1, 6, 1, 1))]
    inits += [init("w2", rand(4, 5)), init("a", rand(1, 5))]
    m = model(nodes, [inp("x", [1, 6, 4, 4]), inp("v", [3, 4])], [out(), out("z")], inits)
    feeds = {"x": rand(1, 6, 4, 4), "v": rand(3, 4)}
    after = check(m, fold_mul_add_into_conv_gemm, feeds, None, 2)
    assert sorted(ops(after)) == ["ConvTranspose", "Gemm"]


def test_add_into_3d_matmul_is_left_alone() -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["y"]),
    ]
    m = model(nodes, [inp("x", [2, 3, 5])], [out()], [init("w", rand(5, 6)), init("b", rand(6))])
    check(m, fold_mul_add_into_conv_gemm, {"x": rand(2, 3, 5)}, ["MatMul", "Add"], 0)


@pytest.mark.parametrize(
    "shape", [(6,), (1, 1, 6), (6, 1), (2, 4, 1, 1), (1, 4, 6, 6), (1, 1, 4, 1, 1)]
)
def test_mul_by_non_channel_constant_is_left_alone(shape) -> None:
    # varies along the spatial axes or the batch, or would add an axis: not foldable
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Mul", ["c", "k"], ["y"]),
    ]
    inits = [init("w", rand(4, 3, 1, 1)), init("k", rand(*shape))]
    m = model(nodes, [inp("x", [2, 3, 6, 6])], [out()], inits)
    check(m, fold_mul_add_into_conv_gemm, {"x": rand(2, 3, 6, 6)}, ["Conv", "Mul"], 0)


def test_mul_negative_cases() -> None:
    x = {"x": rand(1, 3, 4, 4)}
    conv = helper.make_node("Conv", ["x", "w"], ["c"])
    w = init("w", rand(3, 3, 1, 1))
    # the scale is an input, not a constant
    m = model(
        [conv, helper.make_node("Mul", ["c", "k"], ["y"])],
        [inp("x", [1, 3, 4, 4]), inp("k", [3, 1, 1])],
        [out()],
        [w],
    )
    check(m, fold_mul_add_into_conv_gemm, {**x, "k": rand(3, 1, 1)}, ["Conv", "Mul"], 0)
    # the Conv output is read twice
    nodes = [
        conv,
        helper.make_node("Mul", ["c", "k"], ["y"]),
        helper.make_node("Relu", ["c"], ["r"]),
    ]
    m = model(nodes, [inp("x", [1, 3, 4, 4])], [out(), out("r")], [w, init("k", rand(3, 1, 1))])
    check(m, fold_mul_add_into_conv_gemm, x, ["Conv", "Mul", "Relu"], 0)
    # a constant minus the Conv output
    m = model(
        [conv, helper.make_node("Sub", ["k", "c"], ["y"])],
        [inp("x", [1, 3, 4, 4])],
        [out()],
        [w, init("k", rand(3, 1, 1))],
    )
    check(m, fold_mul_add_into_conv_gemm, x, ["Conv", "Sub"], 0)


# ---------------------------------------------------------------- transposes


def _t(x: str, y: str, perm) -> object:
    return helper.make_node("Transpose", [x], [y], perm=list(perm))


def test_transposes_cancel() -> None:
    nodes = [_t("x", "a", [0, 2, 3, 1]), _t("a", "y", [0, 3, 1, 2])]
    m = model(nodes, [inp("x", [2, 3, 4, 5])], [out()])
    after = check(m, merge_transposes, {"x": rand(2, 3, 4, 5)}, ["Identity"], 1)
    assert after.outputs[0].name == "y"


def test_transposes_compose_and_shared_first_stays() -> None:
    nodes = [
        _t("x", "a", [1, 2, 0]),
        _t("a", "y", [0, 2, 1]),
        helper.make_node("Relu", ["a"], ["r"]),
    ]
    m = model(nodes, [inp("x", [2, 3, 4])], [out(), out("r")])
    after = check(m, merge_transposes, {"x": rand(2, 3, 4)}, None, 1)
    assert sorted(ops(after)) == ["Relu", "Transpose", "Transpose"]
    m = model(nodes[:2], [inp("x", [2, 3, 4])], [out()])
    check(m, merge_transposes, {"x": rand(2, 3, 4)}, ["Transpose"], 1)


def test_push_transpose_through_pointwise_chain() -> None:
    nodes = [
        _t("x", "a", [0, 2, 1]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Mul", ["k", "b"], ["c"]),
        _t("c", "y", [0, 2, 1]),
        _t("c", "z", [2, 1, 0]),
    ]
    m = model(nodes, [inp("x", [2, 3, 4])], [out(), out("z")], [init("k", rand())])
    after = check(m, push_transpose_through_pointwise, {"x": rand(2, 3, 4)}, None, 1)
    # y's composed permutation is the identity: y is now the Mul's output, renamed
    assert sorted(ops(after)) == ["Mul", "Relu", "Transpose"]


def test_push_transpose_left_alone_without_a_transpose_to_meet() -> None:
    # moving the Transpose below the Relu would gain nothing; a tensor operand is not pointwise
    x = {"x": rand(2, 3, 4)}
    m = model(
        [_t("x", "a", [0, 2, 1]), helper.make_node("Relu", ["a"], ["y"])],
        [inp("x", [2, 3, 4])],
        [out()],
    )
    check(m, push_transpose_through_pointwise, x, ["Transpose", "Relu"], 0)
    nodes = [
        _t("x", "a", [0, 2, 1]),
        helper.make_node("Add", ["a", "k"], ["b"]),
        _t("b", "y", [0, 2, 1]),
    ]
    m = model(nodes, [inp("x", [2, 3, 4])], [out()], [init("k", rand(3))])
    check(m, push_transpose_through_pointwise, x, ["Transpose", "Add", "Transpose"], 0)
    # the pointwise result is also read by a non-Transpose
    nodes = [
        _t("x", "a", [0, 2, 1]),
        helper.make_node("Relu", ["a"], ["b"]),
        _t("b", "y", [0, 2, 1]),
    ]
    m = model(nodes, [inp("x", [2, 3, 4])], [out(), out("b")])
    check(m, push_transpose_through_pointwise, x, ["Transpose", "Relu", "Transpose"], 0)


# ---------------------------------------------------------------- reshapes


def _r(x: str, shape: str, y: str, **attrs) -> object:
    return helper.make_node("Reshape", [x, shape], [y], **attrs)


def _shape(name: str, *dims: int):
    return init(name, np.array(dims, np.int64))


@pytest.mark.parametrize("first", ["Reshape", "Flatten", "Unsqueeze"])
def test_reshapes_collapse(first: str) -> None:
    if first == "Reshape":
        n1 = _r("x", "s1", "a")
    elif first == "Flatten":
        n1 = helper.make_node("Flatten", ["x"], ["a"], axis=2)
    else:
        n1 = helper.make_node("Unsqueeze", ["x", "ax"], ["a"])
    nodes = [n1, _r("a", "s2", "y")]
    inits = [_shape("s1", 6, -1), _shape("s2", -1, 0), _shape("ax", 0)]
    m = model(nodes, [inp("x", [2, 3, 4, 5])], [out()], inits)
    expected = ["Reshape"]
    if first == "Flatten":  # 0 copies the Flatten's dim 1 (4): resolved from the static shape
        expected = ["Reshape"]
    check(m, merge_reshapes, {"x": rand(2, 3, 4, 5)}, expected, 1)


def test_reshape_zero_on_a_symbolic_dim_is_left_alone() -> None:
    nodes = [_r("x", "s1", "a"), _r("a", "s2", "y")]
    m = model(nodes, [inp("x", ["N", 12])], [out()], [_shape("s1", 0, 3, 4), _shape("s2", 0, -1)])
    check(m, merge_reshapes, {"x": rand(2, 12)}, ["Reshape", "Reshape"], 0)


def test_reshape_with_allowzero_collapses() -> None:
    nodes = [_r("x", "s1", "a"), _r("a", "s2", "y", allowzero=1)]
    m = model(nodes, [inp("x", ["N", 12])], [out()], [_shape("s1", -1, 4), _shape("s2", 3, -1)])
    check(m, merge_reshapes, {"x": rand(2, 12)}, ["Reshape"], 1)


def test_flatten_after_reshape_merges_only_with_a_static_shape() -> None:
    nodes = [_r("x", "s1", "a"), helper.make_node("Flatten", ["a"], ["y"], axis=-1)]
    m = model(nodes, [inp("x", [2, 3, 4])], [out()], [_shape("s1", 4, 3, 2)])
    check(m, merge_reshapes, {"x": rand(2, 3, 4)}, ["Reshape"], 1)
    m = model(nodes, [inp("x", ["N", 3, 4])], [out()], [_shape("s1", 4, 3, -1)])
    check(m, merge_reshapes, {"x": rand(2, 3, 4)}, ["Reshape", "Flatten"], 0)


def test_linear_bias_batchnorm_becomes_one_gemm() -> None:
    # MatMul + Add (2-D) folds into a Gemm, then the BatchNormalization into that Gemm
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["a"]),
        bn("a", "y"),
    ]
    inits = [init("w", rand(5, 6)), init("b", rand(6)), *bn_inits(6)]
    m = model(nodes, [inp("x", [3, 5])], [out()], inits)

    def apply(graph) -> int:
        pm = PassManager(level=2, only=FOLD_PASSES, verify=True)
        pm.run(graph)
        return sum(pm.stats.values())

    check(m, apply, {"x": rand(3, 5)}, ["Gemm"], 2)


# ---------------------------------------------------------------- real exported models


def _export(build, folder: Path, **options) -> Path:
    torch = pytest.importorskip("torch")
    model_, feeds = build()
    path = folder / "model.onnx"
    args = tuple(torch.from_numpy(x) for x in feeds.values())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model_, args, str(path), input_names=list(feeds), **options)
    return path


def _optimize_and_compare(path: Path, feeds) -> dict[str, int]:
    import tensorkiln
    from tensorkiln.runtime import Runner

    graph = tensorkiln.import_onnx(path)
    feeds = {v.name: feeds[v.name] for v in graph.inputs}
    before = Runner(graph).infer(feeds)
    optimized = copy.deepcopy(graph)
    pm = PassManager(level=2, only=FOLD_PASSES, verify=True)
    pm.run(optimized)
    verify(optimized)
    after = Runner(optimized).infer(feeds)
    assert list(after) == list(before)
    for name in before:
        atol = 1e-5 * float(np.abs(before[name]).max())
        np.testing.assert_allclose(after[name], before[name], rtol=1e-5, atol=atol, err_msg=name)
    return {"nodes_before": len(graph.nodes), "nodes_after": len(optimized.nodes), **pm.stats}


def test_resnet50_batchnorms_fold(tmp_path: Path) -> None:
    # the TorchScript exporter without constant folding keeps all 53 BatchNormalization nodes
    # (with default options both exporters of this torch version fold them already)
    from tests.models.test_architectures import build_resnet50

    path = _export(
        build_resnet50, tmp_path, dynamo=False, opset_version=17, do_constant_folding=False
    )
    stats = _optimize_and_compare(path, build_resnet50()[1])
    assert stats["fold_batchnorm"] == 53
    assert stats["nodes_after"] == stats["nodes_before"] - 53


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_transformer_encoder_exports(dynamo: bool, tmp_path: Path) -> None:
    if dynamo:
        pytest.importorskip("onnxscript")
    from tests.models.test_architectures import build_transformer_encoder, export

    model_, feeds = build_transformer_encoder()
    path = export(model_, feeds, tmp_path, dynamo=dynamo)
    stats = _optimize_and_compare(path, feeds)
    assert stats["nodes_after"] <= stats["nodes_before"]


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_transformers_torchscript_export(name: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.models.test_architectures import BUILDERS, export

    model_, feeds = BUILDERS[name](full=False)
    path = export(model_, feeds, tmp_path, dynamo=False)
    stats = _optimize_and_compare(path, feeds)
    assert stats["nodes_after"] <= stats["nodes_before"]
