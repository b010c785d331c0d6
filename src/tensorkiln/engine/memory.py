"""Activation memory planning: liveness over the execution order, one arena, offsets reused.

Each activation (a node output that is not a graph output's alias of an input or a constant) is
live from the step that produces it to the last step that reads it; graph outputs stay live to the
end. Buffers are placed greedily, largest first, at the lowest offset that does not overlap a buffer
whose lifetime intersects (the greedy-by-size strategy of TFLite's arena planner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorkiln.ir import Graph, TensorType, Value, node_reads
from tensorkiln.ir.dims import dim_value

ALIGNMENT = 256


@dataclass
class Buffer:
    name: str
    size: int
    first: int  # step that writes it
    last: int  # last step that reads it
    offset: int = -1


@dataclass
class MemoryPlan:
    buffers: list[Buffer] = field(default_factory=list)
    peak: int = 0
    naive: int = 0
    dynamic: list[str] = field(default_factory=list)  # sizes unknown until run time

    def to_json(self) -> dict:
        return {
            "alignment": ALIGNMENT,
            "peak_bytes": self.peak,
            "naive_bytes": self.naive,
            "buffers": [[b.name, b.offset, b.size, b.first, b.last] for b in self.buffers],
            "dynamic": self.dynamic,
        }


def value_bytes(v: Value, symbols: dict[str, int]) -> int | None:
    """Bytes of ``v`` with symbolic dims bound by ``symbols``; None when not computable."""
    t = v.type
    if not isinstance(t, TensorType) or t.dtype is None or t.shape is None or t.dtype.bits == 0:
        return None
    count = 1
    for d in t.shape:
        n = dim_value(d, symbols)
        if n is None:
            return None
        count *= n
    return (count * t.dtype.bits + 7) // 8


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_memory(graph: Graph, symbols: dict[str, int] | None = None) -> MemoryPlan:
    """Plan the activations of ``graph`` (top level) with symbolic dims bound by ``symbols``."""
    symbols = symbols or {}
    end = len(graph.nodes)
    first: dict[Value, int] = {}
    last: dict[Value, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in node_reads(n):
            last[v] = i
        for v in n.outputs:
            if v is not None:
                first[v] = i
                last.setdefault(v, i)
    for v in graph.outputs:
        if v in first:
            last[v] = end
    plan = MemoryPlan()
    for v, start in first.items():
        size = value_bytes(v, symbols)
        if size is None:
            plan.dynamic.append(v.name)
            continue
        plan.buffers.append(Buffer(v.name, _align(size), start, last[v]))
    plan.naive = sum(b.size for b in plan.buffers)
    placed: list[Buffer] = []
    for b in sorted(plan.buffers, key=lambda b: (-b.size, b.first)):
        b.offset = _lowest_fit(b, placed)
        placed.append(b)
        plan.peak = max(plan.peak, b.offset + b.size)
    plan.buffers.sort(key=lambda b: (b.first, b.name))
    return plan


def _lowest_fit(b: Buffer, placed: list[Buffer]) -> int:
    busy = sorted(
        (p.offset, p.offset + p.size) for p in placed if p.first <= b.last and b.first <= p.last
    )
    offset = 0
    for lo, hi in busy:
        if offset + b.size <= lo:
            break
        offset = max(offset, hi)
    return offset


def max_profile_symbols(graph: Graph, profiles: Sequence[Any]) -> dict[str, int]:
    """Symbol sizes to plan memory for: the largest any profile allows (1 without profiles).

    ``profiles`` are OptimizationProfiles (anything with ``shapes``: name -> (min, opt, max)).
    """
    symbols: dict[str, int] = {}
    for p in profiles:
        for v in graph.inputs:
            if v.name not in p.shapes or v.shape is None:
                continue
            for d, hi in zip(v.shape, p.shapes[v.name][2]):
                if isinstance(d, str):
                    symbols[d] = max(symbols.get(d, 1), hi)
    for v in graph.inputs:
        for d in v.shape or ():
            if isinstance(d, str):
                symbols.setdefault(d, 1)
    return symbols
