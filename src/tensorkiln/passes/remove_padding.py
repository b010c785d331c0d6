"""remove_padding: run a masked encoder on its real tokens only (opt-in: it changes outputs).

A batch of BERT-style sequences carries a key-padding mask M [B, S]: the padded tokens are never
attended to, and everything between the attentions (projections, LayerNorms, activations,
residual adds) works on each token alone. Such a layer gives the real tokens the same values
whether the padded ones are there or not, so they can be left out: the tokens M keeps are packed
into [T, ...] rows once, every token-wise layer and every attention runs on T rows instead of
B * S, and the outputs are scattered back into [B, S, ...] with zeros at the padded positions
(TensorRT's variable-sequence-length BERT, Hugging Face's "unpadded" kernels). With 1/8 of the
tokens padding, the GEMMs do 1/8 less work.

What it takes, each checked (a graph that fails a check is left as it was, and the note says why):

* every tensorkiln.Attention node heads-packed (``bsd`` in and out), with a mask;
* the masks computed from one graph input M [B, S] (B and S: the attention's leading axes) and
  constants, and each a key-padding mask of M: evaluated on sample masks (the reference kernels,
  with the other inputs the masks depend on at zeros), key j of sequence b must be visible to
  every real query of b exactly when M[b, j] != 0 (Hugging Face's attention_mask), or exactly
  when M[b, j] == 0 (torch's key_padding_mask, True at a pad); additive masks: 0 visible, -1e4
  or less hidden; rows of padded queries are not looked at: they are dropped. A mask may also
  be causal and key-padding at once (GPT-2's: real query i sees exactly the real keys j <= i),
  and a causal attention may have a key-padding mask: the packed attention is causal then
  (within a sequence the packed rows keep their order). A causal model's rows that see no real
  key at all (left padding) are rows of padded queries: their outputs, which the original
  computes as some average of all the values, are zeros like every masked position's;
* between the packing and the unpacking, only token-wise layers: MatMul / Gemm / GemmAct of a
  [B, S, K] input by a constant 2-D weight (a bias of rank 1), LayerNorm over the last axis (a
  residual that is packed too), Split of the last axis, and elementwise ops whose other operands
  broadcast over the last axes only. Inside, the tokens may also be flattened to [B*S, ...] and
  back by Reshapes that keep each token's values (GPT-2's Conv1D GEMMs read them so); they
  enter and leave as [B, S, ...].

Layers that are not token-wise (the embeddings' position add, a pooler's Gather of token 0) stay
on the padded [B, S, ...] tensors; the packing sits where they meet the packed region. Those after
it see zeros at the masked positions: a pooler of a left-padded batch reads a zero first token. The packed
length is known only at run time; the engine plans its memory and tunes its tactics for B * S.
Mask values other than 0 and 1 are read as 1, as the sample masks checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tensorkiln.errors import GraphError
from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.ir.dims import dim_product, dim_value
from tensorkiln.ir.toposort import toposort
from tensorkiln.kernels.evaluate import evaluate_node, infer_shapes
from tensorkiln.ops import ELEMENTWISE, has_trait
from tensorkiln.passes.cleanup import dead_code

DOMAIN = "tensorkiln"
HIDDEN_AT = -1.0e4  # an additive mask value at or below this hides its key
_PROBE_BATCH = 4  # the sample masks' batch, where the batch axis is symbolic
_PROBE_SEQ = 16  # and their sequence length, where that axis is symbolic
_PROBE_BYTES = 256 << 20  # the most one layer of the masks' evaluation may produce

_PASSTHROUGH = {("", "Identity"), ("", "Cast"), ("", "Dropout")}
_OUT = ("bsd", "bshd")  # attention outputs taken: [B, S, H*Dv], or [B, S, H, Dv] that Reshapes read
_NORMS = {(DOMAIN, "LayerNorm"), ("", "LayerNormalization")}


class _Skip(Exception):
    """The graph does not qualify; the message says why."""


def remove_padding(graph: Graph) -> tuple[int, str]:
    """Pack the masked tokens of ``graph`` (in place) where it qualifies. Returns the number of
    layers that now run on packed tokens (0: the graph is unchanged) and a note for the build
    report. Raises GraphError when the rewritten graph's shapes do not check out (the graph is
    then changed: rewrite a copy)."""
    try:
        return _remove_padding(graph)
    except _Skip as why:
        return 0, f"padding not removed: {why}"


def _remove_padding(graph: Graph) -> tuple[int, str]:
    attentions = [n for n in graph.nodes if n.domain == DOMAIN and n.op == "Attention"]
    if not attentions:
        raise _Skip("the graph has no fused attention layer")
    producers = graph.producers()
    consumers = graph.consumers()
    for n in attentions:
        _check_attention(n)
    q = attentions[0].inputs[0]
    lead = tuple(q.shape[:2]) if q is not None and q.shape is not None else None
    if lead is None or any(n.inputs[0].shape is None for n in attentions):
        raise _Skip("the attention inputs' shapes are not known")
    if any(tuple(n.inputs[0].shape[:2]) != lead for n in attentions):
        raise _Skip("the attention layers do not share one [batch, sequence]")
    masks = list(dict.fromkeys(n.inputs[3] for n in attentions))
    users = {n.inputs[3]: n for n in attentions}
    nodes = _ancestors(masks, producers)
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    nodes.sort(key=lambda n: order.get(id(n), -1))
    reasons, passed = [], []
    for m in _mask_inputs(graph, masks, nodes, lead):
        try:
            samples = _mask_samples(graph, masks, m, nodes)
        except _Skip as why:
            reasons.append(str(why))
            continue
        for padding in (0, 1):  # nonzero marks a token (Hugging Face) or a pad (torch's MHA)
            forms: dict[Value, str] = {}  # mask -> "padding" or "causal", the same every sample
            try:
                for sample, values in samples:
                    keep = (sample != 0) != bool(padding)
                    for mask in masks:
                        value = np.asarray(values[mask])
                        forms[mask] = _compare(value, keep, users[mask], forms.get(mask))
            except _Skip as why:
                reasons.append(str(why))
            else:
                passed.append((m, padding, forms))
    if len(passed) != 1:
        raise _Skip(reasons[0] if not passed and reasons else (
            f"the attention masks do not come from exactly one integer or bool input of shape "
            f"{list(lead)} (found: {', '.join(v.name for v, *_ in passed) or 'none'})"
        ))  # fmt: skip
    m, padding, forms = passed[0]
    causal = {
        id(n)
        for n in attentions
        if int(n.attrs.get("causal", 0) or 0) or forms.get(n.inputs[3]) == "causal"
    }

    region = _region(attentions, lead, producers, consumers)
    _check_edges(graph, region, lead, consumers)
    ranks = _packed_ranks(region, lead)
    count = _rewrite(graph, region, lead, m, padding, consumers, causal)
    graph.nodes = toposort(graph)
    dead_code(graph)  # (the masks the attentions no longer read)
    infer_shapes(graph)
    for n in region:  # every packed tensor has one token axis where it had one or two
        for v in n.outputs:
            if v is not None and (v.shape is None or len(v.shape) != ranks[id(v)]):
                raise GraphError(
                    f"padding removal: layer '{n.name}' ({n.op}) gives {v.type} on packed tokens"
                )
    return count, (
        f"padding removed: {count} layers run on the tokens that '{m.name}' keeps; the outputs "
        "are zeros at the masked positions"
    )


# ---------------------------------------------------------------- checks


def _check_attention(n: Node) -> None:
    a = n.attrs
    if a.get("input_layout", "bhsd") != "bsd" or a.get("output_layout", "bhsd") not in _OUT:
        raise _Skip(f"attention '{n.name}' does not take and give [batch, sequence, heads*width]")
    if len(n.inputs) < 4 or n.inputs[3] is None:
        raise _Skip(f"attention '{n.name}' has no mask: nothing is padding")
    if a.get("q_dtype"):  # (PackedAttention writes float only)
        raise _Skip(f"attention '{n.name}' writes its output quantized")


def _ancestors(values: Iterable[Value], producers: dict[Value, Node]) -> list[Node]:
    """The nodes ``values`` depend on; a Shape node's input only through its type (the masks'
    evaluation takes shapes from the types, see _shape_of)."""
    seen: set[int] = set()
    out: list[Node] = []
    stack = [v for v in values if v is not None]
    while stack:
        p = producers.get(stack.pop())
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        out.append(p)
        if _reads_shape_only(p):
            continue
        stack.extend(v for v in p.inputs if v is not None)
        for g in p.subgraphs():
            stack.extend(g.outer_refs())
    return out


def _reads_shape_only(n: Node) -> bool:
    return n.op == "Shape" and n.domain == "" and bool(n.inputs) and n.inputs[0] is not None


def _shape_of(v: Value, sizes: Mapping[str, int]) -> tuple[int, ...] | None:
    """``v``'s shape with the sample masks' sizes put in (None where a dim stays unknown)."""
    if v.shape is None:
        return None
    dims = [dim_value(d, sizes) for d in v.shape]
    return None if None in dims else tuple(dims)  # type: ignore[return-value]


def _mask_inputs(graph: Graph, masks: list[Value], nodes: list[Node], lead: tuple) -> list[Value]:
    """The graph inputs [B, S] of integers or bools the masks depend on through ``nodes`` (the
    candidates for M)."""
    read = {id(v) for n in nodes for v in n.inputs if v is not None} | {id(v) for v in masks}
    return [
        v
        for v in graph.inputs
        if id(v) in read and v.shape is not None and tuple(v.shape) == lead
        and v.dtype is not None and not v.dtype.is_float
    ]  # fmt: skip


def _sample_masks(b: int, s: int) -> list[np.ndarray]:
    """Right-padded rows of every length, an empty row, a full one, and scattered holes. With one
    row (a batch-1 engine) the row is half padded, then holed, then full: every sample without a
    zero would pass for either reading of the mask (a 1 marking a token or a pad)."""
    rng = np.random.default_rng(0)
    right = np.zeros((b, s), np.int64)
    for i in range(b):
        right[i, : (i * s) // max(b - 1, 1)] = 1
    holes = (rng.random((b, s)) < 0.6).astype(np.int64)
    if b > 1:
        right[-1] = 1
        holes[0] = 1
        return [right, holes]
    right[0, : max(1, s // 2)] = 1
    holes[0, 0], holes[0, -1] = 1, 0
    return [right, holes, np.ones((b, s), np.int64)]


def _mask_samples(
    graph: Graph, masks: list[Value], m: Value, nodes: list[Node]
) -> list[tuple[np.ndarray, dict[Value, Any]]]:
    """The masks evaluated (``nodes``, the layers they depend on, in graph order) on sample values
    of ``m``, the other inputs they read at zeros: (sample, mask -> value) per sample. Each mask
    must then hide exactly the keys M marks as padding from every real query (see the module's
    docstring and _compare)."""
    read = {id(v) for n in nodes for v in n.inputs if v is not None}
    inputs = [v for v in graph.inputs if id(v) in read or any(v is x for x in masks)]
    b, s = m.shape
    sizes = {}
    if isinstance(b, str):
        sizes[b] = _PROBE_BATCH
    if isinstance(s, str):
        sizes[s] = _PROBE_SEQ
    shapes = {}
    for v in inputs:
        shapes[v] = _shape_of(v, sizes)
        if shapes[v] is None:
            raise _Skip(f"input '{v.name}' has a shape the sample masks cannot fix ({v.type})")
    out = []
    for sample in _sample_masks(*shapes[m]):
        env: dict[Value, Any] = {}
        for v in inputs:
            dtype = v.dtype.numpy if v.dtype is not None else np.float32
            env[v] = (sample != 0).astype(dtype) if v is m else np.zeros(shapes[v], dtype)
        for n in nodes:  # (the reference kernels, as constant folding runs them)
            args = _args(n, env)
            if _reads_shape_only(n) and args[0] is None:  # (a stand-in of its shape, no data)
                shape = _shape_of(n.inputs[0], sizes)
                if shape is not None:
                    args[0] = np.broadcast_to(np.zeros((), np.float32), shape)
            outs = None
            if not any(a is None for v, a in zip(n.inputs, args, strict=True) if v is not None):
                outs = _evaluate(graph, n, args)
            if outs is None:
                raise _Skip(f"the masks cannot be evaluated to check them (at layer '{n.name}')")
            env.update((v, o) for v, o in zip(n.outputs, outs, strict=False) if v is not None)
        out.append((sample, {mask: env[mask] for mask in masks}))
    return out


def _args(n: Node, env: Mapping[Value, Any]) -> list:
    """``n``'s inputs: constants, values computed in ``env``, None where neither."""
    return [None if v is None else v.const if v.const is not None else env.get(v) for v in n.inputs]


