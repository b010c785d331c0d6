"""RoiAlign and NonMaxSuppression: their signatures, attributes and checks, written once for
both kernel trees (the computation is each backend's).

The checks read shapes and attributes (and scalars read on the host), never a tensor's values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


class DetectionOps:
    """RoiAlign and NonMaxSuppression's signatures, attributes and checks, written once; each
    backend supplies the computation (register the bound methods):

    * ``roi_align(x, rois, batch_indices, mode, out_h, out_w, sampling_ratio, scale, half)``
    * ``nms(boxes, scores, limit, iou_threshold, score_threshold, center_point_box)``
    * ``items(x)``: a small input's values as a flat host list (the scalar limits).
    """

    def __init__(self, roi_align: Callable, nms: Callable, items: Callable[[Any], list]) -> None:
        self._roi_align, self._nms, self._items = roi_align, nms, items

    def roi_align(
        self,
        x: Any,
        rois: Any,
        batch_indices: Any,
        *,
        coordinate_transformation_mode: str | None = None,
        mode: str = "avg",
        output_height: int = 1,
        output_width: int = 1,
        sampling_ratio: int = 0,
        spatial_scale: float = 1.0,
        _opset: int = 16,
    ) -> Any:
        """RoiAlign; coordinates shift by half a pixel by default from opset 16 (RoiAlign-10 has
        no coordinate_transformation_mode and never shifts)."""
        half = roi_half_pixel(coordinate_transformation_mode, _opset)
        check_roi_align(mode, x.shape, rois.shape, math.prod(batch_indices.shape))
        args = (mode, output_height, output_width, sampling_ratio, spatial_scale, half)
        return self._roi_align(x, rois, batch_indices, *args)

    def _scalar(self, v: Any, name: str) -> Any:
        return None if v is None else nms_scalar(self._items(v), v.shape, name)

    def non_max_suppression(
        self,
        boxes: Any,
        scores: Any,
        max_output_boxes_per_class: Any = None,
        iou_threshold: Any = None,
        score_threshold: Any = None,
        *,
        center_point_box: int = 0,
    ) -> Any:
        """Selected boxes as int64 rows (batch, class, box), per batch and class in score
        order."""
        check_nms(boxes.shape, scores.shape)
        limit = int(self._scalar(max_output_boxes_per_class, "max_output_boxes_per_class") or 0)
        iou_thr = float(self._scalar(iou_threshold, "iou_threshold") or 0.0)
        score_thr = self._scalar(score_threshold, "score_threshold")
        return self._nms(boxes, scores, limit, iou_thr, score_thr, center_point_box)
