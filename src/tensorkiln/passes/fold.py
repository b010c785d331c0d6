"""Folding passes (level 2): constant per-channel affine ops into weights, layout ops into each other.

* ``fold_batchnorm``: inference-mode BatchNormalization into the Conv / ConvTranspose / Gemm / 2-D
  MatMul before it (new weight and bias initializers).
* ``fold_mul_add_into_conv_gemm``: Mul / Add / Sub by a per-output-channel constant into the same.
* ``push_transpose_through_pointwise``: Transpose -> pointwise chain -> Transpose(s) becomes
  pointwise chain -> composed Transpose(s), one Transpose fewer each time.
* ``merge_transposes``: Transpose(Transpose(x)) composed, dropped when the identity.
* ``merge_reshapes``: Reshape(Reshape/Flatten/Squeeze/Unsqueeze(x)) reads x directly.

Each pass is one rule of :mod:`tensorkiln.passes.rules`, anchored on the node the fold starts
from, swept over every (sub)graph until it finds nothing more. Every rule checks all it relies on
(constant weights, single consumer of the intermediate value, attribute values, broadcast shapes,
dtypes) and returns None when anything is not as required.
Folded weights are new initializers; shared initializers are never modified.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tensorkiln.ir import Graph, Node, TensorType, Value
from tensorkiln.passes.facts import TRANSPOSABLE_BINARY, TRANSPOSABLE_UNARY
from tensorkiln.passes.pattern import Const, Found, Op
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite, add_constant
from tensorkiln.passes.rules import Rule, View, run_rules


def _graphs(graph: Graph) -> Iterator[Graph]:
    yield graph
    for node in graph.nodes:
        for sub in node.subgraphs():
            yield from _graphs(sub)


def _run(graph: Graph, rule: Rule, max_sweeps: int = 64) -> int:
    """Apply ``rule`` to every (sub)graph until it finds nothing more; each match removes nodes."""
    count = 0
    for g in list(_graphs(graph)):
        for _ in range(max_sweeps):
            n = run_rules(g, [rule])
            count += n
            if not n:
                break
    return count


def _is_float(a: np.ndarray | None) -> bool:
    return a is not None and np.issubdtype(a.dtype, np.floating)


# ---------------------------------------------------------------- per-channel affine into weights


@dataclass
class _Linear:
    """A Conv / ConvTranspose / Gemm / MatMul with a constant weight, seen as y = W x + b."""

    node: Node
    w: np.ndarray
    b: np.ndarray | None  # Conv bias [M], or Gemm's C (any broadcastable shape)
    rank: int  # rank of the output
    axis: int  # output channel axis
    channels: int


def _as_linear(view: View, node: Node | None) -> _Linear | None:
    if node is None or node.domain != "" or node in view.claimed:
        return None
    if any(v is None for v in node.outputs[:1]) or len(node.outputs) != 1:
        return None
    w = view.const(node.inputs[1]) if len(node.inputs) > 1 else None
    b_in = node.inputs[2] if len(node.inputs) > 2 else None
    b = view.const(b_in)
    if not _is_float(w) or (b_in is not None and (b is None or b.dtype != w.dtype)):
        return None
    if node.inputs[0] is None or view.const(node.inputs[0]) is not None:
        return None
    if node.op == "Conv" and w.ndim >= 3:
        return _Linear(node, w, b, w.ndim, 1, w.shape[0])
    if node.op == "ConvTranspose" and w.ndim >= 3:
        group = int(node.attrs.get("group", 1))
        return _Linear(node, w, b, w.ndim, 1, w.shape[1] * group)
    if node.op == "Gemm" and w.ndim == 2:
        n = w.shape[0] if node.attrs.get("transB", 0) else w.shape[1]
        return _Linear(node, w, b, 2, 1, n)
    if node.op == "MatMul" and w.ndim == 2:
        x_shape = node.inputs[0].shape
        if x_shape is None or len(x_shape) < 2:
            return None
        return _Linear(node, w, None, len(x_shape), len(x_shape) - 1, w.shape[1])
    return None


def _channel_vector(c: np.ndarray, lin: _Linear) -> np.ndarray | None:
    """``c`` as a [channels] vector when it only varies along the output channel axis."""
    if c.ndim > lin.rank:
        return None  # broadcasting would add axes
    shape = (1,) * (lin.rank - c.ndim) + c.shape
    if any(d != 1 for i, d in enumerate(shape) if i != lin.axis):
        return None
    if shape[lin.axis] not in (1, lin.channels):
        return None
    return np.broadcast_to(c.reshape(-1).astype(np.float64), (lin.channels,))


def _scale_weight(lin: _Linear, s: np.ndarray) -> np.ndarray:
    w, op = lin.w.astype(np.float64), lin.node.op
    if op == "Conv":
        return w * s.reshape((-1,) + (1,) * (w.ndim - 1))
    if op == "ConvTranspose":  # [C_in, M/g, k...]: output channel g_i * M/g + j
        g = int(lin.node.attrs.get("group", 1))
        k = w.shape[2:]
        grouped = w.reshape((g, w.shape[0] // g, w.shape[1], *k))
        scaled = grouped * s.reshape((g, 1, w.shape[1]) + (1,) * len(k))
        return scaled.reshape(w.shape)
    if op == "Gemm" and lin.node.attrs.get("transB", 0):
        return w * s[:, None]
    return w * s[None, :]  # Gemm [K, N], MatMul [K, N]


def _new_bias(lin: _Linear, s: np.ndarray | None, t: np.ndarray | None) -> np.ndarray | None:
    b = lin.b
    if b is not None:
        b = b.astype(np.float64)
        if lin.node.op == "Gemm":
            b = b * float(lin.node.attrs.get("beta", 1.0))
        if s is not None:
            b = b * s
    if t is not None:
        b = t if b is None else b + t
    return b


def _fold_affine(view: View, lin: _Linear, s, t, out: Value, name: str) -> list[Node] | None:
    """New node(s) computing ``lin`` * s + t (per output channel) into ``out``."""
    node, dtype = lin.node, lin.w.dtype
    b = _new_bias(lin, s, t)
    op = node.op
    if op == "MatMul" and b is not None:
        if lin.rank != 2:
            return None  # MatMul + Add of a bias is already the smallest form
        op = "Gemm"
    inputs = list(node.inputs[:2])
    attrs = dict(node.attrs)
    if s is not None:
        w = _scale_weight(lin, s).astype(dtype)
        inputs[1] = add_constant(view.graph, f"{node.inputs[1].name}_folded", w)
    if b is not None:
        inputs.append(add_constant(view.graph, f"{name}_bias_folded", b.astype(dtype)))
        if op == "Gemm":
            attrs["beta"] = 1.0
    return [Node(op, inputs, [out], attrs, "", name=f"{node.name or name}_folded")]


def _is_inference_bn(view: View, node: Node) -> bool:
    if any(v is not None for v in node.outputs[1:]) or node.outputs[0] is None:
        return False
    return node.attrs.get("training_mode", 0) == 0 and node.attrs.get("spatial", 1) == 1


_LINEAR = Op(("Conv", "ConvTranspose", "Gemm", "MatMul"), name="lin")
BATCHNORM = Op("BatchNormalization", [_LINEAR, *[Const()] * 4], where=_is_inference_bn)
SCALED = (
    Op(("Mul", "Add"), [_LINEAR, Const(name="c")], commutative=True),
    Op("Sub", [_LINEAR, Const(name="c")]),
)


def _rule_batchnorm(view: View, found: Found) -> Rewrite | None:
    node = found.root
    lin = _as_linear(view, found.node("lin"))
    if lin is None or lin.axis != 1:
        return None  # BatchNormalization normalizes axis 1
    params = [view.const(v) for v in node.inputs[1:]]
    if not all(_is_float(p) and p.shape == (lin.channels,) for p in params):
        return None
    scale, bias, mean, var = (p.astype(np.float64) for p in params)
    s = scale / np.sqrt(var + float(node.attrs.get("epsilon", 1e-5)))
    t = bias - mean * s
    new = _fold_affine(view, lin, s, t, node.outputs[0], node.name)
    if new is None:
        return None
    return Rewrite(remove=[lin.node, node], add=new, count=1)


@register_pass("fold_batchnorm", level=2, order=20)
def fold_batchnorm(graph: Graph) -> int:
    """Fold inference BatchNormalization into the Conv/ConvTranspose/Gemm/MatMul before it."""
    return _run(graph, Rule("batchnorm", BATCHNORM, _rule_batchnorm))


def _rule_mul_add(view: View, found: Found) -> Rewrite | None:
    node = found.root
    lin = _as_linear(view, found.node("lin"))
    c = view.const(found.value("c"))
    if lin is None or c.dtype != lin.w.dtype:
        return None
    vec = _channel_vector(c, lin)
    if vec is None:
        return None
    s = vec if node.op == "Mul" else None
    t = None if node.op == "Mul" else (vec if node.op == "Add" else -vec)
    new = _fold_affine(view, lin, s, t, node.outputs[0], node.name)
    return None if new is None else Rewrite(remove=[lin.node, node], add=new, count=1)


@register_pass("fold_mul_add_into_conv_gemm", level=2, order=22)
def fold_mul_add_into_conv_gemm(graph: Graph) -> int:
    """Fold Mul/Add/Sub by a per-output-channel constant into Conv/ConvTranspose/Gemm/MatMul."""
    return _run(graph, Rule("mul_add", SCALED, _rule_mul_add))


# ---------------------------------------------------------------- transposes


def _perm(node: Node, rank: int | None) -> list[int] | None:
    perm = node.attrs.get("perm")
    if perm is None:
        return None if rank is None else list(range(rank))[::-1]
    return [int(p) for p in perm]


def _input_rank(node: Node) -> int | None:
    shape = node.inputs[0].shape if node.inputs and node.inputs[0] is not None else None
    return None if shape is None else len(shape)


def _transpose(view: View, x: Value, perm: list[int], out: Value, name: str) -> Rewrite:
    """x transposed by ``perm`` into ``out``; the identity permutation reads x directly."""
    if perm == list(range(len(perm))):
        return Rewrite(replace={out: x}, count=1)
    node = Node("Transpose", [x], [out], {"perm": perm}, "", name=name)
    return Rewrite(add=[node], count=1)


# the first Transpose is kept when others read it too (the rule decides)
TRANSPOSE_PAIR = Op("Transpose", [Op("Transpose", name="first", keep=True)])


def _rule_merge_transposes(view: View, found: Found) -> Rewrite | None:
    node, first = found.root, found.node("first")
    p1, p2 = _perm(first, _input_rank(first)), _perm(node, _input_rank(node))
    if p1 is None or p2 is None or len(p1) != len(p2):
        return None
    composed = [p1[i] for i in p2]  # y2[i] = y1[p2[i]] = x[p1[p2[i]]]
    rw = _transpose(view, first.inputs[0], composed, node.outputs[0], node.name)
    rw.remove.append(node)
    if view.single(first.outputs[0]) is node:
        rw.remove.append(first)  # else the first Transpose stays for its other readers
    return rw


@register_pass("merge_transposes", level=2, order=31)
def merge_transposes(graph: Graph) -> int:
    """Compose consecutive Transposes; drop the result when it is the identity permutation."""
    return _run(graph, Rule("transposes", TRANSPOSE_PAIR, _rule_merge_transposes))


def _pointwise_operand(view: View, node: Node, x: Value, rank: int) -> bool:
    """``node`` is pointwise in ``x`` alone: unary, or binary with a constant of one element."""
    if node.domain != "" or len(node.outputs) != 1 or node.outputs[0] is None:
        return False
    if node.op in TRANSPOSABLE_UNARY:
        return len(node.inputs) == 1
    if node.op not in TRANSPOSABLE_BINARY or len(node.inputs) != 2 or x not in node.inputs:
        return False
    other = node.inputs[1] if node.inputs[0] is x else node.inputs[0]
    c = view.const(other)
    return c is not None and c.size == 1 and c.ndim <= rank and other is not x


def _pointwise_chain(view: View, start: Value, rank: int) -> list[Node] | None:
    """The single-reader pointwise nodes from ``start`` up to one read only by Transposes."""
    chain: list[Node] = []
    v = start
    while True:
        reader = view.single(v)
        if (
            reader is None
            or reader in view.claimed
            or not _pointwise_operand(view, reader, v, rank)
        ):
            return None
        chain.append(reader)
        v = reader.outputs[0]
        readers = view.uses.get(v, [])
        if v in view.graph.outputs or not readers:
            return None
        if all(r.op == "Transpose" and r.domain == "" and r not in view.claimed for r in readers):
            return chain


def _rule_push_transpose(view: View, found: Found) -> Rewrite | None:
    node = found.root
    if node.op != "Transpose" or node.domain != "" or node.inputs[0] is None:
        return None
    rank = _input_rank(node)
    perm = _perm(node, rank)
    if perm is None:
        return None
    chain = _pointwise_chain(view, node.outputs[0], len(perm))
    if chain is None:
        return None
    inverse = [perm.index(i) for i in range(len(perm))]
    rw = Rewrite(remove=[node, *chain], count=1)
    x = node.inputs[0]
    prev = node.outputs[0]
    for p in chain:
        out = p.outputs[0]
        shape = None if out.shape is None else tuple(out.shape[i] for i in inverse)
        new_out = Value(view.fresh_name(f"{out.name}_untransposed"), TensorType(out.dtype, shape))
        inputs = [x if v is prev else v for v in p.inputs]
        rw.add.append(Node(p.op, inputs, [new_out], dict(p.attrs), "", name=p.name))
        x, prev = new_out, out
    for t in view.uses[prev]:
        t_perm = _perm(t, len(perm))
        rw.merge(_transpose(view, x, [perm[i] for i in t_perm], t.outputs[0], t.name))
        rw.remove.append(t)
        rw.count -= 1
    return rw


@register_pass("push_transpose_through_pointwise", level=2, order=30)
def push_transpose_through_pointwise(graph: Graph) -> int:
    """Transpose -> pointwise ops -> Transpose(s): apply the ops first, compose the Transposes.

    Only applied when every reader at the end of the chain is a Transpose, so each match removes
    one Transpose (and more when a composed permutation is the identity): it cannot cycle.
    """
    return _run(graph, Rule("push_transpose", Op("Transpose"), _rule_push_transpose))


# ---------------------------------------------------------------- reshapes

_RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _target_shape(view: View, node: Node) -> np.ndarray | None:
    """The Reshape's shape with 0 entries (copies of the input's dims) resolved, or None."""
    shape = view.const(node.inputs[1]) if len(node.inputs) > 1 else None
    if shape is None or shape.dtype != np.int64 or shape.ndim != 1:
        return None
    if node.attrs.get("allowzero", 0) or not (shape == 0).any():
        return shape
    middle = node.inputs[0].shape
    if middle is None:
        return None
    resolved = shape.copy()
    for i in np.flatnonzero(shape == 0):
        if i >= len(middle) or not isinstance(middle[i], int):
            return None  # the 0 copies a dimension only the middle tensor knows
        resolved[i] = middle[i]
    return resolved


def _flatten_shape(node: Node) -> np.ndarray | None:
    """Flatten's output shape as a Reshape target, when its input shape is static."""
    middle = node.inputs[0].shape
    if middle is None or not all(isinstance(d, int) for d in middle):
        return None
    axis = int(node.attrs.get("axis", 1))
    axis = axis + len(middle) if axis < 0 else axis
    if not 0 <= axis <= len(middle):
        return None
    outer = int(np.prod(middle[:axis], dtype=np.int64))
    return np.array([outer, int(np.prod(middle[axis:], dtype=np.int64))], np.int64)


