"""The Builder: model in, Engine out (TensorRT's IBuilder, in Python).

Phases: parse (import + shape inference), optimize (graph passes, by optimization level), tactics
(choose each layer's implementation and precision), memory (plan the activation arena). Each phase
is timed for the build report; a progress bar shows in a terminal.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from tensorkiln.backends import Backend, get_backend, resolve
from tensorkiln.builder.config import QUANTIZED_PRECISIONS, BuilderConfig, OptimizationProfile
from tensorkiln.builder.precision_choice import (
    FLOAT_LAYERS,
    build_ms,
    chooses_precision,
    compare_layers,
    copy_graph,
    kept_float_note,
    kept_whole_note,
    layer_ms,
    quantized_defaults_notes,
)
from tensorkiln.builder.profiles import (
    check_profiles,
    guessed_shapes_notes,
    opt_shapes,
    pin_fixed_dims,
    profile_extremes,
    tuning_shapes_error,
)
from tensorkiln.engine.engine import Engine
from tensorkiln.engine.memory import max_profile_symbols, plan_memory
from tensorkiln.errors import BuildError, GraphError, TensorkilnError
from tensorkiln.frontends.onnx import import_onnx, load_model_proto
from tensorkiln.ir import Graph
from tensorkiln.ir.verify import verify
from tensorkiln.kernels.evaluate import infer_shapes
from tensorkiln.kernels.registry import lookup
from tensorkiln.passes import PassManager
from tensorkiln.passes.remove_padding import remove_padding
from tensorkiln.precision import DefaultPolicy, PrecisionPolicy, engine_precision
from tensorkiln.precision.budget import AccuracyBudget
from tensorkiln.precision.calib_data import CalibrationData
from tensorkiln.precision.calibration import CalibrationRequest
from tensorkiln.precision.io import set_io_types
from tensorkiln.precision.overflow import value_ranges
from tensorkiln.precision.quantize import quantize_graph
from tensorkiln.runtime.executor import Executor
from tensorkiln.runtime.mathmode import math_mode
from tensorkiln.tactics.autotune import TuneOptions, choose_tactics, describe_layer
from tensorkiln.tactics.cache import TimingCache

log = logging.getLogger(__name__)


@dataclass
class BuildReport:
    """What a build did: per-phase seconds, layers with their implementation, the memory plan."""

    phases: dict[str, float] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)  # optimizer matches per pass
    nodes_before: int = 0  # nodes after import, before the optimizer
    layers: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    timing_cache: dict = field(default_factory=dict)  # hits and misses of the tactic timing cache
    notes: list[str] = field(default_factory=list)  # what the user may want to know or change
    # INT8/FP8 builds choosing per layer: layer -> its measured ms quantized (with the
    # QuantizeLinear feeding it alone), in float, and the precision kept
    precision_choice: dict[str, dict] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"layers: {len(self.layers)} (from {self.nodes_before} nodes)"]
        lines += [f"{name}: {secs * 1e3:.1f} ms" for name, secs in self.phases.items()]
        lines += [f"pass {name}: {n}" for name, n in self.passes.items()]
        if self.timing_cache:
            tc = self.timing_cache
            lines.append(f"timing cache: {tc['hits']} hits, {tc['misses']} misses")
        kept = [x for x in self.layers if x.get("fallback")]
        if kept:  # tuning could not measure these; they run their default kernel
            lines.append(f"tuning kept the default kernel of {len(kept)} layers:")
            lines += [f"  {x['name']}: {x['fallback']}" for x in kept]
        lines += [f"note: {n}" for n in self.notes]
        if self.precision_choice:
            q = sum(c["quantized_ms"] for c in self.precision_choice.values())
            f = sum(c["float_ms"] for c in self.precision_choice.values())
            kept = sum(c["kept"] == "float" for c in self.precision_choice.values())
            lines.append(
                f"precision choice: {len(self.precision_choice)} layers timed both ways, "
                f"{q:.3f} ms quantized (with their own QuantizeLinear) against {f:.3f} ms in "
                f"float; {kept} kept in float"
            )
        if self.memory:
            lines.append(
                f"activation memory: planned peak {self.memory['peak_bytes']:,} bytes, naive sum "
                f"{self.memory['naive_bytes']:,} bytes"
            )
        return "\n".join(lines)


class Builder:
    """Builds engines for one backend: 'reference' (numpy, any CPU, the oracle), 'cpu' (the torch
    kernels on CPU tensors: oneDNN convolutions and GEMMs; needs PyTorch), 'cuda', or 'auto'
    (cuda where a CUDA device is present, else cpu where PyTorch is installed, else reference).

    ``device`` is the torch device of the cuda backend: 'cuda' (default) or 'cpu', which runs the
    same torch kernels on the CPU (for tests; its timings say nothing about a GPU).
    """

    def __init__(self, backend: str = "auto", device: str | None = None) -> None:
        # (names, as users and configs give them; the Backend object is made at build time)
        self.backend, self.device = resolve(backend, device)
        self.last_report: BuildReport | None = None

    def create_builder_config(self) -> BuilderConfig:
        return BuilderConfig()

    def create_optimization_profile(self) -> OptimizationProfile:
        return OptimizationProfile()

    def build(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto,
        config: BuilderConfig | None = None,
        *,
        progress: bool | None = None,
        source_name: str | None = None,
    ) -> Engine:
        """Build an engine from an ONNX model (path, bytes or ModelProto).

        ``source_name`` is the model's name recorded in the engine (default: the file's name).
        Raises BuildError when the planned activation memory exceeds ``config.memory_limit``.
        """
        # precisions this backend cannot honour are refused or dropped with a warning
        config = (config or BuilderConfig()).for_backend(self.backend)
        backend = get_backend(self.backend, self.device)
        report = BuildReport()
        with _Progress(progress) as bar:
            with _phase(report, "parse", bar):
                source_bytes, default_name = _source_bytes(model, config.embed_source)
                graph = import_onnx(model, backend=self.backend)
                check_profiles(graph, config.profiles)
                report.notes += pin_fixed_dims(graph, config.profiles)
            with _phase(report, "optimize", bar):
                report.nodes_before = len(graph.nodes)
                # (a quantized build's GEMMs become QGemmAct, which takes no residual)
                skip = (
                    frozenset({"fold_residual_into_gemm"})
                    if _quantized_precision(config)
                    else frozenset()
                )
                report.passes = optimize(
                    graph, config.optimization_level, config.dump_ir, self.backend, skip
                )
                if config.remove_padding:
                    graph = _remove_padding(graph, report)
            quantized = _quantized_precision(config)
            request = _calibration_request(config)
            float_graph = None
            before = list(report.notes)
            if quantized is not None:
                if chooses_precision(graph, config, backend):
                    float_graph = copy_graph(graph)
                with _phase(report, "calibrate", bar):
                    report.notes += _quantize(graph, config, backend, quantized, bar, request)
            policy = config.precision_policy or DefaultPolicy(_fp16_ranges(graph, config, backend))
            # (the tactic timing cache: read and written by backends that tune)
            tuned = backend.autotunes and config.timing_cache
            cache = TimingCache.load(config.timing_cache) if tuned else TimingCache()
            chooses = float_graph is not None  # (its quantizations are then timed too)
            precision = _lower(graph, config, backend, policy, report, bar, cache, chooses)
            if chooses and report.layers:
                with _phase(report, "precision choice", bar):
                    floats = _float_layer_ms(
                        copy_graph(float_graph), config, backend, policy, cache
                    )
                    report.precision_choice = compare_layers(report.layers, floats)
                settled, precision = _settle_precision(
                    float_graph, floats, report, before, bar, quantized, precision,
                    lambda g, slower: _quantize(g, config, backend, quantized, bar, request, slower),
                    lambda g: _lower(g, config, backend, policy, report, bar, cache, True),
                )  # fmt: skip
                graph = graph if settled is None else settled
            if tuned:
                cache.save(config.timing_cache)
            with _phase(report, "memory", bar):
                report.memory = plan_memory(
                    graph, max_profile_symbols(graph, config.profiles)
                ).to_json()
                _check_memory_limit(report.memory, config.memory_limit)
        self.last_report = report
        return Engine(
            graph,
            backend=self.backend,
            profiles=config.profiles,
            layers=report.layers,
            memory=report.memory,
            source={
                "name": source_name or default_name,
                "sha256": hashlib.sha256(source_bytes).hexdigest(),
            },
            source_model=source_bytes if config.embed_source else None,
            build={
                "config": config.to_json(),
                "phases_s": report.phases,
                "passes": report.passes,
                "nodes_before": report.nodes_before,
                "precision": precision,
                "timing_cache": report.timing_cache,
                "notes": report.notes,
            },
            target=backend.target(),
        )


def _fp16_ranges(graph: Graph, config: BuilderConfig, backend: Backend) -> dict | None:
    """Every tensor's range on the calibration data, for the fp16 overflow guard: on an fp16
    engine given calibration data, else None (no guard)."""
    data = _calibration_data(config)
    if engine_precision(config.precisions) != "fp16" or data is None:
        return None
    if data.one_shot and _quantized_precision(config) is not None:
        return None  # (calibration read the iterator already)
    return value_ranges(graph, lambda g: Executor(g, backend), data)


def _calibration_data(config: BuilderConfig) -> CalibrationData | None:
    if config.calibration_data is None:
        return None
    return CalibrationData(
        config.calibration_data, config.calibration_batch_size, config.calibration_samples
    )


def _quantized_precision(config: BuilderConfig) -> str | None:
    """The quantized precision the build allows: int8 before fp8 (None: neither)."""
    return next((p for p in QUANTIZED_PRECISIONS if p in config.precisions), None)


def _calibration_request(config: BuilderConfig) -> CalibrationRequest:
    return CalibrationRequest(
        _calibration_data(config),
        config.calibration_cache,
        config.calibrator,
        config.calibration_percentile,
    )


def _quantize(
    graph: Graph,
    config: BuilderConfig,
    backend: Backend,
    precision: str,
    bar: _Progress,
    request: CalibrationRequest,
    keep_float: set[str] = frozenset(),
) -> list[str]:
    """Calibrate the optimized float graph and quantize its convolutions and GEMMs, but those
    pinned to a float precision and ``keep_float``."""
    pinned = {k for k, p in config.layer_precisions.items() if p not in QUANTIZED_PRECISIONS}
    notes = quantize_graph(
        graph,
        precision,
        request,
        lambda g: Executor(g, backend),
        exclude=pinned | set(keep_float),
        progress=bar.status,
        budget=None
        if config.accuracy_budget is None
        else AccuracyBudget.parse(config.accuracy_budget),
        smooth=config.smooth_quant,
    )
    # (the optimizer ran on the float graph: its fusions of quantized layers run now)
    optimize(graph, config.optimization_level, backend=backend.name, quantized_only=True)
    infer_shapes(graph)
    verify(graph)
    return notes


def _check_memory_limit(memory: dict, limit: int | None) -> None:
    if limit is not None and memory["peak_bytes"] > limit:
        raise BuildError(
            f"the planned activation memory ({memory['peak_bytes']:,} bytes at the profiles' "
            f"largest shapes) exceeds the memory limit of {limit:,} bytes; raise the limit or "
            "build with smaller --max-shapes"
        )


def optimize(
    graph: Graph,
    level: int,
    dump_dir: str | os.PathLike | None = None,
    backend: str | None = None,
    exclude: frozenset[str] = frozenset(),
    quantized_only: bool = False,
) -> dict[str, int]:
    """Run the graph optimizer at ``level`` (0 = none) in place, with the passes of ``backend``
    (None: all) but those named in ``exclude`` (with ``quantized_only``, only the fusions of
    quantized layers); returns matches per pass."""
    if level <= 0:
        return {}
    pm = PassManager(
        level, dump_dir=dump_dir, backend=backend, exclude=exclude, quantized_only=quantized_only
    )
    pm.run(graph)
    infer_shapes(graph)
    verify(graph)
    return {name: n for name, n in pm.stats.items() if n}


def _remove_padding(graph: Graph, report: BuildReport) -> Graph:
    """``graph`` with its masked tokens packed (passes/remove_padding.py), or ``graph`` itself
    where it does not qualify; the report gets the pass's note either way."""
    packed = copy_graph(graph)
    try:
        count, note = remove_padding(packed)
        if count:
            verify(packed)
    except GraphError as exc:  # (a rewrite that did not check out: build without it)
        count, note = 0, f"padding not removed: {exc}"
    report.notes.append(note)
    if not count:
        return graph
    report.passes["remove_padding"] = count
    return packed


