"""Generated Triton kernels of tensorkiln.Pointwise bodies against the reference Pointwise kernel.

Bodies come from the real fusion pass on small graphs, and hand-built ones give every op of the
generator's table (many ops as the outputs of one body, so that one kernel covers them: the
interpreter is slow). Inputs are fresh random values; float32 must agree within 1e-5 of the
output's scale, float16/bfloat16 within 1e-2 (the interpreter truncates float32 to bfloat16 where
the GPU rounds: one bfloat16 ulp is 4e-3).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tensorkiln.ir import DType, Graph, Node, TensorType, Value  # noqa: E402
from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402
from tensorkiln.kernels.tactics import LayerSpec, get_tactic  # noqa: E402
from tensorkiln.kernels.triton import pointwise as pw  # noqa: E402
from tensorkiln.passes.fuse_pointwise import fuse_pointwise  # noqa: E402
from tensorkiln.runtime.executor import Executor, Scope  # noqa: E402
from tests.passes.util import graph_of, model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = np.dtype(ml_dtypes.bfloat16)
F32, F16, I64, BOOL = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BOOL
node = helper.make_node
rng = np.random.default_rng()


def vi(name: str, shape, dtype: int = F32):
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name: str, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def randn(*shape: int, dtype=np.float32, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype)


def device_tensor(a: np.ndarray, device: str = DEVICE):
    return to_torch(a, device).reshape(a.shape)  # (to_torch gives 0-d arrays one dim)


def reference(body: Graph, arrays: list[np.ndarray]) -> list[np.ndarray]:
    entry = lookup("Pointwise", "tensorkiln", 1)
    return invoke(entry, arrays, {"body": body}, len(body.outputs), Scope(Executor(body), {}))


def triton_run(body: Graph, tensors: list) -> list[np.ndarray]:
    fn = get_tactic("Pointwise", "tensorkiln", "triton").fn
    got = fn(*tensors, body=body)
    return [to_numpy(t) for t in (got if isinstance(got, tuple) else (got,))]


def assert_close(got: np.ndarray, ref: np.ndarray, name: str = "") -> None:
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, reference {ref.shape}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype}, reference {ref.dtype}"
    if ref.dtype.kind not in "fV" and ref.dtype != BF16:
        np.testing.assert_array_equal(got, ref, err_msg=name)
        return
    g, r = got.astype(np.float64), ref.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(r), err_msg=f"{name}: NaNs differ")
    finite = np.isfinite(r)
    np.testing.assert_array_equal(g[~finite], r[~finite], err_msg=f"{name}: infinities differ")
    g, r = g[finite], r[finite]
    scale = float(np.abs(r).max()) if r.size else 0.0
    tol = 1e-5 if ref.dtype == np.float32 else 1e-2
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * scale, err_msg=name)


def check(body: Graph, arrays: list[np.ndarray], names: list[str] | None = None) -> None:
    """The body's generated kernel against the reference on ``arrays``, output by output."""
    assert pw.why_not(body) is None
    ref = reference(body, arrays)
    got = triton_run(body, [device_tensor(a) for a in arrays])
    assert len(got) == len(ref)
    for k, (g, r) in enumerate(zip(got, ref)):
        assert_close(g, r, names[k] if names else f"output {k}")


def fused_body(m) -> tuple[Graph, list[str]]:
    """The body of the one Pointwise node the fusion pass makes of model ``m``, and the names of
    the graph values bound to its inputs."""
    graph = graph_of(m)
    fuse_pointwise(graph)
    (pw_node,) = [n for n in graph.nodes if n.op == "Pointwise"]
    return pw_node.attrs["body"], [v.name for v in pw_node.inputs]


def feed(names: list[str], **arrays: np.ndarray) -> list[np.ndarray]:
    return [arrays[n] for n in names]


