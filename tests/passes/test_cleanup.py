"""Clean-up passes: Before/Expected op lists, numeric equality on fresh random inputs, negatives."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.ir.verify import verify
from tensorkiln.passes import PassManager
from tensorkiln.passes.cleanup import (
    constant_folding,
    constant_to_initializer,
    cse,
    dead_code,
    remove_noops,
)
from tests.passes.util import assert_pass_preserves_outputs, graph_of, model, ops

F = TensorProto.FLOAT
CLEANUP = ["constant_to_initializer", "dead_code", "remove_noops", "cse", "constant_folding"]


def rand(*shape: int) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32) + 0.5


def inp(name: str, shape: list, dtype: int = F):
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name: str, data) -> object:
    return numpy_helper.from_array(np.asarray(data), name)


def node(op: str, ins: list[str], outs: list[str], **attrs):
    return helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}", **attrs)


def run_cleanup(graph) -> None:
    PassManager(1, only=CLEANUP, verify=True).run(graph)


# ---------------------------------------------------------------- dead code


def test_dead_code_removes_unread_nodes_and_initializers():
    m = model(
        [
            node("Relu", ["x"], ["a"]),
            node("Exp", ["x"], ["dead1"]),
            node("Add", ["dead1", "w"], ["dead2"]),
        ],
        [inp("x", [2, 3])],
        [inp("a", [2, 3])],
        [const("w", rand(2, 3)), const("unused", rand(4))],
    )
    g = graph_of(m)
    assert ops(g) == ["Relu", "Exp", "Add"]
    after = assert_pass_preserves_outputs(g, dead_code, {"x": rand(2, 3)})
    assert ops(after) == ["Relu"]
    assert after.initializers == []


def test_dead_code_keeps_outer_values_read_by_subgraphs():
    then_g = helper.make_graph(
        [node("Add", ["x", "w"], ["t"]), node("Neg", ["x"], ["t_dead"])],
        "then",
        [],
        [inp("t", [2])],
    )
    else_g = helper.make_graph([node("Mul", ["x", "w"], ["e"])], "else", [], [inp("e", [2])])
    m = model(
        [
            node("ReduceSum", ["x"], ["s"], keepdims=0),
            node("Greater", ["s", "zero"], ["c"]),
            node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
        ],
        [inp("x", [2])],
        [inp("y", [2])],
        [const("w", rand(2)), const("zero", np.float32(0))],
    )
    g = graph_of(m)
    after = assert_pass_preserves_outputs(g, dead_code, {"x": rand(2)})
    assert ops(after) == ["ReduceSum", "Greater", "If"]
    assert [i.name for i in after.initializers] == ["w", "zero"]
    assert ops(after.nodes[2].attrs["then_branch"]) == ["Add"]


def test_dead_code_keeps_graph_outputs_and_inputs():
    m = model([node("Relu", ["x"], ["y"])], [inp("x", [2]), inp("unused", [3])], [inp("y", [2])])
    g = graph_of(m)
    assert dead_code(g) == 0
    assert [v.name for v in g.inputs] == ["x", "unused"]


# ---------------------------------------------------------------- no-ops


@pytest.mark.parametrize(
    ("nodes", "inits", "expected"),
    [
        ([node("Identity", ["x"], ["a"])], [], []),
        ([node("Dropout", ["x"], ["a"], ratio=0.3)], [], []),
        ([node("Dropout", ["x", "r", "f"], ["a", "mask"])], ["r", "f"], []),
        ([node("Cast", ["x"], ["a"], to=F)], [], []),
        ([node("Reshape", ["x", "s23"], ["a"])], ["s23"], []),
        ([node("Transpose", ["x"], ["a"], perm=[0, 1])], [], []),
        ([node("Pad", ["x", "pads0"], ["a"])], ["pads0"], []),
        ([node("Mul", ["one", "x"], ["a"])], ["one"], []),
        ([node("Div", ["x", "one"], ["a"])], ["one"], []),
        ([node("Add", ["zeros3", "x"], ["a"])], ["zeros3"], []),
        ([node("Sub", ["x", "zero"], ["a"])], ["zero"], []),
        ([node("Expand", ["x", "s23"], ["a"])], ["s23"], []),
        (
            [node("Unsqueeze", ["x", "ax0"], ["u"]), node("Squeeze", ["u", "ax0"], ["a"])],
            ["ax0"],
            [],
        ),
    ],
    ids=lambda p: p[0].op_type if isinstance(p, list) and p and hasattr(p[0], "op_type") else "",
)
def test_noop_removed(nodes, inits, expected):
    table = {
        "r": np.float32(0.5),
        "f": np.bool_(False),
        "s23": np.array([2, 3], np.int64),
        "pads0": np.zeros(4, np.int64),
        "one": np.ones((1,), np.float32),
        "zeros3": np.zeros((3,), np.float32),
        "zero": np.float32(0),
        "ax0": np.array([0], np.int64),
    }
    m = model(
        [*nodes, node("Relu", ["a"], ["y"])],
        [inp("x", [2, 3])],
        [inp("y", [2, 3])],
        [const(n, table[n]) for n in inits],
    )
    g = graph_of(m)
    after = assert_pass_preserves_outputs(
        g, lambda gr: (remove_noops(gr), dead_code(gr)), {"x": rand(2, 3)}
    )
    assert ops(after) == [*expected, "Relu"]


@pytest.mark.parametrize(
    ("n", "inits"),
    [
        # broadcasting changes the shape: [2, 3] + [4, 1, 1] zeros is [4, 2, 3]
        (node("Add", ["x", "zeros411"], ["a"]), ["zeros411"]),
        # 0 - x is not x
        (node("Sub", ["zero", "x"], ["a"]), ["zero"]),
        # 1 / x is not x
        (node("Div", ["one", "x"], ["a"]), ["one"]),
        # not all ones
        (node("Mul", ["x", "almost"], ["a"]), ["almost"]),
        # a real transpose, a real pad, a real reshape
        (node("Transpose", ["x"], ["a"]), []),
        (node("Pad", ["x", "pads1"], ["a"]), ["pads1"]),
        (node("Reshape", ["x", "s32"], ["a"]), ["s32"]),
        # dropout in training mode
        (node("Dropout", ["x", "r", "t"], ["a"], seed=1), ["r", "t"]),
        (node("Cast", ["x"], ["a"], to=TensorProto.DOUBLE), []),
    ],
    ids=lambda p: p.op_type if hasattr(p, "op_type") else "",
)
def test_noop_kept(n, inits):
    table = {
        "zeros411": np.zeros((4, 1, 1), np.float32),
        "zero": np.float32(0),
        "one": np.float32(1),
        "almost": np.array([1, 1, 2], np.float32),
        "pads1": np.array([0, 1, 0, 0], np.int64),
        "s32": np.array([3, 2], np.int64),
        "r": np.float32(0.5),
        "t": np.bool_(True),
    }
    m = model(
        [n],
        [inp("x", [2, 3])],
        [helper.make_empty_tensor_value_info("a")],
        [const(k, table[k]) for k in inits],
    )
    g = graph_of(m)
    assert remove_noops(g) == 0
    assert ops(g) == [n.op_type]


def test_noop_graph_output_keeps_its_name():
    m = model(
        [
            node("Relu", ["x"], ["r"]),
            node("Identity", ["r"], ["y"]),
            node("Identity", ["x"], ["z"]),
        ],
        [inp("x", [2, 3])],
        [inp("y", [2, 3]), inp("z", [2, 3])],
    )
    g = graph_of(m)
    after = assert_pass_preserves_outputs(g, remove_noops, {"x": rand(2, 3)})
    # y's Identity goes (Relu's output takes its name); z reads the graph input: it stays
    assert ops(after) == ["Relu", "Identity"]
    assert [v.name for v in after.outputs] == ["y", "z"]
    assert remove_noops(after) == 0  # and no ping-pong on the next round


def test_squeeze_pair_that_changes_shape_is_kept():
    m = model(
        [
            node("Unsqueeze", ["x", "ax0"], ["u"]),
            node("Squeeze", ["u", "ax0"], ["s"]),
            node("Unsqueeze", ["s", "ax2"], ["y"]),
        ],
        [inp("x", [2, 3])],
        [inp("y", [2, 3, 1])],
        [const("ax0", np.array([0], np.int64)), const("ax2", np.array([2], np.int64))],
    )
    g = graph_of(m)
    after = assert_pass_preserves_outputs(
        g, lambda gr: (remove_noops(gr), dead_code(gr)), {"x": rand(2, 3)}
    )
    assert ops(after) == ["Unsqueeze"]


# ---------------------------------------------------------------- CSE


def test_cse_merges_equal_nodes_and_constants():
    m = model(
        [
            node("Add", ["x", "c1"], ["a1"]),
            node("Add", ["x", "c2"], ["a2"]),  # c2 == c1 by value
            node("Relu", ["a1"], ["r1"]),
            node("Relu", ["a2"], ["r2"]),
            node("Transpose", ["r1"], ["t1"], perm=[1, 0]),
            node("Transpose", ["r2"], ["t2"], perm=[0, 1]),  # other attribute: kept
            node("Add", ["r1", "r2"], ["s"]),
        ],
        [inp("x", [3, 3])],
        [inp("s", [3, 3]), inp("t1", [3, 3]), inp("t2", [3, 3])],
        [const("c1", np.full((3,), 2.0, np.float32)), const("c2", np.full((3,), 2.0, np.float32))],
    )
    g = graph_of(m)
    after = assert_pass_preserves_outputs(g, cse, {"x": rand(3, 3)})
    assert ops(after) == ["Add", "Relu", "Transpose", "Transpose", "Add"]
    assert [v.name for v in after.initializers] == ["c1"]


def test_cse_skips_random_ops():
    m = model(
        [
            node("RandomNormalLike", ["x"], ["n1"]),
            node("RandomNormalLike", ["x"], ["n2"]),
            node("Sub", ["n1", "n2"], ["y"]),
        ],
        [inp("x", [3])],
        [inp("y", [3])],
    )
    g = graph_of(m)
    assert cse(g) == 0
    assert ops(g) == ["RandomNormalLike", "RandomNormalLike", "Sub"]


# ---------------------------------------------------------------- constants and folding


def test_constant_folding_keeps_a_scalar_result_scalar():
    """A folded 0-d result stays 0-d: a scalar Gather index folded to shape [1] would add an
    axis to the Gather that reads it (a static BERT's token-type embedding came out 5-D)."""
    m = model(
        [
            node("Gather", ["dims", "zero"], ["n"], axis=0),
            node("Gather", ["table", "n"], ["row"], axis=0),
            node("Add", ["x", "row"], ["y"]),
        ],
        [inp("x", [3])],
        [inp("y", [3])],
        [
            const("dims", np.array([1, 5], np.int64)),
            const("zero", np.array(0, np.int64)),
            const("table", rand(4, 3)),
        ],
    )
    g = graph_of(m)

    def apply(gr):
        assert constant_folding(gr) == 2
        dead_code(gr)

    after = assert_pass_preserves_outputs(g, apply, {"x": rand(3)})
    assert ops(after) == ["Add"]
    folded = {v.name: v.const for v in after.initializers}
    assert folded["row"].shape == (3,)


def test_constant_folding_folds_chains():
    m = model(
        [
            helper.make_node("Constant", [], ["k"], value=const("kv", rand(4, 3))),
            node("Transpose", ["k"], ["kt"], perm=[1, 0]),
            node("Mul", ["kt", "two"], ["k2"]),
            node("MatMul", ["x", "k2"], ["y"]),
        ],
        [inp("x", [2, 3])],
        [inp("y", [2, 4])],
        [const("two", np.float32(2))],
    )
    g = graph_of(m)

    def apply(gr):
        assert constant_to_initializer(gr) == 1
        assert constant_folding(gr) == 2
        dead_code(gr)

    after = assert_pass_preserves_outputs(g, apply, {"x": rand(2, 3)})
    assert ops(after) == ["MatMul"]
    assert [v.name for v in after.initializers] == ["k2"]


def test_constant_folding_does_not_blow_up():
    m = model(
        [
            node(
                "ConstantOfShape",
                ["big"],
                ["z"],
                value=numpy_helper.from_array(np.ones(1, np.float32)),
            ),
            node("Tile", ["w", "reps"], ["tw"]),
            node("Add", ["z", "x"], ["y1"]),
            node("Add", ["tw", "x"], ["y2"]),
        ],
        [inp("x", [1])],
        [inp("y1", [2048, 1024]), inp("y2", [2048, 1024])],
        [
            const("big", np.array([2048, 1024], np.int64)),
            const("w", rand(2, 2)),
            const("reps", np.array([1024, 512], np.int64)),
        ],
    )
    g = graph_of(m)
    assert constant_folding(g) == 0
    assert ops(g) == ["ConstantOfShape", "Tile", "Add", "Add"]


def test_constant_folding_skips_random_and_folds_dequantized_constants():
    """Randomness never folds; a DequantizeLinear of constants (an int32 bias, a weight no
    quantized layer took) folds to the float constant its kernel computes."""
    m = model(
        [
            node("RandomUniform", [], ["r"], shape=[3]),
            node("DequantizeLinear", ["q", "scale"], ["w"]),
            node("Add", ["r", "w"], ["a"]),
            node("Mul", ["a", "x"], ["y"]),
        ],
        [inp("x", [3])],
        [inp("y", [3])],
        [const("q", np.array([1, 2, -3], np.int8)), const("scale", np.float32(0.5))],
    )
    g = graph_of(m)
    assert constant_folding(g) == 1
    assert [n.op for n in g.nodes] == ["RandomUniform", "Add", "Mul"]
    (folded,) = [v for v in g.nodes[1].inputs if v.is_const]
    np.testing.assert_array_equal(folded.const, np.array([0.5, 1.0, -1.5], np.float32))


def test_cleanup_verified_end_to_end():
    m = model(
        [
            node("Identity", ["x"], ["i"]),
            node("Shape", ["i"], ["s"]),
            node("Reshape", ["i", "s"], ["r"]),
            node("Add", ["r", "zero"], ["a"]),
            node("Exp", ["a"], ["e1"]),
            node("Exp", ["a"], ["e2"]),
            node("Add", ["e1", "e2"], ["y"]),
        ],
        [inp("x", [2, 3])],
        [inp("y", [2, 3])],
        [const("zero", np.zeros((1, 3), np.float32))],
    )
    g = graph_of(m)
    after = assert_pass_preserves_outputs(g, run_cleanup, {"x": rand(2, 3)})
    verify(after)
    # the Reshape to the same static shape goes, then the Shape nobody reads
    assert ops(after) == ["Exp", "Add"]


# ---------------------------------------------------------------- real exported models

MODELS = [
    pytest.param("transformer_encoder", False, id="transformer_encoder-torchscript"),
    pytest.param("transformer_encoder", True, id="transformer_encoder-dynamo"),
    pytest.param("gpt2", False, id="gpt2-torchscript"),
]


@pytest.mark.parametrize(("name", "dynamo"), MODELS)
def test_cleanup_on_exported_model(name: str, dynamo: bool, tmp_path) -> None:
    arch = pytest.importorskip("tests.models.test_architectures")
    if name == "gpt2":
        pytest.importorskip("transformers")
    if dynamo:
        pytest.importorskip("onnxscript")
    m, feeds = arch.BUILDERS[name](full=False)
    g = graph_of(arch.export(m, feeds, tmp_path, dynamo=dynamo))
    rng = np.random.default_rng()
    feeds = {
        k: rng.standard_normal(v.shape).astype(v.dtype) if v.dtype == np.float32 else v
        for k, v in feeds.items()
    }
    after = assert_pass_preserves_outputs(g, run_cleanup, feeds)
    assert len(after.nodes) <= len(g.nodes)
    assert "Constant" not in ops(after) and "Identity" not in ops(after)


def test_widening_cast_of_compact_constant_is_not_folded():
    half = numpy_helper.from_array(rand(3).astype(np.float16), "h")
    m = model(
        [node("Cast", ["h"], ["hf"], to=F), node("Add", ["x", "hf"], ["y"])],
        [inp("x", [3])],
        [inp("y", [3])],
        [half],
    )
    g = graph_of(m)
    assert constant_folding(g) == 0
    assert ops(g) == ["Cast", "Add"]


def test_noops_inside_subgraphs():
    then_g = helper.make_graph(
        [
            node("Identity", ["x"], ["tx"]),
            node("Mul", ["tx", "one"], ["tm"]),
            node("Neg", ["tm"], ["t"]),
        ],
        "then",
        [],
        [inp("t", [2])],
    )
    else_g = helper.make_graph([node("Identity", ["x"], ["e"])], "else", [], [inp("e", [2])])
    m = model(
        [
            node("ReduceSum", ["x"], ["s"], keepdims=0),
            node("Greater", ["s", "zero"], ["c"]),
            node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
        ],
        [inp("x", [2])],
        [inp("y", [2])],
        [const("one", np.float32(1)), const("zero", np.float32(0))],
    )
    g = graph_of(m)
    for x in (rand(2), -rand(2) - 1):
        after = assert_pass_preserves_outputs(g, run_cleanup, {"x": x})
    branches = after.nodes[-1].attrs
    assert ops(branches["then_branch"]) == ["Neg"]
    assert ops(branches["else_branch"]) == ["Identity"]  # reads an outer value: keeps its name
