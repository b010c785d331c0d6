"""The autotuner: for each layer, time every applicable tactic on the opt shapes, keep the fastest.

Per layer with more than one applicable tactic:

1. inputs: the layer's weights as they are, and the activations the graph itself computes at the
   first profile's opt shapes from drawn model inputs (:mod:`tensorkiln.tactics.inputs`), so
   that each op sees values in its domain; drawn ones where those are not known;
2. oracle: the op's default kernel on the same inputs in float32 with TF32 off;
3. the default kernel runs and is timed: it is what runs without tuning, so it is never
   rejected; where it cannot run or the oracle has no finite value, the layer keeps it and
   records why (``fallback``) rather than failing the build;
4. each candidate runs once and must match the oracle where the oracle is finite (relative L2
   error under the precision's tolerance, or no worse than the default's), with the same inf
   and NaN elsewhere, or it is rejected with the reason recorded;
5. each accepted candidate is warmed up, then timed with CUDA events: by default ``runs``
   replays of a CUDA graph holding several calls (the kernels' time without Python's launch
   overhead, as engines run under --use-cuda-graph), or single calls where capture fails; the
   median wins, every timing goes into the engine and the cache, and the layer records how long
   its tuning took (``tune_s``).

Layers whose shapes depend on values, or whose non-float inputs have no real values, keep their
default kernel. A timing cache hit skips steps 1-5. Tactics that ``exclude`` names are never
candidates; with ``timeout_s``, a candidate whose check and timing run longer ends the process
(a kernel that never ends holds the GPU: :class:`_Watchdog`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from tensorkiln.backends import Backend
from tensorkiln.errors import GraphError
from tensorkiln.ir import Graph, Node, TensorType
from tensorkiln.ir.printer import format_graph
from tensorkiln.kernels import derived
from tensorkiln.kernels.evaluate import infer_at_shapes
from tensorkiln.kernels.registry import KernelEntry, invoke, lookup
from tensorkiln.kernels.tactics import LayerSpec, tactics_for
from tensorkiln.precision.policy import TOLERANCE
from tensorkiln.runtime.executor import Executor, Scope, with_fn
from tensorkiln.tactics.cache import TimingCache
from tensorkiln.tactics.inputs import LayerInputs


@dataclass
class TuneOptions:
    precision: str = "fp32"  # the engine's math mode: fp32, tf32, fp16 or bf16
    # a layer's tolerance against the float32 oracle (the precision policy's); None: the
    # engine-wide precision's TOLERANCE for every layer
    tolerance: Callable[[Node], float] | None = None
    warmup: int = 3
    runs: int = 15
    enabled: bool = True  # False: every layer keeps its default tactic (optimization level 0)
    sources: frozenset[str] | None = None  # tactic kinds allowed besides the default; None: all
    graph_timing: bool = True  # time kernels under CUDA graphs (no Python launch overhead)
    # at most this many candidates besides the default are timed per layer, the best-estimated
    # ones (each costs a compilation on a cold build); None times every applicable one
    max_candidates: int | None = 4
    # ops whose default kernel is timed even where no tactic applies (an INT8/FP8 build's
    # precision choice counts what a QuantizeLinear of its own adds to a quantized layer)
    timed_ops: frozenset[str] = frozenset()
    # tactic names or shell-style patterns never tried (BuilderConfig.tactic_exclude)
    exclude: tuple[str, ...] = ()
    # seconds a candidate's check and timing may take before the process stops (None: no
    # limit; BuilderConfig.tactic_timeout)
    timeout_s: float | None = None


def choose_tactics(
    graph: Graph,
    backend: Backend,
    shapes: dict[str, tuple[int, ...]],
    options: TuneOptions,
    cache: TimingCache | None = None,
    log: Callable[[str], None] | None = None,
    also_shapes: list[dict[str, tuple[int, ...]]] | tuple = (),
) -> list[dict]:
    """One dict per top-level node: its op, chosen tactic, timings and rejections.

    Tactics are timed at ``shapes`` (the profile's opt shapes); ``also_shapes`` are the other
    input shapes the engine must run at (each profile's min and max): a tactic that does not
    apply at one of them is not a candidate. ``backend``: one that autotunes (its tactics are
    the cuda tree's; on a CPU device they run for tests, their timings meaning nothing).
    """
    executor = Executor(graph, backend)
    try:
        types = _concrete_types(graph, shapes)
        others = [_concrete_types(graph, s) for s in also_shapes if s != shapes]
    except GraphError:
        if _measures(options):
            raise
        types, others = {}, []  # nothing is timed: every layer keeps its default, unlisted
    layers = []
    watchdog = _Watchdog(options.timeout_s, cache)
    with backend.scope(), backend.inference():
        # the real activations are only worth computing when something is measured on them
        values = LayerInputs(graph, executor, shapes) if _measures(options) else None
        for i, node in enumerate(graph.nodes):
            t0 = time.perf_counter()
            layer = _tune_layer(
                graph, node, executor, (types, *others), options, cache, log, values, watchdog
            )
            if "candidates" in layer:
                layer["tune_s"] = round(time.perf_counter() - t0, 3)
            layers.append(layer)
            if values is not None:
                values.advance(i, node)
    return layers


def _measures(options: TuneOptions) -> bool:
    """Whether tuning times anything (at level 0, or with no tactic source allowed, it does not)."""
    return options.enabled and options.sources != frozenset()


def _tune_layer(graph, node, executor, types, options, cache, log, values, watchdog) -> dict:
    """``types``: the values' types at the opt shapes, then at the profiles' other shapes;
    ``values``: the graph's activations at the opt shapes (None when nothing is measured)."""
    opset = graph.opset(node.domain)
    entry = lookup(node.op, node.domain, opset, executor.backend.name, node=node.name)
    layer = describe_layer(node, entry) | {"tactic": "default"}
    spec, *other_specs = (_spec(node, t, executor.device.type) for t in types)
    candidates = [
        t
        for t in (tactics_for(node.op, node.domain, spec) if spec else ())
        if t.applies(spec)
        and all(s is None or t.applies(s) for s in other_specs)
        and _allowed(t.name, options.sources, options.exclude)
    ]
    if spec is None and options.enabled and tactics_for(node.op, node.domain):
        # (shape inference left an input's shape symbolic at these shapes: nothing to time it at)
        layer["fallback"] = "its input shapes are not concrete at the profile's shapes"
    if not candidates and (spec is None or node.op not in options.timed_ops):
        return layer
    candidates, pruned = _prune(candidates, spec, options.max_candidates)
    layer["candidates"] = ["default"] + [t.name for t in candidates]
    if pruned:
        layer["pruned"] = pruned
    if not options.enabled:
        return layer
    key = TimingCache.key(_signature(node, spec, options, executor.backend, candidates))
    hit = cache.get(key, partial(_covers, layer["candidates"])) if cache is not None else None
    if hit is not None:
        layer.update(_cached_choice(hit))
        return layer
    args = values.for_layer(node, spec) if values is not None else None
    if args is None:
        return layer
    choice = _measure_candidates(node, entry, candidates, args, executor, options, watchdog)
    layer.update(choice)
    if "fallback" in choice:  # not a measurement: the next build tries again
        if log is not None:
            log(f"{node.name} ({node.op}): default kept: {choice['fallback']}")
        return layer
    if cache is not None:
        cache.put(key, {**{k: choice[k] for k in CACHED_KEYS}, "candidates": layer["candidates"]})
    if log is not None:
        log(
            f"{node.name} ({node.op}): {choice['tactic']} "
            + " ".join(f"{k}={v:.4f}ms" for k, v in choice["timings_ms"].items())
        )
    return layer


# what a timing cache entry holds: the choice for engines run as CUDA graphs (kernel time) and for
# engines run layer by layer (Python's launch overhead included), and the timings behind both
CACHED_KEYS = ("tactic", "timings_ms", "tactic_eager", "timings_eager_ms")


def _covers(candidates: list[str], hit: dict) -> bool:
    """Whether a cache entry weighed every one of a layer's candidates and chose among them: a
    tactic added since (a new kernel, a rebuilt library's new tile) is timed, not passed over
    for the old choice, and so is a layer whose choice is excluded since (or gone). An entry
    from before entries named their candidates counts the ones it has timings of."""
    chosen = (hit["tactic"], hit.get("tactic_eager", "default"))
    if not all(n in candidates for n in chosen):
        return False
    known = hit.get("candidates")
    if not (isinstance(known, list) and all(isinstance(n, str) for n in known)):
        known = ["default", *hit["timings_ms"]]
    return set(candidates) <= set(known)


def _cached_choice(hit: dict) -> dict:
    return {
        "tactic": hit["tactic"],
        "timings_ms": hit["timings_ms"],
        "tactic_eager": hit.get("tactic_eager", hit["tactic"]),
        "timings_eager_ms": hit.get("timings_eager_ms", hit["timings_ms"]),
        "cached": True,
    }


def _measure_candidates(node, entry, candidates, args, executor, options, watchdog) -> dict:
    """Check every candidate against the oracle, time the ones that agree, pick the fastest.

    The default kernel is what runs without tuning, so it is never rejected: where it cannot be
    run or timed here, or the oracle has no finite value to check against, the layer keeps it
    and says why (``fallback``) instead of failing the build. A candidate must match the oracle
    within the precision's tolerance, or be no less accurate than the default (twice its error,
    up to ten times the tolerance: a reduced precision may miss the float32 oracle by more than
    the tolerance on large sums, but a default that far off vouches for nothing).
    """
    scope = Scope(executor, {})
    n_out = len(node.outputs)
    layer = f"layer '{node.name}' ({node.op})"
    try:
        with watchdog.guard(f"{layer}: its default kernel"):
            oracle = _oracle(entry, node, args, n_out, scope)
            default = invoke(entry, args, node.attrs, n_out, scope)
            default_err = _rel_error(default, oracle)
            default_ms = _time(entry, args, node.attrs, n_out, scope, executor.backend, options)
    except Exception as exc:  # e.g. drawn inputs outside what the op accepts
        return _fallback(f"the default kernel failed on the tuning inputs: {_reason(exc)}")
    if not _checkable(oracle):
        return _fallback("the oracle has no finite output on the tuning inputs to check against")
    bound = _bound(_tolerance(node, options), default_err)
    graph_ms, eager_ms = {"default": default_ms[0]}, {"default": default_ms[1]}
    rejected: dict[str, str] = {}
    for t in candidates:
        e = with_fn(entry, t.fn)
        try:
            with watchdog.guard(f"{layer}: tactic '{t.name}'", t.name):
                got = invoke(e, args, node.attrs, n_out, scope)
                err = _rel_error(got, oracle)
                if not err <= bound:
                    rejected[t.name] = f"relative error {err:.2e} vs the float32 oracle"
                    if math.isinf(err):
                        rejected[t.name] += f" ({_mismatch(got, oracle)})"
                    continue
                graph_ms[t.name], eager_ms[t.name] = _time(
                    e, args, node.attrs, n_out, scope, executor.backend, options
                )
        except Exception as exc:  # a candidate that cannot run here is rejected, not fatal
            rejected[t.name] = _reason(exc)
    out = {
        "tactic": min(graph_ms, key=graph_ms.get),
        "timings_ms": {k: round(v, 5) for k, v in graph_ms.items()},
        "tactic_eager": min(eager_ms, key=eager_ms.get),
        "timings_eager_ms": {k: round(v, 5) for k, v in eager_ms.items()},
    }
    if rejected:
        out["rejected"] = rejected
    return out


def _tolerance(node: Node, options: TuneOptions) -> float:
    if options.tolerance is not None:
        return options.tolerance(node)
    return TOLERANCE[options.precision]


def _bound(tolerance: float, default_err: float) -> float:
    """The error a candidate may show: the tolerance, or twice the default's up to ten times it."""
    if math.isnan(default_err):
        return tolerance
    return max(tolerance, min(2 * default_err, 10 * tolerance))


def _fallback(why: str) -> dict:
    return {"tactic": "default", "tactic_eager": "default", "fallback": why}


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def _prune(candidates: list, spec: LayerSpec, keep: int | None) -> tuple[list, list[str]]:
    """The ``keep`` best-estimated candidates of each tactic source (the name's first part:
    Triton's tile configs compete among themselves, a cuDNN or cuBLAS call is not crowded out by
    them) or of each group a tactic names, in registration order, and the names of the others."""
    if keep is None:
        return candidates, []
    sources: dict[str, list[int]] = {}
    for i, t in enumerate(candidates):
        sources.setdefault(t.group or _source(t.name), []).append(i)
    dropped: set[int] = set()
    for members in sources.values():
        ranked = sorted(members, key=lambda i: -candidates[i].score(spec))
        dropped.update(ranked[keep:])
    kept = [t for i, t in enumerate(candidates) if i not in dropped]
    return kept, [candidates[i].name for i in sorted(dropped)]


def _source(name: str) -> str:
    """A tactic's source: the first part of its name ("triton_gemm_..." -> "triton")."""
    return name.split("_", 1)[0]


def _allowed(name: str, sources: frozenset[str] | None, exclude: tuple[str, ...] = ()) -> bool:
    """Whether a tactic's source is allowed and no exclusion pattern matches its name."""
    return (sources is None or _source(name) in sources) and not any(
        fnmatch.fnmatchcase(name, p) for p in exclude
    )


# the exit status of a build stopped by --tactic-timeout (a tactic that did not finish)
STUCK_EXIT = 3


class _Watchdog:
    """Stops the process when one tactic's check and timing take longer than ``seconds``.

    A GPU kernel that never ends (a deadlocked pipeline, say) holds the device: the build's
    next synchronization waits forever, and nothing in this process can take the device back.
    So on the timer's thread the watchdog saves the timing cache (the layers tuned so far, so
    that a rebuild starts where this one stopped), names the layer and the tactic on stderr
    with the way around it, and ends the process with :data:`STUCK_EXIT`. Python runs the
    timer while the main thread waits in the driver (torch releases the GIL there)."""

    def __init__(self, seconds: float | None, cache: TimingCache | None) -> None:
        self.seconds = seconds
        self.cache = cache

    @contextmanager
    def guard(self, what: str, tactic: str | None = None) -> Iterator[None]:
        if self.seconds is None:
            yield
            return
        timer = threading.Timer(self.seconds, self._stop, (what, tactic))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _stop(self, what: str, tactic: str | None) -> None:
        saved = ""
        path = getattr(self.cache, "path", None)
        if path is not None:
            try:  # (a snapshot: the main thread is blocked, or about to be stopped)
                TimingCache(dict(self.cache.entries)).save(path)
                saved = f"; the layers tuned before it are saved in the timing cache '{path}'"
            except OSError as exc:
                saved = f"; the timing cache '{path}' could not be saved ({exc})"
        around = f" (tensorkiln build --tactic-exclude '{tactic}')" if tactic else ""
        sys.stderr.write(
            f"tensorkiln: error: {what} did not finish within {self.seconds:g} s (the tactic "
            f"timeout), so the build stops: a kernel that does not end holds the device{saved}. "
            f"Rebuild without that tactic{around}, or with a longer timeout if it was only "
            "slow (a first compilation, say).\n"
        )
        sys.stderr.flush()
        os._exit(STUCK_EXIT)


def describe_layer(node: Node, entry: KernelEntry) -> dict:
    """The engine's record of one layer: names, the kernel that runs it, its output precision."""
    out = node.outputs[0] if node.outputs else None
    t = out.type if out is not None else None
    module = entry.fn.__module__.rsplit(".", 1)[-1]
    return {
        "name": node.name,
        "op": f"{node.domain}.{node.op}" if node.domain else node.op,
        "impl": f"{entry.backend}:{module}.{entry.fn.__name__}",
        "precision": t.dtype.short if isinstance(t, TensorType) and t.dtype is not None else "-",
        # what the precision policy chose for it, where it ran
        **{k: x for k, x in (("compute_precision", node.precision), ("format", node.format)) if x},
        "inputs": [v.name if v is not None else "" for v in node.inputs],
        "outputs": [v.name if v is not None else "" for v in node.outputs],
    }


def _concrete_types(graph: Graph, shapes: dict[str, tuple[int, ...]]) -> dict[str, TensorType]:
    """Types of every top-level value with the inputs at ``shapes`` (weights shared, not copied);
    a GraphError says at which input shapes the model does not infer."""
    try:
        g = infer_at_shapes(graph, shapes)
    except GraphError as exc:
        at = ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in shapes.items())
        raise type(exc)(f"at input shapes {at}: {exc}") from None
    return {v.name: v.type for v in g.values() if isinstance(v.type, TensorType)}


def _spec(node: Node, types: dict[str, TensorType], device_type: str) -> LayerSpec | None:
    shapes, dtypes = [], []
    for v in node.inputs:
        if v is None:
            shapes.append(None)
            dtypes.append(None)
            continue
        t = types.get(v.name)
        if (
            t is None
            or t.shape is None
            or t.dtype is None
            or not all(isinstance(d, int) for d in t.shape)
        ):
            return None
        shapes.append(tuple(t.shape))
        dtypes.append(np.dtype(t.dtype.numpy).name)
    return LayerSpec(
        op=node.op,
        domain=node.domain,
        attrs=node.attrs,
        shapes=tuple(shapes),
        dtypes=tuple(dtypes),
        device=device_type,
        constant=tuple(v is not None and v.const is not None for v in node.inputs),
    )


def _attr_text(a: Any) -> Any:
    if isinstance(a, Graph):
        return format_graph(a)
    if isinstance(a, np.ndarray):
        return [a.dtype.name, list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()]
    if isinstance(a, list):
        return [_attr_text(x) for x in a]
    return a


def _signature(
    node: Node, spec: LayerSpec, options: TuneOptions, backend: Backend, candidates=()
) -> dict:
    import torch  # lazy: torch is optional (an autotuning backend has it)

    device = backend.device
    sig = {
        "op": f"{node.domain}.{node.op}",
        "attrs": {k: _attr_text(v) for k, v in sorted(node.attrs.items())},
        "shapes": spec.shapes,
        "dtypes": spec.dtypes,
        "constant": spec.constant,
        "precision": options.precision,
        # what was allowed to compete: a narrower search must not answer a wider one
        "sources": None if options.sources is None else sorted(options.sources),
        "max_candidates": options.max_candidates,
        "torch": torch.__version__,
        "device": device.type,
    }
    if node.precision not in (None, options.precision):  # (held to that precision's tolerance)
        sig["layer_precision"] = node.precision
    versions = {t.name: t.version for t in candidates if t.version}
    if versions:  # (a rebuilt kernel library: its kernels are timed again)
        sig["versions"] = versions
    if backend.streams:  # a GPU: timings hold for this model of it, with these libraries
        props = torch.cuda.get_device_properties(device)
        sig["device"] = f"{props.name} sm_{props.major}{props.minor}"
        sig["cuda"] = torch.version.cuda
        sig["cudnn"] = torch.backends.cudnn.version()
    try:
        import triton

        sig["triton"] = triton.__version__
    except ImportError:
        pass
    return sig


def _oracle(entry, node, args, n_out, scope) -> list:
    import torch

    # (fp16/bf16 operands are widened; float8 ones are quantized values the layer reads as such)
    up = [
        a.float()
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.element_size() > 1
        else a
        for a in args
    ]
    with _fp32_math():
        return invoke(entry, up, node.attrs, n_out, scope)


class _fp32_math:
    """TF32 off for cuBLAS and cuDNN inside the block."""

    def __enter__(self) -> None:
        import torch

        self.saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def _rel_error(got: list, want: list) -> float:
    """The worst relative L2 error of ``got``'s float outputs against the oracle's, compared
    where the oracle is finite; where it is not, ``got`` must hold the same inf or NaN."""
    import torch

    worst = 0.0
    for g, w in zip(got, want):
        if _eight_bit(w):
            if not _within_a_code(g, w):
                return float("inf")
            continue
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape:
            return float("inf")
        g64, w64 = g.double(), w.double()
        finite = torch.isfinite(w64)
        same_nan = torch.equal(torch.isnan(g64), torch.isnan(w64))
        inf = torch.isinf(w64)
        if not same_nan or not torch.equal(g64[inf], w64[inf]):
            return float("inf")
        g64, w64 = g64[finite], w64[finite]
        if not torch.isfinite(g64).all():
            return float("inf")
        denom = torch.linalg.vector_norm(w64).item() or 1.0
        worst = max(worst, torch.linalg.vector_norm(g64 - w64).item() / denom)
    return worst


def _eight_bit(t) -> bool:
    """An 8-bit output (int8, uint8 or E4M3: a layer quantizing its result for the next one)."""
    import torch

    return isinstance(t, torch.Tensor) and t.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn)


def _mismatch(got: list, want: list) -> str:
    """Why :func:`_rel_error` found no finite error: the first output that differs in kind."""
    import torch

    for i, (g, w) in enumerate(zip(got, want)):
        eight_bit = _eight_bit(w)
        if not eight_bit and not (isinstance(w, torch.Tensor) and w.is_floating_point()):
            continue
        if not isinstance(g, torch.Tensor):
            return f"output {i}: a {type(g).__name__}, not a tensor"
        if g.shape != w.shape or g.dtype != w.dtype:
            return (
                f"output {i}: {g.dtype} {tuple(g.shape)}, the oracle's {w.dtype} {tuple(w.shape)}"
            )
        g64, w64 = g.double(), w.double()
        odd = (torch.isnan(g64) != torch.isnan(w64)) | (torch.isinf(g64) != torch.isinf(w64))
        if bool(odd.any()):
            return f"output {i}: inf or NaN in {int(odd.sum())} of {w.numel()} places the oracle differs"
        if eight_bit:
            ok = ~torch.isnan(w64)
            far = float((g64[ok] - w64[ok]).abs().max()) if bool(ok.any()) else 0.0
            return f"output {i}: 8-bit values up to {far:.3g} from the oracle's"
    return "the outputs differ"


def _within_a_code(g, w) -> bool:
    """An 8-bit output (a layer that quantizes its result for the next one) against the
    oracle's, NaN where the oracle has NaN.

    int8 (exact int32 sums): no value more than one step of the grid away, and the steps missed
    no more than half a step in RMS (less than the rounding to the grid itself adds). E4M3: the
    sums are float32 (Hopper's FP8 tensor cores accumulate more coarsely still), and the grid's
    steps shrink with the value, so a sum's error that is small beside the tensor's largest
    values is many steps of a value near zero; as float outputs are, E4M3 ones are held to the
    tensor's scale: within one step of its largest value everywhere, and within 2**-6 (a
    quarter of E4M3's own rounding error) in relative L2."""
    import torch

    if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
        return False
    g64, w64 = g.double(), w.double()
    if not torch.equal(torch.isnan(g64), torch.isnan(w64)):
        return False
    ok = ~torch.isnan(w64)
    g64, w64 = g64[ok], w64[ok]
    if not w64.numel():
        return True
    diff = (g64 - w64).abs()
    if w.dtype == torch.float8_e4m3fn:
        top = float(w64.abs().max())
        if top == 0.0:
            return bool(diff.max() == 0)
        step = 2.0 ** (math.floor(math.log2(max(top, 2.0**-6))) - 3)
        norm = float(torch.linalg.vector_norm(w64))
        return float(diff.max()) <= step and float(torch.linalg.vector_norm(diff)) <= norm / 64
    return bool(diff.max() <= 1.0) and float(diff.square().mean().sqrt()) <= 0.5


def _checkable(oracle: list) -> bool:
    """Whether the oracle's float outputs hold a finite value to compare (or none are float)."""
    import torch

    floats = [w for w in oracle if isinstance(w, torch.Tensor) and w.is_floating_point()]
    return not floats or any(
        w.numel() == 0 or bool(torch.isfinite(w.float()).any())  # (float8 has no isfinite)
        for w in floats
    )


def _time(entry, args, attrs, n_out, scope, backend, options: TuneOptions) -> tuple[float, float]:
    """:func:`_time_calls` with one scope of derived values around all the calls."""
    with derived.scope():
        return _time_calls(entry, args, attrs, n_out, scope, backend, options)


def _time_calls(
    entry, args, attrs, n_out, scope, backend, options: TuneOptions
) -> tuple[float, float]:
    """Median milliseconds of one call, (as a CUDA graph, layer by layer).

    As a graph: replays of a CUDA graph of ``GRAPH_CALLS`` calls, the kernels' time alone (where
    capture fails, the layer-by-layer time). Layer by layer: single calls between CUDA events,
    Python's launch overhead included where it exceeds the kernels' time. On the CPU (tests), one
    call, for both. Values a kernel derives from a shared input (the mask's row ends, the packed
    sequences' cumulative lengths: kernels/derived.py) are computed once for all the calls, as
    an engine's run computes them once for all its layers: a tactic is not charged per layer
    for what the engine pays once.
    """
    import torch  # lazy: torch is optional (an autotuning backend has it)

    device = backend.device

    def call() -> None:
        invoke(entry, args, attrs, n_out, scope)

    if not backend.streams:  # torch on the CPU: the number says nothing about a GPU
        t0 = time.perf_counter()
        call()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms
    for _ in range(options.warmup):
        call()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(options.runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    eager = statistics.median(samples)
    graph = _time_graph(call, device, options.runs) if options.graph_timing else None
    return (eager if graph is None else graph), eager


GRAPH_CALLS = 10  # calls captured in one graph when timing


def _time_graph(call: Callable[[], None], device: Any, runs: int) -> float | None:
    """Median ms a call over ``runs`` replays; None when the calls cannot be captured (a kernel
    that synchronizes with the host, say)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                call()
    except Exception:
        torch.cuda.synchronize(device)
        return None
    graph.replay()
    samples = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / GRAPH_CALLS)
    del graph
    return statistics.median(samples)
