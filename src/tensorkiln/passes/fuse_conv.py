"""Convolution fusion: Conv [+ per-channel Add] [+ residual Add] [+ activation] -> tensorkiln.ConvAct.

Rules, tried on every Conv (and on every ConvAct that can still take more):

* ``bias``:     Add(y, C), C constant and per-channel (1 everywhere but the channel axis) -> folded
                into B.
* ``residual``: Add(y, Z), Z of exactly y's shape and dtype -> Z, added before the activation.
* ``act``:      a single activation (see :func:`match_activation`) -> ``activation`` + parameters.
* ``residual after``: act(y) then Add(., Z) -> Z with ``residual_order="act_add"``.

Every value that disappears must have the next node of the chain as its only reader; the weight
must be constant and the dtype float32 or float16, otherwise the node is left alone. The activation
matcher is shared with :mod:`tensorkiln.passes.fuse_gemm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkiln.ir import DType, Graph, Node, Value
from tensorkiln.passes.manager import register_pass
from tensorkiln.passes.rewrite import Rewrite, add_constant, const_value, only_use

FLOATS = (DType.FLOAT, DType.FLOAT16)
_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


@dataclass
class Ctx:
    """What the rules of one pass run look at: the graph, its use maps, nodes already taken."""

    graph: Graph
    producers: dict[Value, Node]
    consumers: dict[Value, list[Node]]
    claimed: set[Node] = field(default_factory=set)

    @classmethod
    def of(cls, graph: Graph) -> Ctx:
        return cls(graph, graph.producers(), graph.consumers())

    def next_node(self, v: Value, op: str) -> Node | None:
        """The only reader of ``v`` when it is an unclaimed ``op`` of the ONNX domain."""
        node = only_use(self.graph, v, self.consumers)
        if node is None or node.op != op or node.domain != "" or node in self.claimed:
            return None
        return node

    def const(self, v: Value | None) -> np.ndarray | None:
        """The data of ``v`` when it is constant (through Identity, which exporters leave)."""
        p = self.producers.get(v) if v is not None else None
        while p is not None and p.op == "Identity" and p.domain == "":
            v = p.inputs[0]
            p = self.producers.get(v)
        return const_value(v, self.producers)

    def scalar(self, v: Value | None) -> float | None:
        c = self.const(v)
        return float(c.reshape(())) if c is not None and c.size == 1 else None


def other_input(node: Node, v: Value) -> Value | None:
    """The input of the binary ``node`` that is not ``v`` (None if both are ``v``)."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is v else a if b is v else None


# ------------------------------------------------------------------------------------ activations


@dataclass
class Activation:
    """A matched activation: the nodes it replaces, its output and the fused op's attributes."""

    nodes: list[Node]
    out: Value
    attrs: dict[str, Any]


def _near(x: float | None, want: float, rtol: float = 1e-4) -> bool:
    return x is not None and abs(x - want) <= rtol * abs(want)


def _simple(ctx: Ctx, node: Node) -> dict[str, Any] | None:
    """Attributes of a one-node activation, or None when ``node`` is not one we fuse."""
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
        approx = a.get("approximate", "none")
        approx = approx.decode() if isinstance(approx, bytes) else approx
        return {"activation": "GeluTanh" if approx == "tanh" else "Gelu"}
    if op == "Clip":
        return _clip(ctx, node)
    return None


def _ours(node: Node) -> dict[str, Any] | None:
    """tensorkiln.Gelu / tensorkiln.SiLU, which fuse_norm makes from the decomposed forms."""
    if node.domain != "tensorkiln":
        return None
    if node.op == "SiLU":
        return {"activation": "Swish", "activation_alpha": 1.0}
    if node.op == "Gelu":
        tanh = node.attrs.get("approximate", "none") in ("tanh", b"tanh")
        return {"activation": "GeluTanh" if tanh else "Gelu"}
    return None


def _clip(ctx: Ctx, node: Node) -> dict[str, Any] | None:
    if "min" in node.attrs or "max" in node.attrs:  # opset < 11
        bounds = [node.attrs.get("min"), node.attrs.get("max")]
    else:
        bounds = []
        for v in node.inputs[1:3]:
            if v is None:
                bounds.append(None)
                continue
            bounds.append(ctx.scalar(v))
            if bounds[-1] is None:  # a bound computed at run time: not fused
                return None
    attrs: dict[str, Any] = {"activation": "Clip"}
    for key, b in zip(("activation_min", "activation_max"), [*bounds, None, None]):
        if b is not None:
            attrs[key] = float(b)
    return attrs


