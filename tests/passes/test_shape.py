"""Shape passes: computed shapes become constants; symbolic ones become Reshape targets with 0/-1."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tensorkiln
from tensorkiln.passes import PassManager
from tensorkiln.passes.shape import reshape_target, reshape_targets, static_shapes
from tests.passes.util import assert_pass_preserves_outputs, graph_of, model, ops, run

F, I64 = TensorProto.FLOAT, TensorProto.INT64
LEVEL1 = [
    "constant_to_initializer",
    "dead_code",
    "remove_noops",
    "cse",
    "constant_folding",
    "static_shapes",
    "reshape_targets",
]


def rand(*shape: int) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32) + 0.5


def level1(graph) -> None:
    PassManager(1, only=LEVEL1, verify=True).run(graph)


def i64(name: str, data) -> object:
    return numpy_helper.from_array(np.asarray(data, np.int64), name)


def shape_chain(x_shape: list, tail: list[int]) -> object:
    """x -> Shape -> Gather(0) -> Unsqueeze -> Concat(n, *tail) -> Reshape, as torch exports it."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0, name="gather"),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"], name="unsqueeze"),
        helper.make_node("Concat", ["n1", "tail"], ["target"], axis=0, name="concat"),
        helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape"),
        helper.make_node("Relu", ["r"], ["y"], name="relu"),
    ]
    inits = [i64("zero", 0), i64("ax0", [0]), i64("tail", tail)]
    x = helper.make_tensor_value_info("x", F, x_shape)
    return model(nodes, [x], [helper.make_empty_tensor_value_info("y")], inits)


def test_static_chain_becomes_constant():
    g = graph_of(shape_chain([2, 6, 4], [3, 8]))
    assert ops(g) == ["Shape", "Gather", "Unsqueeze", "Concat", "Reshape", "Relu"]
    after = assert_pass_preserves_outputs(g, level1, {"x": rand(2, 6, 4)})
    assert ops(after) == ["Reshape", "Relu"]
    target = after.nodes[0].inputs[1]
    assert target.const is not None and target.const.tolist() == [2, 3, 8]


def test_static_shapes_counts():
    g = graph_of(shape_chain([2, 6, 4], [3, 8]))
    assert static_shapes(g) == 1
    assert ops(g) == ["Gather", "Unsqueeze", "Concat", "Reshape", "Relu"]


def test_symbolic_batch_becomes_zero():
    g = graph_of(shape_chain(["N", 6, 4], [3, 8]))
    after = assert_pass_preserves_outputs(g, level1, {"x": rand(2, 6, 4)})
    assert ops(after) == ["Reshape", "Relu"]
    assert after.nodes[0].inputs[1].const.tolist() == [0, 3, 8]
    # the same graph on another batch size
    x = rand(5, 6, 4)
    np.testing.assert_allclose(run(after, {"x": x})["y"], run(g, {"x": x})["y"], rtol=1e-6)


