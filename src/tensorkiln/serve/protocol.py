"""The KServe v2 / Triton protocol messages, and the mapping between its data types and numpy's.

The messages come from the protocol's published definitions (proto/*.proto, vendored from Triton's
common repository), compiled into a descriptor set (proto/kserve.binpb, made by
scripts/gen_serve_protos.sh). Message classes are built from it at import, in a descriptor pool of
their own: no generated code tied to one protobuf release, and no clash with the copies of the same
messages that tritonclient registers in protobuf's default pool.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

DESCRIPTORS = Path(__file__).resolve().parent / "proto" / "kserve.binpb"

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


def datatype_of(dtype: np.dtype) -> str | None:
    """The protocol datatype of a numpy dtype, or None where the protocol has none."""
    return _DATATYPES.get(np.dtype(dtype))
