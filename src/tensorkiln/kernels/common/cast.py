"""ONNX data types as numpy dtypes, for the Cast kernels of every backend."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

STRING = np.dtype(object)  # strings are object arrays of Python str


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
