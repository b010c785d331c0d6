"""One Triton kernel generated from a tensorkiln.Pointwise body.

The body (an ir.Graph of elementwise ops, see :mod:`tensorkiln.kernels.reference.fused_pointwise`)
becomes the source of one kernel: each input is loaded once, the body's ops are ``tl`` expressions,
each output is stored once. Float16 and bfloat16 values are computed in float32 and rounded at the
store (a Cast to a narrow float inside the body rounds there too); integers and bools keep their
type. Float64 bodies are left to the default kernel.

Layout: the output's broadcast shape is collapsed at run time into as few dims as the inputs' and
outputs' strides allow (a same-shape body is one flat dim; a bias add is ``[rows, cols]``), and one
program handles a ``[BLOCK_R, BLOCK_C]`` tile: columns along the innermost dim (contiguous, so loads
vectorize), rows decomposed into the outer dims' indices. Each tensor's strides come from
``expand(full_shape)``, so a broadcast dim has stride 0 and is left out of the tensor's offset, and
non-contiguous inputs need no copy. The source depends on the body, the dtypes and that layout's
pattern, never on data: it is written to a file in a cache folder (``triton.jit`` reads a kernel's
source from its file) and imported once per distinct text. Only this module's templates and the
numbers it formats (``repr`` of floats and ints) reach the source; no name or string of the model
does.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkiln.ir import DType, Graph, Node, Value

FLOATS = frozenset([DType.FLOAT, DType.FLOAT16, DType.BFLOAT16])
_TL = {
    DType.FLOAT: "tl.float32",
    DType.FLOAT16: "tl.float16",
    DType.BFLOAT16: "tl.bfloat16",
    DType.INT8: "tl.int8",
    DType.INT16: "tl.int16",
    DType.INT32: "tl.int32",
    DType.INT64: "tl.int64",
    DType.UINT8: "tl.uint8",
    DType.BOOL: "tl.int1",
}
_SIGNED = frozenset([DType.INT8, DType.INT16, DType.INT32, DType.INT64])


class Unsupported(Exception):
    """The body holds an op (or dtype) the generator does not cover."""


# ---------------------------------------------------------------------------------------------
# Terms and the emitter


@dataclass(frozen=True, slots=True)
class Term:
    """A value of the kernel: a variable of the generated source and its ONNX dtype."""

    code: str
    dtype: DType
    value: float | int | None = None  # the number, for a scalar constant

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOATS


def compute_type(dtype: DType) -> str:
    """The tl type a value of ``dtype`` is held in (narrow floats compute in float32)."""
    if dtype in FLOATS:
        return "tl.float32"
    try:
        return _TL[dtype]
    except KeyError:
        raise Unsupported(f"dtype {dtype.name}") from None


def flt(v: float) -> str:
    """A float as source text (inf and nan spelled so that Python reads them back)."""
    v = float(v)
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


def _literal(v: Any, dtype: DType) -> str:
    if dtype in FLOATS:
        return flt(v)
    if dtype == DType.BOOL:
        return "1" if bool(v) else "0"
    return repr(int(v))


@dataclass
class _Emitter:
    lines: list[str] = field(default_factory=list)
    count: int = 0

    def assign(self, expr: str, dtype: DType, prefix: str = "v", value: Any = None) -> Term:
        name = f"{prefix}{self.count}"
        self.count += 1
        self.lines.append(f"{name} = ({expr}).to({compute_type(dtype)})")
        return Term(name, dtype, value)

    def const(self, value: Any, dtype: DType) -> Term:
        """A scalar constant, as a [1, 1] tensor (it broadcasts like any loaded value)."""
        ct = compute_type(dtype)
        return self.assign(f"tl.full([1, 1], {_literal(value, dtype)}, {ct})", dtype, "c", value)


Emit = Callable[[_Emitter, Node, list[Term | None]], str]
_OPS: dict[tuple[str, str], Emit] = {}


def _op(*names: str, domain: str = "") -> Callable[[Emit], Emit]:
    def decorator(fn: Emit) -> Emit:
        for n in names:
            _OPS[(domain, n)] = fn
        return fn

    return decorator


def supported_ops() -> list[tuple[str, str]]:
    """(domain, op) pairs the generator turns into code."""
    return sorted(_OPS)


def _floats(*terms: Term | None) -> None:
    for t in terms:
        if t is not None and not t.is_float:
            raise Unsupported(f"float op on {t.dtype.name}")


def _attr(node: Node, name: str, default: Any) -> Any:
    return node.attrs.get(name, default)


def _domain(node: Node) -> str:
    return "" if node.domain == "ai.onnx" else node.domain


def _max(a: str, b: str, is_float: bool, op: str = "maximum") -> str:
    nan = ", propagate_nan=tl.PropagateNan.ALL" if is_float else ""
    return f"tl.{op}({a}, {b}{nan})"


# ---------------------------------------------------------------------------------------------
# Ops. Each returns the expression of the node's output from its input terms.

# Templates: {0}, {1}... are the inputs, {name} the attribute ``name`` (default given) as a float
# literal. Kind: "any" dtype, "float" only, "bool" only.
_TEMPLATES: dict[tuple[str, str], tuple[str, str, dict[str, float]]] = {
    ("", "Identity"): ("{0}", "any", {}),
    ("", "Add"): ("{0} + {1}", "any", {}),
    ("", "Sub"): ("{0} - {1}", "any", {}),
    ("", "Mul"): ("{0} * {1}", "any", {}),
    ("", "Neg"): ("-{0}", "any", {}),
    ("", "Abs"): ("tl.abs({0})", "any", {}),
    ("", "PRelu"): ("tl.where({0} >= 0, {0}, {0} * {1})", "any", {}),
    ("", "Where"): ("tl.where({0}, {1}, {2})", "any", {}),
    ("", "Equal"): ("{0} == {1}", "any", {}),
    ("", "Less"): ("{0} < {1}", "any", {}),
    ("", "Greater"): ("{0} > {1}", "any", {}),
    ("", "LessOrEqual"): ("{0} <= {1}", "any", {}),
    ("", "GreaterOrEqual"): ("{0} >= {1}", "any", {}),
    ("", "And"): ("{0} & {1}", "bool", {}),
    ("", "Or"): ("{0} | {1}", "bool", {}),
    ("", "Xor"): ("{0} ^ {1}", "bool", {}),
    ("", "Not"): ("{0} == 0", "bool", {}),
    ("", "Exp"): ("tl.exp({0})", "float", {}),
    ("", "Log"): ("tl.log({0})", "float", {}),
    ("", "Sqrt"): ("tl.sqrt({0})", "float", {}),
    ("", "Reciprocal"): ("1.0 / {0}", "float", {}),
    ("", "Sigmoid"): ("tl.sigmoid({0})", "float", {}),
    ("", "Tanh"): ("_tanh({0})", "float", {}),
    ("", "Erf"): ("_erf({0})", "float", {}),
    ("", "Floor"): ("tl.floor({0})", "float", {}),
    ("", "Ceil"): ("tl.ceil({0})", "float", {}),
    ("", "Round"): ("_round_even({0})", "float", {}),
    ("", "Softplus"): ("_softplus({0})", "float", {}),
    ("", "Softsign"): ("{0} / (1.0 + tl.abs({0}))", "float", {}),
    ("", "Mish"): ("{0} * _tanh(_softplus({0}))", "float", {}),
    ("", "IsNaN"): ("{0} != {0}", "float", {}),
    ("", "LeakyRelu"): (
        "tl.where({0} >= 0, {0}, {0} * {alpha})",
        "float",
        {"alpha": 0.009999999776482582},
    ),
    ("", "ThresholdedRelu"): ("tl.where({0} > {alpha}, {0}, 0.0)", "float", {"alpha": 1.0}),
    ("", "Shrink"): (
        "tl.where({0} < -{lambd}, {0} + {bias}, tl.where({0} > {lambd}, {0} - {bias}, 0.0))",
        "float",
        {"bias": 0.0, "lambd": 0.5},
    ),
    ("", "Swish"): ("{0} * tl.sigmoid({0} * {alpha})", "float", {"alpha": 1.0}),
    ("tensorkiln", "SiLU"): ("{0} * tl.sigmoid({0})", "float", {}),
}


def _template(g, n, a):
    template, kind, defaults = _TEMPLATES[(_domain(n), n.op)]
    if kind == "float":
        _floats(*a)
    elif kind == "bool" and any(t.dtype != DType.BOOL for t in a):
        raise Unsupported(f"{n.op} on {a[0].dtype.name}")
    attrs = {k: flt(_attr(n, k, d)) for k, d in defaults.items()}
    return template.format(*(t.code for t in a), **attrs)


for _domain_name, _name in _TEMPLATES:
    _op(_name, domain=_domain_name)(_template)


@_op("Sum")
def _sum(g, n, a):
    return " + ".join(t.code for t in a)


@_op("Mean")
def _mean(g, n, a):
    _floats(*a)
    return f"({' + '.join(t.code for t in a)}) / {flt(len(a))}"


@_op("Div")
def _div(g, n, a):
    x, y = a
    return f"{x.code} / {y.code}" if x.is_float else f"{x.code} // {y.code}"  # ints: C truncation


@_op("Mod")
def _mod(g, n, a):
    x, y = a
    r = g.assign(f"{x.code} % {y.code}", x.dtype).code  # C fmod: the dividend's sign
    if _attr(n, "fmod", 0) or not (x.is_float or x.dtype in _SIGNED):
        return r
    return f"tl.where(({r} != 0) & (({r} < 0) != ({y.code} < 0)), {r} + {y.code}, {r})"


@_op("Max", "Min")
def _maxmin(g, n, a):
    expr = a[0].code
    for t in a[1:]:
        expr = _max(expr, t.code, t.is_float, "maximum" if n.op == "Max" else "minimum")
    return expr


@_op("Relu")
def _relu(g, n, a):
    return _max(a[0].code, "0", a[0].is_float)  # NaN stays NaN, as numpy's maximum


@_op("Sign")
def _sign(g, n, a):
    x = a[0].code
    one, zero = ("1.0", x) if a[0].is_float else ("1", "0")  # float: 0 and NaN stay as they are
    return f"tl.where({x} > 0, {one}, tl.where({x} < 0, -{one}, {zero}))"


@_op("IsInf")
def _isinf(g, n, a):
    _floats(a[0])
    x = a[0].code
    parts = []
    if _attr(n, "detect_negative", 1):
        parts.append(f"({x} == float('-inf'))")
    if _attr(n, "detect_positive", 1):
        parts.append(f"({x} == float('inf'))")
    return " | ".join(parts) if parts else f"({x} != {x}) & ({x} == {x})"


# Elu, Selu, Celu: gamma (max(x, 0) + alpha expm1(min(x, 0) / scale)), as the reference computes
_ELU = {
    "Elu": {"alpha": 1.0},
    "Selu": {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875},
    "Celu": {"alpha": 1.0},
}


@_op(*_ELU)
def _elu(g, n, a):
    _floats(a[0])
    x = a[0].code
    p = {k: float(_attr(n, k, d)) for k, d in _ELU[n.op].items()}
    scale = p["alpha"] if n.op == "Celu" else 1.0
    neg = f"tl.minimum({x}, 0.0)" + (f" / {flt(scale)}" if scale != 1.0 else "")
    expr = f"(tl.maximum({x}, 0.0) + {flt(p['alpha'])} * _expm1({neg}))"
    return f"{expr} * {flt(p['gamma'])}" if "gamma" in p else expr


def _hard_sigmoid_expr(x: str, alpha: float, beta: float) -> str:
    inner = _max(f"{x} * {flt(alpha)} + {flt(beta)}", "0.0", True)
    return _max(inner, "1.0", True, "minimum")


@_op("HardSigmoid")
def _hard_sigmoid(g, n, a):
    _floats(a[0])
    alpha, beta = _attr(n, "alpha", 0.20000000298023224), _attr(n, "beta", 0.5)
    return _hard_sigmoid_expr(a[0].code, alpha, beta)


@_op("HardSwish")
def _hard_swish(g, n, a):
    _floats(a[0])
    return f"{a[0].code} * {_hard_sigmoid_expr(a[0].code, float(np.float32(1 / 6)), 0.5)}"


@_op("Gelu")
@_op("Gelu", domain="tensorkiln")
def _gelu(g, n, a):
    _floats(a[0])
    x = a[0].code
    approximate = _attr(n, "approximate", "none")
    if approximate == "tanh":
        inner = f"_tanh(({x} * {x} * 0.044715 + 1.0) * {x} * 0.7978845608028654)"
    elif approximate == "none":
        inner = f"_erf({x} * 0.7071067811865476)"
    else:
        raise Unsupported(f"Gelu approximate={approximate!r}")
    return f"(({inner}) + 1.0) * {x} * 0.5"


@_op("Clip")
def _clip(g, n, a):
    x = a[0]
    lo = a[1] if len(a) > 1 else None
    hi = a[2] if len(a) > 2 else None
    if "min" in n.attrs:  # opset < 11: bounds as attributes
        lo = g.const(n.attrs["min"], x.dtype)
    if "max" in n.attrs:
        hi = g.const(n.attrs["max"], x.dtype)
    expr = x.code
    if lo is not None:
        expr = _max(expr, lo.code, x.is_float)
    if hi is not None:
        expr = _max(expr, hi.code, x.is_float, "minimum")
    return expr


@_op("Cast")
def _cast(g, n, a):
    x, to = a[0], DType(int(n.attrs["to"]))
    compute_type(to)  # raises for the types the kernel does not hold
    if to == DType.BOOL:
        return f"{x.code} != 0"
    if to in FLOATS:
        wide = f"{x.code}.to(tl.float32)"
        return wide if to == DType.FLOAT else f"{wide}.to({_TL[to]}).to(tl.float32)"  # rounds
    return f"{x.code}.to({_TL[to]})"  # float to int truncates toward zero, as C and numpy


@_op("Pow")
def _pow(g, n, a):
    x, y = a
    if not x.is_float:
        return _int_pow(x, y)
    if y.value is not None:
        return _pow_scalar(x.code, float(y.value))
    e = g.assign(f"{y.code}.to(tl.float32)", DType.FLOAT).code
    r = g.assign(f"tl.exp2({e} * tl.log2(tl.abs({x.code})))", DType.FLOAT).code
    whole = f"(tl.floor({e}) == {e})"
    odd = f"({e} - 2.0 * tl.floor({e} * 0.5) == 1.0)"
    neg = f"tl.where({whole}, tl.where({odd}, -{r}, {r}), float('nan'))"
    return f"tl.where({e} == 0.0, 1.0, tl.where({x.code} < 0, {neg}, {r}))"


def _pow_scalar(x: str, e: float) -> str:
    """x ** e for a constant e: products and roots for the usual exponents, else exp2/log2."""
    special = {
        0.0: "tl.full([1, 1], 1.0, tl.float32)",
        1.0: x,
        2.0: f"{x} * {x}",
        3.0: f"{x} * {x} * {x}",
        4.0: f"({x} * {x}) * ({x} * {x})",
        0.5: f"tl.sqrt({x})",
        -0.5: f"1.0 / tl.sqrt({x})",
        -1.0: f"1.0 / {x}",
        -2.0: f"1.0 / ({x} * {x})",
    }
    if e in special:
        return special[e]
    if e != math.floor(e) or not math.isfinite(e):
        return f"tl.exp2({flt(e)} * tl.log2({x}))"  # a negative base gives NaN, as powf
    r = f"tl.exp2({flt(e)} * tl.log2(tl.abs({x})))"
    return f"tl.where({x} < 0, -({r}), {r})" if int(e) % 2 else r


def _int_pow(x: Term, y: Term) -> str:
    if y.value is None or y.value != int(y.value) or not 0 <= int(y.value) <= 16:
        raise Unsupported("integer Pow with an exponent other than a constant 0..16")
    e = int(y.value)
    return " * ".join([x.code] * e) if e else f"tl.full([1, 1], 1, {_TL[x.dtype]})"


# ---------------------------------------------------------------------------------------------
# Helpers the generated kernels call (written into every generated file)

PRELUDE = """\
import triton
import triton.language as tl


