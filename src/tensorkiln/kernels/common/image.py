"""Backend-neutral checks of the image kernels (GridSample), shared by the reference and cuda
trees. Resize and Upsample have theirs in :mod:`tensorkiln.kernels.common.resize`."""

from __future__ import annotations

from collections.abc import Sequence

# GridSample-16 takes 4-D inputs and names its modes bilinear / nearest / bicubic; from 20 on,
# N-d inputs and the modes linear / nearest / cubic.
GRID_SAMPLE_ND = 20
_GRID_MODES_16 = {"bilinear": "linear", "nearest": "nearest", "bicubic": "cubic"}
_GRID_MODES_20 = ("linear", "nearest", "cubic")


def grid_sample_mode(mode: str, shape: Sequence[int], opset: int) -> str:
    """GridSample's ``mode`` as the N-d modes name it, after checking it and the input's
    ``shape`` against what ``opset`` allows."""
    shape = tuple(shape)
    if opset < GRID_SAMPLE_ND:
        if mode not in _GRID_MODES_16:
            raise ValueError(
                f"GridSample-16: mode '{mode}' is not one of {', '.join(_GRID_MODES_16)}"
            )
        if len(shape) != 4:
            raise ValueError(f"GridSample-16: input must be 4-D, got shape {shape}")
        return _GRID_MODES_16[mode]
    if mode not in _GRID_MODES_20:
        raise ValueError(f"GridSample: mode '{mode}' is not one of linear, nearest, cubic")
    if len(shape) < 3:
        raise ValueError(f"GridSample: input must have a spatial axis, got shape {shape}")
    return mode
