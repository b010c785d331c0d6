"""Fusions of normalizations: LayerNorm, RMSNorm, and a residual Add folded into LayerNorm.

Each pass is a list of rules run by :func:`tensorkiln.passes.rules.run_rules`: matches are
collected first and applied once; the pass returns their count. The decompositions are matched
from their first node (the ReduceMean) on, with the shared :class:`~tensorkiln.passes.rules.View`.
The activation fusions (GELU, SiLU, Softmax) are in :mod:`tensorkiln.passes.fuse_activation`.

* ``fuse_layer_norm``: ONNX LayerNormalization, and its decomposition
  ``ReduceMean -> Sub -> Pow(2) | Mul(d, d) -> ReduceMean -> Add(eps) -> Sqrt -> Div | Reciprocal+Mul
  [-> Mul(scale)] [-> Add(bias)]``, become ``tensorkiln.LayerNorm``.
* ``fold_residual_into_layer_norm``: ``LayerNorm(Add(a, b))`` becomes ``LayerNorm(a, .., residual=b)``;
  when the sum is read elsewhere, the fused node's second output returns it. One operand may be a
  constant (the dynamo exporter folds position embeddings into one); the residual may broadcast.
* ``fold_residual_into_gemm``: ``LayerNorm(x, .., residual=r)`` where one of x, r is made by a
  float Gemm/GemmAct without activation (through a Reshape at most) that only this LayerNorm
  reads becomes that GEMM with the other as its residual input Z, the LayerNorm reading the sum
  alone: the GEMM's epilogue writes the sum (cuBLASLt's C with beta 1), so the LayerNorm reads
  one tensor where it read two, and writes none besides its output where it wrote the sum for
  the next block too (a pre-LN transformer's residual stream). Shapes must be equal, nothing
  broadcast; not run for quantized builds (QGemmAct takes no residual).
* ``fuse_rms_norm``: ONNX RMSNormalization, and ``Pow(2) | Mul(x, x) -> ReduceMean -> Add(eps) ->
  Sqrt -> Div | Reciprocal+Mul [-> Mul(scale)]``, become ``tensorkiln.RMSNorm``.

Every check is there so that a fusion is correct or not applied: reduction axes must be the trailing
axes (attribute or input form, keepdims 1), the square's exponent must be exactly 2, scale and bias
must be constants that do not broadcast the output, and every intermediate that disappears must have
no reader outside the match.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.ir import Graph, Node, TensorType, Value
from tensorkiln.ir.dtypes import DType
from tensorkiln.passes.pattern import Found, Op
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite, add_constant
from tensorkiln.passes.rules import (
    DOMAIN,
    Rule,
    View,
    fused_rewrite,
    is_float,
    is_op,
    other_input,
    rank_of,
    reduce_axes,
    run_rules,
)

# ---------------------------------------------------------------------------------------------
# Matching helpers


def _trailing_axis(axes: tuple[int, ...] | None, rank: int | None) -> int | None:
    """The first axis when ``axes`` are exactly the trailing axes ``first .. rank-1``."""
    if not axes or rank is None or axes != tuple(range(axes[0], rank)):
        return None
    return axes[0]


def _affine_const(m: View, v: Value | None, x: Value, axis: int) -> Value | None:
    """``v`` when it is a constant of x's dtype that broadcasts onto the normalized axes only."""
    c = m.const(v)
    if c is None or x.shape is None or v.dtype != x.dtype:
        return None
    dims = list(c.shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    norm = x.shape[axis:]
    if len(dims) > len(norm):
        return None
    tail = norm[len(norm) - len(dims) :]
    return v if all(d == 1 or d == t for d, t in zip(dims, tail)) else None


def _unused_extra_outputs(m: View, node: Node) -> bool:
    return all(v is None or (v not in m.outputs and not m.readers.get(v)) for v in node.outputs[1:])


# ---------------------------------------------------------------------------------------------
# LayerNorm


def _inv_std(
    m: View, sq: Node, axes: tuple[int, ...], num: Value
) -> tuple[list[Node], float, Node] | None:
    """Match ``sq -> ReduceMean(axes) -> Add(eps) -> Sqrt -> (Div | Reciprocal+Mul) by num``.

    Returns the matched nodes after ``sq``, epsilon, and the node computing ``num / std``.
    """
    mean = m.sole(sq.outputs[0], "ReduceMean")
    if mean is None or reduce_axes(m, mean, axes[-1] + 1) != axes:
        return None
    add = m.sole(mean.outputs[0], "Add")
    eps = m.scalar(other_input(add, mean.outputs[0])) if add is not None else None
    sqrt = m.sole(add.outputs[0], "Sqrt") if eps is not None else None
    if sqrt is None:
        return None
    std = sqrt.outputs[0]
    div = m.sole(std, "Div")
    if div is not None and div.inputs[0] is num and div.inputs[1] is std:
        return [mean, add, sqrt, div], eps, div
    rec = m.sole(std, "Reciprocal")
    mul = m.sole(rec.outputs[0], "Mul") if rec is not None else None
    if mul is not None and other_input(mul, rec.outputs[0]) is num:
        return [mean, add, sqrt, rec, mul], eps, mul
    return None


def _square_of(m: View, node: Node, base: Value) -> bool:
    """``node`` is Pow(base, 2) (exponent exactly 2) or Mul(base, base)."""
    if is_op(node, "Pow"):
        return node.inputs[0] is base and m.scalar(node.inputs[1]) == 2.0
    return is_op(node, "Mul") and node.inputs[0] is base and node.inputs[1] is base


def _affine_tail(m: View, y: Value, x: Value, axis: int, names: tuple[str, ...]):
    """Optional ``Mul(scale)`` then (when asked) ``Add(bias)`` after ``y``: nodes, out, params."""
    nodes, params = [], []
    for op in names:
        node = m.sole(y, op)
        w = _affine_const(m, other_input(node, y), x, axis) if node is not None else None
        if w is None:
            break
        nodes.append(node)
        params.append(w)
        y = node.outputs[0]
    return nodes, y, params


def _ones_scale(m: View, x: Value, axis: int) -> Value:
    norm = x.shape[axis:]
    shape = tuple(norm) if all(isinstance(d, int) for d in norm) else (1,)
    return add_constant(m.graph, f"{x.name}_ones", np.ones(shape, x.dtype.numpy))


def _layer_norm_decomposed(m: View, found: Found) -> Rewrite | None:
    mean = found.root
    x = mean.inputs[0]
    axes = reduce_axes(m, mean, rank_of(x))
    axis = _trailing_axis(axes, rank_of(x)) if is_float(x) else None
    sub = m.sole(mean.outputs[0], "Sub") if axis is not None else None
    if sub is None or sub.inputs[0] is not x or sub.inputs[1] is not mean.outputs[0]:
        return None
    d = sub.outputs[0]
    readers = m.readers.get(d, [])
    if d in m.outputs or len(readers) != 2:
        return None
    sq = next((r for r in readers if _square_of(m, r, d)), None)
    std = _inv_std(m, sq, axes, d) if sq is not None else None
    if std is None or std[2] not in readers:
        return None
    body, eps, norm = std
    tail, y, params = _affine_tail(m, norm.outputs[0], x, axis, ("Mul", "Add"))
    scale = params[0] if params else _ones_scale(m, x, axis)
    bias = params[1] if len(params) > 1 else None
    fused = Node(
        "LayerNorm",
        [x, scale, bias],
        [y],
        {"axis": axis - len(x.shape), "epsilon": eps},
        domain=DOMAIN,
        name=f"{mean.name}/LayerNorm",
    )
    return fused_rewrite([mean, sub, sq, *body, *tail], fused)


def _layer_norm_onnx(m: View, found: Found) -> Rewrite | None:
    node = found.root
    x = node.inputs[0]
    if not is_float(x) or not _unused_extra_outputs(m, node):
        return None
    if node.attrs.get("stash_type", 1) != 1 and x.dtype != DType.FLOAT:
        return None  # a non-float32 compute type that the fused kernel does not reproduce
    attrs = {"axis": node.attrs.get("axis", -1), "epsilon": node.attrs.get("epsilon", 1e-5)}
    inputs = list(node.inputs[:3]) + [None] * (3 - len(node.inputs[:3]))
    fused = Node("LayerNorm", inputs, [node.outputs[0]], attrs, domain=DOMAIN, name=node.name)
    return fused_rewrite([node], fused)


def _fold_residual(m: View, found: Found) -> Rewrite | None:
    ln = found.root
    if (len(ln.inputs) > 3 and ln.inputs[3] is not None) or ln.attrs.get("q_dtype"):
        return None  # (a quantized output takes the second slot: left as it is)
    s = ln.inputs[0]
    add = m.made_by(s, "Add")
    if add is None or s.shape is None or all(m.const(v) is not None for v in add.inputs):
        return None
    a, b = add.inputs
    if not (is_float(a) and a.dtype == b.dtype) or a.shape is None or b.shape is None:
        return None
    if len(a.shape) != len(s.shape) or any(x != y for x, y in zip(a.shape, s.shape)):
        a, b = b, a  # X keeps the full shape; the residual may broadcast
    bias = ln.inputs[2] if len(ln.inputs) > 2 else None
    keep = [v for v in m.readers.get(s, []) if v is not ln] or s in m.outputs
    outputs = [ln.outputs[0], s] if keep else [ln.outputs[0]]
    fused = Node("LayerNorm", [a, ln.inputs[1], bias, b], outputs, dict(ln.attrs), DOMAIN, ln.name)
    return fused_rewrite([add, ln], fused)


def _gemm_making(m: View, v: Value, ln: Node) -> tuple[Node, Node | None] | None:
    """(the Gemm/GemmAct, the Reshape between or None) making ``v``, read by ``ln`` alone, where
    the GEMM can take a residual: float, no activation, no residual yet, its output read once."""
    if m.sole(v) is not ln:
        return None
    node, reshape = m.producers.get(v), None
    if node is not None and is_op(node, "Reshape"):
        reshape, inner = node, node.inputs[0]
        if m.sole(inner) is not reshape:
            return None
        node = m.producers.get(inner)
    if node is None or (node.domain, node.op) not in (("", "Gemm"), (DOMAIN, "GemmAct")):
        return None
    if len(node.inputs) > 3 or node.attrs.get("activation") or len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    if not is_float(out) or out.shape is None:
        return None
    if reshape is not None and (len(out.shape) != 2 or not isinstance(out.shape[1], int)):
        return None
    return node, reshape


def _same_shape(a: Value, b: Value) -> bool:
    return a.shape is not None and b.shape is not None and tuple(a.shape) == tuple(b.shape)


def _residual_into_gemm(m: View, found: Found) -> Rewrite | None:
    ln = found.root
    if len(ln.inputs) != 4 or ln.inputs[3] is None or ln.inputs[0] is None:
        return None
    if ln.attrs.get("q_dtype"):
        return None  # (its second output is the quantized one, not the sum)
    x, r = ln.inputs[0], ln.inputs[3]
    if x.dtype != r.dtype or not _same_shape(x, r):
        return None
    if len(ln.outputs) > 1 and ln.outputs[1] is not None and ln.outputs[1] in m.outputs:
        return None  # (the sum is a graph output: left as it is)
    for made, other in ((x, r), (r, x)):
        hit = _gemm_making(m, made, ln)
        if hit is not None and m.const(other) is None:
            break
    else:
        return None
    gemm, reshape = hit
    out = gemm.outputs[0]
    add: list[Node] = []
    z = other
    if reshape is not None:  # the residual in the GEMM's [rows, N] form (a view)
        shape = add_constant(m.graph, m.fresh_name(f"{gemm.name}/residual_shape"),
                             np.array([-1, out.shape[1]], np.int64))  # fmt: skip
        z = Value(m.fresh_name(f"{other.name}/rows"), TensorType(other.dtype, out.shape))
        add.append(Node("Reshape", [other, shape], [z], name=m.fresh_name(f"{gemm.name}/rows")))
    elif not _same_shape(out, other):
        return None
    keys = ("alpha", "beta", "transA", "transB", "activation_min", "activation_max")
    attrs = {k: v for k, v in gemm.attrs.items() if k in keys or gemm.op == "GemmAct"}
    c = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    fused = Node("GemmAct", [gemm.inputs[0], gemm.inputs[1], c, z], [out], attrs, DOMAIN,
                 gemm.name)  # fmt: skip
    norm = Node("LayerNorm", [made, ln.inputs[1], ln.inputs[2]], [ln.outputs[0]],
                dict(ln.attrs), DOMAIN, ln.name)  # fmt: skip
    replace = {}
    if len(ln.outputs) > 1 and ln.outputs[1] is not None:
        replace[ln.outputs[1]] = made  # (the GEMM's output is the sum now)
    return Rewrite(remove=[gemm, ln], add=[*add, fused, norm], replace=replace, count=1)


# ---------------------------------------------------------------------------------------------
# RMSNorm


def _rms_norm_decomposed(m: View, found: Found) -> Rewrite | None:
    mean = found.root
    sq = m.producers.get(mean.inputs[0])
    x = sq.inputs[0] if sq is not None and sq.inputs else None
    if (
        x is None
        or not is_float(x)
        or not _square_of(m, sq, x)
        or m.sole(sq.outputs[0]) is not mean
    ):
        return None
    axes = reduce_axes(m, mean, rank_of(x))
    axis = _trailing_axis(axes, rank_of(x))
    std = _inv_std(m, sq, axes, x) if axis is not None else None
    if std is None:
        return None
    body, eps, norm = std
    tail, y, params = _affine_tail(m, norm.outputs[0], x, axis, ("Mul",))
    scale = params[0] if params else _ones_scale(m, x, axis)
    attrs = {"axis": axis - len(x.shape), "epsilon": eps}
    fused = Node("RMSNorm", [x, scale], [y], attrs, domain=DOMAIN, name=f"{mean.name}/RMSNorm")
    return fused_rewrite([sq, *body, *tail], fused)


def _rms_norm_onnx(m: View, found: Found) -> Rewrite | None:
    node = found.root
    x = node.inputs[0]
    if not is_float(x) or (node.attrs.get("stash_type", 1) != 1 and x.dtype != DType.FLOAT):
        return None
    attrs = {"axis": node.attrs.get("axis", -1), "epsilon": node.attrs.get("epsilon", 1e-5)}
    fused = Node("RMSNorm", node.inputs[:2], node.outputs[:1], attrs, domain=DOMAIN, name=node.name)
    return fused_rewrite([node], fused)


# ---------------------------------------------------------------------------------------------
# The passes (order 60-62: after the Conv and Gemm fusions; Softmax (65) and attention (70)
# follow)


LAYER_NORM_RULES = (
    Rule("layer_norm_decomposed", Op("ReduceMean"), _layer_norm_decomposed),
    Rule("layer_norm_onnx", Op("LayerNormalization"), _layer_norm_onnx),
)
RESIDUAL_RULES = (Rule("residual_into_layer_norm", Op("LayerNorm", domain=DOMAIN), _fold_residual),)
GEMM_RESIDUAL_RULES = (
    Rule("residual_into_gemm", Op("LayerNorm", domain=DOMAIN), _residual_into_gemm),
)
RMS_NORM_RULES = (
    Rule("rms_norm_decomposed", Op("ReduceMean"), _rms_norm_decomposed),
    Rule("rms_norm_onnx", Op("RMSNormalization"), _rms_norm_onnx),
)


@register_pass("fuse_layer_norm", level=3, order=60)
def fuse_layer_norm(graph: Graph) -> int:
    """ONNX LayerNormalization and its decompositions -> tensorkiln.LayerNorm."""
    return run_rules(graph, LAYER_NORM_RULES)


@register_pass("fold_residual_into_layer_norm", level=3, order=61)
def fold_residual_into_layer_norm(graph: Graph) -> int:
    """LayerNorm(a + b) -> LayerNorm(a, residual=b), the sum as a second output where it is read."""
    return run_rules(graph, RESIDUAL_RULES)


@register_pass("fold_residual_into_gemm", level=3, order=63)
def fold_residual_into_gemm(graph: Graph) -> int:
    """LayerNorm(gemm(a) + r) -> LayerNorm(gemm(a, Z=r)): the GEMM's epilogue writes the sum."""
    return run_rules(graph, GEMM_RESIDUAL_RULES)


@register_pass("fuse_rms_norm", level=3, order=62)
def fuse_rms_norm(graph: Graph) -> int:
    """ONNX RMSNormalization and its decompositions -> tensorkiln.RMSNorm."""
    return run_rules(graph, RMS_NORM_RULES)
