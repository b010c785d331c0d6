"""Fusions of normalizations and activations: LayerNorm, RMSNorm, GELU, SiLU, Softmax.

Each pass is a table of rules. A rule gets an anchor node and returns a :class:`Rewrite` (the
matched nodes to remove, the fused node to add) or None when the pattern, or one of its checks,
does not hold. Matches are collected first and applied once; the pass returns their count.

* ``fuse_layer_norm``: ONNX LayerNormalization, and its decomposition
  ``ReduceMean -> Sub -> Pow(2) | Mul(d, d) -> ReduceMean -> Add(eps) -> Sqrt -> Div | Reciprocal+Mul
  [-> Mul(scale)] [-> Add(bias)]``, become ``tensorkiln.LayerNorm``.
* ``fold_residual_into_layer_norm``: ``LayerNorm(Add(a, b))`` becomes ``LayerNorm(a, .., residual=b)``;
  when the sum is read elsewhere, the fused node's second output returns it. One operand may be a
  constant (the dynamo exporter folds position embeddings into one); the residual may broadcast.
* ``fuse_rms_norm``: ONNX RMSNormalization, and ``Pow(2) | Mul(x, x) -> ReduceMean -> Add(eps) ->
  Sqrt -> Div | Reciprocal+Mul [-> Mul(scale)]``, become ``tensorkiln.RMSNorm``.
* ``fuse_gelu``: the erf form ``x * 0.5 * (1 + erf(x / sqrt 2))`` (Div by sqrt 2 or Mul by
  1/sqrt 2, the 0.5 on either side) and the tanh form
  ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` (GPT-2's, x^3 as Pow or two Muls).
  The result is ONNX ``Gelu`` (approximate "none" or "tanh") where the model imports opset 20 or
  later, so later passes and other tools still read a standard op; below opset 20 it is
  ``tensorkiln.Gelu`` with the same attribute.
* ``fuse_silu``: ``x * Sigmoid(x)`` becomes ONNX ``Swish`` (opset 24+) or ``tensorkiln.SiLU``.
* ``fuse_softmax``: ``Exp -> ReduceSum -> Div`` over the last axis, with or without the
  ``ReduceMax -> Sub`` in front, becomes ONNX ``Softmax`` on the last axis.

Every check is there so that a fusion is correct or not applied: reduction axes must be the trailing
axes (attribute or input form, keepdims 1), constants must have the expected values (exactly 2 for
the square, within 1e-6 relative for irrational ones), scale and bias must be constants that do not
broadcast the output, and every intermediate that disappears must have no reader outside the match.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tensorkiln.ir import Graph, Node, Value
from tensorkiln.ir.dtypes import DType
from tensorkiln.passes.manager import register_pass
from tensorkiln.passes.rewrite import Rewrite, add_constant, const_value

DOMAIN = "tensorkiln"
_FLOATS = {DType.FLOAT, DType.FLOAT16, DType.DOUBLE, DType.BFLOAT16}
_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ---------------------------------------------------------------------------------------------
# Matching helpers


@dataclass
class Match:
    """What rules look at: the graph and its producer/consumer maps, computed once per pass."""

    graph: Graph
    producers: dict[Value, Node]
    readers: dict[Value, list[Node]]
    outputs: set[Value]

    @classmethod
    def of(cls, graph: Graph) -> Match:
        readers = {v: list(dict.fromkeys(ns)) for v, ns in graph.consumers().items()}
        return cls(graph, graph.producers(), readers, set(graph.outputs))

    def sole(self, v: Value | None, op: str | None = None) -> Node | None:
        """The one node reading ``v`` (of ``op`` in the ONNX domain), if ``v`` is no graph output."""
        if v is None or v in self.outputs:
            return None
        rs = self.readers.get(v, [])
        if len(rs) != 1 or (op is not None and not _is(rs[0], op)):
            return None
        return rs[0]

    def made_by(self, v: Value | None, op: str) -> Node | None:
        """The node producing ``v`` when it is ``op`` of the ONNX domain."""
        p = self.producers.get(v) if v is not None else None
        return p if p is not None and _is(p, op) else None

    def const(self, v: Value | None) -> np.ndarray | None:
        return const_value(v, self.producers)

    def scalar(self, v: Value | None) -> float | None:
        c = self.const(v)
        if c is None or c.size != 1 or c.ndim > 1 or c.dtype.kind not in "fiu":
            return None
        return float(c.reshape(-1)[0])

    def is_scalar(self, v: Value | None, target: float, rtol: float = 1e-6) -> bool:
        s = self.scalar(v)
        return s is not None and math.isclose(s, target, rel_tol=rtol, abs_tol=0.0)

    def only_read_by(self, v: Value, nodes: list[Node]) -> bool:
        """``v`` is no graph output and every reader of it is one of ``nodes``."""
        return v not in self.outputs and all(r in nodes for r in self.readers.get(v, []))


def _is(node: Node, op: str) -> bool:
    return node.op == op and node.domain == ""


def _other(node: Node, v: Value) -> Value | None:
    """The other input of a binary node that reads ``v`` once."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is v and b is not v:
        return b
    if b is v and a is not v:
        return a
    return None


