"""Squeeze-and-excitation blocks become ``tensorkiln.SqueezeExcite``.

``Mul(X, ConvAct2(ConvAct1(ReduceMean(X, axes=[2, 3], keepdims=1) | GlobalAveragePool(X))))``,
with both ConvActs 1x1 convolutions of one group (no padding, strides or dilations, no residual),
is MobileNetV3's and EfficientNet's SE block after conv/activation fusion: six nodes of small
work each (four after fusion), which on the CPU cost more in dispatch than in arithmetic. The fused
node keeps the ConvActs' activations (``activation*`` of the first, ``gate*`` of the second) and
its kernels compose the nodes' own (kernels/reference/fused_se.py).

Only for the reference and cpu backends (see the registration). Checks: X is 4-D and floating
point; every intermediate has no reader outside the match and is no graph output (the pattern
language's rule); the gate has X's channel count (W2 is (C, S, 1, 1) for W1's (S, C, 1, 1)).
"""

from __future__ import annotations

from tensorkiln.ir import Graph, Node
from tensorkiln.passes.pattern import Alt, Const, Found, Op, Var
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rules import DOMAIN, Rule, View, is_float, rank_of, reduce_axes, run_rules

_KEYS = ("alpha", "beta", "min", "max")
X = Var("x")


def _spatial_mean(view: View, node: Node) -> bool:
    """A ReduceMean over axes 2 and 3 of a 4-D tensor, dims kept."""
    return reduce_axes(view, node, 4) == (2, 3)


def _one_by_one(view: View, node: Node) -> bool:
    """A ConvAct that is a 1x1 convolution of one group, without padding, strides, dilations or
    residual (its channel counts are checked against X's in :func:`_channels_agree`)."""
    if (len(node.inputs) > 3 and node.inputs[3] is not None) or len(node.outputs) != 1:
        return False
    w = node.inputs[1]
    if w is None or w.shape is None or len(w.shape) != 4 or tuple(w.shape[2:]) != (1, 1):
        return False
    a = node.attrs
    return (
        a.get("group", 1) == 1
        and a.get("auto_pad", "NOTSET") in ("NOTSET", "VALID")
        and not any(a.get("pads") or [])
        and all(s == 1 for s in a.get("strides") or [1])
        and all(d == 1 for d in a.get("dilations") or [1])
    )


_POOL = Alt(
    Op("GlobalAveragePool", [X], name="pool"),
    Op("ReduceMean", [X], name="pool", where=_spatial_mean),
    Op("ReduceMean", [X, Const()], name="pool", where=_spatial_mean),
)
_SQUEEZE = Op("ConvAct", [_POOL, Var("w1")], DOMAIN, name="squeeze", where=_one_by_one, prefix=True)
_EXCITE = Op(
    "ConvAct", [_SQUEEZE, Var("w2")], DOMAIN, name="excite", where=_one_by_one, prefix=True
)
SE = Op("Mul", [X, _EXCITE], commutative=True)


def _channels_agree(view: View, found: Found) -> bool:
    """X is a 4-D float tensor of C channels, W1 is (S, C, 1, 1) and W2 is (C, S, 1, 1)."""
    x, w1, w2 = found.value("x"), found.value("w1"), found.value("w2")
    if rank_of(x) != 4 or not is_float(x) or found.root.outputs[0] is None:
        return False
    channels = x.shape[1] if isinstance(x.shape[1], int) else None
    return (
        channels is not None and w1.shape[1] == channels and w2.shape[:2] == (channels, w1.shape[0])
    )


def _squeeze_excite(view: View, found: Found) -> Node:
    squeeze, excite = found.node("squeeze"), found.node("excite")
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
    inputs = [found.value("x"), found.value("w1"), b1, found.value("w2"), b2]
    mul = found.root
    return Node("SqueezeExcite", inputs, [mul.outputs[0]], attrs, domain=DOMAIN, name=mul.name)


RULES = (Rule("squeeze_excite", SE, _squeeze_excite, check=_channels_agree),)


# (the cpu backend runs the fused op natively; on the cuda backend the composition measured no
# faster, EfficientNet-B0 slower, than the unfused layers with their tactics and fusions)
@register_pass("fuse_squeeze_excite", level=3, order=58, backends=("reference", "cpu"))
def fuse_squeeze_excite(graph: Graph) -> int:
    """``X * gate(FC(act(FC(mean(X)))))`` -> tensorkiln.SqueezeExcite."""
    return run_rules(graph, RULES)
