"""Detection ops on the cuda backend: RoiAlign and NonMaxSuppression's computation (their
signatures, attributes and checks are kernels/common/detection.py's).

RoiAlign samples every ROI at once: one gather of feature-map rows per (corner, sample row),
each covering all ROIs, bins, sample columns and channels. With an adaptive sampling grid
(sampling_ratio 0) each ROI's grid size differs; the largest is read on the host (it sizes the
loop) and the samples past an ROI's own grid are masked out.

NonMaxSuppression's greedy selection is computed for every (batch, class) pair at once, as the
fixed point of one whole-matrix step over a precomputed "suppresses" relation between ranked
boxes (see _greedy), read from one IoU matrix per batch. The number of selected boxes decides the
output's shape, so it is read on the host at the end, as are the scalar limit and threshold inputs and, with a score threshold, the
number of boxes above it.
"""

from __future__ import annotations

import numpy as np
import torch

from tensorkiln.kernels.common.detection import DetectionOps
from tensorkiln.kernels.cuda.convert import host_list
from tensorkiln.kernels.registry import register

f64 = torch.float64

# ---------------------------------------------------------------------------------------------
# RoiAlign
# ---------------------------------------------------------------------------------------------


def _bilinear_taps(s: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Low/high indices and their weights (each stacked on a new first axis) for sample positions
    ``s`` along an axis of ``size``; samples more than one pixel outside weigh zero."""
    empty = (s < -1.0) | (s > size)
    s = s.clamp(min=0.0)
    low = torch.floor(s).to(torch.int64)
    at_end = low >= size - 1
    low = torch.where(at_end, size - 1, low)
    high = torch.where(at_end, size - 1, low + 1)
    s = torch.where(at_end, low.to(s.dtype), s)
    frac = s - low
    keep = ~empty
    return torch.stack([low, high]), torch.stack([(1 - frac) * keep, frac * keep])


def _samples(start, length, grid, pooled: int, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample positions (R, pooled, most) along one axis, and which exist (g < the ROI's grid)."""
    bin_size = (length / pooled)[:, None, None]
    p = torch.arange(pooled, device=start.device, dtype=f64)[None, :, None]
    g = torch.arange(most, device=start.device, dtype=f64)[None, None, :]
    step = bin_size / grid.clamp(min=1).to(f64)[:, None, None]
    pos = start[:, None, None] + p * bin_size + (g + 0.5) * step
    return pos, (g < grid[:, None, None]).expand(pos.shape)


def _grid_size(extent: torch.Tensor, pooled: int, ratio: int) -> tuple[torch.Tensor, int]:
    """Each ROI's sample count along an axis, and the largest (read on the host)."""
    if ratio > 0:
        return torch.full_like(extent, ratio, dtype=torch.int64), ratio
    grid = torch.ceil(extent / pooled).clamp(min=0).to(torch.int64)
    return grid, int(grid.max().item()) if grid.numel() else 0


def _roi_align(x, rois, batch_indices, mode, out_h, out_w, ratio, scale, half):
    c, height, width = x.shape[1:]
    if rois.shape[0] == 0:
        return x.new_zeros(0, c, out_h, out_w)
    ct = torch.float64 if x.dtype == f64 else torch.float32
    boxes = rois.to(f64) * scale - (0.5 if half else 0.0)
    x1, y1, x2, y2 = boxes.unbind(1)
    rh, rw = y2 - y1, x2 - x1
    if not half:  # legacy mode: force malformed ROIs to be at least 1x1
        rh, rw = rh.clamp(min=1.0), rw.clamp(min=1.0)
    gh, most_h = _grid_size(rh, out_h, ratio)
    gw, most_w = _grid_size(rw, out_w, ratio)
    sy, ok_y = _samples(y1, rh, gh, out_h, most_h)  # (R, out_h, most_h)
    sx, ok_x = _samples(x1, rw, gw, out_w, most_w)
    iy, wy = _bilinear_taps(sy, height)  # (2, R, out_h, most_h)
    ix, wx = _bilinear_taps(sx, width)
    # columns: (R, out_w, 2 * most_w) over both x corners and every sample column
    cols = ix.permute(1, 2, 0, 3).reshape(len(rois), out_w, -1)
    wcol = (wx * ok_x).permute(1, 2, 0, 3).reshape(len(rois), out_w, -1)
    ok_col = ok_x[None].expand(2, *ok_x.shape).permute(1, 2, 0, 3).reshape(wcol.shape)
    fmap = x.permute(0, 2, 3, 1).reshape(-1, c).to(ct)  # (N * H * W, C)
    base = batch_indices.reshape(-1).to(torch.int64) * (height * width)
    out = None
    for a in range(2):
        for g in range(most_h):
            rows = base[:, None] + iy[a, :, :, g] * width  # (R, out_h)
            flat = rows[:, :, None, None] + cols[:, None]  # (R, out_h, out_w, S)
            w = (wy[a, :, :, g] * ok_y[:, :, g])[:, :, None, None] * wcol[:, None]
            vals = fmap[flat] * w[..., None].to(ct)  # (R, out_h, out_w, S, C)
            if mode == "avg":
                part = vals.sum(dim=3)
                out = part if out is None else out + part
            else:
                valid = (ok_y[:, :, g, None, None] & ok_col[:, None])[..., None]
                part = vals.masked_fill(~valid, -torch.inf).amax(dim=3)
                out = part if out is None else torch.maximum(out, part)
    if out is None:  # no samples at all
        return x.new_zeros(len(rois), c, out_h, out_w)
    if mode == "avg":
        out = out / (gh * gw).clamp(min=1).to(ct)[:, None, None, None]
    else:
        out = torch.where(torch.isinf(out) & (out < 0), 0.0, out)
    return out.permute(0, 3, 1, 2).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# NonMaxSuppression
# ---------------------------------------------------------------------------------------------


def _corners(boxes: torch.Tensor, center_point_box: int) -> torch.Tensor:
    """Boxes as (y_min, x_min, y_max, x_max), whichever corners or centers they were given as."""
    b = boxes.to(f64)
    if center_point_box:
        xc, yc, w, h = b.unbind(-1)
        return torch.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], dim=-1)
    y = b[..., [0, 2]].sort(dim=-1).values
    x = b[..., [1, 3]].sort(dim=-1).values
    return torch.stack([y[..., 0], x[..., 0], y[..., 1], x[..., 1]], dim=-1)