def _is_float(v: Value | None) -> bool:
    return v is not None and v.dtype in _FLOATS


def _rank(v: Value) -> int | None:
    return None if v.shape is None else len(v.shape)


def _reduce_axes(m: Match, node: Node, rank: int | None) -> tuple[int, ...] | None:
    """The sorted, non-negative axes a keepdims reduction of a rank-``rank`` input uses.

    None when they are unknown or the reduction does not keep dims.
    """
    if rank is None or node.attrs.get("keepdims", 1) != 1:
        return None
    if "axes" in node.attrs:
        axes = list(node.attrs["axes"])
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        c = m.const(node.inputs[1])
        if c is None:
            return None
        axes = [int(a) for a in c.reshape(-1)]
    else:
        axes = []
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            return None
        axes = list(range(rank))
    if any(not -rank <= a < rank for a in axes):
        return None
    norm = sorted({a % rank for a in axes})
    return tuple(norm) if len(norm) == len(axes) else None


def _trailing_axis(axes: tuple[int, ...] | None, rank: int | None) -> int | None:
    """The first axis when ``axes`` are exactly the trailing axes ``first .. rank-1``."""
    if not axes or rank is None or axes != tuple(range(axes[0], rank)):
        return None
    return axes[0]


def _affine_const(m: Match, v: Value | None, x: Value, axis: int) -> Value | None:
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


def _drop_dead_constants(m: Match, rw: Rewrite) -> None:
    """Also remove Constant nodes whose every reader the rewrite removes."""
    gone = set(rw.remove)
    for node in list(rw.remove):
        for v in node.inputs:
            p = m.made_by(v, "Constant")
            if p is not None and p not in gone and m.only_read_by(v, rw.remove):
                gone.add(p)
                rw.remove.append(p)


Rule = Callable[[Match, Node], Rewrite | None]


def run_rules(graph: Graph, rules: dict[tuple[str, str], Rule]) -> int:
    """Try ``rules`` (keyed by the anchor's (domain, op)) on every node; apply the matches once.

    A match whose nodes overlap an earlier match is skipped; the next round of the PassManager
    sees it again.
    """
    m = Match.of(graph)
    rw, claimed = Rewrite(), set()
    for node in graph.nodes:
        fn = rules.get((node.domain, node.op))
        found = fn(m, node) if fn is not None else None
        if found is None or claimed.intersection(found.remove):
            continue
        claimed.update(found.remove)
        rw.merge(found)
    _drop_dead_constants(m, rw)
    return rw.apply(graph)


def _fused(remove: list[Node], node: Node) -> Rewrite:
    return Rewrite(remove=remove, add=[node], count=1)


