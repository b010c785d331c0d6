"""``tensorkiln run``: time an engine (or an ONNX model built in memory), trtexec style."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkiln.cli.common import (
    CLIError,
    Loaded,
    add_backend_option,
    add_subcommand,
    load_or_build,
    mib,
    non_negative,
    parse_shapes,
    percentiles,
    print_table,
    save_npz,
    shape_str,
    write_text,
)
from tensorkiln.cli.inputs import (
    add_input_limit_option,
    check_feed_names,
    input_shapes,
    load_inputs,
    load_raw_inputs,
    random_inputs,
)
from tensorkiln.cli.layer_profile import add_profile_options, print_profile, profile_report
from tensorkiln.runtime.context import in_graph_buffers

EPILOG = """examples:
  tensorkiln run model.engine
  tensorkiln run model.onnx --shapes input:8x3x224x224 --iterations 100
  tensorkiln run model.engine --load-inputs in.npz --save-outputs out.npz
  tensorkiln run model.engine --duration 10 --percentile 50,99,99.9 --json
  tensorkiln run model.engine --dump-profile --export-times times.json
  tensorkiln run model.engine --export-profile layers.json --avg-runs 10
  tensorkiln run model.engine --dump-profile --peak-tflops 10 --peak-gbps 100 --profile-by op

Timing follows trtexec: --warmup seconds of untimed runs, then at least --iterations runs and at
least --duration seconds (default: 10 runs and 3 s; giving only --iterations runs exactly that
many). Latency is the host-measured time of each call until its results are ready; enqueue is
the time until the call returned (on the GPU, work may still be queued then); compute is the time
spent running layers (cuda engines: GPU time between CUDA events); host is latency minus compute
(input checks, binding, copies, output gathering). Random inputs are standard normal
floats, integers in 0..9 and random booleans; dynamic dims come from --shapes, else the engine's
profile (opt shape), else 1.

