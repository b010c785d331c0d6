"""Convolution fusion: Conv [+ per-channel Add] [+ residual Add] [+ activation] -> tensorkiln.ConvAct.

Rules, tried on every Conv (and on every ConvAct or quantized QConvAct that can still take more):

* ``bias``:     Add(y, C), C constant and per-channel (1 everywhere but the channel axis) -> folded
                into B.
* ``residual``: Add(y, Z), Z of exactly y's shape and dtype -> Z, added before the activation.
* ``act``:      a single activation node (see :func:`~tensorkiln.passes.fuse_activation.
                match_activation`; GELU and SiLU written out are single nodes by then) ->
                ``activation`` + parameters.
* ``residual after``: act(y) then Add(., Z) -> Z with ``residual_order="act_add"``.

One rule of :mod:`tensorkiln.passes.rules`, anchored on the Conv: the chain grows in its
replacement. Every value that disappears must have the next node of the chain as its only reader;
the weight must be constant and the dtype float32 or float16, otherwise the node is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorkiln.ir import DType, Graph, Node, Value
from tensorkiln.passes.fuse_activation import match_activation
from tensorkiln.passes.pattern import Found, Op
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite, add_constant
from tensorkiln.passes.rules import DOMAIN, Rule, View, other_input, run_rules

FLOATS = (DType.FLOAT, DType.FLOAT16)
_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
# where each op that starts a chain keeps its data, weight, bias and residual inputs (a
# quantized convolution's scales sit after its data and its weight)
_SLOTS = {"Conv": (0, 1, 2, 3), "ConvAct": (0, 1, 2, 3), "QConvAct": (0, 2, 4, 5)}


# ----------------------------------------------------------------------------------- conv chain


@dataclass
class ConvMatch:
    """A conv chain being grown: the nodes it replaces and the fused node's pieces."""

    start: Node
    nodes: list[Node]
    out: Value
    bias: np.ndarray | None
    residual: Value | None
    attrs: dict[str, Any]
    grown: bool = False

    @property
    def activation(self) -> str:
        return self.attrs.get("activation", "")


def _per_channel(c: np.ndarray, shape: tuple) -> np.ndarray | None:
    """``c`` as (M,) when adding it to a (N, M, ...) tensor adds one value per channel."""
    if c.ndim > len(shape) or len(shape) < 3 or not isinstance(shape[1], int):
        return None
    padded = (1,) * (len(shape) - c.ndim) + c.shape
    if any(d != 1 for i, d in enumerate(padded) if i != 1) or padded[1] not in (1, shape[1]):
        return None
    return np.broadcast_to(c.reshape(-1), (shape[1],))


def _rule_bias(view: View, m: ConvMatch) -> bool:
    add = view.single(m.out, "Add")
    if add is None or m.residual is not None or m.activation:
        return False
    c = view.const(other_input(add, m.out), through_identity=True)
    if c is None or m.out.shape is None or m.out.dtype is None or c.dtype != m.out.dtype.numpy:
        return False
    col = _per_channel(c, m.out.shape)
    if col is None:
        return False
    wide = col.astype(np.float32)
    m.bias = (wide if m.bias is None else m.bias.astype(np.float32) + wide).astype(c.dtype)
    return _take(m, [add], add.outputs[0])


def _same_shape_residual(m: ConvMatch, add: Node) -> Value | None:
    z = other_input(add, m.out)
    if z is None or z.shape is None or m.out.shape is None or z.dtype != m.out.dtype:
        return None
    return z if tuple(z.shape) == tuple(m.out.shape) else None


def _rule_residual(view: View, m: ConvMatch) -> bool:
    add = view.single(m.out, "Add")
    if add is None or m.residual is not None or m.activation:
        return False
    z = _same_shape_residual(m, add)
    if z is None:
        return False
    m.residual = z
    return _take(m, [add], add.outputs[0])


