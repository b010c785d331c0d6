"""What the commands share: argument parsing, shapes strings, models and engines, inputs, tables."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from tensorkiln.backends import NAMES as BACKEND_NAMES
from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.engine import Engine
from tensorkiln.engine.schema import printable
from tensorkiln.errors import InputError, ModelLoadError, TensorkilnError
from tensorkiln.frontends.onnx import open_model

ENGINE_MAGIC = b"TKENGINE"


class CLIError(TensorkilnError):
    """A user error found by the command line itself (missing file, missing optional package)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``tensorkiln: error: ...`` and a pointer to --help, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"tensorkiln: error: {message} (see '{self.prog} --help')\n")


def add_common(p: argparse.ArgumentParser) -> None:
    """Options every subcommand takes; SUPPRESS keeps one given before the command."""
    p.add_argument(
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks on errors",
    )
    p.add_argument(
        "--plugins",
        metavar="MODULES",
        default=argparse.SUPPRESS,
        help="installed Python modules to import first, comma-separated module names (not "
        "files), which register custom ops with @tensorkiln.plugin (trtexec's --staticPlugins)",
    )


_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def import_plugins(names: str) -> None:
    """Import the plugin modules ``--plugins`` names; a name that is not a module name, or a
    module that does not import, is a CLIError naming it."""
    for name in (n.strip() for n in names.split(",")):
        if not _MODULE_NAME.fullmatch(name):
            raise CLIError(
                f"--plugins: '{name}' is not a Python module name; give installed modules by "
                "name (my_package.plugins), not files"
            )
        try:
            importlib.import_module(name)
        except Exception as exc:  # (the module's own error, whatever it is, in one line)
            raise CLIError(
                f"--plugins: cannot import '{name}': {type(exc).__name__}: {exc}"
            ) from exc


def add_backend_option(p: argparse.ArgumentParser, help: str) -> None:
    """--backend, as the Builder takes it (checked here too, for argparse's one-line error)."""
    p.add_argument("--backend", choices=("auto", *BACKEND_NAMES), default="auto", help=help)


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
    """'a:1x3x224x224,b:1x128' -> {'a': (1, 3, 224, 224), 'b': (1, 128)}, as trtexec reads them:
    the name ends at the last ':' and may be quoted ('input:0':1x3); 'c:' or 'c:scalar' is 0-d."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        name, sep, dims = item.rpartition(":")
        if len(name) >= 2 and name[0] == name[-1] == "'":
            name = name[1:-1]
        try:
            if not sep or not name:
                raise ValueError
            scalar = dims in ("", "scalar")
            shape = () if scalar else tuple(int(d) for d in dims.split("x"))
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


def parse_layer_precisions(text: str | None, flag: str = "--layer-precisions") -> dict[str, str]:
    """'conv1:fp32,/fc/Gemm:fp16' -> {'conv1': 'fp32', '/fc/Gemm': 'fp16'} (trtexec's
    --layerPrecisions): the name ends at the last ':' and may be quoted."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        name, sep, precision = item.rpartition(":")
        if len(name) >= 2 and name[0] == name[-1] == "'":
            name = name[1:-1]
        if not sep or not name or not precision:
            raise InputError(
                f"bad {flag} entry '{item}': expected LAYER:PRECISION, e.g. conv1:fp32"
            )
        if name in out:
            raise InputError(f"{flag} gives layer '{name}' twice")
        out[name] = precision.strip().lower()
    return out


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


def existing_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise CLIError(f"file '{p}' does not exist")
    if not p.is_file():
        raise CLIError(f"'{p}' is not a file")
    return p


TIMING_CACHE_MAX_BYTES = 256 << 20  # far above any real cache; a bound before reading it whole


def timing_cache_file(text: str | None) -> str | None:
    """--timing-cache: a regular file of bounded size, or one to be created (checked up front,
    so /dev/zero or a folder is a one-line error rather than a read without end)."""
    if text is None:
        return None
    p = Path(text)
    if p.exists() or p.is_symlink():
        if not p.is_file():
            raise CLIError(f"timing cache '{p}' is not a regular file; pass a .json file path")
        size = p.stat().st_size
        if size > TIMING_CACHE_MAX_BYTES:
            raise CLIError(
                f"timing cache '{p}' is {size:,} bytes, more than a timing cache can be "
                f"({TIMING_CACHE_MAX_BYTES:,}); delete it or pass another file"
            )
    elif not p.parent.is_dir():
        raise CLIError(f"cannot create timing cache '{p}': folder '{p.parent}' does not exist")
    return text


def is_engine_file(path: Path) -> bool:
    """Engines are recognised by their magic bytes, whatever the file is called."""
    with open(path, "rb") as f:
        return f.read(len(ENGINE_MAGIC)) == ENGINE_MAGIC