def _swish(ctx: Ctx, v: Value) -> Activation | None:
    """Mul(v, Sigmoid(v)), v read by nothing else."""
    readers = ctx.consumers.get(v, [])
    if len(readers) != 2 or v in ctx.graph.outputs or any(n in ctx.claimed for n in readers):
        return None
    sig = next((n for n in readers if n.op == "Sigmoid" and n.domain == ""), None)
    mul = next((n for n in readers if n.op == "Mul" and n.domain == ""), None)
    if sig is None or mul is None or ctx.next_node(sig.outputs[0], "Mul") is not mul:
        return None
    if other_input(mul, sig.outputs[0]) is not v:
        return None
    return Activation([sig, mul], mul.outputs[0], {"activation": "Swish", "activation_alpha": 1.0})


def _gelu_erf(ctx: Ctx, v: Value) -> Activation | None:
    """Mul(Mul(v, Add(Erf(v / sqrt 2), 1)), 0.5): the erf Gelu as the TorchScript exporter writes it."""
    readers = ctx.consumers.get(v, [])
    if len(readers) != 2 or v in ctx.graph.outputs or any(n in ctx.claimed for n in readers):
        return None
    scale = next((n for n in readers if n.op in ("Div", "Mul") and n.inputs[0] is v), None)
    if scale is None or scale.domain != "":
        return None
    want = 2**0.5 if scale.op == "Div" else 2**-0.5
    if not _near(ctx.scalar(scale.inputs[1]), want):
        return None
    erf = ctx.next_node(scale.outputs[0], "Erf")
    add = erf and ctx.next_node(erf.outputs[0], "Add")
    if add is None or not _near(ctx.scalar(other_input(add, erf.outputs[0])), 1.0):
        return None
    mul = ctx.next_node(add.outputs[0], "Mul")
    if mul is None or mul not in readers or other_input(mul, add.outputs[0]) is not v:
        return None
    half = ctx.next_node(mul.outputs[0], "Mul")
    if half is None or not _near(ctx.scalar(other_input(half, mul.outputs[0])), 0.5):
        return None
    return Activation([scale, erf, add, mul, half], half.outputs[0], {"activation": "Gelu"})


def _gelu_tanh(ctx: Ctx, v: Value) -> Activation | None:
    """0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), as GPT-2's gelu_new is exported."""
    readers = ctx.consumers.get(v, [])
    if len(readers) != 3 or v in ctx.graph.outputs or any(n in ctx.claimed for n in readers):
        return None
    by_op = {n.op: n for n in readers if n.domain == ""}
    half, cube, add = by_op.get("Mul"), by_op.get("Pow"), by_op.get("Add")
    if half is None or cube is None or add is None or cube.inputs[0] is not v:
        return None
    if not _near(ctx.scalar(other_input(half, v)), 0.5) or ctx.scalar(cube.inputs[1]) != 3.0:
        return None
    coef = ctx.next_node(cube.outputs[0], "Mul")
    if coef is None or not _near(ctx.scalar(other_input(coef, cube.outputs[0])), 0.044715):
        return None
    if (
        ctx.next_node(coef.outputs[0], "Add") is not add
        or other_input(add, coef.outputs[0]) is not v
    ):
        return None
    scale = ctx.next_node(add.outputs[0], "Mul")
    if scale is None or not _near(
        ctx.scalar(other_input(scale, add.outputs[0])), (2 / np.pi) ** 0.5
    ):
        return None
    tanh = ctx.next_node(scale.outputs[0], "Tanh")
    one = tanh and ctx.next_node(tanh.outputs[0], "Add")
    if one is None or not _near(ctx.scalar(other_input(one, tanh.outputs[0])), 1.0):
        return None
    out = ctx.next_node(one.outputs[0], "Mul")
    if out is None or ctx.next_node(half.outputs[0], "Mul") is not out:
        return None
    nodes = [half, cube, coef, add, scale, tanh, one, out]
    return Activation(nodes, out.outputs[0], {"activation": "GeluTanh"})


def match_activation(ctx: Ctx, v: Value) -> Activation | None:
    """The activation applied to ``v`` and nothing else, or None."""
    for composite in (_swish, _gelu_erf, _gelu_tanh):
        found = composite(ctx, v)
        if found is not None:
            return found
    node = only_use(ctx.graph, v, ctx.consumers)
    if node is None or node in ctx.claimed or node.inputs[0] is not v:
        return None
    attrs = _simple(ctx, node) if node.domain == "" else _ours(node)
    return None if attrs is None else Activation([node], node.outputs[0], attrs)


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


