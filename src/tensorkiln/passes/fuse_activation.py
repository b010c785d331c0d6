"""Activations written out as elementwise math become one node, before conv and GEMM fusion.

This module is the one place activations are recognised. ``fuse_gelu`` and ``fuse_silu`` run
before ``fuse_conv_act`` and ``fuse_gemm_act`` (orders 46-47 against 50 and 55), so those see a
single activation node and map it to their ``activation`` attributes with
:func:`match_activation`, the table of the activations ConvAct and GemmAct take.

* ``fuse_gelu``: the erf form ``x * 0.5 * (1 + erf(x / sqrt 2))`` (Div by sqrt 2 or Mul by
  1/sqrt 2, the 0.5 on either side or a Div by 2) and the tanh form
  ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` (GPT-2's, x^3 as Pow or two Muls).
  The result is ONNX ``Gelu`` (approximate "none" or "tanh") where the model imports opset 20 or
  later, so later passes and other tools still read a standard op; below opset 20 it is
  ``tensorkiln.Gelu`` with the same attribute.
* ``fuse_silu``: ``x * Sigmoid(x)`` becomes ONNX ``Swish`` (opset 24+) or ``tensorkiln.SiLU``.
* ``fuse_softmax``: ``Exp -> ReduceSum -> Div`` over the last axis, with or without the
  ``ReduceMax -> Sub`` in front, becomes ONNX ``Softmax`` on the last axis (after the
  normalizations, before attention).

Constants must have their values within 1e-4 relative (exporters write them rounded to float32;
the conv fusion, which recognised these forms itself before, took that tolerance), reductions must
run over the last axis, and no intermediate may be read outside the match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tensorkiln.ir import Graph, Node, Value
from tensorkiln.passes.pattern import Alt, Found, Op, Pattern, Scalar, Var
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite
from tensorkiln.passes.rules import (
    DOMAIN,
    Rule,
    View,
    fused_rewrite,
    is_float,
    is_op,
    rank_of,
    reduce_axes,
    run_rules,
)

RTOL = 1e-4
X = Var("x")


def _mul(a: Pattern, b: Pattern, **kw: Any) -> Op:
    return Op("Mul", [a, b], commutative=True, **kw)


def _add(a: Pattern, b: Pattern, **kw: Any) -> Op:
    return Op("Add", [a, b], commutative=True, **kw)


def _gelu_tails(one_plus: Op) -> list[Op]:
    """The ways exporters multiply ``1 + f(x)`` by ``x / 2``: the root patterns of a GELU."""
    half, two = Scalar(0.5, RTOL), Scalar(2.0, RTOL)
    return [
        _mul(_mul(X, one_plus), half),  # (x * e) * 0.5
        Op("Div", [_mul(X, one_plus), two]),  # (x * e) / 2
        _mul(_mul(one_plus, half), X),  # (e * 0.5) * x
        _mul(_mul(X, half), one_plus),  # (0.5 * x) * e
    ]


_ERF_ARG = Alt(
    Op("Div", [X, Scalar(math.sqrt(2.0), RTOL)]),
    _mul(X, Scalar(1.0 / math.sqrt(2.0), RTOL)),
)
GELU_ERF = _gelu_tails(_add(Op("Erf", [_ERF_ARG], name="anchor"), Scalar(1.0, RTOL)))

_CUBE = Alt(
    Op("Pow", [X, Scalar(3.0, rtol=0.0)]),  # the exponent exactly 3
    _mul(Op("Mul", [X, X]), X),
)
_TANH_ARG = _mul(_add(X, _mul(_CUBE, Scalar(0.044715, RTOL))), Scalar(math.sqrt(2 / math.pi), RTOL))
GELU_TANH = _gelu_tails(_add(Op("Tanh", [_TANH_ARG], name="anchor"), Scalar(1.0, RTOL)))

SILU = _mul(X, Op("Sigmoid", [X], name="anchor"))


def _float_x(view: View, found: Found) -> bool:
    return is_float(found.value("x"))


def _gelu(approximate: str):
    def replace(view: View, found: Found) -> Node:
        x, out = found.value("x"), found.root.outputs[0]
        name = f"{found.node('anchor').name}/Gelu"
        attrs = {"approximate": approximate}
        if view.graph.opset("") >= 20:
            return Node("Gelu", [x], [out], attrs, name=name)
        return Node("Gelu", [x], [out], attrs, domain=DOMAIN, name=name)

    return replace


def _silu(view: View, found: Found) -> Node:
    x, out = found.value("x"), found.root.outputs[0]
    name = f"{found.node('anchor').name}/SiLU"
    if view.graph.opset("") >= 24:
        return Node("Swish", [x], [out], {"alpha": 1.0}, name=name)
    return Node("SiLU", [x], [out], {}, domain=DOMAIN, name=name)


GELU_RULES = (
    Rule("gelu_erf", GELU_ERF, _gelu("none"), check=_float_x),
    Rule("gelu_tanh", GELU_TANH, _gelu("tanh"), check=_float_x),
)
SILU_RULES = (Rule("silu", SILU, _silu, check=_float_x),)


# ---------------------------------------------------------------------------------------------
# Single activation nodes, as ConvAct and GemmAct take them


@dataclass
class Activation:
    """A matched activation: the node it replaces, its output and the fused op's attributes."""

    nodes: list[Node]
    out: Value
    attrs: dict[str, Any]


