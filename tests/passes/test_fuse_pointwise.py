"""fuse_pointwise: Before/Expected graphs, numeric equality, the Pointwise kernel, engines, real models."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.engine import Engine
from tensorkiln.ir import Graph
from tensorkiln.ir.verify import verify
from tensorkiln.kernels.evaluate import infer_shapes
from tensorkiln.kernels.reference.fused_pointwise import BLOCK_ELEMENTS
from tensorkiln.passes import PassManager
from tensorkiln.passes.fuse_pointwise import fuse_pointwise
from tensorkiln.runtime import Runner
from tests.passes.util import assert_pass_preserves_outputs, graph_of, model, ops, run

F32, F16, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64
node = helper.make_node


def vi(name: str, shape, dtype: int = F32):
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name: str, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def feeds_for(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Fresh random inputs for every graph input (float: normal, int: small, bool: coin flips)."""
    rng = np.random.default_rng(seed)
    out = {}
    for v in graph.inputs:
        dt, shape = v.dtype.numpy, tuple(int(d) for d in v.shape)
        if dt == np.bool_:
            out[v.name] = rng.random(shape) < 0.5
        elif np.issubdtype(dt, np.integer):
            out[v.name] = rng.integers(-5, 5, shape).astype(dt)
        else:
            out[v.name] = rng.standard_normal(shape).astype(dt)
    return out


def fused(graph: Graph) -> Graph:
    """The graph after fuse_pointwise, checked numerically against the original on fresh inputs."""
    return assert_pass_preserves_outputs(graph, fuse_pointwise, feeds_for(graph))


def body_ops(graph: Graph) -> list[list[str]]:
    return [ops(n.attrs["body"]) for n in graph.nodes if n.op == "Pointwise"]


# ------------------------------------------------------------------------- Before / Expected


def test_chain_becomes_one_pointwise() -> None:
    before = graph_of(
        model(
            [
                node("Add", ["x", "y"], ["a"]),
                node("Mul", ["a", "scale"], ["b"]),
                node("Relu", ["b"], ["out"]),
            ],
            [vi("x", [4, 8]), vi("y", [8])],
            [vi("out", [4, 8])],
            [const("scale", 0.5)],
        )
    )
    assert ops(before) == ["Add", "Mul", "Relu"]
    after = fused(before)
    assert ops(after) == ["tensorkiln.Pointwise"]
    assert body_ops(after) == [["Add", "Mul", "Relu"]]
    (pw,) = after.nodes
    body = pw.attrs["body"]
    assert [v.name for v in pw.inputs] == ["x", "y"]  # external inputs only
    assert [v.name for v in body.initializers] == ["pw0/scale"]  # constants live in the body
    assert [v.name for v in pw.outputs] == ["out"]


def test_gelu_tree_with_shared_input() -> None:
    """x + bias feeds three ops of the erf GELU: a DAG whose every reader is in the group."""
    before = graph_of(
        model(
            [
                node("Add", ["m", "bias"], ["x"]),
                node("Div", ["x", "sqrt2"], ["d"]),
                node("Erf", ["d"], ["e"]),
                node("Add", ["e", "one"], ["e1"]),
                node("Mul", ["x", "e1"], ["p"]),
                node("Mul", ["p", "half"], ["out"]),
            ],
            [vi("m", [2, 5, 16])],
            [vi("out", [2, 5, 16])],
            [
                const("bias", np.linspace(-1, 1, 16)),
                const("sqrt2", np.sqrt(2.0)),
                const("one", 1.0),
                const("half", 0.5),
            ],
        )
    )
    after = fused(before)
    assert ops(after) == ["tensorkiln.Pointwise"]
    assert body_ops(after) == [["Add", "Div", "Erf", "Add", "Mul", "Mul"]]
    assert len(after.initializers) == 0  # the constants moved into the body


def test_intermediate_read_outside_is_an_extra_output() -> None:
    before = graph_of(
        model(
            [
                node("Add", ["x", "y"], ["a"]),
                node("Sigmoid", ["a"], ["s"]),
                node("Mul", ["a", "s"], ["out"]),
                node("MatMul", ["a", "w"], ["side"]),
            ],
            [vi("x", [3, 4]), vi("y", [3, 4])],
            [vi("out", [3, 4]), vi("side", [3, 2])],
            [const("w", np.ones((4, 2)))],
        )
    )
    after = fused(before)
    assert ops(after) == ["tensorkiln.Pointwise", "MatMul"]
    pw = after.nodes[0]
    assert [v.name for v in pw.outputs] == ["out", "a"]
    assert ops(pw.attrs["body"]) == ["Add", "Sigmoid", "Mul"]


