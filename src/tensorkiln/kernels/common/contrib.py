"""Operators of the ``com.microsoft`` domain (onnxruntime's contrib ops) that shipped models use,
written once for both kernel trees: DynamicQuantizeLSTM over a backend's recurrent layers
(kernels/common/rnn.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tensorkiln.kernels.common.rnn import Recurrent

MS = "com.microsoft"
_QUANT_TYPES = ("int8", "uint8")


def check_quantized_lstm(
    x: Sequence[int],
    w: tuple[Sequence[int], str],
    r: tuple[Sequence[int], str],
    scales: Sequence[tuple[Sequence[int], Sequence[int]]],
    hidden_size: int | None,
    direction: str,
) -> None:
    """Validate DynamicQuantizeLSTM's shapes and types (``w``/``r``: shape and dtype name;
    ``scales``: (scale shape, zero point shape) of W and of R)."""
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


class ContribOps:
    """The com.microsoft kernels over a backend's :class:`Recurrent` layers (register the bound
    methods). ``on_grid`` rounds a float array to the uint8 grid onnxruntime quantizes a GEMM
    operand to (DynamicQuantizeLinear's rounding, back in float)."""

    def __init__(self, layers: Recurrent, on_grid: Callable[[Any], Any]) -> None:
        self.layers = layers
        self.on_grid = on_grid

    def _dequantize(self, q: Any, scale: Any, zero: Any) -> Any:
        """[D, rows, 4H] codes -> [D, 4H, rows] float32 weights, as the LSTM takes them."""
        xp = self.layers.xp
        f32 = xp.float32
        scale = xp.astype(scale, f32).reshape(q.shape[0], 1, -1)
        zero = xp.astype(zero, f32).reshape(q.shape[0], 1, -1)
        return xp.permute((xp.astype(q, f32) - zero) * scale, (0, 2, 1))

    def dynamic_quantize_lstm(
        self,
        x: Any,
        w: Any,
        r: Any,
        b: Any = None,
        sequence_lens: Any = None,
        initial_h: Any = None,
        initial_c: Any = None,
        p: Any = None,
        w_scale: Any = None,
        w_zero_point: Any = None,
        r_scale: Any = None,
        r_zero_point: Any = None,
        *,
        activation_alpha: list[float] | None = None,
        activation_beta: list[float] | None = None,
        activations: list[str] | None = None,
        clip: float | None = None,
        direction: str = "forward",
        hidden_size: int | None = None,
        input_forget: int = 0,
        _n_outputs: int = 3,
    ) -> tuple[Any, ...]:
        """com.microsoft DynamicQuantizeLSTM-1: an LSTM whose W [D, input, 4H] and R [D, H, 4H]
        are int8/uint8 with a scale and zero point per direction (or per direction and column),
        as onnxruntime's dynamic quantization writes it. onnxruntime multiplies them with
        activations quantized on the fly: each GEMM rounds its float operand to uint8 with a scale
        and zero point from that operand's range (0 included), the input projection once over the
        whole sequence, the recurrence at every step over the [batch, H] hidden state. The kernel
        does the same with DynamicQuantizeLinear's rounding, so it matches onnxruntime to float
        rounding instead of to the activation grid (1e-2)."""
        if w_scale is None or w_zero_point is None or r_scale is None or r_zero_point is None:
            raise ValueError(
                "DynamicQuantizeLSTM needs W_scale, W_zero_point, R_scale, R_zero_point"
            )
        name = self.layers.xp.dtype_name
        check_quantized_lstm(
            tuple(x.shape), (tuple(w.shape), name(w)), (tuple(r.shape), name(r)),
            [(tuple(w_scale.shape), tuple(w_zero_point.shape)),
             (tuple(r_scale.shape), tuple(r_zero_point.shape))],
            hidden_size, direction,
        )  # fmt: skip
        outs = self.layers.lstm_layer(
            self.on_grid(x), self._dequantize(w, w_scale, w_zero_point),
            self._dequantize(r, r_scale, r_zero_point), b, sequence_lens, initial_h, initial_c, p,
            activation_alpha=activation_alpha, activation_beta=activation_beta,
            activations=activations, clip=clip, direction=direction, input_forget=input_forget,
            recurrent_input=self.on_grid,
        )  # fmt: skip
        return tuple(self.layers.xp.astype(o, x.dtype) for o in outs[: max(_n_outputs, 1)])
