"""A readable text form of a graph, for debugging passes: one line per node.

graph torch_jit (ai.onnx 17)
  in  %input: f32[N,3,224,224]
  %conv1: f32[N,64,112,112] = Conv(%input, %w1, %b1) {kernel_shape=[7,7], strides=[2,2]} @fp32 linear
  out %output
"""

from __future__ import annotations

import numpy as np

from tensorkiln.ir.graph import Graph, Node, Value

_MAX_ATTR = 60


def format_graph(graph: Graph, indent: str = "") -> str:
    """The whole graph (subgraphs indented under their node) as text."""
    opsets = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in sorted(graph.opsets.items()))
    lines = [f"{indent}graph {graph.name} ({opsets})"]
    for v in graph.inputs:
        lines.append(f"{indent}  in  {_decl(v)}")
    for v in graph.initializers:
        lines.append(f"{indent}  const {_decl(v)}")
    for node in graph.nodes:
        lines.append(indent + "  " + format_node(node))
        for name, sub in _subgraph_attrs(node):
            lines.append(f"{indent}    {name}:")
            lines.append(format_graph(sub, indent + "      "))
    lines.append(f"{indent}  out " + ", ".join(f"%{v.name}" for v in graph.outputs))
    return "\n".join(lines)


def format_node(node: Node) -> str:
    outs = ", ".join(_decl(v) if v is not None else "_" for v in node.outputs)
    ins = ", ".join(f"%{v.name}" if v is not None else "_" for v in node.inputs)
    op = f"{node.domain}.{node.op}" if node.domain else node.op
    attrs = {k: v for k, v in node.attrs.items() if not isinstance(v, Graph)}
    text = f"{outs} = {op}({ins})"
    if attrs:
        text += " {" + ", ".join(f"{k}={_attr(v)}" for k, v in attrs.items()) + "}"
    how = " ".join(x for x in (node.precision, node.format) if x is not None)
    if how:  # the precision policy's choice for this layer
        text += f" @{how}"
    return f"{text}  # {node.name}" if node.name else text


def _decl(v: Value) -> str:
    return f"%{v.name}: {v.type if v.type is not None else '?'}"


def _attr(v: object) -> str:
    if isinstance(v, np.ndarray):
        text = f"tensor{list(v.shape)}" if v.size > 8 else np.array2string(v, separator=",")
    else:
        text = repr(v) if isinstance(v, str) else str(v)
    return text if len(text) <= _MAX_ATTR else text[: _MAX_ATTR - 3] + "..."


def _subgraph_attrs(node: Node) -> list[tuple[str, Graph]]:
    out = []
    for k, v in node.attrs.items():
        if isinstance(v, Graph):
            out.append((k, v))
        elif isinstance(v, list):
            out.extend((f"{k}[{i}]", g) for i, g in enumerate(v) if isinstance(g, Graph))
    return out