@triton.jit
def _erf(x):
    # the reference's float32 rational approximation (Eigen's), |error| < 4e-7
    x = tl.minimum(tl.maximum(x, -4.0), 4.0)
    z = x * x
    p = z * -2.72614225801306e-10 + 2.77068142495902e-08
    p = p * z - 2.10102402082508e-06
    p = p * z - 5.69250639462346e-05
    p = p * z - 7.34990630326855e-04
    p = p * z - 2.95459980854025e-03
    p = p * z - 1.60960333262415e-02
    q = z * -1.45660718464996e-05 - 2.13374055278905e-04
    q = q * z - 1.68282697438203e-03
    q = q * z - 7.37332916720468e-03
    q = q * z - 1.42647390514189e-02
    return x * p / q


@triton.jit
def _tanh(x):
    # odd Taylor series below 0.3 (relative error < 6e-8), (1 - e) / (1 + e) with e = exp(-2|x|)
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    z = x * x
    s = 0.021869488536155203 * z - 0.05396825396825397
    s = (s * z + 0.13333333333333333) * z - 0.3333333333333333
    small = x + x * z * s
    return tl.where(a < 0.3, small, tl.where(x < 0, -big, big))


@triton.jit
def _log1p01(u):
    # log(1 + u) for u in [0, 1]: 2 atanh(s) with s = u / (2 + u) <= 1/3, relative error < 2e-8
    s = u / (2.0 + u)
    z = s * s
    p = z * 0.0769230769 + 0.0909090909
    p = p * z + 0.1111111111
    p = p * z + 0.1428571429
    p = p * z + 0.2
    p = p * z + 0.3333333333
    return 2.0 * s * (p * z + 1.0)


