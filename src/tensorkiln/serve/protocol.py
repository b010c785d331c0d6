"""The KServe v2 / Triton protocol messages, and the mapping between its data types and numpy's.

The messages come from the protocol's published definitions (proto/*.proto, vendored from Triton's
common repository), compiled into a descriptor set (proto/kserve.binpb, made by
scripts/gen_serve_protos.sh). Message classes are built from it at import, in a descriptor pool of
their own: no generated code tied to one protobuf release, and no clash with the copies of the same
messages that tritonclient registers in protobuf's default pool.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from tensorkiln.errors import TensorkilnError

DESCRIPTORS = Path(__file__).resolve().parent / "proto" / "kserve.binpb"
MAX_DIMS = 16  # sizes an input's shape may have


class ServeError(TensorkilnError):
    """An error to answer a request with: ``status`` is the HTTP status (the gRPC front end
    maps it to a status code)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# Triton's data types: the model configuration's TYPE_* enum names without the prefix are the
# protocol's datatype strings ("FP32", "INT64", "BYTES" for strings)
_NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
_DATATYPES = {np.dtype(t): name for name, t in _NUMPY.items()}
# (a GPU engine's outputs, and inputs in CUDA shared memory, are torch tensors)
_TORCH = {f"torch.{np.dtype(t).name}": name for name, t in _NUMPY.items()} | {"torch.bool": "BOOL"}


@cache
def _pool() -> descriptor_pool.DescriptorPool:
    files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTORS.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in files.file:
        pool.Add(f)
    return pool


@cache
def message(name: str) -> Any:
    """The message class of the protocol's ``name`` ("inference.ModelConfig", ...)."""
    return message_factory.GetMessageClass(_pool().FindMessageTypeByName(name))


def model_config() -> Any:
    """An empty ``inference.ModelConfig`` (Triton's config.pbtxt schema)."""
    return message("inference.ModelConfig")()


def config_type_name(value: int) -> str:
    """A ModelConfig data type as the protocol writes it: TYPE_FP32 -> "FP32"."""
    enum = _pool().FindEnumTypeByName("inference.DataType")
    return enum.values_by_number[value].name.removeprefix("TYPE_")


def config_type(name: str) -> int:
    """The ModelConfig DataType number of a protocol datatype ("FP32" or "TYPE_FP32")."""
    enum = _pool().FindEnumTypeByName("inference.DataType")
    key = name if name.startswith("TYPE_") else f"TYPE_{name}"
    value = enum.values_by_name.get(key)
    if value is None:
        raise KeyError(name)
    return value.number


def numpy_dtype(datatype: str) -> np.dtype | None:
    """numpy's dtype of a protocol datatype ("FP32"), or None where numpy has none (BYTES,
    BF16)."""
    t = _NUMPY.get(datatype)
    return None if t is None else np.dtype(t)


def datatype_of(dtype: Any) -> str | None:
    """The protocol datatype of a numpy (or torch) dtype, or None where the protocol has none."""
    try:  # (asked several times a request: the dtypes seen are remembered)
        return _SEEN[dtype]
    except (KeyError, TypeError):
        pass
    if not isinstance(dtype, np.dtype) and str(dtype).startswith("torch."):
        got = _TORCH.get(str(dtype))
    else:
        got = _DATATYPES.get(np.dtype(dtype))
    if len(_SEEN) < 64:
        _SEEN[dtype] = got
    return got


_SEEN: dict[Any, str | None] = {}


# ---------------------------------------------------------------------- request tensors
def declared(name: str, datatype: Any, shape: Any, limit: int) -> tuple[np.dtype, tuple[int, ...]]:
    """An input's declared datatype and shape, checked before any array is made: a datatype
    served here, a list of at most MAX_DIMS sizes of 0 or more, and at most ``limit`` bytes."""
    dtype = numpy_dtype(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise ServeError(f"input '{name}': datatype {str(datatype)[:20]!r} is not one served here")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ServeError(
            f"input '{name}': shape {str(shape)[:80]} must be a list of at most {MAX_DIMS} sizes"
        )
    if math.prod(shape) * dtype.itemsize > limit:
        raise ServeError(
            f"input '{name}': shape {shape} of {datatype} takes more than the {limit:,} bytes a "
            "request may have"
        )
    return dtype, tuple(shape)


def from_values(name: str, values: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """An input's values (JSON data, or gRPC typed contents) as an array: regular nesting,
    the shape's count, values of the datatype's kind, integers within its range."""
    if not isinstance(values, list):
        raise ServeError(f"input '{name}' has no data")
    try:
        flat = np.asarray(values, dtype=object).reshape(-1)  # (ragged nesting: ValueError)
    except ValueError as exc:
        raise ServeError(f"input '{name}': its data is not a regular array ({exc})") from None
    count = math.prod(shape)
    if flat.size != count:
        raise ServeError(
            f"input '{name}': {flat.size} values for shape {list(shape)} ({count} values)"
        )
    if dtype.kind == "b":
        ok = all(type(v) is bool for v in flat)
    elif dtype.kind in "iu":
        ok = all(type(v) is int for v in flat)
    else:
        ok = all(type(v) in (int, float) for v in flat)
    if not ok:
        raise ServeError(f"input '{name}': its data is not all {datatype_of(dtype)} values")
    if dtype.kind in "iu" and flat.size:
        info = np.iinfo(dtype)
        if min(flat) < info.min or max(flat) > info.max:
            raise ServeError(f"input '{name}': values outside {datatype_of(dtype)}'s range")
    return flat.astype(dtype).reshape(shape)
