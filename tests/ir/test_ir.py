"""IR basics: dims arithmetic, toposort, verifier, printer."""

from __future__ import annotations

import numpy as np
import pytest

from tensorkiln.errors import GraphError
from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.ir.dims import broadcast_shapes, dim_divide, dim_product
from tensorkiln.ir.printer import format_graph
from tensorkiln.ir.toposort import toposort
from tensorkiln.ir.verify import verify


def test_dim_products_and_division_are_symbolic():
    assert dim_product(["N", 128]) == "128*N"
    assert dim_product([2, 3, 4]) == 24
    assert dim_divide("128*N", 128) == "N"
    assert dim_divide(dim_product(["N", "S", 768]), dim_product(["S", 12])) == "64*N"
    assert dim_divide("N", 3) is None


def test_broadcast_keeps_symbols_and_rejects_mismatch():
    assert broadcast_shapes(("N", 1, 4), (3, 1)) == ("N", 3, 4)
    assert broadcast_shapes(("N", 4), ("N", 1)) == ("N", 4)
    with pytest.raises(ValueError, match="do not broadcast"):
        broadcast_shapes((2, 3), (4, 3))


def test_dtypes_round_trip_numpy():
    for dt in DType:
        if dt is DType.STRING:
            continue
        assert DType.from_numpy(dt.numpy) is dt


def _chain() -> tuple[Graph, list[Node]]:
    x = Value("x", TensorType(DType.FLOAT, ("N", 4)))
    a, b, c = Value("a"), Value("b"), Value("c")
    n1 = Node("Relu", [x], [a], name="n1")
    n2 = Node("Neg", [a], [b], name="n2")
    n3 = Node("Add", [a, b], [c], name="n3")
    g = Graph("g", inputs=[x], outputs=[c], nodes=[n3, n1, n2], opsets={"": 17})
    return g, [n1, n2, n3]


def test_toposort_orders_and_verify_accepts():
    g, expected = _chain()
    with pytest.raises(GraphError, match="not defined before"):
        verify(g)
    g.nodes = toposort(g)
    assert g.nodes == expected
    verify(g)


def test_toposort_detects_cycles():
    x = Value("x", TensorType(DType.FLOAT, (2,)))
    a, b = Value("a"), Value("b")
    n1 = Node("Add", [x, b], [a], name="n1")
    n2 = Node("Relu", [a], [b], name="n2")
    with pytest.raises(GraphError, match="cycle"):
        toposort(Graph("g", [x], [b], [n1, n2]))


def test_verify_rejects_double_definition_and_bad_constants():
    g, nodes = _chain()
    g.nodes = nodes
    nodes[1].outputs = [nodes[0].outputs[0]]
    with pytest.raises(GraphError, match="defined twice"):
        verify(g)
    w = Value("w", TensorType(DType.FLOAT, (2, 2)), const=np.ones((3,), np.float32))
    with pytest.raises(GraphError, match="holds shape"):
        verify(Graph("g", [], [w], [], [w]))


def test_printer_shows_types_ops_and_attrs():
    g, nodes = _chain()
    g.nodes = nodes
    nodes[0].attrs["alpha"] = 0.5
    text = format_graph(g)
    assert "in  %x: f32[N,4]" in text
    assert "= Relu(%x) {alpha=0.5}  # n1" in text
    assert "out %c" in text