def _evaluate(graph: Graph, n: Node, args: list) -> list | None:
    """``n``'s outputs by the reference kernels; a Pointwise layer (a fused elementwise chain:
    the dynamo exporter's masks have them) by its body's, node by node."""
    body = n.attrs.get("body") if (n.domain, n.op) == (DOMAIN, "Pointwise") else None
    if not isinstance(body, Graph):
        return evaluate_node(graph, n, args, max_bytes=_PROBE_BYTES)
    if body.outer_refs() or len(body.inputs) != len(args):
        return None
    env: dict[Value, Any] = dict(zip(body.inputs, args, strict=True))
    for b in body.nodes:
        outs = evaluate_node(graph, b, _args(b, env), max_bytes=_PROBE_BYTES)
        if outs is None:
            return None
        env.update((v, o) for v, o in zip(b.outputs, outs, strict=False) if v is not None)
    return [env.get(v) for v in body.outputs]


def _compare(value: np.ndarray, keep: np.ndarray, node: Node, form: str | None = None) -> str:
    """Which form of key-padding mask of ``keep`` the mask ``value`` is: "padding" (every real
    query sees exactly the real keys) or "causal" (real query i sees exactly the real keys
    j <= i); only ``form`` where one is given (what the other samples showed)."""
    b, s = keep.shape
    kind = node.attrs.get("mask_kind", "")
    try:
        full = np.broadcast_to(value, (b, value.shape[-3] if value.ndim >= 3 else 1, s, s))
    except ValueError:
        raise _Skip(f"attention '{node.name}''s mask does not broadcast to [B, H, S, S]") from None
    if kind == "bool":
        visible, hidden = full.astype(bool), ~full.astype(bool)
    elif kind == "additive":
        visible, hidden = full == 0, full <= HIDDEN_AT
    else:
        raise _Skip(f"attention '{node.name}' has a mask of kind '{kind}'")
    rows = keep[:, None, :, None]  # real queries only
    keys = np.broadcast_to(keep[:, None, None, :], full.shape)
    for f in (form,) if form else ("padding", "causal"):
        want = keys if f == "padding" else keys & np.tri(s, dtype=bool)[None, None]
        if np.all(np.where(want, visible, hidden) | ~rows):
            return f
    raise _Skip(
        f"attention '{node.name}''s mask is not a key-padding mask of the input, causal or not: "
        "it hides other keys than the input's zeros (a sliding-window mask, a bias)"
    )


