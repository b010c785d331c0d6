"""Run a graph in float16 or bfloat16: weights converted once at build time, activations in the
reduced type, the engine's inputs and outputs kept in the model's dtypes.

Every float32 value of the graph becomes the reduced type: float32 initializers are converted,
dtype attributes that produce float32 (Cast, ConstantOfShape, EyeLike, random ops, Constant values)
are rewritten, a Cast follows each float32 graph input and precedes each float32 graph output, and
shape inference then carries the new type through the graph. Inputs that are coordinates or
scales rather than data (Resize's roi and scales, ...) are cast back to float32 where they are read.

Overflow-prone accumulations (LayerNorm and Softmax statistics, reductions, attention) stay float32
inside the kernels, which upcast internally. Nodes named in ``keep`` (cancellation-prone subgraphs,
see :mod:`tensorkiln.precision.cancellation`) stay float32 as a whole: their float inputs are cast
up (constants keep their float32 values), and what they give to the rest of the graph is cast down.
"""

from __future__ import annotations

from collections.abc import Collection

import ml_dtypes
import numpy as np

from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.kernels.evaluate import infer_shapes

F32 = DType.FLOAT
# (domain, op) -> input positions that must stay float32 (coordinates and scales, not activations)
KEEP_FP32_INPUTS: dict[tuple[str, str], tuple[int, ...]] = {
    ("", "Resize"): (1, 2),
    ("", "Upsample"): (1,),
    ("", "RoiAlign"): (1,),
    ("", "MaxRoiPool"): (1,),
    # quantization scales: float16 would round them, and the quantized values with them
    ("", "QuantizeLinear"): (1,),
    ("tensorkiln", "QConvAct"): (1, 3, 6, 7),
    ("tensorkiln", "QConvPool"): (1, 3, 6),
    ("tensorkiln", "QGemmAct"): (1, 3, 5),
    ("tensorkiln", "LayerNorm"): (4,),
    ("tensorkiln", "Attention"): (4,),
}
# ops whose attribute names a float32 output dtype: (domain, op) -> attribute
_DTYPE_ATTRS = {
    ("", "Cast"): "to",
    ("", "EyeLike"): "dtype",
    ("", "RandomNormal"): "dtype",
    ("", "RandomUniform"): "dtype",
    ("", "RandomNormalLike"): "dtype",
    ("", "RandomUniformLike"): "dtype",
    ("", "Multinomial"): "dtype",
    ("", "Bernoulli"): "dtype",
    ("tensorkiln", "QConvAct"): "out_dtype",
    ("tensorkiln", "QConvPool"): "out_dtype",
    ("tensorkiln", "QGemmAct"): "out_dtype",
}


def reduce_precision(graph: Graph, dtype: DType, keep: Collection[Node] = ()) -> int:
    """Rewrite ``graph`` in place to compute its float32 tensors in ``dtype``, but the top-level
    nodes in ``keep``, which stay float32; returns how many values changed type."""
    if dtype not in (DType.FLOAT16, DType.BFLOAT16):
        raise ValueError(f"reduce_precision takes float16 or bfloat16, not {dtype.name}")
    keep = set(keep)
    originals = {  # float32 constants the kept nodes read, before they are narrowed
        v: v.const for n in keep for v in n.inputs if v is not None and _is_f32_const(v)
    }
    for g in _graphs(graph, keep):
        _convert_consts(g, dtype)
        for n in g.nodes:
            if n not in keep:
                _convert_attrs(n, dtype)
        if g is not graph:  # subgraph inputs (Pointwise bodies, loop-carried state) follow along
            for v in g.inputs:
                if v.dtype == F32:
                    v.type = TensorType(dtype, v.shape)
    _cast_io(graph, dtype)
    if keep:
        _isolate(graph, keep, dtype, originals)
    for g in _graphs(graph):
        _keep_fp32_inputs(g)
    before = {v: v.dtype for g in _graphs(graph) for v in g.values()}
    infer_shapes(graph)
    return sum(1 for v, d in before.items() if d == F32 and v.dtype == dtype)


def _graphs(graph: Graph, skip: Collection[Node] = ()) -> list[Graph]:
    """``graph`` and its subgraphs, but those of the nodes in ``skip``."""
    out = [graph]
    for _, n in graph.walk():
        if n not in skip:
            out.extend(n.subgraphs())
    return out


def _is_f32_const(v: Value) -> bool:
    return v.const is not None and v.const.dtype == np.float32


def _isolate(graph: Graph, keep: set[Node], dtype: DType, originals: dict) -> None:
    """Cast the inputs of the kept nodes up to float32 and their outputs read by other nodes
    down to ``dtype``; a kept node reading a constant gets a float32 copy of the original."""
    consumers, producers = graph.consumers(), graph.producers()
    # a kept node reads a float32 engine input as it is, not its cast to the reduced type
    up: dict[Value, Value] = {
        n.outputs[0]: n.inputs[0]
        for n in graph.nodes
        if n.op == "Cast" and n.inputs[0] in graph.inputs and n.name.endswith("__cast_in")
    }
    nodes: list[Node] = []
    for n in graph.nodes:
        if n not in keep:
            nodes.append(n)
            continue
        for i, v in enumerate(n.inputs):
            if v is None or v.dtype not in (dtype, F32):
                continue
            if v not in up and v in originals:
                up[v] = Value(f"{v.name}__fp32", TensorType(F32, v.shape), originals[v])
                graph.initializers.append(up[v])
            elif v not in up and v.const is None and producers.get(v) not in keep:
                up[v] = Value(f"{v.name}__fp32", TensorType(F32, v.shape))
                nodes.append(Node("Cast", [v], [up[v]], {"to": F32.value}, name=up[v].name))
            n.inputs[i] = up.get(v, v)
        nodes.append(n)
        nodes.extend(_cast_down(n, keep, consumers, dtype))
    graph.nodes[:] = nodes


