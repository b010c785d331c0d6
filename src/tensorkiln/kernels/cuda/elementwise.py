"""Elementwise kernels of the cuda backend: unary math, arithmetic, comparison, logic, bitwise,
Where and Clip, in torch. They match ``kernels/reference/elementwise.py`` op for op; the
activations are in :mod:`tensorkiln.kernels.cuda.activations`, which shares the dtype plumbing here.

torch has hardly any arithmetic for uint16/uint32/uint64: such values compute in a wider signed type
(uint16, uint32) or in int64's bit pattern (uint64), and come back modulo 2**bits, which is what the
unsigned op gives; comparisons map uint64 onto int64 order by flipping the top bit. float8 inputs
compute in float32. String inputs (Equal, Where) run the reference on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tensorkiln.kernels.common.elementwise import CLIP_BOUNDS_AS_INPUTS, check_clip_bound
from tensorkiln.kernels.cuda.convert import to_numpy, to_torch
from tensorkiln.kernels.reference import elementwise as ref
from tensorkiln.kernels.registry import register

Tensor = torch.Tensor

FLOAT8 = frozenset(
    {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}
)
NARROW = frozenset({torch.float16, torch.bfloat16}) | FLOAT8
UNSIGNED = frozenset({torch.uint8, torch.uint16, torch.uint32, torch.uint64})
_WIDER = {torch.uint16: torch.int32, torch.uint32: torch.int64}
_TOP = -(2**63)  # int64 with only the top bit set


def _cuda(name: str, since: int = 1) -> Callable[[Callable], Callable]:
    return register(name, since=since, backend="cuda")


# ---------------------------------------------------------------------------------------------
# dtype plumbing


def arith(x: Tensor) -> Tensor:
    """``x`` in a dtype torch does arithmetic in, exact modulo 2**bits (see :func:`unarith`)."""
    if x.dtype in _WIDER:
        return x.to(_WIDER[x.dtype])
    return x.view(torch.int64) if x.dtype == torch.uint64 else x


def unarith(y: Tensor, dtype: torch.dtype) -> Tensor:
    """``y`` computed on :func:`arith` values, back in ``dtype`` (wrapping modulo 2**bits)."""
    if y.dtype == dtype:
        return y
    if dtype == torch.uint64 and y.dtype == torch.int64:
        return y.view(torch.uint64)
    return y.to(dtype)


def ordered(x: Tensor) -> Tensor:
    """``x`` in a dtype torch compares in, order kept (uint64 maps onto int64 by its top bit)."""
    if x.dtype == torch.uint64:
        return x.view(torch.int64) ^ _TOP
    if x.dtype in FLOAT8:
        return x.float()
    return arith(x)


def unordered(y: Tensor, dtype: torch.dtype) -> Tensor:
    """The inverse of :func:`ordered`."""
    if dtype == torch.uint64:
        return (y ^ _TOP).view(torch.uint64)
    return y if y.dtype == dtype else y.to(dtype)


_SAME_WIDTH = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def select(condition: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """torch.where for every dtype (CUDA's has no uint16/32/64: those select as signed bits)."""
    view = _SAME_WIDTH.get(a.dtype)
    if view is None:
        return torch.where(condition, a, b)
    return torch.where(condition, a.view(view), b.view(view)).view(a.dtype)


def full(shape: list[int] | tuple[int, ...], value: float, dtype: torch.dtype, device) -> Tensor:
    """torch.full for every dtype (CUDA cannot fill uint16/32/64 directly)."""
    if dtype == torch.uint64:
        return unordered(torch.full(shape, value - 2**63, dtype=torch.int64, device=device), dtype)
    if dtype in _WIDER:
        return torch.full(shape, value, dtype=_WIDER[dtype], device=device).to(dtype)
    return torch.full(shape, value, dtype=dtype, device=device)


def compute(x: Tensor) -> Tensor:
    """``x`` in the dtype float formulas run in: float32 for narrow floats, float64 for integers."""
    if x.dtype in NARROW:
        return x.float()
    if not x.is_floating_point():
        return x.double()
    return x


def _ulessthan(a: Tensor, b: Tensor) -> Tensor:
    """a < b for int64 tensors holding uint64 bit patterns."""
    return (a ^ _TOP) < (b ^ _TOP)


def _udivmod64(n: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """Unsigned 64-bit quotient and remainder on int64 bit patterns (Hacker's Delight, divlu)."""
    n, d = torch.broadcast_tensors(n, d)
    big = d < 0  # a divisor of 2**63 or more: the quotient is 0 or 1
    q_big = (~_ulessthan(n, d)).to(torch.int64)
    ds = torch.where(big, 1, d)
    q = torch.div((n >> 1) & (2**63 - 1), ds, rounding_mode="trunc") << 1
    q = q + (~_ulessthan(n - q * ds, ds)).to(torch.int64)
    q = torch.where(big, q_big, q)
    return q, n - q * d


def _on_host(*args: object) -> bool:
    """Whether any input is a host (numpy) array: strings have no torch dtype."""
    return any(isinstance(a, np.ndarray) for a in args)


def _host(fn: Callable, *args: object, **attrs: object) -> object:
    device = next((a.device for a in args if isinstance(a, Tensor)), None)
    return to_torch(fn(*[to_numpy(a) for a in args], **attrs), device)


# ---------------------------------------------------------------------------------------------
# Unary math


def _float_unary(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``fn`` for float inputs; float8 in float32 and integers in float64, rounded back."""

    def run(x: Tensor) -> Tensor:
        if x.dtype in FLOAT8 or not x.is_floating_point():
            return fn(compute(x)).to(x.dtype)
        return fn(x)

    return run


def _abs(x: Tensor) -> Tensor:
    return x if x.dtype in UNSIGNED else torch.abs(x)


def _neg(x: Tensor) -> Tensor:
    return unarith(torch.neg(arith(x)), x.dtype)


def _sign(x: Tensor) -> Tensor:
    if x.dtype in UNSIGNED:
        return unarith((arith(x) != 0).to(arith(x).dtype), x.dtype)
    return torch.sign(x)


def _bitwise_not(x: Tensor) -> Tensor:
    return unarith(torch.bitwise_not(arith(x)), x.dtype)


# fmt: off
_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "Abs": _abs, "Neg": _neg, "Sign": _sign, "Not": torch.logical_not,
    "BitwiseNot": _bitwise_not,
} | {
    name: _float_unary(fn) for name, fn in {
        "Acos": torch.acos, "Acosh": torch.acosh, "Asin": torch.asin, "Asinh": torch.asinh,
        "Atan": torch.atan, "Atanh": torch.atanh, "Ceil": torch.ceil, "Cos": torch.cos,
        "Cosh": torch.cosh, "Exp": torch.exp, "Floor": torch.floor, "Log": torch.log,
        "Reciprocal": torch.reciprocal, "Round": torch.round,  # half to even, as ONNX asks
        "Sin": torch.sin, "Sinh": torch.sinh, "Sqrt": torch.sqrt, "Tan": torch.tan,
        "Tanh": torch.tanh,
    }.items()
}
# fmt: on


def _unary(fn: Callable[[Tensor], Tensor], name: str) -> Callable:
    def kernel(x: Tensor, *, consumed_inputs: list[int] | None = None) -> Tensor:
        return fn(x)

    kernel.__name__ = kernel.__qualname__ = name.lower()
    kernel.__doc__ = f"Elementwise {name}, dtype kept."
    return kernel


for _op, _fn in _UNARY.items():
    _cuda(_op)(_unary(_fn, _op))


@_cuda("IsNaN", since=9)
def isnan(x: Tensor) -> Tensor:
    """True where ``x`` is NaN."""
    return torch.isnan(x.float() if x.dtype in FLOAT8 else x)


@_cuda("IsInf", since=10)
def isinf(x: Tensor, *, detect_negative: int = 1, detect_positive: int = 1) -> Tensor:
    """True where ``x`` is an infinity of a detected sign."""
    if x.dtype in FLOAT8:
        x = x.float()
    if detect_negative and detect_positive:
        return torch.isinf(x)
    if detect_positive:
        return torch.isposinf(x)
    if detect_negative:
        return torch.isneginf(x)
    return torch.zeros(x.shape, dtype=torch.bool, device=x.device)


_cuda("Erf", since=9)(_unary(_float_unary(torch.erf), "Erf"))


# ---------------------------------------------------------------------------------------------
# Binary arithmetic, comparison and logic (multidirectional broadcasting)


def _legacy_b(a: Tensor, b: Tensor, broadcast: int, axis: int | None) -> Tensor:
    """Opset 1-6 ``broadcast=1, axis=k``: ``b``'s dims line up with ``a``'s from axis k on."""
    if broadcast and axis is not None and 0 < b.ndim < a.ndim:
        axis = axis + a.ndim if axis < 0 else axis
        trailing = a.ndim - axis - b.ndim
        if trailing < 0:
            raise ValueError(
                f"axis={axis} puts B of shape {tuple(b.shape)} outside A of shape {tuple(a.shape)}"
            )
        b = b.reshape(tuple(b.shape) + (1,) * trailing)
    return b


def _wrapping(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """``op`` on :func:`arith` values, result back in the inputs' dtype (+ - * and bitwise)."""

    def fn(a: Tensor, b: Tensor) -> Tensor:
        return unarith(op(arith(a), arith(b)), a.dtype)

    return fn


def _comparing(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    def fn(a: Tensor, b: Tensor) -> Tensor:
        return op(ordered(a), ordered(b))

    return fn


def _div(a: Tensor, b: Tensor) -> Tensor:
    """Float division, or integer division truncating toward zero (C semantics, as ONNX)."""
    if a.is_floating_point():
        return torch.true_divide(a, b)
    if a.dtype == torch.uint64:
        return _udivmod64(a.view(torch.int64), b.view(torch.int64))[0].view(torch.uint64)
    return unarith(torch.div(arith(a), arith(b), rounding_mode="trunc"), a.dtype)


_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "Add": _wrapping(torch.add),
    "Sub": _wrapping(torch.sub),
    "Mul": _wrapping(torch.mul),
    "Div": _div,
    "Greater": _comparing(torch.gt),
    "GreaterOrEqual": _comparing(torch.ge),
    "Less": _comparing(torch.lt),
    "LessOrEqual": _comparing(torch.le),
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
    "BitwiseAnd": _wrapping(torch.bitwise_and),
    "BitwiseOr": _wrapping(torch.bitwise_or),
    "BitwiseXor": _wrapping(torch.bitwise_xor),
}


def _binary(fn: Callable[[Tensor, Tensor], Tensor], name: str) -> Callable:
    """A kernel applying ``fn(a, b)`` that also accepts the opset 1-6 broadcast attributes."""

    def kernel(
        a: Tensor,
        b: Tensor,
        *,
        broadcast: int = 0,
        axis: int | None = None,
        consumed_inputs: list[int] | None = None,
    ) -> Tensor:
        if axis is not None:
            b = _legacy_b(a, b, broadcast, axis)
        return fn(a, b)

    kernel.__name__ = kernel.__qualname__ = name.lower()
    kernel.__doc__ = f"Elementwise {name} with numpy broadcasting."
    return kernel


for _op, _fn in _BINARY.items():
    _cuda(_op)(_binary(_fn, _op))

_equal = _binary(_comparing(torch.eq), "Equal")


@_cuda("Equal")
def equal(
    a: Tensor,
    b: Tensor,
    *,
    broadcast: int = 0,
    axis: int | None = None,
    consumed_inputs: list[int] | None = None,
) -> Tensor:
    """Elementwise a == b with numpy broadcasting (strings compare on the host)."""
    if _on_host(a, b):
        return _host(ref.BINARY_KERNELS["Equal"], a, b, broadcast=broadcast, axis=axis)
    return _equal(a, b, broadcast=broadcast, axis=axis)


@_cuda("Pow")
def pow_(x: Tensor, y: Tensor, *, broadcast: int = 0, axis: int | None = None) -> Tensor:
    """x ** y in x's dtype (the exponent may be of another numeric type)."""
    if axis is not None:
        y = _legacy_b(x, y, broadcast, axis)
    if not x.is_floating_point():
        if y.is_floating_point():
            return torch.pow(x.double(), y.double()).to(x.dtype)
        # integer powers wrap like the reference's (the exponent cast to x's type, as numpy's);
        # negative exponents go through float64
        xa = arith(x)
        ya = y.view(torch.int64) if y.dtype == torch.uint64 else arith(y)
        if not y.dtype.is_signed:
            return unarith(torch.pow(xa, ya.to(xa.dtype)), x.dtype)
        exact = torch.pow(xa, ya.clamp(min=0).to(xa.dtype))
        as_float = arith(torch.pow(x.double(), y.double()).to(x.dtype))
        return unarith(torch.where(ya >= 0, exact, as_float), x.dtype)
    if y.dtype == x.dtype and x.dtype not in FLOAT8:
        return torch.pow(x, y)
    # a double exponent is applied in double, as std::pow(double, double) would
    t = torch.float64 if torch.float64 in (x.dtype, y.dtype) else torch.float32
    return torch.pow(x.to(t), y.to(t)).to(x.dtype)


def _float_remainder(a: Tensor, b: Tensor) -> Tensor:
    """numpy's float remainder: C fmod moved to the divisor's sign."""
    r = torch.fmod(a, b)
    return torch.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@_cuda("Mod", since=10)
def mod(a: Tensor, b: Tensor, *, fmod: int = 0) -> Tensor:
    """Remainder with the divisor's sign (``fmod=0``) or the dividend's (``fmod=1``, C fmod)."""
    if fmod not in (0, 1):
        raise ValueError(f"Mod fmod must be 0 or 1, got {fmod}")
    if a.is_floating_point():
        if a.dtype in FLOAT8:
            return mod(a.float(), b.float(), fmod=fmod).to(a.dtype)
        return torch.fmod(a, b) if fmod else _float_remainder(a, b)
    if a.dtype == torch.uint64:
        return _udivmod64(a.view(torch.int64), b.view(torch.int64))[1].view(torch.uint64)
    op = torch.fmod if fmod else torch.remainder
    return unarith(op(arith(a), arith(b)), a.dtype)


def _shift_right(x: Tensor, amount: Tensor) -> Tensor:
    """x >> amount on :func:`arith` values: arithmetic for signed types, logical for unsigned
    ones (0 <= amount < bits)."""
    xa = arith(x)
    if x.dtype != torch.uint64:
        return torch.bitwise_right_shift(xa, amount.to(xa.dtype))
    logical = ((xa >> 1) & (2**63 - 1)) >> (amount - 1).clamp(min=0)
    return torch.where(amount == 0, xa, logical)


@_cuda("BitShift", since=11)
def bit_shift(x: Tensor, y: Tensor, *, direction: str) -> Tensor:
    """Shift ``x`` left or right by ``y`` bits; shifts outside [0, bits) give the sign fill."""
    bits = x.element_size() * 8
    y = ordered(y) if y.dtype != torch.uint64 else y.view(torch.int64)  # huge ones go negative
    out_of_range = (y < 0) | (y >= bits)
    amount = torch.where(out_of_range, 0, y)
    xa = arith(x)
    zero = torch.zeros((), dtype=xa.dtype, device=x.device)
    if direction == "LEFT":
        r = torch.bitwise_left_shift(xa, amount.to(xa.dtype))
        fill = zero
    elif direction == "RIGHT":
        r = _shift_right(x, amount)
        fill = xa >> (bits - 1) if x.dtype.is_signed else zero  # -1 for negative signed values
    else:
        raise ValueError(f"BitShift direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    return unarith(torch.where(out_of_range, fill, r), x.dtype)


# ---------------------------------------------------------------------------------------------
# Variadic, Where, Clip


def _fold(op: Callable[[Tensor, Tensor], Tensor], inputs: tuple[Tensor, ...], name: str) -> Tensor:
    if not inputs:
        raise ValueError(f"{name} needs at least one input")
    out = inputs[0]
    for x in inputs[1:]:
        out = op(out, x)
    return out


def _extremum(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    def fn(a: Tensor, b: Tensor) -> Tensor:
        return unordered(op(ordered(a), ordered(b)), a.dtype)

    return fn


@_cuda("Max")
def max_(*data: Tensor, consumed_inputs: list[int] | None = None) -> Tensor:
    """Elementwise maximum of all inputs (NaN propagates)."""
    return _fold(_extremum(torch.maximum), data, "Max")


@_cuda("Min")
def min_(*data: Tensor, consumed_inputs: list[int] | None = None) -> Tensor:
    """Elementwise minimum of all inputs (NaN propagates)."""
    return _fold(_extremum(torch.minimum), data, "Min")


@_cuda("Sum")
def sum_(*data: Tensor, consumed_inputs: list[int] | None = None) -> Tensor:
    """Elementwise sum of all inputs."""
    return _fold(_wrapping(torch.add), data, "Sum")


@_cuda("Mean")
def mean(*data: Tensor, consumed_inputs: list[int] | None = None) -> Tensor:
    """Elementwise mean of all inputs (integers floor-divide, as the reference)."""
    out = _fold(_wrapping(torch.add), data, "Mean")
    if out.is_floating_point():
        return out / len(data)
    if out.dtype == torch.uint64:
        n = torch.full((), len(data), dtype=torch.int64, device=out.device)
        return _udivmod64(out.view(torch.int64), n)[0].view(torch.uint64)
    return unarith(torch.div(arith(out), len(data), rounding_mode="floor"), out.dtype)


@_cuda("Where", since=9)
def where(condition: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """x where ``condition`` holds, y elsewhere (all three broadcast; strings on the host)."""
    if _on_host(x, y):
        return _host(ref.where, condition, x, y)
    return select(condition, x, y)


def _clip(x: Tensor, lo: Tensor | None, hi: Tensor | None) -> Tensor:
    """min(max(x, lo), hi): where lo > hi everything becomes hi, as ONNX specifies."""
    if lo is None and hi is None:
        return x.clone()
    v = ordered(x)
    lo = None if lo is None else ordered(lo)
    hi = None if hi is None else ordered(hi)
    return unordered(torch.clamp(v, min=lo, max=hi), x.dtype)


def _bound(value: float | None, x: Tensor) -> Tensor | None:
    """An attribute bound as a 0-d tensor of x's dtype (rounded the way numpy's cast rounds)."""
    if value is None:
        return None
    if not x.is_floating_point():
        value = int(value)
    return full((), value, x.dtype, x.device)


@_cuda("Clip")
def clip(
    x: Tensor,
    min: Tensor | float | None = None,  # ONNX's names, of the inputs and the old attributes
    max: Tensor | float | None = None,
    *,
    consumed_inputs: list[int] | None = None,
    _opset: int = CLIP_BOUNDS_AS_INPUTS,
) -> Tensor:
    """min(max(x, min), max): the bounds are optional scalar inputs from opset 11 on, float
    attributes before."""
    if _opset < CLIP_BOUNDS_AS_INPUTS:
        return _clip(x, _bound(min, x), _bound(max, x))
    for name, bound in (("min", min), ("max", max)):
        if bound is not None:
            check_clip_bound(name, bound.numel(), bound.shape)
    lo = None if min is None else min.reshape(()).to(x.dtype)
    hi = None if max is None else max.reshape(()).to(x.dtype)
    return _clip(x, lo, hi)
