"""Checking what a user feeds a model against what the model declares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorkiln.errors import InputError
from tensorkiln.ir import DType, Graph, TensorType, Value


def bind_inputs(graph: Graph, feeds: Mapping[str, Any]) -> dict[Value, Any]:
    """Match ``feeds`` (name -> array) to the graph's inputs, checking names, dtypes and shapes.

    Symbolic dimensions must be bound consistently: two inputs declared with batch "N" must get the
    same size. Raises InputError naming the input, what was expected and what was given.
    """
    if not isinstance(feeds, Mapping):
        raise InputError(f"inputs must be a dict of name -> array, got {type(feeds).__name__}")
    expected = {v.name: v for v in graph.inputs}
    unknown = [k for k in feeds if k not in expected]
    if unknown:
        raise InputError(
            f"unknown input name(s) {', '.join(map(repr, unknown))}; the model's inputs are "
            f"{', '.join(map(repr, expected)) or '(none)'}"
        )
    missing = [k for k in expected if k not in feeds]
    if missing:
        raise InputError(f"missing input(s) {', '.join(map(repr, missing))}")
    symbols: dict[str, tuple[int, str]] = {}
    bound: dict[Value, Any] = {}
    for name, v in expected.items():
        bound[v] = _check_one(v, feeds[name], symbols)
    return bound


def _check_one(v: Value, given: Any, symbols: dict[str, tuple[int, str]]) -> Any:
    t = v.type
    if not isinstance(t, TensorType):
        return given  # sequences and optionals pass as they are
    arr = given if isinstance(given, np.ndarray) else _as_array(v, given, t)
    if t.dtype is not None:
        try:
            got = DType.from_numpy(arr.dtype)
        except TypeError:
            got = None
        if got != t.dtype:
            raise InputError(
                f"input '{v.name}' expects dtype {t.dtype.numpy} ({t.dtype.name}), got {arr.dtype}"
            )
    if t.shape is not None:
        _check_shape(v.name, t.shape, arr.shape, symbols)
    return arr


def _as_array(v: Value, given: Any, t: TensorType) -> np.ndarray:
    if hasattr(given, "__array__") or hasattr(given, "__dlpack__"):
        return np.asarray(given)
    raise InputError(f"input '{v.name}' must be a numpy array, got {type(given).__name__}")


def _check_shape(name: str, want: tuple, got: tuple, symbols: dict[str, tuple[int, str]]) -> None:
    declared = "[" + ", ".join(str(d) for d in want) + "]"
    if len(want) != len(got):
        raise InputError(
            f"input '{name}' expects rank {len(want)} {declared}, got shape {list(got)}"
        )
    for axis, (w, g) in enumerate(zip(want, got)):
        if isinstance(w, int):
            if w != g:
                raise InputError(
                    f"input '{name}' expects shape {declared}, got {list(got)} "
                    f"(axis {axis}: {g} != {w})"
                )
        elif not w.startswith("_d"):
            prev = symbols.setdefault(w, (g, name))
            if prev[0] != g:
                raise InputError(
                    f"input '{name}' axis {axis} is dimension '{w}' = {g}, but input '{prev[1]}' "
                    f"gave '{w}' = {prev[0]}"
                )
