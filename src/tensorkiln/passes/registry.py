"""The registry of named passes: :func:`register_pass` and the table it fills.

A pass is a function ``(graph) -> int`` that changes the graph in place and returns how many
matches it rewrote. Pass modules import this module only (never the PassManager), so that the
manager can import every pass at the top of its module without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tensorkiln.ir import Graph

PassFn = Callable[[Graph], int]


@dataclass(frozen=True)
class PassInfo:
    name: str
    level: int
    fn: PassFn
    order: int
    late: bool = False
    backends: tuple[str, ...] | None = None  # None: every backend
    # run again after implicit quantization (a fusion of the quantized layers it makes)
    quantized: bool = False


PASSES: dict[str, PassInfo] = {}


def register_pass(
    name: str,
    *,
    level: int,
    order: int,
    late: bool = False,
    backends: tuple[str, ...] | None = None,
    quantized: bool = False,
) -> Callable[[PassFn], PassFn]:
    """Register a pass run at optimization ``level`` and above, in ascending ``order``.

    A ``late`` pass (generic fusion of what is left) joins its stage only once the other passes
    of the stage have reached their fixed point, so it never takes a pattern they would fuse.
    ``backends`` limits the pass to graphs built for those backends (a fusion that pays on one
    and not another); a PassManager given no backend runs every pass. A ``quantized`` pass fuses
    quantized layers: the builder runs it again after implicit quantization (which makes them
    from the optimized float graph).
    """

    def decorator(fn: PassFn) -> PassFn:
        PASSES[name] = PassInfo(name, level, fn, order, late, backends, quantized)
        return fn

    return decorator
