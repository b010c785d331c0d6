"""Operators of the ``com.microsoft`` domain (onnxruntime's contrib ops) that shipped models use.

DynamicQuantizeLSTM (an LSTM with int8/uint8 weights and activations quantized on the fly, as
onnxruntime's dynamic quantization writes it) is kernels/common/contrib.py's, over the reference's
recurrent layers; its shape rule is here.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.ir import TensorType
from tensorkiln.kernels.common.contrib import MS, ContribOps
from tensorkiln.kernels.reference.quant import dynamic_quantize_linear
from tensorkiln.kernels.reference.rnn import LAYERS
from tensorkiln.kernels.registry import register
from tensorkiln.ops.shape_rules import InferContext, rule


def on_grid(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to the uint8 grid onnxruntime quantizes a GEMM operand to, in float."""
    q, scale, zero = dynamic_quantize_linear(a)
    return (q.astype(np.float32) - zero.astype(np.float32)) * scale


OPS = ContribOps(LAYERS, on_grid)
register("DynamicQuantizeLSTM", domain=MS, since=1)(OPS.dynamic_quantize_lstm)


@rule("DynamicQuantizeLSTM", domain=MS)
def _dynamic_quantize_lstm_rule(ctx: InferContext) -> list:
    """Y [seq, D, batch, H], Y_h and Y_c [D, batch, H], in X's type."""
    x, rs = ctx.shape(0), ctx.shape(2)
    dirs = 2 if ctx.attr("direction", "forward") == "bidirectional" else 1
    hid = ctx.attr("hidden_size") or (rs[1] if rs is not None and len(rs) == 3 else None)
    if x is None or len(x) != 3 or hid is None:
        return [TensorType(ctx.dtype(0), None)] * len(ctx.node.outputs)
    shapes = [(x[0], dirs, x[1], hid), (dirs, x[1], hid), (dirs, x[1], hid)]
    return [TensorType(ctx.dtype(0), s) for s in shapes[: len(ctx.node.outputs)]]