# ---------------------------------------------------------------- the region


def _axes(v: Value | None, lead: tuple) -> int:
    """How many leading axes of ``v`` hold its tokens: 2 for [B, S, ...] (rank 3 or more), 1 for
    the tokens flattened, [B*S, ...] (rank 2 or more: GPT-2's GEMMs read them so), else 0."""
    if v is None or v.shape is None:
        return 0
    if len(v.shape) >= 3 and tuple(v.shape[:2]) == lead:
        return 2
    if len(v.shape) >= 2 and dim_product([v.shape[0]]) == dim_product(lead):
        return 1
    return 0


def _token(v: Value | None, lead: tuple) -> bool:
    """Whether ``v`` holds one row per token, [B, S, ...] or [B*S, ...]."""
    return _axes(v, lead) > 0


def _small(v: Value | None, trailing: int) -> bool:
    """A non-token operand that broadcasts over the last ``trailing`` axes only."""
    return v is None or (v.shape is not None and len(v.shape) <= trailing)


def _trailing(v: Value, lead: tuple) -> list:
    """A token value's per-token dims."""
    return list(v.shape[_axes(v, lead) :])


def _weight(v: Value | None) -> bool:
    return v is not None and v.const is not None and v.const.ndim == 2


def _last_axis(axis: int, rank: int) -> bool:
    return axis in (-1, rank - 1)


