"""Cast, CastLike and BitCast of the cuda backend, matching ``kernels/reference/cast.py``.

Numbers convert on the device with torch's conversions, which round to nearest even. float8
targets need care: torch saturates some out-of-range values and not others (and differs between
CPU and CUDA), so the kernel decides itself: with ``saturate`` values clip to the finite range
first, without it values past the rounding limit become NaN, or infinity for float8e5m2, as ONNX
specifies. Strings and the 4-bit, 2-bit and float8e8m0 types have no torch dtype and stay numpy
arrays on the host; a cast from or to one of them runs the reference conversion on the host.
"""

from __future__ import annotations

import numpy as np
import torch

from tensorkiln.kernels.common.cast import onnx_dtype
from tensorkiln.kernels.cuda.convert import numpy_dtype, on_device, to_numpy, to_torch, torch_dtype
from tensorkiln.kernels.cuda.elementwise import FLOAT8
from tensorkiln.kernels.reference import cast as ref  # the host path for types torch lacks
from tensorkiln.kernels.registry import register

Tensor = torch.Tensor

# float8 type -> (smallest magnitude that rounds past the largest finite value, whether that exact
# value does (a tie rounds up when the largest value's mantissa is odd), whether overflow gives
# infinity rather than NaN without saturation)
_OVERFLOW = {
    torch.float8_e4m3fn: (464.0, False, False),
    torch.float8_e4m3fnuz: (248.0, True, False),
    torch.float8_e5m2: (61440.0, True, True),
    torch.float8_e5m2fnuz: (61440.0, True, False),
}


def _to_float8(x: Tensor, target: torch.dtype, saturate: bool) -> Tensor:
    if x.dtype in FLOAT8 or not x.is_floating_point():
        x = x.float()
    if saturate:
        bound = float(torch.finfo(target).max)
        return x.clamp(-bound, bound).to(target)  # NaN stays NaN
    limit, inclusive, to_inf = _OVERFLOW[target]
    mag = x.abs()
    over = mag >= limit if inclusive else mag > limit
    # overflow decided here, so the conversion below only sees values it rounds in range
    fill = x * float("inf") if to_inf else torch.full((), float("nan"), device=x.device)
    return torch.where(over, fill.to(x.dtype), x).to(target)


def _host_cast(x: Tensor | np.ndarray, dtype: np.dtype, saturate: int, round_mode: str) -> object:
    """A cast from or to a type with no torch dtype, by the reference on the host."""
    device = x.device if isinstance(x, Tensor) else None
    return to_torch(ref.cast_to(to_numpy(x), dtype, saturate, round_mode), device)


def _cast(x: Tensor | np.ndarray, dtype: np.dtype, saturate: int, round_mode: str) -> object:
    if isinstance(x, np.ndarray) or not on_device(dtype):
        return _host_cast(x, dtype, saturate, round_mode)
    target = torch_dtype(dtype)
    if x.dtype == target:
        return x
    if target in FLOAT8:
        return _to_float8(x, target, bool(saturate))
    return x.to(target)


@register("Cast", since=1, backend="cuda")
def cast(
    x: Tensor | np.ndarray, *, to: int | str, saturate: int = 1, round_mode: str = "up"
) -> object:
    """``x`` converted to the type ``to``; ``saturate`` and ``round_mode`` govern float8 results."""
    return _cast(x, onnx_dtype(to), saturate, round_mode)


@register("CastLike", since=15, backend="cuda")
def cast_like(
    x: Tensor | np.ndarray,
    target_type: Tensor | np.ndarray,
    *,
    saturate: int = 1,
    round_mode: str = "up",
) -> object:
    """``x`` converted to the element type of ``target_type``."""
    if isinstance(target_type, np.ndarray):
        dtype = target_type.dtype
    else:
        dtype = numpy_dtype(target_type.dtype)
    return _cast(x, dtype, saturate, round_mode)


@register("BitCast", since=26, backend="cuda")
def bit_cast(x: Tensor | np.ndarray, *, to: int) -> object:
    """The bits of ``x`` reinterpreted as type ``to``, which must have the same width."""
    dtype = onnx_dtype(to)
    if isinstance(x, np.ndarray) or not on_device(dtype):
        device = x.device if isinstance(x, Tensor) else None
        return to_torch(ref.bit_cast(to_numpy(x), to=to), device)
    target = torch_dtype(dtype)
    if x.dtype.itemsize != target.itemsize:
        raise ValueError(f"BitCast needs types of the same bit width, got {x.dtype} and {target}")
    return x.view(target)
