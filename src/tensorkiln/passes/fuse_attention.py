"""fuse_attention: scaled dot-product attention -> one tensorkiln.Attention node.

Pattern (as the TorchScript and torch.export exporters write it, before or after the earlier passes)::

    K^T   = Transpose(K, [0,1,3,2]) | Transpose(Kbshd, [0,2,3,1]) | Reshape(Transpose(Reshape(K)))
    S     = MatMul(Q * a, K^T * b) [* c | / c]        a, b, c scalar constants: scale = a*b*c
    S     = S + mask                                  optional; mask broadcast over the heads
    P     = Softmax(S, axis=last)  [-> Where(IsNaN(P), 0, P)]
    O     = MatMul(P, V)                              Q, K, V: [B, H, S, D]

Replacement: ``O = tensorkiln.Attention(Q, K, V, mask?)``. The head split around it
(``Transpose(Reshape(X, [B, S, H, D]), [0, 2, 1, 3])`` for all of Q, K and V) and the head merge
after it (``Reshape(Transpose(O, [0, 2, 1, 3]), [B, S, H*Dv])``) are absorbed into the node's
``input_layout`` / ``output_layout`` attributes when the shapes prove them.

Every intermediate that disappears must have this match as its only reader; the scale factors must
be scalar constants; the softmax must run over the last axis; the mask must not change the shape of
the scores. ONNX Attention nodes (opset 23+) are left as they are.

The fused op gives zeros for a query row whose keys are all hidden, which is what the exporters'
IsNaN guard computes (without the guard the unfused graph gives NaN there), and a causal buffer
filled with float32's lowest value is read as -inf (the two differ only on such rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tensorkiln.ir import Graph, Node, TensorType, Value
from tensorkiln.ir.dims import dim_product
from tensorkiln.passes.pattern import Found, Op
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite
from tensorkiln.passes.rules import Rule, View, run_rules

_SWAP_LAST = (0, 1, 3, 2)
_HEADS = (0, 2, 1, 3)  # [B, S, H, D] <-> [B, H, S, D]


def _made_by(view: View, v: Value, op: str) -> Node | None:
    """The producer of ``v`` if it is the ONNX op ``op`` and ``v`` has no other reader."""
    p = view.made_by(v, op)
    return p if p is not None and view.single(v) is not None else None


@dataclass
class _Source:
    """A [B, H, S, D] operand, seen as ``Transpose(base, perm)`` (perm None: base itself)."""

    base: Value
    perm: tuple[int, ...] | None = None
    nodes: list[Node] = field(default_factory=list)  # peeled nodes, removed if the match uses base


@dataclass
class _Match:
    q: _Source
    k: _Source
    v: _Source
    scale: float
    mask: Value | None
    mask_kind: str
    softmax: Node
    out: Node  # the MatMul P @ V
    remove: list[Node] = field(default_factory=list)
    causal: bool = False


# ---------------------------------------------------------------- small checks


def _shape(v: Value | None) -> tuple | None:
    return None if v is None or v.shape is None else tuple(v.shape)


def _rank(v: Value) -> int | None:
    s = _shape(v)
    return None if s is None else len(s)


def _scalar(view: View, v: Value | None) -> float | None:
    """The value of a one-element floating-point constant, else None."""
    data = view.const(v)
    if (
        data is None
        or data.size != 1
        or data.ndim > 4
        or not np.issubdtype(data.dtype, np.floating)
    ):
        return None
    return float(data.reshape(-1)[0])


def _perm(node: Node) -> tuple[int, ...] | None:
    perm = node.attrs.get("perm")
    return None if perm is None else tuple(int(p) for p in perm)


def _then(first: tuple[int, ...] | None, second: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """perm of Transpose(Transpose(x, first), second) as one Transpose of x (None: identity)."""
    if first is None or second is None:
        return first if second is None else second
    p = tuple(first[i] for i in second)
    return None if p == tuple(range(len(p))) else p


# ---------------------------------------------------------------- the scores: Q K^T * scale


def _scaled(view: View, v: Value) -> tuple[Value, float, Node] | None:
    """``v = x * c`` or ``x / c`` with a scalar constant c that does not broadcast x up."""
    p = _made_by(view, v, "Mul") or _made_by(view, v, "Div")
    if p is None:
        return None
    a, b = p.inputs
    ca, cb = _scalar(view, a), _scalar(view, b)
    if cb is not None and _rank(a):
        x, c = a, (cb if p.op == "Mul" else 1.0 / cb if cb else None)
    elif p.op == "Mul" and ca is not None and _rank(b):
        x, c = b, ca
    else:
        return None
    if c is None or _shape(p.outputs[0]) != _shape(x):
        return None
    return x, c, p


def _peel(
    view: View, v: Value, perm: tuple[int, ...] | None, scaled: bool
) -> tuple[_Source, float]:
    """Walk up from an operand through transposes (and scalar scale factors when ``scaled``).

    The operand in [B, H, S, D] is ``Transpose(v, perm)``; the result says the same of the value
    reached, with the product of the factors passed.
    """
    nodes: list[Node] = []
    factor = 1.0
    while True:
        rtr = _reshape_round_trip(view, v)
        t = _made_by(view, v, "Transpose")
        step = _scaled(view, v) if scaled else None
        if rtr is not None:
            v, perm, nodes = rtr[0], _then(_SWAP_LAST, perm), nodes + rtr[1]
        elif t is not None and _perm(t) is not None and len(_perm(t)) == 4:
            v, perm, nodes = t.inputs[0], _then(_perm(t), perm), [*nodes, t]
        elif step is not None:
            v, factor, nodes = step[0], factor * step[1], [*nodes, step[2]]
        else:
            return _Source(v, perm, nodes), factor


def _scores(view: View, v: Value) -> tuple[_Source, _Source, float, list[Node]] | None:
    """(Q, K, scale, nodes) when ``v`` is (Q*a) @ (K^T*b) * c with scalar constants a, b, c."""
    removed: list[Node] = []
    factor = 1.0
    while (step := _scaled(view, v)) is not None:
        v, factor = step[0], factor * step[1]
        removed.append(step[2])
    mm = _made_by(view, v, "MatMul")
    if mm is None or _rank(mm.inputs[0]) != 4 or _rank(mm.inputs[1]) != 4:
        return None
    removed.append(mm)
    q, qa = _peel(view, mm.inputs[0], None, scaled=True)
    k, kb = _peel(view, mm.inputs[1], _SWAP_LAST, scaled=True)
    return q, k, factor * qa * kb, removed


def _softmax_input_ok(view: View, sm: Node) -> bool:
    """Softmax over the last axis (opset < 13: the flattened trailing axes, so the last one)."""
    rank = _rank(sm.inputs[0])
    if rank is None:
        return False
    default = -1 if view.graph.opset("") >= 13 else 1
    return int(sm.attrs.get("axis", default)) % rank == rank - 1


# ---------------------------------------------------------------- mask


def _split_mask(view: View, v: Value) -> list[tuple[Value, Value | None, Node | None]]:
    """The ways to read ``v`` as scores + mask: [(scores, mask, add)], or [(v, None, None)]."""
    add = _made_by(view, v, "Add")
    if add is None:
        return [(v, None, None)]
    found = []
    for i in (0, 1):
        s, m = add.inputs[i], add.inputs[1 - i]
        if _shape(s) is not None and _shape(s) == _shape(v) and _mask_ok(m, s):
            found.append((s, m, add))
    return found


def _causal(view: View, v: Value) -> tuple[Value, Node] | None:
    """``Where(tril, scores, fill)``: a constant lower-triangular [..., S, S] condition, fill -inf.

    fill may also be a huge negative number (<= -1e30, e.g. float32's lowest): a key it hides
    gets no weight either way, except in a row where every key is hidden.
    """
    w = _made_by(view, v, "Where")
    cond = None if w is None else view.const(w.inputs[0])
    fill = None if w is None else _scalar(view, w.inputs[2])
    if cond is None or fill is None or fill > -1e30 or cond.dtype != np.bool_ or cond.ndim < 2:
        return None
    sq, sk = cond.shape[-2:]
    if (
        sq != sk
        or cond.size != sq * sk
        or not np.array_equal(cond.reshape(sq, sk), np.tri(sq, dtype=bool))
    ):
        return None
    if _shape(w.inputs[1]) != _shape(v) or _shape(v) is None or tuple(_shape(v)[-2:]) != (sq, sk):
        return None
    return w.inputs[1], w


def _mask_ok(mask: Value, scores: Value) -> bool:
    shape = _shape(mask)
    return shape is not None and len(shape) <= 4 and mask.dtype == scores.dtype


def _as_bool_mask(view: View, mask: Value) -> tuple[Value, Node] | None:
    """``Where(cond, 0, -inf)`` read only here -> (cond, where) for a boolean mask."""
    w = _made_by(view, mask, "Where")
    if w is None or w.inputs[0].dtype is None or w.inputs[0].dtype.name != "BOOL":
        return None
    zero, neg = _scalar(view, w.inputs[1]), _scalar(view, w.inputs[2])
    if zero != 0.0 or neg != -np.inf or _shape(mask) != _shape(w.inputs[0]):
        return None
    return w.inputs[0], w


# ---------------------------------------------------------------- after the softmax


def _probs(view: View, sm: Node) -> tuple[Value, list[Node]] | None:
    """The softmax output, through an ``Where(IsNaN(P), 0, P)`` guard if there is one."""
    p = sm.outputs[0]
    readers = view.uses.get(p, [])
    if p in view.graph.outputs:
        return None
    if len(readers) == 1:
        return p, []
    if len(readers) != 2:
        return None
    isnan = next((n for n in readers if n.op == "IsNaN" and n.domain == ""), None)
    where = next((n for n in readers if n.op == "Where" and n.domain == ""), None)
    if isnan is None or where is None or view.single(isnan.outputs[0]) is not where:
        return None
    if where.inputs[0] is not isnan.outputs[0] or where.inputs[2] is not p:
        return None
    if _scalar(view, where.inputs[1]) != 0.0 or _shape(where.outputs[0]) != _shape(p):
        return None
    return where.outputs[0], [isnan, where]


# ---------------------------------------------------------------- operands


def _reshape_round_trip(view: View, kt: Value) -> tuple[Value, list[Node]] | None:
    """``Reshape(Transpose(Reshape(K, [B*H, S, D]), [0, 2, 1]), [B, H, D, S])``: (K, nodes)."""
    r2 = _made_by(view, kt, "Reshape")
    t = r2 and _made_by(view, r2.inputs[0], "Transpose")
    r1 = t and _perm(t) == (0, 2, 1) and _made_by(view, t.inputs[0], "Reshape")
    if not r1:
        return None
    k, flat = _shape(r1.inputs[0]), _shape(r1.outputs[0])
    if k is None or flat is None or len(k) != 4 or len(flat) != 3:
        return None
    if flat != (dim_product(k[:2]), k[2], k[3]) or _shape(kt) != (k[0], k[1], k[3], k[2]):
        return None
    return r1.inputs[0], [r2, t, r1]


def _packed(view: View, src: _Source) -> tuple[Value, int, list[Node]] | None:
    """(X, H, nodes) when the operand is ``Transpose(Reshape(X [B,S,H*D], [B,S,H,D]), [0,2,1,3])``."""
    if src.perm != _HEADS:
        return None
    nodes, base = list(src.nodes), src.base
    r = _made_by(view, base, "Reshape")
    if r is None:
        return None
    x, y = _shape(r.inputs[0]), _shape(base)
    if x is None or y is None or len(x) != 3 or len(y) != 4 or not isinstance(y[2], int):
        return None
    if x[:2] != y[:2] or x[2] != dim_product(y[2:]):
        return None
    return r.inputs[0], y[2], [*nodes, r]


# ---------------------------------------------------------------- the match


def _match(view: View, sm: Node) -> _Match | None:
    """Everything between Q, K, V (and the mask) and the P @ V MatMul, or None."""
    if not _softmax_input_ok(view, sm) or view.single(sm.inputs[0]) is not sm:
        return None
    probs = _probs(view, sm)
    pv = None if probs is None else view.single(probs[0])
    if pv is None or pv.op != "MatMul" or pv.domain != "" or pv.inputs[0] is not probs[0]:
        return None
    if _rank(pv.inputs[1]) != 4:
        return None
    for s, mask, add in _split_mask(view, sm.inputs[0]):
        causal = _causal(view, s)
        if causal is not None:
            s = causal[0]
        scores = _scores(view, s)
        if scores is None or not np.isfinite(scores[2]) or scores[2] == 0.0:
            continue
        q, k, scale, nodes = scores
        extra = [n for n in (add, causal and causal[1]) if n is not None]
        remove = [sm, *extra, *nodes, *probs[1], pv]
        kind = "" if mask is None else "additive"
        as_bool = None if mask is None else _as_bool_mask(view, mask)
        if as_bool is not None:
            mask, kind = as_bool[0], "bool"
            remove.append(as_bool[1])
        v = _peel(view, pv.inputs[1], None, scaled=False)[0]
        return _Match(q, k, v, scale, mask, kind, sm, pv, remove, causal is not None)
    return None


def _output_layout(view: View, out: Value, heads: int | None) -> tuple[str, Value, list[Node]]:
    """Absorb ``Reshape(Transpose(O, [0,2,1,3]), [B, S, H*Dv])`` after the op when proven."""
    v, nodes = out, []
    r0 = _reader(view, v, "Reshape")
    if r0 is not None and _shape(r0.outputs[0]) == _shape(v) and None not in (_shape(v) or (None,)):
        v, nodes = r0.outputs[0], [r0]
    t = _reader(view, v, "Transpose")
    if t is None or _perm(t) != _HEADS:
        return "bhsd", out, []
    v, nodes = t.outputs[0], [*nodes, t]
    r = _reader(view, v, "Reshape")
    y, z = _shape(v), r and _shape(r.outputs[0])
    if r is not None and _merges_heads(y, z) and (heads is None or y[2] == heads):
        return "bsd", r.outputs[0], [*nodes, r]
    return "bshd", v, nodes


def _merges_heads(y: tuple | None, z: tuple | None) -> bool:
    """Whether a Reshape from ``y`` [B, S, H, Dv] to ``z`` is [B, S, H*Dv]."""
    if y is None or z is None or len(y) != 4 or len(z) != 3:
        return False
    return z[:2] == y[:2] and z[2] == dim_product(y[2:])


def _reader(view: View, v: Value, op: str) -> Node | None:
    n = view.single(v)
    return n if n is not None and n.op == op and n.domain == "" and n.inputs[0] is v else None


# ---------------------------------------------------------------- the replacement


def _transpose(view: View, x: Value, perm: tuple[int, ...], name: str, rw: Rewrite) -> Value:
    shape = _shape(x)
    new_shape = None if shape is None else tuple(shape[p] for p in perm)
    out = Value(view.fresh_name(name), TensorType(x.dtype, new_shape))
    rw.add.append(Node("Transpose", [x], [out], {"perm": list(perm)}, name=out.name))
    return out


def _inputs(view: View, m: _Match, rw: Rewrite) -> tuple[list[Value], int]:
    """Q, K, V for the new node, and num_heads (0: they are [B, H, S, D])."""
    srcs = [m.q, m.k, m.v]
    packed = [_packed(view, s) for s in srcs]
    heads = {p[1] for p in packed if p is not None}
    if None not in packed and len(heads) == 1:
        for p in packed:
            rw.remove.extend(p[2])
        return [p[0] for p in packed], heads.pop()
    return [_as_bhsd(view, s, rw) for s in srcs], 0


def _as_bhsd(view: View, src: _Source, rw: Rewrite) -> Value:
    """The operand as one value: its base, the Transpose already there, or a new Transpose."""
    first = src.nodes[0] if len(src.nodes) == 1 else None
    if first is not None and first.op == "Transpose" and _perm(first) == src.perm:
        return first.outputs[0]  # the graph already has exactly this transpose: keep it
    rw.remove.extend(src.nodes)
    if src.perm is None:
        return src.base
    return _transpose(view, src.base, src.perm, f"{src.base.name}_bhsd", rw)


def _rewrite(view: View, m: _Match) -> Rewrite:
    rw = Rewrite(remove=list(m.remove), count=1)
    inputs, heads = _inputs(view, m, rw)
    layout, out, nodes = _output_layout(view, m.out.outputs[0], heads or None)
    rw.remove.extend(nodes)
    attrs = {
        "scale": m.scale,
        "causal": int(m.causal),
        "mask_kind": m.mask_kind,
        "num_heads": heads,
        "input_layout": "bsd" if heads else "bhsd",
        "output_layout": layout,
    }
    name = view.fresh_name(f"{m.softmax.name or m.out.name}_attention")
    node = Node(
        "Attention", [*inputs, m.mask] if m.mask else inputs, [out], attrs, "tensorkiln", name
    )
    rw.add.append(node)
    return rw


def _attention(view: View, found: Found) -> Rewrite | None:
    m = _match(view, found.root)
    return None if m is None else _rewrite(view, m)


RULES = (Rule("attention", Op("Softmax"), _attention),)


@register_pass("fuse_attention", level=3, order=70)
def fuse_attention(graph: Graph) -> int:
    """Fuse each scaled dot-product attention into one tensorkiln.Attention node."""
    return run_rules(graph, RULES)
