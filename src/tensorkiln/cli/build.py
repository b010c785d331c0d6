"""``tensorkiln build``: ONNX model (or an engine's embedded model) in, engine file out."""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.builder.config import (
    QUANTIZED_PRECISIONS,
    PrecisionWarning,
    implemented_precisions,
)
from tensorkiln.cli.common import (
    CLIError,
    add_backend_option,
    add_subcommand,
    byte_count,
    existing_file,
    mib,
    not_a_model,
    parse_layer_precisions,
    parse_shapes,
    print_table,
    sniff_file,
    timing_cache_file,
)
from tensorkiln.engine.engine import read_plan, read_source_model
from tensorkiln.engine.schema import printable
from tensorkiln.errors import InputError
from tensorkiln.ir.graph import PRECISIONS
from tensorkiln.precision.calib_data import DEFAULT_BATCH
from tensorkiln.precision.calibrators import CALIBRATORS, DEFAULT_PERCENTILE
from tensorkiln.precision.quantize import quantized_precision

EPILOG = """examples:
  tensorkiln build model.onnx -o model.engine
  tensorkiln build model.onnx -o model.engine --fp16 --shapes input:8x3x224x224
  tensorkiln build model.onnx -o model.engine \\
      --min-shapes input:1x3x224x224 --opt-shapes input:8x3x224x224 --max-shapes input:32x3x224x224
  tensorkiln build model.onnx -o model.engine --embed-source     # rebuildable later
  tensorkiln build --from-engine old.engine -o new.engine        # rebuild for this machine
  tensorkiln build model.onnx -o model.engine --fp16 --input-io-formats fp16:chw \
      --output-io-formats fp16:chw                                  # fp16 in and out, no casts

  tensorkiln build model.onnx -o model.engine --backend reference --int8 \
      --calib-data calib/ --calib-cache model.calib.json     # INT8, calibrated (entropy)
  tensorkiln build model.onnx -o model.engine --backend reference --int8 \
      --calib-cache model.calib.json                         # again, from the cache

--shapes fixes dynamic inputs (min = opt = max); --min/--opt/--max-shapes give a range
(--opt-shapes alone also fixes a shape). --fp16, --bf16 and --tf32 let the cuda backend's layers
compute in that precision; the reference backend computes in float32 and says so with a warning.
--int8 and --fp8 quantize the convolutions and GEMMs (weights per output channel, activations per
tensor, symmetric), calibrated on --calib-data (a folder of .npy/.npz files, one per sample or
batch, or one .npz of stacked samples) or taken from --calib-cache; a model with its own
QuantizeLinear/DequantizeLinear nodes needs neither. The reference and cuda backends run the
quantized layers (on a GPU a layer measured faster in the engine's float precision stays in it,
unless --quantize-all); the cpu backend warns and builds float32. --best allows every precision
the backend implements (INT8/FP8 only with calibration data or a cache).
"""

