"""Shape and type inference over the IR, with symbolic dimensions.

For each node, in order:

1. If every input's value is known (initializers, Constant nodes, shapes of static tensors) and small,
   the node is evaluated with its reference kernel: its outputs become known values with exact types.
   This is how shape computations (Shape -> Gather -> Concat -> Reshape) resolve.
2. Ops that compute shapes (Shape, Gather, Concat, Slice, Unsqueeze, ...) also propagate *symbolic*
   values, so a dynamic batch "N" read by Shape and fed to Reshape stays "N".
3. Otherwise a native rule from :mod:`tensorkiln.ir.shape_rules` gives the output types, or, for ops
   without one, ONNX's own per-node schema inference does.

Native rules raise :class:`ShapeInferenceError` (naming the node) on incompatible inputs.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tensorkiln.errors import ShapeInferenceError, TensorkilnError
from tensorkiln.ir.dims import is_anonymous
from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import Graph, Node, TensorType, Type, Value
from tensorkiln.ir.onnx_types import from_type_proto, type_to_proto
from tensorkiln.ir.shape_rules import RULES, InferContext, symbolic_value

# Values up to this many elements are kept and used to evaluate downstream shape computations.
_FOLD_LIMIT = 4096
# The most bytes evaluating one node ahead of time (at import, in constant folding and shape
# passes) may materialize, computed from the output shapes before anything is allocated. Folding
# is for shape arithmetic and small weight transforms: the passes keep at most 1M elements per
# output (passes.cleanup.FOLD_MAX_ELEMENTS, 8 MiB at 8 bytes each), so 16 MiB never refuses what
# they want, while a 180-byte model whose ConstantOfShape asks for 4 GiB is left to run at run
# time (the same idea as the size_threshold of onnx-graphsurgeon's fold_constants, Polygraphy's
# --fold-size-threshold). Nodes whose output size cannot be known before running are not
# evaluated, except those whose outputs are bounded by their inputs (_BOUNDED_BY_INPUTS).
FOLD_MAX_BYTES = 16 << 20
# Ops whose output sizes depend on input values but never exceed a small multiple of the inputs'
# (NonZero: rank x count indices; Unique and Compress: at most their input).
_BOUNDED_BY_INPUTS = frozenset({"NonZero", "Unique", "Compress"})
# Ops whose outputs are random draws: never evaluated ahead of time, never merged.
RANDOM_OPS = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
        "Dropout",
    }
)
_NO_FOLD = RANDOM_OPS | {"If", "Loop", "Scan", "SequenceMap"}


def infer_shapes(graph: Graph, known: dict[Value, np.ndarray] | None = None) -> None:
    """Fill in the types of every value of ``graph`` (and its subgraphs) in place."""
    known = dict(known or {})
    for v in graph.initializers:
        if v.const is not None and v.const.size <= _FOLD_LIMIT:
            known[v] = v.const
    for node in graph.nodes:
        try:
            _infer_node(graph, node, known)
        except ShapeInferenceError:
            raise
        except TensorkilnError as exc:
            raise ShapeInferenceError(f"node '{node.name}' ({node.op}): {exc}") from None


def infer_at_shapes(graph: Graph, shapes: dict[str, tuple[int, ...]]) -> Graph:
    """A copy of ``graph`` with the named inputs at concrete ``shapes`` and every type inferred
    from them; the weights (of subgraphs too) are shared with ``graph``, not copied."""
    graphs = {id(graph): graph} | {id(g): g for g, _ in graph.walk()}
    shared = {id(v.const): v.const for sub in graphs.values() for v in sub.initializers}
    g = copy.deepcopy(graph, shared)
    for v in g.inputs:
        if v.name in shapes and isinstance(v.type, TensorType):
            v.type = TensorType(v.type.dtype, tuple(shapes[v.name]))
    infer_shapes(g)
    return g


def _infer_node(graph: Graph, node: Node, known: dict[Value, np.ndarray]) -> None:
    for sub in node.subgraphs():
        infer_shapes(sub, known)
    values = [known.get(v) if v is not None else None for v in node.inputs]
    folded = _try_fold(graph, node, values)
    if folded is not None:
        for v, arr in zip(node.outputs, folded):
            if v is not None and isinstance(arr, np.ndarray):
                v.type = TensorType(DType.from_numpy(arr.dtype), arr.shape)
                if arr.size <= _FOLD_LIMIT:
                    known[v] = arr
        return
    for v, t in zip(node.outputs, node_types(graph, node, values)):
        if v is not None and t is not None:
            v.type = merge_types(v.type, t)
    sym = symbolic_value(InferContext(node, graph.opset(node.domain), values))
    if sym is not None and node.outputs and node.outputs[0] is not None:
        known[node.outputs[0]] = sym


def node_types(graph: Graph, node: Node, values: list) -> list[Type | None]:
    """The node's output types from its native shape rule or, without one, ONNX's inference;
    ``values`` are the input values known ahead of time (None where not)."""
    if node.domain == "tensorkiln":
        import tensorkiln.kernels.reference  # noqa: F401  (fused ops register their shape rules)
    rule = RULES.get((node.domain, node.op))
    if rule is None:
        return _onnx_infer(graph, node)
    try:
        return rule(InferContext(node, graph.opset(node.domain), values))
    except ShapeInferenceError:
        raise
    except (ValueError, IndexError, TypeError, KeyError) as exc:
        raise ShapeInferenceError(f"node '{node.name}' ({node.op}): {exc}") from None


def _try_fold(graph: Graph, node: Node, values: list) -> list | None:
    if node.op in _NO_FOLD or any(True for _ in node.subgraphs()):
        return None
    present = [v for v, inp in zip(values, node.inputs) if inp is not None]
    if not present and node.op != "Constant":
        return None
    if any(not isinstance(v, np.ndarray) or v.dtype == object for v in present):
        return None
    if sum(v.size for v in present) > _FOLD_LIMIT:
        return None
    return evaluate_node(graph, node, values)


def evaluate_node(
    graph: Graph, node: Node, args: list, *, max_bytes: int | None = None
) -> list | None:
    """The node's outputs computed by its reference kernel on ``args``, or None when that is not
    possible (no kernel, a kernel that runs subgraphs, or one that rejects these inputs) or not
    wise: outputs of more than ``max_bytes`` together (default :data:`FOLD_MAX_BYTES`), or of a
    size unknown before running."""
    from tensorkiln.kernels.registry import invoke, lookup  # late: kernels import the IR

    try:
        entry = lookup(node.op, node.domain, graph.opset(node.domain), node=node.name)
    except TensorkilnError:
        return None
    limit = FOLD_MAX_BYTES if max_bytes is None else max_bytes
    if entry.wants_ctx or not _fits(graph, node, args, limit):
        return None
    try:
        return invoke(entry, args, node.attrs, len(node.outputs))[: len(node.outputs)]
    except Exception:  # a kernel that rejects these inputs: leave the node to the shape rules
        return None


def _fits(graph: Graph, node: Node, args: list, max_bytes: int) -> bool:
    """Whether evaluating ``node`` on ``args`` stays within ``max_bytes`` of outputs."""
    if node.op == "Constant" and node.domain == "":
        return True  # its output is its attribute, already in memory
    size = output_bytes(graph, node, args)
    if size is not None:
        return size <= max_bytes
    if node.op not in _BOUNDED_BY_INPUTS or node.domain != "":
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


def _onnx_infer(graph: Graph, node: Node) -> list[Type | None]:
    types = _onnx_infer_as(graph, node, {})
    narrow = {v.dtype for v in node.inputs if v is not None} & {DType.BFLOAT16, DType.FLOAT16}
    if all(t is None for t in types) and narrow:
        # Older op versions leave bfloat16 (or float16) out of their type constraints, though our
        # kernels take it (engines in reduced precision): infer in float32 and narrow the result.
        (dt,) = narrow if len(narrow) == 1 else (DType.BFLOAT16,)
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
