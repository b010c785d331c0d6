"""Optimizer steps of the ``ai.onnx.preview.training`` domain on the device: Adagrad, Adam and
Momentum.

Each op updates n tensors at once: its variadic inputs are n X's, then n G's (gradients), then the
optimizer's n-tensor states; its outputs are the new X's followed by the new states. The learning
rate R and the step count T stay on the device: the step's scalar factors are formed there in
float64 (the reference's Python floats), then applied in each tensor's own precision.
"""

from __future__ import annotations

import torch

from tensorkiln.kernels.registry import register

TRAINING = "ai.onnx.preview.training"


def _groups(op: str, tensors: tuple[torch.Tensor, ...], k: int) -> list[tuple[torch.Tensor, ...]]:
    """Split the variadic inputs into n groups (X, G, state...) of ``k`` tensors each."""
    if not tensors or len(tensors) % k:
        raise ValueError(
            f"{op}: expected a multiple of {k} tensors after R and T, got {len(tensors)}."
        )
    n = len(tensors) // k
    return list(zip(*(tensors[i * n : (i + 1) * n] for i in range(k))))


def _scalar(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(()).to(torch.float64)


@register("Adagrad", domain=TRAINING, since=1, backend="cuda")
def adagrad(
    R: torch.Tensor,
    T: torch.Tensor,
    *inputs: torch.Tensor,
    decay_factor: float = 0.0,
    epsilon: float = 0.0,
    norm_coefficient: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """One Adagrad step: X -= r * g / (sqrt(H_new) + eps), H_new = H + g^2."""
    r = _scalar(R) / (1 + _scalar(T) * decay_factor)
    xs, hs = [], []
    for X, G, H in _groups("Adagrad", inputs, 3):
        g = norm_coefficient * X + G
        h = H + g * g
        xs.append((X - r.to(g.dtype) * g / (torch.sqrt(h) + epsilon)).to(X.dtype))
        hs.append(h.to(H.dtype))
    return (*xs, *hs)


@register("Adam", domain=TRAINING, since=1, backend="cuda")
def adam(
    R: torch.Tensor,
    T: torch.Tensor,
    *inputs: torch.Tensor,
    alpha: float = 0.9,
    beta: float = 0.999,
    epsilon: float = 0.0,
    norm_coefficient: float = 0.0,
    norm_coefficient_post: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """One Adam step with bias correction (none at T = 0) and optional L2 terms."""
    t, r = _scalar(T), _scalar(R)
    two = torch.tensor([alpha, beta], dtype=torch.float64, device=t.device)
    powers = torch.pow(two, t)
    corrected = r * torch.sqrt(1 - powers[1]) / (1 - powers[0])
    r = torch.where(t > 0, corrected, r)
    xs, vs, hs = [], [], []
    for X, G, V, H in _groups("Adam", inputs, 4):
        g = norm_coefficient * X + G
        v = alpha * V + (1 - alpha) * g
        h = beta * H + (1 - beta) * g * g
        x = (1 - norm_coefficient_post) * (X - r.to(v.dtype) * v / (torch.sqrt(h) + epsilon))
        xs.append(x.to(X.dtype))
        vs.append(v.to(V.dtype))
        hs.append(h.to(H.dtype))
    return (*xs, *vs, *hs)


@register("Momentum", domain=TRAINING, since=1, backend="cuda")
def momentum(
    R: torch.Tensor,
    T: torch.Tensor,
    *inputs: torch.Tensor,
    alpha: float,
    beta: float,
    mode: str,
    norm_coefficient: float,
) -> tuple[torch.Tensor, ...]:
    """One SGD-with-momentum step (``mode`` "standard" or "nesterov")."""
    if mode not in ("standard", "nesterov"):
        raise ValueError(f"Momentum: mode must be 'standard' or 'nesterov', got {mode!r}.")
    r = _scalar(R)
    betas = torch.tensor([beta, 1.0], dtype=torch.float64, device=r.device)
    b = torch.where(_scalar(T) > 0, betas[0], betas[1])
    xs, vs = [], []
    for X, G, V in _groups("Momentum", inputs, 3):
        g = norm_coefficient * X + G
        v = alpha * V + b.to(g.dtype) * g
        step = v if mode == "standard" else g + alpha * v
        xs.append((X - r.to(step.dtype) * step).to(X.dtype))
        vs.append(v.to(V.dtype))
    return (*xs, *vs)
