"""Squeeze-and-excitation blocks become ``tensorkiln.SqueezeExcite``.

``Mul(X, ConvAct2(ConvAct1(ReduceMean(X, axes=[2, 3], keepdims=1) | GlobalAveragePool(X))))``,
with both ConvActs 1x1 convolutions of one group (no padding, strides or dilations, no residual),
is MobileNetV3's and EfficientNet's SE block after conv/activation fusion: six nodes of small
work each (four after fusion), which on the CPU cost more in dispatch than in arithmetic. The fused
node keeps the ConvActs' activations (``activation*`` of the first, ``gate*`` of the second) and
its kernels compose the nodes' own (kernels/reference/fused_se.py).

Only for the reference and cpu backends (see the registration). Checks: X is 4-D and floating point; every intermediate has no reader outside the match and is no
graph output; the gate has X's channel count (W2 is (C, S, 1, 1) for W1's (S, C, 1, 1)).
"""

from __future__ import annotations

from tensorkiln.ir import Graph, Node, Value
from tensorkiln.passes.manager import register_pass
from tensorkiln.passes.rewrite import Rewrite
from tensorkiln.passes.rules import (
    DOMAIN,
    Match,
    fused_rewrite,
    is_float,
    is_op,
    rank_of,
    reduce_axes,
    run_rules,
)

_KEYS = ("alpha", "beta", "min", "max")


def _pointwise_conv(m: Match, node: Node | None, channels_in: int | None) -> bool:
    """``node`` is a ConvAct that is a 1x1 convolution of one group over ``channels_in``
    channels, without padding, strides, dilations or residual."""
    if node is None or node.domain != DOMAIN or node.op != "ConvAct":
        return False
    if len(node.inputs) < 2 or (len(node.inputs) > 3 and node.inputs[3] is not None):
        return False
    w = node.inputs[1]
    if w is None or w.shape is None or len(w.shape) != 4 or tuple(w.shape[2:]) != (1, 1):
        return False
    if channels_in is None or w.shape[1] != channels_in:
        return False
    a = node.attrs
    return (
        a.get("group", 1) == 1
        and a.get("auto_pad", "NOTSET") in ("NOTSET", "VALID")
        and not any(a.get("pads") or [])
        and all(s == 1 for s in a.get("strides") or [1])
        and all(d == 1 for d in a.get("dilations") or [1])
    )


def _pooled_from(m: Match, v: Value | None) -> tuple[Value, Node] | None:
    """(X, pooling node) when ``v`` is X's spatial mean of a 4-D X, kept 4-D."""
    p = m.producers.get(v) if v is not None else None
    if p is None or not p.inputs or p.inputs[0] is None:
        return None
    x = p.inputs[0]
    if rank_of(x) != 4 or not is_float(x):
        return None
    if is_op(p, "GlobalAveragePool"):
        return x, p
    if is_op(p, "ReduceMean") and reduce_axes(m, p, 4) == (2, 3):
        return x, p
    return None


def _se(m: Match, mul: Node) -> Rewrite | None:
    if len(mul.inputs) != 2 or mul.outputs[0] is None:
        return None
    for x, g in (mul.inputs, mul.inputs[::-1]):
        found = _match(m, mul, x, g)
        if found is not None:
            return found
    return None


def _match(m: Match, mul: Node, x: Value | None, g: Value | None) -> Rewrite | None:
    excite = m.producers.get(g) if g is not None else None
    squeeze = m.producers.get(excite.inputs[0]) if excite is not None and excite.inputs else None
    if squeeze is None or x is None or x.shape is None:
        return None
    pooled = _pooled_from(m, squeeze.inputs[0])
    if pooled is None or pooled[0] is not x:
        return None
    pool = pooled[1]
    channels = x.shape[1] if isinstance(x.shape[1], int) else None
    if not _pointwise_conv(m, squeeze, channels):
        return None
    w1, w2 = squeeze.inputs[1], excite.inputs[1]
    if not _pointwise_conv(m, excite, w1.shape[0]) or w2.shape[0] != channels:
        return None
    chain = [pool, squeeze, excite]
    for node, reader in ((pool, squeeze), (squeeze, excite), (excite, mul)):
        if not m.only_read_by(node.outputs[0], [reader]) or len(node.outputs) != 1:
            return None
    b1 = squeeze.inputs[2] if len(squeeze.inputs) > 2 else None
    b2 = excite.inputs[2] if len(excite.inputs) > 2 else None
    attrs: dict = {
        "activation": squeeze.attrs.get("activation", ""),
        "gate": excite.attrs.get("activation", ""),
    }
    for key in _KEYS:
        for prefix, node in (("activation", squeeze), ("gate", excite)):
            value = node.attrs.get(f"activation_{key}")
            if value is not None:
                attrs[f"{prefix}_{key}"] = value
    fused = Node(
        "SqueezeExcite", [x, w1, b1, w2, b2], [mul.outputs[0]], attrs, domain=DOMAIN, name=mul.name
    )
    return fused_rewrite([*chain, mul], fused)


# (the cpu backend runs the fused op natively; on the cuda backend the composition measured no
# faster, EfficientNet-B0 slower, than the unfused layers with their tactics and fusions)
@register_pass("fuse_squeeze_excite", level=3, order=58, backends=("reference", "cpu"))
def fuse_squeeze_excite(graph: Graph) -> int:
    """``X * gate(FC(act(FC(mean(X)))))`` -> tensorkiln.SqueezeExcite."""
    return run_rules(graph, {("", "Mul"): _se})
