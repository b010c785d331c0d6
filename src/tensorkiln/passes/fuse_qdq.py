"""Quantized layers: a convolution or GEMM whose operands come through DequantizeLinear becomes
``tensorkiln.QConvAct`` / ``QGemmAct``, which multiply the quantized values themselves (int8 or
float8) and apply both scales to the sum, as TensorRT fuses a DQ into the layer that reads it.

Matched: ``Conv`` / ``ConvAct`` / ``Gemm`` / ``GemmAct`` / ``MatMul`` whose data input is
``DequantizeLinear(X_q, scale)`` with one scale and no zero point (or a zero one: symmetric, as
TensorRT requires), and whose weight is ``DequantizeLinear(W_q, W_scale)`` of a constant, with one
scale or one per output channel (axis 0 of a convolution's weight, the output axis of a GEMM's).
Anything else (an asymmetric zero point, scales along another axis) stays as it is and runs in
float through its DequantizeLinear nodes: slower, never wrong. The DequantizeLinear nodes stay
for other readers and go with dead code. A bias read through DequantizeLinear (an int32 one, as
onnxruntime's quantizer writes) folds to a float constant afterwards, like any constant.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.kernels.common.stem import fuses_pool, takes_image
from tensorkiln.kernels.reference.quant import quantize_linear
from tensorkiln.kernels.registry import lookup, node_kwargs
from tensorkiln.passes.pattern import Found, Op
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite, add_constant
from tensorkiln.passes.rules import DOMAIN, Rule, View, run_rules

# element types of a quantized operand (uint8 needs a zero point of 128: not symmetric)
QUANTIZED = (DType.INT8, DType.FLOAT8E4M3FN)


def _zero_point(view: View, node: Node) -> bool:
    """``node`` (a QuantizeLinear or DequantizeLinear) has no zero point, or a constant zero."""
    zp = node.inputs[2] if len(node.inputs) > 2 else None
    if zp is None:
        return True
    z = view.const(zp)
    return z is not None and not np.any(z.astype(np.float32))


def _symmetric(view: View, dq: Node, const_input: bool) -> bool:
    """A DequantizeLinear of an int8/float8 tensor (constant when ``const_input``, or quantized
    from a constant) with a constant scale and no zero point or a zero one, to float32."""
    x, scale = dq.inputs[0], dq.inputs[1] if len(dq.inputs) > 1 else None
    if x is None or x.dtype not in QUANTIZED:
        return False
    if const_input and view.const(x) is None and _quantized_constant(view, x) is None:
        return False
    if dq.attrs.get("block_size", 0) or view.const(scale) is None or not _zero_point(view, dq):
        return False
    out = dq.outputs[0]
    return out is not None and out.dtype == DType.FLOAT


def _quantized_constant(view: View, v: Value) -> Node | None:
    """The QuantizeLinear of a constant that makes ``v`` (weights as NVIDIA's quantization tools
    export them: float32 -> QuantizeLinear -> DequantizeLinear), if it is one."""
    q = view.made_by(v, "QuantizeLinear")
    if q is None or any(x is not None and view.const(x) is None for x in q.inputs):
        return None
    return q


def _weight_data(view: View, v: Value) -> Value:
    """``v``, or a new constant of its value when a QuantizeLinear of constants makes it (run
    with the reference kernel, so the weight is what the model's own nodes compute)."""
    if view.const(v) is not None:
        return v
    q = _quantized_constant(view, v)
    args = [None if x is None else view.const(x) for x in q.inputs]
    kwargs = node_kwargs(lookup("QuantizeLinear", "", view.graph.opset()), q.attrs, 1)
    data = np.ascontiguousarray(quantize_linear(*args, **kwargs))
    return add_constant(view.graph, view.fresh_name(f"{v.name}_constant"), data)


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
    if len(root.inputs) > 3:
        return False  # (a GemmAct's residual Z: QGemmAct has no such input)
    w = found.node("wdq").inputs[0]
    if root.op == "MatMul":
        if w is None or w.shape is None or len(w.shape) != 2:
            return False  # (a batched weight: no GEMM of one B)
        return _channel_scale(view, found, 1)
    return _channel_scale(view, found, 0 if root.attrs.get("transB", 0) else 1)


def _quantized(view: View, found: Found, op: str) -> Node:
    root, xdq, wdq = found.root, found.node("xdq"), found.node("wdq")
    rest = list(root.inputs[2:])
    w = _weight_data(view, wdq.inputs[0])
    attrs = dict(root.attrs) | {"out_dtype": DType.FLOAT.value}  # (narrowed with the engine)
    if op == "QGemmAct" and not attrs.get("transB", 0):
        w = _packed(view, w)
        attrs["transB"] = 1
    inputs = [xdq.inputs[0], xdq.inputs[1], w, wdq.inputs[1], *rest]
    while inputs and inputs[-1] is None:
        inputs.pop()
    return Node(op, inputs, [root.outputs[0]], attrs, domain=DOMAIN, name=root.name)


def _packed(view: View, w: Value) -> Value:
    """A (K, N) weight as its (N, K) transpose: each output column's K values contiguous, the
    column-major B that integer and FP8 tensor-core GEMMs read at full speed (torch._int_mm
    measured 957 TOP/s on an H200 with it, 127 with a row-major B)."""
    data = np.ascontiguousarray(view.const(w).T)
    return add_constant(view.graph, view.fresh_name(f"{w.name}_packed"), data)


RULES = (
    Rule("quantized_conv", _CONV, lambda v, f: _quantized(v, f, "QConvAct"), check=_conv_fits),
    Rule("quantized_gemm", _GEMM, lambda v, f: _quantized(v, f, "QGemmAct"), check=_gemm_fits),
)


# ------------------------------------------------------------------- DQ through data movement
#
# Flatten/Reshape/Squeeze/Unsqueeze/Transpose(DQ(q, s)) -> DQ(op(q), s) for one scale and a zero
# zero point: dequantizing is elementwise, so it commutes with moving the values (exact), and the
# layer after the shape op then reads a DQ it can fuse (PyTorch's export puts a Flatten between
# a ReLU's Q/DQ and the classifier's Gemm). TensorRT propagates DQ forward the same way.

_MOVES = ("Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose")


def _dq_through(view: View, found: Found) -> Rewrite | None:
    move = found.root
    dq = view.made_by(move.inputs[0], "DequantizeLinear") if move.inputs else None
    if dq is None or view.sole(move.inputs[0]) is not move or not _zero_point(view, dq):
        return None
    scale = view.const(dq.inputs[1]) if len(dq.inputs) > 1 else None
    q, out = dq.inputs[0], move.outputs[0]
    if scale is None or scale.size != 1 or q is None or q.dtype not in QUANTIZED or out is None:
        return None
    if dq.attrs.get("output_dtype", 0) or dq.attrs.get("block_size", 0):
        return None
    moved = Value(view.fresh_name(f"{out.name}_quantized"), TensorType(q.dtype, out.shape))
    new_move = Node(move.op, [q, *move.inputs[1:]], [moved], dict(move.attrs), name=move.name)
    new_dq = Node("DequantizeLinear", [moved, *dq.inputs[1:]], [out], dict(dq.attrs),
                  name=dq.name)  # fmt: skip
    return Rewrite(remove=[move, dq], add=[new_move, new_dq], count=1)


MOVE_RULES = tuple(Rule(f"dq_through_{op.lower()}", Op(op), _dq_through) for op in _MOVES)


@register_pass("dq_through_data_movement", level=1, order=8, backends=("reference", "cuda"))
def dq_through_data_movement(graph: Graph) -> int:
    """DequantizeLinear moved past Flatten/Reshape/Squeeze/Unsqueeze/Transpose (exact)."""
    return run_rules(graph, MOVE_RULES)


# Level 1 and first: a model's Q/DQ are honoured before constant folding would fold its weights'
# DequantizeLinear into float constants; fuse_conv_act then grows QConvAct's epilogue. (The cpu
# backend has no fast quantized kernels: there the folds run as before, and layers stay float.)
@register_pass("fuse_quantized", level=1, order=9, backends=("reference", "cuda"))
def fuse_quantized(graph: Graph) -> int:
    """``Conv/Gemm/MatMul(DQ(X_q), DQ(W_q))`` -> tensorkiln.QConvAct / QGemmAct."""
    return run_rules(graph, RULES)


# ------------------------------------------------------------------------------ Q/DQ propagation
#
# Two exact rewrites TensorRT's Q/DQ propagation makes, so that quantized layers meet their
# activations and their neighbours' quantized tensors directly:
#
# * Relu(DQ(Q(y))) -> DQ(Q(Relu(y))): with zero points of zero, quantizing and dequantizing are
#   monotone and keep 0, so ReLU commutes with them; the ReLU then sits right after the layer
#   that makes y and fuses into its epilogue (fuse_conv_act, fuse_gemm_act).
# * Q(DQ(q, s), s) -> q: requantizing at the same scale and type gives the same integers back.


def _fake_quant(view: View, v: Value) -> tuple[Node, Node] | None:
    """The (Q, DQ) pair that makes ``v`` = DQ(Q(y)), symmetric (zero points absent or zero),
    the Q read by that DQ alone, if it is one."""
    dq = view.made_by(v, "DequantizeLinear")
    if dq is None or not _zero_point(view, dq):
        return None
    q = view.made_by(dq.inputs[0], "QuantizeLinear")
    if q is None or not _zero_point(view, q) or view.sole(q.outputs[0]) is not dq:
        return None
    if view.const(q.inputs[1]) is None or view.const(dq.inputs[1]) is None:
        return None
    return q, dq


def _relu_through(view: View, found: Found) -> Rewrite | None:
    relu = found.root
    pair = _fake_quant(view, relu.inputs[0])
    if pair is None or view.sole(relu.inputs[0]) is not relu:
        return None
    q, dq = pair
    y = q.inputs[0]
    if y is None or y.dtype != DType.FLOAT:
        return None
    y_relu = Value(view.fresh_name(f"{y.name}_relu"), TensorType(y.dtype, y.shape))
    q_out = Value(view.fresh_name(f"{q.outputs[0].name}_relu"), q.outputs[0].type)
    new_relu = Node("Relu", [y], [y_relu], name=relu.name)
    new_q = Node("QuantizeLinear", [y_relu, *q.inputs[1:]], [q_out], dict(q.attrs), name=q.name)
    new_dq = Node("DequantizeLinear", [q_out, *dq.inputs[1:]], [relu.outputs[0]], dict(dq.attrs),
                  name=dq.name)  # fmt: skip
    return Rewrite(remove=[relu, q, dq], add=[new_relu, new_q, new_dq], count=1)


def _same_scale_requantize(view: View, found: Found) -> Rewrite | None:
    q = found.root
    dq = view.made_by(q.inputs[0], "DequantizeLinear")
    if dq is None or not (_zero_point(view, q) and _zero_point(view, dq)):
        return None
    s_in, s_out = view.const(dq.inputs[1]), view.const(q.inputs[1])
    if s_in is None or s_out is None or s_in.size != 1 or s_out.size != 1:
        return None
    if float(s_in.reshape(-1)[0]) != float(s_out.reshape(-1)[0]):
        return None
    source, out = dq.inputs[0], q.outputs[0]
    if source is None or out is None or source.dtype != out.dtype:
        return None
    return Rewrite(remove=[q], replace={out: source}, count=1)


PROPAGATION = (
    Rule("relu_through_qdq", Op("Relu"), _relu_through),
    Rule("requantize_same_scale", Op("QuantizeLinear"), _same_scale_requantize),
)


@register_pass("propagate_qdq", level=2, order=45, backends=("reference", "cuda"))
def propagate_qdq(graph: Graph) -> int:
    """ReLU moved ahead of Q/DQ pairs, same-scale requantization removed (exact rewrites)."""
    return run_rules(graph, PROPAGATION)


# ------------------------------------------------------------------------------ requantization
#
# QConvAct/QGemmAct -> QuantizeLinear, the layer's output read by that Q alone: the layer writes
# the quantized tensor itself (its Y_scale input and an 8-bit out_dtype), from its float32 result,
# as TensorRT's quantized layers write int8 for the next one. The wide intermediate (float16 in
# an engine) is neither written nor read again.

_OUT_CODES = {DType.INT8: 3, DType.FLOAT8E4M3FN: 17}
_Y_SCALE = {"QConvAct": 6, "QGemmAct": 5}  # the input slot of Y_scale


def _writes_float(layer: Node | None) -> bool:
    """Whether ``layer`` is a QConvAct or QGemmAct writing float, its Y_scale slot free: one
    that can take a QuantizeLinear of its output into its epilogue."""
    if layer is None or layer.domain != DOMAIN or layer.op not in _Y_SCALE:
        return False
    slot = _Y_SCALE[layer.op]
    if layer.attrs.get("out_dtype", 1) != DType.FLOAT.value:
        return False
    return len(layer.inputs) <= slot or layer.inputs[slot] is None


def _requantize(view: View, found: Found) -> Rewrite | None:
    q = found.root
    layer = view.producers.get(q.inputs[0]) if q.inputs else None
    if not _writes_float(layer) or view.sole(q.inputs[0]) is not q:
        return None
    slot = _Y_SCALE[layer.op]
    out = q.outputs[0]
    code = _quantize_fits(view, q)
    if code is None:
        return None
    inputs = list(layer.inputs) + [None] * (slot + 1 - len(layer.inputs))
    inputs[slot] = q.inputs[1]
    attrs = dict(layer.attrs) | {"out_dtype": code}
    fused = Node(layer.op, inputs, [out], attrs, domain=DOMAIN, name=layer.name)
    return Rewrite(remove=[layer, q], add=[fused], count=1)


def _quantize_fits(view: View, q: Node) -> int | None:
    """The ONNX type code of ``q``'s output where a layer can write it quantized itself: int8 or
    float8 E4M3 (saturating), one float32 scale, a zero point of zero, float32 division."""
    out = q.outputs[0]
    code = _OUT_CODES.get(out.dtype) if out is not None else None
    scale = view.const(q.inputs[1]) if len(q.inputs) > 1 else None
    if code is None or scale is None or scale.size != 1 or scale.dtype != np.float32:
        return None
    if not _zero_point(view, q) or q.attrs.get("block_size", 0):
        return None
    if q.attrs.get("precision", 0) not in (0, DType.FLOAT.value):
        return None
    if out.dtype == DType.FLOAT8E4M3FN and not q.attrs.get("saturate", 1):
        return None  # (NaN on overflow: left to QuantizeLinear)
    return code


# QConvAct -> MaxPool -> QuantizeLinear (a ResNet's stem, its pool, the quantized input of the
# first block): Q(MaxPool(y)) = MaxPool(Q(y)) exactly, since quantizing with a positive scale and
# a zero point of zero is monotone (ties and saturation only merge values) and every window holds
# one input element. Quantized first, the layer writes y in 8 bits (requantize_in_epilogue) and
# the pool reads and writes 8 bits: a quarter of the bytes of a float16 y, one pass less.


def _quantize_before_max_pool(view: View, found: Found) -> Rewrite | None:
    q = found.root
    pool = view.made_by(q.inputs[0], "MaxPool") if q.inputs else None
    if pool is None or len([v for v in pool.outputs if v is not None]) != 1:
        return None
    y = pool.inputs[0]
    layer = view.producers.get(y) if y is not None else None
    if not _writes_float(layer):  # (then it takes the moved Q, as _requantize does)
        return None
    if view.sole(y) is not pool or view.sole(q.inputs[0]) is not q or y.dtype != DType.FLOAT:
        return None
    if _quantize_fits(view, q) is None or float(view.const(q.inputs[1]).reshape(-1)[0]) <= 0:
        return None
    y_q = Value(view.fresh_name(f"{y.name}_quantized"), TensorType(q.outputs[0].dtype, y.shape))
    new_q = Node("QuantizeLinear", [y, *q.inputs[1:]], [y_q], dict(q.attrs), name=q.name)
    new_pool = Node("MaxPool", [y_q], [q.outputs[0]], dict(pool.attrs), name=pool.name)
    return Rewrite(remove=[pool, q], add=[new_q, new_pool], count=1)


# LayerNorm -> QuantizeLinear (the next quantized GEMM's input, BERT's and GPT-2's): the
# normalization writes the quantized tensor too, from the values it writes (its Y_scale input,
# q_dtype, the quantized output second); the float output stays for its other readers (the
# residual of a post-LN block). One pass less over the activations per LayerNorm.


def _quantize_layer_norm(view: View, found: Found) -> Rewrite | None:
    q = found.root
    ln = view.producers.get(q.inputs[0]) if q.inputs else None
    if ln is None or (ln.domain, ln.op) != (DOMAIN, "LayerNorm") or ln.attrs.get("q_dtype"):
        return None
    if not ln.outputs or ln.outputs[0] is not q.inputs[0] or len(ln.inputs) > 4:
        return None
    code = _quantize_fits(view, q)
    if code is None:
        return None
    inputs = list(ln.inputs) + [None] * (4 - len(ln.inputs)) + [q.inputs[1]]
    outputs = [ln.outputs[0], q.outputs[0], *ln.outputs[1:2]]
    fused = Node("LayerNorm", inputs, outputs, dict(ln.attrs) | {"q_dtype": code},
                 domain=DOMAIN, name=ln.name)  # fmt: skip
    return Rewrite(remove=[ln, q], add=[fused], count=1)


# Attention -> QuantizeLinear, the attention's output read by that Q alone (the attention output
# projection's input in a quantized BERT or GPT-2): the attention writes the quantized tensor
# itself (its Y_scale input, q_dtype). One pass less over the activations per attention.


def _quantize_attention(view: View, found: Found) -> Rewrite | None:
    q = found.root
    att = view.producers.get(q.inputs[0]) if q.inputs else None
    if att is None or (att.domain, att.op) != (DOMAIN, "Attention") or att.attrs.get("q_dtype"):
        return None
    if view.sole(q.inputs[0]) is not q or len(att.inputs) > 4:
        return None
    code = _quantize_fits(view, q)
    if code is None:
        return None
    inputs = list(att.inputs) + [None] * (4 - len(att.inputs)) + [q.inputs[1]]
    fused = Node("Attention", inputs, [q.outputs[0]], dict(att.attrs) | {"q_dtype": code},
                 domain=DOMAIN, name=att.name)  # fmt: skip
    return Rewrite(remove=[att, q], add=[fused], count=1)


# QConvAct(..., Z = DQ(Z_q, s)) -> QConvAct(..., Z_q, Z_scale = s): the residual read quantized,
# dequantized in the epilogue (its Z_scale input), for a DQ of one scale and a zero zero point,
# as TensorRT reads an INT8 residual in the convolution that adds it. Exact: the epilogue
# computes Z_q * s in float32 as DequantizeLinear does. The DQ stays for its other readers.

_Z, _Z_SCALE = 5, 7  # QConvAct's input slots of the residual and its scale


def _residual_dequantize(view: View, found: Found) -> Rewrite | None:
    layer = found.root
    if len(layer.inputs) <= _Z or layer.inputs[_Z] is None:
        return None
    if len(layer.inputs) > _Z_SCALE and layer.inputs[_Z_SCALE] is not None:
        return None
    dq = view.made_by(layer.inputs[_Z], "DequantizeLinear")
    if dq is None or not _activation_dq(view, dq) or dq.attrs.get("output_dtype", 0):
        return None
    z_q = dq.inputs[0]
    if z_q is None or z_q.shape != layer.inputs[_Z].shape:
        return None
    inputs = list(layer.inputs) + [None] * (_Z_SCALE + 1 - len(layer.inputs))
    inputs[_Z], inputs[_Z_SCALE] = z_q, dq.inputs[1]
    fused = Node(layer.op, inputs, list(layer.outputs), dict(layer.attrs), domain=DOMAIN,
                 name=layer.name)  # fmt: skip
    return Rewrite(remove=[layer], add=[fused], count=1)


REQUANTIZE = (
    Rule("requantize_in_epilogue", Op("QuantizeLinear"), _requantize),
    Rule("quantize_before_max_pool", Op("QuantizeLinear"), _quantize_before_max_pool),
    Rule("quantize_in_layer_norm", Op("QuantizeLinear"), _quantize_layer_norm),
    Rule("quantize_in_attention", Op("QuantizeLinear"), _quantize_attention),
    Rule("residual_dequantize_in_epilogue", Op("QConvAct", domain=DOMAIN), _residual_dequantize),
)


# after the epilogues have grown (fuse_conv_act, fuse_gemm_act) and Q/DQ propagation
@register_pass("fuse_requantize", level=2, order=46, backends=("reference", "cuda"))
def fuse_requantize(graph: Graph) -> int:
    """``Q(QConvAct(...))`` -> QConvAct writing the quantized tensor (same for QGemmAct, and for
    LayerNorm and Attention where a Q reads them), and ``QConvAct(..., DQ(Z_q))`` -> QConvAct
    reading its residual quantized."""
    return run_rules(graph, REQUANTIZE)


# ------------------------------------------------------------------------------ a stem's pool
#
# QConvAct (an image's convolution, ReLU) -> MaxPool 3x3/2 -> QConvPool: a ResNet's stem and its
# pool as one layer, where a kernel computes the stem's rows and pools them before anything is
# written (kernels/triton/conv_stem.py's conv_stem_pool: the stem's output, four times the
# pool's, is neither written nor read back). Its other tactics run the two kernels apart, so
# the layer is never slower than the two were, by more than the autotuner's choice of each.
# Only on the cuda backend, and only where such a kernel takes the convolution and the pool
# (kernels/common/stem.py); not before the pool's QuantizeLinear has moved into the layer
# (fuse_requantize), so that the layer writes the 8-bit tensor the pool then keeps a quarter of.


def _stem_pool(view: View, found: Found) -> Rewrite | None:
    pool = found.root
    outs = [v for v in pool.outputs if v is not None]
    if len(outs) != 1 or outs[0] is not pool.outputs[0] or not pool.inputs:
        return None
    y = pool.inputs[0]
    layer = view.producers.get(y) if y is not None else None
    if layer is None or (layer.domain, layer.op) != (DOMAIN, "QConvAct"):
        return None
    if view.sole(y) is not pool or any(
        v is not None for v in [*layer.inputs[5:6], *layer.inputs[7:]]
    ):
        return None  # (a residual: not a stem's)
    writes_float = layer.attrs.get("out_dtype", 1) == DType.FLOAT.value
    if writes_float and view.sole(outs[0], "QuantizeLinear") is not None:
        return None  # (fuse_requantize moves that Q into the layer first)
    w = view.const(layer.inputs[2]) if len(layer.inputs) > 2 else None
    geometry_ok = w is not None and takes_image(
        w.shape, int(layer.attrs.get("group", 1)), layer.attrs.get("dilations")
    )
    if not geometry_ok or not fuses_pool(pool.attrs, str(layer.attrs.get("activation", ""))):
        return None
    attrs = dict(layer.attrs)
    attrs.pop("residual_order", None)
    attrs |= {f"pool_{k}": v for k, v in pool.attrs.items() if k != "storage_order"}
    inputs = list(layer.inputs[:7])
    while inputs and inputs[-1] is None:
        inputs.pop()
    fused = Node("QConvPool", inputs, [outs[0]], attrs, domain=DOMAIN, name=layer.name)
    return Rewrite(remove=[layer, pool], add=[fused], count=1)


STEM_POOL = (Rule("stem_and_its_pool", Op("MaxPool"), _stem_pool),)


# after fuse_conv_act has put the ReLU into the layer (level 3) and the pool's Q has moved in
@register_pass("fuse_stem_pool", level=3, order=58, backends=("cuda",), quantized=True)
def fuse_stem_pool(graph: Graph) -> int:
    """``MaxPool(QConvAct(image))`` -> tensorkiln.QConvPool, where a stem kernel can pool the
    convolution's tiles itself (cuda)."""
    return run_rules(graph, STEM_POOL)
