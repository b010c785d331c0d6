"""Find the subgraphs that a float16/bfloat16 engine must keep in float32: cancellation-prone
variances, and the conversions between float and 32/64-bit integers.

A variance written as ``E[x^2] - E[x]^2`` (LayerNorms exported from TensorFlow and jax, hand-written
normalizations) subtracts two nearly equal numbers when the mean is large beside the spread: each
carries the rounding error of its type times ``E[x^2]``, and the difference can be smaller than
that error. In float32 the loss is a few digits; in float16 (11 bits) it is total, the variance
comes out as noise or zero and the output is garbage. TensorRT users meet this as "FP16 accuracy
loss" and pin those layers to FP32; :func:`cancellation_prone` finds them so the precision policy
can do the same.

The rule matches on the optimized graph, so the pieces may sit in fused ``Pointwise`` nodes:

* a reduction (ReduceSum/ReduceMean) of ``x * x`` or ``Pow(x, 2)``, and one of ``x`` itself over
  the same axes;
* everything downstream of both reductions through elementwise and shape-only ops, up to and
  including the node that takes the square root (Sqrt, Reciprocal, Pow) of the result;
* provided a subtraction is among them (otherwise it is a plain RMS, which does not cancel).

Integer-quantized models (ConvInteger, MatMulInteger as onnxruntime's quantizer writes them) add an
int32 bias to an int32 accumulator and cast the sum to float before multiplying by the scales: the
sum passes float16's largest value (65504) long before the scale brings it back, and the quantized
bias itself is computed as Floor(bias / scale) in float and cast to int32. A node that casts
between float and a 32- or 64-bit integer therefore stays float32, with the scaling that follows
it (as TensorRT keeps integer accumulators out of FP16).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tensorkiln.ir import DType, Graph, Node, Value

_REDUCTIONS = {"ReduceSum", "ReduceMean"}
# ops the variance may flow through between the reductions and its square root
_PASS = {
    "Sub", "Mul", "Div", "Add", "Max", "Min", "Relu", "Abs", "Neg", "Identity", "Sqrt", "Pow",
    "Reciprocal", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Flatten", "Pointwise",
}  # fmt: skip
_ROOTS = {"Sqrt", "Reciprocal", "Pow"}  # where the variance becomes a standard deviation
REASON = "variance computed as E[x^2] - E[x]^2 cancels in the reduced type"
INT_REASON = "conversion between float and a 32/64-bit integer exceeds the reduced type's range"
_WIDE_INTS = {d.value for d in (DType.INT32, DType.INT64, DType.UINT32, DType.UINT64)}
_DYNAMIC_QUANT = {("", "DynamicQuantizeLinear"), ("com.microsoft", "DynamicQuantizeLSTM")}
_FLOATS = {d.value for d in (DType.FLOAT, DType.FLOAT16, DType.BFLOAT16)}


def cancellation_prone(graph: Graph) -> dict[Node, str]:
    """Nodes of ``graph`` (top level) to keep in float32, each with the reason why."""
    keep = _variances(graph)
    for n, reason in _int_conversions(graph).items():
        keep.setdefault(n, reason)
    return keep


def _int_conversions(graph: Graph) -> dict[Node, str]:
    """Nodes that cast between float and a wide integer, and the Mul/Div scaling a bare
    integer-to-float Cast's result."""
    consumers = graph.consumers()
    keep: dict[Node, str] = {}
    for n in graph.nodes:
        casts = _wide_int_casts(n)
        if (n.domain, n.op) in _DYNAMIC_QUANT:
            keep[n] = INT_REASON  # its range and rounding need the float32 values
        if not casts:
            continue
        keep[n] = INT_REASON
        if n.op == "Cast" and casts == {"to_float"}:
            for c in consumers.get(n.outputs[0], []):
                if c.op in ("Mul", "Div"):
                    keep[c] = INT_REASON
    return keep


def _wide_int_casts(node: Node) -> set[str]:
    """'to_float' / 'to_int' for each Cast between float and a 32/64-bit integer in ``node`` (or
    in its Pointwise body)."""
    nodes = node.attrs["body"].nodes if node.op == "Pointwise" else [node]
    found = set()
    for m in nodes:
        if m.op != "Cast" or not m.inputs or m.inputs[0] is None:
            continue
        src = m.inputs[0].dtype.value if m.inputs[0].dtype is not None else None
        dst = m.attrs.get("to")
        if src in _WIDE_INTS and dst in _FLOATS:
            found.add("to_float")
        elif src in _FLOATS and dst in _WIDE_INTS:
            found.add("to_int")
    return found


