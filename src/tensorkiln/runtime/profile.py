"""The per-layer profile: each layer's time, FLOPs and bytes, the rates it achieved, and where it
sits on the device's roofline.

Times come from :meth:`ExecutionContext.infer`'s ``layer_times`` (CUDA events around each layer
on a GPU, the host clock elsewhere). FLOPs and bytes are the op facts of
:mod:`tensorkiln.ops.cost` at the shapes and element types the layers really ran at, seen by an
observer during one untimed run. The roofline: a layer whose arithmetic intensity (FLOPs per byte)
exceeds the device's ridge point (peak FLOP/s / peak bytes/s) is compute bound, else memory
bound; its ideal time is max(FLOPs / peak FLOP/s, bytes / peak bytes/s), and "% of roofline" is
that ideal time over the measured one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorkiln.ir import DType, Node, TensorType, Value
from tensorkiln.ops.cost import Cost, node_cost
from tensorkiln.runtime.peaks import DevicePeaks

# the precision of a layer the builder did not mark, by its first output's element type
_PRECISION_OF = {
    DType.FLOAT16: "fp16",
    DType.BFLOAT16: "bf16",
    DType.INT8: "int8",
    DType.UINT8: "int8",
    DType.FLOAT8E4M3FN: "fp8",
    DType.FLOAT8E5M2: "fp8",
}


def observe_types(ctx: Any, feeds: Mapping[str, Any]) -> dict[Value, TensorType | None]:
    """Run once with an observer; the type (element type and concrete shape) of every value
    of the engine's top graph as it was produced (None for what is not a tensor)."""
    graph = ctx.engine.graph
    backend = ctx.backend
    types: dict[Value, TensorType | None] = {
        v: _type_of(v.const, backend) for v in graph.initializers
    }
    types.update((v, _type_of(feeds.get(v.name), backend)) for v in graph.inputs)

    def see(node: Node, outputs: list[Any]) -> None:
        for v, x in zip(node.outputs, outputs):
            if v is not None:
                types[v] = _type_of(x, backend)

    ctx.infer(feeds, observer=see)
    return types


def _type_of(x: Any, backend: Any) -> TensorType | None:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return None
    try:
        dt = DType.from_numpy(dtype if isinstance(dtype, np.dtype) else backend.host_dtype(dtype))
    except (TypeError, KeyError, ValueError):
        return None
    return TensorType(dt, tuple(int(d) for d in shape))


def layer_costs(engine: Any, types: Mapping[Value, TensorType | None]) -> dict[str, Cost]:
    """Each top-graph layer's cost at the observed ``types``, by layer name."""
    graph = engine.graph
    out = {}
    for node in graph.nodes:
        ins = [None if v is None else types.get(v) for v in node.inputs]
        outs = [None if v is None else types.get(v) for v in node.outputs]
        out[node.name] = node_cost(node, ins, outs, graph.opset(node.domain))
    return out


def layer_precision(node: Node) -> str:
    """What ``node`` computes in: the builder's decision, else its output's element type."""
    if node.precision:
        return node.precision
    dtype = node.outputs[0].dtype if node.outputs and node.outputs[0] is not None else None
    return _PRECISION_OF.get(dtype, "fp32") if dtype is not None else "fp32"


def profile_layers(
    ctx: Any, feeds: Mapping[str, Any], runs: int, peaks: DevicePeaks | None = None
) -> list[dict[str, Any]]:
    """Per-layer rows over ``runs`` timed runs, slowest first (see :func:`layer_row`)."""
    types = observe_types(ctx, feeds)
    times: dict[str, float] = {}
    for _ in range(runs):
        ctx.infer(feeds, layer_times=times)
    engine = ctx.engine
    costs = layer_costs(engine, types)
    nodes = {n.name: n for n in engine.graph.nodes}
    total = sum(times.values()) or 1.0
    rows = []
    for name, secs in times.items():
        node = nodes.get(name)
        op = "?" if node is None else (f"{node.domain}.{node.op}" if node.domain else node.op)
        cost = costs.get(name, Cost(None, None))
        precision = "fp32" if node is None else layer_precision(node)
        row = layer_row(name, op, secs, runs, 100.0 * secs / total, cost, precision, peaks)
        rows.append(row)
    return sorted(rows, key=lambda r: -r["total_ms"])


def layer_row(
    name: str,
    op: str,
    total_s: float,
    runs: int,
    percent: float,
    cost: Cost,
    precision: str,
    peaks: DevicePeaks | None,
) -> dict[str, Any]:
    """One row of the profile: times, counts, achieved rates and the roofline (None: unknown)."""
    avg = total_s / max(runs, 1)
    row: dict[str, Any] = {
        "name": name,
        "op": op,
        "precision": precision,
        "total_ms": total_s * 1e3,
        "average_ms": avg * 1e3,
        "percent": percent,
        "flops": cost.flops,
        "bytes": cost.bytes,
    }
    peak_tflops = None if peaks is None else peaks.compute_tflops(precision, cost.products)
    peak_gbps = None if peaks is None else peaks.gbps
    row.update(rates(cost.flops, cost.bytes, avg, peak_tflops, peak_gbps))
    return row


