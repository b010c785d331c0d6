"""The precision policy: the one place that decides what each layer computes in.

A policy has three steps, which the builder calls in order after the optimizer:

* :meth:`PrecisionPolicy.assign` looks at the optimized graph and the build's configuration and
  returns a :class:`PrecisionPlan`: the engine-wide precision (the math mode the engine runs
  under), a precision and a tensor format per layer, and why a layer differs from the engine;
* :meth:`PrecisionPolicy.rewrite` materializes the plan in the graph (casts, narrowed weights) and
  records each layer's precision and format on its node, which the engine file keeps;
* :meth:`PrecisionPolicy.tolerance` says how far a tactic of a layer may stray from the float32
  oracle, given what the layer computes in (the autotuner asks it for every layer it measures).

:class:`DefaultPolicy` is TensorRT's builder-flag behaviour: every layer in the cheapest precision
the build allows (fp16, then bf16, then tf32, else fp32), but cancellation-prone layers
(:mod:`tensorkiln.precision.cancellation`), which stay fp32, and the layers the user pinned with
``BuilderConfig.layer_precisions`` (TensorRT's per-layer precision constraints). Every layer is in
the linear format. A new policy (INT8 calibration, mixed-precision search, layout propagation)
implements the same three methods and is handed to the builder as
``BuilderConfig.precision_policy``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tensorkiln.errors import BuildError, InputError
from tensorkiln.ir import DType, Graph, Node
from tensorkiln.ir.graph import PRECISIONS
from tensorkiln.precision.cancellation import cancellation_prone, kept_fp32_notes
from tensorkiln.precision.overflow import overflow_prone
from tensorkiln.precision.quantize import quantized_precision
from tensorkiln.precision.reduce import reduce_precision

# relative L2 error a tactic may show against the float32 oracle, by the precision it computes in
TOLERANCE = {"fp32": 1e-4, "tf32": 5e-3, "fp16": 1e-2, "bf16": 3e-2}
# a quantized layer's tactics are held to its own reference kernel (same quantized operands),
# which differs from them only in the float epilogue's rounding
TOLERANCE |= {"int8": 1e-3, "fp8": 1e-3}
# the engine-wide precisions the default policy picks from, cheapest first
_CHEAPEST_FIRST = ("fp16", "bf16", "tf32")
# precisions computed by narrowing the graph's float32 tensors to this element type
_REDUCED = {"fp16": DType.FLOAT16, "bf16": DType.BFLOAT16}
PINNED = "pinned by BuilderConfig.layer_precisions"
QUANTIZED = "quantized (its operands are {})"
CHOSEN = "chosen by the precision policy"  # (a plan that gives no reason)
_SHOWN_NAMES = 8  # layer names listed in an error about an unknown one


class PrecisionRequest(Protocol):
    """What a policy reads of the build's configuration (a :class:`BuilderConfig` as
    ``for_backend`` returns it: only precisions the backend implements are allowed)."""

    precisions: set[str]
    layer_precisions: dict[str, str]


@dataclass
class PrecisionPlan:
    """A policy's decision for one graph; layers are the graph's top-level nodes."""

    engine: str  # the engine-wide precision: its math mode, and the timing cache's key
    layers: dict[Node, str] = field(default_factory=dict)  # what each layer computes in
    formats: dict[Node, str] = field(default_factory=dict)  # how each layer's tensors are laid out
    reasons: dict[Node, str] = field(default_factory=dict)  # why a layer is not in ``engine``


class PrecisionPolicy(Protocol):
    """Decides and materializes each layer's precision and format (see the module)."""

    def assign(self, graph: Graph, config: PrecisionRequest) -> PrecisionPlan:
        """Each layer's precision and format; ``graph`` is not changed."""
        ...

    def rewrite(self, graph: Graph, plan: PrecisionPlan) -> list[str]:
        """Make ``graph`` compute as ``plan`` says and record it on the nodes; returns notes
        for the build report."""
        ...

    def tolerance(self, layer: Node) -> float:
        """The relative error a tactic of ``layer`` may show against the float32 oracle."""
        ...