PRECISION_FLAGS = ("tf32", "fp16", "bf16", "int8", "fp8")


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "build", "optimize an ONNX model and write an engine file", EPILOG)
    p.add_argument("model", nargs="?", help="the .onnx model (omit with --from-engine)")
    p.add_argument("-o", "--output", required=True, metavar="ENGINE", help="engine file to write")
    for name in PRECISION_FLAGS:
        p.add_argument(f"--{name}", action="store_true", help=f"allow {name} kernels")
    p.add_argument(
        "--best", action="store_true", help="allow every precision the backend implements"
    )
    p.add_argument(
        "--layer-precisions",
        metavar="SPEC",
        help="keep layers of the optimized graph at a precision, e.g. '/fc/Gemm:fp32,conv1:fp32' "
        "(trtexec's --layerPrecisions; `tensorkiln inspect` lists the layers); a layer kept "
        "at fp32/fp16 is not quantized",
    )
    add_calibration_options(p)
    p.add_argument(
        "--remove-padding",
        action="store_true",
        help="run a masked encoder (BERT-style key-padding mask) on its real tokens only, "
        "packed; outputs are zeros at the masked positions",
    )
    p.add_argument(
        "--shapes", metavar="SHAPES", help="fixed input shapes, e.g. input:1x3x224x224,mask:1x128"
    )
    p.add_argument("--min-shapes", metavar="SHAPES", help="smallest shapes the engine accepts")
    p.add_argument("--opt-shapes", metavar="SHAPES", help="shapes to tune kernels for")
    p.add_argument("--max-shapes", metavar="SHAPES", help="largest shapes the engine accepts")
    p.add_argument("--timing-cache", metavar="FILE", help="timing cache to read and update")
    p.add_argument(
        "--tactic-sources",
        metavar="LIST",
        help="kinds of tactic the autotuner may try besides each op's default kernel: triton "
        "(generated kernels), gluon (Hopper 8-bit convolutions in Triton's Gluon), cutlass "
        "(8-bit GEMMs of the CUTLASS kernel library, where one is built), cudnn (fused cuDNN "
        "calls), cublas (convolutions as GEMMs), "
        "cublaslt (each GEMM algorithm cuBLASLt's heuristic offers, epilogues fused), sdpa "
        "(PyTorch's FlashAttention-2 on packed tokens); 'none' times nothing but the defaults "
        "(default: all)",
    )
    p.add_argument(
        "--tactic-exclude",
        metavar="LIST",
        help="tactics the autotuner never tries, by name or shell-style pattern, comma-separated "
        "(cutlass_fp8_*vd): a way around one kernel that fails or hangs, keeping the rest of "
        "its source; a timing cache entry that chose one is timed again",
    )
    p.add_argument(
        "--tactic-timeout",
        type=float,
        metavar="SECONDS",
        help="stop the build when one tactic's check and timing take longer (a kernel that "
        "never ends holds the GPU): the layer and the tactic are named, the timing cache is "
        "saved, and the exit status is 3 (default: no limit)",
    )
    add_backend_option(
        p, "cuda (GPU kernels, autotuned) or reference (numpy); auto: cuda where a GPU is present"
    )
    p.add_argument(
        "--opt-level",
        type=int,
        choices=range(6),
        default=None,
        metavar="N",
        help="graph optimization level 0..5 (default 3; 0 = no graph passes)",
    )
    p.add_argument(
        "--memory-limit",
        type=byte_count,
        metavar="BYTES",
        help="activation memory limit, e.g. 268435456, 256M or 2G",
    )
    p.add_argument(
        "--dump-ir",
        metavar="DIR",
        help="write the IR to DIR after every graph optimizer pass that changed it",
    )
    p.add_argument(
        "--embed-source",
        action="store_true",
        help="store the ONNX model in the engine so it can be rebuilt (--from-engine)",
    )
    p.add_argument(
        "--input-io-formats",
        metavar="FORMATS",
        help="the engine's input types, one per input in order or one for all float inputs: "
        "fp32, fp16 or bf16 (':chw' allowed), e.g. fp16:chw (trtexec's --inputIOFormats)",
    )
    p.add_argument(
        "--output-io-formats",
        metavar="FORMATS",
        help="the engine's output types, as --input-io-formats (trtexec's --outputIOFormats)",
    )
    p.add_argument(
        "--from-engine",
        metavar="ENGINE",
        help="rebuild from the model embedded in ENGINE (which may come from another machine "
        "or version); keeps its profiles and settings unless flags override them",
    )
    p.set_defaults(handler=run_build)


