"""Implicit quantization: calibrate the float graph, then write the ranges as Q/DQ pairs.

TensorRT's implicit INT8 gives each tensor a dynamic range and lets the builder run layers in
INT8 where ranges are known. tensorkiln turns that into the explicit form NVIDIA's quantization
tools export (and TensorRT recommends): after the optimizer, the data input of every convolution
and GEMM with a constant weight gets ``QuantizeLinear -> DequantizeLinear`` with the calibrated
per-tensor scale, and its weight becomes a quantized constant (one scale per output channel)
read through ``DequantizeLinear``. The pass that honours explicit Q/DQ models
(:mod:`tensorkiln.passes.fuse_qdq`) then makes those layers quantized ones. So implicit and
explicit quantization share one path from there on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from tensorkiln.errors import BuildError
from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.passes.cleanup import dead_code
from tensorkiln.passes.fuse_qdq import REQUANTIZE, fuse_quantized
from tensorkiln.passes.rewrite import Rewrite, add_constant, const_value
from tensorkiln.passes.rules import View, apply_rules
from tensorkiln.precision.budget import AccuracyBudget, Switch, run_with, search
from tensorkiln.precision.calibration import (
    CalibrationRequest,
    CalibrationTable,
    calibrate,
    capture,
    first_batches,
)
from tensorkiln.precision.calibrators import QMAX
from tensorkiln.precision.smooth import choose_alpha, factors, smoothable, smoothed_amax

QUANTIZED_OPS = frozenset(
    {("tensorkiln", "QConvAct"), ("tensorkiln", "QGemmAct"), ("tensorkiln", "QConvPool")}
)
ELEMENT = {"int8": DType.INT8, "fp8": DType.FLOAT8E4M3FN}
_NUMPY = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
_PRECISION_OF = {DType.INT8: "int8", DType.FLOAT8E4M3FN: "fp8"}
_RESIDUAL = 3  # ConvAct's input slot of the residual (X, W, B, Z)


def quantized_precision(node: Node) -> str | None:
    """'int8' or 'fp8' for a quantized layer (by its operands' type), else None."""
    if (node.domain, node.op) not in QUANTIZED_OPS or not node.inputs or node.inputs[0] is None:
        return None
    return _PRECISION_OF.get(node.inputs[0].dtype)


def has_qdq(graph: Graph) -> bool:
    """Whether the model carries its own quantization (explicit Q/DQ nodes)."""
    return any(
        n.domain == "" and n.op in ("QuantizeLinear", "DequantizeLinear") for n in graph.nodes
    )


def quantizable(graph: Graph, exclude: Collection[str] = ()) -> dict[Node, tuple[Value, int]]:
    """The layers implicit quantization makes quantized: each convolution or GEMM with a float32
    data input and a constant float32 weight, with the weight's output-channel axis; layers named
    in ``exclude`` (kept at higher precision) are left out."""
    out: dict[Node, tuple[Value, int]] = {}
    producers = graph.producers()
    for n in graph.nodes:
        if n.name in exclude or len(n.inputs) < 2:
            continue
        x, w = n.inputs[0], n.inputs[1]
        if x is None or x.dtype != DType.FLOAT or w is None:
            continue
        data = const_value(w, producers)
        if data is None or data.dtype != np.float32 or data.ndim < 2:
            continue
        axis = _output_axis(n, data)
        if axis is not None:
            out[n] = (w, axis)
    return out


def _output_axis(n: Node, w: np.ndarray) -> int | None:
    if (n.domain, n.op) in (("", "Conv"), ("tensorkiln", "ConvAct")):
        return 0
    if (n.domain, n.op) in (("", "Gemm"), ("tensorkiln", "GemmAct")) and w.ndim == 2:
        return 0 if n.attrs.get("transB", 0) else 1
    if (n.domain, n.op) == ("", "MatMul") and w.ndim == 2:
        return 1
    return None


BUDGET_BATCHES = 4  # calibration batches the accuracy budget is measured on


def quantize_graph(
    graph: Graph,
    precision: str,
    request: CalibrationRequest,
    executor_factory: Callable[[Graph], Any],
    exclude: Collection[str] = (),
    progress: Callable[[str], None] | None = None,
    budget: AccuracyBudget | None = None,
    smooth: float | str | None = None,
) -> list[str]:
    """Calibrate and quantize ``graph`` (optimized, float32) in place; with a ``budget``, keep
    the fewest layers in float32 that meet it; with ``smooth``, SmoothQuant's alpha for GEMMs.
    Returns notes for the report."""
    if has_qdq(graph):
        return [
            "quantization: the model carries its own QuantizeLinear/DequantizeLinear nodes; "
            "they are used as written and no calibration runs"
        ]
    layers = quantizable(graph, exclude)
    excluded = len(quantizable(graph)) - len(layers) if exclude else 0
    if not layers:
        if excluded:
            return [
                f"{precision}: all {excluded} convolution/GEMM layers are kept at higher precision"
            ]
        return [f"{precision}: no convolution or GEMM with a constant weight to quantize"]
    tensors = calibrated_tensors(layers)
    residuals = quantized_residuals(graph, layers, tensors)
    if budget is not None:
        request.keep_batches = BUDGET_BATCHES
    counted = None if progress is None else (lambda n, _: progress(f"calibrating: {n} samples"))
    producers = graph.producers()
    smoothed = [] if smooth is None else [
        n for n, (w, _) in layers.items() if smoothable(n, const_value(w, producers))
    ]  # fmt: skip
    channels = list(dict.fromkeys(n.inputs[0] for n in smoothed))
    if smooth == "auto":
        request.capture = frozenset(v.name for v in channels)
    table = request.table  # (given: this build calibrated already, the same graph)
    if table is None:
        table = calibrate(graph, executor_factory, tensors, precision, request, counted, channels,
                          optional=residuals)  # fmt: skip
    request.table = table
    samples = _samples(graph, request, executor_factory) if smooth == "auto" and channels else {}
    chosen: dict[str, float | None] = {}
    switches = insert_qdq(graph, table, layers, precision, smooth, samples, chosen, residuals)
    notes = list(request.notes)
    unranged = [z.name for z in residuals if z.name not in table.amax]
    if unranged:
        shown = ", ".join(unranged[:4]) + (", ..." if len(unranged) > 4 else "")
        notes.append(
            f"quantization: the calibration cache has no range for {len(unranged)} residual "
            f"tensor(s) ({shown}); they stay in float (calibrate again to quantize them)"
        )
    if smoothed and smooth != "auto":
        notes.append(f"smoothquant: the inputs of {len(smoothed)} GEMMs smoothed (alpha {smooth})")
    elif chosen:
        counts = Counter("off" if a is None else f"{a:g}" for a in chosen.values())
        shown = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        notes.append(f"smoothquant (auto, per GEMM, on the first calibration batch): alpha {shown}")
    kept = 0
    if budget is not None:
        note, kept = _meet(graph, switches, budget, request, executor_factory, progress)
        notes.append(note)
    fused = fuse_quantized(graph)
    done: Counter[str] = Counter()
    for _ in range(4):  # (a layer both rules rewrite takes the second in the next sweep)
        sweep = apply_rules(graph, REQUANTIZE)
        if not sweep:
            break
        done += sweep
    requantized, residuals = done["requantize_in_epilogue"], done["residual_dequantize_in_epilogue"]
    norms, attentions = done["quantize_in_layer_norm"], done["quantize_in_attention"]
    dead_code(graph)
    left = len(layers) - kept - fused
    notes.append(
        f"{precision}: {fused} of {len(layers) + excluded} convolution/GEMM layers quantized"
        + (f", {excluded} kept at a higher precision as chosen" if excluded else "")
        + (f", {kept} kept in float32 for the accuracy budget" if kept else "")
        + (f" ({left} run in float through their Q/DQ nodes)" if left else "")
        + (f"; {requantized} write the next layer's quantized input" if requantized else "")
        + (f"; {residuals} read their residual quantized" if residuals else "")
        + (f"; {norms} LayerNorms write their output quantized too" if norms else "")
        + (f"; {attentions} attentions write their output quantized" if attentions else "")
    )
    return notes


def _samples(
    graph: Graph, request: CalibrationRequest, executor_factory: Callable[[Graph], Any]
) -> dict[str, np.ndarray]:
    """The first calibration batch's values of the tensors automatic smoothing measures on:
    kept while calibrating, or computed from the data when the ranges came from the cache."""
    missing = set(request.capture) - set(request.captured)
    if missing:
        if request.data is None:
            raise BuildError(
                "automatic SmoothQuant (smooth_quant='auto') measures on calibration data: give "
                "it (--calib-data) as well as the calibration cache, or a fixed alpha"
            )
        feed = first_batches(graph, request.data, 1)[0]
        request.captured.update(capture(graph, executor_factory, feed, missing))
    return request.captured


def calibrated_tensors(layers: Collection[Node]) -> dict[Value, str]:
    """The data input of each quantizable layer, with the first layer that reads it."""
    tensors: dict[Value, str] = {}
    for n in layers:
        tensors.setdefault(n.inputs[0], n.name or n.op)
    return tensors


def quantized_residuals(
    graph: Graph, layers: Collection[Node], tensors: Collection[Value] = ()
) -> dict[Value, str]:
    """The residuals quantized besides the layers' data inputs (tensor -> the layer that adds
    it): a convolution's residual that another quantizable layer makes and that only this
    convolution reads, not already a quantized input (``tensors``). In a ResNet, the first
    block of each stage adds its shortcut's convolution and its last one: quantized, the layer
    that makes the tensor writes it in 8 bits and the one that adds it reads it so (half the
    bytes of a float16 residual, and the 8-bit residual kernels apply), as TensorRT fuses an
    INT8 residual add."""
    quantized = set(layers)
    producers, readers = graph.producers(), graph.consumers()
    found: dict[Value, str] = {}
    for n in layers:
        if (n.domain, n.op) != ("tensorkiln", "ConvAct") or len(n.inputs) <= _RESIDUAL:
            continue
        z = n.inputs[_RESIDUAL]
        if z is None or z in tensors or z in graph.outputs or producers.get(z) not in quantized:
            continue
        if z.dtype == DType.FLOAT and all(m is n for m in readers.get(z, [])):
            found.setdefault(z, n.name or n.op)
    return found


def budget_feeds(graph: Graph, request: CalibrationRequest) -> list[dict[str, np.ndarray]]:
    """The calibration batches an accuracy budget is measured on: those calibration kept, else
    the first of the data (when the ranges came from the cache)."""
    if request.kept:
        return request.kept
    if request.data is None:
        raise BuildError(
            "the accuracy budget is measured on calibration data: give it (--calib-data, "
            "BuilderConfig.calibration_data) as well as the calibration cache"
        )
    return first_batches(graph, request.data, BUDGET_BATCHES)


def _meet(
    graph: Graph,
    switches: list[Switch],
    budget: AccuracyBudget,
    request: CalibrationRequest,
    executor_factory: Callable[[Graph], Any],
    progress: Callable[[str], None] | None,
) -> tuple[str, int]:
    """Search for the fewest layers to keep in float32; a note for the report and their count."""
    feeds = budget_feeds(graph, request)
    found = search(graph, switches, budget, feeds, run_with(executor_factory), progress)
    if not found.kept:
        return (
            f"accuracy budget: met with every layer quantized ({budget.shown(found.all_quantized)} "
            "against float32)"
        ), 0
    shown = ", ".join(found.kept[:8]) + (", ..." if len(found.kept) > 8 else "")
    return (
        f"accuracy budget: {len(found.kept)} of {len(switches)} layers kept in float32 "
        f"({shown}): {budget.shown(found.final)} against float32 (every layer quantized: "
        f"{budget.shown(found.all_quantized)}; {found.runs} runs)"
    ), len(found.kept)


def insert_qdq(
    graph: Graph,
    table: CalibrationTable,
    layers: dict[Node, tuple[Value, int]],
    precision: str,
    smooth: float | str | None = None,
    samples: Mapping[str, np.ndarray] | None = None,
    chosen: dict[str, float | None] | None = None,
    residuals: Collection[Value] = (),
) -> list[Switch]:
    """Each layer's data input through QuantizeLinear/DequantizeLinear (one pair per tensor, at
    its calibrated scale) and its weight as a quantized constant through DequantizeLinear;
    returns each layer's switch between its float and quantized operands. With ``smooth``
    (SmoothQuant's alpha), GEMMs whose input has per-channel ranges in ``table`` read it
    smoothed (precision/smooth.py); ``"auto"``: each GEMM takes the alpha (or no smoothing) that
    brings its output on ``samples`` (tensor -> values) closest to float, recorded in
    ``chosen``. ``residuals`` (:func:`quantized_residuals`) get a Q/DQ pair of their own where
    ``table`` has their range."""
    chosen = {} if chosen is None else chosen
    switches = []
    rw = Rewrite()
    names = View.of(graph).fresh_name
    zp = add_constant(graph, f"zero_point_{precision}", np.zeros((), _NUMPY[precision]))
    dequantized: dict[Value, Value] = {}
    producers = graph.producers()
    for n, (w, axis) in layers.items():
        x, data = n.inputs[0], const_value(w, producers)
        alpha = smooth
        if smooth == "auto" and x.name in table.channels and smoothable(n, data):
            alpha = choose_alpha(
                samples[x.name], data, 1 - axis, np.asarray(table.channels[x.name]),
                table.amax[x.name], QMAX[precision], precision,
            )  # fmt: skip
            chosen[n.name] = alpha
        if alpha is not None and x.name in table.channels and smoothable(n, data):
            s = factors(table.channels[x.name], data, 1 - axis, alpha)
            x_dq = _smoothed(graph, rw, names, n, x, s, table, zp, precision)
            data = data * s.reshape((-1, 1) if axis == 1 else (1, -1)).astype(np.float32)
        else:
            if x not in dequantized:
                scale = add_constant(graph, f"{x.name}_scale", np.float32(table.scale(x.name)))
                dequantized[x] = _qdq(rw, names, x, scale, zp, precision)
            x_dq = dequantized[x]
        wq, ws = quantize_weight(data, axis, precision)
        wq_v = add_constant(graph, f"{w.name}_quantized", wq)
        ws_v = add_constant(graph, f"{w.name}_scale", ws)
        w_dq = _dequantize(rw, names, wq_v, ws_v, None, w, axis)
        switches.append(Switch(n, (x, n.inputs[1]), (x_dq, w_dq)))
        n.inputs = [x_dq, w_dq, *n.inputs[2:]]
    for z in residuals:
        if z not in dequantized and z.name in table.amax:
            scale = add_constant(graph, f"{z.name}_scale", np.float32(table.scale(z.name)))
            dequantized[z] = _qdq(rw, names, z, scale, zp, precision)
    for sw in switches:
        _quantized_residual(sw, dequantized)
    rw.apply(graph)
    return switches


def _quantized_residual(sw: Switch, dequantized: Mapping[Value, Value]) -> None:
    """A quantized convolution whose residual is a tensor quantized for another layer (the
    block input a ResNet adds back, which the next block's first convolution reads), or one of
    the residuals quantized for it (:func:`quantized_residuals`), reads the residual through
    that Q/DQ pair, as TensorRT's INT8 ResNets do. The tensor then has the Q as its one reader,
    so its producer writes it quantized (fuse_requantize), and this layer reads it quantized
    (the DQ fused into its epilogue): no QuantizeLinear runs on its own between blocks. The
    residual carries the quantization error of the tensor it is."""
    n = sw.node
    if (n.domain, n.op) != ("tensorkiln", "ConvAct") or len(n.inputs) <= _RESIDUAL:
        return
    z = n.inputs[_RESIDUAL]
    z_dq = dequantized.get(z) if z is not None else None
    if z_dq is None or z_dq.shape != z.shape:
        return
    n.inputs[_RESIDUAL] = z_dq
    sw.float_inputs, sw.quantized_inputs = (*sw.float_inputs, z), (*sw.quantized_inputs, z_dq)
    sw.slots = (*sw.slots, _RESIDUAL)


def _smoothed(
    graph: Graph,
    rw: Rewrite,
    names: Callable[[str], str],
    n: Node,
    x: Value,
    s: np.ndarray,
    table: CalibrationTable,
    zp: Value,
    precision: str,
) -> Value:
    """X / s (a Mul by a constant per channel) through its own Q/DQ pair, for layer ``n``."""
    inv = add_constant(graph, f"{n.name}_smoothing", (1.0 / s).astype(np.float32))
    xs = Value(names(f"{n.name}_smoothed_input"), TensorType(DType.FLOAT, x.shape))
    rw.add.append(Node("Mul", [x, inv], [xs], name=names(f"{n.name}_smooth")))
    amax = smoothed_amax(table.channels[x.name], s)
    scale = amax / QMAX[precision] if amax > 0 else 1.0
    return _qdq(rw, names, xs, add_constant(graph, f"{xs.name}_scale", np.float32(scale)), zp,
                precision)  # fmt: skip


def quantize_weight(w: np.ndarray, axis: int, precision: str) -> tuple[np.ndarray, np.ndarray]:
    """``w`` quantized symmetrically with one scale per index of ``axis`` (its largest
    magnitude over QMAX; 1 where all are zero): (quantized weight, float32 scales)."""
    others = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w.astype(np.float64)).max(axis=others)
    scale = np.where(amax > 0, amax / QMAX[precision], 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    y = np.clip(w / scale.reshape(shape), -QMAX[precision], QMAX[precision])
    if precision == "int8":
        return np.rint(y).astype(np.int8), scale
    return y.astype(np.float32).astype(_NUMPY[precision]), scale


def _qdq(
    rw: Rewrite, names: Callable[[str], str], x: Value, scale: Value, zp: Value, precision: str
) -> Value:
    q = Value(names(f"{x.name}_quantized"), TensorType(ELEMENT[precision], x.shape))
    rw.add.append(Node("QuantizeLinear", [x, scale, zp], [q], name=names(f"{x.name}_quantize")))
    return _dequantize(rw, names, q, scale, zp, x, None)


def _dequantize(
    rw: Rewrite,
    names: Callable[[str], str],
    q: Value,
    scale: Value,
    zp: Value,
    like: Value,
    axis: int | None,
) -> Value:
    out = Value(names(f"{like.name}_dequantized"), TensorType(DType.FLOAT, like.shape))
    attrs = {"axis": axis} if axis is not None else {}
    rw.add.append(
        Node(
            "DequantizeLinear", [q, scale, zp], [out], attrs, name=names(f"{like.name}_dequantize")
        )
    )
    rw.count += 1
    return out