def _unused_extra_outputs(m: Match, node: Node) -> bool:
    return all(v is None or (v not in m.outputs and not m.readers.get(v)) for v in node.outputs[1:])


# ---------------------------------------------------------------------------------------------
# LayerNorm


def _inv_std(
    m: Match, sq: Node, axes: tuple[int, ...], num: Value
) -> tuple[list[Node], float, Node] | None:
    """Match ``sq -> ReduceMean(axes) -> Add(eps) -> Sqrt -> (Div | Reciprocal+Mul) by num``.

    Returns the matched nodes after ``sq``, epsilon, and the node computing ``num / std``.
    """
    mean = m.sole(sq.outputs[0], "ReduceMean")
    if mean is None or _reduce_axes(m, mean, axes[-1] + 1) != axes:
        return None
    add = m.sole(mean.outputs[0], "Add")
    eps = m.scalar(_other(add, mean.outputs[0])) if add is not None else None
    sqrt = m.sole(add.outputs[0], "Sqrt") if eps is not None else None
    if sqrt is None:
        return None
    std = sqrt.outputs[0]
    div = m.sole(std, "Div")
    if div is not None and div.inputs[0] is num and div.inputs[1] is std:
        return [mean, add, sqrt, div], eps, div
    rec = m.sole(std, "Reciprocal")
    mul = m.sole(rec.outputs[0], "Mul") if rec is not None else None
    if mul is not None and _other(mul, rec.outputs[0]) is num:
        return [mean, add, sqrt, rec, mul], eps, mul
    return None


def _square_of(m: Match, node: Node, base: Value) -> bool:
    """``node`` is Pow(base, 2) (exponent exactly 2) or Mul(base, base)."""
    if _is(node, "Pow"):
        return node.inputs[0] is base and m.scalar(node.inputs[1]) == 2.0
    return _is(node, "Mul") and node.inputs[0] is base and node.inputs[1] is base


def _affine_tail(m: Match, y: Value, x: Value, axis: int, names: tuple[str, ...]):
    """Optional ``Mul(scale)`` then (when asked) ``Add(bias)`` after ``y``: nodes, out, params."""
    nodes, params = [], []
    for op in names:
        node = m.sole(y, op)
        w = _affine_const(m, _other(node, y), x, axis) if node is not None else None
        if w is None:
            break
        nodes.append(node)
        params.append(w)
        y = node.outputs[0]
    return nodes, y, params


def _ones_scale(m: Match, x: Value, axis: int) -> Value:
    norm = x.shape[axis:]
    shape = tuple(norm) if all(isinstance(d, int) for d in norm) else (1,)
    return add_constant(m.graph, f"{x.name}_ones", np.ones(shape, x.dtype.numpy))


def _layer_norm_decomposed(m: Match, mean: Node) -> Rewrite | None:
    x = mean.inputs[0]
    axes = _reduce_axes(m, mean, _rank(x))
    axis = _trailing_axis(axes, _rank(x)) if _is_float(x) else None
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
    return _fused([mean, sub, sq, *body, *tail], fused)


def _layer_norm_onnx(m: Match, node: Node) -> Rewrite | None:
    x = node.inputs[0]
    if not _is_float(x) or not _unused_extra_outputs(m, node):
        return None
    if node.attrs.get("stash_type", 1) != 1 and x.dtype != DType.FLOAT:
        return None  # a non-float32 compute type that the fused kernel does not reproduce
    attrs = {"axis": node.attrs.get("axis", -1), "epsilon": node.attrs.get("epsilon", 1e-5)}
    inputs = list(node.inputs[:3]) + [None] * (3 - len(node.inputs[:3]))
    fused = Node("LayerNorm", inputs, [node.outputs[0]], attrs, domain=DOMAIN, name=node.name)
    return _fused([node], fused)