def add_calibration_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("INT8/FP8 calibration")
    g.add_argument(
        "--calib-data",
        metavar="PATH",
        help="calibration data: a folder of .npy/.npz files (an .npz names each input; a "
        "sample or a batch per file) or one .npz/.npy of samples stacked on the first axis; "
        "with --fp16 alone, layers whose values pass fp16's range on it stay fp32",
    )
    g.add_argument(
        "--calib-cache",
        metavar="FILE",
        help="calibration cache (JSON): read when it exists (calibration is skipped), else "
        "written after calibrating",
    )
    g.add_argument(
        "--calibrator",
        choices=CALIBRATORS,
        help="how ranges are chosen (default: entropy for INT8, minmax for FP8)",
    )
    g.add_argument(
        "--calib-percentile",
        type=float,
        default=DEFAULT_PERCENTILE,
        metavar="P",
        help=f"the percentile calibrator's percentile (default {DEFAULT_PERCENTILE})",
    )
    g.add_argument(
        "--calib-batch",
        type=int,
        default=DEFAULT_BATCH,
        metavar="N",
        help=f"samples per calibration batch (default {DEFAULT_BATCH}; a fixed batch wins)",
    )
    g.add_argument(
        "--calib-samples", type=int, metavar="N", help="use at most N samples (default: all)"
    )
    g.add_argument(
        "--smooth-quant",
        type=_alpha,
        metavar="ALPHA",
        help="SmoothQuant for the GEMMs: divide each input channel by max|X|^ALPHA / "
        "max|W|^(1-ALPHA) and multiply the weight by it; 'auto' picks ALPHA (or none) per GEMM "
        "on the first calibration batch (default: off)",
    )
    g.add_argument(
        "--quantize-all",
        action="store_true",
        help="quantize every convolution and GEMM; by default, on a GPU, a layer the autotuner "
        "measures faster in the engine's float precision stays in it (the build report names it)",
    )
    g.add_argument(
        "--accuracy-budget",
        metavar="SPEC",
        help="keep the fewest layers in float32 so that the outputs stay within SPEC of the "
        "float32 engine on the calibration data: rel_l2:0.02 (or 0.02) or cosine:0.999",
    )


def _alpha(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number in [0, 1] or 'auto', got '{text}'"
        ) from None


def profiles_from_args(args: argparse.Namespace) -> list[Any]:
    """Zero or one OptimizationProfile from --shapes and --min/--opt/--max-shapes."""
    fixed = parse_shapes(args.shapes, "--shapes")
    lo = parse_shapes(args.min_shapes, "--min-shapes")
    mid = parse_shapes(args.opt_shapes, "--opt-shapes")
    hi = parse_shapes(args.max_shapes, "--max-shapes")
    if not (fixed or lo or mid or hi):
        return []
    profile = OptimizationProfile()
    for name, shape in fixed.items():
        if name in lo or name in mid or name in hi:
            raise InputError(
                f"input '{name}' is in --shapes and in --min/--opt/--max-shapes; give one"
            )
        profile.set_shape(name, shape, shape, shape)
    for name in dict.fromkeys([*lo, *mid, *hi]):
        if name not in lo and name not in hi:  # --opt-shapes alone: a fixed shape
            lo[name] = hi[name] = mid[name]
        if name not in lo or name not in hi:
            raise InputError(
                f"input '{name}' needs both --min-shapes and --max-shapes (or --opt-shapes alone)"
            )
        profile.set_shape(name, lo[name], mid.get(name, hi[name]), hi[name])
    return [profile]


def read_embedded_source(path: str) -> tuple[bytes, dict[str, Any]]:
    """The ONNX bytes embedded in an engine, and its plan, without checking it can run here.

    Goes through the container reader (magic, format version, checksums) and skips the engine's
    compatibility checks, so an engine built for another device or tensorkiln version still yields
    its model.
    """
    p = existing_file(path)
    plan = read_plan(p)
    source = read_source_model(p)  # checked against the sha256 the plan records
    if source is None:
        name = (plan.get("source") or {}).get("name") or "its ONNX model"
        raise CLIError(
            f"'{p}' does not embed its source model (it was built without --embed-source); "
            f"rebuild from {name} instead"
        )
    return source, plan


