"""Dimensions: ints, or symbols named by strings ("N", "seq", "2*N").

Products of symbols are kept in a canonical text form ``c*a*b`` (integer coefficient first, symbol
names sorted), so that a Reshape to ``(-1, 768)`` of an ``(N, 128, 768)`` tensor gives ``128*N`` and a
later Reshape back to ``(N, 128, 768)`` divides it out again.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping

from tensorkiln.ir.graph import Dim

_fresh = itertools.count()


def fresh_dim() -> str:
    """A new symbol for a dimension nothing is known about."""
    return f"_d{next(_fresh)}"


def is_anonymous(d: Dim) -> bool:
    return isinstance(d, str) and d.startswith("_d")


def _parse(d: Dim) -> tuple[int, Counter]:
    if isinstance(d, int):
        return d, Counter()
    coef, syms = 1, Counter()
    for part in d.split("*"):
        if part.lstrip("-").isdigit():
            coef *= int(part)
        else:
            syms[part] += 1
    return coef, syms


def _render(coef: int, syms: Counter) -> Dim:
    names = sorted(syms.elements())
    if not names or coef == 0:
        return coef
    return "*".join(([str(coef)] if coef != 1 else []) + names)


def dim_product(dims: Iterable[Dim]) -> Dim:
    """The product of dims, symbolic where any factor is."""
    coef, syms = 1, Counter()
    for d in dims:
        c, s = _parse(d)
        coef *= c
        syms += s
    return _render(coef, syms)


def dim_value(d: Dim, sizes: Mapping[str, int]) -> int | None:
    """``d`` as a number with its symbols bound by ``sizes`` (None where one is not bound)."""
    coef, syms = _parse(d)
    for name, power in syms.items():
        if name not in sizes:
            return None
        coef *= sizes[name] ** power
    return coef


def dim_divide(a: Dim, b: Dim) -> Dim | None:
    """a / b when it divides exactly (symbol by symbol); None when it does not."""
    ca, sa = _parse(a)
    cb, sb = _parse(b)
    if cb == 0 or ca % cb or any(sa[k] < n for k, n in sb.items()):
        return None
    return _render(ca // cb, sa - sb)


def broadcast_dim(a: Dim, b: Dim) -> Dim:
    """The broadcast of two dims; raises ValueError when two known sizes differ."""
    if a == b or b == 1:
        return a
    if a == 1:
        return b
    if isinstance(a, int) and isinstance(b, int):
        raise ValueError(f"sizes {a} and {b} do not broadcast")
    if isinstance(a, int):
        return a
    if isinstance(b, int):
        return b
    return fresh_dim()


def broadcast_shapes(*shapes: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """Numpy-style multidirectional broadcast of shapes with symbolic dims."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = [1] * rank
    for s in shapes:
        padded = (1,) * (rank - len(s)) + tuple(s)
        try:
            out = [broadcast_dim(x, y) for x, y in zip(out, padded)]
        except ValueError:
            raise ValueError(
                f"shapes {' and '.join(str(list(x)) for x in shapes)} do not broadcast"
            ) from None
    return tuple(out)