def op_body(ops: list[tuple], in_dtypes: list[DType], consts=(), opset: int = 24) -> Graph:
    """A body reading inputs i0.. (and constants c0..) with one output per ``(op, args, dtype,
    attrs)``; args name the inputs ("i0", "c1") or earlier outputs ("o2")."""
    values = {f"i{k}": Value(f"i{k}", TensorType(dt)) for k, dt in enumerate(in_dtypes)}
    inits = []
    for k, c in enumerate(consts):
        c = np.asarray(c)
        v = Value(f"c{k}", TensorType(DType.from_numpy(c.dtype), c.shape), const=c)
        values[v.name] = v
        inits.append(v)
    nodes, outs = [], []
    for k, (op, args, dtype, *rest) in enumerate(ops):
        attrs, domain = [*rest, {}][0], "tensorkiln" if op in ("SiLU",) else ""
        out = values[f"o{k}"] = Value(f"o{k}", TensorType(dtype))
        ins = [None if a is None else values[a] for a in args]
        nodes.append(Node(op, ins, [out], dict(attrs), domain, f"n{k}"))
        outs.append(out)
    inputs = [values[f"i{k}"] for k in range(len(in_dtypes))]
    return Graph("body", inputs, outs, nodes, inits, {"": opset, "tensorkiln": 1})


# ------------------------------------------------------------------------- bodies from the fusion


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_fused_erf_gelu_with_bias(dtype):
    onnx_type = F32 if dtype == np.float32 else F16
    m = model(
        [
            node("Add", ["m", "bias"], ["x"]),
            node("Div", ["x", "sqrt2"], ["d"]),
            node("Erf", ["d"], ["e"]),
            node("Add", ["e", "one"], ["e1"]),
            node("Mul", ["x", "e1"], ["p"]),
            node("Mul", ["p", "half"], ["out"]),
        ],
        [vi("m", [2, 5, 48], onnx_type)],
        [vi("out", [2, 5, 48], onnx_type)],
        [
            const("bias", rng.standard_normal(48), dtype),  # a vector constant: a loaded operand
            const("sqrt2", np.sqrt(2.0), dtype),
            const("one", 1.0, dtype),
            const("half", 0.5, dtype),
        ],
    )
    body, names = fused_body(m)
    check(body, feed(names, m=randn(2, 5, 48, dtype=dtype, scale=2)))


def test_fused_tanh_gelu_with_pow():
    m = model(
        [
            node("Pow", ["x", "three"], ["x3"]),
            node("Mul", ["x3", "k"], ["a"]),
            node("Add", ["x", "a"], ["b"]),
            node("Mul", ["b", "s"], ["c"]),
            node("Tanh", ["c"], ["t"]),
            node("Add", ["t", "one"], ["t1"]),
            node("Mul", ["x", "t1"], ["p"]),
            node("Mul", ["p", "half"], ["out"]),
        ],
        [vi("x", [3, 7, 33])],
        [vi("out", [3, 7, 33])],
        [
            const("three", 3.0),
            const("k", 0.044715),
            const("s", np.sqrt(2 / np.pi)),
            const("one", 1.0),
            const("half", 0.5),
        ],
    )
    body, names = fused_body(m)
    check(body, feed(names, x=randn(3, 7, 33, scale=3)))


def test_fused_extra_output_smaller_than_the_result():
    """``a = x + y`` is read outside the fusion and spans only [8] of the [4, 8] result."""
    m = model(
        [
            node("Add", ["x", "y"], ["a"]),
            node("Sigmoid", ["a"], ["s"]),
            node("Mul", ["s", "z"], ["out"]),
            node("MatMul", ["a", "w"], ["side"]),
        ],
        [vi("x", [8]), vi("y", [8]), vi("z", [4, 8])],
        [vi("out", [4, 8]), vi("side", [3])],
        [const("w", rng.standard_normal((8, 3)))],
    )
    body, names = fused_body(m)
    assert len(body.outputs) == 2
    check(body, feed(names, x=randn(8), y=randn(8), z=randn(4, 8)))


