"""Function expansion: model-local functions and standard ops that ONNX defines as functions.

ONNX defines many operators (Gelu, LayerNormalization, Celu, Attention, ...) as a function of simpler
ones. A backend without its own kernel for such an op still runs the model: the node is replaced by the
function's body. Model-local functions (as torch's dynamo exporter writes) are always inlined.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import onnx
import onnx.inliner
from onnx import shape_inference

from tensorkiln.errors import ModelLoadError
from tensorkiln.kernels.registry import has_kernel
from tensorkiln.ops import normalize_domain

_FN_DOMAIN = "tensorkiln.expanded"
_MAX_ROUNDS = 4


def expand_functions(model: onnx.ModelProto, backend: str = "reference") -> onnx.ModelProto:
    """Inline model-local functions, then expand function ops ``backend`` has no kernel for."""
    if model.functions:
        model = _inline(model)
    for _ in range(_MAX_ROUNDS):
        opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
        todo = [n for n in _walk(model.graph) if _wants_expansion(n, opsets, backend)]
        if not todo:
            break
        types = _value_types(model)
        counter = itertools.count()
        added = False
        for node in todo:
            fn = _function_for(node, opsets, types)
            if fn is None:
                continue
            fn.name = f"{node.op_type}_{next(counter)}"
            fn.domain = _FN_DOMAIN
            node.op_type, node.domain = fn.name, _FN_DOMAIN
            model.functions.append(fn)
            added = True
        if not added:
            break
        if all(o.domain != _FN_DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(_FN_DOMAIN, 1))
        model = _inline(model)
    return model


def _inline(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.inliner.inline_local_functions(model)
    except Exception as exc:  # the inliner raises assorted C++ errors on malformed functions
        raise ModelLoadError(f"the model's functions could not be inlined: {exc}") from None


def _walk(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _walk(attr.g)
            for g in attr.graphs:
                yield from _walk(g)


def _schema(node: onnx.NodeProto, opsets: dict[str, int]) -> onnx.defs.OpSchema | None:
    domain = normalize_domain(node.domain)
    try:
        return onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), node.domain)
    except onnx.defs.SchemaError:
        return None


def _wants_expansion(node: onnx.NodeProto, opsets: dict[str, int], backend: str) -> bool:
    if has_kernel(node.op_type, node.domain, backend):
        return False
    schema = _schema(node, opsets)
    return schema is not None and (schema.has_function or schema.has_context_dependent_function)


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:  # inference is best effort here; expansion then lacks some types
        inferred = model
    g = inferred.graph
    types = {vi.name: vi.type for vi in [*g.value_info, *g.input, *g.output]}
    for t in g.initializer:
        types[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return types


def _function_for(
    node: onnx.NodeProto, opsets: dict[str, int], types: dict[str, onnx.TypeProto]
) -> onnx.FunctionProto | None:
    schema = _schema(node, opsets)
    if schema is None:
        return None
    fn = onnx.FunctionProto()
    if schema.has_function:
        fn.CopyFrom(schema.function_body)
    elif schema.has_context_dependent_function:
        if any(i and i not in types for i in node.input):
            return None
        input_types = [types[i] if i else onnx.TypeProto() for i in node.input]
        try:
            body = schema.get_context_dependent_function(
                node.SerializeToString(), [t.SerializeToString() for t in input_types]
            )
        except Exception:  # onnx cannot build the body for this node's attributes or types
            return None
        fn.ParseFromString(body)
    else:
        return None
    # The inliner only inlines bodies whose opset imports agree with the model's: declare the
    # model's versions (function bodies use ops whose meaning holds across these versions).
    for o in fn.opset_import:
        domain = normalize_domain(o.domain)
        if domain in opsets:
            o.version = opsets[domain]
    return fn