def _tokenwise(n: Node, lead: tuple) -> bool:
    """Whether ``n`` computes each token's outputs from that token's inputs alone."""
    key = (n.domain, n.op)
    if not n.outputs or not all(_token(v, lead) for v in n.outputs if v is not None):
        return False
    x = n.inputs[0] if n.inputs else None
    a = n.attrs
    trailing = len(_trailing(n.outputs[0], lead)) if n.outputs[0] is not None else 0
    if key == (DOMAIN, "Attention"):
        return all(_axes(v, lead) == 2 for v in (*n.inputs[:3], n.outputs[0]))
    if key == (DOMAIN, "Pointwise") and not _body_small(n, trailing):
        return False
    if (
        key in _PASSTHROUGH
        or key == (DOMAIN, "Pointwise")
        or has_trait(n.op, n.domain, ELEMENTWISE)
    ):
        operands = [v for v in n.inputs if v is not None]
        if key == ("", "Dropout"):
            operands = operands[:1]
        tokens = [v for v in operands if _token(v, lead)]
        if not tokens:
            return False
        return all(v.shape == n.outputs[0].shape for v in tokens) and all(
            _token(v, lead) or _small(v, trailing) for v in operands
        )
    if not _token(x, lead):
        return False
    rank = len(x.shape)
    if key == ("", "Reshape"):  # between the two token forms, each token's values kept
        dims = _trailing(x, lead) + _trailing(n.outputs[0], lead)
        if not all(isinstance(d, int) for d in dims) or len(n.inputs) < 2:
            return False
        return math.prod(_trailing(x, lead)) == math.prod(_trailing(n.outputs[0], lead))
    if key == ("", "MatMul"):
        return len(n.inputs) == 2 and _weight(n.inputs[1])
    if key in ((DOMAIN, "GemmAct"), ("", "Gemm")):
        plain = not int(a.get("transA", 0) or 0) and float(a.get("alpha", 1.0)) == 1.0
        plain = plain and float(a.get("beta", 1.0)) == 1.0
        bias = n.inputs[2] if len(n.inputs) > 2 else None
        z = n.inputs[3] if len(n.inputs) > 3 else None  # (a residual: one row per token too)
        if z is not None and not (_token(z, lead) and z.shape == n.outputs[0].shape):
            return False
        return plain and len(n.inputs) <= 4 and _weight(n.inputs[1]) and _vector(bias)
    if key in _NORMS:
        residual = n.inputs[3] if len(n.inputs) > 3 else None
        y_scale = n.inputs[4] if len(n.inputs) > 4 else None  # (per tensor: one value)
        return (
            _last_axis(int(a.get("axis", -1)), rank)
            and all(_vector(v) for v in n.inputs[1:3])
            and (residual is None or (_token(residual, lead) and residual.shape == x.shape))
            and (y_scale is None or (y_scale.const is not None and y_scale.const.size == 1))
        )
    if key == ("", "Split"):
        return _last_axis(int(a.get("axis", 0)), rank)
    return False


