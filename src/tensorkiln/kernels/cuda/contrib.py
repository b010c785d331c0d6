"""Operators of the ``com.microsoft`` domain (onnxruntime's contrib ops) on the device.

DynamicQuantizeLSTM as the reference (tensorkiln.kernels.reference.contrib, which says why the
activations are rounded to a uint8 grid before each GEMM): the int8/uint8 weights are dequantized
on the device and the torch LSTM kernel runs with the hidden state rounded at every step.
"""

from __future__ import annotations

import torch

from tensorkiln.kernels.cuda.quant import dynamic_quantize_linear
from tensorkiln.kernels.cuda.rnn import lstm_layer
from tensorkiln.kernels.reference.contrib import MS, check_quantized_lstm
from tensorkiln.kernels.registry import register

_NUMPY_TYPES = {torch.int8: "int8", torch.uint8: "uint8"}


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[D, rows, 4H] codes -> [D, 4H, rows] float32 weights, as the LSTM kernel takes them."""
    scale = scale.to(torch.float32).reshape(q.shape[0], 1, -1)
    zero = zero.to(torch.float32).reshape(q.shape[0], 1, -1)
    return ((q.to(torch.float32) - zero) * scale).transpose(1, 2)


def _on_grid(a: torch.Tensor) -> torch.Tensor:
    """``a`` rounded to the uint8 grid onnxruntime quantizes a GEMM operand to, in float."""
    q, scale, zero = dynamic_quantize_linear(a)
    return (q.to(torch.float32) - zero.to(torch.float32)) * scale


@register("DynamicQuantizeLSTM", domain=MS, since=1, backend="cuda")
def dynamic_quantize_lstm(
    x: torch.Tensor,
    w: torch.Tensor,
    r: torch.Tensor,
    b: torch.Tensor | None = None,
    sequence_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
    initial_c: torch.Tensor | None = None,
    p: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    w_zero_point: torch.Tensor | None = None,
    r_scale: torch.Tensor | None = None,
    r_zero_point: torch.Tensor | None = None,
    *,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    _n_outputs: int = 3,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """com.microsoft DynamicQuantizeLSTM-1: LSTM with int8/uint8 W and R (see the module)."""
    if w_scale is None or w_zero_point is None or r_scale is None or r_zero_point is None:
        raise ValueError("DynamicQuantizeLSTM needs W_scale, W_zero_point, R_scale, R_zero_point")
    check_quantized_lstm(
        tuple(x.shape),
        (tuple(w.shape), _NUMPY_TYPES.get(w.dtype, str(w.dtype))),
        (tuple(r.shape), _NUMPY_TYPES.get(r.dtype, str(r.dtype))),
        [(tuple(w_scale.shape), tuple(w_zero_point.shape)),
         (tuple(r_scale.shape), tuple(r_zero_point.shape))],
        hidden_size, direction,
    )  # fmt: skip
    outs = lstm_layer(
        _on_grid(x), _dequantize(w, w_scale, w_zero_point), _dequantize(r, r_scale, r_zero_point),
        b, sequence_lens, initial_h, initial_c, p,
        activation_alpha=activation_alpha, activation_beta=activation_beta,
        activations=activations, clip=clip, direction=direction, input_forget=input_forget,
        recurrent_input=_on_grid,
    )  # fmt: skip
    outs = tuple(o.to(x.dtype) for o in outs)
    return outs[0] if _n_outputs <= 1 else outs[:_n_outputs]
