"""Values that follow from constants and input shapes alone, kept per input shape.

A transformer's position ids, its token types and the index arithmetic of its attention mask
depend on the input shapes only, yet a run computes them with a few dozen small kernels, and a
CUDA graph captured per input shape replays every one of them. The executor of a backend that
keeps them (``Backend.keeps_shape_values``) keys such a layer by its node and, per input, what
the input follows from: an initializer, an output of a layer it kept, or for Shape and Size the
shape of the tensor itself. The first run at a set of shapes computes the layer and keeps its
outputs under that key; later runs, and the graph captured for those shapes, take them instead of
launching the layer's kernels. A shape that follows from values (NonZero's output) is keyed by
the shape it has, so the layers after it are computed again when it changes.

What is never kept: graph outputs (the caller may write to them), random ops, plugins (ops outside
the ONNX and tensorkiln domains), layers with subgraphs, outputs that are not tensors, anything
while a CUDA graph is captured (its kernels only run when it is replayed), and anything past
:data:`MOST` entries or :data:`MOST_BYTES` bytes. Nothing is dropped once kept: a captured graph
may read it. Kept values are marked unchanging (``Backend.unchanging``), so kernels may keep what
they prepare from them, as from constants (a Gather's wrapped indices).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tensorkiln.backends import Backend
from tensorkiln.ir import Node, Value
from tensorkiln.kernels.registry import KernelEntry
from tensorkiln.ops import RANDOM_OPS

# at most, per executor: a transformer keeps a few dozen small values and its token-type
# embeddings per set of input shapes
MOST = 4096
MOST_BYTES = 256 << 20


def keepable(node: Node, entry: KernelEntry, graph_outputs: set[Value]) -> bool:
    """Whether ``node``'s outputs may be kept: an ONNX or tensorkiln op whose outputs follow from
    its inputs and attributes alone, none of them a graph output."""
    return (
        node.domain in ("", "tensorkiln")
        and node.op not in RANDOM_OPS
        and not entry.wants_ctx
        and not any(node.subgraphs())
        and not any(v in graph_outputs for v in node.outputs if v is not None)
    )


class ShapeValues:
    """One executor's kept values (see the module's docstring), for a graph whose initializers
    are ``constants``. A run starts with no tokens (``known``, filled by :func:`bind`) and asks
    :meth:`key`, :meth:`get` and :meth:`keep` layer by layer."""

    def __init__(self, backend: Backend, constants: Iterable[Value]) -> None:
        self.backend = backend
        self._constants = frozenset(constants)  # (each stands for itself in a key)
        self._table: dict[tuple, tuple[int, list[Any]]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._table)

    def key(
        self, node: Node, inputs: tuple[Value | None, ...], env: Mapping[Value, Any], known: dict
    ) -> tuple | None:
        """What the node's outputs follow from, where that is constants and input shapes alone:
        the node and, per input, the constant itself or its token in ``known`` (for Shape and
        Size, the tensor's shape); None otherwise."""
        if node.op in ("Shape", "Size") and node.domain == "":
            x = env.get(inputs[0])  # type: ignore[arg-type]
            return None if not hasattr(x, "shape") else (id(node), tuple(x.shape))
        parts = []
        for v in inputs:
            token = v if v is None or v in self._constants else known.get(v)
            if token is None and v is not None:
                return None
            parts.append(token)
        return id(node), tuple(parts)

    def get(self, key: tuple) -> tuple[int, list[Any]] | None:
        """The outputs kept under ``key`` and their entry's number, or None."""
        return self._table.get(key)

    def keep(self, key: tuple, outputs: list[Any]) -> int | None:
        """Keep ``outputs`` under ``key``, within the bounds; their entry's number, or None."""
        if len(self._table) >= MOST or self.backend.capturing():
            return None
        size = 0
        for r in outputs:
            if r is None:
                continue
            if not hasattr(r, "element_size"):  # (lists, sequences: computed every run)
                return None
            size += r.numel() * r.element_size()
        if self._bytes + size > MOST_BYTES:
            return None
        self._bytes += size
        number = len(self._table)
        self._table[key] = (number, list(outputs))
        for r in outputs:
            if r is not None:
                self.backend.unchanging(r)
        return number


def bind(outputs: tuple[Value | None, ...], values: list[Any] | None, number: int, env: Any,
         known: dict) -> None:  # fmt: skip
    """Give a kept entry's outputs their tokens in ``known`` (and, with ``values``, their values
    in ``env``)."""
    for i, v in enumerate(outputs):
        if v is not None:
            if values is not None:
                env[v] = values[i]
            known[v] = (number, i)
