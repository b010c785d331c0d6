"""fuse_pointwise: maximal trees of elementwise ops become one tensorkiln.Pointwise node.

Runs last among the fusions (level 3, order 90) and takes what the conv/gemm/norm/attention fusions
left. Pattern, check, replacement:

* **Pattern**: starting from the last elementwise node not yet taken (the *root*), absorb the
  elementwise producers of the group's inputs, one at a time.
* **Check**: a producer is absorbed when every reader of its output is in the group, or, when some
  are not, its output becomes an extra output of the fused node, provided no path leads from those
  outside readers back into the group (that would make a cycle). Integer-only arithmetic on
  scalars and vectors (shape computations) is left alone, so that shape inference and folding keep
  seeing it. A group of one op is not fused.
* **Replacement**: ``Pointwise(external inputs...) {body}``, whose outputs are the root's output then
  the intermediates read outside, in that order. The body is a copy of the group over fresh Values;
  constants read by the group (initializers, Constant nodes) become initializers of the body.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.passes.facts import ELEMENTWISE
from tensorkiln.passes.registry import register_pass
from tensorkiln.passes.rewrite import Rewrite, const_value

DOMAIN = "tensorkiln"


@dataclass
class Group:
    """Nodes fused into one Pointwise, with the values it reads from and gives to the outside."""

    root: Node
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)  # root output first, then extra ones


_QDQ = ("QuantizeLinear", "DequantizeLinear")
_EIGHT_BIT = (DType.INT8, DType.UINT8, DType.FLOAT8E4M3FN)


def _per_tensor_qdq(node: Node) -> bool:
    """A QuantizeLinear/DequantizeLinear of one float32 scale and zero point between float and
    int8/uint8/float8 E4M3 tensors: elementwise, and the Triton generator emits it (an explicitly
    quantized model's residual adds: DQ, DQ, Add, Relu, Q in one kernel, reading and writing 8
    bits; an FP8 model's Q/DQ pairs around the attention's products, into their neighbours)."""
    if len(node.outputs) != 1 or node.outputs[0] is None or len(node.inputs) < 2:
        return False
    if node.attrs.get("block_size", 0) or node.attrs.get("output_dtype", 0):
        return False
    scalars = [v for v in node.inputs[1:3] if v is not None]
    if any(not isinstance(v.type, TensorType) or v.shape is None for v in scalars):
        return False
    if any(int(np.prod(v.shape)) != 1 for v in scalars) or node.inputs[1].dtype != DType.FLOAT:
        return False
    x, y = node.inputs[0], node.outputs[0]
    if x is None or not isinstance(x.type, TensorType) or not isinstance(y.type, TensorType):
        return False
    quantized = y if node.op == "QuantizeLinear" else x
    return quantized.dtype in _EIGHT_BIT and x.shape is not None and len(x.shape) >= 1


def is_elementwise(node: Node) -> bool:
    """An elementwise op on tensors of known dtype that is not shape arithmetic.

    Integer and bool ops on scalars and vectors (or of unknown rank) are taken for shape
    computations and left alone, so that shape inference and folding keep seeing them; integer and
    bool ops on tensors of rank 2 and up (attention masks) are fused.
    """
    if node.domain in ("", "ai.onnx") and node.op in _QDQ:
        return _per_tensor_qdq(node)
    if node.domain not in ("", "ai.onnx") or node.op not in ELEMENTWISE:
        return False
    if "broadcast" in node.attrs or "axis" in node.attrs:  # opset < 7 unidirectional broadcasting
        return False
    if len(node.outputs) != 1 or node.outputs[0] is None or not node.inputs:
        return False
    values = [v for v in node.inputs if v is not None] + [node.outputs[0]]
    types = [v.type for v in values]
    if not all(isinstance(t, TensorType) and t.dtype not in (None, DType.STRING) for t in types):
        return False
    if any(t.dtype.is_float for t in types):
        return True
    return all(t.shape is not None and len(t.shape) >= 2 for t in types)


@register_pass("fuse_pointwise", level=3, order=90, late=True)
def fuse_pointwise(graph: Graph) -> int:
    """Fuse maximal groups of elementwise ops into tensorkiln.Pointwise nodes; returns groups fused.

    Subgraphs (If branches, Loop and Scan bodies) are fused too, each on its own.
    """
    nested = sum(
        fuse_pointwise(sub) for n in graph.nodes if n.domain != DOMAIN for sub in n.subgraphs()
    )
    groups = find_groups(graph)
    producers = graph.producers()
    rw = Rewrite()
    for k, group in enumerate(groups):
        rw.merge(replace_group(graph, group, k, producers))
    count = rw.apply(graph)
    if count:
        taken = [v for g in groups for n in g.nodes for v in n.inputs if v is not None]
        drop_unread_constants(graph, taken)
    return count + nested


def find_groups(graph: Graph) -> list[Group]:
    """Groups of two or more elementwise nodes, found from the last node backwards.

    Two groups can feed each other through their extra outputs although neither reaches back into
    itself; a group that would close such a cycle is grown again without extra outputs (or, if
    that still closes one, dropped).
    """
    producers = graph.producers()
    consumers = graph.consumers()
    index = {n: i for i, n in enumerate(graph.nodes)}
    taken: set[Node] = set()
    groups: list[Group] = []
    grouped: dict[Node, Group] = {}
    extras = False  # whether an accepted group has extra outputs: only then can cycles appear
    for node in reversed(graph.nodes):
        if node in taken or not is_elementwise(node):
            continue
        for extra_outputs in (True, False):
            group = grow(graph, node, producers, consumers, index, taken, extra_outputs)
            has_extra = len(group.outputs) > 1
            if len(group.nodes) < 2 or not (extras or has_extra):
                break
            if not closes_cycle(group, grouped, consumers):
                break
        else:
            continue
        if len(group.nodes) >= 2:
            extras |= has_extra
            taken.update(group.nodes)
            grouped.update(dict.fromkeys(group.nodes, group))
            groups.append(group)
    return groups


def grow(
    graph: Graph,
    root: Node,
    producers: dict[Value, Node],
    consumers: dict[Value, list[Node]],
    index: dict[Node, int],
    taken: set[Node],
    extra_outputs: bool,
) -> Group:
    """The largest group with ``root`` as its last node, absorbing producers while the check holds."""
    group = Group(root, [root], [root.outputs[0]])
    members = {root}
    frontier = [v for v in root.inputs if v is not None]
    while frontier:
        v = frontier.pop()
        p = producers.get(v)
        if p is None or p in members or p in taken or not is_elementwise(p):
            continue
        outside = [c for c in consumers.get(v, []) if c not in members]
        if (outside or v in graph.outputs) and not extra_outputs:
            continue
        if outside and reaches(outside, members, consumers, index, index[root]):
            continue  # an outside reader leads back into the group: fusing would make a cycle
        if outside or v in graph.outputs:
            group.outputs.append(v)
        members.add(p)
        group.nodes.append(p)
        frontier.extend(x for x in p.inputs if x is not None)
    group.nodes.sort(key=index.__getitem__)
    return group


def reaches(
    start: list[Node],
    targets: set[Node],
    consumers: dict[Value, list[Node]],
    index: dict[Node, int],
    limit: int,
) -> bool:
    """Whether a path leads from ``start`` to a node of ``targets`` (none lies after ``limit``)."""
    seen: set[Node] = set()
    stack = list(start)
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen or index[n] > limit:
            continue
        seen.add(n)
        for v in n.outputs:
            if v is not None:
                stack.extend(consumers.get(v, []))
    return False


def closes_cycle(
    group: Group, grouped: dict[Node, Group], consumers: dict[Value, list[Node]]
) -> bool:
    """Whether a path leads from ``group``'s outputs back into it once every group is one node.

    ``grouped`` maps the nodes of the groups accepted so far to their group: reaching one of its
    nodes reaches all of its outputs.
    """
    members = set(group.nodes)
    stack = [c for v in group.outputs for c in consumers.get(v, []) if c not in members]
    seen: set[Node] = set()
    while stack:
        n = stack.pop()
        if n in members:
            return True
        if n in seen:
            continue
        unit = grouped[n].nodes if n in grouped else [n]
        seen.update(unit)
        stack.extend(
            c for m in unit for v in m.outputs if v is not None for c in consumers.get(v, [])
        )
    return False


def replace_group(graph: Graph, group: Group, k: int, producers: dict[Value, Node]) -> Rewrite:
    """The Rewrite that swaps ``group`` for one Pointwise node holding it as its body."""
    body, inputs = make_body(graph, group, k, producers)
    fused = Node(
        "Pointwise",
        inputs,
        list(group.outputs),
        {"body": body},
        domain=DOMAIN,
        name=f"{group.root.name or 'pointwise'}_pointwise",
    )
    return Rewrite(remove=list(group.nodes), add=[fused], count=1)


def make_body(
    graph: Graph, group: Group, k: int, producers: dict[Value, Node]
) -> tuple[Graph, list[Value]]:
    """(body graph over fresh Values, the outer values bound to its inputs in order).

    Body values are prefixed ``pw<k>/`` so that no name of the body shadows one of the graph
    (ONNX forbids it in subgraphs; the printer and IR dumps stay unambiguous).
    """
    mapping: dict[Value, Value] = {}
    inputs: list[Value] = []
    body = Graph(name=f"pointwise_{k}", opsets=dict(graph.opsets))
    prefix = f"pw{k}/"
    produced = {n.outputs[0] for n in group.nodes}
    for node in group.nodes:
        for v in node.inputs:
            if v is None or v in produced or v in mapping:
                continue
            data = const_value(v, producers)
            fresh = Value(prefix + v.name, v.type, const=data)
            if data is not None:
                fresh.type = TensorType(DType.from_numpy(data.dtype), data.shape)
                body.initializers.append(fresh)
            else:
                inputs.append(v)
                body.inputs.append(fresh)
            mapping[v] = fresh
        for v in node.outputs:
            mapping[v] = Value(prefix + v.name, v.type)
        body.nodes.append(_copy(node, mapping))
    body.outputs = [mapping[v] for v in group.outputs]
    return body, inputs


def _copy(node: Node, mapping: dict[Value, Value]) -> Node:
    return Node(
        node.op,
        [None if v is None else mapping[v] for v in node.inputs],
        [None if v is None else mapping[v] for v in node.outputs],
        dict(node.attrs),
        node.domain,
        node.name,
    )


def drop_unread_constants(graph: Graph, candidates: list[Value]) -> None:
    """Remove the initializers and Constant nodes among ``candidates``' sources that the fused
    groups took into their bodies and nothing else reads any more."""
    read = set(graph.consumers()) | set(graph.outputs)
    gone = {v for v in candidates if v not in read}
    graph.initializers = [v for v in graph.initializers if v not in gone]
    graph.nodes = [
        n
        for n in graph.nodes
        if not (n.op == "Constant" and n.domain == "" and n.outputs[0] in gone)
    ]
