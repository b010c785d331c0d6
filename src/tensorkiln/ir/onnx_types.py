"""Conversion between IR types and ONNX TypeProtos (both directions)."""

from __future__ import annotations

import re

import onnx

from tensorkiln.ir.dims import fresh_dim
from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import OptionalType, SequenceType, TensorType, Type


def from_type_proto(tp: onnx.TypeProto | None) -> Type | None:
    """An IR type from an ONNX TypeProto (None where ONNX leaves it unspecified).

    A dimension with neither a (non-negative) value nor a name, or whose name is only a marker for
    "unknown" ("?", "-1", ...), gets a fresh anonymous symbol of its own.
    """
    if tp is None:
        return None
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        tt = tp.tensor_type
        dtype = DType(tt.elem_type) if tt.elem_type in DType._value2member_map_ else None
        shape = None
        if tt.HasField("shape"):
            shape = tuple(_dim(d) for d in tt.shape.dim)
        return TensorType(dtype, shape)
    if kind == "sequence_type":
        elem = tp.sequence_type.elem_type
        return SequenceType(from_type_proto(elem) if elem.WhichOneof("value") else None)
    if kind == "optional_type":
        elem = tp.optional_type.elem_type
        return OptionalType(from_type_proto(elem) if elem.WhichOneof("value") else None)
    return None


# dim_params that mark a size as unknown rather than name it: paddle2onnx writes "?" on every
# dynamic axis, other exporters "-1", "None" or "unk". Two such axes are not the same size
# (onnxruntime treats each as its own unknown), so each gets a fresh symbol instead of one shared
# name. A bare number is no name either (it would read as a constant factor in a product).
_ANONYMOUS_PARAM = re.compile(r"[\s?*_-]*|-?\d+|none|null|unk|unknown", re.IGNORECASE)


def is_anonymous_param(param: str) -> bool:
    """Whether a dim_param is a marker for "some size" rather than a symbol's name."""
    return _ANONYMOUS_PARAM.fullmatch(param.strip()) is not None


def _dim(d: onnx.TensorShapeProto.Dimension) -> int | str:
    if d.HasField("dim_value") and d.dim_value >= 0:
        return int(d.dim_value)  # (ONNX inference can say -1 for "unknown": a fresh symbol below)
    if d.HasField("dim_param") and not is_anonymous_param(d.dim_param):
        return d.dim_param
    return fresh_dim()


def type_to_proto(t: Type | None) -> onnx.TypeProto:
    """An ONNX TypeProto for an IR type (symbolic dims become dim_params)."""
    tp = onnx.TypeProto()
    if isinstance(t, TensorType):
        tp.tensor_type.elem_type = int(t.dtype) if t.dtype is not None else 0
        if t.shape is not None:
            shape = tp.tensor_type.shape
            shape.SetInParent()
            for d in t.shape:
                dim = shape.dim.add()
                if isinstance(d, int):
                    dim.dim_value = d
                else:
                    dim.dim_param = d
    elif isinstance(t, SequenceType):
        tp.sequence_type.elem_type.CopyFrom(type_to_proto(t.elem))
    elif isinstance(t, OptionalType):
        tp.optional_type.elem_type.CopyFrom(type_to_proto(t.elem))
    return tp