def _area(b: torch.Tensor) -> torch.Tensor:
    return (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])


def _iou(one: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """IoU of each box ``one`` (N, K, 4) with every box of its batch ``others`` (N, B, 4) as
    (N, K, B); 0 where either box has no area."""
    a, b = one[:, :, None, :], others[:, None, :, :]
    h = torch.minimum(a[..., 2], b[..., 2]) - torch.maximum(a[..., 0], b[..., 0])
    w = torch.minimum(a[..., 3], b[..., 3]) - torch.maximum(a[..., 1], b[..., 1])
    inter = torch.where((h > 0) & (w > 0), h * w, 0.0)
    area, areas = _area(a), _area(b)
    union = area + areas - inter
    ok = (area > 0) & (areas > 0) & (union > 0) & (inter > 0)
    return torch.where(ok, inter / torch.where(ok, union, 1.0), 0.0)


def _nms(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    limit: int,
    iou_thr: float,
    score_thr: float | None,
    center_point_box: int,
) -> torch.Tensor:
    """The greedy selection of NonMaxSuppression (see the module)."""
    n, classes, count = scores.shape
    device = scores.device
    if limit <= 0 or count == 0 or n * classes == 0:
        return torch.zeros((0, 3), dtype=torch.int64, device=device)
    s = scores.to(f64)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # (N, classes, B)
    eligible = torch.ones_like(s, dtype=torch.bool) if score_thr is None else s > score_thr
    # the eligible boxes come first in score order: no rank past the longest run matters
    ranks = count if score_thr is None else int(eligible.sum(dim=-1).max().item())
    order = order[:, :, :ranks]
    eligible = torch.gather(eligible, 2, order)  # by rank from here on
    overlaps = _overlaps(_corners(boxes, center_point_box), iou_thr)  # (N, B, B) by box index
    batch = torch.arange(n, device=device)[:, None, None, None]
    later = torch.ones(ranks, ranks, dtype=torch.bool, device=device).triu(diagonal=1)
    # beats[n, c, i, j]: the box of rank i suppresses the one of rank j when it is kept
    beats = overlaps[batch, order[:, :, :, None], order[:, :, None, :]] & later
    kept = _greedy(eligible.reshape(n * classes, ranks), beats.reshape(n * classes, ranks, ranks))
    kept = kept.reshape(n, classes, ranks)
    kept &= kept.cumsum(dim=-1) <= limit
    nb, cls, rank = kept.nonzero(as_tuple=True)
    return torch.stack([nb, cls, order[nb, cls, rank]], dim=1)


_PAIRS_PER_CHUNK = 1 << 24


def _overlaps(corners: torch.Tensor, iou_thr: float) -> torch.Tensor:
    """(N, B, B) bool: IoU above the threshold, for every pair of boxes of each batch; built a
    block of rows at a time to bound the float64 IoU temporaries."""
    count = corners.shape[1]
    step = max(1, _PAIRS_PER_CHUNK // max(count, 1))
    rows = [_iou(corners[:, i : i + step], corners) > iou_thr for i in range(0, count, step)]
    return torch.cat(rows, dim=1)


def _greedy(eligible: torch.Tensor, beats: torch.Tensor) -> torch.Tensor:
    """The greedy selection (G, R) as the fixed point of "kept = eligible and not suppressed by a
    kept better box": iteration t settles at least the first t ranks, and real boxes settle in a
    few iterations (the longest chain of suppressions), each a whole-matrix step on the device.
    Whether it moved is read on the host after each iteration."""
    kept = eligible
    for _ in range(eligible.shape[-1]):
        hit = (kept[:, :, None] & beats).any(dim=1)
        nxt = eligible & ~hit
        if torch.equal(nxt, kept):
            break
        kept = nxt
    return kept


def _items(x: torch.Tensor) -> list:
    return np.ravel(host_list(x)).tolist()  # the scalar limits: read on the host


OPS = DetectionOps(_roi_align, _nms, _items)
register("RoiAlign", since=10, backend="cuda")(OPS.roi_align)
register("NonMaxSuppression", since=10, backend="cuda")(OPS.non_max_suppression)
