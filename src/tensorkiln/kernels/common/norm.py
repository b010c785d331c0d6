"""Backend-neutral parts of the normalizations: checks (LayerNorm, RMSNorm and their ONNX forms)
and BatchNormalization's statistics and outputs, written once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tensorkiln.kernels.common.quant import REQUANTIZED


def norm_axis(axis: int, rank: int, op: str) -> int:
    """``axis`` as a non-negative axis of a ``rank``-D input; ValueError when out of range."""
    if not -rank <= axis < rank:
        raise ValueError(f"{op}: axis {axis} is out of range for an input of rank {rank}")
    return axis % rank


def group_norm_layout(
    x_shape: Sequence[int], num_groups: int, scale_size: int, bias_size: int, per_channel: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """GroupNormalization's (shape to view the normalized X in, shape of scale and bias against
    it), after checking that ``num_groups`` divides X's channels and that scale and bias hold one
    value per channel (``per_channel``, opset 21 on) or per group."""
    n, c, *spatial = x_shape
    if num_groups < 1 or c % num_groups:
        raise ValueError(
            f"GroupNormalization: num_groups={num_groups} does not divide the {c} channels"
        )
    want = c if per_channel else num_groups
    if scale_size != want or bias_size != want:
        raise ValueError(
            f"GroupNormalization: scale and bias need {want} values, got {scale_size} and "
            f"{bias_size}"
        )
    rest = (1,) * len(spatial)
    if per_channel:
        return (n, c, *spatial), (c, *rest)
    return (n, num_groups, c // num_groups, *spatial), (num_groups, 1, *rest)


def check_lrn(x_shape: Sequence[int], size: int) -> None:
    """Raise ValueError unless X is (N, C, D1, ...) and the window ``size`` is positive."""
    if len(x_shape) < 3:
        raise ValueError(f"LRN: X must be (N, C, D1, ...), got shape {tuple(x_shape)}")
    if size < 1:
        raise ValueError(f"LRN: size must be positive, got {size}")


# BatchNormalization says training through its training_mode attribute from opset 14; before, a
# node asks for training statistics by declaring more than one output (unless is_test).
BN_TRAINING_MODE = 14


class BatchNormArrays(Protocol):
    """The BatchNormalization steps one backend computes its own way (torch's fused batch_norm on
    the device, numpy arithmetic in the reference)."""

    def params(self, x: Any, scale: Any, bias: Any, mean: Any, var: Any, spatial: int) -> tuple:
        """(compute dtype, [scale, bias, mean, var] checked and shaped to apply against X)."""

    def apply(self, x: Any, scale: Any, bias: Any, mean: Any, var: Any, epsilon: float, ct: Any):
        """y = (x - mean) / sqrt(var + epsilon) * scale + bias, in ``ct``, narrowed to X's dtype."""

    def batch_stats(self, x: Any, ct: Any, spatial: int) -> tuple[Any, Any]:
        """X's (mean, biased variance) per channel (per element when not ``spatial``), in ``ct``,
        with X's rank."""

    def astype(self, x: Any, dtype: Any) -> Any: ...


