"""Evaluating nodes ahead of time with their reference kernels, and the shape inference that does
so (constant folding of shape computations at import, in the passes and at build time).

Shape inference itself (:mod:`tensorkiln.ops.infer`) knows no kernel; this module, above both the
op records and the kernel registry, gives it the reference kernels as its evaluator.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.errors import TensorkilnError
from tensorkiln.ir.graph import Graph, Node, Value
from tensorkiln.kernels.registry import invoke, lookup, node_kwargs
from tensorkiln.ops import infer as _infer

# The most bytes evaluating one node ahead of time (at import, in constant folding and shape
# passes) may materialize, computed from the output shapes before anything is allocated. Folding
# is for shape arithmetic and small weight transforms: the passes keep at most 1M elements per
# output (passes.cleanup.FOLD_MAX_ELEMENTS, 8 MiB at 8 bytes each), so 16 MiB never refuses what
# they want, while a 180-byte model whose ConstantOfShape asks for 4 GiB is left to run at run
# time (the same idea as the size_threshold of onnx-graphsurgeon's fold_constants, Polygraphy's
# --fold-size-threshold). Nodes whose output size cannot be known before running are not
# evaluated, except those whose outputs are bounded by their inputs (the records' BOUNDED trait).
FOLD_MAX_BYTES = 16 << 20


def evaluate_node(
    graph: Graph, node: Node, args: list, *, max_bytes: int | None = None
) -> list | None:
    """The node's outputs computed by its reference kernel on ``args``, or None when that is not
    possible (no kernel, a kernel that runs subgraphs, or one that rejects these inputs) or not
    wise: outputs of more than ``max_bytes`` together (default :data:`FOLD_MAX_BYTES`), or of a
    size unknown before running."""
    try:
        entry = lookup(node.op, node.domain, graph.opset(node.domain), node=node.name)
    except TensorkilnError:
        return None
    limit = FOLD_MAX_BYTES if max_bytes is None else max_bytes
    if entry.wants_ctx or not _infer.fits(graph, node, args, limit):
        return None
    try:
        kwargs = node_kwargs(entry, node.attrs, len(node.outputs))
        return invoke(entry, args, kwargs, len(node.outputs))[: len(node.outputs)]
    except Exception:  # a kernel that rejects these inputs: leave the node to the shape rules
        return None


def infer_shapes(graph: Graph, known: dict[Value, np.ndarray] | None = None) -> None:
    """Fill in the types of every value of ``graph`` (and its subgraphs) in place, evaluating
    small known computations with the reference kernels (see :mod:`tensorkiln.ops.infer`)."""
    _infer.infer_shapes(graph, known, evaluate=evaluate_node)


def infer_at_shapes(graph: Graph, shapes: dict[str, tuple[int, ...]]) -> Graph:
    """A copy of ``graph`` with the named inputs at concrete ``shapes`` and every type inferred
    from them; the weights (of subgraphs too) are shared with ``graph``, not copied."""
    return _infer.infer_at_shapes(graph, shapes, evaluate=evaluate_node)
