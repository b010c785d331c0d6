"""Calibration: run the float32 graph over calibration data, histogram the tensors that will be
quantized, and pick each one's range with a calibrator; keep the ranges in a calibration cache.

The cache is a JSON file a person can read and a stranger may have written::

    {"format": "tensorkiln-calibration", "version": 1, "precision": "int8",
     "calibrator": "entropy", "percentile": null, "samples": 512, "data": "sha256:...",
     "tensors": {"input.1": {"amax": 2.64, "scale": 0.0208}, ...}}

A later build with the same cache skips calibration (TensorRT's calibration cache); a cache made
for another model, precision or calibrator is refused with a message that says which.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tensorkiln.errors import BuildError, InputError
from tensorkiln.ir import Graph, Value
from tensorkiln.precision.calib_data import CalibrationData, batches
from tensorkiln.precision.calibrators import (
    DEFAULT_CALIBRATOR,
    DEFAULT_PERCENTILE,
    QMAX,
    Histogram,
    add_numpy,
    check_method,
    choose_amax,
)

CACHE_FORMAT = "tensorkiln-calibration"
CACHE_VERSION = 1
CACHE_LIMIT = 64 << 20  # bytes: the largest calibration cache read
CHANNEL_LIMIT = 1 << 20  # channels of one tensor in a cache
_SHOWN = 5  # tensor names listed in an error


@dataclass
class CalibrationTable:
    """Each calibrated tensor's range, and how the ranges were found."""

    precision: str
    calibrator: str
    amax: dict[str, float]
    percentile: float | None = None
    samples: int = 0
    data: str = ""  # the calibration data's fingerprint
    # the largest magnitude per channel (last axis) of the tensors smoothing reads
    channels: dict[str, list[float]] = field(default_factory=dict)

    def scale(self, name: str) -> float:
        """The quantization scale of tensor ``name``: ``amax / QMAX``, and 1 for a tensor that was
        always zero (any scale represents it)."""
        amax = self.amax[name]
        return amax / QMAX[self.precision] if amax > 0 else 1.0

    def to_json(self) -> dict:
        return {
            "format": CACHE_FORMAT,
            "version": CACHE_VERSION,
            "precision": self.precision,
            "calibrator": self.calibrator,
            "percentile": self.percentile,
            "samples": self.samples,
            "data": self.data,
            "tensors": {
                k: {"amax": a, "scale": self.scale(k)}
                | ({"channel_amax": self.channels[k]} if k in self.channels else {})
                for k, a in sorted(self.amax.items())
            },
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the cache (atomically: a reader never sees half a file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            raise InputError(f"cannot write the calibration cache '{path}': {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationTable:
        """Read and check a cache; every malformed one is an InputError naming the file."""
        path = Path(path)
        where = f"calibration cache '{path}'"
        try:
            size = path.stat().st_size
            if size > CACHE_LIMIT:
                raise InputError(f"{where} holds {size:,} bytes, above the {CACHE_LIMIT:,} limit")
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError) as exc:
            raise InputError(f"cannot read {where}: {exc}") from None
        return cls.from_json(doc, where)

    @classmethod
    def from_json(cls, doc: Any, where: str) -> CalibrationTable:
        if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT:
            raise InputError(f"{where} is not a tensorkiln calibration cache (no format field)")
        if doc.get("version") != CACHE_VERSION:
            raise InputError(
                f"{where} has version {doc.get('version')!r}; this tensorkiln reads version "
                f"{CACHE_VERSION}: delete it and calibrate again"
            )
        precision, calibrator = doc.get("precision"), doc.get("calibrator")
        percentile = doc.get("percentile")
        if precision not in QMAX or not isinstance(calibrator, str):
            raise InputError(
                f"{where}: precision {precision!r} / calibrator {calibrator!r} unknown"
            )
        try:
            check_method(
                calibrator, precision, DEFAULT_PERCENTILE if percentile is None else percentile
            )
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None
        tensors = doc.get("tensors")
        if not isinstance(tensors, dict):
            raise InputError(f"{where} has no 'tensors' object")
        amax, channels = {}, {}
        for name, entry in tensors.items():
            a = entry.get("amax") if isinstance(entry, dict) else None
            if not _range(a):
                raise InputError(
                    f"{where}: tensor '{name}' has range {a!r}; a range is a finite number >= 0"
                )
            amax[name] = float(a)
            c = entry.get("channel_amax")
            if c is not None:
                if not isinstance(c, list) or len(c) > CHANNEL_LIMIT or not all(map(_range, c)):
                    raise InputError(
                        f"{where}: tensor '{name}' has a malformed channel_amax; it is a list of "
                        f"at most {CHANNEL_LIMIT:,} finite numbers >= 0"
                    )
                channels[name] = [float(v) for v in c]
        samples = doc.get("samples", 0)
        return cls(
            precision,
            calibrator,
            amax,
            percentile,
            samples if isinstance(samples, int) else 0,
            str(doc.get("data", "")),
            channels,
        )

    def check_fits(
        self, tensors: Mapping[str, str], where: str, channels: Collection[str] = ()
    ) -> None:
        """Every tensor the build quantizes (name -> the layer that reads it) has a range, and
        those in ``channels`` their per-channel ranges."""
        missing = [k for k in tensors if k not in self.amax]
        missing += [k for k in channels if k in self.amax and k not in self.channels]
        if missing:
            shown = ", ".join(f"'{k}' (read by {tensors[k]})" for k in missing[:_SHOWN])
            more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
            raise BuildError(
                f"{where} has no range for {len(missing)} of the {len(tensors)} tensors this build "
                f"quantizes: {shown}{more}. It was made for another model or another "
                "optimization level: delete it, or build with calibration data to remake it"
            )


@dataclass
class CalibrationRequest:
    """What the builder is asked to calibrate with (BuilderConfig's calibration fields)."""

    data: CalibrationData | None = None
    cache: str | os.PathLike | None = None
    calibrator: str | None = None  # None: DEFAULT_CALIBRATOR[precision]
    percentile: float = DEFAULT_PERCENTILE
    notes: list[str] = field(default_factory=list)
    keep_batches: int = 0  # the first batches to keep in ``kept`` (for the accuracy budget)
    kept: list[dict[str, np.ndarray]] = field(default_factory=list)
    histograms: dict[str, Histogram] | None = None  # set to {} to receive them (for plots)
    capture: frozenset[str] = frozenset()  # tensors whose first batch's values to keep...
    captured: dict[str, np.ndarray] = field(default_factory=dict)  # ...here (host copies)
    # the ranges quantize_graph used, kept for a second quantization of the same graph in one
    # build (the data may be an iterator, read once); given, they are used as they are
    table: CalibrationTable | None = None


Progress = Callable[[int, int], None]  # (samples done, batches done)


def calibrate(
    graph: Graph,
    executor_factory: Callable[[Graph], Any],
    tensors: Mapping[Value, str],
    precision: str,
    request: CalibrationRequest,
    progress: Progress | None = None,
    channels: Collection[Value] = (),
    optional: Mapping[Value, str] | None = None,
) -> CalibrationTable:
    """Each of ``tensors``' range (a Value of ``graph`` -> the layer that quantizes it), from the
    cache when it has them, else by running ``graph`` (float32) over the calibration data with an
    executor ``executor_factory(graph)`` makes; a new table is written to the cache path.
    ``optional`` tensors are calibrated with them, but a cache without their ranges still fits
    (the build leaves those tensors in float)."""
    optional = optional or {}
    names = {v.name: layer for v, layer in tensors.items()}  # (what the cache must have)
    tensors = {**optional, **tensors}
    method = request.calibrator or DEFAULT_CALIBRATOR[precision]
    check_method(method, precision, request.percentile)
    cache = Path(request.cache) if request.cache is not None else None
    if cache is not None and cache.exists():
        table = CalibrationTable.load(cache)
        where = f"the calibration cache '{cache}'"
        _check_same_method(table, precision, request, where)
        table.check_fits(names, where, [v.name for v in channels])
        request.notes.append(
            f"calibration: ranges of {len(names)} tensors from {where} ({table.calibrator}, "
            f"{table.samples} samples); delete it to calibrate again"
        )
        return table
    if request.data is None:
        raise BuildError(
            f"{precision.upper()} needs calibration: give calibration data (--calib-data PATH, "
            "BuilderConfig.calibration_data) or a calibration cache (--calib-cache FILE; "
            "trtexec's --calib), or build a model that carries its own "
            "QuantizeLinear/DequantizeLinear nodes"
        )
    hists, samples, digest = collect(
        graph, executor_factory, list(tensors), request.data, progress, request, set(channels)
    )
    if request.histograms is not None:
        request.histograms.update(hists)
    percentile = request.percentile if method == "percentile" else None
    amax = {
        v.name: choose_amax(hists[v.name], method, precision, request.percentile) for v in tensors
    }
    per_channel = {
        v.name: hists[v.name].channels.tolist()
        for v in channels
        if hists[v.name].channels is not None
    }
    table = CalibrationTable(precision, method, amax, percentile, samples, digest, per_channel)
    request.notes.append(
        f"calibration: {samples} samples, {method} calibrator, {len(amax)} tensors"
    )
    if cache is not None:
        table.save(cache)
        request.notes.append(f"calibration: wrote the ranges of {len(amax)} tensors to '{cache}'")
    return table


def _range(a: Any) -> bool:
    return isinstance(a, int | float) and not isinstance(a, bool) and math.isfinite(a) and a >= 0


def _check_same_method(
    table: CalibrationTable, precision: str, request: CalibrationRequest, where: str
) -> None:
    if table.precision != precision:
        raise BuildError(
            f"{where} holds {table.precision.upper()} ranges; this build quantizes to "
            f"{precision.upper()}: give another cache file, or delete it to calibrate again"
        )
    if request.calibrator is not None and request.calibrator != table.calibrator:
        raise BuildError(
            f"{where} was made by the {table.calibrator} calibrator, not {request.calibrator}: "
            "delete it to calibrate again with the calibrator asked for"
        )


def collect(
    graph: Graph,
    executor_factory: Callable[[Graph], Any],
    tensors: list[Value],
    data: CalibrationData,
    progress: Progress | None = None,
    keep: CalibrationRequest | None = None,
    channels: Collection[Value] = (),
) -> tuple[dict[str, Histogram], int, str]:
    """Histograms of ``tensors``' magnitudes over the calibration data, the sample count and the
    data's fingerprint; the first ``keep.keep_batches`` batches go to ``keep.kept``."""
    hists = {v.name: Histogram.empty() for v in tensors}
    wanted = set(tensors)
    executor = executor_factory(graph)
    digest = hashlib.sha256()
    samples = 0

    by_channel = set(channels)

    capture = keep.capture if keep is not None else frozenset()

    def observe(node: Any, outputs: list[Any]) -> None:
        for v, x in zip(node.outputs, outputs):
            if v in wanted and x is not None:
                _add(hists[v.name], x, v in by_channel)
                if v.name in capture and v.name not in keep.captured:
                    keep.captured[v.name] = _host(x)

    for n_batches, feed in enumerate(batches(data, graph.inputs), 1):
        feed = typed_feed(feed, graph.inputs)
        if keep is not None and len(keep.kept) < keep.keep_batches:
            keep.kept.append(feed)
        _digest(digest, feed)
        for v in graph.inputs:
            if v in wanted:
                _add(hists[v.name], feed[v.name], v in by_channel)
                if v.name in capture and v.name not in keep.captured:
                    keep.captured[v.name] = np.asarray(feed[v.name])
        executor.run({v: feed[v.name] for v in graph.inputs}, observer=observe)
        samples += int(next(iter(feed.values())).shape[0]) if feed else 0
        if progress is not None:
            progress(samples, n_batches)
    return hists, samples, "sha256:" + digest.hexdigest()


def capture(
    graph: Graph, executor_factory: Callable[[Graph], Any], feed: dict, names: Collection[str]
) -> dict[str, np.ndarray]:
    """The values of the tensors ``names`` on one feed, as numpy."""
    out = {v.name: np.asarray(feed[v.name]) for v in graph.inputs if v.name in names}

    def observe(node: Any, outputs: list[Any]) -> None:
        for v, x in zip(node.outputs, outputs):
            if v is not None and v.name in names and x is not None:
                out[v.name] = _host(x)

    executor_factory(graph).run({v: feed[v.name] for v in graph.inputs}, observer=observe)
    return out


def _host(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.copy()
    return x.detach().float().cpu().numpy()


def first_batches(graph: Graph, data: CalibrationData, count: int) -> list[dict[str, np.ndarray]]:
    """The first ``count`` batches of the calibration data, in the graph's input dtypes."""
    out = []
    for feed in batches(data, graph.inputs):
        out.append(typed_feed(feed, graph.inputs))
        if len(out) >= count:
            break
    return out


def typed_feed(feed: dict[str, np.ndarray], inputs: list[Value]) -> dict[str, np.ndarray]:
    """Feeds in the dtypes of the graph's inputs (float64 data for a float32 input, say)."""
    out = {}
    for v in inputs:
        a = feed[v.name]
        want = np.dtype(v.dtype.numpy) if v.dtype is not None else a.dtype
        if a.dtype != want:
            if (a.dtype.kind == "f") != (want.kind == "f"):
                raise InputError(
                    f"calibration input '{v.name}' is {a.dtype}; the model's input is {want}"
                )
            a = a.astype(want)
        out[v.name] = a
    return out


def _digest(h: Any, feed: dict[str, np.ndarray]) -> None:
    for name in sorted(feed):
        a = np.ascontiguousarray(feed[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())


def _add(hist: Histogram, x: Any, channels: bool = False) -> None:
    """Count ``x``'s magnitudes, on the device that holds it (numpy array or torch tensor);
    ``channels``: also the largest magnitude per index of its last axis."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        x = np.asarray(x)
        if channels and x.ndim and x.size:
            hist.add_channels(np.abs(x.reshape(-1, x.shape[-1])).max(axis=0))
        add_numpy(hist, x)
        return
    if channels and x.ndim and x.numel():
        hist.add_channels(x.detach().reshape(-1, x.shape[-1]).abs().amax(0).double().cpu().numpy())
    a = x.detach().reshape(-1).abs().float()
    if a.numel() == 0:
        return
    bins = hist.bins_for(float(a.max()))
    if hist.width == 0.0:
        hist.add_counts(np.array([a.numel()], np.float64))
        return
    counts = a.histc(bins=bins, min=0.0, max=bins * hist.width)
    hist.add_counts(counts.double().cpu().numpy())
