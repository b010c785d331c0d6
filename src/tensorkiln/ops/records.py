"""Op records: one per (domain, op), holding what the rest of the code needs to know about an op.

A record keeps the op's traits (elementwise, reduction, random, shape, ...), its native shape rule
(when it has one; ops without one fall back to ONNX's schema inference) and, for ops outside ONNX's
schemas (the ``tensorkiln`` domain's fused ops), the attribute defaults declared in code. Attribute
defaults of ONNX ops are read from ONNX's schemas per opset (:mod:`tensorkiln.ops.schema`), never
copied here.

Records are kept in a plain dict filled by :func:`define` at import of :mod:`tensorkiln.ops`;
:func:`get` answers for any (domain, op), creating a bare record for an ONNX op that has a schema but
nothing declared about it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx

from tensorkiln.ops.schema import schema_defaults

if TYPE_CHECKING:
    from tensorkiln.ir.graph import Type
    from tensorkiln.ops.shape_rules import InferContext

Rule = Callable[["InferContext"], list["Type | None"]]

DEFAULT_DOMAIN = ""
_DOMAIN_ALIASES = {"ai.onnx": ""}

# Traits. An op may have several.
ELEMENTWISE = "elementwise"  # each output element depends on the same-index input elements only
REDUCTION = "reduction"  # reduces axes of its input (ReduceSum, ArgMax, ...)
RANDOM = "random"  # draws random numbers: never evaluated ahead of time, never merged
SHAPE = "shape"  # computes or rearranges shape metadata only (Shape, Reshape, Squeeze, ...)
CONTROL = "control"  # runs subgraphs (If, Loop, Scan, SequenceMap)
BOUNDED = "bounded"  # output size depends on input values, never more than a small multiple
# of the inputs' (NonZero, Unique, Compress)
FUSED = "fused"  # a fused op of the tensorkiln domain, made by the optimizer


def normalize_domain(domain: str | None) -> str:
    """Map the spellings of the default ONNX domain ('' and 'ai.onnx') to ''."""
    domain = domain or ""
    return _DOMAIN_ALIASES.get(domain, domain)


@dataclass(slots=True, eq=False)
class OpRecord:
    """What is known about one (domain, op), whatever backend runs it."""

    op: str
    domain: str = DEFAULT_DOMAIN
    traits: frozenset[str] = frozenset()
    shape_rule: Rule | None = None
    # Declared attribute defaults, for ops that have no ONNX schema (None: read the schema).
    attributes: dict[str, Any] | None = None
    # Schema defaults replaced, where a schema's default cannot be used as written (each with its
    # reason where it is declared, in tensorkiln.ops.onnx_ops).
    overrides: dict[str, Any] | None = None
    doc: str = ""
    # the version of the plugin (tensorkiln.plugin) that defines this op; None: not a plugin
    plugin_version: str | None = None

    def has(self, trait: str) -> bool:
        """Whether the op has ``trait`` (one of the trait constants of this module)."""
        return trait in self.traits

    def defaults(self, opset: int) -> dict[str, Any]:
        """The op's attribute defaults at ``opset``: declared ones, or its ONNX schema's."""
        if self.attributes is not None:
            return dict(self.attributes)
        defaults = schema_defaults(self.op, self.domain, opset)
        if self.overrides:
            defaults.update((k, v) for k, v in self.overrides.items() if k in defaults)
        return defaults


_RECORDS: dict[tuple[str, str], OpRecord] = {}


def define(
    ops: str | Iterable[str],
    *,
    domain: str = DEFAULT_DOMAIN,
    traits: Iterable[str] = (),
    attributes: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    doc: str = "",
) -> list[OpRecord]:
    """Declare the records of ``ops`` (or add ``traits`` to records already declared)."""
    names = [ops] if isinstance(ops, str) else list(ops)
    domain = normalize_domain(domain)
    made = []
    for op in names:
        rec = _RECORDS.get((domain, op))
        if rec is None:
            rec = _RECORDS[(domain, op)] = OpRecord(op, domain)
        rec.traits = rec.traits | frozenset(traits)
        if attributes is not None:
            rec.attributes = dict(attributes)
        if overrides is not None:
            rec.overrides = dict(overrides)
        if doc:
            rec.doc = doc
        made.append(rec)
    return made


def rule(*ops: str, domain: str = DEFAULT_DOMAIN) -> Callable[[Rule], Rule]:
    """Decorator: ``fn`` is the native shape rule of ``ops`` (their records are declared if new)."""

    def decorator(fn: Rule) -> Rule:
        for rec in define(ops, domain=domain):
            rec.shape_rule = fn
        return fn

    return decorator


def get(op: str, domain: str = DEFAULT_DOMAIN) -> OpRecord | None:
    """The record of ``op`` in ``domain``; None for an op that is neither declared nor in ONNX's
    schemas (a custom op no backend knows)."""
    domain = normalize_domain(domain)
    rec = _RECORDS.get((domain, op))
    if rec is None and onnx.defs.has(op, domain):
        rec = _RECORDS.setdefault((domain, op), OpRecord(op, domain))
    return rec


def known(op: str, domain: str = DEFAULT_DOMAIN) -> bool:
    """Whether ``op`` of ``domain`` is an op tensorkiln or ONNX's schemas define."""
    return get(op, domain) is not None


def has_trait(op: str, domain: str, trait: str) -> bool:
    """Whether ``op`` of ``domain`` has ``trait`` (False for an unknown op)."""
    rec = _RECORDS.get((normalize_domain(domain), op))
    return rec is not None and trait in rec.traits


def with_trait(trait: str, domain: str = DEFAULT_DOMAIN) -> frozenset[str]:
    """The names of the ops of ``domain`` that have ``trait``."""
    domain = normalize_domain(domain)
    return frozenset(op for (d, op), rec in _RECORDS.items() if d == domain and trait in rec.traits)


def shape_rule(op: str, domain: str = DEFAULT_DOMAIN) -> Rule | None:
    """The native shape rule of ``op``, or None (ONNX's schema inference applies)."""
    rec = _RECORDS.get((normalize_domain(domain), op))
    return None if rec is None else rec.shape_rule