RESHAPE_PAIR = Op(("Reshape", "Flatten"), [Op(_RESHAPES, name="first", keep=True)], prefix=True)


def _rule_merge_reshapes(view: View, found: Found) -> Rewrite | None:
    node, first = found.root, found.node("first")
    if node.op == "Reshape" and len(node.inputs) == 2:
        shape = _target_shape(view, node)
    elif node.op == "Flatten":
        shape = _flatten_shape(node)
    else:
        return None
    if first.inputs[0] is None or shape is None:
        return None  # a Reshape only depends on the element count, unless a 0 copies a dim
    if node.op == "Reshape" and np.array_equal(shape, view.const(node.inputs[1])):
        shape_value = node.inputs[1]
    else:
        shape_value = add_constant(view.graph, f"{node.name or 'shape'}_target", shape)
    attrs = {"allowzero": node.attrs["allowzero"]} if "allowzero" in node.attrs else {}
    new = Node("Reshape", [first.inputs[0], shape_value], list(node.outputs), attrs)
    new.name = node.name
    rw = Rewrite(remove=[node], add=[new], count=1)
    if view.single(first.outputs[0]) is node:
        rw.remove.append(first)
    return rw


@register_pass("merge_reshapes", level=2, order=33)
def merge_reshapes(graph: Graph) -> int:
    """Reshape (or Flatten) of a Reshape/Flatten/Squeeze/Unsqueeze reads the original directly.

    A Reshape's result depends only on its input's element count, except where its shape has a
    0 entry that copies a dimension (allowzero=0): those are resolved from the inferred middle
    shape when it is static, otherwise the pair is left alone. A Flatten depends on its input's
    shape, so it is only merged (as a Reshape) when that shape is fully static.
    """
    return _run(graph, Rule("reshapes", RESHAPE_PAIR, _rule_merge_reshapes))
