"""The checks of RoiAlign and NonMaxSuppression, written once for both kernel trees.

They read shapes and attributes (and scalars the caller has already read on the host), never a
tensor's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Shape = Sequence[int]

_COORDINATE_MODES = ("half_pixel", "output_half_pixel")


def roi_half_pixel(coordinate_transformation_mode: str | None, opset: int) -> bool:
    """Whether RoiAlign shifts pixel coordinates by half a pixel: never in RoiAlign-10 (its
    output_half_pixel), by default from opset 16 (coordinate_transformation_mode half_pixel)."""
    mode = coordinate_transformation_mode
    if mode is None:
        mode = "half_pixel" if opset >= 16 else "output_half_pixel"
    if mode not in _COORDINATE_MODES:
        raise ValueError(
            f"RoiAlign: coordinate_transformation_mode '{mode}' is not one of "
            f"{', '.join(_COORDINATE_MODES)}"
        )
    return mode == "half_pixel"


def check_roi_align(mode: str, x: Shape, rois: Shape, n_indices: int) -> None:
    """RoiAlign's mode, X (N, C, H, W), rois (R, 4) and one batch index per roi."""
    if mode not in ("avg", "max"):
        raise ValueError(f"RoiAlign: mode '{mode}' is not one of avg, max")
    if len(x) != 4 or len(rois) != 2 or rois[1] != 4:
        raise ValueError(
            f"RoiAlign: need X (N, C, H, W) and rois (R, 4); got {tuple(x)}, {tuple(rois)}"
        )
    if n_indices != rois[0]:
        raise ValueError(f"RoiAlign: batch_indices has {n_indices} values for {rois[0]} rois")


def check_nms(boxes: Shape, scores: Shape) -> None:
    """NonMaxSuppression's boxes (N, B, 4) and scores (N, classes, B)."""
    if len(boxes) != 3 or boxes[2] != 4 or len(scores) != 3:
        raise ValueError(
            "NonMaxSuppression: need boxes (N, B, 4) and scores (N, classes, B); got "
            f"{tuple(boxes)} and {tuple(scores)}"
        )
    if scores[0] != boxes[0] or scores[2] != boxes[1]:
        raise ValueError(
            f"NonMaxSuppression: boxes {tuple(boxes)} and scores {tuple(scores)} differ"
        )


def nms_scalar(values: list[Any] | None, shape: Shape, name: str) -> Any:
    """The one value of NonMaxSuppression's optional scalar input ``name`` (its host values
    and shape), or None when it is absent or empty."""
    if values is None or not values:
        return None
    if len(values) != 1:
        raise ValueError(
            f"NonMaxSuppression: '{name}' must hold one value, got shape {tuple(shape)}"
        )
    return values[0]
