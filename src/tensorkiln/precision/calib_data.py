"""Calibration data: batches of feeds for the calibrators, from files or from Python.

A source is one of

* a folder of ``.npy`` / ``.npz`` files, read in name order: an ``.npz`` holds one array per model
  input, named after it; an ``.npy`` holds the only input of a one-input model. Each array is one
  sample (the input's shape without its batch axis) or several (the input's full rank);
* one ``.npz`` (or ``.npy``) file holding every sample, stacked on the first axis;
* any iterable of feeds (dicts from input name to array, each a batch as the model takes it),
  which is used as it comes: a generator is read once.

Samples from files are regrouped into batches of ``batch_size``. Files are hostile: only regular
files directly inside the folder are read (a link that leads out of it is refused), arrays are
read without pickle, and each array's size is checked from its header before it is read.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tensorkiln.errors import InputError
from tensorkiln.ir import Value

ARRAY_LIMIT = 1 << 30  # bytes: the largest array a calibration file may hold
DEFAULT_BATCH = 8
_SUFFIXES = (".npy", ".npz")


@dataclass(frozen=True)
class RandomCalibration:
    """Calibration on random inputs (standard normal floats, integers 0..9), as trtexec's --int8
    without a calibration cache: the engine's speed is real, its accuracy is not. Dimensions the
    build leaves dynamic are drawn as 1."""

    batches: int = 4
    seed: int = 0


@dataclass
class CalibrationData:
    """Where calibration feeds come from, and how many samples to use (None: all)."""

    source: str | os.PathLike | Iterable[Mapping[str, Any]]
    batch_size: int = DEFAULT_BATCH
    max_samples: int | None = None

    @property
    def one_shot(self) -> bool:
        """Whether the source can be read once only (an iterator, a generator)."""
        return isinstance(self.source, Iterator)

    def describe(self) -> str:
        if isinstance(self.source, RandomCalibration):
            return "of random inputs"
        if isinstance(self.source, str | os.PathLike):
            return f"'{os.fspath(self.source)}'"
        return f"a {type(self.source).__name__} of feeds"


def batches(data: CalibrationData, inputs: list[Value]) -> Iterator[dict[str, np.ndarray]]:
    """The feeds to calibrate with, checked against the graph's ``inputs``; at least one."""
    if not isinstance(data.batch_size, int) or data.batch_size < 1:
        raise InputError(
            f"the calibration batch size must be a positive integer, got {data.batch_size!r}"
        )
    if data.max_samples is not None and (
        not isinstance(data.max_samples, int) or data.max_samples < 1
    ):
        raise InputError(f"the calibration sample count must be positive, got {data.max_samples!r}")
    fixed = fixed_batch(inputs)
    if isinstance(data.source, RandomCalibration):
        feeds = _random(data.source, inputs)
    elif isinstance(data.source, str | os.PathLike):
        size = fixed or data.batch_size
        feeds = _batched(_file_samples(Path(data.source), inputs), size, exact=fixed is not None)
    elif isinstance(data.source, Mapping) or not isinstance(data.source, Iterable):
        raise InputError(
            "calibration data must be a folder or file of .npy/.npz, or an iterable of feeds "
            f"(dicts from input name to array), not a {type(data.source).__name__}"
        )
    else:
        feeds = _python_feeds(data.source, inputs)
    yield from _limited(feeds, data.max_samples, data.describe())


def _limited(feeds: Iterator[dict], limit: int | None, where: str) -> Iterator[dict]:
    taken = 0
    for feed in feeds:
        n = _batch_of(feed)
        if limit is not None and taken + n > limit:
            feed = {k: v[: limit - taken] for k, v in feed.items()}
            n = limit - taken
        if n:
            yield feed
        taken += n
        if limit is not None and taken >= limit:
            break
    if taken == 0:
        raise InputError(f"the calibration data {where} holds no samples")


def _batch_of(feed: Mapping[str, np.ndarray]) -> int:
    return int(next(iter(feed.values())).shape[0]) if feed else 0


