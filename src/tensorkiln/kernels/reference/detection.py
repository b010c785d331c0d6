"""Detection ops on numpy arrays: RoiAlign and NonMaxSuppression's computation; their signatures,
attributes and checks are kernels/common/detection.py's."""

from __future__ import annotations

import numpy as np

from tensorkiln.kernels.common.detection import DetectionOps
from tensorkiln.kernels.registry import register

# ---------------------------------------------------------------------------------------------
# RoiAlign
# ---------------------------------------------------------------------------------------------


def _bilinear_taps(s: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Low/high indices and their weights for sample positions ``s`` along an axis of ``size``.

    Samples more than one pixel outside the map contribute zero (both weights are 0), as in
    Caffe2/onnxruntime's RoiAlign.
    """
    empty = (s < -1.0) | (s > size)
    s = np.maximum(s, 0.0)
    low = np.floor(s).astype(np.int64)
    at_end = low >= size - 1
    low = np.where(at_end, size - 1, low)
    high = np.where(at_end, size - 1, low + 1)
    s = np.where(at_end, low, s)
    frac = s - low
    keep = ~empty
    return np.stack([low, high]), np.stack([(1 - frac) * keep, frac * keep])


def _roi_samples(start: float, length: float, pooled: int, grid: int) -> np.ndarray:
    """Sample positions (pooled, grid) of one ROI along one axis."""
    bin_size = length / pooled
    p = np.arange(pooled)[:, None]
    g = np.arange(grid)[None, :]
    return start + p * bin_size + (g + 0.5) * bin_size / grid


def _one_roi(
    fmap: np.ndarray, box: np.ndarray, out_hw: tuple[int, int], ratio: int, half: bool, mode: str
) -> np.ndarray:
    """RoiAlign of one box (x1, y1, x2, y2 already scaled) over fmap (C, H, W)."""
    offset = 0.5 if half else 0.0
    x1, y1, x2, y2 = (float(v) - offset for v in box)
    rh, rw = y2 - y1, x2 - x1
    if not half:  # legacy mode: force malformed ROIs to be at least 1x1
        rh, rw = max(rh, 1.0), max(rw, 1.0)
    ph, pw = out_hw
    gh = ratio if ratio > 0 else int(np.ceil(rh / ph))
    gw = ratio if ratio > 0 else int(np.ceil(rw / pw))
    iy, wy = _bilinear_taps(_roi_samples(y1, rh, ph, gh), fmap.shape[1])  # (2, ph, gh)
    ix, wx = _bilinear_taps(_roi_samples(x1, rw, pw, gw), fmap.shape[2])  # (2, pw, gw)
    if mode == "avg":
        # Separable: each bin is (sum of y weights) x map x (sum of x weights) / count.
        my = np.zeros((ph, fmap.shape[1]))
        mx = np.zeros((pw, fmap.shape[2]))
        rows = np.broadcast_to(np.arange(ph)[None, :, None], iy.shape)
        cols = np.broadcast_to(np.arange(pw)[None, :, None], ix.shape)
        np.add.at(my, (rows, iy), wy)
        np.add.at(mx, (cols, ix), wx)
        return my @ fmap @ mx.T / max(gh * gw, 1)
    if gh * gw == 0:
        return np.zeros((fmap.shape[0], ph, pw))
    # max: the largest weighted corner value over every sample of the bin (onnxruntime's rule)
    best = None
    for a in range(2):
        for b in range(2):
            v = fmap[:, iy[a][:, :, None, None], ix[b][None, None, :, :]]  # (C, ph, gh, pw, gw)
            v = v * (wy[a][:, :, None, None] * wx[b][None, None, :, :])
            best = v if best is None else np.maximum(best, v)
    return best.max(axis=(2, 4))


def _roi_align(x, rois, batch_indices, mode, output_height, output_width, ratio, scale, half):
    batch = np.asarray(batch_indices).reshape(-1).astype(np.int64)
    if ((batch < 0) | (batch >= x.shape[0])).any():
        raise ValueError(
            f"RoiAlign: batch_indices {batch.tolist()} must hold one index in [0, {x.shape[0]}) "
            f"for each of the {rois.shape[0]} rois"
        )
    out = np.zeros((rois.shape[0], x.shape[1], output_height, output_width), np.float64)
    boxes = rois.astype(np.float64) * scale
    data = x.astype(np.float64)
    for r in range(rois.shape[0]):
        out[r] = _one_roi(
            data[batch[r]], boxes[r], (output_height, output_width), ratio, half, mode
        )
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# NonMaxSuppression
# ---------------------------------------------------------------------------------------------


def _corners(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """Boxes as (y_min, x_min, y_max, x_max), whichever corners or centers they were given as."""
    b = boxes.astype(np.float64)
    if center_point_box:
        xc, yc, w, h = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
        return np.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], axis=-1)
    y = np.sort(b[..., [0, 2]], axis=-1)
    x = np.sort(b[..., [1, 3]], axis=-1)
    return np.stack([y[..., 0], x[..., 0], y[..., 1], x[..., 1]], axis=-1)


def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """IoU of one corner box with many; 0 where either box has no area."""
    h = np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0])
    w = np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1])
    inter = np.where((h > 0) & (w > 0), h * w, 0.0)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = area + areas - inter
    ok = (area > 0) & (areas > 0) & (union > 0) & (inter > 0)
    return np.where(ok, inter / np.where(ok, union, 1.0), 0.0)


def _select(boxes: np.ndarray, scores: np.ndarray, limit: int, iou_thr: float, score_thr):
    """Greedy selection for one (batch, class): indices of kept boxes, best score first."""
    order = np.argsort(-scores, kind="stable")
    if score_thr is not None:
        order = order[scores[order] > score_thr]
    keep: list[int] = []
    while order.size and len(keep) < limit:
        best, order = order[0], order[1:]
        keep.append(int(best))
        order = order[_iou(boxes[best], boxes[order]) <= iou_thr]
    return keep


def _nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    limit: int,
    iou_thr: float,
    score_thr: float | None,
    center_point_box: int,
) -> np.ndarray:
    """The greedy selection of NonMaxSuppression, per batch and class in score order."""
    corners = _corners(boxes, center_point_box)
    rows = []
    for n in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            for b in _select(
                corners[n], scores[n, c].astype(np.float64), limit, iou_thr, score_thr
            ):
                rows.append((n, c, b))
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def _items(x: np.ndarray) -> list:
    return np.asarray(x).reshape(-1).tolist()


OPS = DetectionOps(_roi_align, _nms, _items)
register("RoiAlign", since=10)(OPS.roi_align)
register("NonMaxSuppression", since=10)(OPS.non_max_suppression)