def test_fused_attention_mask_ints_and_bools():
    """An attention-mask expression: int64 compare, bool logic, Where and a Cast to float."""
    m = model(
        [
            node("Equal", ["ids", "pad"], ["is_pad"]),
            node("Not", ["is_pad"], ["keep"]),
            node("And", ["keep", "causal"], ["allowed"]),
            node("Cast", ["allowed"], ["f"], to=F32),
            node("Sub", ["one", "f"], ["inv"]),
            node("Mul", ["inv", "big"], ["bias"]),
            node("Where", ["allowed", "scores", "bias"], ["out"]),
        ],
        [
            vi("ids", [2, 1, 1, 9], I64),
            vi("causal", [1, 1, 9, 9], BOOL),
            vi("scores", [2, 3, 9, 9]),
        ],
        [vi("out", [2, 3, 9, 9])],
        [const("pad", [[[[0]]]], np.int64), const("one", 1.0), const("big", -1e4)],
    )
    ids = rng.integers(0, 3, (2, 1, 1, 9)).astype(np.int64)
    causal = np.tril(np.ones((9, 9), bool))[None, None]
    body, names = fused_body(m)
    assert body.nodes[0].op == "Equal"
    check(body, feed(names, ids=ids, causal=causal, scores=randn(2, 3, 9, 9)))


def test_fused_body_runs_through_the_executor_as_a_tactic():
    """The tactic as the executor calls it (by node name), against the reference engine."""
    m = model(
        [
            node("Mul", ["x", "y"], ["a"]),
            node("Relu", ["a"], ["b"]),
            node("Add", ["b", "x"], ["out"]),
        ],
        [vi("x", [5, 6]), vi("y", [6])],
        [vi("out", [5, 6])],
    )
    graph = graph_of(m)
    fuse_pointwise(graph)
    (pw_node,) = graph.nodes
    feeds = [randn(5, 6), randn(6)]
    ref = Executor(graph).run(dict(zip(graph.inputs, feeds)))
    fn = get_tactic("Pointwise", "tensorkiln", "triton").fn
    ex = Executor(graph, "cuda", DEVICE, tactics={pw_node.name: fn})
    got = ex.run({v: device_tensor(a) for v, a in zip(graph.inputs, feeds)})
    assert_close(to_numpy(got[0]), ref[0])


# ------------------------------------------------------------------------- every op


FLOAT_UNARY = [
    "Neg", "Abs", "Relu", "Sigmoid", "Tanh", "Erf", "Exp", "Reciprocal", "Softplus", "Softsign",
    "Mish", "Floor", "Ceil", "Round", "Sign", "Identity", "HardSwish", "SiLU",
]  # fmt: skip
FLOAT_UNARY_ATTRS = [
    ("LeakyRelu", {}),
    ("LeakyRelu", {"alpha": 0.3}),
    ("HardSigmoid", {}),
    ("HardSigmoid", {"alpha": 0.4, "beta": 0.6}),
    ("Gelu", {}),
    ("Gelu", {"approximate": "tanh"}),
    ("Swish", {"alpha": 1.5}),
    ("Elu", {"alpha": 0.7}),
    ("Selu", {}),
    ("Celu", {"alpha": 2.0}),
    ("ThresholdedRelu", {"alpha": 0.5}),
    ("Shrink", {"bias": 0.2, "lambd": 0.6}),
]
FLOAT_BINARY = ["Add", "Sub", "Mul", "Div", "Max", "Min", "PRelu", "Sum", "Mean"]
COMPARE = ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"]


def _unary_ops(dtype: DType) -> list[tuple]:
    ops = [(op, ["i0"], dtype) for op in FLOAT_UNARY]
    ops += [(op, ["i0"], dtype, attrs) for op, attrs in FLOAT_UNARY_ATTRS]
    ops += [(op, ["i1"], dtype) for op in ("Log", "Sqrt")]  # on positive values
    return ops


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"]
)
def test_float_unary_ops(dtype):
    t = DType.from_numpy(dtype)
    ops = _unary_ops(t)
    x = randn(6, 37, scale=3)
    x[0, :8] = [0.0, -0.0, 0.5, 1.5, 2.5, -2.5, 1e-3, -1e-4]  # Round's ties, small tanh/expm1
    check(
        op_body(ops, [t, t]),
        [x.astype(dtype), (np.abs(x) + 0.01).astype(dtype)],
        [o[0] for o in ops],
    )


