"""Native shape rules of ONNX ops, and symbolic value propagation for shape computations.

A rule takes an :class:`InferContext` and returns the output types of the node; :func:`rule` puts
it on the op's record. Ops without a rule fall back to ONNX's schema inference (see
:mod:`tensorkiln.ops.infer`); the rules here are the ones where symbolic dimensions matter
(elementwise broadcasting, MatMul, Reshape and the ops that compute shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorkiln.ir.dims import broadcast_shapes, dim_divide, dim_product, fresh_dim
from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import Dim, Graph, Node, Shape, TensorType, Type
from tensorkiln.ops.onnx_ops import UNARY_ELEMENTWISE
from tensorkiln.ops.records import Rule, rule

__all__ = ["InferContext", "Rule", "rule", "symbolic_value"]


@dataclass(slots=True)
class InferContext:
    node: Node
    opset: int
    values: list[np.ndarray | None]  # known input values (object arrays hold symbolic dims)
    # the inference that asked, for rules that infer a body graph the same way (Pointwise)
    infer: Callable[[Graph], None] | None = None

    def type(self, i: int) -> Type | None:
        if i >= len(self.node.inputs) or self.node.inputs[i] is None:
            return None
        return self.node.inputs[i].type

    def dtype(self, i: int) -> DType | None:
        t = self.type(i)
        return t.dtype if isinstance(t, TensorType) else None

    def shape(self, i: int) -> Shape | None:
        t = self.type(i)
        return t.shape if isinstance(t, TensorType) else None

    def value(self, i: int) -> np.ndarray | None:
        return self.values[i] if i < len(self.values) else None

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)

    def ints(self, i: int, attr: str) -> list[Dim] | None:
        """A list of ints (or symbols) given as input ``i`` or, in older opsets, attribute ``attr``."""
        if attr in self.node.attrs:
            return list(self.node.attrs[attr])
        v = self.value(i)
        return None if v is None else [_py(x) for x in np.asarray(v).reshape(-1)]


def _py(x: Any) -> Dim:
    return x if isinstance(x, str) else int(x)


def _t(dtype: DType | None, shape: Shape | None) -> TensorType:
    return TensorType(dtype, None if shape is None else tuple(shape))


def _axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


# Ops whose output has the type of their first input: the elementwise ops of one input (but those
# with a bool output and Cast), and the normalizations along an axis.
_SAME_TYPE = sorted(
    {*UNARY_ELEMENTWISE} - {"Cast", "IsInf", "IsNaN", "Not"}
    | {
        "BitwiseNot",
        "Hardmax",
        "Identity",
        "LogSoftmax",
        "LpNormalization",
        "LRN",
        "MeanVarianceNormalization",
        "Softmax",
    }
)


@rule(*_SAME_TYPE)
def _same(ctx: InferContext) -> list[Type | None]:
    return [ctx.type(0)]


@rule("Not", "IsNaN", "IsInf")
def _bool_same(ctx: InferContext) -> list[Type | None]:
    return [_t(DType.BOOL, ctx.shape(0))]


def _broadcast(ctx: InferContext, idx: range | list[int]) -> Shape | None:
    shapes = [ctx.shape(i) for i in idx]
    if any(s is None for s in shapes):
        return None
    return broadcast_shapes(*shapes)  # type: ignore[arg-type]


@rule("Add", "Sub", "Mul", "Div", "Pow", "Mod", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor")
def _arith(ctx: InferContext) -> list[Type | None]:
    if ctx.opset < 7 and ctx.attr("broadcast"):
        return [ctx.type(0)]  # legacy broadcast with an axis attribute: output is A's shape
    return [_t(ctx.dtype(0), _broadcast(ctx, [0, 1]))]


@rule("PRelu")
def _prelu(ctx: InferContext) -> list[Type | None]:
    # The slope broadcasts to X (unidirectionally; per channel in opsets before 7).
    return [ctx.type(0)]


@rule("And", "Or", "Xor", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")
def _compare(ctx: InferContext) -> list[Type | None]:
    if ctx.opset < 7 and ctx.attr("broadcast"):
        return [_t(DType.BOOL, ctx.shape(0))]
    return [_t(DType.BOOL, _broadcast(ctx, [0, 1]))]


@rule("Where")
def _where(ctx: InferContext) -> list[Type | None]:
    return [_t(ctx.dtype(1), _broadcast(ctx, [0, 1, 2]))]


@rule("Max", "Min", "Sum", "Mean")
def _variadic(ctx: InferContext) -> list[Type | None]:
    return [_t(ctx.dtype(0), _broadcast(ctx, range(len(ctx.node.inputs))))]


@rule("Cast")
def _cast(ctx: InferContext) -> list[Type | None]:
    return [_t(DType(ctx.attr("to")), ctx.shape(0))]


# Natively, so that a model of an older opset quantized to float8 by the builder (E4M3 zero
# points, which ONNX's schemas before opset 19 refuse) still infers at the tuning shapes.
@rule("QuantizeLinear")
def _quantize(ctx: InferContext) -> list[Type | None]:
    """The zero point's type, else ``output_dtype``, else uint8; the input's shape."""
    dtype = ctx.dtype(2)
    if dtype is None:
        dtype = DType(ctx.attr("output_dtype", 0) or DType.UINT8.value)
    return [_t(dtype, ctx.shape(0))]


@rule("DequantizeLinear")
def _dequantize(ctx: InferContext) -> list[Type | None]:
    """``output_dtype`` when set (opset 23), else the scale's type; the input's shape."""
    code = ctx.attr("output_dtype", 0)
    return [_t(DType(code) if code else ctx.dtype(1), ctx.shape(0))]


@rule("CastLike")
def _castlike(ctx: InferContext) -> list[Type | None]:
    return [_t(ctx.dtype(1), ctx.shape(0))]


@rule("MatMul")
def _matmul(ctx: InferContext) -> list[Type | None]:
    a, b = ctx.shape(0), ctx.shape(1)
    if a is None or b is None:
        return [_t(ctx.dtype(0), None)]
    if len(a) == 0 or len(b) == 0:
        raise ValueError("MatMul inputs must have rank >= 1")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    k1, k2 = a2[-1], b2[-2]
    if isinstance(k1, int) and isinstance(k2, int) and k1 != k2:
        raise ValueError(f"inner dimensions differ: {list(a)} @ {list(b)} ({k1} != {k2})")
    batch = broadcast_shapes(tuple(a2[:-2]), tuple(b2[:-2]))
    out = [*batch, a2[-2], b2[-1]]
    if len(b) == 1:
        out.pop()
    if len(a) == 1:
        out.pop(-2 if len(b) != 1 else -1)
    return [_t(ctx.dtype(0), tuple(out))]


@rule("Gemm")
def _gemm(ctx: InferContext) -> list[Type | None]:
    a, b = ctx.shape(0), ctx.shape(1)
    if a is None or b is None:
        return [_t(ctx.dtype(0), None)]
    if len(a) != 2 or len(b) != 2:
        raise ValueError(f"Gemm takes 2-D inputs, got shapes {list(a)} and {list(b)}")
    m, k1 = (a[1], a[0]) if ctx.attr("transA", 0) else a
    k2, n = (b[1], b[0]) if ctx.attr("transB", 0) else b
    if isinstance(k1, int) and isinstance(k2, int) and k1 != k2:
        raise ValueError(f"inner dimensions differ: A is {list(a)}, B is {list(b)}")
    return [_t(ctx.dtype(0), (m, n))]


@rule("Reshape")
def _reshape(ctx: InferContext) -> list[Type | None]:
    target = ctx.ints(1, "shape")
    src = ctx.shape(0)
    if target is None:
        return [_t(ctx.dtype(0), None)]
    out = list(target)
    if not ctx.attr("allowzero", 0):
        for i, d in enumerate(out):
            if d == 0:
                if src is None or i >= len(src):
                    return [_t(ctx.dtype(0), None)]
                out[i] = src[i]
    if -1 in out:
        if out.count(-1) > 1:
            raise ValueError(f"shape {target} has more than one -1")
        i = out.index(-1)
        rest = dim_product(d for j, d in enumerate(out) if j != i)
        out[i] = fresh_dim() if src is None else (dim_divide(dim_product(src), rest) or fresh_dim())
        if src is not None and all(isinstance(d, int) for d in (*src, rest)) and out[i] == -1:
            raise ValueError(f"cannot reshape {list(src)} to {target}")
    elif src is not None:
        a, b = dim_product(src), dim_product(out)
        if isinstance(a, int) and isinstance(b, int) and a != b:
            raise ValueError(f"cannot reshape {list(src)} ({a} elements) to {target} ({b})")
    return [_t(ctx.dtype(0), tuple(out))]


@rule("Expand")
def _expand(ctx: InferContext) -> list[Type | None]:
    target, src = ctx.ints(1, "_"), ctx.shape(0)
    if target is None or src is None:
        return [_t(ctx.dtype(0), None)]
    return [_t(ctx.dtype(0), broadcast_shapes(tuple(src), tuple(target)))]


@rule("ConstantOfShape")
def _constant_of_shape(ctx: InferContext) -> list[Type | None]:
    value = ctx.attr("value")
    dtype = DType.from_numpy(value.dtype) if value is not None else DType.FLOAT
    target = ctx.ints(0, "_")
    if target is None:
        s = ctx.shape(0)
        rank = s[0] if s is not None and len(s) == 1 and isinstance(s[0], int) else None
        return [_t(dtype, None if rank is None else tuple(fresh_dim() for _ in range(rank)))]
    return [_t(dtype, tuple(target))]


def _shape_bounds(ctx: InferContext, rank: int) -> tuple[int, int]:
    start = ctx.attr("start", 0)
    end = ctx.attr("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return start, max(start, end)


@rule("Shape")
def _shape(ctx: InferContext) -> list[Type | None]:
    s = ctx.shape(0)
    if s is None:
        return [_t(DType.INT64, (fresh_dim(),))]
    start, end = _shape_bounds(ctx, len(s))
    return [_t(DType.INT64, (end - start,))]


@rule("Size")
def _size(ctx: InferContext) -> list[Type | None]:
    return [_t(DType.INT64, ())]


@rule("Gather")
def _gather(ctx: InferContext) -> list[Type | None]:
    data, idx = ctx.shape(0), ctx.shape(1)
    if data is None or idx is None:
        return [_t(ctx.dtype(0), None)]
    axis = _axis(ctx.attr("axis", 0), len(data))
    return [_t(ctx.dtype(0), (*data[:axis], *idx, *data[axis + 1 :]))]


@rule("Concat")
def _concat(ctx: InferContext) -> list[Type | None]:
    shapes = [ctx.shape(i) for i in range(len(ctx.node.inputs))]
    if not shapes or any(s is None for s in shapes):
        return [_t(ctx.dtype(0), None)]
    rank = len(shapes[0])
    axis = _axis(ctx.attr("axis"), rank)
    out = list(shapes[0])
    for s in shapes[1:]:
        if len(s) != rank:
            raise ValueError(f"inputs have different ranks: {[list(x) for x in shapes]}")
        for i, (a, b) in enumerate(zip(out, s)):
            if i != axis and isinstance(a, int) and isinstance(b, int) and a != b:
                raise ValueError(f"input shapes {[list(x) for x in shapes]} differ off axis {axis}")
    sizes = [s[axis] for s in shapes]
    out[axis] = sum(sizes) if all(isinstance(d, int) for d in sizes) else fresh_dim()
    return [_t(ctx.dtype(0), tuple(out))]


@rule("Unsqueeze")
def _unsqueeze(ctx: InferContext) -> list[Type | None]:
    axes, s = ctx.ints(1, "axes"), ctx.shape(0)
    if axes is None or s is None:
        return [_t(ctx.dtype(0), None)]
    rank = len(s) + len(axes)
    norm = sorted(_axis(int(a), rank) for a in axes)
    out: list[Dim] = list(s)
    for a in norm:
        out.insert(a, 1)
    return [_t(ctx.dtype(0), tuple(out))]


@rule("Squeeze")
def _squeeze(ctx: InferContext) -> list[Type | None]:
    axes, s = ctx.ints(1, "axes"), ctx.shape(0)
    if s is None:
        return [_t(ctx.dtype(0), None)]
    if axes is None:
        if len(ctx.node.inputs) > 1 and ctx.node.inputs[1] is not None:
            return [_t(ctx.dtype(0), None)]
        if any(isinstance(d, str) for d in s):
            return [_t(ctx.dtype(0), None)]
        return [_t(ctx.dtype(0), tuple(d for d in s if d != 1))]
    drop = {_axis(int(a), len(s)) for a in axes}
    for a in drop:
        if isinstance(s[a], int) and s[a] != 1:
            raise ValueError(f"cannot squeeze axis {a} of size {s[a]}")
    return [_t(ctx.dtype(0), tuple(d for i, d in enumerate(s) if i not in drop))]


@rule("Transpose")
def _transpose(ctx: InferContext) -> list[Type | None]:
    s = ctx.shape(0)
    if s is None:
        return [_t(ctx.dtype(0), None)]
    perm = ctx.attr("perm") or list(range(len(s)))[::-1]
    if sorted(perm) != list(range(len(s))):
        raise ValueError(f"perm {perm} is not a permutation of the {len(s)} axes")
    return [_t(ctx.dtype(0), tuple(s[p] for p in perm))]


@rule("Flatten")
def _flatten(ctx: InferContext) -> list[Type | None]:
    s = ctx.shape(0)
    if s is None:
        return [_t(ctx.dtype(0), None)]
    axis = ctx.attr("axis", 1)
    axis = axis + len(s) if axis < 0 else axis
    return [_t(ctx.dtype(0), (dim_product(s[:axis]), dim_product(s[axis:])))]


@rule("Split")
def _split(ctx: InferContext) -> list[Type | None]:
    n = len(ctx.node.outputs)
    s = ctx.shape(0)
    if s is None:
        return [_t(ctx.dtype(0), None)] * n
    axis = _axis(ctx.attr("axis", 0), len(s))
    sizes = ctx.ints(1, "split")
    dim = s[axis]
    if sizes is not None and len(sizes) != n:
        raise ValueError(f"split gives {len(sizes)} sizes for {n} outputs")
    if sizes is None:
        if isinstance(dim, int):
            chunk = -(-dim // n)  # the last part is smaller when num_outputs does not divide
            sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(n)]
            if "num_outputs" not in ctx.node.attrs and dim % n:
                raise ValueError(f"size {dim} of axis {axis} does not split into {n} equal parts")
        else:
            part = dim_divide(dim, n)
            sizes = [part if part is not None else fresh_dim() for _ in range(n)]
    elif isinstance(dim, int) and all(isinstance(x, int) for x in sizes) and sum(sizes) != dim:
        raise ValueError(f"split sizes {sizes} do not add up to {dim}, the size of axis {axis}")
    return [_t(ctx.dtype(0), (*s[:axis], size, *s[axis + 1 :])) for size in sizes]


_BIG = 1 << 62  # exporters write "to the end" as INT64_MAX or similar


def _slice_len(d: Dim, start: Dim, end: Dim, step: int) -> Dim:
    """Elements of ``d`` in [start:end:step] (ONNX clamping), symbolic where it can be."""
    if isinstance(d, int) and isinstance(start, int) and isinstance(end, int):
        return len(range(*slice(start, end, step).indices(d)))
    if step == 1 and start == 0:
        if isinstance(end, int) and end >= _BIG:
            return d
        if end == d:
            return d
        if isinstance(end, str) and isinstance(d, int):
            return end  # x[:S] of a table with d rows: S rows (S <= d, or the kernel fails)
    return fresh_dim()


@rule("Slice")
def _slice_rule(ctx: InferContext) -> list[Type | None]:
    s = ctx.shape(0)
    starts, ends = ctx.ints(1, "starts"), ctx.ints(2, "ends")
    if s is None or starts is None or ends is None:
        return [_t(ctx.dtype(0), None)]
    axes = ctx.ints(3, "axes") or list(range(len(starts)))
    steps = (ctx.ints(4, "_") if ctx.opset >= 10 else None) or [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(
            f"starts {starts}, ends {ends}, axes {axes}, steps {steps} differ in length"
        )
    out = list(s)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        if not isinstance(step, int) or not isinstance(axis, int):
            return [_t(ctx.dtype(0), None)]
        if step == 0:
            raise ValueError("Slice step must not be 0")
        a = _axis(axis, len(s))
        out[a] = _slice_len(s[a], start, end, step)
    return [_t(ctx.dtype(0), tuple(out))]


@rule("Range")
def _range(ctx: InferContext) -> list[Type | None]:
    start, limit, delta = (ctx.value(i) for i in range(3))
    dtype = ctx.dtype(0)
    if start is not None and limit is not None and delta is not None:
        a, b, d = (np.asarray(x).reshape(-1)[0] for x in (start, limit, delta))
        if isinstance(b, str) and not isinstance(a, str) and not isinstance(d, str):
            if int(a) == 0 and int(d) == 1:
                return [_t(dtype, (b,))]  # arange(S) has S elements, symbolically too
        elif not any(isinstance(x, str) for x in (a, b, d)) and float(d) != 0:
            return [_t(dtype, (max(int(np.ceil((float(b) - float(a)) / float(d))), 0),))]
    return [_t(dtype, (fresh_dim(),))]


# ---------------------------------------------------------------------------------------------
# Symbolic values: what shape-computing nodes produce when the shapes they read are symbolic.


def symbolic_value(ctx: InferContext) -> np.ndarray | None:
    fn = _VALUE_FNS.get(ctx.node.op) if ctx.node.domain == "" else None
    if fn is None:
        return None
    try:
        out = fn(ctx)
    except (ValueError, IndexError, TypeError, KeyError):
        return None
    if out is None:
        return None
    out = np.asarray(out, dtype=object)
    if all(not isinstance(x, str) for x in out.reshape(-1)):
        result = ctx.node.outputs[0].type if ctx.node.outputs else None
        dtype = result.dtype if isinstance(result, TensorType) and result.dtype else DType.INT64
        return out.astype(dtype.numpy)
    return out


def _v_shape(ctx: InferContext) -> Any:
    s = ctx.shape(0)
    if s is None:
        return None
    start, end = _shape_bounds(ctx, len(s))
    return np.array(list(s[start:end]), dtype=object)


def _v_gather(ctx: InferContext) -> Any:
    data, idx = ctx.value(0), ctx.value(1)
    if data is None or idx is None or idx.dtype == object:
        return None
    return np.take(data, idx.astype(np.int64), axis=ctx.attr("axis", 0))


def _v_concat(ctx: InferContext) -> Any:
    vals = [ctx.value(i) for i in range(len(ctx.node.inputs))]
    if any(v is None for v in vals):
        return None
    return np.concatenate([np.asarray(v, dtype=object) for v in vals], axis=ctx.attr("axis"))


def _v_reshape_like(ctx: InferContext) -> Any:
    v = ctx.value(0)
    out_type = ctx.node.outputs[0].type if ctx.node.outputs[0] is not None else None
    if v is None or not isinstance(out_type, TensorType) or out_type.shape is None:
        return None
    if any(isinstance(d, str) for d in out_type.shape):
        return None
    return np.asarray(v, dtype=object).reshape(out_type.shape)


def _v_slice(ctx: InferContext) -> Any:
    v = ctx.value(0)
    if v is None or v.ndim != 1:
        return None
    starts, ends = ctx.ints(1, "starts"), ctx.ints(2, "ends")
    steps = ctx.ints(4, "_") if len(ctx.node.inputs) > 4 else None
    if starts is None or ends is None:
        return None
    step = steps[0] if steps else 1
    return v[slice(int(starts[0]), int(ends[0]), int(step))]


def _v_pass(ctx: InferContext) -> Any:
    return ctx.value(0)


def _elementwise(fn: Callable[[Any, Any], Any]) -> Callable[[InferContext], Any]:
    def apply(ctx: InferContext) -> Any:
        a, b = ctx.value(0), ctx.value(1)
        if a is None or b is None:
            return None
        a, b = np.broadcast_arrays(np.asarray(a, dtype=object), np.asarray(b, dtype=object))
        out = [fn(_py(x), _py(y)) for x, y in zip(a.reshape(-1), b.reshape(-1))]
        if any(x is None for x in out):
            return None
        return np.array(out, dtype=object).reshape(a.shape)

    return apply


def _sym_add(a: Dim, b: Dim) -> Dim | None:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    return a if b == 0 else b if a == 0 else None


def _sym_sub(a: Dim, b: Dim) -> Dim | None:
    if isinstance(a, int) and isinstance(b, int):
        return a - b
    return a if b == 0 else None


def _sym_eq(a: Dim, b: Dim) -> bool | None:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if a == b:
        return True
    if (isinstance(a, int) and a < 0) or (isinstance(b, int) and b < 0):
        return False  # a dimension is never negative
    return None


def _v_where(ctx: InferContext) -> Any:
    c, x, y = ctx.value(0), ctx.value(1), ctx.value(2)
    if c is None or x is None or y is None or c.dtype == object:
        return None
    return np.where(c, np.asarray(x, dtype=object), np.asarray(y, dtype=object))


_VALUE_FNS: dict[str, Callable[[InferContext], Any]] = {
    "Shape": _v_shape,
    "Gather": _v_gather,
    "Concat": _v_concat,
    "Unsqueeze": _v_reshape_like,
    "Squeeze": _v_reshape_like,
    "Reshape": _v_reshape_like,
    "Slice": _v_slice,
    "Cast": _v_pass,
    "Identity": _v_pass,
    "Add": _elementwise(_sym_add),
    "Sub": _elementwise(_sym_sub),
    "Mul": _elementwise(lambda a, b: dim_product([a, b])),
    "Div": _elementwise(
        lambda a, b: a // b if isinstance(a, int) and isinstance(b, int) else dim_divide(a, b)
    ),
    "Equal": _elementwise(_sym_eq),
    "Where": _v_where,
}
