"""The numpy side of the sliding-window kernels: padding a channels-first tensor, zero-copy
strided views of its windows, and the arithmetic dtype. The geometry itself (``auto_pad`` /
``pads`` / ``ceil_mode`` into pads and output sizes) is ops/window.py's, with the tap slices in
kernels/common/window.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np
from numpy.lib.stride_tricks import as_strided

from tensorkiln.kernels.common.window import Geometry


def pad(x: np.ndarray, begin: Sequence[int], end: Sequence[int], value: float = 0) -> np.ndarray:
    """Pad the trailing ``len(begin)`` axes of ``x`` with ``value`` (``x`` itself if no padding)."""
    if not any(begin) and not any(end):
        return x
    lead = x.ndim - len(begin)
    shape = x.shape[:lead] + tuple(s + b + e for s, b, e in zip(x.shape[lead:], begin, end))
    out = np.full(shape, value, dtype=x.dtype)
    inner = tuple(slice(b, b + s) for b, s in zip(begin, x.shape[lead:]))
    out[(Ellipsis, *inner)] = x
    return out


def windows(xp: np.ndarray, g: Geometry, kernel_first: bool = False) -> np.ndarray:
    """A read-only view of the windows of the padded tensor ``xp``.

    Shape ``(*lead, *out, *kernel)``, or ``(*lead, *kernel, *out)`` with ``kernel_first``.
    """
    n = len(g.kernel)
    lead_shape, lead_strides = xp.shape[:-n], xp.strides[:-n]
    sp = xp.strides[-n:]
    out_strides = tuple(a * s for a, s in zip(sp, g.strides))
    k_strides = tuple(a * d for a, d in zip(sp, g.dilations))
    if kernel_first:
        shape, strides = (*g.kernel, *g.out), (*k_strides, *out_strides)
    else:
        shape, strides = (*g.out, *g.kernel), (*out_strides, *k_strides)
    return as_strided(xp, lead_shape + shape, lead_strides + strides, writeable=False)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype to do arithmetic in: float32 for the narrow floats, else ``dtype`` itself."""
    if dtype == np.float16 or dtype == ml_dtypes.bfloat16 or dtype.itemsize == 1:
        return np.dtype(np.float32)
    return np.dtype(dtype)
