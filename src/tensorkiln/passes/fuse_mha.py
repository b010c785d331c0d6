"""batch_first_attention: nn.MultiheadAttention's exported layout shuffle -> views of one GEMM.

``torch.nn.MultiheadAttention(batch_first=True)`` (torchvision's ViT, and many more) computes in
sequence-first order, and its TorchScript export says so around the attention that fuse_attention
made (X: [N, S, E], E = H*D)::

    T  = Transpose(X, [1, 0, 2])                                   [S, N, E]
    P  = in-projection of T: GemmAct(T, W, b) or MatMul(T, W)      [S, N, 3E]
    Y  = Squeeze(Transpose(Unsqueeze(Reshape(P), [0]), [3, 1, 2, 0, 4]), [3])   [3, S, N, E]
    Qi = Reshape(Transpose(Reshape(Gather(Y, i)), [1, 0, 2]))      [N, H, S, D], i = 0, 1, 2
    O  = Attention(Q0, Q1, Q2 [, mask])                            [N, H, S, D] ("bhsd")
    R  = Reshape(Transpose(O, [2, 0, 1, 3]))                       [S*N, E]
    G  = out-projection of R: Gemm(R, W2, b2) / GemmAct / MatMul   [S*N, E]
    Z  = Transpose(Reshape(G), [1, 0, 2])                          [N, S, E]

The reshapes of transposed tensors are copies on a GPU (for ViT-B/16 at batch 128, five or six
38 MB copies per block), and the chain is about twenty layers per block at batch 1. In batch-first
order the same computation is the in-projection of X, a Split of its last axis into Q, K and V
(views), the attention on [N, S, E] with the heads split as views ("bsd"), and the
out-projection of its [N, S, E] output::

    Q, K, V = Split(in-projection of X, [E, E, E], axis=-1)
    Z       = out-projection of Attention(Q, K, V [, mask]; "bsd" -> "bsd", num_heads=H)

Every step is checked against the value types that shape inference gives (reshapes are row-major,
so their output shapes fix what they do), every intermediate must be read by the chain alone, the
three Gathers must take indices 0, 1 and 2 of one tensor, and the projections must be plain
(no activation, no transposed A). The mask, when there is one, is read as before: the attention's
[N, H, S, S] indexing does not change with the layout of Q, K and V.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.ir import Graph, Node, TensorType, Value
from tensorkiln.ir.dims import dim_product
from tensorkiln.passes.fuse_gemm import split_last
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite
from tensorkiln.passes.rules import DOMAIN, View

_SWAP01 = (1, 0, 2)


def _perm(node: Node | None, perm: tuple[int, ...]) -> bool:
    return node is not None and tuple(node.attrs.get("perm") or ()) == perm


def _shape(v: Value | None) -> tuple | None:
    return None if v is None or v.shape is None else tuple(v.shape)


def _ints(view: View, node: Node, attr: str, index: int) -> tuple[int, ...] | None:
    """An axes-like list: the attribute (older opsets) or the constant input ``index``."""
    if attr in node.attrs:
        return tuple(int(a) for a in node.attrs[attr])
    if len(node.inputs) > index:
        data = view.const(node.inputs[index])
        if data is not None:
            return tuple(int(a) for a in np.atleast_1d(data))
    return None


class _Chain:
    """The nodes one match removes, each checked to be read by the chain alone."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.nodes: list[Node] = []

    def back(self, v: Value | None, *ops: str, domain: str = "") -> Node | None:
        """The producer of ``v`` (one of ``ops``) when the chain is its only reader."""
        view = self.view
        p = view.producers.get(v) if v is not None else None
        if p is None or p.op not in ops or p.domain != domain or p in view.claimed:
            return None
        if view.single(v) is None:
            return None
        self.nodes.append(p)
        return p

    def forward(self, v: Value | None, op: str) -> Node | None:
        """The one reader of ``v`` when it is the ONNX op ``op`` (and ``v`` is no graph output)."""
        n = self.view.single(v, op)
        if n is not None:
            self.nodes.append(n)
        return n