# What files mistaken for models start with. ONNX (a protobuf) has no magic of its own, so a file
# is an engine by its magic, one of these by theirs, and otherwise is tried as ONNX.
_SIGNATURES = (
    (b"PK\x03\x04", "a zip archive (an .npz, a PyTorch checkpoint or a zipped model?)"),
    (b"\x1f\x8b", "a gzip-compressed file (decompress it first)"),
    (b"\x93NUMPY", "a numpy .npy array"),
    (b"\x89HDF\r\n", "an HDF5 file (a Keras model? export it to ONNX)"),
    (b"\x7fELF", "an executable (ELF)"),
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
)
_PICKLE_PROTOCOLS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def sniff_file(path: Path) -> str | None:
    """'engine' for a tensorkiln engine; a description for a file that is surely not ONNX
    ('empty', 'a zip archive (...)', 'a text file ...'); None for a file worth parsing as ONNX."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(ENGINE_MAGIC):
        return "engine"
    if not head:
        return "empty"
    if len(head) < len(ENGINE_MAGIC) and ENGINE_MAGIC.startswith(head):
        return "a truncated tensorkiln engine"
    for magic, what in _SIGNATURES:
        if head.startswith(magic):
            return what
    if head[:2] in _PICKLE_PROTOCOLS:
        return "a Python pickle (never loaded: pickles can run code)"
    if head[8:10] == b'{"':  # an 8-byte header length, then the JSON header
        return "a safetensors file (weights without a graph; export the model to ONNX)"
    return _text_kind(head)


def _text_kind(head: bytes) -> str | None:
    """'a text file ...' when the first bytes read as text (protobuf field tags are not)."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:  # may end inside a multi-byte character: retry without the end
        try:
            text = head[:-3].decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not text or not all(c.isprintable() or c in "\t\r\n" for c in text):
        return None
    first = text.strip().splitlines()[0][:40] if text.strip() else ""
    kind = "JSON" if first[:1] in "{[" else "text"
    return f"a {kind} file (it starts with {first!r})"


def not_a_model(path: Path, what: str) -> CLIError:
    """The error for a file that is neither an engine nor an ONNX model, naming what it is."""
    return CLIError(
        f"'{path}' is neither a tensorkiln engine nor an ONNX model: it is {what}; give an "
        "engine from `tensorkiln build` or an .onnx model"
    )


def profile_from_shapes(shapes: dict[str, tuple[int, ...]]) -> Any:
    """One profile with min = opt = max for every named input (trtexec's --shapes at build time)."""
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


def load_or_build(
    path: str | os.PathLike, shapes: dict[str, tuple[int, ...]], backend: str = "auto"
) -> Loaded:
    """Load an engine file, or build an ONNX model in memory (``shapes`` fixes dynamic inputs)."""
    import time

    p = existing_file(path)
    kind = sniff_file(p)  # by content, never by the file's name
    if kind == "engine":
        return Loaded(Engine.load(p), p)
    if kind is not None:
        raise not_a_model(p, kind)

    try:
        proto, external = open_model(p)  # parsed once, here; external data checked, not read
    except ModelLoadError as exc:
        raise CLIError(f"'{p}' is not a tensorkiln engine (no TKENGINE magic), and {exc}") from None
    config = BuilderConfig()
    dynamic = _dynamic_shapes(proto, shapes)
    if dynamic:
        config.add_optimization_profile(profile_from_shapes(dynamic))
    builder = Builder(backend)
    t0 = time.perf_counter()
    # External data is found (and mapped, not copied) from the model's path.
    model = proto if external is None else p
    engine = builder.build(model, config, source_name=p.name)
    return Loaded(engine, p, builder.last_report, time.perf_counter() - t0)


def _dynamic_shapes(proto: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The --shapes entries worth a profile: those of inputs with a symbolic dim."""
    if not shapes:
        return {}
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
    """A rich table in a terminal; plain aligned columns otherwise (what scripts and tests read).

    Cells often hold names from a model or engine file: control characters are shown escaped and
    rich markup is never read in them, so a name like '[bold]' or an ESC sequence is shown as it is.
    """
    cells = [[printable(str(c)) for c in r] for r in rows]
    if sys.stdout.isatty() and not os.environ.get("NO_COLOR"):
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title=Text(title) if title else None, title_justify="left")
        for i, h in enumerate(headers):
            numeric = bool(cells) and all(_is_number(r[i]) for r in cells)
            table.add_column(Text(h), justify="right" if numeric else "left")
        for r in cells:
            table.add_row(*(Text(c) for c in r))
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