def wanted_precisions(args: argparse.Namespace, backend: str) -> set[str]:
    """The precisions the flags ask for; --best means all that ``backend`` implements (INT8 and
    FP8 only when calibration data or a cache is given)."""
    wanted = {n for n in PRECISION_FLAGS if getattr(args, n, False)}
    if args.best:
        best = [p for p in implemented_precisions(backend) if p != "fp32"]
        calibrated = getattr(args, "calib_data", None) or getattr(args, "calib_cache", None)
        left = [p for p in QUANTIZED_PRECISIONS if p not in best or not calibrated]
        if left:
            why = (
                "need calibration data (--calib-data) or a cache (--calib-cache)"
                if all(p in best for p in left)
                else f"are not implemented by the {backend} backend or need calibration data"
            )
            warnings.warn(
                f"--best: {'/'.join(p.upper() for p in left)} {why}; allowing "
                f"{', '.join(['fp32', *(p for p in best if p not in left)])}",
                PrecisionWarning,
                stacklevel=2,
            )
        wanted |= {p for p in best if p not in left}
    return wanted


def _config(args: argparse.Namespace, plan: dict | None, backend: str) -> Any:
    old = (plan or {}).get("build", {}).get("config", {}) if plan else {}
    config = BuilderConfig()
    kept = {p for p in old.get("precisions", ()) if p in PRECISIONS}
    for precision in wanted_precisions(args, backend) or kept:
        config.set_flag(precision)
    config.calibration_data = getattr(args, "calib_data", None)
    config.calibration_cache = getattr(args, "calib_cache", None)
    config.calibrator = getattr(args, "calibrator", None)
    config.calibration_percentile = getattr(args, "calib_percentile", DEFAULT_PERCENTILE)
    config.calibration_batch_size = getattr(args, "calib_batch", DEFAULT_BATCH)
    config.calibration_samples = getattr(args, "calib_samples", None)
    config.accuracy_budget = getattr(args, "accuracy_budget", None)
    config.smooth_quant = getattr(args, "smooth_quant", None)
    if getattr(args, "quantize_all", False):
        config.choose_precision_per_layer = False
    profiles = profiles_from_args(args)
    if not profiles and plan:
        profiles = [OptimizationProfile.from_json(p) for p in plan.get("profiles", [])]
    for profile in profiles:
        config.add_optimization_profile(profile)
    # flags given now win; otherwise a rebuild keeps the old engine's settings
    config.optimization_level = _first(args.opt_level, old.get("optimization_level"), 3)
    # never a path the engine names: only the command line says which files are read or written
    config.timing_cache = timing_cache_file(args.timing_cache)
    config.memory_limit = _first(args.memory_limit, old.get("memory_limit"))
    config.embed_source = args.embed_source or plan is not None
    config.dump_ir = args.dump_ir
    for what in ("input", "output"):
        given = getattr(args, f"{what}_io_formats", None)
        formats = [given] if given else old.get(f"{what}_io_formats", [])
        setattr(config, f"{what}_io_formats", list(formats))
    if args.tactic_sources is not None:
        names = {x.strip() for x in args.tactic_sources.split(",") if x.strip()}
        config.tactic_sources = set() if names == {"none"} else names
    exclude = getattr(args, "tactic_exclude", None)
    if exclude:
        config.tactic_exclude = [x.strip() for x in exclude.split(",") if x.strip()]
    config.tactic_timeout = getattr(args, "tactic_timeout", None)
    given = getattr(args, "layer_precisions", None)
    pins = parse_layer_precisions(given) if given else old.get("layer_precisions", {})
    config.layer_precisions = dict(pins)
    config.remove_padding = bool(getattr(args, "remove_padding", False)) or bool(
        old.get("remove_padding", False)
    )
    return config


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def run_build(args: argparse.Namespace) -> int:
    engine, report, total, config = build_engine(args)
    try:
        engine.save(args.output)
    except OSError as exc:
        raise CLIError(f"cannot write '{args.output}': {exc.strerror or exc}") from None
    print_report(args, engine, report, total, config)
    return 0