def test_float_binary_ops_with_broadcasting():
    ops = [(op, ["i0", "i1"], DType.FLOAT) for op in FLOAT_BINARY]
    ops += [(op, ["i0", "i1"], DType.BOOL) for op in COMPARE]
    ops += [
        ("Sum", ["i0", "i1", "i0"], DType.FLOAT),
        ("Max", ["i0", "i1", "c0"], DType.FLOAT),
        ("Mod", ["i0", "i1"], DType.FLOAT),
        ("Mod", ["i0", "i1"], DType.FLOAT, {"fmod": 1}),
        ("Pow", ["i2", "i1"], DType.FLOAT),  # positive base, any exponent
        ("Pow", ["i0", "i3"], DType.FLOAT),  # any base, integer exponents (int64)
        ("Where", ["o9", "i0", "i1"], DType.FLOAT),  # o9: Equal... any bool output
        ("Clip", ["i0", "c1", "c2"], DType.FLOAT),
        ("Clip", ["i0", None, "i4"], DType.FLOAT),  # a bound as a (scalar) input
    ]
    x, y = randn(3, 4, 6, scale=2), randn(4, 1, scale=2)
    y[0, 0] = x[0, 0, 0]  # an Equal that holds
    e = rng.integers(-3, 4, (6,)).astype(np.int64)
    consts = [np.float32(0.25), np.float32(-0.5), np.float32(1.25)]
    body = op_body(ops, [DType.FLOAT, DType.FLOAT, DType.FLOAT, DType.INT64, DType.FLOAT], consts)
    arrays = [x, y, np.abs(x) + 0.1, e, np.array(0.5, np.float32)]
    check(body, arrays, [o[0] for o in ops])


@pytest.mark.parametrize("exponent", [0.0, 0.5, -0.5, 1.0, 2.0, 3.0, 4.0, -1.0, -2.0, 5.0, 1.7])
def test_pow_scalar_exponents(exponent):
    body = op_body([("Pow", ["i0", "c0"], DType.FLOAT)], [DType.FLOAT], [np.float32(exponent)])
    x = randn(5, 9, scale=2)
    if exponent != int(exponent):
        x = np.abs(x) + 0.1
    check(body, [x])


def test_integer_ops():
    ops = [
        (op, ["i0", "i1"], DType.INT64) for op in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Mod")
    ]
    ops += [(op, ["i0", "i1"], DType.BOOL) for op in COMPARE]
    ops += [
        ("Mod", ["i0", "i1"], DType.INT64, {"fmod": 1}),
        ("Neg", ["i0"], DType.INT64),
        ("Abs", ["i0"], DType.INT64),
        ("Relu", ["i0"], DType.INT64),
        ("Sign", ["i0"], DType.INT64),
        ("Pow", ["i0", "c0"], DType.INT64),
        ("Pow", ["i0", "c3"], DType.INT64),  # x ** 0
        ("Clip", ["i0", "c1", "c2"], DType.INT64),
        ("Add", ["i2", "i2"], DType.INT32),
        ("Cast", ["i0"], DType.INT32, {"to": int(DType.INT32)}),
        ("Cast", ["i0"], DType.INT8, {"to": int(DType.INT8)}),
        ("Cast", ["i0"], DType.FLOAT16, {"to": int(DType.FLOAT16)}),
        ("Cast", ["i0"], DType.BOOL, {"to": int(DType.BOOL)}),
    ]
    x = rng.integers(-50, 50, (4, 2, 5)).astype(np.int64)
    y = rng.integers(1, 7, (2, 1)).astype(np.int64) * np.array([[1], [-1]])  # both signs, no 0
    consts = [np.int64(3), np.int64(-10), np.int64(20), np.int64(0)]
    body = op_body(ops, [DType.INT64, DType.INT64, DType.INT32], consts)
    check(body, [x, y, x.astype(np.int32)], [o[0] for o in ops])