def _source_bytes(model: Any, embed: bool) -> tuple[bytes, str]:
    """The model as recorded in the engine (hashed; embedded when ``embed``), and its name.

    External data is pulled in only to embed it: a model whose data files are larger than one
    protobuf can hold still builds, its record hashing the model file alone."""
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString(), "model.onnx"
    if isinstance(model, bytes | bytearray):
        return bytes(model), "model.onnx"
    path = Path(model)
    if not embed and path.is_file():
        return path.read_bytes(), path.name  # (import_onnx checks the file and its data)
    proto = load_model_proto(path)  # validates and pulls external data in
    return proto.SerializeToString(), path.name


def _record_formats(graph: Graph, backend: Backend) -> None:
    """Mark the 2-D convolutions that run channels-last: those whose weights the backend holds
    NHWC (the cpu backend, and the cuda backend on a GPU) take and give "hwc" tensors (TensorRT's
    kHWC); the rest of the graph keeps the layout it is given ("linear" where none was set)."""
    if not backend.holds_weights:
        return
    for n in graph.nodes:
        w = n.inputs[1] if len(n.inputs) > 1 else None
        conv = (n.domain, n.op) in (("", "Conv"), ("tensorkiln", "ConvAct"))
        if conv and w is not None and w.const is not None and w.const.ndim == 4:
            n.format = "hwc"