def _rule_bias(ctx: Ctx, m: ConvMatch) -> bool:
    add = ctx.next_node(m.out, "Add")
    if add is None or m.residual is not None or m.activation:
        return False
    c = ctx.const(other_input(add, m.out))
    if c is None or m.out.shape is None or m.out.dtype is None or c.dtype != m.out.dtype.numpy:
        return False
    col = _per_channel(c, m.out.shape)
    if col is None:
        return False
    wide = col.astype(np.float32)
    m.bias = (wide if m.bias is None else m.bias.astype(np.float32) + wide).astype(c.dtype)
    return _take(m, [add], add.outputs[0])


def _same_shape_residual(ctx: Ctx, m: ConvMatch, add: Node) -> Value | None:
    z = other_input(add, m.out)
    if z is None or z.shape is None or m.out.shape is None or z.dtype != m.out.dtype:
        return None
    return z if tuple(z.shape) == tuple(m.out.shape) else None


def _rule_residual(ctx: Ctx, m: ConvMatch) -> bool:
    add = ctx.next_node(m.out, "Add")
    if add is None or m.residual is not None or m.activation:
        return False
    z = _same_shape_residual(ctx, m, add)
    if z is None:
        return False
    m.residual = z
    return _take(m, [add], add.outputs[0])


def _rule_act(ctx: Ctx, m: ConvMatch) -> bool:
    if m.activation:
        return False
    act = match_activation(ctx, m.out)
    if act is None:
        return False
    m.attrs.update(act.attrs)
    return _take(m, act.nodes, act.out)


def _rule_residual_after(ctx: Ctx, m: ConvMatch) -> bool:
    add = ctx.next_node(m.out, "Add")
    if add is None or m.residual is not None or not m.activation:
        return False
    z = _same_shape_residual(ctx, m, add)
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


RULES = (_rule_bias, _rule_residual, _rule_act, _rule_residual_after)


def _start(ctx: Ctx, node: Node) -> ConvMatch | None:
    """A chain beginning at a Conv with a constant weight, or at a ConvAct that can grow."""
    is_conv = node.op == "Conv" and node.domain == ""
    if not (is_conv or (node.op == "ConvAct" and node.domain == "tensorkiln")):
        return None
    if node in ctx.claimed or len(node.outputs) != 1 or len(node.inputs) < 2:
        return None
    x, w = node.inputs[0], node.inputs[1]
    if x is None or x.dtype not in FLOATS or ctx.const(w) is None:
        return None
    b = node.inputs[2] if len(node.inputs) > 2 else None
    bias = ctx.const(b) if b is not None else None
    if b is not None and bias is None:
        return None
    attrs = {k: v for k, v in node.attrs.items() if k in _CONV_ATTRS or node.op == "ConvAct"}
    if is_conv:
        return ConvMatch(node, [node], node.outputs[0], bias, None, attrs, grown=True)
    z = node.inputs[3] if len(node.inputs) > 3 else None
    if node.attrs.get("residual_order") == "act_add" and z is not None:
        return None  # nothing can follow an added-after residual
    return ConvMatch(node, [node], node.outputs[0], bias, z, attrs)


def _fused(graph: Graph, ctx: Ctx, m: ConvMatch, rw: Rewrite) -> None:
    """Queue the ConvAct that replaces ``m.nodes`` and writes ``m.out``."""
    w = m.start.inputs[1]
    b = m.start.inputs[2] if len(m.start.inputs) > 2 else None
    if m.bias is not None and (b is None or m.bias is not ctx.const(b)):
        name = f"{m.start.name or 'conv'}_fused_bias"
        b = add_constant(graph, name, np.ascontiguousarray(m.bias))
    inputs = [m.start.inputs[0], w, b, m.residual]
    while inputs and inputs[-1] is None:
        inputs.pop()
    name = m.start.name or m.out.name
    node = Node("ConvAct", inputs, [m.out], dict(m.attrs), domain="tensorkiln", name=name)
    rw.remove.extend(m.nodes)
    rw.add.append(node)
    rw.count += 1
    ctx.claimed.update(m.nodes)


def _grow(ctx: Ctx, m: ConvMatch) -> ConvMatch:
    for rule in RULES:
        if rule(ctx, m):
            ctx.claimed.update(m.nodes)
    return m


@register_pass("fuse_conv_act", level=3, order=50)
def fuse_conv_act(graph: Graph) -> int:
    """Turn every Conv with a constant weight into a ConvAct with its epilogue fused."""
    ctx = Ctx.of(graph)
    rw = Rewrite()
    for node in list(graph.nodes):
        m = _start(ctx, node)
        if m is None:
            continue
        ctx.claimed.add(node)
        m = _grow(ctx, m)
        if m.grown:
            _fused(graph, ctx, m, rw)
    n = rw.apply(graph)
    if n:
        _ensure_opset(graph)
    return n


def _ensure_opset(graph: Graph) -> None:
    graph.opsets.setdefault("tensorkiln", 1)