def test_bool_ops_and_casts():
    ops = [(op, ["i0", "i1"], DType.BOOL) for op in ("And", "Or", "Xor", "Equal")]
    ops += [
        ("Not", ["i0"], DType.BOOL),
        ("Where", ["i0", "i2", "i3"], DType.FLOAT16),
        ("Cast", ["i0"], DType.FLOAT, {"to": int(DType.FLOAT)}),
        ("Cast", ["i0"], DType.INT64, {"to": int(DType.INT64)}),
        ("Cast", ["i2"], DType.BOOL, {"to": int(DType.BOOL)}),
        ("Cast", ["i2"], DType.FLOAT, {"to": int(DType.FLOAT)}),
        ("Cast", ["i4"], DType.FLOAT16, {"to": int(DType.FLOAT16)}),  # rounds inside the body
        ("Cast", ["i4"], DType.BFLOAT16, {"to": int(DType.BFLOAT16)}),
        ("Cast", ["i4"], DType.INT32, {"to": int(DType.INT32)}),  # truncates toward zero
        ("Cast", ["i4"], DType.UINT8, {"to": int(DType.UINT8)}),
    ]
    a, b = rng.random((3, 10)) < 0.5, rng.random((10,)) < 0.5
    h = randn(3, 10, dtype=np.float16)
    h[0, 0] = 0
    f = np.minimum(np.abs(randn(3, 10, scale=50)), 250)  # within uint8
    dtypes = [DType.BOOL, DType.BOOL, DType.FLOAT16, DType.FLOAT16, DType.FLOAT]
    check(op_body(ops, dtypes), [a, b, h, randn(1, dtype=np.float16), f], [o[0] for o in ops])


def test_nan_and_inf():
    ops = [
        ("IsNaN", ["i0"], DType.BOOL),
        ("IsInf", ["i0"], DType.BOOL),
        ("IsInf", ["i0"], DType.BOOL, {"detect_negative": 0}),
        ("IsInf", ["i0"], DType.BOOL, {"detect_positive": 0}),
        ("Relu", ["i0"], DType.FLOAT),  # NaN stays NaN, as numpy's maximum
        ("Max", ["i0", "i1"], DType.FLOAT),
        ("Min", ["i0", "i1"], DType.FLOAT),
        ("Sigmoid", ["i0"], DType.FLOAT),
        ("Tanh", ["i0"], DType.FLOAT),
    ]
    x = np.array([1.0, np.nan, np.inf, -np.inf, -2.0, 0.0], np.float32)
    y = np.array([np.nan, 0.0, 1.0, 2.0, -3.0, np.inf], np.float32)
    check(op_body(ops, [DType.FLOAT, DType.FLOAT]), [x, y], [o[0] for o in ops])


# ------------------------------------------------------------------------- layouts


def _add_mul_body() -> Graph:
    return op_body(
        [("Add", ["i0", "i1"], DType.FLOAT), ("Mul", ["o0", "i1"], DType.FLOAT)],
        [DType.FLOAT, DType.FLOAT],
    )


@pytest.mark.parametrize(
    "shapes",
    [
        [(2, 3, 4, 5), (2, 3, 4, 5)],  # one flat dim
        [(4, 1, 6), (5, 1)],  # both sides broadcast
        [(2, 3, 1, 7), (3, 5, 1)],
        [(2, 1, 3, 1, 4), (1, 5, 1, 2, 1)],  # rank 5, alternating
        [(), ()],  # scalars
        [(6,), ()],
        [(0, 3), (3,)],  # empty
        [(1, 1, 1), (1,)],
    ],
    ids=str,
)
def test_broadcast_shapes(shapes):
    body = _add_mul_body()
    check(body, [randn(*s) for s in shapes])


def test_non_contiguous_inputs():
    body = _add_mul_body()
    x, y = randn(6, 8), randn(8, 6)
    ref = reference(body, [x, np.ascontiguousarray(y.T)])
    xt, yt = device_tensor(x)[:, ::1], device_tensor(y).t()  # yt: a transposed view
    sliced = device_tensor(randn(6, 16))[:, ::2]  # a strided view
    got = triton_run(body, [xt, yt])
    for g, r in zip(got, ref):
        assert_close(g, r)
    ref = reference(body, [to_numpy(sliced).copy(), np.ascontiguousarray(y.T)])
    for g, r in zip(triton_run(body, [sliced, yt]), ref):
        assert_close(g, r)


