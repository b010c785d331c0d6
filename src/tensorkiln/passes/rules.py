"""What the fusion rules of the normalization and activation passes share.

Each of those passes is a table of rules. A rule gets an anchor node and returns a
:class:`Rewrite` (the matched nodes to remove, the fused node to add) or None when the pattern, or
one of its checks, does not hold. :func:`run_rules` collects the matches first and applies them
once; the pass returns their count. :class:`Match` is what a rule looks at: the graph with its
producer and consumer maps, and checks of constants and reductions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tensorkiln.ir import Graph, Node, Value
from tensorkiln.ir.dtypes import DType
from tensorkiln.passes.rewrite import Rewrite, const_value

DOMAIN = "tensorkiln"
_FLOATS = {DType.FLOAT, DType.FLOAT16, DType.DOUBLE, DType.BFLOAT16}


# ---------------------------------------------------------------------------------------------
# Matching helpers


@dataclass
class Match:
    """What rules look at: the graph and its producer/consumer maps, computed once per pass."""

    graph: Graph
    producers: dict[Value, Node]
    readers: dict[Value, list[Node]]
    outputs: set[Value]

    @classmethod
    def of(cls, graph: Graph) -> Match:
        readers = {v: list(dict.fromkeys(ns)) for v, ns in graph.consumers().items()}
        return cls(graph, graph.producers(), readers, set(graph.outputs))

    def sole(self, v: Value | None, op: str | None = None) -> Node | None:
        """The one node reading ``v`` (of ``op`` in the ONNX domain), if ``v`` is no graph output."""
        if v is None or v in self.outputs:
            return None
        rs = self.readers.get(v, [])
        if len(rs) != 1 or (op is not None and not is_op(rs[0], op)):
            return None
        return rs[0]

    def made_by(self, v: Value | None, op: str) -> Node | None:
        """The node producing ``v`` when it is ``op`` of the ONNX domain."""
        p = self.producers.get(v) if v is not None else None
        return p if p is not None and is_op(p, op) else None

    def const(self, v: Value | None) -> np.ndarray | None:
        return const_value(v, self.producers)

    def scalar(self, v: Value | None) -> float | None:
        c = self.const(v)
        if c is None or c.size != 1 or c.ndim > 1 or c.dtype.kind not in "fiu":
            return None
        return float(c.reshape(-1)[0])

    def is_scalar(self, v: Value | None, target: float, rtol: float = 1e-6) -> bool:
        s = self.scalar(v)
        return s is not None and math.isclose(s, target, rel_tol=rtol, abs_tol=0.0)

    def only_read_by(self, v: Value, nodes: list[Node]) -> bool:
        """``v`` is no graph output and every reader of it is one of ``nodes``."""
        return v not in self.outputs and all(r in nodes for r in self.readers.get(v, []))


def is_op(node: Node, op: str) -> bool:
    """``node`` is ``op`` of the ONNX domain."""
    return node.op == op and node.domain == ""


def other_input(node: Node, v: Value) -> Value | None:
    """The other input of a binary node that reads ``v`` once."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is v and b is not v:
        return b
    if b is v and a is not v:
        return a
    return None


def is_float(v: Value | None) -> bool:
    """``v`` is a float16, bfloat16, float32 or float64 tensor."""
    return v is not None and v.dtype in _FLOATS


def rank_of(v: Value) -> int | None:
    """The rank of ``v``, None when its shape is unknown."""
    return None if v.shape is None else len(v.shape)


def reduce_axes(m: Match, node: Node, rank: int | None) -> tuple[int, ...] | None:
    """The sorted, non-negative axes a keepdims reduction of a rank-``rank`` input uses.

    None when they are unknown or the reduction does not keep dims.
    """
    if rank is None or node.attrs.get("keepdims", 1) != 1:
        return None
    if "axes" in node.attrs:
        axes = list(node.attrs["axes"])
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        c = m.const(node.inputs[1])
        if c is None:
            return None
        axes = [int(a) for a in c.reshape(-1)]
    else:
        axes = []
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            return None
        axes = list(range(rank))
    if any(not -rank <= a < rank for a in axes):
        return None
    norm = sorted({a % rank for a in axes})
    return tuple(norm) if len(norm) == len(axes) else None


def _drop_dead_constants(m: Match, rw: Rewrite) -> None:
    """Also remove Constant nodes whose every reader the rewrite removes."""
    gone = set(rw.remove)
    for node in list(rw.remove):
        for v in node.inputs:
            p = m.made_by(v, "Constant")
            if p is not None and p not in gone and m.only_read_by(v, rw.remove):
                gone.add(p)
                rw.remove.append(p)


Rule = Callable[[Match, Node], Rewrite | None]


def run_rules(graph: Graph, rules: dict[tuple[str, str], Rule]) -> int:
    """Try ``rules`` (keyed by the anchor's (domain, op)) on every node; apply the matches once.

    A match whose nodes overlap an earlier match is skipped; the next round of the PassManager
    sees it again.
    """
    m = Match.of(graph)
    rw, claimed = Rewrite(), set()
    for node in graph.nodes:
        fn = rules.get((node.domain, node.op))
        found = fn(m, node) if fn is not None else None
        if found is None or claimed.intersection(found.remove):
            continue
        claimed.update(found.remove)
        rw.merge(found)
    _drop_dead_constants(m, rw)
    return rw.apply(graph)


def fused_rewrite(remove: list[Node], node: Node) -> Rewrite:
    """One match: the nodes of ``remove`` give way to the fused ``node``."""
    return Rewrite(remove=remove, add=[node], count=1)