def _apply_precision(
    graph: Graph, config: BuilderConfig, policy: PrecisionPolicy
) -> tuple[str, list[str]]:
    """The policy decides each layer's precision and format and rewrites the graph to them;
    returns the engine-wide precision and notes naming the layers kept in fp32, and why."""
    plan = policy.assign(graph, config)
    return plan.engine, policy.rewrite(graph, plan)


def _lower(
    graph: Graph,
    config: BuilderConfig,
    backend: Backend,
    policy: PrecisionPolicy,
    report: BuildReport,
    bar: _Progress,
    cache: TimingCache,
    time_quantize: bool = False,
) -> str:
    """The precision and tactics phases on ``graph``: each layer's precision, the I/O types and
    formats, then each layer's kernel (``report.layers``); returns the engine's precision.
    ``time_quantize``: QuantizeLinear layers are timed too (for the precision choice)."""
    with _phase(report, "precision", bar):
        precision, notes = _apply_precision(graph, config, policy)
        report.notes += notes
        report.notes += set_io_types(graph, config.input_io_formats, config.output_io_formats)
        _record_formats(graph, backend)
    with _phase(report, "tactics", bar):
        if backend.autotunes:
            report.layers, report.timing_cache = _tune(
                graph, config, backend, precision, policy, cache, time_quantize
            )
            report.notes += guessed_shapes_notes(graph, config)
            report.notes += quantized_defaults_notes(report.layers)
        else:
            report.layers = _choose_tactics(graph, backend)
    return precision


