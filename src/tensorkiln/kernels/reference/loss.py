"""Reference kernels for the training losses NegativeLogLikelihoodLoss and
SoftmaxCrossEntropyLoss.

Inputs are [N, C] or [N, C, d1, ..., dk] with targets [N] or [N, d1, ..., dk]; a target equal to
``ignore_index`` contributes nothing, neither to the loss nor to the mean's denominator.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.kernels.reference.math import log_softmax, widen
from tensorkiln.kernels.registry import register

_REDUCTIONS = ("none", "sum", "mean")


def _nll(
    log_prob: np.ndarray,
    target: np.ndarray,
    weight: np.ndarray | None,
    ignore_index: int | None,
    reduction: str,
) -> np.ndarray:
    """The loss in ``log_prob``'s dtype (the caller casts)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if log_prob.ndim < 2 or target.shape != log_prob.shape[:1] + log_prob.shape[2:]:
        raise ValueError(
            f"input of shape {log_prob.shape} needs target of shape "
            f"{log_prob.shape[:1] + log_prob.shape[2:]} (input without its class dim 1), "
            f"got {target.shape}"
        )
    n_classes = log_prob.shape[1]
    target = target.astype(np.int64, copy=False)
    keep = None if ignore_index is None else target != ignore_index
    if keep is not None:
        target = np.where(keep, target, 0)
    if target.size and (target.min() < 0 or target.max() >= n_classes):
        raise ValueError(f"target values must be in [0, {n_classes}) or equal ignore_index")
    loss = -np.take_along_axis(log_prob, target[:, None], axis=1)[:, 0]
    w = None if weight is None else widen(weight)[target]
    if keep is not None:
        w = keep.astype(loss.dtype) if w is None else w * keep
    if w is not None:
        loss *= w
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (w.sum() if w is not None else loss.size)


@register("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(
    input: np.ndarray,
    target: np.ndarray,
    weight: np.ndarray | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> np.ndarray:
    """loss[n, d...] = -input[n, target[n, d...], d...] * weight[target], then reduced."""
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = _nll(widen(input), target, weight, ignore_index, reduction)
    return np.asarray(loss).astype(input.dtype, copy=False)


@register("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(
    scores: np.ndarray,
    labels: np.ndarray,
    weights: np.ndarray | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
    _n_outputs: int = 1,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """NegativeLogLikelihoodLoss of log_softmax(scores, axis=1); optionally also the log-probs."""
    log_prob = log_softmax(widen(scores), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = _nll(log_prob, labels, weights, ignore_index, reduction)
    loss = np.asarray(loss).astype(scores.dtype, copy=False)
    if _n_outputs > 1:
        return loss, log_prob.astype(scores.dtype, copy=False)
    return loss