@triton.jit
def _softplus(x):
    # log(1 + exp(x)) without overflow, as the reference: max(x, 0) + log1p(exp(-|x|))
    return tl.maximum(x, 0.0) + _log1p01(tl.exp(-tl.abs(x)))


@triton.jit
def _expm1(x):
    # exp(x) - 1: Taylor series below 0.5 (no cancellation near 0), exp(x) - 1 above
    z = x * (1.0 / 40320.0) + 1.0 / 5040.0
    z = z * x + 1.0 / 720.0
    z = z * x + 1.0 / 120.0
    z = z * x + 1.0 / 24.0
    z = z * x + 1.0 / 6.0
    z = z * x + 0.5
    small = x + x * x * z
    return tl.where(tl.abs(x) < 0.5, small, tl.exp(x) - 1.0)


@triton.jit
def _round_even(x):
    # round half to even, as ONNX Round (and numpy's rint)
    r = tl.floor(x)
    d = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)
"""


# ---------------------------------------------------------------------------------------------
# A body, analysed once: operands, compute lines, outputs


@dataclass(frozen=True, slots=True)
class Operand:
    """A tensor the kernel loads: body input ``index``, or a non-scalar body constant ``data``."""

    index: int | None
    dtype: DType
    data: np.ndarray | None = None


@dataclass
class Program:
    """What a body compiles to, independent of shapes: the kernel's loads, code and stores."""

    body: Graph
    operands: list[Operand]
    lines: list[str]  # the compute, over x<k> (operand k, loaded) and c/v temporaries
    outputs: list[Term]
    deps: list[list[tuple[int, Any]]]  # per output: ("in" operand k | "shape" of a constant)
    text: str  # canonical text: operands' dtypes, compute lines, outputs
    plans: dict[tuple, Any] = field(default_factory=dict)


