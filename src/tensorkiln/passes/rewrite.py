"""Helpers for writing passes: collect edits, apply them once; constants.

A pass gathers a :class:`Rewrite` (nodes to remove, nodes to add, values to replace) from rules that
match, then :meth:`Rewrite.apply` changes the graph in one step and keeps it topologically sorted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.ir.toposort import toposort


@dataclass
class Rewrite:
    """Edits to one graph, applied together."""

    remove: list[Node] = field(default_factory=list)
    add: list[Node] = field(default_factory=list)
    replace: dict[Value, Value] = field(default_factory=dict)  # every use of key reads value
    count: int = 0  # matches, for the pass statistics

    def merge(self, other: Rewrite) -> None:
        self.remove.extend(other.remove)
        self.add.extend(other.add)
        self.replace.update(other.replace)
        self.count += other.count

    def apply(self, graph: Graph) -> int:
        """Change ``graph`` in place; returns the number of matches."""
        if not (self.remove or self.add or self.replace):
            return 0
        gone = set(self.remove)
        graph.nodes = [n for n in graph.nodes if n not in gone] + self.add
        if self.replace:
            replace_uses(graph, self.replace)
        graph.nodes = toposort(graph)
        return self.count


def _resolve(v: Value, mapping: dict[Value, Value]) -> Value:
    seen = set()
    while v in mapping and v not in seen:
        seen.add(v)
        v = mapping[v]
    return v


def replace_uses(graph: Graph, mapping: dict[Value, Value]) -> None:
    """Make every read of a key of ``mapping`` (subgraphs included) read its value instead.

    A replaced graph output keeps its name: the replacement value is renamed to it when the
    replacement is produced inside the graph, otherwise an Identity keeps the output's name.
    """
    for _, node in graph.walk():
        node.inputs = [None if v is None else _resolve(v, mapping) for v in node.inputs]
    outputs = []
    for out in graph.outputs:
        new = _resolve(out, mapping)
        if new is out:
            outputs.append(out)
            continue
        produced = {v for n in graph.nodes for v in n.outputs if v is not None}
        if new in produced and new not in graph.outputs and new not in outputs:
            new.name = out.name
            outputs.append(new)
        else:
            keep = Value(out.name, out.type)
            graph.nodes.append(Node("Identity", [new], [keep], name=f"{out.name}_identity"))
            outputs.append(keep)
    graph.outputs = outputs


def const_value(v: Value | None, producers: dict[Value, Node] | None = None) -> np.ndarray | None:
    """The data of ``v`` when it is an initializer or the output of a Constant node."""
    if v is None:
        return None
    if v.const is not None:
        return v.const
    if producers is not None:
        p = producers.get(v)
        if p is not None and p.op == "Constant" and p.domain == "" and "value" in p.attrs:
            return np.asarray(p.attrs["value"])
    return None


def add_constant(graph: Graph, name: str, data: np.ndarray) -> Value:
    """A new initializer with a name unique in ``graph``."""
    taken = {v.name for v in graph.values()}
    base, k = name, 1
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    v = Value(name, TensorType(DType.from_numpy(data.dtype), data.shape), const=data)
    graph.initializers.append(v)
    return v
