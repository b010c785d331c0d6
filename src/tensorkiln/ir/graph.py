"""The intermediate representation: three plain classes.

* :class:`Value` is an edge: a named tensor (or sequence / optional) with a type. A Value made from an
  initializer carries its data in ``const``.
* :class:`Node` is an operator application: op, domain, input Values (``None`` for an omitted optional
  input), output Values (``None`` for an omitted optional output), and attributes as plain Python
  values (``Graph`` for subgraphs, numpy arrays for tensors).
* :class:`Graph` holds inputs, outputs, nodes in topological order, initializers and the opset imports.

A node may also record how it is computed, once the builder's precision policy has decided it: its
``precision`` (one of :data:`PRECISIONS`) and the ``format`` of the tensors it reads and writes
(one of :data:`FORMATS`); ``None`` means not decided (float32, linear, before the builder runs).

Producer and consumer maps are computed on demand (:meth:`Graph.producers`, :meth:`Graph.consumers`);
nothing is kept in sync by hand. A subgraph (If/Loop/Scan body) refers to values of enclosing graphs by
using the very same Value objects.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from tensorkiln.ir.dtypes import DType

Dim = Union[int, str]  # noqa: UP007  (an int, or the name of a symbolic dimension)
Shape = tuple[Dim, ...]

# What a layer may compute in (TensorRT's DataType as a builder flag names it).
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "int8", "fp8")
# How a layer's tensors are laid out, as TensorRT's TensorFormat names them: "linear" is row-major
# (NCHW for images), "hwc" channels-last (NHWC), "chw<k>"/"hwc<k>" channel-vectorized by k.
FORMATS = (
    "linear", "chw2", "chw4", "chw16", "chw32", "hwc", "hwc8", "hwc16", "dhwc", "dhwc8", "cdhw32",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorType:
    """A tensor of ``dtype`` and ``shape`` (``None``: rank unknown; a str dim is symbolic)."""

    dtype: DType | None
    shape: Shape | None = None

    def __str__(self) -> str:
        dt = self.dtype.short if self.dtype is not None else "?"
        if self.shape is None:
            return f"{dt}[...]"
        return f"{dt}[{','.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True, slots=True)
class SequenceType:
    """A sequence of values of type ``elem``."""

    elem: TensorType | SequenceType | OptionalType | None

    def __str__(self) -> str:
        return f"seq<{self.elem if self.elem is not None else '?'}>"


@dataclass(frozen=True, slots=True)
class OptionalType:
    """A value of type ``elem`` or nothing."""

    elem: TensorType | SequenceType | OptionalType | None

    def __str__(self) -> str:
        return f"opt<{self.elem if self.elem is not None else '?'}>"


Type = Union[TensorType, SequenceType, OptionalType]  # noqa: UP007


@dataclass(eq=False, slots=True)
class Value:
    """An edge of the graph. Identity matters: two Values with one name are two different edges."""

    name: str
    type: Type | None = None
    const: np.ndarray | None = None

    @property
    def dtype(self) -> DType | None:
        return self.type.dtype if isinstance(self.type, TensorType) else None

    @property
    def shape(self) -> Shape | None:
        return self.type.shape if isinstance(self.type, TensorType) else None

    @property
    def is_const(self) -> bool:
        return self.const is not None

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {self.type})"


@dataclass(eq=False, slots=True)
class Node:
    """One operator application."""

    op: str
    inputs: list[Value | None]
    outputs: list[Value | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""
    name: str = ""
    precision: str | None = None  # what it computes in (PRECISIONS); None: not decided yet
    format: str | None = None  # its tensors' layout (FORMATS); None: not decided yet

    def subgraphs(self) -> Iterator[Graph]:
        """The graphs held by this node's attributes (If branches, Loop/Scan bodies)."""
        for v in self.attrs.values():
            if isinstance(v, Graph):
                yield v
            elif isinstance(v, list):
                yield from (g for g in v if isinstance(g, Graph))

    def __repr__(self) -> str:
        return f"Node({self.op!r}, name={self.name!r})"


@dataclass(eq=False, slots=True)
class Graph:
    """A computation: inputs -> nodes (in topological order) -> outputs."""

    name: str = "graph"
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    initializers: list[Value] = field(default_factory=list)
    opsets: dict[str, int] = field(default_factory=dict)
    doc: str = ""

    def opset(self, domain: str = "") -> int:
        """The opset version imported for ``domain`` ('' is the default ONNX domain)."""
        return self.opsets.get(domain, 1)

    def producers(self) -> dict[Value, Node]:
        """Map from each node output to the node that produces it."""
        return {v: n for n in self.nodes for v in n.outputs if v is not None}

    def consumers(self) -> dict[Value, list[Node]]:
        """Map from each value to the nodes of this graph that read it (subgraph reads included)."""
        out: dict[Value, list[Node]] = {}
        for n in self.nodes:
            for v in node_reads(n):
                out.setdefault(v, []).append(n)
        return out

    def values(self) -> list[Value]:
        """Every value defined in this graph (inputs, initializers, node outputs), in order."""
        seen: dict[Value, None] = dict.fromkeys(self.inputs)
        seen.update(dict.fromkeys(self.initializers))
        for n in self.nodes:
            seen.update(dict.fromkeys(v for v in n.outputs if v is not None))
        return list(seen)

    def walk(self) -> Iterator[tuple[Graph, Node]]:
        """Every (graph, node) pair, descending into subgraphs."""
        for n in self.nodes:
            yield self, n
            for g in n.subgraphs():
                yield from g.walk()

    def outer_refs(self) -> list[Value]:
        """Values this graph (or its subgraphs) reads that are defined in an enclosing graph."""
        defined = set(self.values())
        refs: dict[Value, None] = {}
        for n in self.nodes:
            for v in n.inputs:
                if v is not None and v not in defined:
                    refs[v] = None
            for g in n.subgraphs():
                refs.update(dict.fromkeys(r for r in g.outer_refs() if r not in defined))
        refs.update(dict.fromkeys(v for v in self.outputs if v not in defined))
        return list(refs)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.nodes)} nodes)"


def node_reads(node: Node) -> list[Value]:
    """The values a node reads: its inputs plus the outer values its subgraphs use."""
    reads = [v for v in node.inputs if v is not None]
    for g in node.subgraphs():
        reads.extend(g.outer_refs())
    return reads