def analyse(body: Graph) -> Program:
    """The Program of ``body``; raises Unsupported naming the first thing it does not cover."""
    g = _Emitter()
    terms: dict[Value, Term] = {}
    deps: dict[Value, list] = {}
    operands: list[Operand] = []
    for i, v in enumerate(body.inputs):
        if v.dtype is None:
            raise Unsupported(f"body input '{v.name}' has no dtype")
        compute_type(v.dtype)
        terms[v] = Term(f"x{len(operands)}", v.dtype)
        deps[v] = [("in", len(operands))]
        operands.append(Operand(i, v.dtype))
    for v in body.initializers:
        data = np.asarray(v.const)
        dtype = DType.from_numpy(data.dtype)
        compute_type(dtype)
        deps[v] = [("shape", tuple(data.shape))]
        if data.size == 1:
            terms[v] = g.const(data.reshape(-1)[0].item(), dtype)
        else:
            terms[v] = Term(f"x{len(operands)}", dtype)
            deps[v].append(("in", len(operands)))
            operands.append(Operand(None, dtype, data))
    for node in body.nodes:
        _emit_node(g, node, terms, deps)
    outputs = [terms[v] for v in body.outputs]
    for t in outputs:
        compute_type(t.dtype)
    text = "\n".join(
        [
            "operands: " + " ".join(o.dtype.name for o in operands),
            *g.lines,
            "outputs: " + " ".join(f"{t.code}:{t.dtype.name}" for t in outputs),
        ]
    )
    out_deps = [sorted(set(deps[v]), key=repr) for v in body.outputs]
    return Program(body, operands, g.lines, outputs, out_deps, text)


