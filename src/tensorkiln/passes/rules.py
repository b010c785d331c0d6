"""The one driver of every pattern rewrite, the graph view rules look at, and shared checks.

A pass is a list of :class:`Rule`: a pattern (see :mod:`tensorkiln.passes.pattern`) anchored on
a node's op, an optional check, and a replacement that returns the fused node (or a
:class:`~tensorkiln.passes.rewrite.Rewrite`, or None when it does not apply after all).
:func:`apply_rules` tries the rules on every node, keeps the matches that consume no node an
earlier match took, applies them all at once and counts them per rule; :func:`run_rules` returns
the total, which the pass returns to the PassManager ("fuse_conv_act: 49").

Rules whose match is not a fixed tree (a conv chain that grows, attention's many exporter forms)
anchor on their first node with a pattern of that node alone and walk on in their replacement
with the :class:`View`'s helpers; they see the nodes earlier matches claimed (``view.claimed``).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tensorkiln.ir import Graph, Node, Value
from tensorkiln.ir.dtypes import DType
from tensorkiln.passes.pattern import Found, Op, match
from tensorkiln.passes.rewrite import Rewrite, const_value

DOMAIN = "tensorkiln"
_FLOATS = {DType.FLOAT, DType.FLOAT16, DType.DOUBLE, DType.BFLOAT16}


# ---------------------------------------------------------------------------------------------
# The graph as rules see it


@dataclass
class View:
    """A graph with its producer and reader maps (computed once per run of the rules), the nodes
    matches have claimed so far, and the names new values may not take."""

    graph: Graph
    producers: dict[Value, Node]
    readers: dict[Value, list[Node]]  # each reading node once
    uses: dict[Value, list[Node]]  # each read (a node reading a value twice is there twice)
    outputs: set[Value]
    claimed: set[Node] = field(default_factory=set)
    names: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, graph: Graph) -> View:
        uses = graph.consumers()
        readers = {v: list(dict.fromkeys(ns)) for v, ns in uses.items()}
        return cls(graph, graph.producers(), readers, uses, set(graph.outputs))

    def sole(self, v: Value | None, op: str | None = None) -> Node | None:
        """The one node reading ``v`` (of ``op`` in the ONNX domain), if ``v`` is no graph output."""
        if v is None or v in self.outputs:
            return None
        rs = self.readers.get(v, [])
        if len(rs) != 1 or (op is not None and not is_op(rs[0], op)):
            return None
        return rs[0]

    def single(self, v: Value | None, op: str | None = None) -> Node | None:
        """The node reading ``v`` once and alone (of ``op``, unclaimed), if ``v`` is no graph
        output: the next link of a chain."""
        if v is None or v in self.outputs:
            return None
        rs = self.uses.get(v, [])
        if len(rs) != 1 or (op is not None and (not is_op(rs[0], op) or rs[0] in self.claimed)):
            return None
        return rs[0]

    def made_by(self, v: Value | None, *ops: str) -> Node | None:
        """The node producing ``v`` when it is one of ``ops`` of the ONNX domain."""
        p = self.producers.get(v) if v is not None else None
        return p if p is not None and p.domain == "" and p.op in ops else None

    def const(self, v: Value | None, through_identity: bool = False) -> np.ndarray | None:
        """The data of ``v`` when it is constant (and, when asked, behind Identity nodes)."""
        p = self.producers.get(v) if through_identity and v is not None else None
        while p is not None and is_op(p, "Identity"):
            v = p.inputs[0]
            p = self.producers.get(v)
        return const_value(v, self.producers)

    def scalar(self, v: Value | None, through_identity: bool = False) -> float | None:
        """The number a one-element numeric constant holds."""
        c = self.const(v, through_identity)
        if c is None or c.size != 1 or c.ndim > 1 or c.dtype.kind not in "fiu":
            return None
        return float(c.reshape(-1)[0])

    def is_scalar(self, v: Value | None, target: float, rtol: float = 1e-6) -> bool:
        s = self.scalar(v)
        return s is not None and math.isclose(s, target, rel_tol=rtol, abs_tol=0.0)

    def only_read_by(self, v: Value, nodes: list[Node]) -> bool:
        """``v`` is no graph output and every reader of it is one of ``nodes``."""
        return v not in self.outputs and all(r in nodes for r in self.readers.get(v, []))

    def fresh_name(self, base: str) -> str:
        """A value or node name not used in the graph nor given out before (engine files key
        values by name)."""
        if not self.names:
            self.names = {v.name for v in self.graph.values()}
            self.names.update(n.name for n in self.graph.nodes if n.name)
        name, k = base, 1
        while name in self.names:
            name, k = f"{base}_{k}", k + 1
        self.names.add(name)
        return name


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


def reduce_axes(m: View, node: Node, rank: int | None) -> tuple[int, ...] | None:
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


def fused_rewrite(remove: list[Node], node: Node) -> Rewrite:
    """One match: the nodes of ``remove`` give way to the fused ``node``."""
    return Rewrite(remove=remove, add=[node], count=1)


# ---------------------------------------------------------------------------------------------
# Rules and the driver

Replacement = Callable[[View, Found], "Rewrite | Node | None"]
Check = Callable[[View, Found], bool]


@dataclass(frozen=True)
class Rule:
    """A named rewrite: root pattern(s), an optional check, a replacement.

    The replacement returns the node that takes the place of the match (written to the root's
    outputs; the match's nodes go), a :class:`Rewrite` for anything else, or None when the rule
    does not apply after all.
    """

    name: str
    patterns: Op | Sequence[Op]
    replace: Replacement
    check: Check | None = None

    @property
    def roots(self) -> tuple[Op, ...]:
        return (self.patterns,) if isinstance(self.patterns, Op) else tuple(self.patterns)

    def anchors(self) -> Iterable[tuple[str, str]]:
        """The (domain, op) of the nodes this rule can be rooted on."""
        for p in self.roots:
            for op in p.ops:
                yield p.domain, op

    def apply(self, view: View, node: Node) -> Rewrite | None:
        """The rewrite this rule makes rooted on ``node``, or None."""
        for pattern in self.roots:
            found = match(view, pattern, node)
            if found is None or (self.check is not None and not self.check(view, found)):
                continue
            result = self.replace(view, found)
            if isinstance(result, Node):
                return fused_rewrite(list(found.nodes), result)
            if result is not None:
                return result
        return None


def apply_rules(graph: Graph, rules: Sequence[Rule]) -> Counter[str]:
    """Try ``rules`` on every node of ``graph`` in order, apply the matches at once; count per rule.

    A node is the root of at most one match (the first rule that applies). A match that would
    consume a node an earlier match consumed is dropped; the PassManager's next round sees it
    again. Constant nodes only the removed nodes read go too.
    """
    index = _index(rules)
    if not any((n.domain, n.op) in index for n in graph.nodes):
        return Counter()  # (no node a rule is rooted on: the common case, made cheap)
    view, rw, counts = View.of(graph), Rewrite(), Counter()
    for node in list(graph.nodes):
        for rule in index.get((node.domain, node.op), ()):
            edit = rule.apply(view, node) if node not in view.claimed else None
            if edit is None or view.claimed.intersection(edit.remove):
                continue
            view.claimed.update(edit.remove)
            view.claimed.add(node)
            rw.merge(edit)
            counts[rule.name] += edit.count
            break
    _drop_dead_constants(view, rw)
    if rw.count and any(n.domain == DOMAIN for n in rw.add):
        graph.opsets.setdefault(DOMAIN, 1)
    rw.apply(graph)
    return +counts


# rule tables' indexes, by the ids of their rules (held here, so the ids are not reused), the
# most recently used kept: the passes' tables are module-level, a few rules are made per run
_INDEXES: OrderedDict[tuple[int, ...], tuple[tuple[Rule, ...], dict[tuple[str, str], list[Rule]]]]
_INDEXES = OrderedDict()


def _index(rules: Sequence[Rule]) -> dict[tuple[str, str], list[Rule]]:
    """The rules by the (domain, op) they are rooted on, made once per table."""
    key = tuple(map(id, rules))
    hit = _INDEXES.get(key)
    if hit is not None:
        _INDEXES.move_to_end(key)
        return hit[1]
    index: dict[tuple[str, str], list[Rule]] = {}
    for rule in rules:
        for anchor in rule.anchors():
            index.setdefault(anchor, []).append(rule)
    _INDEXES[key] = (tuple(rules), index)
    if len(_INDEXES) > 64:
        _INDEXES.popitem(last=False)
    return index


def run_rules(graph: Graph, rules: Sequence[Rule]) -> int:
    """:func:`apply_rules`, the total count (what a pass returns to the PassManager)."""
    return sum(apply_rules(graph, rules).values())


def _drop_dead_constants(view: View, rw: Rewrite) -> None:
    """Also remove Constant nodes whose every reader the rewrite removes (and no new node reads)."""
    gone = set(rw.remove)
    still_read = {v for node in rw.add for v in node.inputs} | set(rw.replace.values())
    for node in list(rw.remove):
        for v in node.inputs:
            p = view.made_by(v, "Constant")
            if p is None or p in gone or v in still_read:
                continue
            if view.only_read_by(v, rw.remove):
                gone.add(p)
                rw.remove.append(p)
