"""Topological ordering of a graph's nodes."""

from __future__ import annotations

import heapq

from tensorkiln.errors import GraphError
from tensorkiln.ir.graph import Graph, Node, node_reads


def toposort(graph: Graph) -> list[Node]:
    """The graph's nodes in an order where every node comes after the producers of what it reads.

    Stable: nodes keep their file order wherever the dependencies allow. Raises GraphError on a cycle.
    """
    producer = graph.producers()
    index = {n: i for i, n in enumerate(graph.nodes)}
    deps: dict[Node, set[Node]] = {}
    users: dict[Node, list[Node]] = {n: [] for n in graph.nodes}
    for n in graph.nodes:
        deps[n] = {producer[v] for v in node_reads(n) if v in producer and producer[v] is not n}
        for d in deps[n]:
            users[d].append(n)
    if all(index[d] < index[n] for n in graph.nodes for d in deps[n]):
        return list(graph.nodes)
    ready = [index[n] for n in graph.nodes if not deps[n]]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        n = graph.nodes[heapq.heappop(ready)]
        order.append(n)
        for u in users[n]:
            deps[u].discard(n)
            if not deps[u]:
                heapq.heappush(ready, index[u])
    if len(order) != len(graph.nodes):
        stuck = [n.name for n in graph.nodes if deps[n]][:5]
        raise GraphError(f"graph '{graph.name}' has a cycle through nodes {', '.join(stuck)}")
    return order