def _fold_residual(m: Match, ln: Node) -> Rewrite | None:
    if len(ln.inputs) > 3 and ln.inputs[3] is not None:
        return None
    s = ln.inputs[0]
    add = m.made_by(s, "Add")
    if add is None or s.shape is None or all(m.const(v) is not None for v in add.inputs):
        return None
    a, b = add.inputs
    if not (_is_float(a) and a.dtype == b.dtype) or a.shape is None or b.shape is None:
        return None
    if len(a.shape) != len(s.shape) or any(x != y for x, y in zip(a.shape, s.shape)):
        a, b = b, a  # X keeps the full shape; the residual may broadcast
    bias = ln.inputs[2] if len(ln.inputs) > 2 else None
    keep = [v for v in m.readers.get(s, []) if v is not ln] or s in m.outputs
    outputs = [ln.outputs[0], s] if keep else [ln.outputs[0]]
    fused = Node("LayerNorm", [a, ln.inputs[1], bias, b], outputs, dict(ln.attrs), DOMAIN, ln.name)
    return _fused([add, ln], fused)


# ---------------------------------------------------------------------------------------------
# RMSNorm


def _rms_norm_decomposed(m: Match, mean: Node) -> Rewrite | None:
    sq = m.producers.get(mean.inputs[0])
    x = sq.inputs[0] if sq is not None and sq.inputs else None
    if (
        x is None
        or not _is_float(x)
        or not _square_of(m, sq, x)
        or m.sole(sq.outputs[0]) is not mean
    ):
        return None
    axes = _reduce_axes(m, mean, _rank(x))
    axis = _trailing_axis(axes, _rank(x))
    std = _inv_std(m, sq, axes, x) if axis is not None else None
    if std is None:
        return None
    body, eps, norm = std
    tail, y, params = _affine_tail(m, norm.outputs[0], x, axis, ("Mul",))
    scale = params[0] if params else _ones_scale(m, x, axis)
    attrs = {"axis": axis - len(x.shape), "epsilon": eps}
    fused = Node("RMSNorm", [x, scale], [y], attrs, domain=DOMAIN, name=f"{mean.name}/RMSNorm")
    return _fused([sq, *body, *tail], fused)


def _rms_norm_onnx(m: Match, node: Node) -> Rewrite | None:
    x = node.inputs[0]
    if not _is_float(x) or (node.attrs.get("stash_type", 1) != 1 and x.dtype != DType.FLOAT):
        return None
    attrs = {"axis": node.attrs.get("axis", -1), "epsilon": node.attrs.get("epsilon", 1e-5)}
    fused = Node("RMSNorm", node.inputs[:2], node.outputs[:1], attrs, domain=DOMAIN, name=node.name)
    return _fused([node], fused)


# ---------------------------------------------------------------------------------------------
# GELU and SiLU


def _gelu_tail(m: Match, x: Value, one_plus: Node) -> tuple[list[Node], Value] | None:
    """After ``e = 1 + f(x)``: ``(x * e) * 0.5``, ``(x * e) / 2``, ``(e * 0.5) * x`` or ``(0.5 * x) * e``."""
    e = one_plus.outputs[0]
    m1 = m.sole(e, "Mul")
    o = _other(m1, e) if m1 is not None else None
    if o is None:
        return None
    if o is x or m.is_scalar(o, 0.5):
        m2 = m.sole(m1.outputs[0])
        if m2 is None or len(m2.inputs) != 2 or m2.inputs.count(m1.outputs[0]) != 1:
            return None
        last = _other(m2, m1.outputs[0])
        ok = (
            (_is(m2, "Mul") and m.is_scalar(last, 0.5))
            or (_is(m2, "Div") and m2.inputs[1] is last and m.is_scalar(last, 2.0))
            if o is x
            else (_is(m2, "Mul") and last is x)
        )
        return ([m1, m2], m2.outputs[0]) if ok else None
    half = m.made_by(o, "Mul")
    if half is not None and m.sole(o) is m1 and m.is_scalar(_other(half, x), 0.5):
        return [half, m1], m1.outputs[0]
    return None


def _one_plus(m: Match, v: Value) -> Node | None:
    add = m.sole(v, "Add")
    return add if add is not None and m.is_scalar(_other(add, v), 1.0) else None