def _tune(
    graph: Graph,
    config: BuilderConfig,
    backend: Backend,
    precision: str,
    policy: PrecisionPolicy,
    cache: TimingCache,
    time_quantize: bool = False,
) -> tuple[list[dict], dict]:
    shapes = opt_shapes(graph, config.profiles)
    sources = None if config.tactic_sources is None else frozenset(config.tactic_sources)
    options = TuneOptions(
        precision=precision,
        tolerance=policy.tolerance,
        enabled=config.optimization_level > 0,
        sources=sources,
        # levels 4 and 5 time every applicable tactic; lower ones the best-estimated few
        max_candidates=None if config.optimization_level >= 4 else 4,
        # (a standalone quantization's cost is part of the precision choice's comparison)
        timed_ops=frozenset({"QuantizeLinear"}) if time_quantize else frozenset(),
        exclude=tuple(p.strip() for p in config.tactic_exclude),
        timeout_s=config.tactic_timeout,
    )
    try:
        with math_mode(precision):
            layers = choose_tactics(
                graph,
                backend,
                shapes,
                options,
                cache,
                also_shapes=profile_extremes(graph, config.profiles),
            )
    except GraphError as exc:  # the model does not infer at the shapes it is tuned at
        raise BuildError(tuning_shapes_error(graph, config.profiles, exc)) from None
    return layers, {"hits": cache.hits, "misses": cache.misses}


# ------------------------------------------------- INT8/FP8: each layer in the faster precision


def _float_layer_ms(
    float_graph: Graph,
    config: BuilderConfig,
    backend: Backend,
    policy: PrecisionPolicy,
    cache: TimingCache,
) -> dict[str, float]:
    """Layer name -> the measured ms of its chosen tactic in the float engine (``float_graph``,
    lowered and tuned here), for the layers an INT8/FP8 build may quantize."""
    scratch = BuildReport()
    _lower(float_graph, config, backend, policy, scratch, _Progress(False), cache)
    return layer_ms(scratch.layers, FLOAT_LAYERS)


# quantize-and-lower rounds of the precision choice after the first, at most
_CHOICE_ROUNDS = 4


