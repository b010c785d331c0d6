"""Operators of the ``com.microsoft`` domain (onnxruntime's contrib ops) that shipped models use.

DynamicQuantizeLSTM is an LSTM whose W [D, input, 4H] and R [D, H, 4H] are int8/uint8 with a scale
and zero point per direction (or per direction and column), as onnxruntime's dynamic quantization
writes it. onnxruntime multiplies them with activations quantized on the fly: each GEMM rounds its
float operand to uint8 with a scale and zero point from that operand's range (0 included), the
input projection once over the whole sequence, the recurrence at every step over the
[batch, H] hidden state (onnxruntime on one thread; with several it may split the batch into
chunks, each with its own range). The kernels do the same with DynamicQuantizeLinear's rounding,
so they match onnxruntime to float rounding instead of to the activation grid (1e-2).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tensorkiln.ir import TensorType
from tensorkiln.kernels.reference.quant import dynamic_quantize_linear
from tensorkiln.kernels.reference.rnn import lstm_layer
from tensorkiln.kernels.registry import register
from tensorkiln.ops.shape_rules import InferContext, rule

MS = "com.microsoft"
_QUANT_TYPES = (np.dtype(np.int8), np.dtype(np.uint8))


def check_quantized_lstm(
    x: Sequence[int],
    w: tuple[Sequence[int], object],
    r: tuple[Sequence[int], object],
    scales: Sequence[tuple[Sequence[int], Sequence[int]]],
    hidden_size: int | None,
    direction: str,
) -> None:
    """Validate DynamicQuantizeLSTM's shapes and types (``w``/``r``: shape and dtype; ``scales``:
    (scale shape, zero point shape) of W and of R); raises ValueError naming what is wrong."""
    dirs = 2 if direction == "bidirectional" else 1
    (ws, wt), (rs, rt) = w, r
    if len(x) != 3:
        raise ValueError(f"X must be rank 3 [seq, batch, input], got shape {tuple(x)}")
    hid = rs[1] if len(rs) == 3 else -1
    want = {"W": (ws, (dirs, x[2], 4 * hid)), "R": (rs, (dirs, hid, 4 * hid))}
    for name, (got, expected) in want.items():
        if tuple(got) != expected:
            raise ValueError(
                f"DynamicQuantizeLSTM's {name} must have shape {expected} "
                f"([directions, rows, 4*hidden_size], direction='{direction}'), got {tuple(got)}"
            )
    if hidden_size is not None and hidden_size != hid:
        raise ValueError(f"hidden_size={hidden_size} but R has shape {tuple(rs)}")
    if wt not in _QUANT_TYPES or rt not in _QUANT_TYPES:
        raise ValueError(f"DynamicQuantizeLSTM's W and R must be int8 or uint8, got {wt} and {rt}")
    for name, (scale, zero) in zip(("W", "R"), scales):
        if tuple(scale) not in ((dirs,), (dirs, 4 * hid)) or tuple(zero) != tuple(scale):
            raise ValueError(
                f"DynamicQuantizeLSTM's {name}_scale and {name}_zero_point must both have shape "
                f"({dirs},) or ({dirs}, {4 * hid}), got {tuple(scale)} and {tuple(zero)}"
            )


def _dequantize(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """[D, rows, 4H] codes -> [D, 4H, rows] float32 weights, as the LSTM kernel takes them."""
    scale = scale.astype(np.float32).reshape(q.shape[0], 1, -1)
    zero = zero.astype(np.float32).reshape(q.shape[0], 1, -1)
    return ((q.astype(np.float32) - zero) * scale).transpose(0, 2, 1)


def _on_grid(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to the uint8 grid onnxruntime quantizes a GEMM operand to, in float."""
    q, scale, zero = dynamic_quantize_linear(a)
    return (q.astype(np.float32) - zero.astype(np.float32)) * scale


@register("DynamicQuantizeLSTM", domain=MS, since=1)
def dynamic_quantize_lstm(
    x: np.ndarray,
    w: np.ndarray,
    r: np.ndarray,
    b: np.ndarray | None = None,
    sequence_lens: np.ndarray | None = None,
    initial_h: np.ndarray | None = None,
    initial_c: np.ndarray | None = None,
    p: np.ndarray | None = None,
    w_scale: np.ndarray | None = None,
    w_zero_point: np.ndarray | None = None,
    r_scale: np.ndarray | None = None,
    r_zero_point: np.ndarray | None = None,
    *,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    _n_outputs: int = 3,
) -> tuple[np.ndarray, ...]:
    """com.microsoft DynamicQuantizeLSTM-1: LSTM with int8/uint8 W and R (see the module)."""
    if w_scale is None or w_zero_point is None or r_scale is None or r_zero_point is None:
        raise ValueError("DynamicQuantizeLSTM needs W_scale, W_zero_point, R_scale, R_zero_point")
    check_quantized_lstm(
        x.shape, (w.shape, w.dtype), (r.shape, r.dtype),
        [(w_scale.shape, w_zero_point.shape), (r_scale.shape, r_zero_point.shape)],
        hidden_size, direction,
    )  # fmt: skip
    outs = lstm_layer(
        _on_grid(x), _dequantize(w, w_scale, w_zero_point), _dequantize(r, r_scale, r_zero_point),
        b, sequence_lens, initial_h, initial_c, p,
        activation_alpha=activation_alpha, activation_beta=activation_beta,
        activations=activations, clip=clip, direction=direction, input_forget=input_forget,
        recurrent_input=_on_grid,
    )  # fmt: skip
    return tuple(o.astype(x.dtype) for o in outs[: max(_n_outputs, 1)])


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
