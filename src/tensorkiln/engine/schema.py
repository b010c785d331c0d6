"""The plan's JSON, described once as data and checked by type and range when an engine is read.

Every section of the plan (target, io, profiles, layers, memory, source, build, the tensor table)
is a :class:`Spec` below; :func:`check_plan` runs them all before anything reads the plan, so every
consumer (``Engine.load``, ``read_plan``, ``tensorkiln inspect``, ``build --from-engine``) sees
checked data: no ``Infinity`` where an int belongs, no list where a name belongs. The graph has
its own validating reader (engine/serialize.py), which uses the same bounds (:func:`is_dim`).

Objects accept keys they do not know (a later tensorkiln may record more; nobody here reads them),
but every key they know must have the right type and range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorkiln.errors import EngineFormatError
from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import FORMATS, PRECISIONS

# Sizes, dims and counts must fit an int64, as they do in ONNX, numpy and torch.
MAX_INT = 2**63 - 1


def is_dim(x: Any) -> bool:
    """A non-negative int that fits an int64 (not a bool, not a float)."""
    return type(x) is int and 0 <= x <= MAX_INT


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on (ESC, BEL, other controls, line
    breaks, bidirectional overrides) written as a Python escape: names from a file are shown,
    never obeyed."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def show(x: Any) -> str:
    """A short, printable description of a value found in a file, for messages."""
    text = printable(repr(x))
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(x), "null" if x is None else f"the number {show(x)}"
    )


class PlanError(Exception):
    """Where in the plan (a path such as ``layers[3].name``) and what is wrong."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what


class Spec:
    """What one JSON value must be; :meth:`check` raises PlanError naming where it is not."""

    def check(self, x: Any, where: str) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Spec):
    lo: int = 0
    hi: int = MAX_INT

    def check(self, x: Any, where: str) -> None:
        if type(x) is not int:  # bool is a subclass of int; JSON's 1.0 is a float
            raise PlanError(where, f"expected an integer, found {_kind(x)}")
        if not self.lo <= x <= self.hi:
            raise PlanError(where, f"{show(x)} is outside {self.lo}..{self.hi}")


@dataclass(frozen=True)
class Float(Spec):
    """A finite number (ints too), at least ``lo``."""

    lo: float = -math.inf

    def check(self, x: Any, where: str) -> None:
        if type(x) not in (int, float) or not math.isfinite(x):
            raise PlanError(where, f"expected a finite number, found {_kind(x)}")
        if x < self.lo:
            raise PlanError(where, f"{show(x)} is below {self.lo}")


@dataclass(frozen=True)
class Str(Spec):
    choices: tuple[str, ...] = ()

    def check(self, x: Any, where: str) -> None:
        if not isinstance(x, str):
            raise PlanError(where, f"expected a string, found {_kind(x)}")
        if self.choices and x not in self.choices:
            raise PlanError(where, f"{show(x)} is not one of the known names")


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, x: Any, where: str) -> None:
        if not isinstance(x, bool):
            raise PlanError(where, f"expected true or false, found {_kind(x)}")


@dataclass(frozen=True)
class Null(Spec):
    def check(self, x: Any, where: str) -> None:
        if x is not None:
            raise PlanError(where, f"expected null, found {_kind(x)}")


@dataclass(frozen=True)
class OneOf(Spec):
    """The first of ``options`` that accepts the value; ``what`` names them all for messages."""

    options: tuple[Spec, ...]
    what: str

    def check(self, x: Any, where: str) -> None:
        errors = []
        for spec in self.options:
            try:
                spec.check(x, where)
                return
            except PlanError as exc:
                errors.append(exc)
        # The option of the right kind says best what is wrong: its error is deeper in the value
        # (a bad dim in a shape) or about the value rather than its kind (an unknown name).
        best = max(errors, key=lambda e: (_depth(e.where), not e.what.startswith("expected")))
        if best.where != where or not best.what.startswith("expected"):
            raise best
        raise PlanError(where, f"expected {self.what}, found {_kind(x)}")


def _depth(where: str) -> int:
    return where.count("[") + where.count(".")


def nullable(spec: Spec, what: str) -> Spec:
    return OneOf((Null(), spec), f"{what} or null")


@dataclass(frozen=True)
class List(Spec):
    item: Spec

    def check(self, x: Any, where: str) -> None:
        if not isinstance(x, list):
            raise PlanError(where, f"expected a list, found {_kind(x)}")
        for i, v in enumerate(x):
            self.item.check(v, f"{where}[{i}]")


@dataclass(frozen=True)
class Tuple(Spec):
    """A list of fixed length, each position with its own spec."""

    items: tuple[Spec, ...]

    def check(self, x: Any, where: str) -> None:
        if not isinstance(x, list) or len(x) != len(self.items):
            found = f"a list of {len(x)}" if isinstance(x, list) else _kind(x)
            raise PlanError(where, f"expected a list of {len(self.items)}, found {found}")
        for i, (spec, v) in enumerate(zip(self.items, x)):
            spec.check(v, f"{where}[{i}]")