def test_intermediate_that_is_a_graph_output_stays_an_output() -> None:
    before = graph_of(
        model(
            [node("Add", ["x", "y"], ["a"]), node("Tanh", ["a"], ["out"])],
            [vi("x", [3, 4]), vi("y", [1, 4])],
            [vi("out", [3, 4]), vi("a", [3, 4])],
        )
    )
    after = fused(before)
    assert ops(after) == ["tensorkiln.Pointwise"]
    assert [v.name for v in after.outputs] == ["out", "a"]


def test_comparison_where_and_cast_inside_one_group() -> None:
    """LeakyReLU written with Greater/Where, in float16 computed through a float32 Cast."""
    before = graph_of(
        model(
            [
                node("Cast", ["x"], ["x32"], to=F32),
                node("Greater", ["x32", "zero"], ["pos"]),
                node("Mul", ["x32", "slope"], ["neg"]),
                node("Where", ["pos", "x32", "neg"], ["y"]),
                node("Cast", ["y"], ["out"], to=F16),
            ],
            [vi("x", [6, 7], F16)],
            [vi("out", [6, 7], F16)],
            [const("zero", 0.0), const("slope", 0.1)],
        )
    )
    after = fused(before)
    assert ops(after) == ["tensorkiln.Pointwise"]
    assert after.outputs[0].dtype == before.outputs[0].dtype  # float16 in, float16 out


def test_attention_mask_of_bools_is_fused() -> None:
    """Integer/bool ops on rank >= 2 tensors are masks, not shape arithmetic."""
    before = graph_of(
        model(
            [
                node("Cast", ["mask"], ["keep"], to=TensorProto.BOOL),
                node("And", ["keep", "causal"], ["both"]),
                node("Where", ["both", "zero", "neg"], ["out"]),
            ],
            [vi("mask", [2, 1, 1, 8], I64), vi("causal", [1, 1, 8, 8], TensorProto.BOOL)],
            [vi("out", [2, 1, 8, 8])],
            [const("zero", 0.0), const("neg", -1e9)],
        )
    )
    after = fused(before)
    assert ops(after) == ["tensorkiln.Pointwise"]
    assert body_ops(after) == [["Cast", "And", "Where"]]


def test_chains_inside_an_if_branch_are_fused() -> None:
    branch = helper.make_graph(
        [node("Mul", ["x", "two"], ["m"]), node("Sigmoid", ["m"], ["then_out"])],
        "then",
        [],
        [vi("then_out", [3, 4])],
        [const("two", 2.0)],
    )
    other = helper.make_graph(
        [node("Neg", ["x"], ["else_out"])], "else", [], [vi("else_out", [3, 4])]
    )
    before = graph_of(
        model(
            [node("If", ["c"], ["out"], then_branch=branch, else_branch=other)],
            [vi("c", [], TensorProto.BOOL), vi("x", [3, 4])],
            [vi("out", [3, 4])],
        )
    )
    for c in (True, False):
        feeds = {"c": np.array(c), "x": feeds_for(before)["x"]}
        after = assert_pass_preserves_outputs(before, fuse_pointwise, feeds)
    assert ops(after) == ["If"]
    assert ops(after.nodes[0].attrs["then_branch"]) == ["tensorkiln.Pointwise"]
    assert ops(after.nodes[0].attrs["else_branch"]) == ["Neg"]


# ------------------------------------------------------------------------- negative cases


def test_intermediate_whose_outside_reader_feeds_the_group_is_not_fused() -> None:
    """a is read by MatMul, whose result comes back into the group: fusing a would make a cycle."""
    before = graph_of(
        model(
            [
                node("Add", ["x", "y"], ["a"]),
                node("Relu", ["a"], ["r"]),
                node("MatMul", ["a", "w"], ["m"]),
                node("Add", ["r", "m"], ["out"]),
            ],
            [vi("x", [4, 4]), vi("y", [4, 4])],
            [vi("out", [4, 4])],
            [const("w", np.eye(4))],
        )
    )
    after = fused(before)
    assert sorted(ops(after)) == ["Add", "MatMul", "tensorkiln.Pointwise"]
    assert body_ops(after) == [["Relu", "Add"]]