def _body_small(n: Node, trailing: int) -> bool:
    """A Pointwise body whose own constants broadcast over the last ``trailing`` axes only (a
    [1, 1, E] constant inside would give packed [T, E] operands a leading axis back)."""
    body = n.attrs.get("body")
    if not isinstance(body, Graph) or body.outer_refs():
        return False
    consts = [v.const for v in body.initializers if v.const is not None]
    consts += [a for b in body.nodes for a in b.attrs.values() if isinstance(a, np.ndarray)]
    return all(c.ndim <= trailing for c in consts)


def _vector(v: Value | None) -> bool:
    """Absent, or a tensor of rank 0 or 1 (a bias, a LayerNorm's scale)."""
    return v is None or (v.shape is not None and len(v.shape) <= 1)


def _region(
    attentions: list[Node],
    lead: tuple,
    producers: dict[Value, Node],
    consumers: dict[Value, list[Node]],
) -> list[Node]:
    """The token-wise layers connected to the attentions through [B, S, ...] tensors."""
    for n in attentions:
        if not _tokenwise(n, lead):
            raise _Skip(f"attention '{n.name}''s inputs are not [batch, sequence, ...] tensors")
    region: dict[int, Node] = {id(n): n for n in attentions}
    stack = list(attentions)
    while stack:
        n = stack.pop()
        near = []
        for v in _data_inputs(n):
            if _token(v, lead) and v in producers:
                near.append(producers[v])
        for v in n.outputs:
            if v is not None:
                near.extend(consumers.get(v, ()))
        for p in near:
            if id(p) not in region and _tokenwise(p, lead):
                region[id(p)] = p
                stack.append(p)
    return list(region.values())