def test_layout_collapses_dims():
    # same shapes: one dim; a bias over the last dim: [rows, cols]; a per-channel [C, 1, 1]: 3 dims
    same = pw.layout([(2, 3, 4)], [(12, 4, 1), (12, 4, 1)])
    assert same.sizes == (24,) and same.pattern(0) == "1"
    bias = pw.layout([(2, 3, 4)], [(12, 4, 1), (0, 0, 1)])
    assert bias.sizes == (6, 4) and bias.pattern(1) == "01"
    chan = pw.layout([(2, 3, 4, 5)], [(60, 20, 5, 1), (0, 1, 0, 0)])
    assert chan.sizes == (2, 3, 20) and chan.pattern(1) == "0s0"


def test_equal_bodies_share_one_kernel():
    a, b = _add_mul_body(), _add_mul_body()
    assert pw.program(a).text == pw.program(b).text
    x, y = randn(3, 5), randn(5)
    triton_run(a, [device_tensor(x), device_tensor(y)])
    kernels = len(pw._KERNELS)
    triton_run(b, [device_tensor(x), device_tensor(y)])
    assert len(pw._KERNELS) == kernels


def test_attribute_values_are_formatted_numbers():
    body = op_body([("LeakyRelu", ["i0"], DType.FLOAT, {"alpha": float("inf")})], [DType.FLOAT])
    assert 'float("inf")' in pw.program(body).text
    check(body, [randn(4, 4)])


# ------------------------------------------------------------------------- what is not covered


@pytest.mark.parametrize(
    "ops, dtypes",
    [
        ([("Sin", ["i0"], DType.FLOAT)], [DType.FLOAT]),
        ([("Add", ["i0", "i0"], DType.DOUBLE)], [DType.DOUBLE]),
        ([("Mean", ["i0", "i0"], DType.INT64)], [DType.INT64]),
        ([("Pow", ["i0", "i0"], DType.INT64)], [DType.INT64]),
        ([("Cast", ["i0"], DType.STRING, {"to": int(DType.STRING)})], [DType.FLOAT]),
    ],
    ids=["Sin", "float64", "int-Mean", "int-Pow-tensor", "Cast-string"],
)
def test_unsupported_bodies_are_declined(ops, dtypes):
    body = op_body(ops, dtypes)
    assert not pw.can_generate(body)
    spec = LayerSpec("Pointwise", "tensorkiln", {"body": body}, ((4,),), ("float32",), "cpu")
    assert not get_tactic("Pointwise", "tensorkiln", "triton").applies(spec)


def test_supports_takes_a_covered_body():
    spec = LayerSpec(
        "Pointwise", "tensorkiln", {"body": _add_mul_body()}, ((4,), (4,)), ("float32",) * 2, DEVICE
    )
    assert get_tactic("Pointwise", "tensorkiln", "triton").applies(spec)


# ------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"]
)
def test_large_bodies_on_the_gpu(dtype):
    t = DType.from_numpy(dtype)
    ops = _unary_ops(t) + [(op, ["i0", "i2"], t) for op in FLOAT_BINARY]
    body = op_body(ops, [t, t, t])
    x = randn(8, 128, 769, dtype=dtype, scale=3)
    arrays = [x, (np.abs(x.astype(np.float32)) + 0.01).astype(dtype), randn(769, dtype=dtype)]
    check(body, arrays, [o[0] for o in ops])
    m = model(
        [node("Add", ["x", "b"], ["y"]), node("Gelu", ["y"], ["out"])],
        [vi("x", [64, 512, 768]), vi("b", [768])],
        [vi("out", [64, 512, 768])],
        opset=20,
    )
    body, names = fused_body(m)
    check(body, feed(names, x=randn(64, 512, 768), b=randn(768)))


