"""What the commands share: argument parsing, shapes strings, models and engines, inputs, tables."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from tensorkiln.errors import InputError, TensorkilnError

ENGINE_MAGIC = b"TKENGINE"


class CLIError(TensorkilnError):
    """A user error found by the command line itself (missing file, missing optional package)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``tensorkiln: error: ...`` and a pointer to --help, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"tensorkiln: error: {message} (see '{self.prog} --help')\n")


def add_common(p: argparse.ArgumentParser) -> None:
    """Options every subcommand takes; SUPPRESS keeps a --verbose given before the command."""
    p.add_argument(
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks on errors",
    )


def add_backend_option(p: argparse.ArgumentParser, help: str) -> None:
    """--backend, as the Builder takes it (checked here too, for argparse's one-line error)."""
    p.add_argument(
        "--backend", choices=("auto", "reference", "cpu", "cuda"), default="auto", help=help
    )


def add_subcommand(sub: Any, name: str, help: str, epilog: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help=help,
        description=help[:1].upper() + help[1:] + ".",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(p)
    return p


# ----------------------------------------------------------------------------- values in flags


def parse_shapes(text: str | None, flag: str = "--shapes") -> dict[str, tuple[int, ...]]:
    """'a:1x3x224x224,b:1x128' -> {'a': (1, 3, 224, 224), 'b': (1, 128)}; 'c:' is a scalar."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        name, sep, dims = item.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(d) for d in dims.split("x")) if dims else ()
            if any(d < 0 for d in shape):
                raise ValueError
        except ValueError:
            raise InputError(
                f"bad {flag} entry '{item}': expected NAME:DxDx... with non-negative sizes, "
                "e.g. input:1x3x224x224"
            ) from None
        if name in shapes:
            raise InputError(f"{flag} gives input '{name}' twice")
        shapes[name] = shape
    return shapes


def percentiles(text: str) -> list[float]:
    """argparse type for '90,95,99'."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 90,99, got '{text}'") from None
    if not values or any(not 0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in 0..100, got '{text}'")
    return values


def byte_count(text: str) -> int:
    """argparse type for sizes: 1073741824, 512K, 64M, 2G (binary multiples)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = int(float(num) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 1073741824, 512M or 2G, got '{text}'"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, got '{text}'")
    return value


def non_negative(kind: type) -> Any:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
            raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got '{text}'")
        return value

    return convert


# ----------------------------------------------------------------------------- models and engines


def existing_file(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CLIError(f"file '{p}' does not exist")
    if not p.is_file():
        raise CLIError(f"'{p}' is not a file")
    return p


def is_engine_file(path: Path) -> bool:
    """Engines are recognised by their magic bytes, whatever the file is called."""
    with open(path, "rb") as f:
        return f.read(len(ENGINE_MAGIC)) == ENGINE_MAGIC


def profile_from_shapes(shapes: dict[str, tuple[int, ...]]) -> Any:
    """One profile with min = opt = max for every named input (trtexec's --shapes at build time)."""
    from tensorkiln.builder import OptimizationProfile

    profile = OptimizationProfile()
    for name, shape in shapes.items():
        profile.set_shape(name, shape, shape, shape)
    return profile


@dataclass
class Loaded:
    """An engine ready to run, and how it came to be."""

    engine: Any
    path: Path
    built: Any = None  # the BuildReport when built in memory from an ONNX model
    build_s: float = 0.0


def load_or_build(path: str, shapes: dict[str, tuple[int, ...]], backend: str = "auto") -> Loaded:
    """Load an engine file, or build an ONNX model in memory (``shapes`` fixes dynamic inputs)."""
    import time

    from tensorkiln.builder import Builder, BuilderConfig
    from tensorkiln.engine import Engine

    p = existing_file(path)
    if is_engine_file(p):
        return Loaded(Engine.load(p), p)
    config = BuilderConfig()
    dynamic = _dynamic_shapes(p, shapes)
    if dynamic:
        config.add_optimization_profile(profile_from_shapes(dynamic))
    builder = Builder(backend)
    t0 = time.perf_counter()
    engine = builder.build(p, config)
    return Loaded(engine, p, builder.last_report, time.perf_counter() - t0)


def _dynamic_shapes(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The --shapes entries worth a profile: those of inputs with a symbolic dim."""
    if not shapes:
        return {}
    from tensorkiln.frontends.onnx import load_model_proto

    proto = load_model_proto(path)
    inits = {t.name for t in proto.graph.initializer}
    declared = {}
    for vi in proto.graph.input:
        if vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        declared[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    unknown = [n for n in shapes if n not in declared]
    if unknown:
        raise InputError(
            f"--shapes names unknown input(s) {', '.join(map(repr, unknown))}; the model's "
            f"inputs are {', '.join(map(repr, declared))}"
        )
    return {n: s for n, s in shapes.items() if None in declared[n] or not declared[n]}


# ----------------------------------------------------------------------------- inputs


def input_shapes(engine: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Concrete input shapes: --shapes, else the first profile's opt shape, else dynamic dims = 1."""
    specs = {s.name: s for s in engine.inputs}
    unknown = [n for n in shapes if n not in specs]
    if unknown:
        raise InputError(
            f"--shapes names unknown input(s) {', '.join(map(repr, unknown))}; the engine's "
            f"inputs are {', '.join(map(repr, specs))}"
        )
    profile = engine.profiles[0].shapes if engine.profiles else {}
    out = {}
    for name, s in specs.items():
        if name in shapes:
            out[name] = shapes[name]
        elif name in profile:
            out[name] = tuple(profile[name][1])
        elif s.shape is None:
            raise InputError(f"input '{name}' has no declared shape; give it with --shapes")
        else:
            out[name] = tuple(d if isinstance(d, int) else 1 for d in s.shape)
    return out


def random_inputs(
    engine: Any, shapes: dict[str, tuple[int, ...]], seed: int | None = None
) -> dict[str, np.ndarray]:
    """Standard normal floats, small non-negative integers (0..9), random booleans."""
    from tensorkiln.ir import DType

    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in engine.inputs:
        shape = shapes[spec.name]
        if spec.dtype is None:
            raise InputError(
                f"input '{spec.name}' has no declared type; give it with --load-inputs"
            )
        dt = DType[spec.dtype]
        if dt.is_float:
            feeds[spec.name] = rng.standard_normal(shape).astype(dt.numpy)
        elif dt.numpy == np.bool_:
            feeds[spec.name] = rng.integers(0, 2, shape).astype(bool)
        elif dt.is_integer:
            feeds[spec.name] = rng.integers(0, 10, shape).astype(dt.numpy)
        else:
            raise InputError(
                f"cannot make random data for input '{spec.name}' of type {dt.name}; "
                "give it with --load-inputs"
            )
    return feeds


def load_inputs(path: str) -> dict[str, np.ndarray]:
    p = existing_file(path)
    try:
        with np.load(p, allow_pickle=False) as data:
            if not hasattr(data, "files"):
                raise ValueError("it holds one array, not named arrays (save with np.savez)")
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError) as exc:
        raise CLIError(f"cannot read inputs from '{p}': {exc}") from None


def check_feed_names(engine: Any, feeds: dict[str, Any], where: str) -> None:
    names = [s.name for s in engine.inputs]
    unknown = [k for k in feeds if k not in names]
    missing = [k for k in names if k not in feeds]
    if unknown or missing:
        parts = []
        if missing:
            parts.append(f"lacks {', '.join(map(repr, missing))}")
        if unknown:
            parts.append(f"has unknown {', '.join(map(repr, unknown))}")
        raise InputError(
            f"{where} {' and '.join(parts)}; the inputs are {', '.join(map(repr, names))}"
        )


def save_npz(path: str, arrays: dict[str, Any]) -> None:
    try:
        with open(path, "wb") as f:
            np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})
    except OSError as exc:
        raise CLIError(f"cannot write '{path}': {exc.strerror or exc}") from None


def write_text(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise CLIError(f"cannot write '{path}': {exc.strerror or exc}") from None


# ----------------------------------------------------------------------------- output


def shape_str(shape: Sequence[Any] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


def mib(n: int | float) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None
) -> None:
    """A rich table in a terminal; plain aligned columns otherwise (what scripts and tests read)."""
    cells = [[str(c) for c in r] for r in rows]
    if sys.stdout.isatty() and not os.environ.get("NO_COLOR"):
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            numeric = bool(cells) and all(_is_number(r[i]) for r in cells)
            table.add_column(h, justify="right" if numeric else "left")
        for r in cells:
            table.add_row(*r)
        Console().print(table)
        return
    if title:
        print(title)
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for r in [list(headers), *cells]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("%"))
    except ValueError:
        return False
    return True