def rates(
    flops: int | None,
    nbytes: int | None,
    seconds: float,
    peak_tflops: float | None,
    peak_gbps: float | None,
) -> dict[str, Any]:
    """GFLOP, MB, achieved TFLOP/s and GB/s, arithmetic intensity, and the roofline: the peaks
    used, the bound ("compute" or "memory") and the ideal time's percentage of ``seconds``."""
    out: dict[str, Any] = {
        "gflop": None if flops is None else flops / 1e9,
        "mb": None if nbytes is None else nbytes / 1e6,
        "tflops": None if flops is None or seconds <= 0 else flops / seconds / 1e12,
        "gbps": None if nbytes is None or seconds <= 0 else nbytes / seconds / 1e9,
        "intensity": None if flops is None or not nbytes else flops / nbytes,
        "peak_tflops": peak_tflops,
        "peak_gbps": peak_gbps,
        "bound": None,
        "ideal_ms": None,
        "roofline_percent": None,
    }
    known = flops is not None and nbytes is not None
    if not known or not peak_tflops or not peak_gbps:
        return out
    compute_s = flops / (peak_tflops * 1e12)  # type: ignore[operator]
    memory_s = nbytes / (peak_gbps * 1e9)  # type: ignore[operator]
    # (intensity > ridge point, FLOPs/byte, is the same test as compute time > memory time)
    out["bound"] = "compute" if compute_s > memory_s else "memory"
    ideal = max(compute_s, memory_s)
    out["ideal_ms"] = ideal * 1e3
    out["roofline_percent"] = 100.0 * ideal / seconds if seconds > 0 else None
    return out


def _sum(values: list[Any]) -> Any:
    """The sum, or None when any is unknown."""
    return None if any(v is None for v in values) else sum(values)


def group_by_op(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows added up per op type, slowest first: times, FLOPs and bytes summed (None when a
    layer's is unknown), rates over the summed time; the roofline's ideal times summed, and the
    bound of the layers that took most of the time."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["op"], []).append(r)
    out = []
    for op, members in groups.items():
        avg_s = sum(r["average_ms"] for r in members) / 1e3
        flops, nbytes = _sum([r["flops"] for r in members]), _sum([r["bytes"] for r in members])
        row: dict[str, Any] = {
            "name": op,
            "op": op,
            "layers": len(members),
            "total_ms": sum(r["total_ms"] for r in members),
            "average_ms": avg_s * 1e3,
            "percent": sum(r["percent"] for r in members),
            "flops": flops,
            "bytes": nbytes,
        }
        row.update(rates(flops, nbytes, avg_s, None, None))
        del row["peak_tflops"], row["peak_gbps"]  # (per layer: a group may mix precisions)
        ideal = _sum([r["ideal_ms"] for r in members])
        if ideal is not None and avg_s > 0:
            row["ideal_ms"] = ideal
            row["roofline_percent"] = 100.0 * ideal / (avg_s * 1e3)
            by_bound: dict[str, float] = {}
            for r in members:
                by_bound[r["bound"]] = by_bound.get(r["bound"], 0.0) + r["average_ms"]
            row["bound"] = max(by_bound, key=by_bound.__getitem__)
        out.append(row)
    return sorted(out, key=lambda r: -r["total_ms"])


def summarize(rows: list[dict[str, Any]], top: int = 5) -> dict[str, Any]:
    """Totals over the layers: time per run, FLOPs and bytes (of the layers whose counts are
    known), the overall rates, and the ``top`` op types by their share of the time."""
    avg_s = sum(r["average_ms"] for r in rows) / 1e3
    flops = sum(r["flops"] for r in rows if r["flops"] is not None)
    nbytes = sum(r["bytes"] for r in rows if r["bytes"] is not None)
    shares: dict[str, float] = {}
    for r in rows:
        shares[r["op"]] = shares.get(r["op"], 0.0) + r["percent"]
    ranked = sorted(shares.items(), key=lambda kv: -kv[1])[:top]
    return {
        "layers": len(rows),
        "average_ms": avg_s * 1e3,
        "flops": flops,
        "gflop": flops / 1e9,
        "bytes": nbytes,
        "mb": nbytes / 1e6,
        "tflops": flops / avg_s / 1e12 if avg_s > 0 else None,
        "gbps": nbytes / avg_s / 1e9 if avg_s > 0 else None,
        "layers_without_flops": sum(r["flops"] is None for r in rows),
        "top_ops": [{"op": op, "percent": pct} for op, pct in ranked],
    }
