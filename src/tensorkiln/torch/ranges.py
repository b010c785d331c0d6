"""Dynamic dimensions that dynamo traced with bounds, as engine profiles.

A graph dynamo traces with symbolic sizes (``torch._dynamo.mark_dynamic(x, 0, min=1, max=64)``,
or sizes it found changing) carries each symbol's range in its shape environment. Where every
symbolic size of the graph's tensor inputs is bounded, the backend builds one engine per block
whose profile spans those ranges, instead of one per input shape:

* the graph's integer inputs that are sizes (dynamo passes ``s0`` beside a tensor of size ``s0``)
  are replaced by size queries of those tensors, so nothing bakes one size into an engine;
* each block's inputs get ``torch.export.Dim``s from their traced shapes, one Dim per symbol,
  shared between the blocks' inputs.

A block input whose size is an expression of symbols (``2*s0``), or a number computed outside
the blocks, has no Dim to give: :class:`NotRanged` says so and the backend builds per shape.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorkiln.frontends.torch.export import size_range


class NotRanged(Exception):
    """The graph's dynamic sizes cannot be given as profiles (the message says why)."""


def _fake(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def symbol_ranges(gm: torch.fx.GraphModule) -> dict[str, tuple[int, int]]:
    """Symbol -> (min, max) of the symbolic sizes of ``gm``'s tensor inputs; {} where none is
    symbolic. Raises NotRanged for a symbol with no maximum."""
    symbols: set[str] = set()
    env = None
    for node in gm.graph.nodes:
        value = _fake(node) if node.op == "placeholder" else None
        if not isinstance(value, torch.Tensor):
            continue
        for d in value.shape:
            if isinstance(d, torch.SymInt):
                symbols |= {str(s) for s in d.node.expr.free_symbols}
                env = d.node.shape_env
    if not symbols:
        return {}
    ranges = {str(k): v for k, v in env.var_to_range.items()}
    out = {}
    for s in sorted(symbols):
        lo, hi = size_range(ranges[s]) if s in ranges else (1, None)
        if hi is None:
            raise NotRanged(
                f"size {s} has no maximum (torch._dynamo.mark_dynamic(x, dim, max=...))"
            )
        out[s] = (lo, hi)
    return out


def sizes_from_tensors(gm: torch.fx.GraphModule) -> list[int]:
    """Replace the integer inputs that are a tensor input's size with size queries of that
    tensor; returns the positions (among the placeholders) of the inputs removed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where: dict[str, tuple[torch.fx.Node, int]] = {}
    for node in placeholders:
        value = _fake(node)
        if isinstance(value, torch.Tensor):
            for axis, d in enumerate(value.shape):
                if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                    where.setdefault(str(d.node.expr), (node, axis))
    sizes = [(i, n) for i, n in enumerate(placeholders) if isinstance(_fake(n), torch.SymInt)]
    for _, node in sizes:  # (all checked before the graph is changed)
        if str(_fake(node).node.expr) not in where:
            raise NotRanged(f"input {node.name} is a size of no tensor input")
    removed = []
    for i, node in sizes:
        value = _fake(node)
        source = where[str(value.node.expr)]
        with gm.graph.inserting_after(placeholders[-1]):
            size = gm.graph.call_function(torch.ops.aten.sym_size.int, (source[0], source[1]))
        size.meta["example_value"] = value
        node.replace_all_uses_with(size)
        gm.graph.erase_node(node)
        removed.append(i)
    gm.recompile()
    return removed


def block_dims(
    call: torch.fx.Node, ranges: dict[str, tuple[int, int]], dims: dict[str, Any]
) -> tuple[dict[int, Any] | None, ...]:
    """The dynamic_shapes of a block's inputs: a Dim for each axis whose traced size is a
    symbol (``dims`` holds one Dim per symbol, made here on first use)."""
    out = []
    for arg in call.args:
        value = _fake(arg) if isinstance(arg, torch.fx.Node) else arg
        if not isinstance(value, torch.Tensor):
            raise NotRanged(f"block {call.target} takes a number computed outside the blocks")
        axes = {}
        for axis, d in enumerate(value.shape):
            if not isinstance(d, torch.SymInt):
                continue
            expr = d.node.expr
            if not expr.is_Symbol or str(expr) not in ranges:
                raise NotRanged(f"block {call.target} takes a tensor of size {expr}")
            name = str(expr)
            if name not in dims:
                lo, hi = ranges[name]
                dims[name] = torch.export.Dim(f"tk_{name}", min=lo, max=hi)
            axes[axis] = dims[name]
        out.append(axes or None)
    return tuple(out)
