"""Attribute defaults per opset, read from ONNX's schemas (as onnx's reference evaluator does)."""

from __future__ import annotations

import functools
from typing import Any

import onnx
from onnx import helper


def schema_defaults(op: str, domain: str, opset: int) -> dict[str, Any]:
    """The defaults of ``op``'s attributes in the schema ``opset`` selects, as node attributes
    hold them (ints, floats, strings, lists); {} for an op without a schema at that opset.

    The dict is a fresh copy: callers may change it."""
    return {k: list(v) if isinstance(v, list) else v for k, v in _cached(op, domain, opset)}


@functools.lru_cache(maxsize=4096)
def _cached(op: str, domain: str, opset: int) -> tuple[tuple[str, Any], ...]:
    try:
        schema = onnx.defs.get_schema(op, max(int(opset), 1), domain)
    except onnx.defs.SchemaError:
        return ()
    out = []
    for name, attr in sorted(schema.attributes.items()):
        proto = attr.default_value
        if proto is None or proto.type == onnx.AttributeProto.UNDEFINED:
            continue  # required, or optional without a default
        out.append((name, _value(helper.get_attribute_value(proto))))
    return tuple(out)


def _value(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, list):
        return [_value(x) for x in v]
    return v


def since_version(op: str, domain: str, opset: int) -> int | None:
    """The opset the schema of ``op`` that ``opset`` selects was introduced in (None: no schema)."""
    try:
        return int(onnx.defs.get_schema(op, max(int(opset), 1), domain).since_version)
    except onnx.defs.SchemaError:
        return None
