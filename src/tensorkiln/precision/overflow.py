"""The FP16 overflow guard: layers whose values do not fit float16 stay float32.

float16's largest finite value is 65504. A transformer's FFN output or an unnormalized sum can
pass it on real data (T5 is the known case), and a TensorRT FP16 engine then returns inf or NaN,
which its users find only after deployment. Given calibration data, the builder runs the float32
graph over it once, records each tensor's largest magnitude, and keeps in float32 every layer
whose output or non-constant input reaches ``FP16_MAX * MARGIN`` (half the limit: calibration data
rarely holds the extremes), and every layer with a constant beyond the limit itself. bfloat16 has
float32's range and needs no guard.

An additive attention mask is the exception: its -3.4e38 (float32's lowest, as transformers
writes it) means minus infinity, and float16 keeps that meaning when the value saturates to
-65504 (reduce_precision saturates constants, the kernels saturate what they compute). The values
that only ever reach a fused Attention's additive mask, through data movement, Where and
arithmetic, are left out of the guard; a layer kept in float32 for them would keep the attention
beside it in float32 too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tensorkiln.ir import DType, Graph, Node, Value
from tensorkiln.precision.calib_data import CalibrationData, batches
from tensorkiln.precision.calibration import typed_feed

FP16_MAX = 65504.0
MARGIN = 0.5
_FLOATS = (DType.FLOAT, DType.FLOAT16, DType.BFLOAT16, DType.DOUBLE)
# ops through which a mask value stays a mask value (its huge magnitudes only ever "minus infinity")
_MASK_PATH = frozenset(
    ("Where", "Cast", "Expand", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose",
     "Slice", "Concat", "Tile", "Identity", "Mul", "Add", "Sub", "Min")
)  # fmt: skip


def value_ranges(
    graph: Graph, executor_factory: Callable[[Graph], Any], data: CalibrationData
) -> dict[str, float]:
    """The largest magnitude of every float value of ``graph`` (inputs and node outputs) over
    the calibration data."""
    ranges: dict[str, float] = {}
    executor = executor_factory(graph)

    def see(name: str, x: Any) -> None:
        if isinstance(x, np.ndarray):
            if x.dtype.kind != "f" or not x.size:
                return  # (ml_dtypes' float8 is kind 'V': not a value fp16 narrows)
            m = float(np.max(np.abs(x)))
        else:
            if not getattr(x, "is_floating_point", lambda: False)() or not x.numel():
                return
            t = x.detach()
            m = float((t if t.element_size() > 1 else t.float()).abs().max())  # (float8: widen)
        if not np.isfinite(m):
            m = float("inf")
        ranges[name] = max(ranges.get(name, 0.0), m)

    def observe(node: Node, outputs: list[Any]) -> None:
        for v, x in zip(node.outputs, outputs):
            if v is not None and x is not None:
                see(v.name, x)

    for feed in batches(data, graph.inputs):
        feed = typed_feed(feed, graph.inputs)
        for name, a in feed.items():
            see(name, a)
        executor.run({v: feed[v.name] for v in graph.inputs}, observer=observe)
    return ranges


def mask_values(graph: Graph) -> set[Value]:
    """The values that reach nothing but fused Attentions' additive masks: a mask input, and
    (to a fixed point) every constant, graph input or output of a :data:`_MASK_PATH` op all of
    whose readers are such nodes, a graph output never."""
    uses: dict[Value, list[tuple[Node, int]]] = {}
    for n in graph.nodes:
        for i, v in enumerate(n.inputs):
            if v is not None:
                uses.setdefault(v, []).append((n, i))
    producers = graph.producers()
    sinks = {
        (n, 3)
        for n in graph.nodes
        if n.op == "Attention"
        and n.domain == "tensorkiln"
        and n.attrs.get("mask_kind") == "additive"
    }
    outputs = set(graph.outputs)
    masks: set[Value] = set()
    path: set[Node] = set()
    changed = True
    while changed:
        changed = False
        for v, readers in uses.items():
            if v in masks or v in outputs:
                continue
            p = producers.get(v)
            if p is not None and (p.op not in _MASK_PATH or p.domain):
                continue
            if all((n, i) in sinks or n in path for n, i in readers):
                masks.add(v)
                changed = True
        for n in graph.nodes:
            if n in path or n.op not in _MASK_PATH or n.domain:
                continue
            if all(o is None or o in masks for o in n.outputs) and any(n.outputs):
                path.add(n)
                changed = True
    return masks


def overflow_prone(graph: Graph, ranges: Mapping[str, float]) -> dict[Node, str]:
    """Layers to keep in float32 on an fp16 engine, each with the reason."""
    limit = FP16_MAX * MARGIN
    keep: dict[Node, str] = {}
    masks = mask_values(graph)
    for n in graph.nodes:
        for role, values in (("output", n.outputs), ("input", n.inputs)):
            for v in values:
                if v is None or v.dtype not in _FLOATS or v in masks:
                    continue
                if v.const is not None:
                    m = float(np.max(np.abs(v.const), initial=0.0)) if v.const.size else 0.0
                    if m <= FP16_MAX:
                        continue
                else:
                    m = ranges.get(v.name, 0.0)
                    if m <= limit:
                        continue
                keep[n] = (
                    f"its {role} '{v.name}' reaches {m:.4g} on the calibration data, beyond "
                    f"fp16's range (65504; the guard keeps a margin of {1 / MARGIN:g}x)"
                )
                break
            if n in keep:
                break
    return keep