def _projection(node: Node | None) -> bool:
    """A plain in/out-projection: MatMul, or a Gemm/GemmAct without activation or transposed A."""
    if node is None:
        return False
    if node.domain == "" and node.op == "MatMul":
        return True
    if (node.domain, node.op) not in (("", "Gemm"), (DOMAIN, "GemmAct")):
        return False
    return not node.attrs.get("transA", 0) and not node.attrs.get("activation")


def _head_input(chain: _Chain, q4: Value, sizes: tuple) -> tuple[Value, int] | None:
    """Q/K/V [N, H, S, D] back to (the [3, S, N, E] tensor it is gathered from, its index)."""
    n, h, s, d = sizes
    r2 = chain.back(q4, "Reshape")
    t = chain.back(r2.inputs[0], "Transpose") if r2 is not None else None
    if not _perm(t, _SWAP01):
        return None
    r1 = chain.back(t.inputs[0], "Reshape")
    g = chain.back(r1.inputs[0], "Gather") if r1 is not None else None
    if g is None or int(g.attrs.get("axis", 0)) != 0:
        return None
    if _shape(r1.outputs[0]) != (s, dim_product([n, h]), d) or _shape(g.outputs[0]) != (
        s,
        n,
        dim_product([h, d]),
    ):
        return None
    index = chain.view.const(g.inputs[1])
    if index is None or index.size != 1:
        return None
    return g.inputs[0], int(index.reshape(()))


def _packed_source(chain: _Chain, y: Value, sizes: tuple) -> Node | None:
    """The [3, S, N, E] tensor back to its in-projection over Transpose(X, [1, 0, 2])."""
    n, _, s, _ = sizes
    e = dim_product(sizes[1::2])
    view = chain.view
    sq = view.producers.get(y)
    if sq is None or sq.op != "Squeeze" or sq.domain != "" or y in view.outputs:
        return None
    if len(view.uses.get(y, [])) != 3 or _ints(view, sq, "axes", 1) != (3,):
        return None
    chain.nodes.append(sq)
    t = chain.back(sq.inputs[0], "Transpose")
    if not _perm(t, (3, 1, 2, 0, 4)):
        return None
    u = chain.back(t.inputs[0], "Unsqueeze")
    if u is None or _ints(view, u, "axes", 1) != (0,):
        return None
    r = chain.back(u.inputs[0], "Reshape")
    if r is None or _shape(r.outputs[0]) != (s, n, 3, e):
        return None
    proj = view.producers.get(r.inputs[0])
    if not _projection(proj) or _shape(proj.outputs[0]) != (s, n, dim_product([3, e])):
        return None
    if chain.back(r.inputs[0], proj.op, domain=proj.domain) is None:
        return None
    t0 = chain.back(proj.inputs[0], "Transpose")
    if not _perm(t0, _SWAP01) or _shape(t0.inputs[0]) != (n, s, e):
        return None
    return proj


def _out_projection(chain: _Chain, o: Value, sizes: tuple) -> tuple[Node, Value] | None:
    """The attention's [N, H, S, D] output forward to (its out-projection, the final [N, S, E])."""
    n, _, s, _ = sizes
    e = dim_product(sizes[1::2])
    t = chain.forward(o, "Transpose")
    if not _perm(t, (2, 0, 1, 3)):
        return None
    r = chain.forward(t.outputs[0], "Reshape")
    if r is None or _shape(r.outputs[0]) != (dim_product([s, n]), e):
        return None
    proj = chain.view.single(r.outputs[0])  # (its only reader: a projection, of any domain)
    if not _projection(proj) or proj.inputs[0] is not r.outputs[0] or proj in chain.view.claimed:
        return None
    chain.nodes.append(proj)
    if _shape(proj.outputs[0]) is None or _shape(proj.outputs[0])[0] != dim_product([s, n]):
        return None
    r2 = chain.forward(proj.outputs[0], "Reshape")
    if r2 is None or _shape(r2.outputs[0])[:2] != (s, n):
        return None
    t2 = chain.forward(r2.outputs[0], "Transpose")
    if not _perm(t2, _SWAP01):
        return None
    return proj, t2.outputs[0]


