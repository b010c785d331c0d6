"""The accuracy budget: the fewest layers to keep at float32 so that a quantized engine stays
within a stated error of the float32 one on the calibration data (automatic mixed precision).

After calibration every quantizable layer reads its operands through Q/DQ nodes
(:func:`~tensorkiln.precision.quantize.insert_qdq`); keeping a layer in float32 is reading its
float operands again. The search:

1. all layers quantized: within budget, done;
2. each layer's sensitivity: the error with that layer alone kept in float32 (one run each);
3. layers in order of the error they remove, the fewest of them (bisection) that meet the budget.

The same search answers ``tensorkiln debug precision`` (Polygraphy's bisection of which layers
must stay in higher precision), which prints the ranking instead of building.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkiln.errors import InputError
from tensorkiln.ir import Graph, Node, Value

METRICS = ("rel_l2", "cosine")


@dataclass(frozen=True)
class AccuracyBudget:
    """``rel_l2``: the outputs' relative L2 error against float32 at most ``value``; ``cosine``:
    each sample's cosine similarity to float32 at least ``value`` (an embedding's or a logit
    vector's; the worst output and sample count)."""

    metric: str
    value: float

    @classmethod
    def parse(cls, text: str | float) -> AccuracyBudget:
        """'0.02' or 'rel_l2:0.02' or 'cosine:0.999'."""
        metric, _, number = str(text).rpartition(":")
        metric = metric.strip().lower() or "rel_l2"
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if metric not in METRICS or not math.isfinite(value) or value < 0:
            raise InputError(
                f"bad accuracy budget '{text}': expected rel_l2:T (the outputs' relative L2 "
                "error against float32 at most T, e.g. 0.02) or cosine:C (e.g. cosine:0.999)"
            )
        if metric == "cosine" and value > 1:
            raise InputError(f"bad accuracy budget '{text}': a cosine similarity is at most 1")
        return cls(metric, value)

    def error(self, got: list[np.ndarray], want: list[np.ndarray]) -> float:
        """How far ``got`` is from ``want``, larger is worse: the relative L2 error of the worst
        output, or 1 - the cosine similarity of its worst sample (row of the first axis)."""
        worst = 0.0
        for g, w in zip(got, want):
            g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
            if self.metric == "rel_l2":
                ref = float(np.linalg.norm(w64))
                diff = float(np.linalg.norm(g64 - w64))
                e = diff / ref if ref > 0 else diff
            else:
                e = 1.0 - _worst_cosine(g64, w64)
            worst = max(worst, e if math.isfinite(e) else math.inf)
        return worst

    def allows(self, error: float) -> bool:
        limit = self.value if self.metric == "rel_l2" else 1.0 - self.value
        return error <= limit

    def shown(self, error: float) -> str:
        if self.metric == "rel_l2":
            return f"rel L2 {error:.3g}"
        return f"cosine {1.0 - error:.6f}"


def _worst_cosine(g: np.ndarray, w: np.ndarray) -> float:
    """The least cosine similarity of a sample of ``g`` to its sample of ``w`` (1 for two
    zero samples, 0 for one)."""
    rows = g.shape[0] if g.ndim > 1 else 1
    g2, w2 = g.reshape(rows, -1), w.reshape(rows, -1)
    ng, nw = np.linalg.norm(g2, axis=1), np.linalg.norm(w2, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.sum(g2 * w2, axis=1) / (ng * nw)
    cos = np.where((ng == 0) & (nw == 0), 1.0, np.where((ng == 0) | (nw == 0), 0.0, cos))
    return float(np.min(cos, initial=1.0))


@dataclass
class Switch:
    """A quantizable layer's two ways to read its inputs in ``slots``: its data input and weight
    (0 and 1), and a convolution's residual (3) where that is quantized too."""

    node: Node
    float_inputs: tuple[Value, ...]
    quantized_inputs: tuple[Value, ...]
    slots: tuple[int, ...] = (0, 1)

    def set(self, quantized: bool) -> None:
        values = self.quantized_inputs if quantized else self.float_inputs
        for slot, v in zip(self.slots, values, strict=True):
            self.node.inputs[slot] = v


@dataclass
class Search:
    """What the search found: each layer's error when kept alone in float32, and the set kept."""

    all_quantized: float
    sensitivity: dict[str, float] = field(default_factory=dict)  # layer -> error without it
    kept: list[str] = field(default_factory=list)  # the layers kept in float32, most useful first
    final: float = 0.0
    runs: int = 0


def search(
    graph: Graph,
    switches: list[Switch],
    budget: AccuracyBudget,
    feeds: list[dict[str, np.ndarray]],
    run: Callable[[Graph, dict[str, np.ndarray]], list[np.ndarray]],
    progress: Callable[[str], None] | None = None,
    rank_all: bool = False,
) -> Search:
    """Find the fewest ``switches`` to set to float32 for ``budget``; leaves the graph so.
    ``rank_all``: measure every layer's sensitivity even when no layer needs to be kept."""
    if not feeds:
        raise InputError("the accuracy budget is measured on calibration data; none was given")
    _choose(switches, switches)
    reference = [run(graph, f) for f in feeds]
    counter = {"runs": 1}

    def error(float_layers: Iterable[Switch]) -> float:
        _choose(switches, float_layers)
        counter["runs"] += 1
        return max(budget.error(run(graph, f), r) for f, r in zip(feeds, reference))

    found = Search(error(()))
    if budget.allows(found.all_quantized) and not rank_all:
        found.final, found.runs = found.all_quantized, counter["runs"]
        return found
    for k, s in enumerate(switches):
        if progress is not None:
            progress(f"accuracy budget: layer {k + 1} of {len(switches)}")
        found.sensitivity[s.node.name] = error([s])
    ranked = sorted(switches, key=lambda s: found.sensitivity[s.node.name])
    if budget.allows(found.all_quantized):
        found.final, found.runs = found.all_quantized, counter["runs"]
        _choose(switches, ())
        return found
    # the fewest k whose top-k layers meet the budget; all of them float is the float graph,
    # which meets any budget, so k = len(ranked) needs no run
    lo, hi = 1, len(ranked)
    errors: dict[int, float] = {}
    while lo < hi:
        mid = (lo + hi) // 2
        errors[mid] = error(ranked[:mid])
        if budget.allows(errors[mid]):
            hi = mid
        else:
            lo = mid + 1
    found.kept = [s.node.name for s in ranked[:hi]]
    found.final = errors[hi] if hi in errors else error(ranked[:hi])
    _choose(switches, ranked[:hi])  # (leave the graph as chosen)
    found.runs = counter["runs"]
    return found


def _choose(switches: list[Switch], float_layers: Iterable[Switch]) -> None:
    """Set ``float_layers`` to read float operands, every other switch quantized ones."""
    keep = set(map(id, float_layers))
    for s in switches:
        s.set(id(s) not in keep)


def run_with(executor_factory: Callable[[Graph], Any]) -> Callable[[Graph, dict], list[np.ndarray]]:
    """A ``run`` for :func:`search`: the graph's outputs on one feed, as numpy."""

    def run(graph: Graph, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        executor = executor_factory(graph)  # (a new plan: the switches rewired the graph)
        outs = executor.run({v: feed[v.name] for v in graph.inputs})
        to_host = getattr(executor.backend, "to_host", None)
        return [np.asarray(to_host(x) if to_host else x) for x in outs]

    return run