class DefaultPolicy:
    """The cheapest allowed precision everywhere, but cancellation-prone and pinned layers, and
    on an fp16 engine the layers whose values ``ranges`` (tensor name -> largest magnitude on
    calibration data) put beyond fp16's range (precision/overflow.py)."""

    def __init__(self, ranges: Mapping[str, float] | None = None) -> None:
        self.ranges = ranges

    def assign(self, graph: Graph, config: PrecisionRequest) -> PrecisionPlan:
        engine = engine_precision(config.precisions)
        plan = PrecisionPlan(
            engine,
            dict.fromkeys(graph.nodes, engine),
            dict.fromkeys(graph.nodes, "linear"),
        )
        if engine in _REDUCED:
            for n, why in cancellation_prone(graph).items():
                plan.layers[n], plan.reasons[n] = "fp32", why
        if engine == "fp16" and self.ranges is not None:
            for n, why in overflow_prone(graph, self.ranges).items():
                plan.layers[n], plan.reasons[n] = "fp32", why
        for n in graph.nodes:
            q = quantized_precision(n)
            if q is not None:
                plan.layers[n], plan.reasons[n] = q, QUANTIZED.format(q)
        for n, wanted in pinned_layers(graph, config).items():
            _check_realizable(n, wanted, engine)
            plan.layers[n] = wanted
            if wanted == engine:
                plan.reasons.pop(n, None)
            else:
                plan.reasons[n] = PINNED
        return plan

    def rewrite(self, graph: Graph, plan: PrecisionPlan) -> list[str]:
        notes: list[str] = []
        for n, p in plan.layers.items():
            _check_rewritable(n, p, plan.engine)
        if plan.engine in _REDUCED:
            # (in the order the reasons were found: the notes list layers as they always have)
            keep = {n: why for n, why in plan.reasons.items() if plan.layers.get(n) == "fp32"}
            keep |= {n: CHOSEN for n, p in plan.layers.items() if p == "fp32" and n not in keep}
            reduce_precision(graph, _REDUCED[plan.engine], keep)
            notes = kept_fp32_notes(keep, plan.engine)
        record(graph, plan)
        return notes

    def tolerance(self, layer: Node) -> float:
        return TOLERANCE[layer.precision or "fp32"]


def engine_precision(allowed: Collection[str]) -> str:
    """The cheapest float precision in ``allowed`` (fp16, bf16, tf32), else fp32."""
    return next((p for p in _CHEAPEST_FIRST if p in allowed), "fp32")


def record(graph: Graph, plan: PrecisionPlan) -> None:
    """Write the plan on the graph's layers; nodes the rewrite added (casts at the boundaries of
    kept layers, of the engine's inputs and outputs) take the engine's precision, linear."""
    for n in graph.nodes:
        n.precision = plan.layers.get(n, plan.engine)
        n.format = plan.formats.get(n, "linear")


def pinned_layers(graph: Graph, config: PrecisionRequest) -> dict[Node, str]:
    """The layers ``config.layer_precisions`` pins, by node, once each name and precision is
    checked: a name the optimized graph lacks, or a precision the build does not allow, is an
    error naming the layer."""
    by_name: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.name:
            by_name.setdefault(n.name, []).append(n)
    pinned: dict[Node, str] = {}
    for name, wanted in config.layer_precisions.items():
        if name not in by_name:
            raise BuildError(_unknown_layer(name, by_name))
        _check_allowed(name, wanted, config.precisions)
        pinned.update(dict.fromkeys(by_name[name], wanted))
    return pinned


def _unknown_layer(name: str, by_name: Mapping[str, list[Node]]) -> str:
    names = list(by_name)
    shown = ", ".join(names[:_SHOWN_NAMES]) + (", ..." if len(names) > _SHOWN_NAMES else "")
    return (
        f"layer_precisions pins layer '{name}', which the optimized graph does not have (the "
        f"optimizer may have fused it into another layer); its layers are {shown or 'none'}. "
        "Pin a layer of the optimized graph (BuilderConfig.dump_ir or `tensorkiln inspect` on "
        "an engine lists them), or build with optimization level 0"
    )


def _check_allowed(name: str, wanted: str, allowed: Collection[str]) -> None:
    if wanted not in PRECISIONS:
        raise InputError(
            f"layer '{name}' is pinned to unknown precision '{wanted}'; choose from "
            f"{', '.join(PRECISIONS)}"
        )
    if wanted not in allowed and wanted != "fp32":
        raise BuildError(
            f"layer '{name}' is pinned to {wanted}, which this build does not allow on its "
            f"backend (allowed: {', '.join(sorted(allowed))}); allow it with "
            f"set_flag('{wanted}') (--{wanted}) on a backend that implements it, or pin another"
        )


def _check_realizable(node: Node, wanted: str, engine: str) -> None:
    """The default policy computes a layer in the engine's precision or, on an fp16/bf16
    engine, in fp32 (TF32 is a process-wide math mode, so it is the engine's or none)."""
    if wanted == engine or (wanted == "fp32" and engine in _REDUCED):
        return
    raise BuildError(
        f"layer '{node.name}' is pinned to {wanted}, but this {engine} engine can run a layer "
        f"only in {engine}"
        + (" or fp32" if engine in _REDUCED else "")
        + f"; pin it to {engine if engine not in _REDUCED else engine + ' or fp32'}, or allow "
        f"only the precisions it should use (the engine computes in the cheapest one allowed)"
    )


def _check_rewritable(node: Node, precision: str, engine: str) -> None:
    """What :meth:`DefaultPolicy.rewrite` can materialize: the engine's precision, or fp32 on an
    fp16/bf16 engine, or the precision of a quantized layer's operands (a policy that plans more
    brings its own rewrite)."""
    if precision == engine or (precision == "fp32" and engine in _REDUCED):
        return
    if precision == quantized_precision(node):
        return
    raise BuildError(
        f"the precision plan puts layer '{node.name}' ({node.op}) in {precision} while the engine "
        f"computes in {engine}, which DefaultPolicy.rewrite cannot materialize (it keeps layers in "
        "the engine's precision or fp32); the policy must rewrite the graph itself"
    )
