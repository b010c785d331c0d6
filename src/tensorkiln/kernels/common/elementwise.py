"""Backend-neutral checks and shape facts of the elementwise kernels (PRelu's slope, Clip's bounds),
shared by the reference and cuda trees."""

from __future__ import annotations

from collections.abc import Sequence

# PRelu before opset 7 lays a 1-D slope of length C along axis 1 (NCHW channels); from 7 on the
# slope broadcasts to X as usual.
PRELU_BROADCASTS = 7
# Clip takes its bounds as float attributes before opset 11, as optional scalar inputs from 11 on.
CLIP_BOUNDS_AS_INPUTS = 11


def prelu_slope_shape(slope: Sequence[int], x: Sequence[int], opset: int) -> tuple[int, ...] | None:
    """The shape to view PRelu's slope as, for ``x`` at ``opset``; None to keep it as it is."""
    slope, x = tuple(slope), tuple(x)
    if opset < PRELU_BROADCASTS and len(slope) == 1 and len(x) > 2 and slope[0] == x[1] != x[-1]:
        return (-1,) + (1,) * (len(x) - 2)
    return None


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    tail = target[len(target) - len(shape) :]
    return all(s in (1, t) for s, t in zip(shape, tail))


def check_prelu_slope(slope: Sequence[int], x: Sequence[int]) -> None:
    """Raise ValueError unless PRelu's slope broadcasts to X (unidirectionally)."""
    if not _broadcasts_to(tuple(slope), tuple(x)):
        raise ValueError(f"PRelu slope of shape {tuple(slope)} does not broadcast to X {tuple(x)}")


def check_clip_bound(name: str, size: int, shape: Sequence[int]) -> None:
    """Raise ValueError unless a Clip bound input is a scalar (one element)."""
    if size != 1:
        raise ValueError(f"Clip {name} must be a scalar, got shape {tuple(shape)}")
