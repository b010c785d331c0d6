"""The graph verifier: run it after any transformation to catch broken graphs early."""

from __future__ import annotations

from tensorkiln.errors import GraphError
from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import FORMATS, PRECISIONS, Graph, Node, TensorType, Value


def verify(graph: Graph, outer: frozenset[Value] = frozenset()) -> None:
    """Check structure and types; raise GraphError naming the first problem found.

    Checks: every value read is defined earlier (topological order) in this graph or an enclosing
    one; no value is defined twice; outputs are defined; constants match their declared types;
    a node's precision and format, where recorded, are known names; subgraphs recursively.
    """
    defined: set[Value] = set()
    where = f"graph '{graph.name}'"

    def define(v: Value, what: str) -> None:
        if v in defined or v in outer:
            raise GraphError(f"{where}: value '{v.name}' is defined twice (again as {what})")
        defined.add(v)

    for v in graph.inputs:
        define(v, "graph input")
    for v in graph.initializers:
        define(v, "initializer")
        _check_const(v, where)
    for node in graph.nodes:
        _check_layer_fields(node, where)
        for i, v in enumerate(node.inputs):
            if v is not None and v not in defined and v not in outer:
                raise GraphError(
                    f"{where}: node '{node.name}' ({node.op}) input {i} '{v.name}' is not defined "
                    "before the node (dangling value or nodes out of topological order)"
                )
        visible = frozenset(defined | outer)
        for sub in node.subgraphs():
            verify(sub, visible)
        for v in node.outputs:
            if v is not None:
                define(v, f"output of node '{node.name}'")
    for v in graph.outputs:
        if v not in defined and v not in outer:
            raise GraphError(f"{where}: output '{v.name}' is not defined by the graph")


def _check_layer_fields(node: Node, where: str) -> None:
    """The precision and format a policy recorded on ``node`` must be ones the project knows."""
    for what, x, known in (
        ("precision", node.precision, PRECISIONS),
        ("format", node.format, FORMATS),
    ):
        if x is not None and x not in known:
            raise GraphError(
                f"{where}: node '{node.name}' ({node.op}) has {what} {x!r}; known are "
                f"{', '.join(known)}"
            )


def _check_const(v: Value, where: str) -> None:
    if v.const is None:
        raise GraphError(f"{where}: initializer '{v.name}' has no data")
    t = v.type
    if isinstance(t, TensorType):
        if t.shape is not None and tuple(t.shape) != v.const.shape:
            raise GraphError(
                f"{where}: initializer '{v.name}' holds shape {list(v.const.shape)} but is "
                f"declared {list(t.shape)}"
            )
        if t.dtype is not None and DType.from_numpy(v.const.dtype) != t.dtype:
            raise GraphError(
                f"{where}: initializer '{v.name}' holds {v.const.dtype} but is declared "
                f"{t.dtype.name}"
            )
