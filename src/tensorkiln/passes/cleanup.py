"""Clean-up passes (level 1): constants, dead code, no-ops, common subexpressions, constant folding.

* ``constant_to_initializer``: Constant nodes become initializers (the Value keeps its identity).
* ``dead_code``: nodes nobody reads and unused initializers go, in subgraphs too.
* ``remove_noops``: Identity, inference Dropout, Cast to the same type, Reshape/Expand to the same
  shape, identity Transpose, zero Pad, x*1, x/1, x+0, x-0 and cancelling Squeeze/Unsqueeze pairs.
* ``cse``: nodes with the same op, attributes and inputs are computed once; equal constants merge.
* ``constant_folding``: nodes whose inputs are all constants are evaluated with the reference
  kernels, unless their result would be large or much larger than their inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tensorkiln.ir import Graph, Node, Value
from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import TensorType, node_reads
from tensorkiln.kernels.evaluate import evaluate_node
from tensorkiln.passes.facts import RANDOM_OPS
from tensorkiln.passes.pattern import Found, Op
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite
from tensorkiln.passes.rules import Rule, View, run_rules

# Constant folding limits: never materialize more than FOLD_MAX_ELEMENTS per output, and above
# FOLD_SMALL elements only when the output is at most FOLD_GROWTH times the size of the inputs.
FOLD_MAX_ELEMENTS = 1 << 20
FOLD_SMALL = 4096
FOLD_GROWTH = 2

# Ops never folded or merged: randomness, and quantization whose scale depends on the data.
# (QuantizeLinear/DequantizeLinear of constants fold: fuse_quantized, which runs before this in
# every round, has taken the weights it makes quantized layers of; what is left, such as a bias
# stored as int32, is a float constant to every layer that reads it.)
NO_FOLD = RANDOM_OPS | {"DynamicQuantizeLinear"}


def each_graph(graph: Graph) -> Iterator[Graph]:
    """``graph`` and all its subgraphs, innermost first."""
    for n in graph.nodes:
        for sub in n.subgraphs():
            yield from each_graph(sub)
    yield graph


def _set_const(v: Value, data: np.ndarray) -> None:
    v.const = data
    v.type = TensorType(DType.from_numpy(data.dtype), data.shape)


# ---------------------------------------------------------------------------------------------
# Constant nodes -> initializers


@register_pass("constant_to_initializer", level=1, order=10)
def constant_to_initializer(graph: Graph) -> int:
    """Turn the Constant nodes of the main graph into initializers; returns how many."""
    count, kept = 0, []
    for node in graph.nodes:
        data = _constant_data(graph, node)
        if data is None:
            kept.append(node)
            continue
        _set_const(node.outputs[0], data)
        graph.initializers.append(node.outputs[0])
        count += 1
    graph.nodes = kept
    return count


def _constant_data(graph: Graph, node: Node) -> np.ndarray | None:
    if node.op != "Constant" or node.domain != "" or len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    if out is None or out in graph.outputs:
        return None
    result = evaluate_node(graph, node, [])
    if not result or not isinstance(result[0], np.ndarray) or result[0].dtype == object:
        return None
    return result[0]


# ---------------------------------------------------------------------------------------------
# Dead code


@register_pass("dead_code", level=1, order=11)
def dead_code(graph: Graph) -> int:
    """Remove nodes and initializers nothing reads (subgraphs too); returns how many."""
    return sum(_dead_code_one(g) for g in each_graph(graph))


def _dead_code_one(graph: Graph) -> int:
    live: set[Value] = set(graph.outputs)
    kept: list[Node] = []
    for node in reversed(graph.nodes):
        if any(v is not None and v in live for v in node.outputs):
            kept.append(node)
            live.update(node_reads(node))
    inits = [v for v in graph.initializers if v in live]
    removed = len(graph.nodes) - len(kept) + len(graph.initializers) - len(inits)
    graph.nodes = kept[::-1]
    graph.initializers = inits
    return removed


# ---------------------------------------------------------------------------------------------
# No-ops: each rule returns the value the node's first output equals, or None; the driver of
# passes/rules.py makes every read of the output read that value instead.

NoopRule = Callable[[View, Node], Value | None]
NOOP_RULES: list[Rule] = []


def noop_rule(*ops: str) -> Callable[[NoopRule], NoopRule]:
    """Register ``fn`` (the value ``node``'s first output equals, or None) for the ONNX ``ops``."""

    def decorator(fn: NoopRule) -> NoopRule:
        NOOP_RULES.append(Rule(fn.__name__.strip("_"), Op(ops), _bypass(fn)))
        return fn

    return decorator


def _bypass(fn: NoopRule) -> Callable[[View, Found], Rewrite | None]:
    """The replacement that reads the value ``fn`` finds instead of the node's output."""

    def replace(view: View, found: Found) -> Rewrite | None:
        node = found.root
        if not node.outputs or node.outputs[0] is None:
            return None
        extra = [v for v in node.outputs[1:] if v is not None]
        if any(v in view.uses or v in view.outputs for v in extra):
            return None  # e.g. a Dropout mask that is read
        x = fn(view, node)
        if x is None or not _keeps_output_names(view.graph, node.outputs[0], x, view.producers):
            return None
        return Rewrite(remove=[node], replace={node.outputs[0]: x}, count=1)

    return replace


def same_type(a: Value | None, b: Value | None) -> bool:
    """Both tensors have one known dtype and the same known shape (identical symbols count)."""
    if a is None or b is None:
        return False
    ta, tb = a.type, b.type
    if not (isinstance(ta, TensorType) and isinstance(tb, TensorType)):
        return False
    return (
        ta.dtype is not None
        and ta.dtype == tb.dtype
        and ta.shape is not None
        and ta.shape == tb.shape
    )


def _all_equal(data: np.ndarray | None, x: float) -> bool:
    return data is not None and data.dtype != object and data.size > 0 and bool(np.all(data == x))


@noop_rule("Identity")
def _identity(view: View, node: Node) -> Value | None:
    return node.inputs[0]


@noop_rule("Dropout")
def _dropout(view: View, node: Node) -> Value | None:
    opset = view.graph.opset("")
    if opset < 7 and not node.attrs.get("is_test", 0):
        return None
    if opset >= 12 and len(node.inputs) > 2 and node.inputs[2] is not None:
        mode = view.const(node.inputs[2])
        if mode is None or mode.size != 1 or bool(mode.reshape(-1)[0]):
            return None
    return node.inputs[0]


@noop_rule("Cast")
def _cast(view: View, node: Node) -> Value | None:
    to = node.attrs.get("to")
    x = node.inputs[0]
    if isinstance(to, int) and x is not None and x.dtype is not None and int(x.dtype) == to:
        return x
    return None


@noop_rule("CastLike")
def _cast_like(view: View, node: Node) -> Value | None:
    x, like = node.inputs[0], node.inputs[1]
    if x is not None and like is not None and x.dtype is not None and x.dtype == like.dtype:
        return x
    return None


@noop_rule("Reshape", "Expand")
def _same_shape(view: View, node: Node) -> Value | None:
    x = node.inputs[0]
    if same_type(x, node.outputs[0]) and all(isinstance(d, int) for d in x.shape):
        return x
    return None


@noop_rule("Transpose")
def _transpose(view: View, node: Node) -> Value | None:
    x = node.inputs[0]
    if x is None or x.shape is None:
        return None
    rank = len(x.shape)
    perm = node.attrs.get("perm", list(range(rank))[::-1])
    return x if list(perm) == list(range(rank)) else None


@noop_rule("Pad")
def _pad(view: View, node: Node) -> Value | None:
    if "pads" in node.attrs:
        pads = np.asarray(node.attrs["pads"])
    else:
        pads = view.const(node.inputs[1] if len(node.inputs) > 1 else None)
    if pads is None or np.any(pads != 0) or not same_type(node.inputs[0], node.outputs[0]):
        return None
    return node.inputs[0]


@noop_rule("Mul", "Div", "Add", "Sub")
def _neutral(view: View, node: Node) -> Value | None:
    neutral = 1 if node.op in ("Mul", "Div") else 0
    sides = [(0, 1)] if node.op in ("Div", "Sub") else [(0, 1), (1, 0)]
    for keep, other in sides:
        x = node.inputs[keep]
        one = _all_equal(view.const(node.inputs[other]), neutral)
        if one and same_type(x, node.outputs[0]):
            return x
    return None


@noop_rule("Squeeze", "Unsqueeze")
def _squeeze_pair(view: View, node: Node) -> Value | None:
    # Squeeze and Unsqueeze only change the shape, never the order of elements: a pair that
    # brings back the original shape is the identity.
    first = view.producers.get(node.inputs[0])
    if first is None or first.op not in ("Squeeze", "Unsqueeze") or first.domain != "":
        return None
    x = first.inputs[0]
    return x if same_type(x, node.outputs[0]) else None


@register_pass("remove_noops", level=1, order=12)
def remove_noops(graph: Graph) -> int:
    """Bypass nodes that return their input unchanged (subgraphs too); returns how many."""
    return sum(_remove_noops_one(g) for g in each_graph(graph))


def _remove_noops_one(graph: Graph) -> int:
    return run_rules(graph, NOOP_RULES)


def _keeps_output_names(graph: Graph, out: Value, x: Value, producers: dict[Value, Node]) -> bool:
    """A graph output can only be bypassed when its new value can take over its name."""
    if out not in graph.outputs:
        return True
    return x in producers and x not in graph.outputs and x not in graph.inputs


# ---------------------------------------------------------------------------------------------
# Common subexpressions


def _freeze(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, float):
        return ("float", repr(x))
    if isinstance(x, (int, str, bytes, bool)) or x is None:
        return x
    if hasattr(x, "SerializeToString"):
        return ("proto", x.SerializeToString())
    raise TypeError(f"cannot compare attribute {type(x).__name__}")


def _node_key(node: Node, resolve: dict[Value, Value]) -> tuple | None:
    if node.op in RANDOM_OPS or any(True for _ in node.subgraphs()):
        return None
    try:
        attrs = tuple(sorted((k, _freeze(v)) for k, v in node.attrs.items()))
    except TypeError:
        return None
    ins = tuple(None if v is None else id(resolve.get(v, v)) for v in node.inputs)
    outs = tuple(v is not None for v in node.outputs)
    return (node.domain, node.op, ins, outs, attrs)


def _merge_constants(graph: Graph, resolve: dict[Value, Value]) -> int:
    seen: dict[tuple, Value] = {}
    count = 0
    for v in graph.initializers:
        if v.const is None or v.const.dtype == object:
            continue
        if v.const.size > FOLD_MAX_ELEMENTS:
            # Too large to compare byte by byte, but one array named by several initializers
            # (external data that tensors share) is the same constant.
            key: tuple = ("same array", id(v.const))
        else:
            key = (v.const.dtype.str, v.const.shape, v.const.tobytes())
        first = seen.setdefault(key, v)
        if first is not v and v not in graph.outputs:
            resolve[v] = first
            count += 1
    return count


@register_pass("cse", level=1, order=13)
def cse(graph: Graph) -> int:
    """Compute equal nodes once and keep one copy of equal constants; returns how many merged."""
    rw = Rewrite()
    rw.count = _merge_constants(graph, rw.replace)
    seen: dict[tuple, Node] = {}
    for node in graph.nodes:
        key = _node_key(node, rw.replace)
        if key is None:
            continue
        first = seen.setdefault(key, node)
        if first is node or any(v in graph.outputs for v in node.outputs if v is not None):
            continue
        rw.remove.append(node)
        for dup, orig in zip(node.outputs, first.outputs):
            if dup is not None:
                rw.replace[dup] = orig
        rw.count += 1
    if not rw.count:
        return 0
    count = rw.apply(graph)
    _dead_code_one(graph)  # the merged constants
    return count


# ---------------------------------------------------------------------------------------------
# Constant folding


def _static_size(v: Value | None) -> int | None:
    if v is None or not isinstance(v.type, TensorType) or v.type.shape is None:
        return None
    if not all(isinstance(d, int) for d in v.type.shape):
        return None
    return int(np.prod(v.type.shape, dtype=np.int64))


def _worth_folding(node: Node, args: list[np.ndarray | None]) -> bool:
    """Every output has a known static size, none is too large or much larger than the inputs."""
    in_size = sum(a.size for a in args if a is not None)
    for v in node.outputs:
        if v is None:
            continue
        size = _static_size(v)
        if size is None or size > FOLD_MAX_ELEMENTS:
            return False
        if size > FOLD_SMALL and size > FOLD_GROWTH * in_size:
            return False
    return True


def _widening_cast(node: Node) -> bool:
    """A Cast of a compact constant (float16/bfloat16/float8/int4) to a wider type: folding it
    would store the weight wide; keeping it compact is the precision step's decision."""
    if node.op not in ("Cast", "CastLike") or node.outputs[0] is None:
        return False
    src, dst = node.inputs[0].dtype, node.outputs[0].dtype
    if src is None or dst is None or src.bits >= dst.bits:
        return False
    return src.is_float or src.bits < 8


def _fold_one(graph: Graph, node: Node) -> list[np.ndarray] | None:
    if node.op in NO_FOLD or node.op == "Constant" or any(True for _ in node.subgraphs()):
        return None
    if _widening_cast(node):
        return None
    present = [v for v in node.inputs if v is not None]
    if not present or any(v.const is None or v.const.dtype == object for v in present):
        return None
    if any(v is not None and v in graph.outputs for v in node.outputs):
        return None
    args = [None if v is None else v.const for v in node.inputs]
    if not _worth_folding(node, args):
        return None
    result = evaluate_node(graph, node, args)
    if result is None or len(result) != len(node.outputs):
        return None
    result = [np.asarray(a) if isinstance(a, np.generic) else a for a in result]
    for v, arr in zip(node.outputs, result):
        if v is None:
            continue
        if not isinstance(arr, np.ndarray) or arr.dtype == object:
            return None
        if v.dtype is not None and DType.from_numpy(arr.dtype) != v.dtype:
            return None  # the kernel and the declared type disagree: leave it
        if tuple(v.type.shape) != arr.shape:
            return None
    return result


@register_pass("constant_folding", level=1, order=14)
def constant_folding(graph: Graph) -> int:
    """Replace nodes whose inputs are all constants by initializers; returns how many."""
    count, kept = 0, []
    for node in graph.nodes:
        result = _fold_one(graph, node)
        if result is None:
            kept.append(node)
            continue
        for v, arr in zip(node.outputs, result):
            if v is not None:
                # (not np.ascontiguousarray: it makes a 0-d result 1-d, and a folded scalar
                # Gather index of shape [1] then adds an axis to everything it indexes)
                _set_const(v, np.require(arr, requirements="C"))
                graph.initializers.append(v)
        count += 1
    graph.nodes = kept
    return count