def _gelu_node(m: Match, x: Value, out: Value, approximate: str, name: str) -> Node:
    attrs = {"approximate": approximate}
    if m.graph.opset("") >= 20:
        return Node("Gelu", [x], [out], attrs, name=name)
    return Node("Gelu", [x], [out], attrs, domain=DOMAIN, name=name)


def _gelu_erf(m: Match, erf: Node) -> Rewrite | None:
    u = erf.inputs[0]
    scale = m.producers.get(u)
    if scale is None or m.sole(u) is not erf or len(scale.inputs) != 2:
        return None
    x, c = scale.inputs
    if _is(scale, "Mul") and m.const(x) is not None:
        x, c = c, x
    ok = (_is(scale, "Div") and m.is_scalar(c, _SQRT2)) or (
        _is(scale, "Mul") and m.is_scalar(c, 1.0 / _SQRT2)
    )
    one_plus = _one_plus(m, erf.outputs[0]) if ok and _is_float(x) else None
    tail = _gelu_tail(m, x, one_plus) if one_plus is not None else None
    if tail is None:
        return None
    nodes, out = tail
    fused = _gelu_node(m, x, out, "none", f"{erf.name}/Gelu")
    return _fused([scale, erf, one_plus, *nodes], fused)


def _cube(m: Match, v: Value) -> tuple[list[Node], Value] | None:
    """``v = Pow(x, 3)``, ``Mul(Mul(x, x), x)`` or ``Mul(x, Mul(x, x))``: the nodes and x."""
    p = m.producers.get(v)
    if p is None or m.sole(v) is None:
        return None
    if _is(p, "Pow") and m.scalar(p.inputs[1]) == 3.0:
        return [p], p.inputs[0]
    if not _is(p, "Mul") or len(p.inputs) != 2:
        return None
    for sq_v, x in (p.inputs, p.inputs[::-1]):
        sq = m.made_by(sq_v, "Mul")
        if sq is not None and sq.inputs == [x, x] and m.sole(sq_v) is p:
            return [sq, p], x
    return None


def _gelu_tanh(m: Match, tanh: Node) -> Rewrite | None:
    t = tanh.inputs[0]
    mt = m.made_by(t, "Mul")
    if mt is None or m.sole(t) is not tanh:
        return None
    s = next((v for v in mt.inputs if not m.is_scalar(v, _SQRT_2_OVER_PI)), None)
    inner = (
        m.made_by(s, "Add")
        if _other(mt, s) is not None and m.is_scalar(_other(mt, s), _SQRT_2_OVER_PI)
        else None
    )
    if inner is None or m.sole(s) is not mt:
        return None
    for q, x in (inner.inputs, inner.inputs[::-1]):
        mq = m.made_by(q, "Mul")
        k = next((v for v in (mq.inputs if mq else []) if m.is_scalar(v, 0.044715)), None)
        cube = _cube(m, _other(mq, k)) if k is not None and m.sole(q) is inner else None
        if cube is not None and cube[1] is x and _is_float(x):
            break
    else:
        return None
    one_plus = _one_plus(m, tanh.outputs[0])
    tail = _gelu_tail(m, x, one_plus) if one_plus is not None else None
    if tail is None:
        return None
    nodes, out = tail
    fused = _gelu_node(m, x, out, "tanh", f"{tanh.name}/Gelu")
    return _fused([*cube[0], mq, inner, mt, tanh, one_plus, *nodes], fused)


def _silu(m: Match, sig: Node) -> Rewrite | None:
    x = sig.inputs[0]
    mul = m.sole(sig.outputs[0], "Mul")
    if mul is None or _other(mul, sig.outputs[0]) is not x or not _is_float(x):
        return None
    name = f"{sig.name}/SiLU"
    if m.graph.opset("") >= 24:
        fused = Node("Swish", [x], mul.outputs, {"alpha": 1.0}, name=name)
    else:
        fused = Node("SiLU", [x], mul.outputs, {}, domain=DOMAIN, name=name)
    return _fused([sig, mul], fused)


