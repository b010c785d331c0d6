"""Backend-neutral checks of the normalizations (LayerNorm, RMSNorm and their ONNX forms)."""

from __future__ import annotations


def norm_axis(axis: int, rank: int, op: str) -> int:
    """``axis`` as a non-negative axis of a ``rank``-D input; ValueError when out of range."""
    if not -rank <= axis < rank:
        raise ValueError(f"{op}: axis {axis} is out of range for an input of rank {rank}")
    return axis % rank