def test_shape_changing_op_in_the_middle_stops_the_group() -> None:
    before = graph_of(
        model(
            [
                node("Add", ["x", "y"], ["a"]),
                node("Transpose", ["a"], ["t"], perm=[1, 0]),
                node("Relu", ["t"], ["out"]),
            ],
            [vi("x", [3, 5]), vi("y", [3, 5])],
            [vi("out", [5, 3])],
        )
    )
    after = fused(before)
    assert ops(after) == ["Add", "Transpose", "Relu"]  # two groups of one: nothing fused


def test_reshape_between_two_chains_gives_two_groups() -> None:
    before = graph_of(
        model(
            [
                node("Add", ["x", "y"], ["a"]),
                node("Exp", ["a"], ["e"]),
                node("Reshape", ["e", "shape"], ["r"]),
                node("Neg", ["r"], ["n"]),
                node("Abs", ["n"], ["out"]),
            ],
            [vi("x", [2, 6]), vi("y", [2, 6])],
            [vi("out", [3, 4])],
            [const("shape", [3, 4], np.int64)],
        )
    )
    after = fused(before)
    assert ops(after) == ["tensorkiln.Pointwise", "Reshape", "tensorkiln.Pointwise"]
    assert body_ops(after) == [["Add", "Exp"], ["Neg", "Abs"]]


def test_single_op_and_integer_shape_arithmetic_are_left_alone() -> None:
    before = graph_of(
        model(
            [
                node("Relu", ["x"], ["out"]),
                node("Add", ["i", "j"], ["k"]),
                node("Mul", ["k", "j"], ["iout"]),
            ],
            [vi("x", [3]), vi("i", [2], I64), vi("j", [2], I64)],
            [vi("out", [3]), vi("iout", [2], I64)],
        )
    )
    after = fused(before)
    assert ops(after) == ["Relu", "Add", "Mul"]


def _random_graph(seed: int, n: int = 14) -> Graph:
    """A random DAG of elementwise ops and Softmax (not elementwise), some intermediates outputs."""
    rng = np.random.default_rng(seed)
    values, nodes = ["x", "y"], []
    for i in range(n):
        op = str(rng.choice(["Add", "Mul", "Sub", "Max", "Relu", "Tanh", "Neg", "Softmax"]))
        arity = 2 if op in ("Add", "Mul", "Sub", "Max") else 1
        attrs = {"axis": -1} if op == "Softmax" else {}
        nodes.append(node(op, [str(v) for v in rng.choice(values[-6:], arity)], [f"v{i}"], **attrs))
        values.append(f"v{i}")
    outs = sorted({values[-1], *(str(v) for v in rng.choice(values[2:], 2))}, key=values.index)
    return graph_of(model(nodes, [vi("x", [3, 4]), vi("y", [3, 4])], [vi(o, [3, 4]) for o in outs]))


@pytest.mark.parametrize("seed", range(0, 100, 10))
def test_random_graphs_stay_acyclic_and_exact(seed: int) -> None:
    """Groups with extra outputs can feed each other; one that would close a cycle is regrown."""
    for s in range(seed, seed + 10):
        graph = _random_graph(s)
        assert_pass_preserves_outputs(graph, fuse_pointwise, feeds_for(graph, s), rtol=0, atol=0)


# ------------------------------------------------------------------------- the kernel and types


def _bias_gelu_graph(shape: list[int], extra: str | None = None) -> Graph:
    """y = tanh(x * scale + bias) * x, optionally also giving the intermediate ``extra``."""
    nodes = [
        node("Mul", ["x", "scale"], ["xs"]),
        node("Add", ["xs", "bias"], ["b"]),
        node("Tanh", ["b"], ["t"]),
        node("Mul", ["t", "x"], ["out"]),
    ]
    outputs = [vi("out", shape)]
    if extra is not None:
        nodes.append(node("Identity", [extra], ["extra_out"]))
        outputs.append(vi("extra_out", None))
    return graph_of(
        model(
            nodes,
            [vi("x", shape), vi("scale", [shape[0], 1, 1]), vi("bias", [shape[-1]])],
            outputs,
        )
    )


@pytest.mark.parametrize("shape", [[3, 4, 5], [64, 64, 48], [1, 64, 96]])
def test_kernel_matches_unfused_ops_exactly(shape: list[int]) -> None:
    """Small inputs run whole; large ones run in blocks (along axis 0, or 1 when axis 0 is 1)."""
    graph = _bias_gelu_graph(shape)
    feeds = feeds_for(graph, seed=1)
    after = copy.deepcopy(graph)
    assert fuse_pointwise(after) == 1
    assert ops(after) == ["tensorkiln.Pointwise"]
    expected, got = run(graph, feeds), run(after, feeds)
    np.testing.assert_array_equal(got["out"], expected["out"])
    assert got["out"].dtype == np.float32