def _check_edges(
    graph: Graph, region: list[Node], lead: tuple, consumers: dict[Value, list[Node]]
) -> None:
    """Tokens enter and leave the region as [B, S, ...] (packed and unpacked there), never
    flattened; an attention's [B, S, H, Dv] output is read by the region's Reshapes alone."""
    inside = {id(n) for n in region}
    made = {id(v) for n in region for v in n.outputs if v is not None}
    outputs = {id(v) for v in graph.outputs}
    for n in region:
        for v in _data_inputs(n):
            if _token(v, lead) and id(v) not in made and _axes(v, lead) != 2:
                raise _Skip(f"'{v.name}' enters the token-wise layers as [batch*sequence, ...]")
        for v in n.outputs:
            if v is None:
                continue
            leaves = id(v) in outputs or any(id(c) not in inside for c in consumers.get(v, ()))
            if leaves and _axes(v, lead) != 2:
                raise _Skip(f"'{v.name}' leaves the token-wise layers as [batch*sequence, ...]")
        if (n.domain, n.op) == (DOMAIN, "Attention") and n.attrs.get("output_layout") == "bshd":
            readers = consumers.get(n.outputs[0], [])
            if id(n.outputs[0]) in outputs or not all(
                id(c) in inside and (c.domain, c.op) == ("", "Reshape") for c in readers
            ):
                raise _Skip(
                    f"attention '{n.name}''s [B, S, H, D] output is read other than reshaped"
                )


def _packed_ranks(region: list[Node], lead: tuple) -> dict[int, int]:
    """The rank each region output has once packed: its per-token axes and the tokens' one (an
    attention that gave [B, S, H, Dv] gives [T, H*Dv])."""
    ranks = {}
    for n in region:
        for v in n.outputs:
            if v is not None:
                ranks[id(v)] = 1 + len(_trailing(v, lead))
        if (n.domain, n.op) == (DOMAIN, "Attention"):
            ranks[id(n.outputs[0])] = 2
    return ranks


