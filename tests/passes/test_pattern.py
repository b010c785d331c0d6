"""The pattern language (passes/pattern.py) and its driver (passes/rules.py).

Each test builds a small Before graph, matches or rewrites it, and checks the result: which nodes
a match takes and captures, or the Expected graph after a rewrite plus equal outputs on the
reference backend for fresh random inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.ir import Node
from tensorkiln.passes.pattern import Alt, Const, Found, Op, Scalar, Var, match
from tensorkiln.passes.rules import Rule, View, apply_rules, run_rules
from tests.passes.util import (
    assert_pass_preserves_outputs,
    assert_structure,
    graph_of,
    model,
    ops,
)

RNG = np.random.default_rng(12)
SHAPE = [3, 4]
X = Var("x")
SILU = Op("Mul", [X, Op("Sigmoid", [X], name="sig")], commutative=True)


def vi(name: str):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, SHAPE)


def const(name: str, value) -> object:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def feeds(graph) -> dict[str, np.ndarray]:
    return {v.name: RNG.standard_normal(v.shape).astype(np.float32) for v in graph.inputs}


def before(nodes, inputs=("x",), outputs=("y",), inits=()):
    return graph_of(model(nodes, [vi(n) for n in inputs], [vi(n) for n in outputs], inits))


def root(graph, name: str) -> Node:
    return next(n for n in graph.nodes if n.outputs[0].name == name)


def find(graph, pattern: Op, out: str = "y") -> Found | None:
    return match(View.of(graph), pattern, root(graph, out))


# ---------------------------------------------------------------------------------------------
# Matching


@pytest.mark.parametrize("order", [("x", "s"), ("s", "x")])
def test_commutative_inputs_match_in_either_order(order) -> None:
    g = before([helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", order, ["y"])])
    found = find(g, SILU)
    assert found is not None
    assert found.value("x") is g.inputs[0]
    assert [n.op for n in found.nodes] == ["Mul", "Sigmoid"]
    ordered = Op("Mul", [X, Op("Sigmoid", [X])])  # not commutative: only x first
    assert (find(g, ordered) is not None) == (order == ("x", "s"))


def test_a_var_used_twice_must_be_one_value() -> None:
    nodes = [helper.make_node("Sigmoid", ["z"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    g = before(nodes, inputs=("x", "z"))
    assert find(g, SILU) is None
    assert find(g, Op("Mul", [Var("a"), Op("Sigmoid", [Var("b")])])) is not None


@pytest.mark.parametrize(
    ("value", "rtol", "matches"),
    [(0.5, 1e-6, True), (0.5000001, 1e-6, True), (0.50001, 1e-6, False), (0.50001, 1e-4, True)],
)
def test_scalar_predicate_within_tolerance(value, rtol, matches) -> None:
    g = before([helper.make_node("Mul", ["x", "c"], ["y"])], inits=[const("c", value)])
    found = find(g, Op("Mul", [X, Scalar(0.5, rtol, name="half")]))
    assert (found is not None) == matches
    if matches:
        assert found.value("half").name == "c"


def test_constant_predicate_reads_constant_nodes_and_rejects_tensors() -> None:
    c = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.float32(2.0)))
    g = before([c, helper.make_node("Div", ["x", "c"], ["y"])])
    assert find(g, Op("Div", [X, Scalar(2.0)])) is not None
    assert find(g, Op("Div", [X, Const(lambda a: a.ndim == 1)])) is None
    wide = before([helper.make_node("Div", ["x", "c"], ["y"])], inits=[const("c", [2.0] * 4)])
    assert find(wide, Op("Div", [X, Scalar(2.0)])) is None  # four elements: no scalar
    assert find(wide, Op("Div", [X, Const()])) is not None


def test_alternatives_and_node_captures() -> None:
    scaled = Alt(Op("Div", [X, Scalar(2.0)], name="s"), Op("Mul", [X, Scalar(0.5)], name="s"))
    pattern = Op("Relu", [scaled])
    for op, c in (("Div", 2.0), ("Mul", 0.5)):
        nodes = [helper.make_node(op, ["x", "c"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
        found = find(before(nodes, inits=[const("c", c)]), pattern)
        assert found is not None and found.node("s").op == op


def test_var_named_after_a_node_reads_its_output() -> None:
    """A pattern reads one node from two places (a DAG) by naming it and using Var."""
    pattern = Op("Mul", [Op("Exp", [X], name="e"), Var("e")])
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Mul", ["e", "e"], ["y"])]
    found = find(before(nodes), pattern)
    assert found is not None and [n.op for n in found.nodes] == ["Mul", "Exp"]
    other = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Mul", ["e", "x"], ["y"])]
    assert find(before(other), pattern) is None


def test_consumed_node_read_elsewhere_or_a_graph_output_does_not_match() -> None:
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("Mul", ["x", "s"], ["y"]),
        helper.make_node("Neg", ["s"], ["n"]),
    ]
    g = before(nodes, outputs=("y", "n"))
    assert find(g, SILU) is None  # the Sigmoid is also read by Neg
    kept = Op("Mul", [X, Op("Sigmoid", [X], keep=True)], commutative=True)
    found = find(g, kept)
    assert found is not None and [n.op for n in found.nodes] == ["Mul"]
    g = before(nodes[:2], outputs=("y", "s"))
    assert find(g, SILU) is None  # the Sigmoid's output is a graph output


# ---------------------------------------------------------------------------------------------
# The driver


def _drop_double(view: View, found: Found) -> Node:
    """f(f(x)) -> f(x) for an idempotent f."""
    node = found.root
    return Node(node.op, [found.value("x")], list(node.outputs), {}, name=node.name)


RELU_RELU = Rule("relu_relu", Op("Relu", [Op("Relu", [X])]), _drop_double)
ABS_ABS = Rule("abs_abs", Op("Abs", [Op("Abs", [X])]), _drop_double)


def test_overlapping_matches_apply_once() -> None:
    """Relu(Relu(Relu(x))): the matches at the 2nd and 3rd Relu share the 2nd; the first wins,
    the other waits for the next run."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Relu", ["b"], ["y"]),
    ]
    g = before(nodes)
    counts = []
    after = assert_pass_preserves_outputs(
        g, lambda h: counts.append(run_rules(h, [RELU_RELU])), feeds(g)
    )
    assert counts == [1]
    expected = before(
        [helper.make_node("Relu", ["x"], ["b"]), helper.make_node("Relu", ["b"], ["y"])]
    )
    assert_structure(after, expected)
    assert run_rules(after, [RELU_RELU]) == 1 and ops(after) == ["Relu"]


