"""Optimizer steps of the ``ai.onnx.preview.training`` domain: Adagrad, Adam and Momentum.

Each op updates n tensors at once: its variadic inputs are n X's, then n G's (gradients), then the
optimizer's n-tensor states; its outputs are the new X's followed by the new states.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.kernels.registry import register

TRAINING = "ai.onnx.preview.training"


def _groups(op: str, tensors: tuple[np.ndarray, ...], k: int) -> list[tuple[np.ndarray, ...]]:
    """Split the variadic inputs into n groups (X, G, state...) of ``k`` tensors each."""
    if not tensors or len(tensors) % k:
        raise ValueError(
            f"{op}: expected a multiple of {k} tensors after R and T, got {len(tensors)}."
        )
    n = len(tensors) // k
    return list(zip(*(tensors[i * n : (i + 1) * n] for i in range(k))))


def _scalar(x: np.ndarray) -> float:
    return float(np.asarray(x).reshape(()))


@register("Adagrad", domain=TRAINING, since=1)
def adagrad(
    R: np.ndarray,
    T: np.ndarray,
    *inputs: np.ndarray,
    decay_factor: float = 0.0,
    epsilon: float = 0.0,
    norm_coefficient: float = 0.0,
) -> tuple[np.ndarray, ...]:
    """One Adagrad step: X -= r * g / (sqrt(H_new) + eps), H_new = H + g^2."""
    r = _scalar(R) / (1 + _scalar(T) * decay_factor)
    xs, hs = [], []
    for X, G, H in _groups("Adagrad", inputs, 3):
        g = norm_coefficient * X + G
        h = H + g * g
        xs.append((X - r * g / (np.sqrt(h) + epsilon)).astype(X.dtype))
        hs.append(h.astype(H.dtype))
    return (*xs, *hs)


@register("Adam", domain=TRAINING, since=1)
def adam(
    R: np.ndarray,
    T: np.ndarray,
    *inputs: np.ndarray,
    alpha: float = 0.9,
    beta: float = 0.999,
    epsilon: float = 0.0,
    norm_coefficient: float = 0.0,
    norm_coefficient_post: float = 0.0,
) -> tuple[np.ndarray, ...]:
    """One Adam step with bias correction (none at T = 0) and optional L2 terms."""
    t, r = _scalar(T), _scalar(R)
    if t > 0:
        r = r * np.sqrt(1 - beta**t) / (1 - alpha**t)
    xs, vs, hs = [], [], []
    for X, G, V, H in _groups("Adam", inputs, 4):
        g = norm_coefficient * X + G
        v = alpha * V + (1 - alpha) * g
        h = beta * H + (1 - beta) * g * g
        x = (1 - norm_coefficient_post) * (X - r * v / (np.sqrt(h) + epsilon))
        xs.append(x.astype(X.dtype))
        vs.append(v.astype(V.dtype))
        hs.append(h.astype(H.dtype))
    return (*xs, *vs, *hs)


@register("Momentum", domain=TRAINING, since=1)
def momentum(
    R: np.ndarray,
    T: np.ndarray,
    *inputs: np.ndarray,
    alpha: float,
    beta: float,
    mode: str,
    norm_coefficient: float,
) -> tuple[np.ndarray, ...]:
    """One SGD-with-momentum step (``mode`` "standard" or "nesterov")."""
    if mode not in ("standard", "nesterov"):
        raise ValueError(f"Momentum: mode must be 'standard' or 'nesterov', got {mode!r}.")
    r = _scalar(R)
    b = beta if _scalar(T) > 0 else 1.0
    xs, vs = [], []
    for X, G, V in _groups("Momentum", inputs, 3):
        g = norm_coefficient * X + G
        v = alpha * V + b * g
        step = v if mode == "standard" else g + alpha * v
        xs.append((X - r * step).astype(X.dtype))
        vs.append(v.astype(V.dtype))
    return (*xs, *vs)
