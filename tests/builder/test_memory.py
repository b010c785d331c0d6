"""The activation memory planner, checked against lifetimes computed here from the graph itself.

A plan is valid when no two buffers whose lifetimes overlap share a byte, every buffer is aligned
and big enough for its value at the planned symbol sizes, the peak is at most the naive sum, and
values whose size is unknown until run time are listed as dynamic.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile, plan_memory
from tensorkiln.engine.memory import ALIGNMENT
from tensorkiln.frontends.onnx import import_onnx
from tensorkiln.ir import Graph, TensorType, Value
from tests.engine import models as M


def lifetimes(graph: Graph) -> dict[str, tuple[int, int]]:
    """name -> (producing step, last step that needs it) for every node output of the top graph.

    A value is needed by a node that takes it as input or whose subgraphs read it; graph outputs are
    needed until the end (step len(nodes)).
    """
    produced: dict[Value, int] = {}
    last: dict[Value, int] = {}
    for i, node in enumerate(graph.nodes):
        for v in _reads(node):
            if v in produced:
                last[v] = i
        for v in node.outputs:
            if v is not None:
                produced[v] = i
                last[v] = i
    for v in graph.outputs:
        if v in produced:
            last[v] = len(graph.nodes)
    return {v.name: (produced[v], last[v]) for v in produced}


def _reads(node) -> set[Value]:
    """Inputs of ``node`` plus every value its subgraphs (at any depth) take from outside."""
    reads = {v for v in node.inputs if v is not None}
    stack = [g for g in node.attrs.values() if isinstance(g, Graph)]
    stack += [
        g for a in node.attrs.values() if isinstance(a, list) for g in a if isinstance(g, Graph)
    ]
    inner: set[Value] = set()
    used: set[Value] = set()
    while stack:
        g = stack.pop()
        inner.update(g.inputs, g.initializers)
        for n in g.nodes:
            inner.update(v for v in n.outputs if v is not None)
            used.update(v for v in n.inputs if v is not None)
            stack += [s for s in n.attrs.values() if isinstance(s, Graph)]
        used.update(g.outputs)
    return reads | (used - inner)


def exact_bytes(v: Value, symbols: dict[str, int]) -> int | None:
    t = v.type
    if not isinstance(t, TensorType) or t.dtype is None or t.shape is None:
        return None
    if t.dtype.bits == 0:
        return None  # strings are Python objects, never in the arena
    count = 1
    for d in t.shape:
        if isinstance(d, str):
            factors = [int(f) if f.isdigit() else symbols.get(f) for f in d.split("*")]
            if any(f is None for f in factors):
                return None
            d = math.prod(factors)
        count *= d
    return math.ceil(count * t.dtype.bits / 8)


def check_plan(graph: Graph, plan: dict, symbols: dict[str, int]) -> None:
    """Validate a plan (its JSON form) against lifetimes and sizes computed from ``graph``."""
    life = lifetimes(graph)
    values = {v.name: v for n in graph.nodes for v in n.outputs if v is not None}
    buffers = {name: (offset, size) for name, offset, size, _first, _last in plan["buffers"]}
    assert len(buffers) == len(plan["buffers"]), "a value is planned twice"
    assert set(buffers) | set(plan["dynamic"]) == set(life), "planned values != node outputs"
    assert not set(buffers) & set(plan["dynamic"])
    for name, (offset, size) in buffers.items():
        need = exact_bytes(values[name], symbols)
        assert need is not None, f"'{name}' has no static size but was planned"
        assert offset % ALIGNMENT == 0 and size % ALIGNMENT == 0, f"'{name}' is not aligned"
        assert need <= size < need + ALIGNMENT or (need == 0 and size == 0), (
            f"'{name}' needs {need} bytes, planned {size}"
        )
    for name in plan["dynamic"]:
        assert exact_bytes(values[name], symbols) is None, f"'{name}' has a size but is dynamic"
    names = sorted(buffers)
    for i, a in enumerate(names):
        fa, la = life[a]
        oa, sa = buffers[a]
        for b in names[i + 1 :]:
            fb, lb = life[b]
            ob, sb = buffers[b]
            if fa <= lb and fb <= la and sa and sb:
                assert oa + sa <= ob or ob + sb <= oa, (
                    f"'{a}' (steps {fa}..{la}, bytes {oa}..{oa + sa}) and '{b}' (steps {fb}..{lb}, "
                    f"bytes {ob}..{ob + sb}) are live together and overlap"
                )
    sizes = [s for _, s in buffers.values()]
    assert plan["naive_bytes"] == sum(sizes)
    assert plan["peak_bytes"] == max((o + s for o, s in buffers.values()), default=0)
    assert plan["peak_bytes"] <= plan["naive_bytes"]
    # The peak is at least what the busiest step holds at once.
    steps = len(graph.nodes) + 1
    live = [
        sum(buffers[n][1] for n in buffers if life[n][0] <= t <= life[n][1]) for t in range(steps)
    ]
    assert plan["peak_bytes"] >= max(live, default=0)


def simulate(graph: Graph, plan: dict) -> None:
    """Run the plan on an arena: each step writes its outputs' tags, then reads must find theirs."""
    life = lifetimes(graph)
    # Offsets and sizes are multiples of ALIGNMENT: one arena cell per aligned block.
    buffers = {
        name: (offset // ALIGNMENT, size // ALIGNMENT) for name, offset, size, *_ in plan["buffers"]
    }
    arena = np.full(plan["peak_bytes"] // ALIGNMENT, -1, np.int32)
    tag = {name: i for i, name in enumerate(sorted(buffers))}
    for step in range(len(graph.nodes) + 1):
        for name, (first, last) in life.items():
            if name in buffers and first < step <= last:
                offset, size = buffers[name]
                assert (arena[offset : offset + size] == tag[name]).all(), (
                    f"'{name}' was overwritten before step {step}"
                )
        for name, (first, _) in life.items():
            if name in buffers and first == step:
                offset, size = buffers[name]
                arena[offset : offset + size] = tag[name]


def _cases() -> dict[str, tuple[onnx.ModelProto, dict[str, int]]]:
    return {
        "chain": (M.chain(8), {"N": 16}),
        "residual_with_intermediate_output": (M.residual(), {"N": 16}),
        "mlp_two_outputs": (M.mlp(), {"N": 4}),
        "cnn": (M.cnn(), {"N": 16}),
        "control_flow": (M.control_flow(), {}),
        "typed_constants": (M.typed_constants(), {}),
    }


@pytest.mark.parametrize("name", sorted(_cases()))
def test_plan_is_valid(name: str) -> None:
    model, symbols = _cases()[name]
    graph = import_onnx(model)
    plan = plan_memory(graph, symbols).to_json()
    check_plan(graph, plan, symbols)
    simulate(graph, plan)


def test_chain_reuses_memory() -> None:
    graph = import_onnx(M.chain(8))
    plan = plan_memory(graph, {"N": 16}).to_json()
    one = 16 * 64 * 4
    # Two buffers ping-pong along a chain: eight values of 4 KiB fit in 8 KiB.
    assert plan["naive_bytes"] == 8 * one
    assert plan["peak_bytes"] == 2 * one


def test_intermediate_output_stays_live_to_the_end() -> None:
    graph = import_onnx(M.residual())
    plan = plan_memory(graph, {"N": 2}).to_json()
    first, last = next((f, l) for n, _, _, f, l in plan["buffers"] if n == "a")
    assert (first, last) == (0, len(graph.nodes))
    assert lifetimes(graph)["a"] == (first, last)


def test_values_read_inside_subgraphs_live_until_that_node() -> None:
    graph = import_onnx(M.control_flow())
    life = lifetimes(graph)
    if_step = next(i for i, n in enumerate(graph.nodes) if n.op == "If")
    plan = plan_memory(graph).to_json()
    recorded = {n: (f, l) for n, _, _, f, l in plan["buffers"]}
    # 'chosen' is the If's output and also read by the Loop body (outer reference).
    loop_step = next(i for i, n in enumerate(graph.nodes) if n.op == "Loop")
    assert life["chosen"][0] == if_step
    assert recorded["chosen"] == life["chosen"] == (if_step, len(graph.nodes))
    assert life["pos"] == recorded["pos"] == (if_step - 1, if_step)
    assert loop_step > if_step


@pytest.mark.skipif(not M.DIGITS.exists(), reason="examples/digits_cnn.onnx is not bundled")
def test_digits_engine_plan_binds_profile_max() -> None:
    model = onnx.load(M.DIGITS)
    config = BuilderConfig()
    config.add_optimization_profile(
        OptimizationProfile().set_shape("input", (1, 1, 8, 8), (4, 1, 8, 8), (16, 1, 8, 8))
    )
    config.add_optimization_profile(
        OptimizationProfile().set_shape("input", (1, 1, 8, 8), (2, 1, 8, 8), (8, 1, 8, 8))
    )
    engine = Builder().build(model, config)
    check_plan(engine.graph, engine.memory, {"N": 16})
    simulate(engine.graph, engine.memory)
    logits = next(b for b in engine.memory["buffers"] if b[0] == "logits")
    assert logits[2] == 16 * 10 * 4 + (-16 * 10 * 4) % ALIGNMENT  # batch 16, the largest max
    assert engine.memory["alignment"] == ALIGNMENT


def test_engine_without_profile_plans_symbols_at_one() -> None:
    engine = Builder().build(M.cnn())
    check_plan(engine.graph, engine.memory, {"N": 1})
    y = next(b for b in engine.memory["buffers"] if b[0] == "y")
    assert y[2] == ALIGNMENT  # 1 x 10 floats, aligned


@pytest.mark.parametrize("stem", ["light_inception_v1", "light_squeezenet", "light_resnet50"])
def test_light_model_plan(stem: str) -> None:
    path = next(p for p in M.light_models() if p.stem == stem)
    graph = import_onnx(path)
    plan = plan_memory(graph).to_json()
    check_plan(graph, plan, {})
    simulate(graph, plan)
    assert plan["peak_bytes"] < plan["naive_bytes"]


def test_data_dependent_sizes_are_dynamic() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("NonZero", ["r"], ["nz"], name="nonzero"),
        helper.make_node("Transpose", ["nz"], ["idx"], name="transpose"),
        helper.make_node("GatherND", ["r", "idx"], ["picked"], name="gather"),
        helper.make_node("Neg", ["r"], ["y"], name="neg"),
    ]
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "dynamic",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
            [
                helper.make_tensor_value_info("picked", TensorProto.FLOAT, None),
                helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5]),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 21)],
    )
    graph = import_onnx(model)
    plan = plan_memory(graph, {"N": 3}).to_json()
    check_plan(graph, plan, {"N": 3})
    assert {"nz", "idx", "picked"} <= set(plan["dynamic"])
    assert {b[0] for b in plan["buffers"]} == {"r", "y"}
    # Unbound symbols are dynamic too.
    unbound = plan_memory(graph, {}).to_json()
    assert {"r", "y"} <= set(unbound["dynamic"])


def test_checker_catches_a_broken_plan() -> None:
    # The checks above must fail on a plan that puts live buffers on top of each other.
    graph = import_onnx(M.residual())
    plan = plan_memory(graph, {"N": 16}).to_json()
    broken = {**plan, "buffers": [[n, 0, s, f, l] for n, _, s, f, l in plan["buffers"]]}
    broken["peak_bytes"] = max(s for _, _, s, _, _ in broken["buffers"])
    with pytest.raises(AssertionError, match="live together and overlap"):
        check_plan(graph, broken, {"N": 16})
    with pytest.raises(AssertionError, match="overwritten"):
        simulate(graph, broken)