def test_counts_per_rule_and_the_check() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Abs", ["b"], ["c"]),
        helper.make_node("Abs", ["c"], ["d"]),
        helper.make_node("Abs", ["z"], ["e"]),
        helper.make_node("Abs", ["e"], ["f"]),
        helper.make_node("Add", ["d", "f"], ["y"]),
    ]
    g = before(nodes, inputs=("x", "z"))
    fed = feeds(g)
    counts = []
    after = assert_pass_preserves_outputs(
        g, lambda h: counts.append(apply_rules(h, [RELU_RELU, ABS_ABS])), fed
    )
    assert counts == [{"relu_relu": 1, "abs_abs": 2}]
    expected = before(
        [
            helper.make_node("Relu", ["x"], ["b"]),
            helper.make_node("Abs", ["b"], ["d"]),
            helper.make_node("Abs", ["z"], ["f"]),
            helper.make_node("Add", ["d", "f"], ["y"]),
        ],
        inputs=("x", "z"),
    )
    assert_structure(after, expected)
    # a check that refuses every match: nothing changes, nothing is counted
    never = Rule("abs_abs", ABS_ABS.patterns, _drop_double, check=lambda view, found: False)
    assert apply_rules(g, [never]) == {} and ops(g)[2:4] == ["Abs", "Abs"]


def test_replacement_returning_none_leaves_the_graph() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    g = before(nodes)
    assert run_rules(g, [Rule("none", RELU_RELU.patterns, lambda view, found: None)]) == 0
    assert ops(g) == ["Relu", "Relu"]


# ---------------------------------------------------------------------------------------------
# The example of docs/contributing.md ("Adding a fusion pass"), kept working here

RELU6 = Op("Clip", [Op("Add", [X, Scalar(3.0)], commutative=True), Scalar(0.0), Scalar(6.0)])
HARD_SWISH = Op("Div", [Op("Mul", [X, RELU6], commutative=True), Scalar(6.0)])


def _hard_swish(view: View, found: Found) -> Node | None:
    """x * relu6(x + 3) / 6 -> HardSwish (an ONNX op from opset 14)."""
    if view.graph.opset("") < 14:
        return None
    return Node("HardSwish", [found.value("x")], found.root.outputs, name=found.root.name)


HARD_SWISH_RULES = (Rule("hard_swish", HARD_SWISH, _hard_swish),)


def test_contributing_example_hard_swish() -> None:
    inits = [const("three", 3.0), const("zero", 0.0), const("six", 6.0)]
    nodes = [
        helper.make_node("Add", ["three", "x"], ["a"]),
        helper.make_node("Clip", ["a", "zero", "six"], ["r"]),
        helper.make_node("Mul", ["r", "x"], ["m"]),
        helper.make_node("Div", ["m", "six"], ["y"]),
    ]
    g = before(nodes, inits=inits)
    counts = []
    after = assert_pass_preserves_outputs(
        g, lambda h: counts.append(apply_rules(h, HARD_SWISH_RULES)), feeds(g)
    )
    assert counts == [{"hard_swish": 1}]
    assert_structure(after, before([helper.make_node("HardSwish", ["x"], ["y"])]))
