"""The pattern language of the passes: graph patterns written as data.

A pattern describes a tree of nodes, matched upwards from the node a rule is anchored on (its
root) through the producers of its inputs::

    ONE_PLUS_ERF = Op("Add", [Op("Erf", [Op("Div", [Var("x"), Scalar(SQRT2)])]), Scalar(1.0)],
                      commutative=True)
    GELU = Op("Mul", [Op("Mul", [Var("x"), ONE_PLUS_ERF], commutative=True), Scalar(0.5)],
              commutative=True)

* :class:`Op` matches a node: its op (one name or several), its domain, its inputs (positionally,
  each by a sub-pattern; None: any inputs), ``commutative`` to try both orders of a binary node,
  ``name`` to capture the node, ``where`` for a check of the node itself (its attributes), and
  ``keep`` for a node the match reads but does not consume (it stays; others may read it), and
  ``prefix`` to match only the first inputs.
* :class:`Var` matches any value and captures it; a name used twice must be the same value (the
  ``x`` of ``Mul(x, Sigmoid(x))``). A Var named like a captured Op is that node's output: this is
  how a pattern reads one node from two places.
* :class:`Const` matches a constant (initializer or Constant node) whose data passes a predicate;
  :func:`Scalar` is the common one: a one-element number within a relative tolerance of a target.
* :class:`Alt` matches the first of several patterns that fits.

Matching backtracks: a failed alternative, input order or inner check tries the next way. Every
node a match consumes (all but ``keep`` ones) except the root must have no reader outside the
match and must not be a graph output, so removing the match removes nothing anyone else reads.
The driver and the graph view rules look at are in :mod:`tensorkiln.passes.rules`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import numpy as np

from tensorkiln.ir import Node, Value

if TYPE_CHECKING:  # annotations only: rules imports this module
    from tensorkiln.passes.rules import View


@dataclass(frozen=True)
class Var:
    """Any value (None for an omitted input never matches), captured as ``name``."""

    name: str | None = None


@dataclass(frozen=True)
class Const:
    """A constant value whose data passes ``pred`` (any constant when None)."""

    pred: Callable[[np.ndarray], bool] | None = None
    name: str | None = None


@dataclass(frozen=True)
class Op:
    """A node of ``op`` (or one of the ops of a tuple) in ``domain``; see the module docstring."""

    op: str | tuple[str, ...]
    inputs: Sequence[Pattern] | None = None
    domain: str = ""
    commutative: bool = False
    name: str | None = None
    where: Callable[[View, Node], bool] | None = None
    keep: bool = False
    prefix: bool = False  # ``inputs`` are the first inputs; later ones are not looked at

    @property
    def ops(self) -> tuple[str, ...]:
        return (self.op,) if isinstance(self.op, str) else tuple(self.op)


@dataclass(frozen=True)
class Alt:
    """The first of ``options`` that matches."""

    options: tuple[Pattern, ...]

    def __init__(self, *options: Pattern) -> None:
        object.__setattr__(self, "options", tuple(options))


Pattern = Union[Op, Var, Const, Alt]  # noqa: UP007  (a runtime alias, used in isinstance)


def Scalar(target: float, rtol: float = 1e-6, name: str | None = None) -> Const:
    """A one-element numeric constant within ``rtol`` (relative) of ``target``, or within its
    type's spacing where that is coarser: a float16 model stores GELU's 0.044715 as 0.04471
    (1.6e-4 off), a bfloat16 one as 0.04468, and each is that constant as the model has it."""

    def close(c: np.ndarray) -> bool:
        if c.size != 1 or c.ndim > 1:
            return False
        spacing = _spacing(c.dtype)
        if spacing is None:
            return False
        value = float(c.reshape(-1)[0].astype(np.float64))
        return math.isclose(value, target, rel_tol=max(rtol, spacing), abs_tol=0.0)

    return Const(close, name)


def _spacing(dtype: np.dtype) -> float | None:
    """The relative spacing of ``dtype``'s values (0 for integers; None: not a number type)."""
    if dtype.kind in "iu":
        return 0.0
    if dtype.kind == "f":
        return float(np.finfo(dtype).eps)
    if dtype.name == "bfloat16":  # (ml_dtypes': 8 bits of precision)
        return 2.0**-7
    return None