# ---------------------------------------------------------------------------------------------
# Softmax


def _last_axis_reduce(m: Match, node: Node | None, rank: int | None) -> bool:
    return node is not None and rank is not None and _reduce_axes(m, node, rank) == (rank - 1,)


def _max_ok(m: Match, mx: Node) -> bool:
    return _last_axis_reduce(m, mx, _rank(mx.inputs[0]))


def _softmax(m: Match, exp: Node) -> Rewrite | None:
    x, e = exp.inputs[0], exp.outputs[0]
    readers = m.readers.get(e, [])
    rs = next((r for r in readers if _is(r, "ReduceSum") and r.inputs[0] is e), None)
    div = m.sole(rs.outputs[0], "Div") if rs is not None else None
    if div is None or div.inputs != [e, rs.outputs[0]] or e in m.outputs or len(readers) != 2:
        return None
    if not _is_float(x) or not _last_axis_reduce(m, rs, _rank(x)):
        return None
    nodes = [exp, rs, div]
    sub = m.made_by(x, "Sub")
    mx = m.made_by(sub.inputs[1], "ReduceMax") if sub is not None and m.sole(x) is exp else None
    if mx is not None and mx.inputs[0] is sub.inputs[0] and m.sole(mx.outputs[0]) is sub:
        nodes, x = ([mx, sub, *nodes], sub.inputs[0]) if _max_ok(m, mx) else (nodes, x)
    axis = -1 if m.graph.opset("") >= 11 else len(x.shape) - 1
    fused = Node("Softmax", [x], [div.outputs[0]], {"axis": axis}, name=f"{exp.name}/Softmax")
    return _fused(nodes, fused)


# ---------------------------------------------------------------------------------------------
# The passes (order 60-69: after the Conv and Gemm fusions, before attention)


@register_pass("fuse_layer_norm", level=3, order=60)
def fuse_layer_norm(graph: Graph) -> int:
    """ONNX LayerNormalization and its decompositions -> tensorkiln.LayerNorm."""
    rules = {
        ("", "ReduceMean"): _layer_norm_decomposed,
        ("", "LayerNormalization"): _layer_norm_onnx,
    }
    return run_rules(graph, rules)


@register_pass("fold_residual_into_layer_norm", level=3, order=61)
def fold_residual_into_layer_norm(graph: Graph) -> int:
    """LayerNorm(a + b) -> LayerNorm(a, residual=b), the sum as a second output where it is read."""
    return run_rules(graph, {(DOMAIN, "LayerNorm"): _fold_residual})


@register_pass("fuse_rms_norm", level=3, order=62)
def fuse_rms_norm(graph: Graph) -> int:
    """ONNX RMSNormalization and its decompositions -> tensorkiln.RMSNorm."""
    rules = {("", "ReduceMean"): _rms_norm_decomposed, ("", "RMSNormalization"): _rms_norm_onnx}
    return run_rules(graph, rules)


@register_pass("fuse_gelu", level=3, order=63)
def fuse_gelu(graph: Graph) -> int:
    """Decomposed erf and tanh GELU -> Gelu (ONNX from opset 20, tensorkiln below)."""
    return run_rules(graph, {("", "Erf"): _gelu_erf, ("", "Tanh"): _gelu_tanh})


@register_pass("fuse_silu", level=3, order=64)
def fuse_silu(graph: Graph) -> int:
    """x * Sigmoid(x) -> Swish (ONNX from opset 24) or tensorkiln.SiLU."""
    return run_rules(graph, {("", "Sigmoid"): _silu})


@register_pass("fuse_softmax", level=3, order=65)
def fuse_softmax(graph: Graph) -> int:
    """Exp / ReduceSum(Exp) over the last axis (max-subtracted or not) -> Softmax."""
    return run_rules(graph, {("", "Exp"): _softmax})