The per-layer profile (--dump-profile, --export-profile) times each layer (CUDA events on a GPU,
the host clock elsewhere) and counts its FLOPs (2 per multiply-accumulate of convolutions,
matrix products and attention; 1 per element of elementwise ops) and bytes (its input, weight
and output tensors: a lower bound of its memory traffic), giving achieved TFLOP/s and GB/s. Its
roofline compares each layer with the device's peaks (datasheet figures of H200, H100 and A100
GPUs at the layer's precision, or --peak-tflops/--peak-gbps): compute bound when its FLOPs per
byte exceed peak FLOP/s over peak bytes/s, memory bound otherwise; "% roofline" is the time the
peaks allow over the time measured.
"""

DEFAULT_ITERATIONS = 10
DEFAULT_DURATION_S = 3.0


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "run", "run an engine or an ONNX model and report its speed", EPILOG)
    p.add_argument("model", help="an engine file, or an .onnx model (built in memory first)")
    p.add_argument("--shapes", help="input shapes, e.g. input:1x3x224x224,mask:1x128")
    p.add_argument("--load-inputs", metavar="NPZ", help="inputs from an .npz file (by name)")
    p.add_argument(
        "--save-outputs", metavar="NPZ", help="write the last run's outputs to an .npz file"
    )
    p.add_argument(
        "--iterations",
        type=non_negative(int),
        metavar="N",
        help=f"run at least N timed iterations (default {DEFAULT_ITERATIONS})",
    )
    p.add_argument(
        "--duration",
        type=non_negative(float),
        metavar="S",
        help=f"run for at least S seconds (default {DEFAULT_DURATION_S:g} unless --iterations is given)",
    )
    p.add_argument(
        "--warmup",
        type=non_negative(float),
        default=0.2,
        metavar="S",
        help="untimed runs for S seconds first (default 0.2)",
    )
    p.add_argument(
        "--percentile",
        type=percentiles,
        default=[90.0, 95.0, 99.0],
        metavar="P,P",
        help="latency percentiles to report (default 90,95,99)",
    )
    p.add_argument("--seed", type=int, help="seed for the random inputs")
    add_input_limit_option(p)
    p.add_argument("--export-times", metavar="JSON", help="write each iteration's timings as JSON")
    p.add_argument(
        "--export-profile",
        metavar="JSON",
        help="write the per-layer times as JSON (from a profiling run, as --dump-profile)",
    )
    p.add_argument(
        "--dump-profile",
        action="store_true",
        help="per-layer times (from a separate profiling run of as many iterations)",
    )
    add_profile_options(p)
    p.add_argument(
        "--avg-runs",
        type=_positive_int,
        metavar="N",
        help="also report the mean times of each N consecutive iterations",
    )
    p.add_argument("--json", action="store_true", help="print all results as one JSON object")
    p.add_argument(
        "--use-cuda-graph",
        action="store_true",
        help="cuda engines: capture the whole engine as a CUDA graph and replay it",
    )
    p.add_argument(
        "--cpu-compile",
        action="store_true",
        help="cpu engines: run through torch.compile, compiled in the first (warm-up) run per "
        "input shape, seconds (as TENSORKILN_CPU_COMPILE=1 does)",
    )
    p.add_argument(
        "--device-io",
        action="store_true",
        help="cuda engines: keep inputs and outputs on the GPU (torch tensors) instead of "
        "copying numpy arrays in and out on every run; with --use-cuda-graph the inputs sit in "
        "the graph's own buffers, read with no copy (trtexec's --noDataTransfers --useCudaGraph)",
    )
    add_backend_option(
        p, "backend for an .onnx model built in memory (auto: cuda where a GPU is present)"
    )
    p.set_defaults(handler=run_run)


def _positive_int(text: str) -> int:
    value = non_negative(int)(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


@dataclass
class Timings:
    start_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)  # GPU time (CUDA events) on cuda engines
    enqueue_s: list[float] = field(default_factory=list)  # until infer() returned
    warmup_runs: int = 0
    wall_s: float = 0.0

    def host_s(self) -> list[float]:
        return [max(t - c, 0.0) for t, c in zip(self.latency_s, self.compute_s)]


def measure(
    ctx: Any, feeds: dict, warmup_s: float, iterations: int, duration_s: float
) -> tuple[Timings, dict]:
    """Warm up, then run until both ``iterations`` and ``duration_s`` are reached (at least once)."""
    t = Timings()
    outputs: dict = {}
    end = time.perf_counter() + warmup_s
    while warmup_s > 0 and time.perf_counter() < end:
        outputs = ctx.infer(feeds)
        ctx.synchronize()
        t.warmup_runs += 1
    begin = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        outputs = ctx.infer(feeds)
        t_enqueued = time.perf_counter()
        ctx.synchronize()  # device outputs return before the GPU is done: wait, as trtexec does
        t1 = time.perf_counter()
        t.start_s.append(t0 - begin)
        t.latency_s.append(t1 - t0)
        t.enqueue_s.append(t_enqueued - t0)
        gpu = ctx.last_gpu_s
        t.compute_s.append(ctx.last_compute_s if gpu is None else gpu)
        if len(t.latency_s) >= iterations and t1 - begin >= duration_s:
            break
    t.wall_s = time.perf_counter() - begin
    return t, outputs


def stats_ms(seconds: list[float], pcts: list[float]) -> dict[str, float]:
    a = np.asarray(seconds) * 1e3
    out = {
        "min": float(a.min()),
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "max": float(a.max()),
    }
    for p in pcts:
        out[f"p{p:g}"] = float(np.percentile(a, p))
    return out


def _iterations_and_duration(args: argparse.Namespace) -> tuple[int, float]:
    if args.iterations is None and args.duration is None:
        return DEFAULT_ITERATIONS, DEFAULT_DURATION_S
    return max(args.iterations or 1, 1), args.duration or 0.0


def run_run(args: argparse.Namespace) -> int:
    shapes = parse_shapes(args.shapes)
    loaded = load_or_build(args.model, shapes, args.backend)
    if loaded.built is not None:
        print(
            f"built {loaded.path.name} in memory ({len(loaded.built.layers)} layers, "
            f"{loaded.build_s * 1e3:.1f} ms); save an engine with `tensorkiln build` to skip this",
            file=sys.stderr if args.json else sys.stdout,
        )
    return run_loaded(args, loaded, shapes)


def run_loaded(args: argparse.Namespace, loaded: Loaded, shapes: dict[str, tuple[int, ...]]) -> int:
    """Time ``loaded.engine`` as the run flags in ``args`` say, and report."""
    engine = loaded.engine
    note = sys.stderr if args.json else sys.stdout
    feeds, origin = _feeds(args, engine, shapes)
    iterations, duration = _iterations_and_duration(args)
    backend = engine.runtime_backend
    on_gpu = backend.cuda_graphs
    if (args.use_cuda_graph or args.device_io) and not on_gpu:
        raise CLIError(
            "--use-cuda-graph and --device-io need an engine of the cuda backend on a GPU"
        )
    if args.cpu_compile and not backend.compiles:
        raise CLIError(f"--cpu-compile needs an engine of the cpu backend, not '{engine.backend}'")
    compiled = True if args.cpu_compile else None  # (None: the environment decides)
    with engine.create_execution_context(
        use_cuda_graph=args.use_cuda_graph, compile=compiled
    ) as ctx:
        for name, arr in feeds.items():
            ctx.set_input_shape(name, np.shape(arr))  # a clear error for shapes outside the profile
        run_feeds = {k: backend.to_device(v) for k, v in feeds.items()} if args.device_io else feeds
        if args.device_io and args.use_cuda_graph:
            run_feeds = in_graph_buffers(ctx, run_feeds)
        timings, outputs = measure(ctx, run_feeds, args.warmup, iterations, duration)
        outputs = {k: backend.to_host(v) for k, v in outputs.items()}
        held = ctx.device_memory_bytes() if on_gpu else None
        if args.use_cuda_graph and ctx.cuda_graph_fallback:
            print(f"note: ran without a CUDA graph: {ctx.cuda_graph_fallback}", file=note)
        profile = (
            profile_report(args, ctx, engine, feeds, len(timings.latency_s))
            if args.dump_profile or args.export_profile
            else None
        )
    result = _result(args, loaded, feeds, origin, outputs, timings, profile)
    if args.avg_runs:
        result["averages"] = _averages(timings, args.avg_runs)
    result["memory"] = {
        "weights_bytes": engine.weight_bytes,
        "planned_activation_bytes": engine.memory.get("peak_bytes"),
        "context_device_bytes": held,  # what the context's pools hold after the runs (GPU only)
    }
    if args.save_outputs:
        save_npz(args.save_outputs, outputs)
    if args.export_times:
        write_text(args.export_times, json.dumps(_per_iteration(timings), indent=1) + "\n")
    if args.export_profile:
        write_text(args.export_profile, json.dumps(profile, indent=1) + "\n")
    if getattr(args, "export_output", None):  # trtexec's --exportOutput
        write_text(args.export_output, json.dumps(_outputs_json(outputs)) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_text(args, result)
    return 0


def _feeds(
    args: argparse.Namespace, engine: Any, shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, Any], str]:
    """The inputs and where they came from: an .npz, raw files per input (trtexec's
    --loadInputs, random data for the rest) or random data."""
    if args.load_inputs:
        feeds = load_inputs(args.load_inputs, args.max_input_bytes)
        check_feed_names(engine, feeds, f"'{args.load_inputs}'")
        return feeds, args.load_inputs
    concrete = input_shapes(engine, shapes)
    feeds = random_inputs(engine, concrete, args.seed, args.max_input_bytes)
    raw = getattr(args, "raw_inputs", None)
    if not raw:
        return feeds, "random"
    feeds.update(load_raw_inputs(engine, raw, concrete, args.max_input_bytes))
    rest = [k for k in feeds if k not in raw]
    return feeds, "raw files" + (f", random for {', '.join(rest)}" if rest else "")


def _result(
    args: argparse.Namespace,
    loaded: Any,
    feeds: dict,
    origin: str,
    outputs: dict,
    timings: Timings,
    profile: dict | None,
) -> dict:
    n = len(timings.latency_s)
    result = {
        "model": str(loaded.path),
        "built_in_memory": loaded.built is not None,
        "backend": loaded.engine.backend,
        "cuda_graph": bool(args.use_cuda_graph),
        "device_io": bool(args.device_io),
        "inputs": {
            k: {"dtype": str(np.asarray(v).dtype), "shape": list(np.shape(v))}
            for k, v in feeds.items()
        },
        "input_source": origin,
        "outputs": {
            k: {"dtype": str(np.asarray(v).dtype), "shape": list(np.shape(v))}
            for k, v in outputs.items()
        },
        "warmup_s": args.warmup,
        "warmup_runs": timings.warmup_runs,
        "iterations": n,
        "wall_s": timings.wall_s,
        "throughput_qps": n / timings.wall_s if timings.wall_s > 0 else float("inf"),
        "latency_ms": stats_ms(timings.latency_s, args.percentile),
        "compute_ms": stats_ms(timings.compute_s, args.percentile),
        "compute_measured_by": "cuda events"
        if loaded.engine.runtime_backend.streams
        else "host clock",
        "enqueue_ms": stats_ms(timings.enqueue_s, args.percentile),
        "host_ms": stats_ms(timings.host_s(), args.percentile),
    }
    if profile is not None:
        result["profile"] = profile
    if args.save_outputs:
        result["outputs_saved_to"] = args.save_outputs
    if args.export_times:
        result["times_exported_to"] = args.export_times
    return result


def _averages(t: Timings, runs: int) -> list[dict]:
    """Mean times over each window of ``runs`` consecutive iterations (trtexec's --avgRuns)."""
    out = []
    for i in range(0, len(t.latency_s), runs):
        window = slice(i, i + runs)
        out.append(
            {
                "runs": len(t.latency_s[window]),
                "latency_ms": float(np.mean(t.latency_s[window])) * 1e3,
                "compute_ms": float(np.mean(t.compute_s[window])) * 1e3,
                "enqueue_ms": float(np.mean(t.enqueue_s[window])) * 1e3,
            }
        )
    return out


def _outputs_json(outputs: dict) -> list[dict]:
    """Outputs as trtexec's --exportOutput writes them: name, dimensions ('2x3'), values."""
    return [
        {
            "name": name,
            "dimensions": "x".join(str(d) for d in np.shape(v)),
            "values": np.asarray(v).ravel().tolist(),
        }
        for name, v in outputs.items()
    ]


def _per_iteration(t: Timings) -> list[dict]:
    return [
        {
            "start_ms": s * 1e3,
            "latency_ms": lat * 1e3,
            "compute_ms": c * 1e3,
            "enqueue_ms": e * 1e3,
            "host_ms": h * 1e3,
        }
        for s, lat, c, e, h in zip(t.start_s, t.latency_s, t.compute_s, t.enqueue_s, t.host_s())
    ]


def _print_text(args: argparse.Namespace, r: dict) -> None:
    mode = "  (CUDA graph)" if r["cuda_graph"] else ""
    print(f"model: {r['model']}  backend: {r['backend']}{mode}")
    for name, spec in r["inputs"].items():
        print(f"input  {name}: {spec['dtype']} {shape_str(spec['shape'])} ({r['input_source']})")
    for name, spec in r["outputs"].items():
        print(f"output {name}: {spec['dtype']} {shape_str(spec['shape'])}")
    print(
        f"warmup: {r['warmup_runs']} runs in {r['warmup_s']:g} s; timed: {r['iterations']} "
        f"iterations in {r['wall_s']:.3f} s"
    )
    print(f"throughput: {r['throughput_qps']:.2f} qps")
    m = r["memory"]
    parts = [f"weights {mib(m['weights_bytes'])}"]
    if m["planned_activation_bytes"] is not None:
        parts.append(f"activations planned {mib(m['planned_activation_bytes'])}")
    if m["context_device_bytes"] is not None:
        parts.append(f"context holds {mib(m['context_device_bytes'])} on the device")
    print("memory: " + ", ".join(parts))
    keys = list(r["latency_ms"])
    print_table(
        ["ms", *keys],
        [
            [label, *(f"{r[key][k]:.4f}" for k in keys)]
            for label, key in (
                ("latency", "latency_ms"),
                ("enqueue", "enqueue_ms"),
                (
                    "gpu compute" if r["compute_measured_by"] == "cuda events" else "compute",
                    "compute_ms",
                ),
                ("host", "host_ms"),
            )
        ],
    )
    for a in r.get("averages", []):
        print(
            f"average on {a['runs']} runs - latency: {a['latency_ms']:.4f} ms - compute: "
            f"{a['compute_ms']:.4f} ms (enqueue {a['enqueue_ms']:.4f} ms)"
        )
    if "profile" in r and args.dump_profile:
        print()
        print_profile(r["profile"])
    if args.save_outputs:
        print(f"outputs saved to {args.save_outputs}")
    if args.export_times:
        print(f"per-iteration times written to {args.export_times}")
    if args.export_profile:
        print(f"per-layer profile written to {args.export_profile}")