def _emit_node(g: _Emitter, node: Node, terms: dict[Value, Term], deps: dict[Value, list]) -> None:
    domain = _domain(node)
    emit = _OPS.get((domain, node.op))
    if emit is None:
        raise Unsupported(f"op {domain + '.' if domain else ''}{node.op}")
    if len(node.outputs) != 1 or node.outputs[0] is None:
        raise Unsupported(f"{node.op} with {len(node.outputs)} outputs")
    if any(v is not None and v not in terms for v in node.inputs):
        raise Unsupported(f"{node.op} reads a value from outside the body")
    args = [None if v is None else terms[v] for v in node.inputs]
    out = node.outputs[0]
    if out.dtype is None:
        raise Unsupported(f"{node.op} output '{out.name}' has no dtype")
    shaped = node.inputs[:1] if node.op == "Clip" else node.inputs  # Clip's bounds are scalars
    deps[out] = [d for v in shaped if v is not None for d in deps[v]]
    terms[out] = g.assign(emit(g, node, args), out.dtype)


CACHE_LIMIT = 4096  # bodies (and body constants) remembered before the caches start over
_PROGRAMS: dict[int, tuple[Graph, Program | Unsupported]] = {}  # holds the body: ids stay its


def program(body: Graph) -> Program:
    """The cached Program of ``body`` (raises Unsupported)."""
    hit = _PROGRAMS.get(id(body))
    if hit is None or hit[0] is not body:
        try:
            got: Program | Unsupported = analyse(body)
        except Unsupported as exc:
            got = exc
        if len(_PROGRAMS) >= CACHE_LIMIT:
            _PROGRAMS.clear()
        hit = _PROGRAMS[id(body)] = (body, got)
    if isinstance(hit[1], Unsupported):
        raise Unsupported(str(hit[1]))
    return hit[1]