def _cast_down(
    n: Node, keep: set[Node], consumers: dict[Value, list[Node]], dtype: DType
) -> list[Node]:
    """Casts to ``dtype`` of ``n``'s float32 outputs for the consumers outside ``keep`` (a Cast
    to float32, such as the engine's output cast, reads the float32 value as it is)."""
    casts = []
    for v in n.outputs:
        if v is None or v.dtype not in (F32, dtype):  # (types are not inferred again yet)
            continue
        readers = [
            c
            for c in consumers.get(v, [])
            if c not in keep and not (c.op == "Cast" and c.attrs.get("to") == F32.value)
        ]
        if not readers:
            continue
        low = Value(f"{v.name}__{dtype.short}", TensorType(dtype, v.shape))
        casts.append(Node("Cast", [v], [low], {"to": dtype.value}, name=low.name))
        for c in readers:
            c.inputs = [low if x is v else x for x in c.inputs]
            _replace_in_subgraphs(c, v, low)
    return casts


def _convert_consts(g: Graph, dtype: DType) -> None:
    for v in g.initializers:
        if v.const is not None and v.const.dtype == np.float32:
            v.const = _narrow(v.const, dtype)
            v.type = TensorType(dtype, tuple(v.const.shape))


def _narrow(arr: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 -> float16/bfloat16, saturating instead of overflowing to infinity (a -3.4e38 mask
    constant becomes the reduced type's lowest finite value, as TensorRT clamps)."""
    info = ml_dtypes.finfo(dtype.numpy)
    finite = np.isfinite(arr)
    clipped = np.where(finite, np.clip(arr, float(info.min), float(info.max)), arr)
    return clipped.astype(dtype.numpy)


def _convert_attrs(n: Node, dtype: DType) -> None:
    key = (n.domain, n.op)
    name = _DTYPE_ATTRS.get(key)
    if name is not None and n.attrs.get(name) == F32.value:
        n.attrs[name] = dtype.value
    if n.op in ("Constant", "ConstantOfShape") and n.domain == "":
        for k, a in n.attrs.items():
            if isinstance(a, np.ndarray) and a.dtype == np.float32:
                n.attrs[k] = _narrow(a, dtype)
            elif (k == "value_float" and n.op == "Constant") or (
                k == "value_floats" and n.op == "Constant"
            ):
                n.attrs = {"value": _narrow(np.array(a, np.float32), dtype)}
                return


def _cast_io(graph: Graph, dtype: DType) -> None:
    """Keep the engine's float32 inputs and outputs: cast on the way in and on the way out."""
    head: list[Node] = []
    for v in graph.inputs:
        if v.dtype != F32:
            continue
        inner = Value(f"{v.name}__{dtype.short}", TensorType(dtype, v.shape))
        for n in graph.nodes:
            n.inputs = [inner if x is v else x for x in n.inputs]
            _replace_in_subgraphs(n, v, inner)
        head.append(Node("Cast", [v], [inner], {"to": dtype.value}, name=f"{v.name}__cast_in"))
    tail: list[Node] = []
    for v in graph.outputs:
        if v.dtype != F32 or v in graph.inputs:
            continue
        inner = Value(f"{v.name}__{dtype.short}", TensorType(dtype, v.shape))
        for n in graph.nodes:
            n.outputs = [inner if x is v else x for x in n.outputs]
            n.inputs = [inner if x is v else x for x in n.inputs]
            _replace_in_subgraphs(n, v, inner)
        if v in graph.initializers:
            continue
        tail.append(Node("Cast", [inner], [v], {"to": F32.value}, name=f"{v.name}__cast_out"))
    graph.nodes[:0] = head
    graph.nodes.extend(tail)


def _replace_in_subgraphs(n: Node, old: Value, new: Value) -> None:
    for g in n.subgraphs():
        for m in g.nodes:
            m.inputs = [new if x is old else x for x in m.inputs]
            _replace_in_subgraphs(m, old, new)
        g.outputs = [new if x is old else x for x in g.outputs]


def _keep_fp32_inputs(g: Graph) -> None:
    nodes: list[Node] = []
    for k, n in enumerate(g.nodes):
        for i in KEEP_FP32_INPUTS.get((n.domain, n.op), ()):
            v = n.inputs[i] if i < len(n.inputs) else None
            if v is None:
                continue
            name = f"{v.name}__fp32_{k}_{i}"
            if v.const is not None and v.const.dtype != np.float32:
                c = v.const.astype(np.float32)
                n.inputs[i] = Value(name, TensorType(F32, c.shape), c)
                g.initializers.append(n.inputs[i])
            elif v.const is None and v.dtype in (DType.FLOAT16, DType.BFLOAT16):
                out = Value(name, TensorType(F32, v.shape))
                nodes.append(Node("Cast", [v], [out], {"to": F32.value}, name=name))
                n.inputs[i] = out
        nodes.append(n)
    g.nodes[:] = nodes
