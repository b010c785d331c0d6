"""The tensorkiln IR: :class:`Graph`, :class:`Node`, :class:`Value`, element types and dimensions."""

from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import (
    Dim,
    Graph,
    Node,
    OptionalType,
    SequenceType,
    Shape,
    TensorType,
    Type,
    Value,
    node_reads,
)

__all__ = [
    "DType",
    "Dim",
    "Graph",
    "Node",
    "OptionalType",
    "SequenceType",
    "Shape",
    "TensorType",
    "Type",
    "Value",
    "node_reads",
]
