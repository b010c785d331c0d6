"""The cpu backend's opt-in compiled path: the executor's plan traced by torch.compile.

The plain loop calls one torch kernel per layer from Python; Inductor (torch.compile with
freezing) traces the same kernels into one program, fuses the elementwise layers into their
neighbours, folds the weights and prepacks them for oneDNN itself. The trace runs the kernels
on their plain torch route (``Backend.plain()``: weights not held, no shape-specialized
functions), as the prepacked oneDNN calls of the plain loop (kernels/cpu/conv.py) take opaque packed
weights that dynamo cannot trace.

Compiling takes seconds per input shape (dynamic=False: one program per set of input shapes,
made at the first run with them), so the path is opt-in: ``create_execution_context(
compile=True)`` or TENSORKILN_CPU_COMPILE=1. Anything that fails while compiling or running the
compiled program warns once and that set of shapes runs the plain loop from then on: the path
never fails a run nor gives another answer than the loop's kernels would.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from tensorkiln.backends import Backend
from tensorkiln.ir import Graph
from tensorkiln.runtime.executor import Executor, Scope, _run_step

ENV = "TENSORKILN_CPU_COMPILE"
# Inductor's settings, as measured on MobileNetV3-Small and EfficientNet-B0 (RESULTS.md):
# freezing folds the weights as constants (and lets Inductor prepack convolutions' weights);
# the C++ wrapper calls the kernels without Python in between
_OPTIONS = {"freezing": True, "cpp_wrapper": True}


def wanted(compile: bool | None) -> bool:
    """Whether a context compiles: ``compile`` when given, else the environment variable."""
    if compile is not None:
        return bool(compile)
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


_SHARED: weakref.WeakKeyDictionary[Any, CompiledRuns] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def for_engine(engine: Any) -> CompiledRuns:
    """The engine's compiled runs, shared by its contexts: one copy of the weights and one
    compile per input shape however many contexts run it."""
    with _SHARED_LOCK:
        runs = _SHARED.get(engine)
        if runs is None:
            runs = _SHARED[engine] = CompiledRuns(engine.graph, engine.runtime_backend)
        return runs


class CompiledRuns:
    """Runs a cpu engine's graph through torch.compile, one compiled program per input-shape
    key, falling back to the plain loop for any key where compiling or running fails."""

    def __init__(self, graph: Graph, backend: Backend) -> None:
        self.graph = graph
        # its own weights: the plain loop's are held channels-last with prepacked copies
        self._executor = Executor(graph, backend.plain())
        self._executor.upload_weights()  # (numpy conversions are not for the trace)
        self._program = _Program(self._executor, graph)
        self._compiled: Any = None  # torch.compile's wrapper, made at the first run
        self._ready: set[Hashable] = set()  # keys compiled and run once without error
        self._failed: set[Hashable] = set()  # keys that run the plain loop
        self._lock = threading.Lock()  # compiles one key at a time

    def run(self, key: Hashable, inputs: list[Any], plain: Callable[[], list[Any]]) -> list[Any]:
        """The graph's outputs for ``inputs`` (tensors on the CPU), compiled for ``key`` at the
        first run with it; ``plain()`` (the plain loop) where compiling or running failed."""
        if key in self._failed:
            return plain()
        if key in self._ready:
            return self._call(key, inputs, plain)
        import torch

        # (the settings as a patch of Inductor's config while it compiles: freezing given in
        # torch.compile's options is not applied, the weights stay inputs of the program)
        # (dynamo keeps at most recompile_limit programs per function, and Program.forward is
        # one function for every engine: past that it would run the plan uncompiled, on the plain
        # route, slower than the loop; failing instead sends those shapes to the loop)
        with (
            self._lock,
            torch._inductor.config.patch(_OPTIONS),
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
            warnings.catch_warnings(),
        ):
            # (dynamo traces through the kernels' lru_cache'd geometry, a pure function of
            # shapes and attributes, and says so once)
            warnings.filterwarnings("ignore", message=".*lru_cache", category=UserWarning)
            result = self._call(key, inputs, plain)
            if key not in self._failed:
                self._ready.add(key)
            return result

    def _call(self, key: Hashable, inputs: list[Any], plain: Callable[[], list[Any]]) -> list[Any]:
        try:
            if self._compiled is None:
                import torch

                self._compiled = torch.compile(self._program, dynamic=False, fullgraph=False)
            return list(self._compiled(*inputs))
        except Exception as exc:  # any failure of torch.compile: the plain loop is right
            self._failed.add(key)
            first = (str(exc).splitlines() or [""])[0][:200]
            warnings.warn(
                f"tensorkiln: torch.compile failed for input shapes {key}; these shapes run "
                f"the plain loop ({type(exc).__name__}: {first})",
                RuntimeWarning,
                stacklevel=2,
            )
            return plain()


@functools.cache
def _program(torch: Any) -> type:
    """The module torch.compile traces (made once torch is imported)."""

    class Program(torch.nn.Module):
        """The graph's plan as a module whose buffers are the graph's weights: Inductor's
        freezing folds a module's parameters and buffers as constants (tensors the trace only
        reaches through the executor would stay inputs of the compiled program)."""

        def __init__(self, executor: Executor, graph: Graph) -> None:
            super().__init__()
            self._executor = executor
            self._graph = graph
            self._plan = executor._plan(graph)
            self._weights = []  # (value, buffer name)
            self._others = {}  # initializers that are not tensors, as the kernels take them
            for i, v in enumerate(graph.initializers):
                c = executor.const(v)
                if isinstance(c, torch.Tensor):
                    self.register_buffer(f"w{i}", c, persistent=False)
                    self._weights.append((v, f"w{i}"))
                else:
                    self._others[v] = c

        def forward(self, *inputs: Any) -> list[Any]:
            env = dict(self._others)
            for v, name in self._weights:
                env[v] = getattr(self, name)
            env.update(zip(self._graph.inputs, inputs))
            scope = Scope(self._executor, env)  # (what kernels with subgraphs run them in)
            for step in self._plan:  # Scope.run_graph's loop, without freeing: one program
                _run_step(step, env, scope)
            return [env[v] for v in self._graph.outputs]

    return Program


def _Program(executor: Executor, graph: Graph) -> Any:
    import torch

    return _program(torch)(executor, graph)