def test_channels_last_inputs_give_channels_last_outputs():
    """An NHWC activation (the cuda backend's conv layout on a GPU) plus a per-channel bias and an
    NCHW tensor: right values, and the output keeps the channels-last layout of its input."""
    body = _add_mul_body()
    x, y = randn(2, 5, 4, 3), randn(5, 1, 1)
    xt = device_tensor(x).contiguous(memory_format=torch.channels_last)
    fn = get_tactic("Pointwise", "tensorkiln", "triton").fn
    got = fn(xt, device_tensor(y), body=body)
    got = got if isinstance(got, tuple) else (got,)
    for g, r in zip(got, reference(body, [x, y])):
        assert g.is_contiguous(memory_format=torch.channels_last) and not g.is_contiguous()
        assert_close(to_numpy(g), r)
    z = randn(2, 5, 4, 3)
    mixed = fn(xt, device_tensor(z), body=body)  # one NHWC operand, one NCHW
    mixed = mixed if isinstance(mixed, tuple) else (mixed,)
    for g, r in zip(mixed, reference(body, [x, z])):
        assert_close(to_numpy(g), r)


def _residual_block(qtype: int, zero_points: list, **kw):
    """DQ(aq), DQ(bq), Add, Relu, Q -> out: an explicitly quantized residual block, its tensors
    of ``qtype`` (2x8x5x6), ``zero_points`` the initializers za, zb, zy."""
    return model(
        [
            node("DequantizeLinear", ["aq", "sa", "za"], ["a"]),
            node("DequantizeLinear", ["bq", "sb", "zb"], ["b"]),
            node("Add", ["a", "b"], ["s"]),
            node("Relu", ["s"], ["r"]),
            node("QuantizeLinear", ["r", "sy", "zy"], ["out"]),
        ],
        [vi("aq", [2, 8, 5, 6], qtype), vi("bq", [2, 8, 5, 6], qtype)],
        [vi("out", [2, 8, 5, 6], qtype)],
        [const("sa", 0.05), const("sb", 0.04), const("sy", 0.06), *zero_points],
        **kw,
    )  # fmt: skip


@pytest.mark.parametrize("zero_point", ["int8", "uint8"])
def test_fused_quantized_residual_add(zero_point):
    """An explicitly quantized model's residual block: DQ(a), DQ(b), Add, Relu, Q -> one kernel
    reading int8 (or uint8 with zero points) and writing it, bit for bit the reference's, which is
    onnxruntime's (IEEE division, half-to-even rounding)."""
    ort = pytest.importorskip("onnxruntime")
    qtype, np_t = (
        (TensorProto.INT8, np.int8) if zero_point == "int8" else (TensorProto.UINT8, np.uint8)
    )
    zps = (0, 0, 0) if zero_point == "int8" else (128, 120, 3)
    m = _residual_block(
        qtype, [const(n, z, np_t) for n, z in zip(("za", "zb", "zy"), zps, strict=True)]
    )
    body, names = fused_body(m)
    assert [n.op for n in body.nodes] == [
        "DequantizeLinear", "DequantizeLinear", "Add", "Relu", "QuantizeLinear",
    ]  # fmt: skip
    lo, hi = (-128, 128) if zero_point == "int8" else (0, 256)
    arrays = {k: rng.integers(lo, hi, (2, 8, 5, 6)).astype(np_t) for k in ("aq", "bq")}
    check(body, feed(names, **arrays))
    got = reference(body, feed(names, **arrays))[0]
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(got, session.run(None, arrays)[0])


FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _fp8_codes(shape, rng_) -> np.ndarray:
    """Random float8 E4M3 values: every bit pattern but the NaNs (0x7f, 0xff)."""
    bits = rng_.integers(0, 256, shape).astype(np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C  # (1.5)
    return bits.view(FP8)


def test_fused_fp8_residual_add():
    """An FP8 model's residual block: DQ(a), DQ(b), Add, Relu, Q to float8 E4M3 -> one kernel
    reading and writing float8, bit for bit the reference's, which is onnxruntime's reference
    run (graph optimizations off)."""
    ort = pytest.importorskip("onnxruntime")
    f8 = TensorProto.FLOAT8E4M3FN

    def zero(name):
        return helper.make_tensor(
            name, f8, [], np.zeros((), FP8).view(np.uint8).tobytes(), raw=True
        )

    m = _residual_block(f8, [zero("za"), zero("zb"), zero("zy")], opset=21)
    body, names = fused_body(m)
    assert [n.op for n in body.nodes] == [
        "DequantizeLinear", "DequantizeLinear", "Add", "Relu", "QuantizeLinear",
    ]  # fmt: skip
    arrays = {k: _fp8_codes((2, 8, 5, 6), rng) for k in ("aq", "bq")}
    got = triton_run(body, [device_tensor(a) for a in feed(names, **arrays)])[0]
    ref = reference(body, feed(names, **arrays))[0]
    assert got.dtype == ref.dtype == FP8
    np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        m.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    fed = {  # (onnxruntime takes float8 tensors as their bytes, and gives them back so)
        k: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint8), f8)
        for k, a in arrays.items()
    }
    # (equal codes, except that E4M3's -0 (0x80) and +0 are one value: where both inputs are -0,
    # Relu(-0) is -0 in onnxruntime and +0 here, which ONNX leaves open)
    want = session.run_with_ort_values(None, fed)[0].numpy()
    np.testing.assert_array_equal(np.where(ref.view(np.uint8) == 0x80, 0, ref.view(np.uint8)),
                                  np.where(want == 0x80, 0, want))  # fmt: skip


def test_fp8_quantize_rounds_half_to_even_and_saturates():
    """QuantizeLinear to float8 E4M3 in a generated kernel, on the values where rounding and
    saturation show: every halfway point between neighbouring E4M3 values (ties to even), the
    subnormals, +-448 and beyond, infinities, NaN, -0 and negative values that round to zero;
    the float8 output and its DequantizeLinear bit for bit the reference kernel's, whose float8
    codes are onnxruntime's (saturating, as ONNX's default)."""
    ort = pytest.importorskip("onnxruntime")
    grid = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    halves = (grid[:-1] + grid[1:]) / 2  # (exact in float32)
    special = [448.0, 464.0, 470.0, 480.0, 1e6, -1e6, np.inf, -np.inf, np.nan, -0.0, 2.0**-10,
               3 * 2.0**-11, 2.0**-12, 1e-30, -1e-30, -(2.0**-11)]  # fmt: skip
    x = np.concatenate([grid, halves, np.float32(special), rng.standard_normal(500) * 60])
    x = np.concatenate([x, np.zeros(-x.size % 64)]).astype(np.float32).reshape(-1, 64)
    f8 = DType.FLOAT8E4M3FN
    for scale in (1.0, 0.37):  # (1: the halfway points stay halfway after the division)
        body = op_body(
            [("QuantizeLinear", ["i0", "c0", "c1"], f8),
             ("DequantizeLinear", ["o0", "c0", "c1"], DType.FLOAT)],
            [DType.FLOAT], consts=[np.float32(scale), np.zeros((), FP8)], opset=21,
        )  # fmt: skip
        ref = reference(body, [x])
        got = triton_run(body, [device_tensor(x)])
        np.testing.assert_array_equal(got[0].view(np.uint8), ref[0].view(np.uint8))
        nan = np.isnan(ref[1])  # (NaN's payload is not a value: compared as NaN)
        np.testing.assert_array_equal(np.isnan(got[1]), nan)
        np.testing.assert_array_equal(got[1][~nan].view(np.uint32), ref[1][~nan].view(np.uint32))
        m = helper.make_model(
            helper.make_graph(
                [node("QuantizeLinear", ["x", "s", "z"], ["y"])], "q", [vi("x", list(x.shape))],
                [vi("y", list(x.shape), TensorProto.FLOAT8E4M3FN)],
                [const("s", scale), helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0])],
            ),
            opset_imports=[helper.make_opsetid("", 21)], ir_version=10,
        )  # fmt: skip
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(ref[0].view(np.uint8), session.run(None, {"x": x})[0])
