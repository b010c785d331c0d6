"""Fusions of activations written out as elementwise math: GELU, SiLU, Softmax.

Each pass is a table of rules run by :func:`tensorkiln.passes.rules.run_rules`: matches are
collected first and applied once; the pass returns their count. The normalization fusions are in
:mod:`tensorkiln.passes.fuse_norm`.

* ``fuse_gelu``: the erf form ``x * 0.5 * (1 + erf(x / sqrt 2))`` (Div by sqrt 2 or Mul by
  1/sqrt 2, the 0.5 on either side) and the tanh form
  ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` (GPT-2's, x^3 as Pow or two Muls).
  The result is ONNX ``Gelu`` (approximate "none" or "tanh") where the model imports opset 20 or
  later, so later passes and other tools still read a standard op; below opset 20 it is
  ``tensorkiln.Gelu`` with the same attribute.
* ``fuse_silu``: ``x * Sigmoid(x)`` becomes ONNX ``Swish`` (opset 24+) or ``tensorkiln.SiLU``.
* ``fuse_softmax``: ``Exp -> ReduceSum -> Div`` over the last axis, with or without the
  ``ReduceMax -> Sub`` in front, becomes ONNX ``Softmax`` on the last axis.

Every check is there so that a fusion is correct or not applied: reductions must be over the last
axis (attribute or input form, keepdims 1), constants must have the expected values (within 1e-6
relative for irrational ones), and every intermediate that disappears must have no reader outside
the match.
"""

from __future__ import annotations

import math

from tensorkiln.ir import Graph, Node, Value
from tensorkiln.passes.manager import register_pass
from tensorkiln.passes.rewrite import Rewrite
from tensorkiln.passes.rules import (
    DOMAIN,
    Match,
    fused_rewrite,
    is_float,
    is_op,
    other_input,
    rank_of,
    reduce_axes,
    run_rules,
)

_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ---------------------------------------------------------------------------------------------
# GELU and SiLU


def _gelu_tail(m: Match, x: Value, one_plus: Node) -> tuple[list[Node], Value] | None:
    """After ``e = 1 + f(x)``: ``(x * e) * 0.5``, ``(x * e) / 2``, ``(e * 0.5) * x`` or ``(0.5 * x) * e``."""
    e = one_plus.outputs[0]
    m1 = m.sole(e, "Mul")
    o = other_input(m1, e) if m1 is not None else None
    if o is None:
        return None
    if o is x or m.is_scalar(o, 0.5):
        m2 = m.sole(m1.outputs[0])
        if m2 is None or len(m2.inputs) != 2 or m2.inputs.count(m1.outputs[0]) != 1:
            return None
        last = other_input(m2, m1.outputs[0])
        ok = (
            (is_op(m2, "Mul") and m.is_scalar(last, 0.5))
            or (is_op(m2, "Div") and m2.inputs[1] is last and m.is_scalar(last, 2.0))
            if o is x
            else (is_op(m2, "Mul") and last is x)
        )
        return ([m1, m2], m2.outputs[0]) if ok else None
    half = m.made_by(o, "Mul")
    if half is not None and m.sole(o) is m1 and m.is_scalar(other_input(half, x), 0.5):
        return [half, m1], m1.outputs[0]
    return None


def _one_plus(m: Match, v: Value) -> Node | None:
    add = m.sole(v, "Add")
    return add if add is not None and m.is_scalar(other_input(add, v), 1.0) else None


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
    if is_op(scale, "Mul") and m.const(x) is not None:
        x, c = c, x
    ok = (is_op(scale, "Div") and m.is_scalar(c, _SQRT2)) or (
        is_op(scale, "Mul") and m.is_scalar(c, 1.0 / _SQRT2)
    )
    one_plus = _one_plus(m, erf.outputs[0]) if ok and is_float(x) else None
    tail = _gelu_tail(m, x, one_plus) if one_plus is not None else None
    if tail is None:
        return None
    nodes, out = tail
    fused = _gelu_node(m, x, out, "none", f"{erf.name}/Gelu")
    return fused_rewrite([scale, erf, one_plus, *nodes], fused)


