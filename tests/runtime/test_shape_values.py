"""Values that follow from constants and input shapes alone (a transformer's position ids, token
types and mask index arithmetic) are kept per input shapes by the cuda backend's executor: a
later run at the same shapes reuses them and launches none of their kernels (nor does the CUDA
graph captured for those shapes). Runs at other shapes, and shapes that follow from values
(NonZero), compute them again.

The oracle is numpy on the same inputs; kernel launches are counted by wrapping the layers'
kernels.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")

import tensorkiln
from tensorkiln.backends import get_backend
from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.kernels.registry import lookup
from tensorkiln.runtime import Executor
from tests.passes.test_dynamic_axes import _export_dynamic, assert_outputs_close, token_feeds
from tests.passes.util import model


def _counting(graph, backend, calls: Counter) -> dict:
    """Every layer's kernel, wrapped to count its calls by layer name (the executor's tactics)."""

    def wrap(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    out = {}
    for n in graph.nodes:
        entry = lookup(n.op, n.domain, graph.opset(n.domain), backend.name)
        out[n.name] = wrap(n.name, entry.fn)
    return out


def _positions_model(data_dependent: bool = False):
    """y = x + Range(0, n) (as float, along the last axis), n = x's last dimension; with
    ``data_dependent`` n is instead the number of positive elements of x's first row (NonZero),
    and y = x[0, :n] + Range(0, n)."""
    h = helper.make_node
    nodes = []
    if data_dependent:
        nodes += [
            h("Gather", ["x", "zero"], ["row"], axis=0, name="row"),
            h("Greater", ["row", "fzero"], ["pos"], name="pos"),
            h("NonZero", ["pos"], ["nz"], name="nz"),
            h("Shape", ["nz"], ["s"], name="shape"),
            h("Gather", ["s", "one"], ["n"], axis=0, name="n"),
        ]
    else:
        nodes += [
            h("Shape", ["x"], ["s"], name="shape"),
            h("Gather", ["s", "one"], ["n"], axis=0, name="n"),
        ]
    nodes += [
        h("Range", ["zero", "n", "one"], ["r"], name="range"),
        h("Cast", ["r"], ["rf"], to=TensorProto.FLOAT, name="cast"),
        h("Unsqueeze", ["rf", "axes"], ["ru"], name="unsqueeze"),
    ]
    if data_dependent:
        nodes += [
            h("Unsqueeze", ["n", "axes"], ["n1"], name="n1"),
            h("Slice", ["row", "zero1", "n1"], ["head"], name="head"),
            h("Add", ["head", "rf"], ["y"], name="add"),
        ]
    else:
        nodes.append(h("Add", ["x", "ru"], ["y"], name="add"))
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "zero1"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array(0.0, np.float32), "fzero"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )


def _executor(m, calls: Counter) -> Executor:
    graph = tensorkiln.import_onnx(m)
    backend = get_backend("cuda", "cpu")
    return Executor(graph, backend, tactics=_counting(graph, backend, calls))


def test_shape_values_are_computed_once_per_input_shape() -> None:
    calls: Counter = Counter()
    ex = _executor(_positions_model(), calls)
    rng = np.random.default_rng()
    shape_layers = ("shape", "n", "range", "cast", "unsqueeze")
    for run, (n, s) in enumerate([(2, 5), (2, 5), (3, 7), (2, 5), (3, 7)]):
        x = rng.standard_normal((n, s)).astype(np.float32)
        (y,) = ex.run({ex.graph.inputs[0]: x})
        np.testing.assert_array_equal(y.numpy(), x + np.arange(s, dtype=np.float32))
        # the shape arithmetic ran at the first run of each shape only; the Add every run
        first_of_shape = run in (0, 2)
        expected = 1 if first_of_shape else 0
        for name in shape_layers:
            assert calls[name] == expected, (run, name, calls)
        assert calls["add"] == 1
        calls.clear()


def test_shapes_that_follow_from_values_are_keyed_by_those_shapes() -> None:
    # n comes from NonZero's output: the Range is computed again whenever n is one not seen yet,
    # though x's shape stays the same
    calls: Counter = Counter()
    ex = _executor(_positions_model(data_dependent=True), calls)
    rng = np.random.default_rng()
    seen = set()
    for k in (3, 5, 3, 6, 5):
        x = rng.uniform(0.5, 2.0, (2, 9)).astype(np.float32)
        x[0, rng.permutation(9)[k:]] *= -1.0  # k positives in the first row
        (y,) = ex.run({ex.graph.inputs[0]: x})
        np.testing.assert_array_equal(y.numpy(), x[0, :k] + np.arange(k, dtype=np.float32))
        assert calls["nz"] == calls["head"] == 1  # (they read x's values: every run)
        assert calls["range"] == (k not in seen), (k, calls)
        seen.add(k)
        calls.clear()


def test_a_shape_value_that_is_an_output_is_returned_fresh() -> None:
    # Shape(x) as the graph's output: not kept, so a caller writing to it changes no later run
    h = helper.make_node
    m = model(
        [h("Shape", ["x"], ["s"], name="shape"), h("Mul", ["s", "two"], ["y"], name="mul")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [2])],
        [numpy_helper.from_array(np.array(2, np.int64), "two")],
    )
    calls: Counter = Counter()
    ex = _executor(m, calls)
    x = np.random.default_rng().standard_normal((4, 3)).astype(np.float32)
    for _ in range(3):
        (y,) = ex.run({ex.graph.inputs[0]: x})
        np.testing.assert_array_equal(y.numpy(), [8, 6])
        y.fill_(-1)  # the caller's to change
    assert calls["mul"] == 3 and calls["shape"] == 1


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_transformers_keep_their_shape_values_and_match(name, tmp_path) -> None:
    path = _export_dynamic(name, tmp_path)
    plain = tensorkiln.Runner(path)
    engine = Builder("cuda", device="cpu").build(
        path, BuilderConfig(tactic_sources=set()), progress=False
    )
    ctx = engine.create_execution_context()
    rng = np.random.default_rng()
    kept = []
    for n, s in [(2, 7), (2, 7), (3, 11), (2, 7)]:
        feeds = token_feeds(n, s, rng)
        assert_outputs_close(ctx.infer(feeds), plain.infer(feeds))
        kept.append(len(ctx._executor.shape_values))
    # a set of values per input shape: kept at the first run of each, reused after
    assert kept[0] > 0 and kept[1] == kept[0] and kept[2] == 2 * kept[0] and kept[3] == kept[2]


def test_nothing_is_kept_past_the_bound_or_while_a_graph_is_captured(monkeypatch) -> None:
    from tensorkiln.runtime import shape_values

    calls: Counter = Counter()
    ex = _executor(_positions_model(), calls)
    rng = np.random.default_rng()

    def run(n: int, s: int) -> None:
        x = rng.standard_normal((n, s)).astype(np.float32)
        (y,) = ex.run({ex.graph.inputs[0]: x})
        np.testing.assert_array_equal(y.numpy(), x + np.arange(s, dtype=np.float32))

    # capturing: the kernels run (into the graph), and nothing is kept
    monkeypatch.setattr(ex.backend, "capturing", lambda: True)
    run(2, 5)
    run(2, 5)
    assert len(ex.shape_values) == 0 and calls["range"] == 2
    monkeypatch.undo()
    # a bound on the bytes: 120, of which the first shape's five values take 104 (Shape 16,
    # Gather 8, Range 40, Cast 20, Unsqueeze 20); the second's Shape fits, its Gather does not,
    # and what follows the Gather is no longer keyed
    monkeypatch.setattr(shape_values, "MOST_BYTES", 120)
    run(2, 5)
    assert len(ex.shape_values) == 5
    run(3, 7)
    assert len(ex.shape_values) == 6
    calls.clear()
    run(3, 7)  # the Gather and after: computed again, correctly
    assert calls["shape"] == 0 and calls["n"] == calls["range"] == 1