def _data_inputs(n: Node) -> list[Value]:
    """The inputs that carry tokens (an attention's mask does not)."""
    ins = n.inputs[:3] if (n.domain, n.op) == (DOMAIN, "Attention") else n.inputs
    return [v for v in ins if v is not None]


# ---------------------------------------------------------------- the rewrite


def _rewrite(
    graph: Graph,
    region: list[Node],
    lead: tuple,
    m: Value,
    padding: int,
    consumers: dict[Value, list[Node]],
    causal: set[int],
) -> int:
    inside = {id(n) for n in region}
    made = {id(v) for n in region for v in n.outputs if v is not None}
    index = Value(f"{m.name}_pack_index")
    ends = Value(f"{m.name}_pack_ends")
    added = [
        Node(
            "PackIndex",
            [m],
            [index, ends],
            attrs={"padding": padding},
            domain=DOMAIN,
            name=f"{m.name}_pack_index",
        )
    ]
    packed: dict[int, Value] = {}

    def pack(v: Value) -> Value:
        p = packed.get(id(v))
        if p is None and _axes(v, lead) != 2:
            raise _Skip(
                f"'{v.name}' enters the token-wise layers flattened to [batch*sequence, ...]"
            )
        if p is None:
            p = packed[id(v)] = Value(f"{v.name}_packed")
            added.append(Node("PackTokens", [v, index], [p], domain=DOMAIN, name=f"{v.name}_pack"))
        return p

    for n in region:  # (positive axes count the batch and sequence axes, one axis now)
        if (
            "axis" in n.attrs
            and int(n.attrs["axis"]) >= 0
            and (n.domain, n.op) != (DOMAIN, "Attention")
        ):
            n.attrs["axis"] = int(n.attrs["axis"]) - (_axes(_data_inputs(n)[0], lead) - 1)
    for n in region:  # Reshapes between the token forms: each token's dims, after its row
        if (n.domain, n.op) == ("", "Reshape"):
            target = np.array([-1, *_trailing(n.outputs[0], lead)], np.int64)
            shape = Value(f"{n.name}_packed_shape", TensorType(DType.INT64, target.shape))
            shape.const = target
            graph.initializers.append(shape)
            n.inputs = [n.inputs[0], shape]
            n.attrs = {}
    for n in region:
        data = {id(v) for v in _data_inputs(n)}
        n.inputs = [
            pack(v) if v is not None and id(v) in data and _token(v, lead) and id(v) not in made
            else v
            for v in n.inputs
        ]  # fmt: skip
    outputs = {id(v) for v in graph.outputs}
    for n in region:
        for v in n.outputs:
            if v is None:
                continue
            outside = [c for c in consumers.get(v, ()) if id(c) not in inside]
            if not outside and id(v) not in outputs:
                continue
            full = Value(v.name, v.type)
            v.name = f"{v.name}_packed"
            added.append(
                Node(
                    "UnpackTokens", [v, index, m], [full], domain=DOMAIN, name=f"{full.name}_unpack"
                )
            )
            for c in outside:
                c.inputs = [full if x is v else x for x in c.inputs]
            graph.outputs = [full if x is v else x for x in graph.outputs]
    for n in region:
        if (n.domain, n.op) == (DOMAIN, "Attention"):
            n.op = "PackedAttention"
            n.inputs = [*n.inputs[:3], ends, m]
            n.attrs = {
                "scale": float(n.attrs.get("scale", 0.0) or 0.0),
                "num_heads": int(n.attrs.get("num_heads", 0)),
                "causal": int(id(n) in causal),
            }
        for v in n.outputs:
            if v is not None and isinstance(v.type, TensorType):
                v.type = TensorType(v.type.dtype, None)  # (inferred again for [T, ...])
    graph.nodes = graph.nodes + added
    return len(region)
