"""Shape simplification (level 1): computed shapes become constants.

PyTorch exports compute reshape targets at run time: Shape -> Gather -> Unsqueeze -> Concat ->
Reshape. These passes make such chains dead (``dead_code`` then removes them), so that later
fusions see constant shapes:

* ``static_shapes``: Shape and Size of a tensor whose shape is fully static become constants
  (``constant_folding`` then folds the rest of the chain).
* ``known_shape_values``: a shape computation whose value is known to be numbers although the
  tensor it reads has symbolic dims (the last dim of an ``[N, 4, 7, 8]`` tensor: ``Slice(Shape(x),
  -1)`` is ``[8]``, the head width an attention's scale is computed from) becomes a constant.
* ``reshape_targets``: a Reshape target computed at run time whose value is known symbolically
  (``[N, 16, 4, 32]`` of an input ``[N, 16, 128]``) becomes a constant, with 0 (copy the input's
  dim) and -1 (infer one dim) standing in for the symbolic entries: ``[0, 0, 4, 32]``.

The symbolic values are recomputed here the way :func:`tensorkiln.ir.infer.infer_shapes` computes
them (it keeps them to itself): small constants are evaluated, shape-computing ops propagate
symbols through :func:`tensorkiln.ir.shape_rules.symbolic_value`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tensorkiln.ir import Graph, Node, Value
from tensorkiln.ir.dims import dim_divide, dim_product
from tensorkiln.ir.graph import Dim, Shape, TensorType
from tensorkiln.kernels.evaluate import evaluate_node
from tensorkiln.ops.shape_rules import InferContext, symbolic_value
from tensorkiln.passes.cleanup import NO_FOLD
from tensorkiln.passes.pattern import Found, Op
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import add_constant
from tensorkiln.passes.rules import Rule, View, run_rules

# Values up to this many elements are tracked (as in ir.infer).
VALUE_LIMIT = 4096


def _static_shape(v: Value | None) -> Shape | None:
    if v is None or not isinstance(v.type, TensorType) or v.type.shape is None:
        return None
    shape = v.type.shape
    return shape if all(isinstance(d, int) for d in shape) else None


# ---------------------------------------------------------------------------------------------
# Shape / Size of static tensors


def _shape_data(node: Node) -> np.ndarray | None:
    if node.domain != "" or node.op not in ("Shape", "Size") or len(node.outputs) != 1:
        return None
    shape = _static_shape(node.inputs[0])
    if shape is None:
        return None
    if node.op == "Size":
        return np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    rank = len(shape)
    start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(shape[start:end], dtype=np.int64)


@register_pass("static_shapes", level=1, order=40)
def static_shapes(graph: Graph) -> int:
    """Replace Shape/Size of statically shaped tensors by constants; returns how many."""
    count, kept = 0, []
    for node in graph.nodes:
        data = _shape_data(node)
        out = node.outputs[0] if node.outputs else None
        if data is None or out is None or out in graph.outputs:
            kept.append(node)
            continue
        out.const = data
        out.type = TensorType(out.type.dtype if out.dtype else None, data.shape)
        graph.initializers.append(out)
        count += 1
    graph.nodes = kept
    return count


# ---------------------------------------------------------------------------------------------
# Symbolic values


def _node_values(graph: Graph, node: Node, values: list[np.ndarray | None]) -> list | None:
    if node.op == "Constant" and node.domain == "":
        return evaluate_node(graph, node, [])
    present = [v for v, inp in zip(values, node.inputs) if inp is not None]
    numeric = all(isinstance(v, np.ndarray) and v.dtype != object for v in present)
    small = numeric and sum(v.size for v in present) <= VALUE_LIMIT
    if present and small and node.op not in NO_FOLD and not any(True for _ in node.subgraphs()):
        result = evaluate_node(graph, node, values)
        if result is not None:
            return result
    sym = symbolic_value(InferContext(node, graph.opset(node.domain), values))
    return None if sym is None else [sym]


def shape_values(graph: Graph) -> dict[Value, np.ndarray]:
    """The values known before running ``graph``: constants, and shape computations whose
    entries are ints or symbolic dims (object arrays holding str)."""
    known: dict[Value, np.ndarray] = {
        v: v.const
        for v in graph.initializers
        if v.const is not None and v.const.size <= VALUE_LIMIT
    }
    for node in graph.nodes:
        values = [known.get(v) if v is not None else None for v in node.inputs]
        result = _node_values(graph, node, values)
        for v, arr in zip(node.outputs, result or []):
            if v is not None and isinstance(arr, np.ndarray) and arr.size <= VALUE_LIMIT:
                known[v] = arr
    return known


# ---------------------------------------------------------------------------------------------
# Reshape targets


def reshape_target(target: list[Dim], src: Shape | None, allowzero: bool) -> list[int] | None:
    """``target`` with its symbolic entries written as 0 (same as the input's dim at that place)
    or a single -1; None when that cannot be done."""
    out: list[int] = []
    unknown = []
    for i, d in enumerate(target):
        if isinstance(d, int):
            out.append(d)
        elif not allowzero and src is not None and i < len(src) and src[i] == d:
            out.append(0)
        else:
            unknown.append(i)
            out.append(-1)
    if not unknown:
        return out
    if len(unknown) > 1 or out.count(-1) > 1:
        return None
    return out


def _resolve_inferred(target: list[Dim], x: Value | None) -> list[Dim]:
    """``target`` with its -1 worked out symbolically from the input's shape (``[N, 4, -1, 7]``
    of a ``[4*N, 1, 7]`` input is ``[N, 4, 1, 7]``), so that a symbolic entry can take the one
    -1 a constant target may have; ``target`` as it is where that cannot be done."""
    src = x.shape if x is not None and isinstance(x.type, TensorType) else None
    if src is None or target.count(-1) != 1 or 0 in target:
        return target
    rest = dim_product(d for d in target if d != -1)
    missing = dim_divide(dim_product(src), rest)
    return target if missing is None else [missing if d == -1 else d for d in target]


def _reshape_rule(node: Node, known: dict[Value, np.ndarray]) -> np.ndarray | None:
    if node.op != "Reshape" or node.domain != "" or len(node.inputs) < 2:
        return None
    x, shape = node.inputs[0], node.inputs[1]
    if shape is None or shape.const is not None or shape not in known:
        return None
    value = known[shape]
    if value.ndim != 1:
        return None
    target = _resolve_inferred([d if isinstance(d, str) else int(d) for d in value.tolist()], x)
    new = reshape_target(
        target, x.shape if x is not None else None, bool(node.attrs.get("allowzero", 0))
    )
    return None if new is None else np.array(new, dtype=np.int64)


def _constant_target(known: dict[Value, np.ndarray]) -> Callable[[View, Found], Node | None]:
    """The replacement: the Reshape with its target as a constant, from the values ``known``."""

    def replace(view: View, found: Found) -> Node | None:
        node = found.root
        data = _reshape_rule(node, known)
        if data is None:
            return None
        target = add_constant(view.graph, f"{node.name or 'reshape'}_shape", data)
        inputs = [node.inputs[0], target]
        return Node("Reshape", inputs, node.outputs, dict(node.attrs), "", node.name)

    return replace


@register_pass("reshape_targets", level=1, order=41)
def reshape_targets(graph: Graph) -> int:
    """Give Reshapes with computed targets a constant target (with 0 and -1); returns how many."""
    rule = Rule("reshape_target", Op("Reshape"), _constant_target(shape_values(graph)))
    return run_rules(graph, [rule])


# ---------------------------------------------------------------------------------------------
# Shape computations with numeric values


def _numeric(arr: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """``arr`` as a numeric array of ``dtype`` when every entry is an integer, else None."""
    if arr.dtype != object:
        return arr.astype(dtype) if arr.dtype.kind in "iub" else None
    if not all(isinstance(x, int | np.integer) for x in arr.flat):
        return None
    return np.array(arr.tolist(), dtype=dtype).reshape(arr.shape)


@register_pass("known_shape_values", level=1, order=42)
def known_shape_values(graph: Graph) -> int:
    """Replace shape computations whose values are known numbers by constants; returns how many."""
    known = shape_values(graph)
    count, kept = 0, []
    for node in graph.nodes:
        out = node.outputs[0] if len(node.outputs) == 1 else None
        arr = known.get(out) if out is not None else None
        data = None
        wanted = arr is not None and out not in graph.outputs and node.op not in NO_FOLD
        wanted = wanted and not any(True for _ in node.subgraphs())
        if wanted and out.dtype is not None and out.dtype.is_integer:
            data = _numeric(arr, out.dtype.numpy)
        if data is None:
            kept.append(node)
            continue
        out.const = data
        out.type = TensorType(out.dtype, data.shape)
        graph.initializers.append(out)
        count += 1
    graph.nodes = kept
    return count