def can_generate(body: Graph) -> bool:
    """Whether every op and dtype of ``body`` has a generator rule."""
    try:
        program(body)
    except Unsupported:
        return False
    return True


def why_not(body: Graph) -> str | None:
    """What keeps ``body`` from being generated, or None."""
    try:
        program(body)
    except Unsupported as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------------------------
# Layout: the broadcast shape collapsed, each tensor's strides in it


@dataclass(frozen=True, slots=True)
class Layout:
    sizes: tuple[int, ...]  # collapsed dims, outermost first (at least one)
    strides: tuple[tuple[int, ...], ...]  # per tensor (operands, then outputs), per dim
    wide: bool  # offsets need 64 bits

    def pattern(self, k: int) -> str:
        """Per dim of tensor k: '0' broadcast, 's' strided; the innermost '1' when contiguous."""
        s = self.strides[k]
        out = ["0" if x == 0 else "s" for x in s]
        if s[-1] == 1:
            out[-1] = "1"
        return "".join(out)


def layout(shapes: list[tuple[int, ...]], strides: list[tuple[int, ...]]) -> Layout:
    """Collapse the broadcast shape of tensors of ``shapes``/``strides`` (each given at full rank,
    broadcast dims with stride 0) into the fewest dims that keep every tensor's addressing."""
    full = shapes[0]
    keep = [d for d in range(len(full)) if full[d] != 1]
    sizes = [full[d] for d in keep]
    strides_k = [[s[d] for d in keep] for s in strides]
    d = len(sizes) - 1
    while d > 0:  # merge dim d-1 into d where every tensor steps through both as one
        if all(s[d - 1] == s[d] * sizes[d] for s in strides_k):
            sizes[d] *= sizes[d - 1]
            del sizes[d - 1]
            for s in strides_k:
                del s[d - 1]
        d -= 1
    if not sizes:
        sizes, strides_k = [1], [[0] for _ in strides_k]
    span = max(sum((n - 1) * st for n, st in zip(sizes, s)) for s in strides_k)
    numel = math.prod(sizes)
    wide = max(span, numel) >= 2**31 - 2**16
    return Layout(tuple(sizes), tuple(tuple(s) for s in strides_k), wide)


