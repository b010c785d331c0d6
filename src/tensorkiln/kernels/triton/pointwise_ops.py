"""The ops of generated Pointwise kernels: each ONNX op of a body as a ``tl`` expression.

:mod:`tensorkiln.kernels.triton.pointwise` walks a body and asks this module for each node's
expression. An op's rule gets the emitter (to name temporaries and constants) and the node's input
terms, and returns the expression of the node's output; :data:`PRELUDE` holds the ``triton.jit``
helpers these expressions call (erf, tanh, softplus...), written into every generated file. Only
the templates here and the numbers they format reach the generated source.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from tensorkiln.ir import DType, Node
from tensorkiln.ops import attribute_defaults

FP8 = DType.FLOAT8E4M3FN
# (float8 values are held in float32 like the other narrow floats, and only QuantizeLinear and
# DequantizeLinear may read or write them: analyse refuses any other op touching one)
FLOATS = frozenset([DType.FLOAT, DType.FLOAT16, DType.BFLOAT16, FP8])
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


def tl_type(dtype: DType) -> str:
    """The tl type a tensor of ``dtype`` is stored in (one that :func:`compute_type` takes)."""
    return _TL[dtype]


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
class Emitter:
    """The compute lines of a kernel, each assigning one numbered temporary."""

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


Emit = Callable[[Emitter, Node, list[Term | None]], str]
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


def emitter_for(node: Node) -> Emit:
    """The rule that turns ``node`` into an expression; raises Unsupported when there is none."""
    domain = _domain(node)
    emit = _OPS.get((domain, node.op))
    if emit is None:
        raise Unsupported(f"op {domain + '.' if domain else ''}{node.op}")
    return emit


def _floats(*terms: Term | None) -> None:
    for t in terms:
        if t is not None and not t.is_float:
            raise Unsupported(f"float op on {t.dtype.name}")


def _attr(node: Node, name: str) -> Any:
    """The node's attribute ``name``, or its op record's default. A Pointwise body does not say
    its opset: the newest schema's defaults apply, as they have to these ops since the opsets
    the generator emits them for."""
    if name in node.attrs:
        return node.attrs[name]
    return _defaults(_domain(node), node.op)[name]


@functools.cache
def _defaults(domain: str, op: str) -> dict[str, Any]:
    return attribute_defaults(op, domain, onnx.defs.onnx_opset_version())


def _domain(node: Node) -> str:
    return "" if node.domain == "ai.onnx" else node.domain


def _max(a: str, b: str, is_float: bool, op: str = "maximum") -> str:
    nan = ", propagate_nan=tl.PropagateNan.ALL" if is_float else ""
    return f"tl.{op}({a}, {b}{nan})"


# ---------------------------------------------------------------------------------------------
# Ops. Each returns the expression of the node's output from its input terms.

# Templates: {0}, {1}... are the inputs, {name} the attribute ``name`` (the op record's default when
# the node has none) as a float literal. Kind: "any" dtype, "float" only, "bool" only.
_TEMPLATES: dict[tuple[str, str], tuple[str, str, tuple[str, ...]]] = {
    ("", "Identity"): ("{0}", "any", ()),
    ("", "Add"): ("{0} + {1}", "any", ()),
    ("", "Sub"): ("{0} - {1}", "any", ()),
    ("", "Mul"): ("{0} * {1}", "any", ()),
    ("", "Neg"): ("-{0}", "any", ()),
    ("", "Abs"): ("tl.abs({0})", "any", ()),
    ("", "PRelu"): ("tl.where({0} >= 0, {0}, {0} * {1})", "any", ()),
    ("", "Where"): ("tl.where({0}, {1}, {2})", "any", ()),
    ("", "Equal"): ("{0} == {1}", "any", ()),
    ("", "Less"): ("{0} < {1}", "any", ()),
    ("", "Greater"): ("{0} > {1}", "any", ()),
    ("", "LessOrEqual"): ("{0} <= {1}", "any", ()),
    ("", "GreaterOrEqual"): ("{0} >= {1}", "any", ()),
    ("", "And"): ("{0} & {1}", "bool", ()),
    ("", "Or"): ("{0} | {1}", "bool", ()),
    ("", "Xor"): ("{0} ^ {1}", "bool", ()),
    ("", "Not"): ("{0} == 0", "bool", ()),
    ("", "Exp"): ("tl.exp({0})", "float", ()),
    ("", "Log"): ("tl.log({0})", "float", ()),
    ("", "Sqrt"): ("tl.sqrt({0})", "float", ()),
    ("", "Reciprocal"): ("1.0 / {0}", "float", ()),
    ("", "Sigmoid"): ("tl.sigmoid({0})", "float", ()),
    ("", "Tanh"): ("_tanh({0})", "float", ()),
    ("", "Erf"): ("_erf({0})", "float", ()),
    ("", "Floor"): ("tl.floor({0})", "float", ()),
    ("", "Ceil"): ("tl.ceil({0})", "float", ()),
    ("", "Round"): ("_round_even({0})", "float", ()),
    ("", "Softplus"): ("_softplus({0})", "float", ()),
    ("", "Softsign"): ("{0} / (1.0 + tl.abs({0}))", "float", ()),
    ("", "Mish"): ("{0} * _tanh(_softplus({0}))", "float", ()),
    ("", "IsNaN"): ("{0} != {0}", "float", ()),
    ("", "LeakyRelu"): (
        "tl.where({0} >= 0, {0}, {0} * {alpha})",
        "float",
        ("alpha",),
    ),
    ("", "ThresholdedRelu"): ("tl.where({0} > {alpha}, {0}, 0.0)", "float", ("alpha",)),
    ("", "Shrink"): (
        "tl.where({0} < -{lambd}, {0} + {bias}, tl.where({0} > {lambd}, {0} - {bias}, 0.0))",
        "float",
        ("bias", "lambd"),
    ),
    ("", "Swish"): ("{0} * tl.sigmoid({0} * {alpha})", "float", ("alpha",)),
    ("tensorkiln", "SiLU"): ("{0} * tl.sigmoid({0})", "float", ()),
}


def _template(g, n, a):
    template, kind, names = _TEMPLATES[(_domain(n), n.op)]
    if kind == "float":
        _floats(*a)
    elif kind == "bool" and any(t.dtype != DType.BOOL for t in a):
        raise Unsupported(f"{n.op} on {a[0].dtype.name}")
    attrs = {k: flt(_attr(n, k)) for k in names}
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
    if _attr(n, "fmod") or not (x.is_float or x.dtype in _SIGNED):
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
    if _attr(n, "detect_negative"):
        parts.append(f"({x} == float('-inf'))")
    if _attr(n, "detect_positive"):
        parts.append(f"({x} == float('inf'))")
    return " | ".join(parts) if parts else f"({x} != {x}) & ({x} == {x})"


# Elu, Selu, Celu: gamma (max(x, 0) + alpha expm1(min(x, 0) / scale)), as the reference computes
_ELU = {"Elu": ("alpha",), "Selu": ("alpha", "gamma"), "Celu": ("alpha",)}


@_op(*_ELU)
def _elu(g, n, a):
    _floats(a[0])
    x = a[0].code
    p = {k: float(_attr(n, k)) for k in _ELU[n.op]}
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
    alpha, beta = _attr(n, "alpha"), _attr(n, "beta")
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
    approximate = _attr(n, "approximate")
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


_EIGHT_BIT = {DType.INT8: (-128, 127), DType.UINT8: (0, 255)}


def _per_tensor_qdq(n: Node, a: list[Term | None]) -> tuple:
    """(x, scale, zero point or None) of a Q/DQ the generator emits: one float32 scale and zero
    point (scalars)."""
    if n.attrs.get("block_size", 0) or n.attrs.get("output_dtype", 0):
        raise Unsupported(f"{n.op} with block_size or output_dtype")
    if n.attrs.get("precision", 0) not in (0, DType.FLOAT.value):
        raise Unsupported(f"{n.op} dividing in another type")
    if len(a) < 2 or a[1] is None or a[1].dtype != DType.FLOAT:
        raise Unsupported(f"{n.op} without a float32 scale")
    return a[0], a[1], a[2] if len(a) > 2 else None


def _zero_fp8_point(zp: Term | None) -> None:
    """A float8 Q/DQ's zero point: none, or a constant zero (as ONNX requires of float8)."""
    if zp is not None and (zp.value is None or float(zp.value) != 0.0):
        raise Unsupported("a float8 QuantizeLinear/DequantizeLinear with a zero point")