def _random(source: RandomCalibration, inputs: list[Value]) -> Iterator[dict[str, np.ndarray]]:
    """Random feeds; a dimension the build left dynamic is 1 (as `tensorkiln run` draws them)."""
    rng = np.random.default_rng(source.seed)
    for v in inputs:
        if v.shape is None or v.dtype is None:
            raise InputError(
                f"random calibration needs the inputs' shapes; input '{v.name}' has none: give "
                "it with --shapes"
            )
    for _ in range(source.batches):
        feed = {}
        for v in inputs:
            dt = np.dtype(v.dtype.numpy)
            shape = tuple(d if isinstance(d, int) else 1 for d in v.shape)
            if dt.kind == "f":
                feed[v.name] = rng.standard_normal(shape).astype(dt)
            elif dt.kind == "b":
                feed[v.name] = rng.integers(0, 2, shape).astype(bool)
            else:
                feed[v.name] = rng.integers(0, 10, shape).astype(dt)
        yield feed


def _python_feeds(source: Iterable, inputs: list[Value]) -> Iterator[dict[str, np.ndarray]]:
    for k, feed in enumerate(source):
        where = f"calibration batch {k}"
        if not isinstance(feed, Mapping):
            raise InputError(
                f"{where} is a {type(feed).__name__}; each batch must be a dict from input name "
                "to array"
            )
        _check_names(set(feed), inputs, where)
        arrays = {v.name: _as_array(feed[v.name], where, v.name) for v in inputs}
        for v in inputs:
            _check_shape(arrays[v.name], v, where)
            batch = v.shape[0] if v.shape else None
            if isinstance(batch, int) and arrays[v.name].shape[0] != batch:
                raise InputError(
                    f"{where}: input '{v.name}' has batch {arrays[v.name].shape[0]}, but the "
                    f"engine fixes it at {batch} (shape {list(v.shape)}); give batches of {batch}"
                )
        _check_batches(arrays, where)
        yield arrays


def _as_array(x: Any, where: str, name: str) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray):
        raise InputError(f"{where}: input '{name}' is a {type(x).__name__}, not an array")
    return x


def _check_names(names: set[str], inputs: list[Value], where: str) -> None:
    want = {v.name for v in inputs}
    missing, unknown = sorted(want - names), sorted(names - want)
    if missing or unknown:
        parts = ([f"lacks {', '.join(map(repr, missing))}"] if missing else []) + (
            [f"has unknown {', '.join(map(repr, unknown))}"] if unknown else []
        )
        raise InputError(
            f"{where} {' and '.join(parts)}; the model's inputs are "
            f"{', '.join(repr(v.name) for v in inputs)}"
        )


def _check_shape(a: np.ndarray, v: Value, where: str) -> None:
    """``a`` fits input ``v``: numbers, of the input's rank, matching its fixed dimensions after
    the first (the batch axis)."""
    if a.dtype.kind not in "fiub":
        raise InputError(f"{where}: input '{v.name}' has dtype {a.dtype}, not a number")
    shape = v.shape
    if shape is None:
        return
    if a.ndim != len(shape):
        raise InputError(
            f"{where}: input '{v.name}' has shape {list(a.shape)}, but the model's input has "
            f"shape {list(shape)} (a batch has rank {len(shape)}, one sample {len(shape) - 1})"
        )
    for d, (want, have) in enumerate(zip(shape[1:], a.shape[1:]), 1):
        if isinstance(want, int) and want != have:
            raise InputError(
                f"{where}: input '{v.name}' has shape {list(a.shape)}; the model's input has "
                f"{want} at axis {d} (shape {list(shape)})"
            )


def _check_batches(arrays: Mapping[str, np.ndarray], where: str) -> None:
    sizes = {k: a.shape[0] if a.ndim else None for k, a in arrays.items()}
    if len(set(sizes.values())) > 1:
        raise InputError(f"{where}: the inputs' batch sizes differ: {sizes}")