class BatchNorm:
    """BatchNormalization of every opset over one backend's :class:`BatchNormArrays`: which
    statistics to use and which outputs to return, written once."""

    def __init__(self, xp: BatchNormArrays) -> None:
        self.xp = xp

    def _running(self, old: Any, batch: Any, momentum: float, like: Any) -> Any:
        new = old.reshape(batch.shape) * momentum + batch * (1 - momentum)
        return self.xp.astype(new.reshape(like.shape), like.dtype)

    def _train(self, x, params, epsilon: float, spatial: int) -> tuple:
        """(Y over the batch statistics, batch mean, batch variance)."""
        ct, (s, b, m, v) = params
        bm, bv = self.xp.batch_stats(x, ct, spatial)
        y = self.xp.apply(x, s, b, bm.reshape(m.shape), bv.reshape(v.shape), epsilon, ct)
        return y, bm, bv

    def legacy(self, x, scale, bias, mean, var, *, epsilon, is_test, momentum, spatial, n_outputs):
        """Opsets 1-13: inference with one output; with several, training-mode statistics.

        The outputs then are Y, the updated running mean and variance, and the batch mean and
        variance.
        """
        params = self.xp.params(x, scale, bias, mean, var, spatial)
        ct, (s, b, m, v) = params
        if n_outputs == 1 or is_test:
            return self.xp.apply(x, s, b, m, v, epsilon, ct)
        y, bm, bv = self._train(x, params, epsilon, spatial)
        outs = [y, self._running(m, bm, momentum, mean), self._running(v, bv, momentum, mean)]
        outs += [self.xp.astype(t.reshape(mean.shape), mean.dtype) for t in (bm, bv)]
        return tuple(outs[:n_outputs])

    def batch_normalization(
        self,
        x: Any,
        scale: Any,
        bias: Any,
        mean: Any,
        var: Any,
        *,
        epsilon: float = 1e-5,
        momentum: float = 0.9,
        training_mode: int = 0,
        consumed_inputs: Sequence[int] | None = None,
        is_test: int = 0,
        spatial: int = 1,
        _n_outputs: int = 1,
        _opset: int = BN_TRAINING_MODE,
    ):
        """Normalize per channel; training_mode uses the batch statistics and also returns the
        updated running mean and variance (before opset 14 see :meth:`legacy`)."""
        if _opset < BN_TRAINING_MODE:
            legacy = {"is_test": is_test, "momentum": momentum, "spatial": spatial}
            return self.legacy(
                x, scale, bias, mean, var, epsilon=epsilon, n_outputs=_n_outputs, **legacy
            )
        params = self.xp.params(x, scale, bias, mean, var, 1)
        ct, (s, b, m, v) = params
        if not training_mode:
            return self.xp.apply(x, s, b, m, v, epsilon, ct)
        y, bm, bv = self._train(x, params, epsilon, 1)
        outs = (y, self._running(m, bm, momentum, mean), self._running(v, bv, momentum, var))
        return outs[:_n_outputs] if _n_outputs > 1 else y


# Dropout takes ratio as an attribute and is identity in inference before opset 12 (with a mask of
# X's type before 10, bool from 10); from 12, ratio and training_mode are inputs.
DROPOUT_INPUTS = 12
DROPOUT_BOOL_MASK = 10


class DropoutArrays(Protocol):
    """The array operations Dropout needs, on one backend's arrays."""

    def ratio(self, ratio: Any, training: bool) -> float:
        """The ratio input as a float (0.5 when absent); the device reads it only in training."""

    def flag(self, v: Any) -> bool:
        """A boolean scalar input (training_mode), read on the host."""

    def ones(self, x: Any, boolean: bool) -> Any:
        """An all-ones mask of X's shape: bool, or X's dtype."""

    def keep(self, x: Any, ratio: float, seed: int | None) -> Any:
        """A bool mask of X's shape, each element True with probability 1 - ratio (drawn with
        numpy's RandomState when ``seed`` is given, so that both trees draw the same mask)."""

    def astype(self, x: Any, dtype: Any) -> Any: ...


class Dropout:
    """Dropout of every opset over one backend's :class:`DropoutArrays`."""

    def __init__(self, xp: DropoutArrays) -> None:
        self.xp = xp

    def _dropout(self, x, ratio: float, training: bool, seed: int | None, n_outputs: int):
        if not 0 <= ratio < 1:
            raise ValueError(f"Dropout: ratio must be in [0, 1), got {ratio}")
        if not training or ratio == 0:
            mask = self.xp.ones(x, boolean=True) if n_outputs > 1 else None
            return (x, mask) if n_outputs > 1 else x
        mask = self.xp.keep(x, ratio, seed)
        y = self.xp.astype(x * mask * (1.0 / (1.0 - ratio)), x.dtype)
        return (y, mask) if n_outputs > 1 else y

    def dropout(
        self,
        x: Any,
        ratio: Any = None,  # an input from opset 12, an attribute (a float) before
        training_mode: Any = None,
        *,
        seed: int | None = None,
        consumed_inputs: Sequence[int] | None = None,
        is_test: int = 0,
        _n_outputs: int = 1,
        _opset: int = DROPOUT_INPUTS,
    ):
        """Identity unless training_mode; then zero elements with probability ratio, scale the
        rest. Before opset 12 ``ratio`` is an attribute (a float) and Dropout is identity."""
        if _opset < DROPOUT_BOOL_MASK:  # the mask has X's type (all ones)
            return x if _n_outputs == 1 else (x, self.xp.ones(x, boolean=False))
        if _opset < DROPOUT_INPUTS:
            return self._dropout(x, 0.5 if ratio is None else float(ratio), False, None, _n_outputs)
        training = training_mode is not None and self.xp.flag(training_mode)
        return self._dropout(x, self.xp.ratio(ratio, training), training, seed, _n_outputs)


