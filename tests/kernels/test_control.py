"""If / Loop / Scan / SequenceMap reference kernels.

The kernels run subgraphs through ``_ctx.run_graph``. Two stand-in executors are used here: one
that runs ONNX GraphProto bodies with onnx's own ReferenceEvaluator (for the ONNX backend node
cases), and one whose "graphs" are Python functions (checked on fresh random inputs against numpy).
"""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from tensorkiln.ir import DType, Graph, TensorType, Value
from tensorkiln.kernels.registry import lookup

CONTROL_OPS = {"If", "Loop", "Scan", "SequenceMap"}


class _Optional(OpRun):
    """onnx's reference Optional wraps its input in a list; an optional here is the value itself."""

    op_domain = ""

    def _run(self, x=None, type=None):
        return (x,)


_Optional.__name__ = "Optional"


class OnnxCtx:
    """Runs GraphProto subgraphs with onnx's ReferenceEvaluator (an independent executor)."""

    def __init__(self, opsets):
        self.opsets = opsets

    def run_graph(self, graph, inputs):
        model = helper.make_model(graph, opset_imports=self.opsets, ir_version=10)
        feeds = {vi.name: x for vi, x in zip(graph.input, inputs)}
        return list(ReferenceEvaluator(model, new_ops=[_Optional]).run(None, feeds))


class FnCtx:
    """A stand-in executor whose graphs are Python callables (or ir.Graphs mapped to callables)."""

    def __init__(self, bodies=None):
        self.bodies = bodies or {}
        self.calls = 0

    def run_graph(self, graph, inputs):
        self.calls += 1
        fn = self.bodies[id(graph)] if isinstance(graph, Graph) else graph
        return list(fn(*inputs))


def _attrs(node):
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _control_cases():
    # importing a case module runs its exporters, which record the cases (much faster than all)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("if_", "loop", "scan", "sequence_map"):
            importlib.import_module(f"onnx.backend.test.case.node.{name}")
    from onnx.backend.test.case.node import _NodeTestCases

    return [
        c
        for c in _NodeTestCases
        if len(c.model.graph.node) == 1 and c.model.graph.node[0].op_type in CONTROL_OPS
    ]


def _same(got, exp):
    if isinstance(exp, list):
        assert isinstance(got, list) and len(got) == len(exp)
        for g, e in zip(got, exp):
            _same(g, e)
    elif exp is None:
        assert got is None
    else:
        got = np.asarray(got)
        assert got.shape == exp.shape and got.dtype == exp.dtype
        np.testing.assert_allclose(got, exp, rtol=1e-6)


