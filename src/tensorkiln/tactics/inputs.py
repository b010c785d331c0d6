"""What the autotuner feeds each layer: the values the graph itself would give it.

Random data is outside many ops' domain: the variance an RMSNorm layer takes the square root of is
never negative in a real model, but a normal draw is negative half the time, and the layer's output
turns to NaN, for every candidate and for the oracle alike. So the graph runs once at the tuning
shapes, node by node beside the tuning, with every op's default kernel on drawn model inputs; each
layer is then tuned on its real inputs. Values are dropped after their last reader, so the pass
holds what one inference holds.

Where a real value is missing (the pass failed at an earlier node, or a shape differs from the one
tuned for) floating-point inputs are drawn from a normal distribution and other inputs keep the
layer on its default kernel; the oracle check then compares only where the oracle is finite.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorkiln.backends import Backend
from tensorkiln.ir import Graph, Node, Value, node_reads
from tensorkiln.kernels.registry import invoke, lookup
from tensorkiln.kernels.tactics import LayerSpec
from tensorkiln.runtime.executor import Executor, Scope

FLOATS = ("float32", "float16", "bfloat16", "float64")


class LayerInputs:
    """The graph's activations at the tuning shapes, computed one node at a time.

    Call :meth:`for_layer` for a node's inputs, then :meth:`advance` past it, in graph order.
    """

    def __init__(
        self, graph: Graph, executor: Executor, shapes: dict[str, tuple[int, ...]]
    ) -> None:
        self.graph = graph
        self.executor = executor
        self.env: dict[Value, Any] = {}
        self.scope = Scope(executor, self.env)
        self.broken: str | None = None  # why the graph's values stopped, at which node
        self._last_use = _last_uses(graph)
        self._feed(shapes)

    def _feed(self, shapes: dict[str, tuple[int, ...]]) -> None:
        import torch  # lazy: torch is optional (an autotuning backend has it)

        backend = self.executor.backend
        gen = torch.Generator(device=backend.device).manual_seed(0)
        for v in self.graph.inputs:
            shape = shapes.get(v.name)
            dtype = getattr(getattr(v.type, "dtype", None), "numpy", None)
            if shape is None or dtype is None:
                self.broken = f"input '{v.name}' has no shape or dtype to draw"
                return
            dtype = np.dtype(dtype)
            try:
                if dtype.kind == "f":  # (in the layout the engine uploads it in)
                    self.env[v] = self.executor.upload_input(
                        v, _draw(shape, dtype.name, gen, backend)
                    )
                else:  # token ids, masks, indices: all ones, a valid index anywhere
                    self.env[v] = torch.ones(
                        shape, dtype=backend.device_dtype(dtype), device=backend.device
                    )
            except TypeError:  # strings: nothing torch holds
                self.broken = f"input '{v.name}' of {dtype} cannot be drawn"
                return

    def for_layer(self, node: Node, spec: LayerSpec) -> list | None:
        """The node's inputs at ``spec``'s shapes: real values where known, else drawn; None
        when an input that is not floating point has no real value (its values matter)."""
        import torch  # lazy: torch is optional (an autotuning backend has it)

        backend = self.executor.backend
        gen = torch.Generator(device=backend.device).manual_seed(len(node.name))
        args: list = []
        for v, shape, dtype in zip(node.inputs, spec.shapes, spec.dtypes):
            if v is None:
                args.append(None)
            elif v.const is not None:
                args.append(self.executor.const(v))
            elif _matches(self.env.get(v), shape, dtype, backend):
                args.append(self.env[v])
            elif dtype in FLOATS:
                args.append(_draw(shape, dtype, gen, backend))
            else:
                return None
        return args

    def advance(self, index: int, node: Node) -> None:
        """Compute ``node``'s outputs with its default kernel, then drop the values whose last
        reader it is."""
        if self.broken is None:
            self._run(node)
        for v in node_reads(node):
            if self._last_use.get(v) == index:
                self.env.pop(v, None)

    def _run(self, node: Node) -> None:
        opset = self.graph.opset(node.domain)
        entry = lookup(node.op, node.domain, opset, self.executor.backend.name, node=node.name)
        args = [None if v is None else self._value(v) for v in node.inputs]
        try:
            if any(a is None for v, a in zip(node.inputs, args) if v is not None):
                raise KeyError("an input was never computed")
            outs = invoke(entry, args, node.attrs, len(node.outputs), self.scope)
        except Exception as exc:  # drawn model inputs may be outside what the model accepts
            self.broken = f"node '{node.name}' ({node.op}): {type(exc).__name__}: {exc}"[:300]
            self.env.clear()
            return
        for v, out in zip(node.outputs, outs):
            if v is not None:
                self.env[v] = out
        self.executor.shadow_host_values(node, self.env)

    def _value(self, v: Value) -> Any:
        return self.executor.const(v) if v.const is not None else self.env.get(v)


def _last_uses(graph: Graph) -> dict[Value, int]:
    """Value -> index of the last node that reads it; graph outputs are never dropped early
    (they have no reader here, and nothing after needs them)."""
    last: dict[Value, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in node_reads(n):
            last[v] = i
    return last


def _matches(value: Any, shape: tuple[int, ...], dtype: str | None, backend: Backend) -> bool:
    import torch  # lazy: torch is optional (an autotuning backend has it)

    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        return False
    try:
        return value.dtype == backend.device_dtype(dtype)
    except TypeError:
        return False


def _draw(shape: tuple[int, ...], dtype: str, gen: Any, backend: Backend) -> Any:
    """A standard normal draw of ``shape`` in ``dtype`` (TypeError for a dtype torch lacks)."""
    import torch  # lazy: torch is optional (an autotuning backend has it)

    target = backend.device_dtype(dtype)
    t = torch.randn(shape, generator=gen, device=backend.device, dtype=torch.float32)
    return t.to(target)