def _rule_act(view: View, m: ConvMatch) -> bool:
    if m.activation:
        return False
    act = match_activation(view, m.out)
    if act is None:
        return False
    m.attrs.update(act.attrs)
    return _take(m, act.nodes, act.out)


def _rule_residual_after(view: View, m: ConvMatch) -> bool:
    add = view.single(m.out, "Add")
    if add is None or m.residual is not None or not m.activation:
        return False
    z = _same_shape_residual(m, add)
    if z is None:
        return False
    m.residual = z
    m.attrs["residual_order"] = "act_add"
    return _take(m, [add], add.outputs[0])


def _take(m: ConvMatch, nodes: list[Node], out: Value) -> bool:
    m.nodes.extend(nodes)
    m.out = out
    m.grown = True
    return True


EPILOGUE = (_rule_bias, _rule_residual, _rule_act, _rule_residual_after)


def _input(node: Node, slot: int) -> Value | None:
    k = _SLOTS[node.op][slot]
    return node.inputs[k] if k < len(node.inputs) else None


def _start(view: View, node: Node) -> ConvMatch | None:
    """A chain beginning at a Conv with a constant weight, or at a ConvAct or QConvAct that
    can grow."""
    if len(node.outputs) != 1 or node.outputs[0] is None or len(node.inputs) < 2:
        return None
    w = _input(node, 1)
    if node.outputs[0].dtype not in FLOATS or view.const(w, through_identity=True) is None:
        return None
    b = _input(node, 2)
    bias = view.const(b, through_identity=True) if b is not None else None
    if b is not None and bias is None:
        return None
    is_conv = node.domain == ""
    attrs = {k: v for k, v in node.attrs.items() if k in _CONV_ATTRS or not is_conv}
    if is_conv:
        return ConvMatch(node, [node], node.outputs[0], bias, None, attrs, grown=True)
    z = _input(node, 3)
    if node.attrs.get("residual_order") == "act_add" and z is not None:
        return None  # nothing can follow an added-after residual
    return ConvMatch(node, [node], node.outputs[0], bias, z, attrs)


def _fused(view: View, m: ConvMatch) -> Node:
    """The ConvAct (QConvAct) that replaces ``m.nodes`` and writes ``m.out``."""
    b = _input(m.start, 2)
    if m.bias is not None and (b is None or m.bias is not view.const(b, through_identity=True)):
        name = f"{m.start.name or 'conv'}_fused_bias"
        b = add_constant(view.graph, name, np.ascontiguousarray(m.bias))
    op = "QConvAct" if m.start.op == "QConvAct" else "ConvAct"
    head = m.start.inputs[:4] if op == "QConvAct" else m.start.inputs[:2]
    # (a QConvAct's Y_scale and Z_scale stay with it; Z_scale belongs to its own residual)
    tail = m.start.inputs[6:8] if op == "QConvAct" and m.residual is _input(m.start, 3) else []
    inputs = [*head, b, m.residual, *tail]
    while inputs and inputs[-1] is None:
        inputs.pop()
    name = m.start.name or m.out.name
    return Node(op, inputs, [m.out], dict(m.attrs), domain=DOMAIN, name=name)


def _conv_chain(view: View, found: Found) -> Rewrite | None:
    """Grow the chain from the Conv (or ConvAct) as far as the epilogue rules take it."""
    m = _start(view, found.root)
    if m is None:
        return None
    for rule in EPILOGUE:
        rule(view, m)
    return Rewrite(remove=m.nodes, add=[_fused(view, m)], count=1) if m.grown else None


RULES = (
    Rule(
        "conv_act",
        (Op("Conv"), Op("ConvAct", domain=DOMAIN), Op("QConvAct", domain=DOMAIN)),
        _conv_chain,
    ),
)


@register_pass("fuse_conv_act", level=3, order=50)
def fuse_conv_act(graph: Graph) -> int:
    """Turn every Conv with a constant weight into a ConvAct with its epilogue fused."""
    return run_rules(graph, RULES)