@pytest.mark.parametrize("case", _control_cases(), ids=lambda c: c.name)
def test_onnx_node_case(case):
    node = case.model.graph.node[0]
    opset = next(o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx"))
    entry = lookup(node.op_type, "", opset)
    ctx = OnnxCtx(list(case.model.opset_import))
    for inputs, outputs in case.data_sets:
        feeds = dict(zip([i.name for i in case.model.graph.input], inputs))
        args = [feeds[n] if n else None for n in node.input]
        kwargs = _attrs(node)
        if entry.wants_n_outputs:
            kwargs["_n_outputs"] = len(node.output)
        if entry.wants_opset:
            kwargs["_opset"] = entry.opset
        res = entry.fn(*args, **kwargs, _ctx=ctx)
        res = res if isinstance(res, tuple) else (res,)
        assert len(res) == len(outputs)
        for g, e in zip(res, outputs):
            _same(g, e)


def test_if_picks_branch():
    rng = np.random.default_rng()
    a, b = rng.standard_normal(4), rng.standard_normal((2, 3))
    fn = lookup("If", "", 21).fn
    ctx = FnCtx()
    then, other = (lambda: [a, b]), (lambda: [b, a])
    got = fn(np.array([True]), then_branch=then, else_branch=other, _ctx=ctx)
    assert got[0] is a and got[1] is b
    got = fn(np.array(False), then_branch=then, else_branch=other, _ctx=ctx)
    assert got[0] is b and got[1] is a
    with pytest.raises(ValueError, match="one element"):
        fn(np.array([True, False]), then_branch=then, else_branch=other, _ctx=ctx)


def test_loop_while_and_for():
    rng = np.random.default_rng()
    x0 = rng.uniform(0.5, 1.5, size=(3,)).astype(np.float32)
    limit = float(rng.uniform(20, 60))

    def body(i, cond, x):
        y = x * np.float32(1.5) + np.float32(i)
        return [np.asarray(y.sum() < limit), y, y.sum(keepdims=True)]

    # independent computation: the same loop written out by hand
    x, frames = x0, []
    while True:
        x = x * np.float32(1.5) + np.float32(len(frames))
        frames.append(x.sum(keepdims=True))
        if not x.sum() < limit:
            break
    fn = lookup("Loop", "", 13).fn
    final, stacked = fn(None, np.array(True), x0, body=body, _ctx=FnCtx(), _n_outputs=2)
    np.testing.assert_allclose(final, x, rtol=1e-6)
    np.testing.assert_allclose(stacked, np.stack(frames), rtol=1e-6)
    # with a trip count and no cond the body's condition is ignored
    final, stacked = fn(np.array(7), None, x0, body=body, _ctx=FnCtx(), _n_outputs=2)
    expected = x0
    for i in range(7):
        expected = expected * np.float32(1.5) + np.float32(i)
    np.testing.assert_allclose(final, expected, rtol=1e-5, atol=1e-6)
    assert stacked.shape == (7, 1)


def test_loop_zero_trips_uses_declared_type():
    body = Graph(
        outputs=[
            Value("c", TensorType(DType.BOOL, ())),
            Value("x", TensorType(DType.FLOAT, (3,))),
            Value("s", TensorType(DType.INT32, (2, "n"))),
        ]
    )
    ctx = FnCtx({id(body): lambda *a: pytest.fail("the body must not run")})
    x0 = np.random.default_rng().standard_normal(3).astype(np.float32)
    final, scan = lookup("Loop", "", 16).fn(
        np.array(0), None, x0, body=body, _ctx=ctx, _n_outputs=2
    )
    assert final is x0
    assert scan.shape == (0, 2, 0) and scan.dtype == np.int32


def test_loop_carries_sequences_and_optionals():
    def body(i, cond, seq, opt):
        return [cond, [*seq, np.full(2, i)], None if opt is not None else np.ones(1)]

    seq, opt = lookup("Loop", "", 16).fn(
        np.array(3), None, [], None, body=body, _ctx=FnCtx(), _n_outputs=2
    )
    assert [s.tolist() for s in seq] == [[0, 0], [1, 1], [2, 2]]
    assert opt is not None


@pytest.mark.parametrize(
    "in_dir,out_dir,in_axis,out_axis", [(0, 0, 0, 0), (1, 0, 1, -1), (1, 1, -1, 1)]
)
def test_scan9_cumsum(in_dir, out_dir, in_axis, out_axis):
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 6)).astype(np.float32)
    init = rng.standard_normal(5 if in_axis in (1, -1) else 6).astype(np.float32)

    def body(s, xt):
        s = s + xt
        return [s, s * 2]

    got_s, got_y = lookup("Scan", "", 21).fn(
        init,
        x,
        body=body,
        num_scan_inputs=1,
        scan_input_axes=[in_axis],
        scan_input_directions=[in_dir],
        scan_output_axes=[out_axis],
        scan_output_directions=[out_dir],
        _ctx=FnCtx(),
        _n_outputs=2,
    )
    seq = np.moveaxis(x, in_axis, 0)
    seq = seq[::-1] if in_dir else seq
    run = np.cumsum(seq, axis=0) + init
    # sums of random normals can land near zero, where only an absolute tolerance makes sense
    np.testing.assert_allclose(got_s, run[-1], rtol=1e-5, atol=1e-6)
    ys = 2 * run
    ys = ys[::-1] if out_dir else ys
    np.testing.assert_allclose(got_y, np.moveaxis(ys, 0, out_axis % 2), rtol=1e-5, atol=1e-6)


def test_scan8_batches_and_sequence_lens():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 4, 2)).astype(np.float32)
    init = rng.standard_normal((3, 2)).astype(np.float32)
    lens = np.array([4, 2, 0], dtype=np.int64)

    def body(s, xt):
        s = s + xt
        return [s, s]

    entry = lookup("Scan", "", 8)
    got_s, got_y = entry.fn(
        lens, init, x, body=body, num_scan_inputs=1, directions=[1], _ctx=FnCtx(), _n_outputs=2,
        _opset=entry.opset,
    )  # fmt: skip
    for b in range(3):
        part = x[b, : lens[b]][::-1]
        run = init[b] + np.cumsum(part, axis=0)
        np.testing.assert_allclose(got_s[b], run[-1] if lens[b] else init[b], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_y[b, : lens[b]], run, rtol=1e-5, atol=1e-6)
        assert not got_y[b, lens[b] :].any()
    assert got_y.shape == (3, 4, 2)


def test_sequence_map_mixed_inputs():
    rng = np.random.default_rng()
    seq = [rng.standard_normal(rng.integers(1, 5)) for _ in range(4)]
    other = [rng.standard_normal(s.shape) for s in seq]
    t = rng.standard_normal(())

    def body(a, b, c):
        return [a + b * c, np.array(a.shape, dtype=np.int64)]

    out, shapes = lookup("SequenceMap", "", 17).fn(
        seq, other, t, body=body, _ctx=FnCtx(), _n_outputs=2
    )
    for a, b, o, s in zip(seq, other, out, shapes):
        np.testing.assert_allclose(o, a + b * t)
        assert s.tolist() == [a.shape[0]]
    with pytest.raises(ValueError, match="elements"):
        lookup("SequenceMap", "", 17).fn(seq, other[:2], body=body, _ctx=FnCtx(), _n_outputs=2)