def test_kernel_falls_back_when_an_output_does_not_span_the_block_axis() -> None:
    """An extra output with the shape of the small input cannot be assembled from row blocks."""
    rows, cols = 4 * BLOCK_ELEMENTS // 256, 256
    before = graph_of(
        model(
            [
                node("Exp", ["a"], ["e"]),
                node("Add", ["e", "b"], ["s"]),
                node("Sigmoid", ["s"], ["out"]),
                node("ReduceSum", ["e"], ["side"], keepdims=1),
            ],
            [vi("a", [1, cols]), vi("b", [rows, cols])],
            [vi("out", [rows, cols]), vi("side", [1, 1])],
        )
    )
    after = assert_pass_preserves_outputs(before, fuse_pointwise, feeds_for(before), rtol=0)
    assert ops(after) == ["tensorkiln.Pointwise", "ReduceSum"]


def test_shape_rule_keeps_symbolic_dims() -> None:
    graph = graph_of(
        model(
            [node("Add", ["x", "y"], ["a"]), node("Relu", ["a"], ["out"])],
            [vi("x", ["N", 8]), vi("y", [1, 8])],
            [vi("out", ["N", 8])],
        )
    )
    fuse_pointwise(graph)
    pw = graph.nodes[0]
    pw.outputs[0].type = None
    infer_shapes(graph)
    assert str(pw.outputs[0].type) == "f32[N,8]"
    x = np.ones((5, 8), np.float32)
    out = Runner(graph).infer({"x": x, "y": -2 * x[:1]})["out"]
    np.testing.assert_array_equal(out, np.zeros((5, 8), np.float32))


def test_pass_manager_runs_it_once_and_verifies() -> None:
    graph = _bias_gelu_graph([2, 3, 4])
    pm = PassManager(level=3, only=["fuse_pointwise"], verify=True)
    pm.run(graph)
    assert pm.stats == {"fuse_pointwise": 1}  # the second round finds nothing more


# ------------------------------------------------------------------------- engine round trip


def test_engine_round_trip_is_bit_identical() -> None:
    graph = _bias_gelu_graph([64, 32, 48], extra="b")
    fuse_pointwise(graph)
    verify(graph)
    assert ops(graph) == ["tensorkiln.Pointwise", "Identity"]
    engine = Engine(graph, backend="reference", layers=[{}] * len(graph.nodes))
    loaded = Engine.deserialize(engine.serialize())
    assert ops(loaded.graph) == ops(graph)
    assert ops(loaded.graph.nodes[0].attrs["body"]) == ["Mul", "Add", "Tanh", "Mul"]
    feeds = feeds_for(graph, seed=3)
    expected, got = run(graph, feeds), run(loaded.graph, feeds)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])


# ------------------------------------------------------------------------- real exported models

# ResNet-50 (full size only) is left out to keep this file fast: its 16 Add+Relu groups are the
# same pattern as the residual adds here.
MODELS = ["bert", "gpt2", "transformer_encoder"]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("name", MODELS)
def test_real_models_keep_their_outputs(name: str, exporter: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    if name in ("bert", "gpt2"):
        pytest.importorskip("transformers")
    from tests.models.test_architectures import BUILDERS, export

    module, feeds = BUILDERS[name](full=False)
    path = export(module, feeds, tmp_path, dynamo=exporter == "dynamo")
    graph = graph_of(str(path))
    feeds = {v.name: feeds[v.name] for v in graph.inputs}
    n_before = len(graph.nodes)
    after = assert_pass_preserves_outputs(graph, fuse_pointwise, feeds, rtol=1e-5)
    n_fused = ops(after).count("tensorkiln.Pointwise")
    assert n_fused > 0
    assert len(after.nodes) < n_before


def test_blocked_kernel_does_not_slice_past_a_per_channel_constant():
    """Blocks along the channel axis would cut the input but not a [C,1,1] constant of the body."""
    rng = np.random.default_rng()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 112, 112])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 112, 112])
    scale = numpy_helper.from_array(rng.standard_normal((64, 1, 1)).astype(np.float32), "s")
    nodes = [helper.make_node("Mul", ["x", "s"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    graph = graph_of(model(nodes, [x], [y], [scale]))
    feeds = {"x": rng.standard_normal((1, 64, 112, 112)).astype(np.float32)}
    after = assert_pass_preserves_outputs(graph, PassManager(3, only=["fuse_pointwise"]).run, feeds)
    assert ops(after) == ["tensorkiln.Pointwise"]