class FusedNormArrays(Protocol):
    """The normalization math of tensorkiln.LayerNorm and RMSNorm on one backend (torch's
    F.layer_norm with its affine step fused where it fits, numpy arithmetic in the reference)."""

    def layer_norm(self, s: Any, axis: int, scale: Any, bias: Any, epsilon: float) -> Any:
        """``s`` normalized over the axes from ``axis`` on, then scaled and shifted (scale and
        bias broadcast against ``s``), in ``s``'s dtype (statistics in float32 or float64)."""

    def rms_norm(self, x: Any, axis: int, scale: Any, epsilon: float) -> Any:
        """``x / sqrt(mean(x^2) + epsilon) * scale`` over the axes from ``axis`` on."""

    def quantize(self, y: Any, scale: Any, q_dtype: int) -> Any:
        """QuantizeLinear of ``y`` to the per-tensor ``scale``, no zero point, of ONNX type
        ``q_dtype`` (int8, float8 E4M3: saturating, half to even): the backend's own kernel."""


def quant_scale(y_scale: Any, q_dtype: int, op: str = "LayerNorm") -> Any:
    """The Y_scale of ``op`` (LayerNorm, Attention), checked with its q_dtype: the quantized
    output needs both."""
    if int(q_dtype) not in REQUANTIZED:  # (ONNX's int8 and float8 E4M3)
        raise ValueError(
            f"{op}: q_dtype {q_dtype} is not int8 (3) or float8 E4M3 (17), the types its "
            "quantized output takes"
        )
    if y_scale is None:
        raise ValueError(f"{op}: a quantized output (q_dtype) needs the Y_scale input")
    return y_scale


class FusedNorm:
    """tensorkiln.LayerNorm and RMSNorm over one backend's :class:`FusedNormArrays`: the
    residual sum, the axis check and the outputs, written once."""

    def __init__(self, xp: FusedNormArrays) -> None:
        self.xp = xp

    def layer_norm(
        self,
        x: Any,
        scale: Any,
        bias: Any = None,
        residual: Any = None,
        y_scale: Any = None,
        *,
        axis: int = -1,
        epsilon: float = 1e-5,
        q_dtype: int = 0,
        _n_outputs: int = 1,
    ) -> Any:
        """LayerNormalization of ``x + residual`` over the axes from ``axis`` on; second output
        the sum. With ``q_dtype``: second output the normalized values quantized to
        ``y_scale`` (as a QuantizeLinear reading the first output would), third the sum."""
        s = x if residual is None else x + residual
        y = self.xp.layer_norm(s, norm_axis(axis, s.ndim, "LayerNorm"), scale, bias, epsilon)
        if _n_outputs == 1:
            return y
        if not q_dtype:
            return y, s
        q = self.xp.quantize(y, quant_scale(y_scale, q_dtype), int(q_dtype))
        return (y, q) if _n_outputs == 2 else (y, q, s)

    def rms_norm(self, x: Any, scale: Any, *, axis: int = -1, epsilon: float = 1e-5) -> Any:
        """``x / sqrt(mean(x^2) + epsilon) * scale`` over the axes from ``axis`` on."""
        return self.xp.rms_norm(x, norm_axis(axis, x.ndim, "RMSNorm"), scale, epsilon)
