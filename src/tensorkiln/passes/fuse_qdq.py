"""Quantized layers: a convolution or GEMM whose operands come through DequantizeLinear becomes
``tensorkiln.QConvAct`` / ``QGemmAct``, which multiply the quantized values themselves (int8 or
float8) and apply both scales to the sum, as TensorRT fuses a DQ into the layer that reads it.

Matched: ``Conv`` / ``ConvAct`` / ``Gemm`` / ``GemmAct`` / ``MatMul`` whose data input is
``DequantizeLinear(X_q, scale)`` with one scale and no zero point (or a zero one: symmetric, as
TensorRT requires), and whose weight is ``DequantizeLinear(W_q, W_scale)`` of a constant, with one
scale or one per output channel (axis 0 of a convolution's weight, the output axis of a GEMM's).
Anything else (an asymmetric zero point, scales along another axis) stays as it is and runs in
float through its DequantizeLinear nodes: slower, never wrong. The DequantizeLinear nodes stay
for other readers and go with dead code.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.ir import DType, Graph, Node
from tensorkiln.passes.pattern import Found, Op
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rules import DOMAIN, Rule, View, run_rules

# element types of a quantized operand (uint8 needs a zero point of 128: not symmetric)
QUANTIZED = (DType.INT8, DType.FLOAT8E4M3FN)


def _symmetric(view: View, dq: Node, const_input: bool) -> bool:
    """A DequantizeLinear of an int8/float8 tensor (constant when ``const_input``) with a
    constant scale and no zero point or a zero one, to float32."""
    x, scale = dq.inputs[0], dq.inputs[1] if len(dq.inputs) > 1 else None
    if x is None or x.dtype not in QUANTIZED or (const_input and view.const(x) is None):
        return False
    if dq.attrs.get("block_size", 0) or view.const(scale) is None:
        return False
    zp = dq.inputs[2] if len(dq.inputs) > 2 else None
    if zp is not None:
        z = view.const(zp)
        if z is None or np.any(z.astype(np.float32) != 0):
            return False
    out = dq.outputs[0]
    return out is not None and out.dtype == DType.FLOAT


def _activation_dq(view: View, dq: Node) -> bool:
    scale = view.const(dq.inputs[1])
    return _symmetric(view, dq, const_input=False) and scale is not None and scale.size == 1


def _weight_dq(view: View, dq: Node) -> bool:
    return _symmetric(view, dq, const_input=True)


_X = Op("DequantizeLinear", name="xdq", where=_activation_dq, keep=True)
_W = Op("DequantizeLinear", name="wdq", where=_weight_dq, keep=True)
_CONV = (Op("Conv", [_X, _W], prefix=True), Op("ConvAct", [_X, _W], DOMAIN, prefix=True))
_GEMM = (
    Op("Gemm", [_X, _W], prefix=True),
    Op("GemmAct", [_X, _W], DOMAIN, prefix=True),
    Op("MatMul", [_X, _W]),
)


def _channel_scale(view: View, found: Found, out_axis: int) -> bool:
    """The weight's scale is one value, or one per output channel along ``out_axis`` of W."""
    wdq = found.node("wdq")
    scale = view.const(wdq.inputs[1])
    w = wdq.inputs[0]
    if scale is None or w is None or w.shape is None:
        return False
    if scale.size == 1:
        return True
    axis = wdq.attrs.get("axis", 1)
    rank = len(w.shape)
    return (
        scale.ndim == 1
        and -rank <= axis < rank
        and axis % rank == out_axis % rank
        and scale.size == w.shape[out_axis]
    )


def _conv_fits(view: View, found: Found) -> bool:
    return _channel_scale(view, found, 0)


def _gemm_fits(view: View, found: Found) -> bool:
    root = found.root
    w = found.node("wdq").inputs[0]
    if root.op == "MatMul":
        if w is None or w.shape is None or len(w.shape) != 2:
            return False  # (a batched weight: no GEMM of one B)
        return _channel_scale(view, found, 1)
    return _channel_scale(view, found, 0 if root.attrs.get("transB", 0) else 1)


def _quantized(view: View, found: Found, op: str) -> Node:
    root, xdq, wdq = found.root, found.node("xdq"), found.node("wdq")
    rest = list(root.inputs[2:])
    inputs = [xdq.inputs[0], xdq.inputs[1], wdq.inputs[0], wdq.inputs[1], *rest]
    while inputs and inputs[-1] is None:
        inputs.pop()
    return Node(op, inputs, [root.outputs[0]], dict(root.attrs), domain=DOMAIN, name=root.name)


RULES = (
    Rule("quantized_conv", _CONV, lambda v, f: _quantized(v, f, "QConvAct"), check=_conv_fits),
    Rule("quantized_gemm", _GEMM, lambda v, f: _quantized(v, f, "QGemmAct"), check=_gemm_fits),
)


# (the reference backend has the quantized kernels so far)
@register_pass("fuse_quantized", level=2, order=57, backends=("reference",))
def fuse_quantized(graph: Graph) -> int:
    """``Conv/Gemm/MatMul(DQ(X_q), DQ(W_q))`` -> tensorkiln.QConvAct / QGemmAct."""
    return run_rules(graph, RULES)
