"""ONNX ModelProto -> tensorkiln IR.

Initializers become constant Values (also when an old exporter lists them as graph inputs too);
subgraphs (If/Loop/Scan bodies) are converted recursively and refer to outer values by identity;
nodes are put in topological order even when the file lists them otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from tensorkiln.errors import GraphError, ModelLoadError
from tensorkiln.frontends.onnx.external import ExternalData, uses_external_data
from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.ir.onnx_types import from_type_proto
from tensorkiln.ir.toposort import toposort
from tensorkiln.ops import normalize_domain


def tensor_to_array(t: onnx.TensorProto, external: ExternalData | None = None) -> np.ndarray:
    """A numpy array from a TensorProto; strings become object arrays of str.

    A tensor with external data is read through ``external`` (a read-only view of the mapped file).
    """
    if uses_external_data(t):
        if external is None:
            raise ModelLoadError(
                f"tensor '{t.name}' keeps its data in an external file; load the model from its "
                "path (or pass base_dir=) so the file can be found"
            )
        return external.array(t)
    try:
        arr = numpy_helper.to_array(t)
    except Exception as exc:  # malformed tensor payloads raise assorted errors inside onnx
        raise ModelLoadError(f"tensor '{t.name}' could not be decoded: {exc}") from None
    if t.data_type == onnx.TensorProto.STRING:
        arr = _decode_strings(arr)
    return arr


def _decode_strings(arr: np.ndarray) -> np.ndarray:
    flat = [s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s for s in arr.flat]
    return np.array(flat, dtype=object).reshape(arr.shape)


def sparse_to_array(sp: onnx.SparseTensorProto, external: ExternalData | None = None) -> np.ndarray:
    """The dense array of a sparse tensor; malformed dims or indices are a ModelLoadError."""
    values = tensor_to_array(sp.values, external)
    indices = tensor_to_array(sp.indices, external).astype(np.int64)
    try:
        dense = np.zeros(tuple(sp.dims), dtype=values.dtype)
        if indices.ndim == 1:
            dense.reshape(-1)[indices] = values
        else:
            dense[tuple(indices.T)] = values
    except (MemoryError, ValueError, IndexError) as exc:  # dims or indices a file got wrong
        raise ModelLoadError(
            f"sparse tensor '{sp.values.name}' of dims {list(sp.dims)} cannot be made dense: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return dense


class _Scope:
    """Names visible in a graph: its own values, then the enclosing graph's."""

    def __init__(self, parent: _Scope | None = None) -> None:
        self.names: dict[str, Value] = {}
        self.parent = parent

    def get(self, name: str) -> Value | None:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None


