"""Shape and type inference over the IR, with symbolic dimensions.

For each node, in order:

1. If every input's value is known (initializers, Constant nodes, shapes of static tensors) and small,
   the node is evaluated by the caller's ``evaluate`` (the reference kernels, through
   :func:`tensorkiln.kernels.evaluate.infer_shapes`): its outputs become known values with exact
   types. This is how shape computations (Shape -> Gather -> Concat -> Reshape) resolve. This module
   knows no kernel: without ``evaluate`` only Constant nodes are evaluated.
2. Ops that compute shapes (Shape, Gather, Concat, Slice, Unsqueeze, ...) also propagate *symbolic*
   values, so a dynamic batch "N" read by Shape and fed to Reshape stays "N".
3. Otherwise the op record's native shape rule (:mod:`tensorkiln.ops.shape_rules`) gives the output
   types, or, for ops without one, ONNX's own per-node schema inference does.

Native rules raise :class:`ShapeInferenceError` (naming the node) on incompatible inputs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tensorkiln.errors import ShapeInferenceError, TensorkilnError
from tensorkiln.ir.dims import is_anonymous
from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import Graph, Node, TensorType, Type, Value
from tensorkiln.ir.onnx_types import from_type_proto, type_to_proto
from tensorkiln.ops.records import BOUNDED, CONTROL, RANDOM, has_trait, shape_rule
from tensorkiln.ops.shape_rules import InferContext, symbolic_value

# How a caller evaluates a node ahead of time: its outputs computed on known input values, or
# None when that is not possible or not wise (see tensorkiln.kernels.evaluate.evaluate_node).
Evaluate = Callable[[Graph, Node, list], "list | None"]

# Values up to this many elements are kept and used to evaluate downstream shape computations.
_FOLD_LIMIT = 4096


def no_fold(node: Node) -> bool:
    """Whether ``node`` must never be evaluated ahead of time: random draws, control flow."""
    return has_trait(node.op, node.domain, RANDOM) or has_trait(node.op, node.domain, CONTROL)


def infer_shapes(
    graph: Graph,
    known: dict[Value, np.ndarray] | None = None,
    *,
    evaluate: Evaluate | None = None,
) -> None:
    """Fill in the types of every value of ``graph`` (and its subgraphs) in place; nodes whose
    inputs are all known and small are evaluated by ``evaluate`` (only Constant nodes without)."""
    known = dict(known or {})
    for v in graph.initializers:
        if v.const is not None and v.const.size <= _FOLD_LIMIT:
            known[v] = v.const
    for node in graph.nodes:
        try:
            _infer_node(graph, node, known, evaluate)
        except ShapeInferenceError:
            raise
        except TensorkilnError as exc:
            raise ShapeInferenceError(f"node '{node.name}' ({node.op}): {exc}") from None


def infer_at_shapes(
    graph: Graph, shapes: dict[str, tuple[int, ...]], *, evaluate: Evaluate | None = None
) -> Graph:
    """A copy of ``graph`` with the named inputs at concrete ``shapes`` and every type inferred
    from them; the weights (of subgraphs too) are shared with ``graph``, not copied."""
    graphs = {id(graph): graph} | {id(g): g for g, _ in graph.walk()}
    shared = {id(v.const): v.const for sub in graphs.values() for v in sub.initializers}
    g = copy.deepcopy(graph, shared)
    for v in g.inputs:
        if v.name in shapes and isinstance(v.type, TensorType):
            v.type = TensorType(v.type.dtype, tuple(shapes[v.name]))
    infer_shapes(g, evaluate=evaluate)
    return g


def _infer_node(
    graph: Graph, node: Node, known: dict[Value, np.ndarray], evaluate: Evaluate | None
) -> None:
    for sub in node.subgraphs():
        infer_shapes(sub, known, evaluate=evaluate)
    values = [known.get(v) if v is not None else None for v in node.inputs]
    folded = _try_fold(graph, node, values, evaluate)
    if folded is not None:
        for v, arr in zip(node.outputs, folded):
            if v is not None and isinstance(arr, np.ndarray):
                v.type = TensorType(DType.from_numpy(arr.dtype), arr.shape)
                if arr.size <= _FOLD_LIMIT:
                    known[v] = arr
        return
    for v, t in zip(node.outputs, node_types(graph, node, values, evaluate)):
        if v is not None and t is not None:
            v.type = merge_types(v.type, t)
    sym = symbolic_value(InferContext(node, graph.opset(node.domain), values))
    if sym is not None and node.outputs and node.outputs[0] is not None:
        known[node.outputs[0]] = sym


def node_types(
    graph: Graph, node: Node, values: list, evaluate: Evaluate | None = None
) -> list[Type | None]:
    """The node's output types from its native shape rule or, without one, ONNX's inference;
    ``values`` are the input values known ahead of time (None where not); ``evaluate`` is passed
    on to rules that infer a body graph."""
    rule = shape_rule(node.op, node.domain)
    if rule is None:
        return _onnx_infer(graph, node)

    def infer_body(body: Graph) -> None:
        infer_shapes(body, evaluate=evaluate)

    try:
        return rule(InferContext(node, graph.opset(node.domain), values, infer_body))
    except ShapeInferenceError:
        raise
    except (ValueError, IndexError, TypeError, KeyError) as exc:
        raise ShapeInferenceError(f"node '{node.name}' ({node.op}): {exc}") from None


def _try_fold(graph: Graph, node: Node, values: list, evaluate: Evaluate | None) -> list | None:
    if no_fold(node) or any(True for _ in node.subgraphs()):
        return None
    present = [v for v, inp in zip(values, node.inputs) if inp is not None]
    if not present and node.op != "Constant":
        return None
    if any(not isinstance(v, np.ndarray) or v.dtype == object for v in present):
        return None
    if sum(v.size for v in present) > _FOLD_LIMIT:
        return None
    if evaluate is None:
        return _constant(node)
    return evaluate(graph, node, values)


def _constant(node: Node) -> list | None:
    """A Constant node's value (what any evaluator gives), so that inference without kernels
    still knows the shapes that constants spell."""
    if node.op != "Constant" or node.domain != "" or len(node.attrs) != 1:
        return None
    ((name, value),) = node.attrs.items()
    if name == "value" and isinstance(value, np.ndarray):
        return [value]
    if name in ("value_int", "value_ints"):
        return [np.asarray(value, dtype=np.int64)]
    if name in ("value_float", "value_floats"):
        return [np.asarray(value, dtype=np.float32)]
    return None


def fits(graph: Graph, node: Node, args: list, max_bytes: int) -> bool:
    """Whether evaluating ``node`` on ``args`` stays within ``max_bytes`` of outputs."""
    if node.op == "Constant" and node.domain == "":
        return True  # its output is its attribute, already in memory
    size = output_bytes(graph, node, args)
    if size is not None:
        return size <= max_bytes
    if not has_trait(node.op, node.domain, BOUNDED):
        return False
    inputs = sum(a.nbytes for a in args if isinstance(a, np.ndarray))
    return 8 * inputs <= max_bytes  # (NonZero's int64 indices: up to rank x 8 bytes each)


def output_bytes(graph: Graph, node: Node, args: list) -> int | None:
    """The bytes the node's declared outputs take when computed on ``args``, from the shape rules
    on the args' own types and values (not the types the graph declares, which a hostile file
    may state wrongly); None when a size is not known before running."""
    inputs: list[Value | None] = []
    for i, v in enumerate(node.inputs):
        a = args[i] if i < len(args) else None
        if v is None or not isinstance(a, np.ndarray) or a.dtype == object:
            inputs.append(v)
            continue
        try:
            t = TensorType(DType.from_numpy(a.dtype), a.shape)
        except (TypeError, ValueError, KeyError):
            return None
        inputs.append(Value(v.name, t, const=a))
    outputs = [None if v is None else Value(v.name) for v in node.outputs]
    probe = Node(node.op, inputs, outputs, node.attrs, node.domain, node.name)
    try:
        types = node_types(graph, probe, list(args))
    except Exception:  # a rule that rejects these inputs: the size is not known
        return None
    total = 0
    for v, t in zip(node.outputs, [*types, *[None] * len(node.outputs)]):
        if v is None:
            continue
        if not isinstance(t, TensorType) or t.dtype is None or t.shape is None:
            return None
        if not all(isinstance(d, int) for d in t.shape):
            return None
        total += (int(np.prod(t.shape, dtype=object)) * t.dtype.bits + 7) // 8
    return total


def merge_types(old: Type | None, new: Type) -> Type:
    """The inferred type, keeping declared symbol names where inference only knows 'some size'."""
    if not (isinstance(old, TensorType) and isinstance(new, TensorType)):
        return new
    dtype = new.dtype if new.dtype is not None else old.dtype
    if new.shape is None:
        return TensorType(dtype, old.shape)
    if old.shape is None or len(old.shape) != len(new.shape):
        return TensorType(dtype, new.shape)
    shape = tuple(
        o if is_anonymous(n) and not is_anonymous(o) else n for o, n in zip(old.shape, new.shape)
    )
    return TensorType(dtype, shape)


# ---------------------------------------------------------------------------------------------
# Fallback: ONNX's own per-node inference.


def _attr_to_proto(name: str, value: object) -> onnx.AttributeProto | None:
    if isinstance(value, np.ndarray):
        return helper.make_attribute(name, numpy_helper.from_array(value))
    if isinstance(value, onnx.TypeProto):
        return helper.make_attribute(name, value)
    if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
        return helper.make_attribute(name, [numpy_helper.from_array(v) for v in value])
    if isinstance(value, Graph) or (
        isinstance(value, list) and value and isinstance(value[0], Graph)
    ):
        return None
    return helper.make_attribute(name, value)


# the float types an op version's type constraints may leave out, though our kernels take them
# (engines in reduced precision: bfloat16 and float16 layers, an FP8 engine's pool of E4M3 codes)
_NARROW = {DType.BFLOAT16, DType.FLOAT16, DType.FLOAT8E4M3FN, DType.FLOAT8E5M2}


def _onnx_infer(graph: Graph, node: Node) -> list[Type | None]:
    types = _onnx_infer_as(graph, node, {})
    narrow = {v.dtype for v in node.inputs if v is not None} & _NARROW
    if narrow == {DType.BFLOAT16, DType.FLOAT16}:
        narrow = {DType.BFLOAT16}
    if all(t is None for t in types) and len(narrow) == 1:
        # Older op versions leave such a type out of their type constraints (MaxPool takes no
        # float8 at any opset): infer in float32 and narrow the result.
        (dt,) = narrow
        wide = _onnx_infer_as(graph, node, {dt: DType.FLOAT})
        types = [
            TensorType(dt, t.shape) if isinstance(t, TensorType) and t.dtype == DType.FLOAT else t
            for t in wide
        ]
    return types


def _onnx_infer_as(graph: Graph, node: Node, swap: dict[DType, DType]) -> list[Type | None]:
    """ONNX's inference for ``node`` with input dtypes replaced as ``swap`` says."""
    try:
        schema = onnx.defs.get_schema(node.op, graph.opset(node.domain), node.domain)
    except onnx.defs.SchemaError:
        return [None] * len(node.outputs)
    names = [f"i{i}" if v is not None else "" for i, v in enumerate(node.inputs)]
    outs = [f"o{i}" if v is not None else "" for i, v in enumerate(node.outputs)]
    attrs = [a for k, v in node.attrs.items() if (a := _attr_to_proto(k, v)) is not None]
    proto = helper.make_node(node.op, names, outs, domain=node.domain)
    proto.attribute.extend(attrs)
    types = {
        n: type_to_proto(_swapped(v.type, swap))
        for n, v in zip(names, node.inputs)
        if v is not None
    }
    data = {}
    for n, v in zip(names, node.inputs):
        if swap and v is not None and v.dtype in swap:
            continue
        if v is not None and v.const is not None and v.const.size <= _FOLD_LIMIT:
            data[n] = numpy_helper.from_array(v.const)
    opsets = [helper.make_opsetid(d, ver) for d, ver in graph.opsets.items()]
    try:
        result = onnx.shape_inference.infer_node_outputs(schema, proto, types, data, None, opsets)
    except Exception:  # ONNX could not infer (missing input types, unsupported case): unknown
        return [None] * len(node.outputs)
    return [from_type_proto(result.get(o)) if o else None for o in outs]


def _swapped(t: Type | None, swap: dict[DType, DType]) -> Type | None:
    if isinstance(t, TensorType) and t.dtype in swap:
        return TensorType(swap[t.dtype], t.shape)
    return t
