"""Element types of tensors.

:class:`DType` mirrors ONNX's ``TensorProto.DataType`` codes (so conversion is the identity) and knows
the host numpy dtype of each type; ml_dtypes provides bfloat16, the float8/6/4 formats and the sub-byte
integers.
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class DType(enum.IntEnum):
    """A tensor element type; values are ONNX TensorProto.DataType codes."""

    FLOAT = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    STRING = 8
    BOOL = 9
    FLOAT16 = 10
    DOUBLE = 11
    UINT32 = 12
    UINT64 = 13
    COMPLEX64 = 14
    COMPLEX128 = 15
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20
    UINT4 = 21
    INT4 = 22
    FLOAT4E2M1 = 23
    FLOAT8E8M0 = 24
    UINT2 = 25
    INT2 = 26
    FLOAT6E2M3 = 27
    FLOAT6E3M2 = 28

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype that holds this type on the host."""
        return _TO_NUMPY[self]

    @property
    def short(self) -> str:
        """A short lowercase name for printing: f32, f16, bf16, i64, ..."""
        return _SHORT[self]

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_integer(self) -> bool:
        return self in _INTEGERS

    @property
    def bits(self) -> int:
        """Bits per element (8 * itemsize; 4 for int4, 2 for int2, ...)."""
        return _BITS.get(self, 8 * _TO_NUMPY[self].itemsize)

    @classmethod
    def from_numpy(cls, dtype: np.dtype | type) -> DType:
        """The DType of a numpy dtype; raises TypeError for dtypes ONNX has no type for."""
        dtype = np.dtype(dtype)
        if dtype.kind in "OUS":
            return cls.STRING
        try:
            return _FROM_NUMPY[dtype]
        except KeyError:
            raise TypeError(f"numpy dtype {dtype} has no ONNX element type") from None


_TO_NUMPY: dict[DType, np.dtype] = {
    DType.FLOAT: np.dtype(np.float32),
    DType.UINT8: np.dtype(np.uint8),
    DType.INT8: np.dtype(np.int8),
    DType.UINT16: np.dtype(np.uint16),
    DType.INT16: np.dtype(np.int16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.STRING: np.dtype(object),
    DType.BOOL: np.dtype(np.bool_),
    DType.FLOAT16: np.dtype(np.float16),
    DType.DOUBLE: np.dtype(np.float64),
    DType.UINT32: np.dtype(np.uint32),
    DType.UINT64: np.dtype(np.uint64),
    DType.COMPLEX64: np.dtype(np.complex64),
    DType.COMPLEX128: np.dtype(np.complex128),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DType.FLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.FLOAT8E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    DType.FLOAT8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    DType.FLOAT8E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
    DType.UINT4: np.dtype(ml_dtypes.uint4),
    DType.INT4: np.dtype(ml_dtypes.int4),
    DType.FLOAT4E2M1: np.dtype(ml_dtypes.float4_e2m1fn),
    DType.FLOAT8E8M0: np.dtype(ml_dtypes.float8_e8m0fnu),
    DType.UINT2: np.dtype(ml_dtypes.uint2),
    DType.INT2: np.dtype(ml_dtypes.int2),
    DType.FLOAT6E2M3: np.dtype(ml_dtypes.float6_e2m3fn),
    DType.FLOAT6E3M2: np.dtype(ml_dtypes.float6_e3m2fn),
}
_FROM_NUMPY = {v: k for k, v in _TO_NUMPY.items() if k != DType.STRING}
_SHORT = {
    DType.FLOAT: "f32",
    DType.UINT8: "u8",
    DType.INT8: "i8",
    DType.UINT16: "u16",
    DType.INT16: "i16",
    DType.INT32: "i32",
    DType.INT64: "i64",
    DType.STRING: "str",
    DType.BOOL: "bool",
    DType.FLOAT16: "f16",
    DType.DOUBLE: "f64",
    DType.UINT32: "u32",
    DType.UINT64: "u64",
    DType.COMPLEX64: "c64",
    DType.COMPLEX128: "c128",
    DType.BFLOAT16: "bf16",
    DType.FLOAT8E4M3FN: "f8e4m3fn",
    DType.FLOAT8E4M3FNUZ: "f8e4m3fnuz",
    DType.FLOAT8E5M2: "f8e5m2",
    DType.FLOAT8E5M2FNUZ: "f8e5m2fnuz",
    DType.UINT4: "u4",
    DType.INT4: "i4",
    DType.FLOAT4E2M1: "f4e2m1",
    DType.FLOAT8E8M0: "f8e8m0",
    DType.UINT2: "u2",
    DType.INT2: "i2",
    DType.FLOAT6E2M3: "f6e2m3",
    DType.FLOAT6E3M2: "f6e3m2",
}
_FLOATS = frozenset(
    {
        DType.FLOAT,
        DType.FLOAT16,
        DType.DOUBLE,
        DType.BFLOAT16,
        DType.FLOAT8E4M3FN,
        DType.FLOAT8E4M3FNUZ,
        DType.FLOAT8E5M2,
        DType.FLOAT8E5M2FNUZ,
        DType.FLOAT4E2M1,
        DType.FLOAT8E8M0,
        DType.FLOAT6E2M3,
        DType.FLOAT6E3M2,
    }
)
_INTEGERS = frozenset(
    {
        DType.UINT8,
        DType.INT8,
        DType.UINT16,
        DType.INT16,
        DType.INT32,
        DType.INT64,
        DType.UINT32,
        DType.UINT64,
        DType.UINT4,
        DType.INT4,
        DType.UINT2,
        DType.INT2,
    }
)
_BITS = {
    DType.UINT4: 4,
    DType.INT4: 4,
    DType.FLOAT4E2M1: 4,
    DType.UINT2: 2,
    DType.INT2: 2,
    DType.FLOAT6E2M3: 6,
    DType.FLOAT6E3M2: 6,
    DType.BOOL: 8,
    DType.STRING: 0,
}