# ---------------------------------------------------------------------------------------------
# Matches


@dataclass
class Found:
    """One match: the root node, the nodes it consumes (root first), and its captures."""

    root: Node
    nodes: list[Node] = field(default_factory=list)
    kept: list[Node] = field(default_factory=list)
    captures: dict[str, Value | Node] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Value | Node:
        return self.captures[name]

    def value(self, name: str) -> Value:
        """The value captured as ``name`` (the first output of a node captured so)."""
        v = self.captures[name]
        return v.outputs[0] if isinstance(v, Node) else v

    def node(self, name: str) -> Node:
        n = self.captures[name]
        assert isinstance(n, Node), f"capture {name!r} is a value"
        return n

    def _with(self, key: str | None, item: Value | Node) -> Found | None:
        """A copy that also captures ``item`` as ``key``; None if ``key`` holds something else.

        A node and its first output are the same capture: ``Var("d")`` names the value a node
        captured as ``d`` writes, which is how a pattern reads one node twice (a DAG).
        """
        held = self.captures.get(key) if key is not None else None
        if held is not None and not _same(held, item):
            return None
        if held is not None and not isinstance(item, Node):
            return self
        new = Found(self.root, list(self.nodes), list(self.kept), dict(self.captures))
        if key is not None:
            new.captures[key] = item
        return new


def _same(a: Value | Node, b: Value | Node) -> bool:
    if a is b:
        return True
    if isinstance(a, Node) != isinstance(b, Node):
        node, v = (a, b) if isinstance(a, Node) else (b, a)
        return bool(node.outputs) and node.outputs[0] is v
    return False


def match(view: View, pattern: Op, node: Node) -> Found | None:
    """The first way ``pattern`` matches with ``node`` as its root, or None."""
    if node in view.claimed:
        return None
    for found in _node(view, pattern, node, Found(node)):
        if _closed(view, found):
            return found
    return None


def _closed(view: View, found: Found) -> bool:
    """No node the match consumes (but the root) is read from outside it or is a graph output."""
    inside = set(found.nodes) | set(found.kept)
    for n in found.nodes[1:]:
        for v in n.outputs:
            if v is None:
                continue
            if v in view.outputs or any(r not in inside for r in view.readers.get(v, [])):
                return False
    return True


def _node(view: View, p: Op, node: Node, found: Found) -> Iterator[Found]:
    if node.domain != p.domain or node.op not in p.ops or node in view.claimed:
        return
    if node in found.nodes or node in found.kept:
        return  # a node reached twice through two sub-patterns: name it and use Var instead
    if p.where is not None and not p.where(view, node):
        return
    found = found._with(p.name, node)
    if found is None:
        return
    (found.kept if p.keep else found.nodes).append(node)
    if p.inputs is None:
        yield found
        return
    ins = list(node.inputs)
    while ins and ins[-1] is None:
        ins.pop()  # omitted trailing optional inputs
    if p.prefix:
        ins = ins[: len(p.inputs)]
    if len(ins) != len(p.inputs):
        return
    orders = [ins, ins[::-1]] if p.commutative and len(ins) == 2 else [ins]
    for order in orders:
        yield from _inputs(view, list(p.inputs), order, found)


def _inputs(view: View, pats: list[Pattern], values: list, found: Found) -> Iterator[Found]:
    if not pats:
        yield found
        return
    for f in _value(view, pats[0], values[0], found):
        yield from _inputs(view, pats[1:], values[1:], f)


def _value(view: View, p: Pattern, v: Value | None, found: Found) -> Iterator[Found]:
    if v is None:
        return
    if isinstance(p, Var):
        f = found._with(p.name, v)
        if f is not None:
            yield f
    elif isinstance(p, Const):
        c = view.const(v)
        if c is not None and (p.pred is None or p.pred(c)):
            f = found._with(p.name, v)
            if f is not None:
                yield f
    elif isinstance(p, Alt):
        for option in p.options:
            yield from _value(view, option, v, found)
    else:
        producer = view.producers.get(v)
        if producer is not None:
            yield from _node(view, p, producer, found)
