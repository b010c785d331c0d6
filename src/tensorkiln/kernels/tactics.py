"""Tactics: the candidate implementations of one op on the cuda backend, and the table of them.

The table lives with the kernels that register into it (kernels/cuda/tactics_*.py); the builder's
autotuner (tensorkiln.tactics) times the candidates, and the runtime reads an engine's choices
back here (:func:`tactic_functions`) without importing the autotuner.

Every op's registered cuda kernel is its ``default`` tactic. Further candidates (Triton kernels with
several tile configs, cuDNN vs an implicit GEMM, ...) register here with a constraint check; the
builder's autotuner times each one that applies on the profile's opt shapes and keeps the fastest.

A tactic's function has the kernel convention (inputs positionally as torch tensors, attributes as
keywords) and must compute the same function as the op's reference kernel.

    @tactic("GemmAct", domain="tensorkiln", name="triton_128x64x32", supports=fits_triton)
    def gemm_triton(a, b, c=None, *, alpha=1.0, ...): ...

``supports(spec)`` receives a :class:`LayerSpec` and returns True when the tactic can run it.
``estimate(spec)``, optional, scores how well the tactic should suit the layer (higher is
better); when more tactics apply than the autotuner times, it keeps the best-scored ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensorkiln.errors import EngineCompatibilityError
from tensorkiln.ir import Graph
from tensorkiln.kernels.registry import normalize_domain


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What a tactic's constraints look at: the node's op, attributes, input shapes and dtypes."""

    op: str
    domain: str
    attrs: dict[str, Any]
    shapes: tuple[tuple[int, ...] | None, ...]  # concrete input shapes; None for an omitted input
    dtypes: tuple[str | None, ...]  # numpy dtype names ("float16", ...); None for omitted
    device: str = "cuda"  # torch device type the layer runs on
    constant: tuple[bool, ...] = field(default=())  # which inputs are initializers (weights)


@dataclass(frozen=True, slots=True)
class Tactic:
    name: str
    op: str
    domain: str
    fn: Callable
    supports: Callable[[LayerSpec], bool] | None = None
    estimate: Callable[[LayerSpec], float] | None = None
    # the candidates the autotuner's max_candidates counts together (None: the name's source)
    group: str | None = None
    # what identifies the code behind the name where a rebuild can change it under the same name
    # (a kernel library's object code): part of the timing cache's key, so a rebuilt kernel is
    # timed again rather than chosen on the old one's timings
    version: str | None = None

    def score(self, spec: LayerSpec) -> float:
        """How well the tactic should suit the layer (0 where it has no estimate, or the
        estimate fails on this layer)."""
        if self.estimate is None:
            return 0.0
        try:
            return float(self.estimate(spec))
        except Exception:  # a third-party model's odd layer must not fail the build
            return 0.0

    def applies(self, spec: LayerSpec) -> bool:
        """Whether the tactic can run the layer; a constraint check that fails says no."""
        if self.supports is None:
            return True
        try:
            return bool(self.supports(spec))
        except Exception:  # a third-party model's odd layer must not fail the build
            return False


_TACTICS: dict[tuple[str, str], dict[str, Tactic]] = {}


def tactic(
    op: str,
    *,
    domain: str = "",
    name: str,
    supports: Callable[[LayerSpec], bool] | None = None,
    estimate: Callable[[LayerSpec], float] | None = None,
    group: str | None = None,
) -> Callable[[Callable], Callable]:
    """Register ``fn`` as tactic ``name`` of ``op`` (besides the op's default kernel).
    ``group``: the tactics that compete for the autotuner's per-layer candidate slots (default:
    those of the same source, the name's first part); a tactic in a group of its own is always
    timed where it applies."""
    domain = normalize_domain(domain)

    def decorator(fn: Callable) -> Callable:
        if name == "default":
            raise ValueError("'default' names the op's registered kernel; pick another name")
        _TACTICS.setdefault((domain, op), {})[name] = Tactic(
            name, op, domain, fn, supports, estimate, group
        )
        return fn

    return decorator


@dataclass(frozen=True, slots=True)
class TacticFamily:
    """Tactics named per layer rather than registered one by one: ``expand(spec)`` names the
    family's candidates for a layer (cuBLASLt's algorithms for its shape, say), and
    ``resolve(name)`` gives the tactic of a name the family made (None: not one of its names).
    Every name starts with ``prefix``."""

    prefix: str
    expand: Callable[[LayerSpec], list[str]]
    resolve: Callable[[str], Tactic | None]
    # what to check when an engine names one of its tactics and this installation cannot make it
    missing: str = ""


_FAMILIES: dict[tuple[str, str], list[TacticFamily]] = {}


def tactic_family(op: str, family: TacticFamily, *, domain: str = "") -> None:
    """Register ``family``'s tactics as candidates for ``op``."""
    _FAMILIES.setdefault((normalize_domain(domain), op), []).append(family)


def tactics_for(op: str, domain: str = "", spec: LayerSpec | None = None) -> list[Tactic]:
    """The registered non-default tactics of ``op``, in registration order; with ``spec``, the
    candidates its families name for that layer after them."""
    _load()
    key = (normalize_domain(domain), op)
    found = list(_TACTICS.get(key, {}).values())
    if spec is not None:
        for family in _FAMILIES.get(key, ()):
            try:
                names = family.expand(spec)
            except Exception:  # a third-party model's odd layer must not fail the build
                continue
            found += [t for t in map(family.resolve, names) if t is not None]
    return found


def get_tactic(op: str, domain: str, name: str) -> Tactic | None:
    _load()
    key = (normalize_domain(domain), op)
    found = _TACTICS.get(key, {}).get(name)
    if found is None:
        family = _family_of(key, name)
        found = family.resolve(name) if family is not None else None
    return found


def _family_of(key: tuple[str, str], name: str) -> TacticFamily | None:
    return next((f for f in _FAMILIES.get(key, ()) if name.startswith(f.prefix)), None)


def _load() -> None:
    # (the cuda tree's modules register their tactics on import)
    import tensorkiln.kernels.cuda  # noqa: F401  # lazy: torch


def tactic_functions(graph: Graph, layers: list[dict], mode: str = "graph") -> dict[str, Callable]:
    """Node name -> tactic function for the layers whose chosen tactic is not the default;
    ``mode`` picks the choice for engines run as CUDA graphs ("graph") or layer by layer
    ("eager")."""
    by_name = {n.name: n for n in graph.nodes}
    out = {}
    for layer in layers:
        name = layer.get("tactic", "default")
        if mode == "eager":
            name = layer.get("tactic_eager", name)
        node = by_name.get(layer.get("name"))
        if name == "default" or node is None:
            continue
        t = get_tactic(node.op, node.domain, name)
        if t is None:
            family = _family_of((normalize_domain(node.domain), node.op), name)
            hint = (family.missing if family is not None else "") or "is triton installed?"
            raise EngineCompatibilityError(
                f"layer '{node.name}' uses tactic '{name}', which this installation does not have "
                f"({hint}); rebuild the engine here"
            )
        out[node.name] = t.fn
    return out
