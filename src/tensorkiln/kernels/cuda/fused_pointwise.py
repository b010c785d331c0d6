"""tensorkiln.Pointwise on the cuda backend, default tactic: the body's ops, one kernel each.

``Pointwise(inputs...) {body}`` binds its inputs positionally to ``body``'s inputs and returns the
body's outputs (see :mod:`tensorkiln.kernels.reference.fused_pointwise`). This default runs the body
through the executor with the cuda kernels of its elementwise ops; the body's constants are the
executor's device copies. Generated single-kernel versions of a body are tactics of this op.
"""

from __future__ import annotations

import torch

from tensorkiln.ir.graph import Graph
from tensorkiln.kernels.registry import register


@register("Pointwise", domain="tensorkiln", since=1, backend="cuda")
def pointwise(*inputs: torch.Tensor, body: Graph, _ctx) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Evaluate ``body`` on ``inputs`` with the cuda kernels of its ops."""
    outs = tuple(_ctx.run_graph(body, list(inputs)))
    return outs[0] if len(outs) == 1 else outs