def _rewrite_one(graph: Graph, view: View, att: Node, rw: Rewrite) -> bool:
    a = att.attrs
    if a.get("input_layout", "bhsd") != "bhsd" or a.get("output_layout", "bhsd") != "bhsd":
        return False
    q4, k4, v4 = att.inputs[:3]
    sizes = _shape(q4)
    if sizes is None or len(sizes) != 4 or _shape(k4) != sizes or _shape(v4) != sizes:
        return False
    if not isinstance(sizes[1], int) or not isinstance(sizes[3], int):
        return False  # (the heads and their width must be known)
    chain = _Chain(view)
    heads = [_head_input(chain, x, sizes) for x in (q4, k4, v4)]
    if any(x is None for x in heads) or len({id(y) for y, _ in heads}) != 1:
        return False
    if [i for _, i in heads] != [0, 1, 2]:
        return False
    proj_in = _packed_source(chain, heads[0][0], sizes)
    out = _out_projection(chain, att.outputs[0], sizes) if proj_in is not None else None
    if out is None or any(n in view.claimed for n in chain.nodes):
        return False
    proj_out, final = out
    n, h, s, d = sizes
    e = h * d
    x = proj_in.inputs[0]
    x = view.producers[x].inputs[0]  # (under Transpose(X, [1, 0, 2]))
    dtype = x.dtype
    packed = Value(f"{att.name}_qkv", TensorType(dtype, (n, s, 3 * e)))
    in_node = Node(
        proj_in.op, [x, *proj_in.inputs[1:]], [packed], dict(proj_in.attrs), proj_in.domain,
        f"{proj_in.name}_batch_first",
    )  # fmt: skip
    qkv = [Value(f"{att.name}_{k}", TensorType(dtype, (n, s, e))) for k in "qkv"]
    split = split_last(graph, packed, [e, e, e], qkv, f"{att.name}_qkv")
    attended = Value(f"{att.name}_bsd", TensorType(att.outputs[0].dtype, (n, s, e)))
    attrs = {**a, "input_layout": "bsd", "output_layout": "bsd", "num_heads": h}
    new_att = Node("Attention", [*qkv, *att.inputs[3:]], [attended], attrs, DOMAIN, att.name)
    projected = final  # (the out-projection now gives the block's [N, S, E] output itself)
    if proj_out.op == "Gemm":  # (ONNX Gemm is 2-D: GemmAct takes the 3-D input)
        gemm_attrs = {k: v for k, v in proj_out.attrs.items() if k in ("alpha", "beta", "transB")}
        out_node = Node("GemmAct", [attended, *proj_out.inputs[1:]], [projected], gemm_attrs,
                        DOMAIN, proj_out.name)  # fmt: skip
    else:
        out_node = Node(proj_out.op, [attended, *proj_out.inputs[1:]], [projected],
                        dict(proj_out.attrs), proj_out.domain, proj_out.name)  # fmt: skip
    view.claimed.update(chain.nodes)
    view.claimed.add(att)
    rw.remove.extend([*chain.nodes, att])
    rw.add.extend([in_node, split, new_att, out_node])
    rw.count += 1
    return True


@register_pass("batch_first_attention", level=3, order=72)
def batch_first_attention(graph: Graph) -> int:
    """nn.MultiheadAttention(batch_first=True)'s sequence-first shuffle -> Split views + "bsd"."""
    view = View.of(graph)
    rw = Rewrite()
    for node in list(graph.nodes):
        if node.op == "Attention" and node.domain == DOMAIN and node not in view.claimed:
            _rewrite_one(graph, view, node, rw)
    n = rw.apply(graph)
    if n:
        graph.opsets.setdefault(DOMAIN, 1)
    return n