def test_symbolic_product_becomes_minus_one():
    # x[N, S, 8] -> Reshape to [N*S, 8]
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Gather", ["s", "one"], ["t"], axis=0),
        helper.make_node("Mul", ["n", "t"], ["nt"]),
        helper.make_node("Unsqueeze", ["nt", "ax0"], ["nt1"]),
        helper.make_node("Concat", ["nt1", "eight"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [i64("zero", 0), i64("one", 1), i64("ax0", [0]), i64("eight", [8])]
    x = helper.make_tensor_value_info("x", F, ["N", "S", 8])
    g = graph_of(model(nodes, [x], [helper.make_empty_tensor_value_info("y")], inits))
    after = assert_pass_preserves_outputs(g, level1, {"x": rand(2, 3, 8)})
    assert ops(after) == ["Reshape"]
    assert after.nodes[0].inputs[1].const.tolist() == [-1, 8]
    x2 = rand(4, 7, 8)
    np.testing.assert_allclose(run(after, {"x": x2})["y"], run(g, {"x": x2})["y"], rtol=1e-6)


def test_two_unknown_entries_are_left_alone():
    # x[M, 8] -> Reshape to [N, S, 8] where M = N*S comes from another input: not expressible
    nodes = [
        helper.make_node("Shape", ["z"], ["s"]),
        helper.make_node("Concat", ["s", "eight"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", F, ["M", 8])
    z = helper.make_tensor_value_info("z", F, ["N", "S"])
    g = graph_of(
        model(nodes, [x, z], [helper.make_empty_tensor_value_info("y")], [i64("eight", [8])])
    )
    assert reshape_targets(g) == 0
    assert ops(g) == ["Shape", "Concat", "Reshape"]


def test_reshape_target_rules():
    assert reshape_target(["N", 4, 32], ("N", 16, 8), False) == [0, 4, 32]
    assert reshape_target(["N", 4, 32], ("N", 16, 8), True) == [-1, 4, 32]  # allowzero: no 0
    assert reshape_target(["S", "N", 8], ("N", "S", 8), False) is None  # transposed dims
    assert reshape_target(["2*N", "S"], ("N", "S", 2), False) == [-1, 0]
    assert reshape_target(["2*N", "S"], ("N", 2, "S"), False) is None
    assert reshape_target([-1, "S"], ("N", 2, "K"), False) is None
    assert reshape_target([3, 4], None, False) == [3, 4]


def test_reshape_from_data_is_left_alone():
    nodes = [helper.make_node("Reshape", ["x", "t"], ["y"])]
    ins = [
        helper.make_tensor_value_info("x", F, [2, 3]),
        helper.make_tensor_value_info("t", I64, [2]),
    ]
    g = graph_of(model(nodes, ins, [helper.make_empty_tensor_value_info("y")]))
    assert reshape_targets(g) == 0 and static_shapes(g) == 0


# ---------------------------------------------------------------- real exported models


def _export_dynamic(name: str, folder: Path) -> tuple[Path, dict]:
    arch = pytest.importorskip("tests.models.test_architectures")
    torch = arch.torch
    model_, feeds = arch.BUILDERS[name](full=False)
    path = folder / "model.onnx"
    args = tuple(torch.from_numpy(x) for x in feeds.values())
    axes = {k: {0: "N", 1: "S"} for k in feeds}
    with warnings.catch_warnings(), arch._no_mha_fastpath(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model_,
            args,
            str(path),
            input_names=list(feeds),
            dynamo=False,
            opset_version=17,
            dynamic_axes=axes,
        )
    return path, feeds


def _other_size(feeds: dict, batch: int, seq: int) -> dict:
    rng = np.random.default_rng()
    out = {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64)}
    if "attention_mask" in feeds:
        out["attention_mask"] = np.ones((batch, seq), np.int64)
        out["attention_mask"][-1, seq // 2 :] = 0
    return out


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_dynamic_axes_models(name: str, tmp_path: Path):
    pytest.importorskip("transformers")
    path, feeds = _export_dynamic(name, tmp_path)
    g = tensorkiln.import_onnx(path)
    shape_ops = ("Shape", "Gather", "Unsqueeze", "Concat", "Reshape")
    count = lambda gr: sum(n.op in shape_ops for n in gr.nodes)  # noqa: E731
    before = len(g.nodes), count(g)
    after = assert_pass_preserves_outputs(g, level1, feeds)
    assert len(after.nodes) < before[0] * 0.6 and count(after) < before[1]
    for batch, seq in ((1, 5), (3, 11)):
        f = _other_size(feeds, batch, seq)
        want, got = run(g, f), run(after, f)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_static_model_has_no_shape_chains_left(tmp_path: Path):
    pytest.importorskip("transformers")
    arch = pytest.importorskip("tests.models.test_architectures")
    m, feeds = arch.build_bert(full=False)
    g = tensorkiln.import_onnx(arch.export(m, feeds, tmp_path, dynamo=False))
    after = assert_pass_preserves_outputs(g, level1, feeds)
    assert not {"Shape", "Constant", "Identity", "ConstantOfShape"} & set(ops(after))


def test_a_static_slice_of_a_symbolic_shape_becomes_a_constant():
    """Slice(Shape(x), -1) of x[N, 4, 8] is [8] whatever N is (an attention's head width, from
    which its scale is computed): known_shape_values makes it a constant, and the chain folds."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "minus1", "big"], ["d"]),
        helper.make_node("Cast", ["d"], ["df"], to=F),
        helper.make_node("Sqrt", ["df"], ["root"]),
        helper.make_node("Div", ["x", "root"], ["y"]),
    ]
    inits = [i64("minus1", [-1]), i64("big", [2**62])]
    x = helper.make_tensor_value_info("x", F, ["N", 4, 8])
    g = graph_of(model(nodes, [x], [helper.make_empty_tensor_value_info("y")], inits))
    after = assert_pass_preserves_outputs(g, PassManager(1, verify=True).run, {"x": rand(2, 4, 8)})
    assert ops(after) == ["Div"]
    assert after.nodes[0].inputs[1].const is not None
    x2 = rand(5, 4, 8)
    np.testing.assert_allclose(run(after, {"x": x2})["y"], run(g, {"x": x2})["y"], rtol=1e-6)


def test_a_minus_one_is_worked_out_to_free_it_for_the_symbolic_entry():
    """A target [N, 4, -1, 7] (N from another tensor's shape) of an x[4*N, 1, 7]: the -1 is 1
    symbolically, so N can take the -1 of the constant target [-1, 4, 1, 7]."""
    nodes = [
        helper.make_node("Shape", ["z"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
        helper.make_node("Concat", ["n1", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Add", ["r", "r"], ["y"]),
    ]
    inits = [i64("zero", 0), i64("ax0", [0]), i64("tail", [4, -1, 7])]
    x = helper.make_tensor_value_info("x", F, ["4*N", 1, 7])
    z = helper.make_tensor_value_info("z", F, ["N", 3])
    g = graph_of(model(nodes, [x, z], [helper.make_empty_tensor_value_info("y")], inits))
    feeds = {"x": rand(8, 1, 7), "z": rand(2, 3)}
    after = assert_pass_preserves_outputs(g, level1, feeds)
    reshape = next(n for n in after.nodes if n.op == "Reshape")
    assert reshape.inputs[1].const is not None
    assert reshape.inputs[1].const.tolist() == [-1, 4, 1, 7]
