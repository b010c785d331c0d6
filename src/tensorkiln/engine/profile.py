"""Optimization profiles: the input shapes an engine accepts, recorded in the engine file."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensorkiln.errors import InputError


@dataclass
class OptimizationProfile:
    """min/opt/max shapes per dynamic input (TensorRT's IOptimizationProfile).

    The engine accepts any input shape between ``min`` and ``max`` (per axis); ``opt`` is the shape
    kernels are tuned for.
    """

    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict
    )

    def set_shape(self, name: str, min: Any, opt: Any, max: Any) -> OptimizationProfile:
        lo, mid, hi = (tuple(int(d) for d in s) for s in (min, opt, max))
        if not len(lo) == len(mid) == len(hi):
            raise InputError(
                f"profile for '{name}': min {lo}, opt {mid} and max {hi} differ in rank"
            )
        for axis, (a, b, c) in enumerate(zip(lo, mid, hi)):
            if not 0 <= a <= b <= c:
                raise InputError(
                    f"profile for '{name}' axis {axis}: need 0 <= min <= opt <= max, got "
                    f"{a}, {b}, {c}"
                )
        self.shapes[name] = (lo, mid, hi)
        return self

    def to_json(self) -> dict:
        return {
            k: {"min": list(a), "opt": list(b), "max": list(c)}
            for k, (a, b, c) in self.shapes.items()
        }

    @classmethod
    def from_json(cls, data: dict) -> OptimizationProfile:
        p = cls()
        for name, s in data.items():
            p.set_shape(name, s["min"], s["opt"], s["max"])
        return p
