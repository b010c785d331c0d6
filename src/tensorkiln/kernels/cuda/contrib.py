"""Operators of the ``com.microsoft`` domain (onnxruntime's contrib ops) on the device.

DynamicQuantizeLSTM is kernels/common/contrib.py's, over the device's recurrent layers: the int8/uint8
weights are dequantized on the device and the LSTM runs with the hidden state rounded to the
activation grid at every step, as onnxruntime does.
"""

from __future__ import annotations

import torch

from tensorkiln.kernels.common.contrib import MS, ContribOps
from tensorkiln.kernels.cuda.quant import dynamic_quantize_linear
from tensorkiln.kernels.cuda.rnn import LAYERS
from tensorkiln.kernels.registry import register


def on_grid(a: torch.Tensor) -> torch.Tensor:
    """``a`` rounded to the uint8 grid onnxruntime quantizes a GEMM operand to, in float."""
    q, scale, zero = dynamic_quantize_linear(a)
    return (q.to(torch.float32) - zero.to(torch.float32)) * scale


OPS = ContribOps(LAYERS, on_grid)
register("DynamicQuantizeLSTM", domain=MS, since=1, backend="cuda")(OPS.dynamic_quantize_lstm)
