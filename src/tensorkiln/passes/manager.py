"""The PassManager: named passes by optimization level, statistics, IR dumps, verification.

    pm = PassManager(level=3, dump_dir="ir/", verify=True)
    graph = pm.run(graph)
    print(pm.stats)        # {"dead_code": 12, "fuse_conv_act": 49, ...}

A pass is a function ``(graph) -> int`` that changes the graph in place and returns how many
matches it rewrote. It is registered with :func:`register_pass` under a name and the lowest
optimization level that runs it (0 runs nothing).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import tensorkiln.passes.builtin  # noqa: F401  (the built-in passes register themselves)
from tensorkiln.ir import Graph
from tensorkiln.ir.printer import format_graph
from tensorkiln.ir.verify import verify as verify_graph
from tensorkiln.kernels.evaluate import infer_shapes
from tensorkiln.passes.registry import PASSES, PassInfo, register_pass

__all__ = ["PASSES", "PassInfo", "PassManager", "register_pass"]


class PassManager:
    """Runs the registered passes of an optimization level in stages, each to its fixed point
    (``quantized_only``: only the passes registered ``quantized``, which the builder runs again
    after implicit quantization)."""

    def __init__(
        self,
        level: int = 3,
        *,
        dump_dir: str | os.PathLike | None = None,
        verify: bool = False,
        max_rounds: int = 4,
        only: list[str] | None = None,
        backend: str | None = None,
        exclude: frozenset[str] = frozenset(),
        quantized_only: bool = False,
    ) -> None:
        self.level = level
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.verify = verify
        self.max_rounds = max_rounds
        chosen = [
            p
            for p in PASSES.values()
            if 0 < p.level <= level
            and (backend is None or p.backends is None or backend in p.backends)
            and p.name not in exclude
            and (p.quantized or not quantized_only)
        ]
        if only is not None:
            unknown = set(only) - set(PASSES)
            if unknown:
                raise KeyError(f"unknown pass(es) {sorted(unknown)}; known: {sorted(PASSES)}")
            chosen = [PASSES[n] for n in only]
        self.passes = sorted(chosen, key=lambda p: p.order)
        self.stats: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._dumps = 0

    def run(self, graph: Graph) -> Graph:
        """Optimize ``graph`` in place, stage by stage.

        Stage L runs every chosen pass of level <= L until nothing changes, so clean-up and shape
        simplification reach their fixed point before folds, and folds before fusions; types are
        inferred again after every pass that changed the graph, so later passes see exact shapes.
        """
        self._dump(graph, "input")
        for stage in sorted({p.level for p in self.passes}):
            group = [p for p in self.passes if p.level <= stage]
            for members in ([p for p in group if not p.late], group):
                for _ in range(self.max_rounds):
                    if not sum(self._run_pass(p, graph) for p in members):
                        break
        return graph

    def _run_pass(self, p: PassInfo, graph: Graph) -> int:
        t0 = time.perf_counter()
        n = p.fn(graph)
        if n:
            infer_shapes(graph)
        self.seconds[p.name] = self.seconds.get(p.name, 0.0) + time.perf_counter() - t0
        self.stats[p.name] = self.stats.get(p.name, 0) + n
        if n:
            if self.verify:
                verify_graph(graph)
            self._dump(graph, p.name)
        return n

    def _dump(self, graph: Graph, name: str) -> None:
        if self.dump_dir is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"{self._dumps:03d}_{name}.txt"
        path.write_text(format_graph(graph) + "\n")
        self._dumps += 1

    def summary(self) -> str:
        return "\n".join(f"{name}: {n}" for name, n in self.stats.items() if n)