def render(prog: Program, lay: Layout, n_out: int) -> str:
    """The kernel's source for ``prog`` on ``lay`` (operands, then outputs, as its tensors)."""
    r = len(lay.sizes)
    n_in = len(prog.operands)
    patterns = [lay.pattern(k) for k in range(n_in + n_out)]
    params = [f"p{k}" for k in range(n_in)] + [f"o{j}" for j in range(n_out)]
    params += ["n_rows", "n_cols"] + [f"d{i}" for i in range(1, r - 1)]
    for k, pat in enumerate(patterns):
        params += [f"s{k}_{i}" for i, c in enumerate(pat) if c == "s"]
    params += ["BLOCK_R: tl.constexpr", "BLOCK_C: tl.constexpr"]
    cast = ".to(tl.int64)" if lay.wide else ""
    body = [
        "pid = tl.program_id(0)",
        "n_cb = tl.cdiv(n_cols, BLOCK_C)",
        f"pid_r = (pid // n_cb){cast}",
        f"pid_c = (pid % n_cb){cast}",
        "rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)",
        "cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)",
        "rmask = (rows < n_rows)[:, None]",
        "cmask = (cols < n_cols)[None, :]",
        "mask = rmask & cmask",
    ]
    body += _row_indices(r)
    for k, op in enumerate(prog.operands):
        ptr, m = _address(f"p{k}", k, patterns[k], full=False)
        load = f"tl.load({ptr}, mask={m})" if m else f"tl.load({ptr})"
        body.append(f"x{k} = {load}.to({compute_type(op.dtype)})")
    body += prog.lines
    for j, t in enumerate(prog.outputs):
        ptr, _ = _address(f"o{j}", n_in + j, patterns[n_in + j], full=True)
        body.append(f"tl.store({ptr}, {t.code}.to({_TL[t.dtype]}), mask=mask)")
    text = "\n    ".join(body)
    return f"{PRELUDE}\n\n@triton.jit\ndef kernel({', '.join(params)}):\n    {text}\n"


def _row_indices(r: int) -> list[str]:
    """i0..i{r-2}: the outer dims' indices of each row (dim r-1 is the columns)."""
    if r == 1:
        return []
    if r == 2:
        return ["i0 = rows"]
    lines = ["t = rows"]
    for i in range(r - 2, 0, -1):
        lines += [f"i{i} = t % d{i}", f"t = t // d{i}"]
    return [*lines, "i0 = t"]


def _address(base: str, k: int, pat: str, full: bool) -> tuple[str, str | None]:
    """(pointer expression, mask name) of tensor k: [BLOCK_R, 1] when it broadcasts along the
    columns, [1, BLOCK_C] along the rows, [1, 1] for a scalar; ``full`` forces [BLOCK_R, BLOCK_C]."""
    outer = [f"i{i} * s{k}_{i}" for i, c in enumerate(pat[:-1]) if c == "s"]
    inner = {"0": None, "1": "cols", "s": f"cols * s{k}_{len(pat) - 1}"}[pat[-1]]
    parts = []
    if outer:
        parts.append(f"({' + '.join(outer)})[:, None]")
    if inner:
        parts.append(f"({inner})[None, :]")
    if full and not (outer and inner):
        parts.append("tl.zeros([BLOCK_R, BLOCK_C], tl.int32)")
    if not parts:
        parts.append("tl.zeros([1, 1], tl.int32)")
    mask = "mask" if full or (outer and inner) else "rmask" if outer else "cmask" if inner else None
    return f"{base} + {' + '.join(parts)}", mask


# ---------------------------------------------------------------------------------------------
# Compiling: one module per distinct source, in a cache folder

_KERNELS: dict[str, Any] = {}
_LOCK = threading.Lock()
_CACHE_DIR: str | None = None


def cache_dir() -> str:
    """The folder the generated sources are written to (one per process)."""
    global _CACHE_DIR
    if _CACHE_DIR is None:
        _CACHE_DIR = tempfile.mkdtemp(prefix="tensorkiln-triton-")
    return _CACHE_DIR