class _Converter:
    def __init__(self, opsets: dict[str, int], external: ExternalData | None) -> None:
        self.opsets = opsets
        self.external = external
        self.node_names: set[str] = set()

    def graph(self, gp: onnx.GraphProto, parent: _Scope | None) -> Graph:
        scope = _Scope(parent)
        types = {vi.name: from_type_proto(vi.type) for vi in gp.value_info}
        types.update({vi.name: from_type_proto(vi.type) for vi in gp.output})
        init_names = {t.name for t in gp.initializer} | {
            s.values.name for s in gp.sparse_initializer
        }
        graph = Graph(name=gp.name or "graph", opsets=self.opsets, doc=gp.doc_string)
        for vi in gp.input:
            if vi.name in init_names:
                continue  # an initializer listed as an input (old exporters): a constant
            v = Value(vi.name, from_type_proto(vi.type))
            graph.inputs.append(self._define(scope, v, "graph input"))
        for t in gp.initializer:
            arr = tensor_to_array(t, self.external)
            v = Value(t.name, TensorType(DType(t.data_type), arr.shape), const=arr)
            graph.initializers.append(self._define(scope, v, "initializer"))
        for sp in gp.sparse_initializer:
            arr = sparse_to_array(sp, self.external)
            v = Value(sp.values.name, TensorType(DType(sp.values.data_type), arr.shape), const=arr)
            graph.initializers.append(self._define(scope, v, "initializer"))
        # Define every node output first, so that files whose nodes are out of order still import.
        for i, np_ in enumerate(gp.node):
            for name in np_.output:
                if name:
                    self._define(scope, Value(name, types.get(name)), f"output of node {i}")
        for i, np_ in enumerate(gp.node):
            graph.nodes.append(self.node(np_, i, scope))
        for vi in gp.output:
            v = scope.get(vi.name)
            if v is None:
                raise GraphError(
                    f"graph '{graph.name}' output '{vi.name}' is not produced by any node, input "
                    "or initializer"
                )
            if v.type is None:
                v.type = from_type_proto(vi.type)
            graph.outputs.append(v)
        graph.nodes = toposort(graph)
        return graph

    @staticmethod
    def _define(scope: _Scope, v: Value, what: str) -> Value:
        if v.name in scope.names:
            raise GraphError(
                f"'{v.name}' is defined twice (again as {what}); ONNX requires SSA form"
            )
        scope.names[v.name] = v
        return v

    def unique_name(self, name: str) -> str:
        """Node names are unique across the model (profiles and reports key layers by name)."""
        base, k = name, 1
        while name in self.node_names:
            name = f"{base}_{k}"
            k += 1
        self.node_names.add(name)
        return name

    def node(self, np_: onnx.NodeProto, index: int, scope: _Scope) -> Node:
        name = self.unique_name(np_.name or f"{np_.op_type}_{index}")
        inputs: list[Value | None] = []
        for inp in np_.input:
            if not inp:
                inputs.append(None)
                continue
            v = scope.get(inp)
            if v is None:
                raise GraphError(
                    f"node '{name}' ({np_.op_type}) reads '{inp}', which no node, graph input or "
                    "initializer defines"
                )
            inputs.append(v)
        outputs = [scope.names[o] if o else None for o in np_.output]
        attrs = {a.name: self.attribute(a, name, scope) for a in np_.attribute}
        return Node(np_.op_type, inputs, outputs, attrs, normalize_domain(np_.domain), name)

    def attribute(self, a: onnx.AttributeProto, node: str, scope: _Scope) -> Any:
        if a.ref_attr_name:
            raise GraphError(f"node '{node}' attribute '{a.name}' refers to a function attribute")
        T = onnx.AttributeProto
        match a.type:
            case T.FLOAT:
                return float(a.f)
            case T.INT:
                return int(a.i)
            case T.STRING:
                return a.s.decode("utf-8", errors="replace")
            case T.TENSOR:
                return tensor_to_array(a.t, self.external)
            case T.GRAPH:
                return self.graph(a.g, scope)
            case T.SPARSE_TENSOR:
                return sparse_to_array(a.sparse_tensor, self.external)
            case T.TYPE_PROTO:
                return a.tp
            case T.FLOATS:
                return [float(x) for x in a.floats]
            case T.INTS:
                return [int(x) for x in a.ints]
            case T.STRINGS:
                return [s.decode("utf-8", errors="replace") for s in a.strings]
            case T.TENSORS:
                return [tensor_to_array(t, self.external) for t in a.tensors]
            case T.GRAPHS:
                return [self.graph(g, scope) for g in a.graphs]
            case T.SPARSE_TENSORS:
                return [sparse_to_array(s, self.external) for s in a.sparse_tensors]
            case T.TYPE_PROTOS:
                return list(a.type_protos)
        raise GraphError(f"node '{node}' attribute '{a.name}' has unknown type {a.type}")


def opsets_of(model: onnx.ModelProto) -> dict[str, int]:
    """Domain -> opset version; an old model with no opset import means opset 1."""
    opsets = {normalize_domain(o.domain): int(o.version) for o in model.opset_import}
    opsets.setdefault("", 1)
    return opsets


def convert_model(model: onnx.ModelProto, external: ExternalData | None = None) -> Graph:
    """Convert a (function-free) ModelProto to an IR Graph; ``external`` reads external data."""
    return _Converter(opsets_of(model), external).graph(model.graph, None)