@_op("DequantizeLinear")
def _dequantize(g, n, a):
    """(x - zp) * scale, in float32 (exact for 8-bit x), as the reference computes it."""
    x, s, zp = _per_tensor_qdq(n, a)
    if x.dtype == FP8:  # (held in float32 already: the load widened it exactly)
        _zero_fp8_point(zp)
        return f"{x.code} * {s.code}"
    if x.dtype not in _EIGHT_BIT:
        raise Unsupported(f"DequantizeLinear of {x.dtype.name}")
    wide = f"{x.code}.to(tl.float32)"
    wide = wide if zp is None else f"({wide} - {zp.code}.to(tl.float32))"
    return f"{wide} * {s.code}"


@_op("QuantizeLinear")
def _quantize(g, n, a):
    """clamp(round_half_even(x / scale) + zp) to int8 or uint8, the division IEEE as the
    reference's (Triton's ``/`` on float32 is an approximation). To float8 E4M3 (saturating,
    ONNX's default), x / scale rounded half to even onto E4M3's grid in float32 arithmetic
    (quantize.saturated_e4m3_value, the QuantizeLinear kernel's rounding), which a
    DequantizeLinear in the body reads as it is; a float8 output is stored as its E4M3 code
    (quantize.e4m3_bits), so no float8 conversion of Triton's runs (its interpreter rounds them
    wrongly and turns NaN into 384)."""
    x, s, zp = _per_tensor_qdq(n, a)
    target = n.outputs[0].dtype if n.outputs and n.outputs[0] is not None else None
    if target == FP8 and x.dtype in FLOATS and x.dtype != FP8:
        _zero_fp8_point(zp)
        if not n.attrs.get("saturate", 1):
            raise Unsupported("QuantizeLinear to float8 without saturation")
        q = g.assign(f"tl.math.div_rn({x.code}.to(tl.float32), {s.code})", DType.FLOAT).code
        return f"saturated_e4m3_value({q})"
    if target not in _EIGHT_BIT or x.dtype not in FLOATS:
        raise Unsupported("QuantizeLinear to a type other than int8/uint8/float8 E4M3")
    lo, hi = _EIGHT_BIT[target]
    q = f"_round_even(tl.math.div_rn({x.code}.to(tl.float32), {s.code}))"
    q = q if zp is None else f"({q} + {zp.code}.to(tl.float32))"
    return f"tl.minimum(tl.maximum({q}, {lo}.0), {hi}.0)"


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

from tensorkiln.kernels.triton.quantize import e4m3_bits, saturated_e4m3_value


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