def _settle_precision(
    float_graph: Graph,
    floats: dict[str, float],
    report: BuildReport,
    notes_before: list[str],
    bar: _Progress,
    quantized: str,
    precision: str,
    quantize: Callable[[Graph, set[str]], list[str]],
    lower: Callable[[Graph], str],
) -> tuple[Graph | None, str]:
    """Quantize and lower again without the layers the choice keeps in float, until no more go;
    then keep the fastest of the builds made.

    One comparison is not enough: in the fully quantized build a layer's input quantization is
    fused into the quantized layer that produces it, so it costs nothing there; once that
    producer is kept in float, the quantization runs as a kernel of its own before the layer,
    which may then be slower than its float form as well. Each round compares the new build's
    quantized layers again (their own QuantizeLinear now measured) and only ever adds layers to
    the float set, so it ends; after _CHOICE_ROUNDS rounds the last set is built without a
    further comparison. Going layer by layer, the rounds can also cascade past the best mix (a
    chain faster quantized as a whole loses one layer at a time), so of the fully quantized
    build and each round's, the one that measures fastest (:func:`build_ms`) is kept (the
    last, as settled, where one was not measured). ``quantized`` names the 8-bit precision,
    ``precision`` the float one the first build lowered to. Returns (the graph to use, None if
    the first build stands; its precision)."""
    # (graph, its float set, its report's layers, timing cache and notes, its precision)
    builds = [(None, frozenset(), list(report.layers), report.timing_cache, list(report.notes),
               precision)]  # fmt: skip
    slower: set[str] = set()
    choice = report.precision_choice
    for round_ in range(1, _CHOICE_ROUNDS + 1):
        new = {n for n, c in choice.items() if c["kept"] == "float"} - slower
        if not new:
            break
        slower |= new
        graph = copy_graph(float_graph)  # the same ranges, the tactics from the cache
        report.notes = list(notes_before)  # (the last round's notes were of another graph)
        with _phase(report, "calibrate", bar):
            report.notes += quantize(graph, slower)
        precision = lower(graph)
        builds.append((graph, frozenset(slower), list(report.layers), report.timing_cache,
                       list(report.notes), precision))  # fmt: skip
        if round_ == _CHOICE_ROUNDS:
            break
        with _phase(report, "precision choice", bar):
            choice = compare_layers(report.layers, floats)
        report.precision_choice.update(choice)  # (the float layers keep their earlier entry)
    if not slower:
        return None, precision
    times = [build_ms(b[2]) for b in builds]
    best = len(builds) - 1
    if all(t is not None for t in times):  # (the fastest; on a tie the later, more float)
        best = min(range(len(builds)), key=lambda i: (times[i], -i))
    graph, kept, report.layers, report.timing_cache, notes, precision = builds[best]
    report.notes = list(notes)
    if best == 0:
        report.notes.append(kept_whole_note(slower, quantized, times[0], times[-1]))
    else:
        report.notes.append(kept_float_note(set(kept), quantized, precision))
        if best < len(builds) - 1:
            report.notes.append(
                f"{quantized}: this mix measured {times[best]:.3f} ms; the choice's later rounds, "
                f"with up to {len(slower)} layers in {precision}, {times[-1]:.3f} ms"
            )
    overruled = "whole build" if best == 0 else "faster build"
    for name in (slower - kept) & set(report.precision_choice):
        report.precision_choice[name] |= {"kept": "quantized", "overruled": overruled}
    return graph, precision


def _choose_tactics(graph: Graph, backend: Backend) -> list[dict]:
    return [
        describe_layer(n, lookup(n.op, n.domain, graph.opset(n.domain), backend.name, node=n.name))
        for n in graph.nodes
    ]


@contextmanager
def _phase(report: BuildReport, name: str, bar: Any):
    t0 = time.perf_counter()
    try:
        yield
    except TensorkilnError:
        raise
    finally:
        # (a phase run again, as an INT8 build's precision choice does, adds up)
        spent = time.perf_counter() - t0
        report.phases[name] = report.phases.get(name, 0.0) + spent
        log.debug("build phase %s: %.2f s", name, spent)
        bar.advance(name)


class _Progress:
    """A rich progress bar over the build phases, shown only in a terminal."""

    PHASES = 5

    def __init__(self, enabled: bool | None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import Progress

            self._progress = Progress(transient=True)
            self._progress.__enter__()
            self._task = self._progress.add_task("building", total=self.PHASES)
        return self

    def status(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)

    def advance(self, name: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1, description=f"building: {name} done")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
