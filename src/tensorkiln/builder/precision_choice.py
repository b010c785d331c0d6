"""An INT8/FP8 build's per-layer precision choice, TensorRT's among the allowed precisions: each
quantized layer's measured time against the same layer's in the float engine (with the
QuantizeLinear that exists only to feed it), which layers to keep in float, and the build
report's notes about them and about quantized layers left on the exact default kernel."""

from __future__ import annotations

import copy
from typing import Any

from tensorkiln.backends import Backend
from tensorkiln.builder.config import BuilderConfig
from tensorkiln.ir import Graph
from tensorkiln.precision.quantize import has_qdq

# (layer records name ops as "domain.op", the default domain bare)
FLOAT_LAYERS = ("Conv", "tensorkiln.ConvAct", "Gemm", "tensorkiln.GemmAct", "MatMul")
QUANTIZED_LAYERS = ("tensorkiln.QConvAct", "tensorkiln.QGemmAct", "tensorkiln.QConvPool")
# the quantized layers weighed against their float form: a QConvPool (a stem with its pool) has
# no one float layer of its time, so it is not weighed and stays quantized
COMPARED_LAYERS = ("tensorkiln.QConvAct", "tensorkiln.QGemmAct")


def chooses_precision(graph: Graph, config: BuilderConfig, backend: Backend) -> bool:
    """Whether an INT8/FP8 build compares each quantized layer with its float form and keeps
    the faster (TensorRT's choice among the allowed precisions): as configured, by default on a
    GPU, never for a model that carries its own Q/DQ (quantized as written), nor with an
    accuracy budget or SmoothQuant (which choose the float layers themselves)."""
    wanted = config.choose_precision_per_layer
    if wanted is None:
        wanted = backend.autotunes and backend.streams
    if not wanted or not backend.autotunes or config.optimization_level == 0:
        return False
    if config.accuracy_budget is not None or config.smooth_quant is not None:
        return False
    return not has_qdq(graph)


def copy_graph(graph: Graph) -> Graph:
    """A copy to lower separately, sharing the (never rewritten in place) constant arrays."""
    memo: dict[int, Any] = {}
    for v in graph.values():
        if v.const is not None:
            memo[id(v.const)] = v.const
    return copy.deepcopy(graph, memo)


def layer_ms(layers: list[dict], ops: tuple[str, ...] | None = None) -> dict[str, float]:
    """Layer name -> the measured milliseconds of its chosen tactic, for layers of ``ops``
    (None: every layer)."""
    out = {}
    for layer in layers:
        timings = layer.get("timings_ms") or {}
        if (ops is None or layer.get("op") in ops) and layer.get("tactic") in timings:
            out[layer["name"]] = float(timings[layer["tactic"]])
    return out


def build_ms(layers: list[dict]) -> float | None:
    """A build's measured milliseconds: the chosen tactic's time of every layer the autotuner
    timed (None where it timed none). Two builds of one model compare by it: the layers
    neither times (shape arithmetic, copies the tuner does not see) are the same in both."""
    times = layer_ms(layers)
    return sum(times.values()) if times else None


def compare_layers(layers: list[dict], floats: dict[str, float]) -> dict[str, dict]:
    """Each quantized layer's measured time against the same layer's in the float engine
    (``floats``, layer_ms of the float build), and which to keep: float where the quantized
    layer is no faster; with the quantized form's tactic, to see what it was timed on. A
    quantized layer's time includes the QuantizeLinear that exists only to feed it (kept in
    float, the layer would not need it); a QuantizeLinear shared by several layers, or not
    measured, is not counted."""
    quantized = layer_ms(layers, COMPARED_LAYERS)
    own = own_quantize_ms(layers)
    tactics = {layer["name"]: layer.get("tactic") for layer in layers if "name" in layer}
    out = {}
    for name, ms in quantized.items():
        if name not in floats:
            continue
        q = ms + own.get(name, 0.0)
        out[name] = {
            "quantized_ms": q,
            "quantize_ms": own.get(name, 0.0),
            "float_ms": floats[name],
            "kept": "float" if q >= floats[name] else "quantized",
            "tactic": tactics.get(name),  # (the quantized form's, as timed)
        }
    return out


def own_quantize_ms(layers: list[dict]) -> dict[str, float]:
    """Layer name -> the measured milliseconds of the QuantizeLinear layers whose output only
    that layer reads."""
    quantize = {}  # output value -> the QuantizeLinear's measured ms
    readers: dict[str, list[str]] = {}
    for layer in layers:
        for value in layer.get("inputs") or ():
            readers.setdefault(value, []).append(layer.get("name", ""))
        timings = layer.get("timings_ms") or {}
        if layer.get("op") == "QuantizeLinear" and layer.get("tactic") in timings:
            for value in (layer.get("outputs") or ())[:1]:
                quantize[value] = float(timings[layer["tactic"]])
    out: dict[str, float] = {}
    for value, ms in quantize.items():
        names = readers.get(value, [])
        if len(names) == 1:
            out[names[0]] = out.get(names[0], 0.0) + ms
    return out


def kept_whole_note(slower: set[str], quantized: str, whole: float, settled: float) -> str:
    return (
        f"{quantized}: every layer kept quantized: the fully quantized build measured "
        f"{whole:.3f} ms against {settled:.3f} ms with {len(slower)} layers in float, which "
        f"the layer-by-layer choice preferred (a layer can lose alone and win inside a fused "
        f"{quantized} chain)"
    )


def kept_float_note(slower: set[str], quantized: str, precision: str) -> str:
    names = sorted(slower)
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"{quantized}: {len(names)} layers kept in {precision} where the autotuner measured "
        f"them faster than in {quantized}: {shown} (BuilderConfig.choose_precision_per_layer "
        f"= False quantizes every layer)"
    )


def quantized_defaults_notes(layers: list[dict]) -> list[str]:
    """A note naming the quantized layers that kept their default kernel (exact sums in float64:
    right, but far slower on a GPU than any tensor-core tactic), with why: no tactic took the
    layer, tuning could not measure it, or every candidate was refused."""
    kept = [x for x in layers if x.get("op") in QUANTIZED_LAYERS and x.get("tactic") == "default"]
    if not kept:
        return []
    total = sum(1 for x in layers if x.get("op") in QUANTIZED_LAYERS)

    def why(x: dict) -> str:
        if x.get("fallback"):
            return str(x["fallback"])
        if not x.get("candidates"):
            return "no tensor-core tactic takes its shapes and types"
        if x.get("rejected"):
            name, reason = next(iter(x["rejected"].items()))
            return f"every candidate refused ({name}: {reason})"
        return "the default measured fastest"

    shown = "; ".join(f"{x.get('name')}: {why(x)}" for x in kept[:5])
    more = f" and {len(kept) - 5} more" if len(kept) > 5 else ""
    return [
        f"{len(kept)} of {total} quantized layers run the exact default kernel (float64 sums, "
        f"slow on a GPU): {shown}{more}"
    ]