def _onnx_activation(view: View, node: Node) -> dict[str, Any] | None:
    """Attributes of an ONNX activation node, or None when it is not one ConvAct/GemmAct take."""
    op, a = node.op, node.attrs
    if op in ("Relu", "Tanh", "Sigmoid", "HardSwish"):
        return {"activation": op}
    if op == "LeakyRelu":
        return {"activation": op, "activation_alpha": float(a.get("alpha", 0.01))}
    if op == "HardSigmoid":
        alpha, beta = float(a.get("alpha", 0.2)), float(a.get("beta", 0.5))
        return {"activation": op, "activation_alpha": alpha, "activation_beta": beta}
    if op == "Swish":
        return {"activation": op, "activation_alpha": float(a.get("alpha", 1.0))}
    if op == "Gelu":
        return {"activation": "GeluTanh" if _tanh_gelu(node) else "Gelu"}
    if op == "Clip":
        return _clip(view, node)
    return None


def _tanh_gelu(node: Node) -> bool:
    return node.attrs.get("approximate", "none") in ("tanh", b"tanh")


def _our_activation(node: Node) -> dict[str, Any] | None:
    """tensorkiln.Gelu / tensorkiln.SiLU, which fuse_gelu / fuse_silu make below opset 20 / 24."""
    if node.op == "SiLU":
        return {"activation": "Swish", "activation_alpha": 1.0}
    if node.op == "Gelu":
        return {"activation": "GeluTanh" if _tanh_gelu(node) else "Gelu"}
    return None


def _clip(view: View, node: Node) -> dict[str, Any] | None:
    if "min" in node.attrs or "max" in node.attrs:  # opset < 11
        bounds = [node.attrs.get("min"), node.attrs.get("max")]
    else:
        bounds = []
        for v in node.inputs[1:3]:
            if v is None:
                bounds.append(None)
                continue
            c = view.const(v, through_identity=True)
            bounds.append(float(c.reshape(())) if c is not None and c.size == 1 else None)
            if bounds[-1] is None:  # a bound computed at run time: not fused
                return None
    attrs: dict[str, Any] = {"activation": "Clip"}
    for key, b in zip(("activation_min", "activation_max"), [*bounds, None, None]):
        if b is not None:
            attrs[key] = float(b)
    return attrs


def match_activation(view: View, v: Value) -> Activation | None:
    """The activation node applied to ``v`` and nothing else (unclaimed), or None."""
    node = view.single(v)
    if node is None or node in view.claimed or node.inputs[0] is not v:
        return None
    if node.domain == "":
        attrs = _onnx_activation(view, node)
    else:
        attrs = _our_activation(node) if node.domain == DOMAIN else None
    return None if attrs is None else Activation([node], node.outputs[0], attrs)


# ---------------------------------------------------------------------------------------------
# Softmax: Exp's output is read twice (ReduceSum and Div), so the rule walks on from Exp


def _last_axis_reduce(view: View, node: Node | None, rank: int | None) -> bool:
    return node is not None and rank is not None and reduce_axes(view, node, rank) == (rank - 1,)


def _max_subtracted(m: View, x: Value, exp: Node) -> tuple[Node, Node] | None:
    """(ReduceMax, Sub) when ``x = y - ReduceMax(y)`` over the last axis, read only by ``exp``."""
    sub = m.made_by(x, "Sub")
    mx = m.made_by(sub.inputs[1], "ReduceMax") if sub is not None and m.sole(x) is exp else None
    if mx is None or mx.inputs[0] is not sub.inputs[0] or m.sole(mx.outputs[0]) is not sub:
        return None
    return (mx, sub) if _last_axis_reduce(m, mx, rank_of(mx.inputs[0])) else None


def _softmax(view: View, found: Found) -> Rewrite | None:
    m, exp = view, found.root
    x, e = exp.inputs[0], exp.outputs[0]
    readers = m.readers.get(e, [])
    rs = next((r for r in readers if is_op(r, "ReduceSum") and r.inputs[0] is e), None)
    div = m.sole(rs.outputs[0], "Div") if rs is not None else None
    if div is None or div.inputs != [e, rs.outputs[0]] or e in m.outputs or len(readers) != 2:
        return None
    if not is_float(x) or not _last_axis_reduce(m, rs, rank_of(x)):
        return None
    nodes = [exp, rs, div]
    shifted = _max_subtracted(m, x, exp)
    if shifted is not None:
        nodes, x = [*shifted, *nodes], shifted[1].inputs[0]
    axis = -1 if m.graph.opset("") >= 11 else len(x.shape) - 1
    fused = Node("Softmax", [x], [div.outputs[0]], {"axis": axis}, name=f"{exp.name}/Softmax")
    return fused_rewrite(nodes, fused)


SOFTMAX_RULES = (Rule("softmax", Op("Exp"), _softmax),)


# ---------------------------------------------------------------------------------------------
# The passes: GELU and SiLU before the conv (50) and GEMM (55) fusions, Softmax after the
# normalizations (60-62) and before attention (70)


@register_pass("fuse_gelu", level=3, order=46)
def fuse_gelu(graph: Graph) -> int:
    """Decomposed erf and tanh GELU -> Gelu (ONNX from opset 20, tensorkiln below)."""
    return run_rules(graph, GELU_RULES)


@register_pass("fuse_silu", level=3, order=47)
def fuse_silu(graph: Graph) -> int:
    """x * Sigmoid(x) -> Swish (ONNX from opset 24) or tensorkiln.SiLU."""
    return run_rules(graph, SILU_RULES)


@register_pass("fuse_softmax", level=3, order=65)
def fuse_softmax(graph: Graph) -> int:
    """Exp / ReduceSum(Exp) over the last axis (max-subtracted or not) -> Softmax."""
    return run_rules(graph, SOFTMAX_RULES)
