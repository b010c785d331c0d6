"""Backend-neutral parts of the normalizations: checks (LayerNorm, RMSNorm and their ONNX forms)
and BatchNormalization's statistics and outputs, written once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


def norm_axis(axis: int, rank: int, op: str) -> int:
    """``axis`` as a non-negative axis of a ``rank``-D input; ValueError when out of range."""
    if not -rank <= axis < rank:
        raise ValueError(f"{op}: axis {axis} is out of range for an input of rank {rank}")
    return axis % rank


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