def build_engine(args: argparse.Namespace) -> tuple[Any, Any, float, Any]:
    """(engine, build report, seconds, config) for the build flags in ``args``; saves nothing."""
    if (args.model is None) == (args.from_engine is None):
        raise CLIError("give either an ONNX model or --from-engine ENGINE (one of them)")
    plan = None
    source_name = None
    if args.from_engine is not None:
        model, plan = read_embedded_source(args.from_engine)
        source_name = Path((plan.get("source") or {}).get("name") or "model.onnx").name
    else:
        model = existing_file(args.model)
        kind = sniff_file(model)
        if kind == "engine":
            raise CLIError(
                f"'{model}' is an engine, not an ONNX model; to rebuild it use "
                f"`tensorkiln build --from-engine {model} -o NEW.engine`"
            )
        if kind is not None:
            raise not_a_model(model, kind)
    builder = Builder(args.backend)
    config = _config(args, plan, builder.backend)
    t0 = time.perf_counter()
    engine = builder.build(model, config, source_name=source_name)
    return engine, builder.last_report, time.perf_counter() - t0, config


FUSED_SHOWN = 20  # fused layers listed in the build report


def _print_tuning(engine: Any, report: Any) -> None:
    tuned = [x for x in report.layers if x.get("timings_ms")]
    chosen: dict[str, int] = {}
    for x in report.layers:
        chosen[x.get("tactic", "default")] = chosen.get(x.get("tactic", "default"), 0) + 1
    tc = report.timing_cache
    print(
        f"autotuner: {len(tuned)} layers timed ({tc.get('hits', 0)} from the timing cache, "
        f"{tc.get('misses', 0)} measured); tactics chosen: "
        + ", ".join(f"{k} x{n}" for k, n in sorted(chosen.items(), key=lambda kv: -kv[1]))
    )


def print_report(
    args: argparse.Namespace, engine: Any, report: Any, total: float, config: Any
) -> None:
    """The build report: layers, precisions, profiles, phases, passes, fusions, memory."""
    src = args.from_engine or args.model
    dst = args.output or "an engine in memory"
    print(f"built {src} -> {dst} in {total * 1e3:.1f} ms (backend {engine.backend})")
    # what the engine records: the precisions its backend implements, not every flag given
    allowed = engine.build.get("config", {}).get("precisions", ["fp32"])
    main = engine.build.get("precision", "fp32")
    quantized = Counter(q for n in engine.graph.nodes if (q := quantized_precision(n)))
    print(
        f"layers: {len(report.layers)} (from {report.nodes_before} nodes)   precisions allowed: "
        f"{', '.join(allowed)}; layers compute in {main}"
        + "".join(f", {n} in {q}" for q, n in sorted(quantized.items()))
    )
    for i, p in enumerate(config.profiles):
        for name, (lo, mid, hi) in p.shapes.items():
            print(f"profile {i}: {name} min {list(lo)} opt {list(mid)} max {list(hi)}")
    if engine.runtime_backend.autotunes:
        _print_tuning(engine, report)
    kept = [x for x in report.layers if x.get("fallback")]
    if kept:  # tuning could not measure these; they run their default kernel
        print(f"tuning kept the default kernel of {len(kept)} layers:")
        for x in kept[:FUSED_SHOWN]:
            print(f"  {printable(x['name'])}: {printable(x['fallback'])}")
    for note in report.notes:
        print(f"note: {printable(note)}")
    print_table(["phase", "ms"], [[name, f"{s * 1e3:.1f}"] for name, s in report.phases.items()])
    if report.passes:
        print_table(["optimizer pass", "matches"], [[k, str(n)] for k, n in report.passes.items()])
    fused = [[x["name"], x["op"]] for x in report.layers if x["op"].startswith("tensorkiln.")]
    if fused:
        shown = fused[:FUSED_SHOWN]
        print_table(["fused layer", "op"], shown)
        if len(fused) > len(shown):
            print(
                f"... and {len(fused) - len(shown)} more fused layers (`tensorkiln inspect` lists all)"
            )
    mem = report.memory
    if mem:
        naive, peak = mem["naive_bytes"], mem["peak_bytes"]
        saved = f" ({1 - peak / naive:.0%} less)" if naive else ""
        print(
            f"activation memory: planned peak {peak:,} bytes ({mib(peak)}), naive sum "
            f"{naive:,} bytes ({mib(naive)}){saved}"
        )
        if mem.get("dynamic"):
            print(f"dynamic buffers (sized at run time): {len(mem['dynamic'])}")
    if config.embed_source:
        print("source model embedded (rebuild with --from-engine)")
