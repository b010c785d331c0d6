"""IR graph <-> plain JSON data plus a dict of named arrays (no pickle, no code).

Values are numbered in one pass over the graph and its subgraphs; nodes and graphs refer to them by
number. Arrays (constants and tensor attributes) go to the returned tensor dict under keys the JSON
names; string tensors, which safetensors cannot hold, stay in the JSON as lists.

:func:`graph_from_json` validates as it reads: every reference, type and attribute kind is checked,
so a damaged or hand-edited plan is rejected with :class:`EngineFormatError` instead of producing a
broken graph.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import onnx

from tensorkiln.engine.schema import is_dim, printable, show
from tensorkiln.errors import EngineFormatError
from tensorkiln.ir import DType, Graph, Node, OptionalType, SequenceType, TensorType, Type, Value
from tensorkiln.ir.graph import FORMATS, PRECISIONS

# ----------------------------------------------------------------------------------- writing


class _Writer:
    def __init__(self) -> None:
        self.ids: dict[Value, int] = {}
        self.tensors: dict[str, np.ndarray] = {}

    def value_id(self, v: Value) -> int:
        if v not in self.ids:
            self.ids[v] = len(self.ids)
        return self.ids[v]

    def array(self, key: str, arr: np.ndarray) -> dict:
        arr = np.asarray(arr)
        if arr.dtype == object:
            return {"strings": [str(s) for s in arr.reshape(-1)], "shape": list(arr.shape)}
        self.tensors[key] = np.asarray(arr, order="C")  # keeps 0-d arrays 0-d
        return {"tensor": key}

    def graph(self, g: Graph, path: str) -> dict:
        defined = [*g.inputs, *g.initializers]
        for n in g.nodes:
            defined.extend(v for v in n.outputs if v is not None)
        values = []
        for v in dict.fromkeys(defined):
            entry: dict[str, Any] = {
                "id": self.value_id(v),
                "name": v.name,
                "type": type_to_json(v.type),
            }
            if v.const is not None:
                entry["const"] = self.array(f"{path}const/{v.name}", v.const)
            values.append(entry)
        nodes = [self.node(n, f"{path}{i}/") for i, n in enumerate(g.nodes)]
        return {
            "name": g.name,
            "values": values,
            "inputs": [self.value_id(v) for v in g.inputs],
            "initializers": [self.value_id(v) for v in g.initializers],
            "outputs": [self.value_id(v) for v in g.outputs],
            "nodes": nodes,
        }

    def node(self, n: Node, path: str) -> dict:
        d = {
            "op": n.op,
            "domain": n.domain,
            "name": n.name,
            "inputs": [None if v is None else self.value_id(v) for v in n.inputs],
            "outputs": [None if v is None else self.value_id(v) for v in n.outputs],
            "attrs": {k: self.attr(v, f"{path}{k}") for k, v in n.attrs.items()},
        }
        # the precision policy's per-layer choices, where it made them
        d.update({k: x for k, x in (("precision", n.precision), ("format", n.format)) if x})
        return d

    def attr(self, v: Any, path: str) -> dict:
        if isinstance(v, bool | int | np.integer):
            return {"int": int(v)}
        if isinstance(v, float | np.floating):
            return {"float": float(v)}
        if isinstance(v, str):
            return {"str": v}
        if isinstance(v, np.ndarray):
            return {"array": self.array(path, v)}
        if isinstance(v, Graph):
            return {"graph": self.graph(v, path + "/")}
        if isinstance(v, onnx.TypeProto):
            return {"type_proto": base64.b64encode(v.SerializeToString()).decode()}
        if isinstance(v, list | tuple):
            return {"list": [self.attr(x, f"{path}/{i}") for i, x in enumerate(v)]}
        raise EngineFormatError(f"attribute value of type {type(v).__name__} cannot be stored")


def type_to_json(t: Type | None) -> dict | None:
    if t is None:
        return None
    if isinstance(t, TensorType):
        return {
            "tensor": t.dtype.name if t.dtype is not None else None,
            "shape": None if t.shape is None else list(t.shape),
        }
    if isinstance(t, SequenceType):
        return {"sequence": type_to_json(t.elem)}
    return {"optional": type_to_json(t.elem)}


def graph_to_json(graph: Graph) -> tuple[dict, dict[str, np.ndarray], dict[Value, int]]:
    """(plan dict, tensors, value ids) for ``graph``."""
    w = _Writer()
    data = w.graph(graph, "")
    data["opsets"] = dict(graph.opsets)
    return data, w.tensors, w.ids


# ----------------------------------------------------------------------------------- reading


def _fail(where: str, what: str) -> EngineFormatError:
    # (names in ``where`` and ``what`` come from the file: shown escaped)
    return EngineFormatError(printable(f"engine plan is damaged at {where}: {what}"))


def _expect(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise _fail(where, what)


def _get(d: Any, key: str, kind: type | tuple, where: str) -> Any:
    _expect(isinstance(d, dict), where, "expected an object")
    _expect(key in d, where, f"missing '{key}'")
    v = d[key]
    ok = isinstance(v, kind) and not (isinstance(v, bool) and kind in (int, (int,)))
    _expect(
        ok,
        f"{where}.{key}",
        f"expected {getattr(kind, '__name__', kind)}, found {type(v).__name__}",
    )
    return v


def type_from_json(d: Any, where: str) -> Type | None:
    if d is None:
        return None
    _expect(isinstance(d, dict) and len(d) >= 1, where, "bad type")
    if "tensor" in d:
        dt = d["tensor"]
        _expect(
            dt is None or (isinstance(dt, str) and dt in DType.__members__),
            where,
            f"unknown dtype {dt!r}",
        )
        shape = d.get("shape")
        if shape is not None:
            _expect(isinstance(shape, list), where, "shape is not a list")
            for s in shape:
                _expect(is_dim(s) or isinstance(s, str), where, f"bad dimension {show(s)}")
            shape = tuple(shape)
        return TensorType(DType[dt] if dt else None, shape)
    if "sequence" in d:
        return SequenceType(type_from_json(d["sequence"], where))
    if "optional" in d:
        return OptionalType(type_from_json(d["optional"], where))
    raise _fail(where, "unknown type kind")


class _Reader:
    def __init__(self, tensors: dict[str, np.ndarray], opsets: dict[str, int]) -> None:
        self.tensors = tensors
        self.opsets = opsets
        self.values: dict[int, Value] = {}
        self.used_tensors: set[str] = set()

    def array(self, d: Any, where: str) -> np.ndarray:
        _expect(isinstance(d, dict), where, "expected an array reference")
        if "strings" in d:
            strings = _get(d, "strings", list, where)
            shape = _get(d, "shape", list, where)
            _expect(
                all(isinstance(s, str) for s in strings), where, "non-string in a string tensor"
            )
            _expect(all(is_dim(x) for x in shape), where, "bad shape")
            _expect(math.prod(shape) == len(strings), where, "string count does not match shape")
            return np.array(strings, dtype=object).reshape(shape)
        key = _get(d, "tensor", str, where)
        _expect(key in self.tensors, where, f"tensor '{key}' is missing from the weights")
        self.used_tensors.add(key)
        return self.tensors[key]

    def graph(self, d: Any, where: str) -> Graph:
        name = _get(d, "name", str, where)
        where = f"{where}graph '{name}'"
        for i, vd in enumerate(_get(d, "values", list, where)):
            vw = f"{where}.values[{i}]"
            vid = _get(vd, "id", int, vw)
            _expect(vid not in self.values, vw, f"value id {vid} is defined twice")
            v = Value(_get(vd, "name", str, vw), type_from_json(vd.get("type"), vw))
            if "const" in vd:
                v.const = self.array(vd["const"], vw)
                t = v.type
                if isinstance(t, TensorType):
                    _expect(
                        t.shape is None or tuple(t.shape) == v.const.shape,
                        vw,
                        f"constant '{v.name}' has shape {list(v.const.shape)}, plan says {list(t.shape or [])}",
                    )
                    _expect(
                        t.dtype is None
                        or v.const.dtype == object
                        or t.dtype.numpy == v.const.dtype,
                        vw,
                        f"constant '{v.name}' has dtype {v.const.dtype}, plan says {t.dtype and t.dtype.name}",
                    )
            self.values[vid] = v
        g = Graph(name=name, opsets=self.opsets)
        g.inputs = [self.ref(x, f"{where}.inputs") for x in _get(d, "inputs", list, where)]
        g.initializers = [
            self.ref(x, f"{where}.initializers") for x in _get(d, "initializers", list, where)
        ]
        _expect(all(v.const is not None for v in g.initializers), where, "initializer without data")
        g.nodes = [
            self.node(nd, f"{where}.nodes[{i}]")
            for i, nd in enumerate(_get(d, "nodes", list, where))
        ]
        g.outputs = [self.ref(x, f"{where}.outputs") for x in _get(d, "outputs", list, where)]
        return g

    def ref(self, x: Any, where: str) -> Value:
        _expect(isinstance(x, int) and not isinstance(x, bool), where, f"bad value reference {x!r}")
        _expect(x in self.values, where, f"value id {x} is not defined")
        return self.values[x]

    def node(self, d: Any, where: str) -> Node:
        op = _get(d, "op", str, where)
        domain = _get(d, "domain", str, where)
        name = _get(d, "name", str, where)
        ins = [
            None if x is None else self.ref(x, f"{where}.inputs")
            for x in _get(d, "inputs", list, where)
        ]
        outs = [
            None if x is None else self.ref(x, f"{where}.outputs")
            for x in _get(d, "outputs", list, where)
        ]
        attrs_d = _get(d, "attrs", dict, where)
        attrs = {k: self.attr(v, f"{where}.attrs.{k}") for k, v in attrs_d.items()}
        if op in _VALUE_OPS and domain in ("", "ai.onnx") and outs and outs[0] is not None:
            _check_value_attr(attrs.get("value"), outs[0], where)
        precision = _layer_field(d, "precision", PRECISIONS, where)
        layout = _layer_field(d, "format", FORMATS, where)
        return Node(op, ins, outs, attrs, domain, name, precision, layout)

    def attr(self, d: Any, where: str) -> Any:
        _expect(isinstance(d, dict) and len(d) == 1, where, "bad attribute")
        ((kind, v),) = d.items()
        if kind == "int":
            _expect(isinstance(v, int) and not isinstance(v, bool), where, "not an int")
            return v
        if kind == "float":
            _expect(isinstance(v, float | int) and not isinstance(v, bool), where, "not a float")
            return float(v)
        if kind == "str":
            _expect(isinstance(v, str), where, "not a string")
            return v
        if kind == "array":
            return self.array(v, where)
        if kind == "graph":
            return self.graph(v, where + ":")
        if kind == "type_proto":
            _expect(isinstance(v, str), where, "not a type")
            try:
                return onnx.TypeProto.FromString(base64.b64decode(v, validate=True))
            except Exception:  # malformed base64 or protobuf
                raise _fail(where, "type attribute does not decode") from None
        if kind == "list":
            _expect(isinstance(v, list), where, "not a list")
            return [self.attr(x, f"{where}[{i}]") for i, x in enumerate(v)]
        raise _fail(where, f"unknown attribute kind '{kind}'")


def _layer_field(d: dict, key: str, known: tuple[str, ...], where: str) -> str | None:
    """A node's recorded precision or format: absent (engines written before they were recorded,
    and nodes no policy decided), or one of the ``known`` names."""
    if key not in d:
        return None
    x = d[key]
    _expect(
        isinstance(x, str) and x in known,
        f"{where}.{key}",
        f"{show(x)} is not a known {key} (one of {', '.join(known)}); rebuild the engine",
    )
    return x


# Ops whose output takes its element type from the tensor attribute 'value'.
_VALUE_OPS = ("Constant", "ConstantOfShape")


def _check_value_attr(value: Any, out: Value, where: str) -> None:
    """The 'value' tensor must have the dtype its output declares.

    Types safetensors lacks (float8, int4, ...) are stored as bytes and typed by the tensor table
    alone; an attribute tensor has no declared type elsewhere to compare with, except this one.
    """
    t = out.type
    if not isinstance(value, np.ndarray) or not isinstance(t, TensorType) or t.dtype is None:
        return
    _expect(
        value.dtype == t.dtype.numpy,
        f"{where}.attrs.value",
        f"tensor of dtype {value.dtype}, but output '{out.name}' is declared {t.dtype.name}",
    )


def graph_from_json(
    data: Any, tensors: dict[str, np.ndarray], precision: str | None = None
) -> tuple[Graph, dict[int, Value]]:
    """Rebuild a graph from :func:`graph_to_json`'s output, validating every reference.

    ``precision`` is the engine-wide one: layers that record none (in engines written before
    layers recorded their own) take it, and the linear format every layer used then."""
    opsets = _get(data, "opsets", dict, "plan")
    for k, v in opsets.items():
        _expect(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool),
            "plan.opsets",
            "bad opset",
        )
    reader = _Reader(tensors, dict(opsets))
    graph = reader.graph(data, "")
    if precision is not None:
        _expect(
            precision in PRECISIONS, "plan.build.precision", f"unknown precision {show(precision)}"
        )
        _default_layer_fields(graph, precision)
    unused = set(tensors) - reader.used_tensors
    _expect(not unused, "weights", f"tensors not referenced by the plan: {sorted(unused)[:3]}")
    return graph, reader.values


def _default_layer_fields(graph: Graph, precision: str) -> None:
    """Layers (top-level nodes) without a recorded precision or format take the engine's."""
    for n in graph.nodes:
        if n.precision is None:
            n.precision = precision
        if n.format is None:
            n.format = "linear"
