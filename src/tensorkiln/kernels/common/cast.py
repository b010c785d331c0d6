"""ONNX data types as numpy dtypes, for the Cast and quantization kernels of every backend."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper

STRING = np.dtype(object)  # strings are object arrays of Python str


def dtypes(*types: type | np.dtype) -> frozenset[np.dtype]:
    """The numpy dtypes of ``types``, as a set to test membership against."""
    return frozenset(np.dtype(t) for t in types)


# the four float8 types of the ONNX standard (float8e8m0 is a scale type: no saturation rules)
FLOAT8 = dtypes(
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e5m2fnuz,
)


def onnx_dtype(to: int | str) -> np.dtype:
    """The numpy dtype of an ONNX ``TensorProto.DataType`` (number, or name as opset 1 had it)."""
    if isinstance(to, str):
        try:
            to = TensorProto.DataType.Value(to.upper())
        except ValueError:
            raise ValueError(f"Cast: unknown data type name {to!r}") from None
    if to == TensorProto.STRING:
        return STRING
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(to))
    except KeyError:
        raise ValueError(f"Cast: unsupported data type {to}") from None
