"""Cast, CastLike and BitCast reference kernels.

Narrow types are ml_dtypes dtypes (what onnx.numpy_helper returns too): bfloat16, float8 e4m3fn /
e4m3fnuz / e5m2 / e5m2fnuz / e8m0fnu, float4 e2m1fn, int4/uint4, int2/uint2. Strings are object
arrays of Python str.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tensorkiln.kernels.common.cast import FLOAT8, STRING, onnx_dtype
from tensorkiln.kernels.registry import register

_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# types narrower than their one-byte storage (ml_dtypes keeps the bits in the low end of the byte)
_SUB_BYTE_BITS = {
    np.dtype(ml_dtypes.int4): 4,
    np.dtype(ml_dtypes.uint4): 4,
    np.dtype(ml_dtypes.float4_e2m1fn): 4,
    np.dtype(ml_dtypes.int2): 2,
    np.dtype(ml_dtypes.uint2): 2,
}
_OBJECT = STRING


def _to_string(x: np.ndarray) -> np.ndarray:
    """Numbers as text the way onnxruntime writes them: floats with 8 significant digits
    ("0.5", "1.2345679e+08", "INF", "-INF", "NaN"), integers in full, bools as "1"/"0"."""
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    if x.dtype.kind in "iu":
        return x.astype(np.str_).astype(object)
    v = x.astype(np.float64)
    text = np.char.mod("%.8g", v).astype(object)
    text[np.isnan(v)] = "NaN"
    text[np.isposinf(v)] = "INF"
    text[np.isneginf(v)] = "-INF"
    return text


def _parse(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"Cast: cannot convert the string {s!r} to a number") from None


def _from_string(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Parse text as numbers; integers are read exactly when they are written as integers."""
    if dtype == _OBJECT:
        return x.copy()
    flat = x.reshape(-1).tolist()
    if dtype.kind in "iu":
        try:
            return np.array([int(s) for s in flat], dtype=np.int64).astype(dtype).reshape(x.shape)
        except ValueError:
            pass
    values = np.array([_parse(s) for s in flat], dtype=np.float64).reshape(x.shape)
    return _cast_number(values, dtype, True, "up")


def _to_e8m0(x: np.ndarray, saturate: bool, round_mode: str) -> np.ndarray:
    """Round float32 values to powers of two (e8m0 keeps only the exponent byte)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.uint16)
    special = exponent == 0xFF  # inf and NaN
    if round_mode == "up":
        up = (bits & 0x7FFFFF) != 0
    elif round_mode == "nearest":
        # round on the mantissa's top bit; ties go up except below the smallest normal
        half = (bits & 0x400000) != 0
        rest = (bits & 0x3FFFFF) != 0
        up = half & (rest | (exponent > 0))
    elif round_mode == "down":
        up = np.zeros(bits.shape, dtype=bool)
    else:
        raise ValueError(f"Cast round_mode must be 'up', 'down' or 'nearest', got {round_mode!r}")
    if saturate:
        up &= exponent != 0xFE
    exponent += up & ~special
    out = np.minimum(exponent, 0xFF).astype(np.uint8)
    if saturate:
        out[np.isinf(x)] = 0xFE
    return out.view(_E8M0)


def _cast_number(x: np.ndarray, dtype: np.dtype, saturate: bool, round_mode: str) -> np.ndarray:
    if dtype == _E8M0:
        return _to_e8m0(x, saturate, round_mode)
    if dtype in FLOAT8 and saturate:
        # clip to the finite range first: inf and out-of-range values saturate, NaN stays NaN
        if x.dtype.kind != "f" or x.dtype.itemsize < 2:
            x = x.astype(np.float32)
        bound = float(ml_dtypes.finfo(dtype).max)
        x = np.clip(x, -bound, bound)
    return x.astype(dtype)


def cast_to(
    x: np.ndarray, dtype: np.dtype, saturate: int = 1, round_mode: str = "up"
) -> np.ndarray:
    """``x`` converted to numpy ``dtype`` (the other backends' host path for the types they
    cannot hold: strings, 4- and 2-bit types, float8e8m0)."""
    if x.dtype == dtype:
        return x.copy()
    if dtype == _OBJECT:
        return _to_string(x)
    if x.dtype == _OBJECT:
        return _from_string(x, dtype)
    return np.asarray(_cast_number(x, dtype, bool(saturate), round_mode))


@register("Cast", since=1)
def cast(x: np.ndarray, *, to: int | str, saturate: int = 1, round_mode: str = "up") -> np.ndarray:
    """``x`` converted to the type ``to``; ``saturate`` and ``round_mode`` govern float8 results."""
    return cast_to(x, onnx_dtype(to), saturate, round_mode)


@register("CastLike", since=15)
def cast_like(
    x: np.ndarray, target_type: np.ndarray, *, saturate: int = 1, round_mode: str = "up"
) -> np.ndarray:
    """``x`` converted to the element type of ``target_type``."""
    return cast_to(x, target_type.dtype, saturate, round_mode)


@register("BitCast", since=26)
def bit_cast(x: np.ndarray, *, to: int) -> np.ndarray:
    """The bits of ``x`` reinterpreted as type ``to``, which must have the same width."""
    dtype = onnx_dtype(to)
    if dtype == _OBJECT or x.dtype == _OBJECT:
        raise ValueError("BitCast does not support strings")
    if _bit_width(dtype) != _bit_width(x.dtype):
        raise ValueError(f"BitCast needs types of the same bit width, got {x.dtype} and {dtype}")
    return x.copy(order="C").view(dtype)


def _bit_width(dtype: np.dtype) -> int:
    return _SUB_BYTE_BITS.get(dtype, dtype.itemsize * 8)