def _cube(m: Match, v: Value) -> tuple[list[Node], Value] | None:
    """``v = Pow(x, 3)``, ``Mul(Mul(x, x), x)`` or ``Mul(x, Mul(x, x))``: the nodes and x."""
    p = m.producers.get(v)
    if p is None or m.sole(v) is None:
        return None
    if is_op(p, "Pow") and m.scalar(p.inputs[1]) == 3.0:
        return [p], p.inputs[0]
    if not is_op(p, "Mul") or len(p.inputs) != 2:
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
        if other_input(mt, s) is not None and m.is_scalar(other_input(mt, s), _SQRT_2_OVER_PI)
        else None
    )
    if inner is None or m.sole(s) is not mt:
        return None
    for q, x in (inner.inputs, inner.inputs[::-1]):
        mq = m.made_by(q, "Mul")
        k = next((v for v in (mq.inputs if mq else []) if m.is_scalar(v, 0.044715)), None)
        cube = _cube(m, other_input(mq, k)) if k is not None and m.sole(q) is inner else None
        if cube is not None and cube[1] is x and is_float(x):
            break
    else:
        return None
    one_plus = _one_plus(m, tanh.outputs[0])
    tail = _gelu_tail(m, x, one_plus) if one_plus is not None else None
    if tail is None:
        return None
    nodes, out = tail
    fused = _gelu_node(m, x, out, "tanh", f"{tanh.name}/Gelu")
    return fused_rewrite([*cube[0], mq, inner, mt, tanh, one_plus, *nodes], fused)


def _silu(m: Match, sig: Node) -> Rewrite | None:
    x = sig.inputs[0]
    mul = m.sole(sig.outputs[0], "Mul")
    if mul is None or other_input(mul, sig.outputs[0]) is not x or not is_float(x):
        return None
    name = f"{sig.name}/SiLU"
    if m.graph.opset("") >= 24:
        fused = Node("Swish", [x], mul.outputs, {"alpha": 1.0}, name=name)
    else:
        fused = Node("SiLU", [x], mul.outputs, {}, domain=DOMAIN, name=name)
    return fused_rewrite([sig, mul], fused)


# ---------------------------------------------------------------------------------------------
# Softmax


def _last_axis_reduce(m: Match, node: Node | None, rank: int | None) -> bool:
    return node is not None and rank is not None and reduce_axes(m, node, rank) == (rank - 1,)


def _max_ok(m: Match, mx: Node) -> bool:
    return _last_axis_reduce(m, mx, rank_of(mx.inputs[0]))


def _softmax(m: Match, exp: Node) -> Rewrite | None:
    x, e = exp.inputs[0], exp.outputs[0]
    readers = m.readers.get(e, [])
    rs = next((r for r in readers if is_op(r, "ReduceSum") and r.inputs[0] is e), None)
    div = m.sole(rs.outputs[0], "Div") if rs is not None else None
    if div is None or div.inputs != [e, rs.outputs[0]] or e in m.outputs or len(readers) != 2:
        return None
    if not is_float(x) or not _last_axis_reduce(m, rs, rank_of(x)):
        return None
    nodes = [exp, rs, div]
    sub = m.made_by(x, "Sub")
    mx = m.made_by(sub.inputs[1], "ReduceMax") if sub is not None and m.sole(x) is exp else None
    if mx is not None and mx.inputs[0] is sub.inputs[0] and m.sole(mx.outputs[0]) is sub:
        nodes, x = ([mx, sub, *nodes], sub.inputs[0]) if _max_ok(m, mx) else (nodes, x)
    axis = -1 if m.graph.opset("") >= 11 else len(x.shape) - 1
    fused = Node("Softmax", [x], [div.outputs[0]], {"axis": axis}, name=f"{exp.name}/Softmax")
    return fused_rewrite(nodes, fused)


# ---------------------------------------------------------------------------------------------
# The passes (order 63-65: after the normalizations, before attention)


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