def _file_samples(path: Path, inputs: list[Value]) -> Iterator[dict[str, np.ndarray]]:
    """Feeds of one or more samples each, from a file or a folder's files."""
    if path.is_dir():
        files = _folder_files(path)
        if not files:
            raise InputError(f"the calibration folder '{path}' holds no .npy or .npz file")
    elif path.is_file():
        files = [path]
    else:
        raise InputError(f"calibration data '{path}' does not exist")
    for f in files:
        yield _read_samples(f, inputs)


def _folder_files(folder: Path) -> list[Path]:
    root = folder.resolve()
    out = []
    for entry in sorted(folder.iterdir()):
        if entry.suffix.lower() not in _SUFFIXES:
            continue
        real = entry.resolve()
        if real.parent != root or not real.is_file():
            raise InputError(
                f"'{entry}' is not a regular file of the calibration folder '{folder}' (a link "
                "that leads out of it, or a folder); calibration reads only the folder's own files"
            )
        out.append(real)
    return out


def _read_samples(path: Path, inputs: list[Value]) -> dict[str, np.ndarray]:
    where = f"calibration file '{path}'"
    try:
        if path.suffix.lower() == ".npz" or zipfile.is_zipfile(path):
            arrays = _read_npz(path, where)
        else:
            if len(inputs) != 1:
                raise InputError(
                    f"{where} is an .npy file, which holds one array, but the model has "
                    f"{len(inputs)} inputs; save each sample as an .npz with arrays named "
                    f"{', '.join(repr(v.name) for v in inputs)}"
                )
            arrays = {inputs[0].name: _read_npy(path, where)}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InputError(f"cannot read {where}: {exc}") from None
    _check_names(set(arrays), inputs, where)
    out = {}
    for v in inputs:
        a = arrays[v.name]
        if v.shape is not None and a.ndim == len(v.shape) - 1:
            a = a[None]  # one sample
        _check_shape(a, v, where)
        out[v.name] = a
    _check_batches(out, where)
    return out


def _read_npy(path: Path, where: str) -> np.ndarray:
    with open(path, "rb") as f:
        _check_header(f, where, "the array")
    return np.load(path, allow_pickle=False)


def _read_npz(path: Path, where: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        for member in data.zip.namelist():
            with data.zip.open(member) as f:
                _check_header(f, where, f"array '{member.removesuffix('.npy')}'")
        return {k: data[k] for k in data.files}


def _check_header(f: Any, where: str, what: str) -> None:
    """Read an .npy header and refuse an array above ARRAY_LIMIT bytes or of object dtype."""
    from numpy.lib import format as npy

    readers = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}
    version = npy.read_magic(f)
    if version not in readers:
        raise ValueError(f"{what} has .npy format version {version}, not 1.0 or 2.0")
    shape, _, dtype = readers[version](f)
    if dtype.hasobject:
        raise ValueError(f"{what} holds Python objects, which calibration does not read")
    nbytes = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    if nbytes > ARRAY_LIMIT:
        raise InputError(
            f"{where}: {what} of shape {list(shape)} needs {nbytes:,} bytes, above the limit of "
            f"{ARRAY_LIMIT:,}; split it into several files of the calibration folder"
        )


def fixed_batch(inputs: list[Value]) -> int | None:
    """The batch size every input fixes (its first dimension), if they all do."""
    sizes = {v.shape[0] if v.shape else None for v in inputs}
    size = sizes.pop() if len(sizes) == 1 else None
    return size if isinstance(size, int) and size > 0 else None


def _batched(
    samples: Iterator[dict[str, np.ndarray]], size: int, exact: bool = False
) -> Iterator[dict[str, np.ndarray]]:
    """Regroup feeds of any number of samples into batches of ``size``; the last may be short
    unless ``exact`` (the engine fixes the batch: the remainder is left out)."""
    held: list[dict[str, np.ndarray]] = []
    count = 0
    for feed in samples:
        start = 0
        n = _batch_of(feed)
        while start < n:
            take = min(size - count, n - start)
            held.append({k: a[start : start + take] for k, a in feed.items()})
            count += take
            start += take
            if count == size:
                yield _concat(held)
                held, count = [], 0
    if held and not exact:
        yield _concat(held)


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return {k: np.ascontiguousarray(a) for k, a in parts[0].items()}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