def _variances(graph: Graph) -> dict[Node, str]:
    """The E[x^2] - E[x]^2 regions of ``graph`` (see the module)."""
    producers = graph.producers()
    consumers = graph.consumers()
    reductions = [n for n in graph.nodes if n.op in _REDUCTIONS and n.domain == ""]
    keep: dict[Node, str] = {}
    for r2 in reductions:
        square = producers.get(r2.inputs[0]) if r2.inputs and r2.inputs[0] is not None else None
        x = _squared(square) if square is not None else None
        if x is None:
            continue
        r1 = next((r for r in reductions if r.inputs[0] is x and _same_axes(r, r2)), None)
        if r1 is None:
            continue
        region = _variance_region([r1, r2], graph, consumers)
        if region and any("Sub" in _ops(n) for n in region):
            keep.update(dict.fromkeys([square, r1, r2, *region], REASON))
    return keep


def _squared(node: Node) -> Value | None:
    """``x`` when ``node`` computes ``x * x`` or ``x ** 2`` (also as a one-op Pointwise)."""
    if node.op == "Pointwise" and len(node.attrs["body"].nodes) == 1:
        body = node.attrs["body"]
        inner = _squared(body.nodes[0])
        if inner is None or inner not in body.inputs:
            return None
        return node.inputs[body.inputs.index(inner)]
    ins = node.inputs
    if node.op == "Mul" and len(ins) == 2 and ins[0] is ins[1]:
        return ins[0]
    exponent = ins[1].const if node.op == "Pow" and len(ins) == 2 and ins[1] is not None else None
    if exponent is not None and exponent.size == 1 and float(exponent.reshape(-1)[0]) == 2.0:
        return ins[0]
    return None


def _axes(node: Node) -> tuple | None:
    if "axes" in node.attrs:
        return tuple(np.asarray(node.attrs["axes"]).reshape(-1).tolist())
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        const = node.inputs[1].const
        return None if const is None else tuple(const.reshape(-1).tolist())
    return ()


def _same_axes(a: Node, b: Node) -> bool:
    axes = _axes(a)
    return (
        axes is not None
        and axes == _axes(b)
        and a.attrs.get("keepdims", 1) == b.attrs.get("keepdims", 1)
    )


def _ops(node: Node) -> set[str]:
    """The ops a node computes: its own, or its body's for a fused Pointwise."""
    if node.op == "Pointwise":
        return {m.op for m in node.attrs["body"].nodes}
    return {node.op}


def _variance_region(
    starts: list[Node], graph: Graph, consumers: dict[Value, list[Node]]
) -> list[Node]:
    """The nodes after ``starts`` that lie on a path to a square root, in graph order."""
    reach: set[Node] = set()
    roots: set[Node] = set()
    frontier = list(_next(starts, consumers))
    while frontier:
        n = frontier.pop()
        if n in reach or n.op not in _PASS:
            continue
        reach.add(n)
        if _ops(n) & _ROOTS:
            roots.add(n)  # included, not followed: past it the values are well conditioned
            continue
        frontier.extend(_next([n], consumers))
    if not roots:
        return []
    # keep only what leads to a root: walk back from the roots inside the reached set
    keep, stack = set(roots), list(roots)
    producers = graph.producers()
    while stack:
        for v in stack.pop().inputs:
            p = producers.get(v) if v is not None else None
            if p is not None and p in reach and p not in keep:
                keep.add(p)
                stack.append(p)
    return [n for n in graph.nodes if n in keep]


def _next(nodes: Iterable[Node], consumers: dict[Value, list[Node]]) -> Iterable[Node]:
    for n in nodes:
        for v in n.outputs:
            if v is not None:
                yield from consumers.get(v, [])


def kept_fp32_notes(keep: dict[Node, str], precision: str) -> list[str]:
    """One build-report note per reason: which layers stay fp32 on a ``precision`` engine."""
    by_reason: dict[str, list[str]] = {}
    for n, reason in keep.items():
        by_reason.setdefault(reason, []).append(n.name or n.op)
    return [
        f"{len(names)} layer(s) kept in fp32 on this {precision} engine ({reason}): "
        + ", ".join(names)
        for reason, names in by_reason.items()
    ]