@dataclass(frozen=True)
class Map(Spec):
    """An object with any keys (names), each value of one spec."""

    value: Spec

    def check(self, x: Any, where: str) -> None:
        if not isinstance(x, dict):
            raise PlanError(where, f"expected an object, found {_kind(x)}")
        for k, v in x.items():
            self.value.check(v, f"{where}[{show(k)}]")


@dataclass(frozen=True)
class Obj(Spec):
    """An object with known keys: ``required`` must be there, ``optional`` may be."""

    required: Mapping[str, Spec] = field(default_factory=dict)
    optional: Mapping[str, Spec] = field(default_factory=dict)

    def check(self, x: Any, where: str) -> None:
        if not isinstance(x, dict):
            raise PlanError(where, f"expected an object, found {_kind(x)}")
        for key in self.required:
            if key not in x:
                raise PlanError(where, f"'{key}' is missing")
        for key, v in x.items():
            spec = self.required.get(key) or self.optional.get(key)
            if spec is not None:
                spec.check(v, f"{where}.{key}")


# ------------------------------------------------------------------------------------ the plan
COUNT = Int()
NAME = Str()
NAMES = List(NAME)
SECONDS = Float(lo=0.0)
DTYPE = Str(tuple(DType.__members__))
PRECISION = Str(PRECISIONS)
SHAPE = List(COUNT)  # concrete dims
DECLARED_SHAPE = nullable(List(OneOf((COUNT, NAME), "a dim (int or name)")), "a shape")

IO_ENTRY = Obj({"name": NAME, "dtype": nullable(DTYPE, "an element type"), "shape": DECLARED_SHAPE})
PROFILE = Map(Obj({"min": SHAPE, "opt": SHAPE, "max": SHAPE}))
LAYER = Obj(
    optional={
        "name": NAME,
        "op": NAME,
        "impl": NAME,
        "precision": NAME,  # the output's element type ("f16"), as before layers recorded more
        # the precision policy's choices (the node records them too); absent in older engines
        "compute_precision": PRECISION,
        "format": Str(FORMATS),
        "inputs": NAMES,
        "outputs": NAMES,
        "tactic": NAME,
        "candidates": NAMES,
        "timings_ms": Map(SECONDS),
        "tactic_eager": NAME,
        "timings_eager_ms": Map(SECONDS),
        "rejected": Map(Str()),
        "pruned": NAMES,
        "cached": Bool(),
        "tune_s": SECONDS,
        "fallback": Str(),  # why tuning kept the default kernel
    }
)
BUFFER = Tuple((NAME, COUNT, COUNT, COUNT, COUNT))  # [value name, offset, size, first, last]
MEMORY = Obj(
    optional={
        "alignment": Int(lo=1),
        "peak_bytes": COUNT,
        "naive_bytes": COUNT,
        "buffers": List(BUFFER),
        "dynamic": NAMES,
    }
)
SOURCE = Obj(optional={"name": nullable(NAME, "a file name"), "sha256": NAME, "embedded": Bool()})
BUILD_CONFIG = Obj(
    optional={
        "precisions": NAMES,
        "optimization_level": Int(0, 5),
        "memory_limit": nullable(COUNT, "a byte count"),
        "timing_cache": nullable(NAME, "a file name"),
        "tactic_sources": nullable(NAMES, "a list of names"),
        "layer_precisions": Map(PRECISION),
    }
)
BUILD = Obj(
    optional={
        "config": BUILD_CONFIG,
        "phases_s": Map(SECONDS),
        "passes": Map(COUNT),
        "nodes_before": COUNT,
        "precision": PRECISION,  # engine-wide: the math mode, and what older engines' layers take
        "timing_cache": Map(COUNT),
        "notes": NAMES,
    }
)
SCALAR = OneOf((Str(), Int(-MAX_INT - 1), Float(), Bool(), Null()), "a string or a number")
TENSOR_ENTRY = Obj({"dtype": DTYPE, "shape": SHAPE, "sha256": NAME})
PLAN = Obj(
    {
        "format_version": Int(),
        "tensorkiln_version": NAME,
        "backend": NAME,
        "target": Map(SCALAR),
        "io": Obj({"inputs": List(IO_ENTRY), "outputs": List(IO_ENTRY)}),
        "profiles": List(PROFILE),
        "layers": List(LAYER),
        "memory": MEMORY,
        "source": SOURCE,
        "build": BUILD,
        "graph": Obj(),  # its content: serialize.graph_from_json, which validates as it reads
        "tensors": Map(TENSOR_ENTRY),
    },
    # the plugins (tensorkiln.plugin) the graph uses, by name and version; absent: none
    optional={"plugins": List(Obj({"name": NAME, "version": NAME}))},
)


def check_plan(plan: Any, where: str) -> None:
    """Raise EngineFormatError naming the first field of ``plan`` of the wrong type or range."""
    try:
        PLAN.check(plan, "plan")
    except PlanError as exc:
        raise EngineFormatError(
            f"{where}: the plan is damaged at {exc.where}: {exc.what}; the file was not written "
            "by tensorkiln or was edited since (rebuild the engine)"
        ) from None