def compile_source(source: str) -> Any:
    """The ``kernel`` of the module made from ``source`` (generated by this module), cached."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    fn = _KERNELS.get(digest)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _KERNELS.get(digest)
        if fn is None:
            name = f"tensorkiln_pointwise_{digest}"
            path = os.path.join(cache_dir(), f"{name}.py")
            with open(path, "w") as f:
                f.write(source)
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            fn = _KERNELS[digest] = module.kernel
    return fn


# ---------------------------------------------------------------------------------------------
# Running


@dataclass(frozen=True, slots=True)
class _Plan:
    kernel: Any
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[Any, ...]
    scalars: tuple[int, ...]  # n_rows, n_cols, dims, strides, as the kernel takes them
    grid: tuple[int]
    launch: dict[str, int]  # BLOCK_R, BLOCK_C, num_warps
    numel: int


def run(body: Graph, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The body's outputs on torch tensors ``inputs`` (CUDA, or CPU through the interpreter)."""
    import torch

    prog = program(body)
    if len(inputs) != len(body.inputs):
        raise ValueError(f"Pointwise body takes {len(body.inputs)} inputs, got {len(inputs)}")
    device = inputs[0].device if inputs else _current_device()
    tensors = [
        inputs[o.index] if o.index is not None else _device_const(o, device) for o in prog.operands
    ]
    key = (*((t.shape, t.stride(), t.dtype) for t in tensors), device)
    plan = prog.plans.get(key)
    if plan is None:
        plan = prog.plans[key] = _make_plan(prog, tensors)
    outs = tuple(
        torch.empty(s, dtype=dt, device=device) for s, dt in zip(plan.out_shapes, plan.out_dtypes)
    )
    if plan.numel:
        # the interpreter computes masked-off lanes too: numpy warns of their NaNs
        quiet = np.errstate(all="ignore") if _interpreting() else contextlib.nullcontext()
        with quiet:
            plan.kernel[plan.grid](*tensors, *outs, *plan.scalars, **plan.launch)
    return outs


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _current_device() -> Any:
    from tensorkiln.kernels.cuda.convert import current_device

    return current_device()


_CONSTS: dict[tuple[int, Any], tuple[np.ndarray, Any]] = {}


def _device_const(op: Operand, device: Any) -> Any:
    """Body constant ``op`` on ``device``, copied there once."""
    key = (id(op.data), device)
    hit = _CONSTS.get(key)
    if hit is None or hit[0] is not op.data:
        from tensorkiln.kernels.cuda.convert import to_torch

        if len(_CONSTS) >= CACHE_LIMIT:
            _CONSTS.clear()
        hit = _CONSTS[key] = (op.data, to_torch(np.array(op.data), device))  # a writable copy
    return hit[1]


def _make_plan(prog: Program, tensors: list[Any]) -> _Plan:
    import torch

    from tensorkiln.kernels.cuda.convert import torch_dtype

    for o, t in zip(prog.operands, tensors):
        if t.dtype != torch_dtype(o.dtype.numpy):
            raise TypeError(f"Pointwise input of dtype {t.dtype} where the body has {o.dtype.name}")
    out_shapes = []
    for dep in prog.deps:
        shapes = [tuple(tensors[d].shape) if kind == "in" else d for kind, d in dep]
        out_shapes.append(tuple(torch.broadcast_shapes(*shapes)) if shapes else ())
    full = tuple(torch.broadcast_shapes(*out_shapes, *(t.shape for t in tensors)))
    rank = len(full)
    strides = [_strides_in(t.shape, t.stride(), full) for t in tensors]
    strides += [_strides_in(s, _contiguous(s), full) for s in out_shapes]
    out_dtypes = tuple(torch_dtype(t.dtype.numpy) for t in prog.outputs)
    if not math.prod(full):
        return _Plan(None, tuple(out_shapes), out_dtypes, (), (0,), {}, 0)
    lay = layout([full], strides) if rank else Layout((1,), tuple((0,) for _ in strides), False)
    kernel = compile_source(render(prog, lay, len(out_shapes)))
    sizes = lay.sizes
    n_cols, n_rows = sizes[-1], math.prod(sizes[:-1])
    numel = n_cols * n_rows
    block = 4096 if numel >= 1 << 20 else 1024  # H200: 4096 a program, 4 warps, were fastest
    block_c = min(_pow2(n_cols), block)
    block_r = max(1, min(block // block_c, _pow2(n_rows)))
    scalars = [n_rows, n_cols, *sizes[1:-1]]
    for k in range(len(strides)):
        pat = lay.pattern(k)
        scalars += [lay.strides[k][i] for i, c in enumerate(pat) if c == "s"]
    grid = (triton_cdiv(n_rows, block_r) * triton_cdiv(n_cols, block_c),)
    return _Plan(
        kernel,
        tuple(out_shapes),
        out_dtypes,
        tuple(int(s) for s in scalars),
        grid,
        {"BLOCK_R": block_r, "BLOCK_C": block_c, "num_warps": 4},
        numel,
    )


def _strides_in(shape, stride, full: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a tensor of ``shape`` broadcast to ``full`` (0 along the broadcast dims)."""
    pad = len(full) - len(shape)
    out = [0] * pad
    for d, (n, s) in enumerate(zip(shape, stride)):
        out.append(0 if n == 1 and full[pad + d] != 1 else int(s))
    return tuple(out)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
