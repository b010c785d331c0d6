"""GEMM fusion: MatMul/Gemm with a constant weight + bias + activation -> tensorkiln.GemmAct, and
merging of projections that share their input.

``fuse_gemm_act`` rules, tried on every MatMul/Gemm whose B is a constant 2-D weight:

* ``bias``: Add(y, C), C constant, 1 everywhere but the last axis -> GemmAct's C.
* ``act``:  an activation node of y (see
            :func:`tensorkiln.passes.fuse_activation.match_activation`), also through one Reshape
            (act(Reshape(y)) = Reshape(act(y)); GPT-2 writes its MLP so).

One rule of :mod:`tensorkiln.passes.rules`, anchored on the MatMul/Gemm; the chain grows in its
replacement.

MatMuls with two computed operands (attention's Q K^T and P V) are never touched.

``merge_shared_matmuls``: MatMuls/GemmActs that read the same A with constant weights of the same
K (Q, K and V projections) become one over the concatenated weights, followed by a Split whose
outputs are the original output values, so every consumer keeps reading what it read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkiln.ir import Graph, Node, TensorType, Value
from tensorkiln.passes.fuse_activation import match_activation
from tensorkiln.passes.fuse_conv import FLOATS
from tensorkiln.passes.pattern import Found, Op
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite, add_constant
from tensorkiln.passes.rules import DOMAIN, Rule, View, other_input, run_rules

_ACT_KEYS = (
    "activation",
    "activation_alpha",
    "activation_beta",
    "activation_min",
    "activation_max",
)


@dataclass
class GemmMatch:
    """A GEMM chain being grown."""

    start: Node
    nodes: list[Node]
    out: Value
    bias: np.ndarray | None
    attrs: dict[str, Any]
    after: list[Node] = field(default_factory=list)  # nodes kept after the GemmAct (a Reshape)
    grown: bool = False


def _weight(view: View, node: Node) -> np.ndarray | None:
    """The constant 2-D B of a MatMul/Gemm/GemmAct with a float A of rank >= 2, else None."""
    if len(node.inputs) < 2 or len(node.outputs) != 1:
        return None
    a, w = node.inputs[0], view.const(node.inputs[1], through_identity=True)
    if a is None or a.dtype not in FLOATS or a.shape is None or len(a.shape) < 2:
        return None
    if w is None or w.ndim != 2 or w.dtype != a.dtype.numpy:
        return None
    return w


def _start(view: View, node: Node) -> GemmMatch | None:
    if _weight(view, node) is None or len(node.inputs) > 3:
        return None  # (a GemmAct with a residual Z is finished too: nothing comes after the sum)
    c = node.inputs[2] if len(node.inputs) > 2 else None
    bias = view.const(c, through_identity=True)
    if c is not None and bias is None:
        return None
    attrs = dict(node.attrs)
    if node.op == "GemmAct" and attrs.get("activation"):
        return None  # already finished
    return GemmMatch(node, [node], node.outputs[0], bias, attrs)


def _last_axis(c: np.ndarray, shape: tuple) -> bool:
    """Adding ``c`` to a tensor of ``shape`` adds one value per column, nothing broadcast out."""
    if c.ndim > len(shape) or not isinstance(shape[-1], int):
        return False
    padded = (1,) * (len(shape) - c.ndim) + c.shape
    return all(d == 1 for d in padded[:-1]) and padded[-1] in (1, shape[-1])


def _rule_bias(view: View, m: GemmMatch) -> bool:
    add = view.single(m.out, "Add")
    if add is None or m.bias is not None or m.attrs.get("activation") or m.after:
        return False
    c = view.const(other_input(add, m.out), through_identity=True)
    if c is None or m.out.shape is None or m.out.dtype is None:
        return False
    if c.dtype != m.out.dtype.numpy:
        return False
    if not _last_axis(c, m.out.shape):
        return False
    m.bias = c.reshape(c.shape[-1:]) if c.ndim else c
    m.attrs["beta"] = 1.0
    return _take(m, [add], add.outputs[0])


def _rule_act(view: View, m: GemmMatch) -> bool:
    if m.attrs.get("activation"):
        return False
    act = match_activation(view, m.out)
    reshape = None
    if act is None:
        reshape = view.single(m.out, "Reshape")
        act = reshape and match_activation(view, reshape.outputs[0])
    if act is None:
        return False
    m.attrs.update(act.attrs)
    if reshape is not None:
        m.after.append(reshape)
        m.nodes.append(reshape)
    return _take(m, act.nodes, act.out)


def _take(m: GemmMatch, nodes: list[Node], out: Value) -> bool:
    m.nodes.extend(nodes)
    m.out = out
    m.grown = True
    return True


EPILOGUE = (_rule_bias, _rule_act)


def _fused(view: View, m: GemmMatch) -> Rewrite:
    """The GemmAct (and the Reshape kept after it) that replace ``m.nodes``."""
    s = m.start
    c = s.inputs[2] if len(s.inputs) > 2 else None
    if m.bias is not None and c is None:
        c = add_constant(view.graph, f"{s.name or 'gemm'}_fused_bias", np.ascontiguousarray(m.bias))
    inputs = [s.inputs[0], s.inputs[1]] + ([c] if c is not None else [])
    y = s.outputs[0] if m.after else m.out
    attrs = {k: v for k, v in m.attrs.items() if k != "broadcast"}
    rw = Rewrite(remove=m.nodes, count=1)
    rw.add.append(Node("GemmAct", inputs, [y], attrs, domain=DOMAIN, name=s.name or y.name))
    for r in m.after:  # Reshape(y) now writes the chain's output
        rw.add.append(Node(r.op, [y, *r.inputs[1:]], [m.out], dict(r.attrs), r.domain, r.name))
    return rw


def _gemm_chain(view: View, found: Found) -> Rewrite | None:
    """Grow the chain from the MatMul/Gemm (or unfinished GemmAct) through its epilogue."""
    m = _start(view, found.root)
    if m is None:
        return None
    for rule in EPILOGUE:
        rule(view, m)
    return _fused(view, m) if m.grown else None


RULES = (Rule("gemm_act", (Op(("MatMul", "Gemm")), Op("GemmAct", domain=DOMAIN)), _gemm_chain),)


@register_pass("fuse_gemm_act", level=3, order=55)
def fuse_gemm_act(graph: Graph) -> int:
    """Fuse the bias Add and activation that follow a MatMul/Gemm with a constant weight."""
    return run_rules(graph, RULES)


# ------------------------------------------------------------------------------ shared matmuls


@dataclass
class Projection:
    """One MatMul/GemmAct as (A @ B + C) then an activation, B not transposed, C of shape (N,)."""

    node: Node
    b: np.ndarray
    c: np.ndarray | None


def _projection(view: View, node: Node) -> Projection | None:
    kind = (node.domain, node.op)
    if kind not in (("", "MatMul"), ("tensorkiln", "GemmAct")) or node.outputs[0] is None:
        return None
    if len(node.inputs) > 3:
        return None  # (a residual Z: its own sum, not merged with another GEMM's)
    w = _weight(view, node)
    if w is None:
        return None
    a = node.attrs
    if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0:
        return None
    b = w.T if a.get("transB", 0) else w
    c_in = node.inputs[2] if len(node.inputs) > 2 else None
    c = view.const(c_in, through_identity=True)
    if c is not None:
        if node.inputs[0].shape is None or not _last_axis(c, (1, b.shape[1])):
            return None
        beta = a.get("beta", 1.0)
        c = np.broadcast_to(c.reshape(-1), (b.shape[1],)) * c.dtype.type(beta)
    return Projection(node, b, c)


def _key(p: Projection) -> tuple:
    kind = "MatMul" if p.node.op == "MatMul" else "GemmAct"
    act = tuple(p.node.attrs.get(k) for k in _ACT_KEYS)
    if kind == "GemmAct" and not act[0]:
        kind = "MatMul"  # a GemmAct without activation merges with plain MatMuls
    return (p.node.inputs[0], p.b.shape[0], p.b.dtype.str, act if kind == "GemmAct" else None)


def _merge(graph: Graph, group: list[Projection], rw: Rewrite) -> None:
    first = group[0].node
    a = first.inputs[0]
    sizes = [p.b.shape[1] for p in group]
    w = add_constant(
        graph,
        f"{first.name or 'matmul'}_merged_weight",
        np.concatenate([p.b for p in group], axis=1),
    )
    out_type = TensorType(a.dtype, (*a.shape[:-1], sum(sizes)))
    merged_out = Value(f"{first.outputs[0].name}_merged", out_type)
    biased = any(p.c is not None for p in group) or any(
        p.node.attrs.get("activation") for p in group
    )
    if biased:
        cs = [p.c if p.c is not None else np.zeros(p.b.shape[1], p.b.dtype) for p in group]
        c = add_constant(graph, f"{first.name or 'matmul'}_merged_bias", np.concatenate(cs))
        attrs = {k: first.attrs[k] for k in _ACT_KEYS if k in first.attrs}
        node = Node("GemmAct", [a, w, c], [merged_out], attrs, "tensorkiln", f"{first.name}_merged")
    else:
        node = Node("MatMul", [a, w], [merged_out], {}, "", f"{first.name}_merged")
    rw.add.append(node)
    rw.add.append(
        split_last(graph, merged_out, sizes, [p.node.outputs[0] for p in group], first.name)
    )
    rw.remove.extend(p.node for p in group)
    rw.count += 1


def split_last(graph: Graph, v: Value, sizes: list[int], outs: list[Value], name: str) -> Node:
    """Split ``v`` along its last axis into ``outs``, in the form the graph's opset takes."""
    if graph.opset("") >= 13:
        s = add_constant(graph, f"{name}_split_sizes", np.asarray(sizes, dtype=np.int64))
        return Node("Split", [v, s], list(outs), {"axis": -1}, "", f"{name}_split")
    return Node("Split", [v], list(outs), {"axis": -1, "split": sizes}, "", f"{name}_split")


@register_pass("merge_shared_matmuls", level=3, order=56)
def merge_shared_matmuls(graph: Graph) -> int:
    """Merge projections of one input (Q, K, V) into one GEMM over concatenated weights + Split."""
    view = View.of(graph)
    groups: dict[tuple, list[Projection]] = {}
    for node in graph.nodes:
        p = _projection(view, node)
        if p is not None:
            groups.setdefault(_key(p), []).append(p)
    rw = Rewrite()
    for group in groups.values():
        if len(group) > 1:
            _merge(graph, group, rw)
    n = rw.apply(graph)
    if n:
        graph.opsets.setdefault("tensorkiln", 1)
    return n
