"""Inputs for `run`, `compare` and `trtexec`: shapes, random data, .npz and raw files, each
bounded in size before anything is allocated."""

from __future__ import annotations

import argparse
import math
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tensorkiln.cli.common import CLIError, byte_count, existing_file, mib, sniff_file
from tensorkiln.errors import InputError
from tensorkiln.ir import DType


def _input_specs(engine: Any, named: dict[str, Any], flag: str) -> dict[str, Any]:
    """The engine's inputs by name; InputError when ``flag`` names one it does not have."""
    specs = {s.name: s for s in engine.inputs}
    unknown = [n for n in named if n not in specs]
    if unknown:
        raise InputError(
            f"{flag} names unknown input(s) {', '.join(map(repr, unknown))}; the engine's "
            f"inputs are {', '.join(map(repr, specs))}"
        )
    return specs


def input_shapes(engine: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Concrete input shapes: --shapes, else the first profile's opt shape, else dynamic dims = 1."""
    specs = _input_specs(engine, shapes, "--shapes")
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


RANDOM_INPUT_LIMIT = 2 << 30  # bytes per random input unless --max-input-bytes says otherwise


def add_input_limit_option(p: argparse.ArgumentParser) -> None:
    """--max-input-bytes: the bound random_inputs checks before allocating."""
    p.add_argument(
        "--max-input-bytes",
        type=byte_count,
        default=RANDOM_INPUT_LIMIT,
        metavar="BYTES",
        help="largest input array to allocate, random or from --load-inputs, e.g. 512M or 16G "
        f"(default {mib(RANDOM_INPUT_LIMIT)})",
    )


def _check_input_size(
    what: str, shape: Sequence[int], itemsize: int, limit: int, hint: str
) -> None:
    """Refuse before allocating: a huge shape must be a clear error, not a MemoryError."""
    nbytes = math.prod(shape) * itemsize
    if nbytes > limit:
        raise InputError(
            f"{what} of shape {list(shape)} needs {nbytes:,} bytes ({nbytes / (1 << 30):.1f} GiB), "
            f"above the limit of {limit:,}; {hint}raise the limit with --max-input-bytes "
            f"{_round_up_gib(nbytes)}G"
        )


def _round_up_gib(nbytes: int) -> int:
    return -(-nbytes // (1 << 30))


def random_inputs(
    engine: Any,
    shapes: dict[str, tuple[int, ...]],
    seed: int | None = None,
    limit: int = RANDOM_INPUT_LIMIT,
) -> dict[str, np.ndarray]:
    """Standard normal floats, small non-negative integers (0..9), random booleans.

    Raises InputError, before allocating, for an input of more than ``limit`` bytes.
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in engine.inputs:
        shape = shapes[spec.name]
        if spec.dtype is None:
            raise InputError(
                f"input '{spec.name}' has no declared type; give it with --load-inputs"
            )
        dt = DType[spec.dtype]
        what = f"random {dt.name} input '{spec.name}'"
        _check_input_size(
            what, shape, np.dtype(dt.numpy).itemsize, limit, "give smaller --shapes or "
        )
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


def load_inputs(path: str, limit: int = RANDOM_INPUT_LIMIT) -> dict[str, np.ndarray]:
    """Named arrays from an .npz file; each array's header is read, and its size checked against
    ``limit``, before the array itself (a small compressed file can hold a huge array)."""
    p = existing_file(path)
    if not zipfile.is_zipfile(p):
        kind = sniff_file(p)
        what = {"engine": "a tensorkiln engine", None: "not a zip archive"}.get(kind, kind)
        raise CLIError(
            f"'{p}' is not an .npz file of named arrays (it is {what}); save with np.savez"
        )
    try:
        with np.load(p, allow_pickle=False) as data:
            for member in data.zip.namelist():
                _check_npz_member(p, data.zip, member, limit)
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise CLIError(f"cannot read inputs from '{p}': {exc}") from None


def _check_npz_member(path: Path, archive: zipfile.ZipFile, member: str, limit: int) -> None:
    from numpy.lib import format as npy

    readers = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}
    with archive.open(member) as f:
        version = npy.read_magic(f)
        if version not in readers:
            raise ValueError(f"'{member}' has .npy format version {version}, not 1.0 or 2.0")
        shape, _, dtype = readers[version](f)
    name = member.removesuffix(".npy")
    _check_input_size(f"input '{name}' in '{path}'", shape, dtype.itemsize, limit, "")


def load_raw_inputs(
    engine: Any, files: dict[str, str], shapes: dict[str, tuple[int, ...]], limit: int
) -> dict[str, np.ndarray]:
    """Inputs from raw binary files, one per input (trtexec's --loadInputs): each file holds the
    input's elements in its dtype, C order, for its shape; its size must match exactly."""
    specs = _input_specs(engine, files, "--loadInputs")
    feeds = {}
    for name, path in files.items():
        dtype = np.dtype(DType[specs[name].dtype].numpy)
        shape = shapes[name]
        _check_input_size(f"input '{name}'", shape, dtype.itemsize, limit, "")
        p = existing_file(path)
        want = math.prod(shape) * dtype.itemsize
        size = p.stat().st_size
        if size != want:
            raise InputError(
                f"'{p}' holds {size:,} bytes; input '{name}' of shape {list(shape)} "
                f"({dtype}) needs {want:,}; set its shape with --shapes"
            )
        feeds[name] = np.fromfile(p, dtype=dtype, count=math.prod(shape)).reshape(shape)
    return feeds


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
