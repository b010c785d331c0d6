"""What the builder reads from optimization profiles: their checks against the model's inputs,
the input shapes to tune at (and the extremes every tactic must run at), the dynamic dims every
profile pins, and the messages and notes about dynamic axes no profile sizes."""

from __future__ import annotations

from tensorkiln.builder.config import BuilderConfig, OptimizationProfile
from tensorkiln.errors import InputError
from tensorkiln.ir import Graph, TensorType
from tensorkiln.kernels.evaluate import infer_shapes


def check_profiles(graph: Graph, profiles: list[OptimizationProfile]) -> None:
    """Refuse a profile that names no input, gives an input another rank, or ranges over an axis
    the model fixes."""
    inputs = {v.name: v for v in graph.inputs}
    for i, p in enumerate(profiles):
        for name, (lo, _, hi) in p.shapes.items():
            v = inputs.get(name)
            if v is None:
                raise InputError(
                    f"profile {i} names '{name}', which is not an input; inputs are "
                    f"{', '.join(inputs)}"
                )
            if v.shape is None:
                continue
            if len(v.shape) != len(lo):
                raise InputError(
                    f"profile {i} gives '{name}' rank {len(lo)}; the model declares {list(v.shape)}"
                )
            for axis, (d, a, b) in enumerate(zip(v.shape, lo, hi)):
                if isinstance(d, int) and not a == b == d:
                    raise InputError(
                        f"profile {i}: '{name}' axis {axis} is fixed at {d} in the model, but "
                        f"the profile gives {a}..{b}"
                    )


def pin_fixed_dims(graph: Graph, profiles: list[OptimizationProfile]) -> list[str]:
    """Make the dynamic input dims that every profile fixes (min == max, the same value in each)
    the model's own, and infer the types again: the shape arithmetic that reads them (Shape,
    Gather, Concat, Range, Where... feeding Reshapes and masks) then folds to constants at
    build time instead of running as dozens of tiny kernels in every inference. An engine whose
    profiles pin an axis accepts nothing else on it anyway. Returns a note per pinned input."""
    if not profiles:
        return []
    notes = []
    for v in graph.inputs:
        given = [p.shapes.get(v.name) for p in profiles]
        if not isinstance(v.type, TensorType) or v.shape is None or None in given:
            continue
        dims = list(v.shape)
        for axis, d in enumerate(dims):
            ranges = {(g[0][axis], g[2][axis]) for g in given}
            if not isinstance(d, int) and len(ranges) == 1:
                lo, hi = next(iter(ranges))
                dims[axis] = lo if lo == hi else d
        if tuple(dims) != tuple(v.shape):
            notes.append(f"input '{v.name}' fixed at {dims} by the profiles (was {list(v.shape)})")
            v.type = TensorType(v.type.dtype, tuple(dims))
    if notes:
        infer_shapes(graph)
    return notes


def unprofiled_axes(graph: Graph, profiles: list[OptimizationProfile]) -> dict[str, list[str]]:
    """Input -> its dynamic axes ("2 (height)") that no profile sizes: tuned at 1."""
    given = profiles[0].shapes if profiles else {}
    return {
        v.name: [f"{a} ({d})" for a, d in enumerate(v.shape) if not isinstance(d, int)]
        for v in graph.inputs
        if v.name not in given
        and v.shape is not None
        and not all(isinstance(d, int) for d in v.shape)
    }


def tuning_shapes_error(graph: Graph, profiles: list[OptimizationProfile], exc: Exception) -> str:
    """The build error when the model does not infer at the shapes the builder tunes at: where
    those were guessed (1 for a dynamic axis without a profile), which inputs need a profile, as
    TensorRT refuses dynamic inputs without one."""
    guessed = unprofiled_axes(graph, profiles)
    if not guessed:
        where = "the optimization profile's shapes" if profiles else "its declared input shapes"
        return f"the model does not run at {where}: {exc}"
    axes = "; ".join(f"'{name}' axes {', '.join(a)}" for name, a in guessed.items())
    shapes = {v.name: v.shape for v in graph.inputs if v.name in guessed}
    example = " ".join(
        f"{name}:" + "x".join(str(d) if isinstance(d, int) else f"<{d}>" for d in shape)
        for name, shape in shapes.items()
    )
    return (
        f"the model has dynamic inputs but no optimization profile sizes them ({axes}); tuning "
        f"at 1 for each such axis fails: {exc}. Give the shapes to tune for with --opt-shapes "
        f"(and --min-shapes/--max-shapes for a range), e.g. --opt-shapes {example}; in Python, "
        "BuilderConfig.add_optimization_profile"
    )


def guessed_shapes_notes(graph: Graph, config: BuilderConfig) -> list[str]:
    """A note where layers were tuned at 1 for a dynamic axis past the first (a batch axis is
    routinely tuned at 1; a sequence or image size of 1 says little about real ones)."""
    if config.optimization_level <= 0 or config.tactic_sources == set():
        return []
    guessed = {
        name: [a for a in axes if not a.startswith("0 ")]
        for name, axes in unprofiled_axes(graph, config.profiles).items()
    }
    axes = "; ".join(f"'{name}' axes {', '.join(a)}" for name, a in guessed.items() if a)
    if not axes:
        return []
    return [
        f"kernels were tuned at size 1 for dynamic axes without a profile ({axes}); give "
        "--opt-shapes for timings that match the shapes the engine will run at"
    ]


def profile_extremes(
    graph: Graph, profiles: list[OptimizationProfile]
) -> list[dict[str, tuple[int, ...]]]:
    """Each profile's min and max input shapes: tactics must run at every shape in range."""
    return [input_shapes(graph, p, k) for p in profiles for k in (0, 2)]


def opt_shapes(graph: Graph, profiles: list[OptimizationProfile]) -> dict[str, tuple[int, ...]]:
    """Input shapes to tune for: profile 0's opt shapes; a dynamic dim without one is 1."""
    return input_shapes(graph, profiles[0] if profiles else None, 1)


def input_shapes(
    graph: Graph, profile: OptimizationProfile | None, k: int
) -> dict[str, tuple[int, ...]]:
    """Every input's shape: the profile's min (k=0), opt (1) or max (2) where it has one, else
    the declared shape with 1 for each dynamic dim."""
    shapes: dict[str, tuple[int, ...]] = {}
    given = profile.shapes if profile is not None else {}
    for v in graph.inputs:
        if v.name in given:
            shapes[v.name] = given[v.name][k]
        elif v.shape is not None:
            shapes[v.name] = tuple(d if isinstance(d, int) else 1 for d in v.shape)
    return shapes
