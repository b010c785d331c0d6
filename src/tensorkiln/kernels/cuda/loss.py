"""The training losses NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss on the cuda backend.

Inputs are [N, C] or [N, C, d1, ..., dk] with targets [N] or [N, d1, ..., dk]; a target equal to
``ignore_index`` contributes nothing, neither to the loss nor to the mean's denominator. Targets
are not range-checked (that would read them on the host): an out-of-range class is undefined.
"""

from __future__ import annotations

import torch

from tensorkiln.kernels.cuda.nn import compute_dtype
from tensorkiln.kernels.registry import register

_REDUCTIONS = ("none", "sum", "mean")


def _widen(x: torch.Tensor) -> torch.Tensor:
    return x.to(compute_dtype(x.dtype))


def _nll(
    log_prob: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int | None,
    reduction: str,
) -> torch.Tensor:
    """The loss in ``log_prob``'s dtype (the caller casts)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    want = (*log_prob.shape[:1], *log_prob.shape[2:])
    if log_prob.ndim < 2 or tuple(target.shape) != want:
        raise ValueError(
            f"input of shape {tuple(log_prob.shape)} needs target of shape {want} (input "
            f"without its class dim 1), got {tuple(target.shape)}"
        )
    target = target.to(torch.int64)
    keep = None if ignore_index is None else target != ignore_index
    if keep is not None:
        target = torch.where(keep, target, 0)
    loss = -torch.gather(log_prob, 1, target.unsqueeze(1)).squeeze(1)
    w = None if weight is None else _widen(weight)[target].to(loss.dtype)
    if keep is not None:
        w = keep.to(loss.dtype) if w is None else w * keep
    if w is not None:
        loss = loss * w
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (w.sum() if w is not None else loss.numel())


@register("NegativeLogLikelihoodLoss", since=12, backend="cuda")
def negative_log_likelihood_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """loss[n, d...] = -input[n, target[n, d...], d...] * weight[target], then reduced."""
    return _nll(_widen(input), target, weight, ignore_index, reduction).to(input.dtype)


@register("SoftmaxCrossEntropyLoss", since=12, backend="cuda")
def softmax_cross_entropy_loss(
    scores: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
    _n_outputs: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """NegativeLogLikelihoodLoss of log_softmax(scores, axis=1); optionally also the log-probs."""
    log_prob = torch.log_softmax(_widen(scores), dim=1)
    loss = _nll(log_prob, labels, weights, ignore_index, reduction).to(scores.dtype)
    if _n_outputs > 1:
        return loss, log_prob.to(scores.dtype)
    return loss
