"""``tensorkiln trtexec``: trtexec's own flags, translated to ``tensorkiln build`` and ``run``.

Scripts written for NVIDIA's trtexec move over unchanged: the flags keep trtexec's names, its
``--flag=value`` form, its shape syntax and its units (--warmUp in milliseconds, --duration in
seconds). Each flag is translated to the options of the build and run commands, whose code does
the work. A trtexec flag tensorkiln does not implement is a one-line error (exit 2), never
ignored.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from tensorkiln.cli import build, run
from tensorkiln.cli.common import (
    CLIError,
    Loaded,
    existing_file,
    not_a_model,
    parse_shapes,
    percentiles,
    sniff_file,
)
from tensorkiln.cli.inputs import (
    RANDOM_INPUT_LIMIT,
)
from tensorkiln.engine import Engine
from tensorkiln.precision.calib_data import RandomCalibration


@dataclass(frozen=True)
class Flag:
    """A trtexec flag tensorkiln implements: where its value goes and how it is read."""

    dest: str
    help: str
    convert: Callable[[str], Any] | None = None  # None: a switch, given without a value


def _number(kind: type, low: float, what: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"expected {what}, got '{text}'") from None
        if value < low:
            raise ValueError(f"must be >= {low:g}, got '{text}'")
        return value

    return convert


def _level(text: str) -> int:
    value = _number(int, 0, "an integer 0..5")(text)
    if value > 5:
        raise ValueError(f"must be 0..5, got '{text}'")
    return value


def _percentiles(text: str) -> list[float]:
    try:
        return percentiles(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None


def _constraints(text: str) -> str:
    if text not in ("obey", "prefer"):
        raise ValueError(
            f"must be obey or prefer, got '{text}' (tensorkiln obeys --layerPrecisions)"
        )
    return text


def _text(text: str) -> str:
    if not text:
        raise ValueError("needs a value")
    return text


def _name_files(text: str) -> dict[str, str]:
    """--loadInputs's 'NAME:FILE,NAME:FILE' (the name up to the last ':', maybe quoted)."""
    files: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, path = item.rpartition(":")
        if len(name) >= 2 and name[0] == name[-1] == "'":
            name = name[1:-1]
        if not sep or not name or not path:
            raise ValueError(f"bad entry '{item}': expected NAME:FILE, e.g. x:x.bin")
        if name in files:
            raise ValueError(f"input '{name}' is given twice")
        files[name] = path
    if not files:
        raise ValueError("needs NAME:FILE entries")
    return files


SUPPORTED: dict[str, Flag] = {
    "--onnx": Flag("onnx", "the ONNX model to build", _text),
    "--saveEngine": Flag("save_engine", "write the engine built from --onnx here", _text),
    "--loadEngine": Flag("load_engine", "run this engine (no build)", _text),
    "--shapes": Flag("shapes", "input shapes to run with (and to build with, alone)", _text),
    "--minShapes": Flag("min_shapes", "smallest shapes of the build's profile", _text),
    "--optShapes": Flag("opt_shapes", "shapes the build tunes for", _text),
    "--maxShapes": Flag("max_shapes", "largest shapes of the build's profile", _text),
    "--fp16": Flag("fp16", "allow fp16 layers (backends without fp16 warn and keep fp32)"),
    "--bf16": Flag("bf16", "allow bf16 layers (as --fp16)"),
    "--int8": Flag("int8", "quantize convolutions/GEMMs to INT8 (needs --calib or Q/DQ nodes)"),
    "--fp8": Flag("fp8", "quantize convolutions/GEMMs to FP8 (as --int8)"),
    "--best": Flag("best", "allow every precision the backend implements (warns)"),
    "--calib": Flag("calib_cache", "INT8/FP8 calibration cache to read (JSON)", _text),
    "--layerPrecisions": Flag("layer_precisions", "LAYER:PRECISION,...: keep layers there", _text),
    "--precisionConstraints": Flag(
        "precision_constraints", "obey or prefer: both obey --layerPrecisions", _constraints
    ),
    "--noTF32": Flag("no_tf32", "no TF32 (tensorkiln allows TF32 only when asked)"),
    "--builderOptimizationLevel": Flag("opt_level", "graph optimization level 0..5", _level),
    "--timingCacheFile": Flag("timing_cache", "timing cache to read and update", _text),
    "--inputIOFormats": Flag(
        "input_io_formats", "input types, e.g. fp16:chw (one per input)", _text
    ),
    "--outputIOFormats": Flag("output_io_formats", "output types, as --inputIOFormats", _text),
    "--skipInference": Flag("skip_inference", "build (and save) only; do not run"),
    "--buildOnly": Flag("skip_inference", "the older name of --skipInference"),
    "--iterations": Flag("iterations", "run at least N iterations", _number(int, 1, "an integer")),
    "--duration": Flag("duration", "run for at least N seconds", _number(float, 0, "seconds")),
    "--warmUp": Flag("warmup_ms", "warm up for N milliseconds first", _number(float, 0, "ms")),
    "--avgRuns": Flag("avg_runs", "report means over N consecutive runs", _number(int, 1, "N")),
    "--percentile": Flag("percentile", "latency percentiles, e.g. 90,95,99", _percentiles),
    "--useCudaGraph": Flag("use_cuda_graph", "replay the engine as one CUDA graph"),
    "--noDataTransfers": Flag("device_io", "keep inputs and outputs on the GPU"),
    "--separateProfileRun": Flag("separate_profile", "per-layer times come from a separate run"),
    "--dumpProfile": Flag("dump_profile", "print per-layer times"),
    "--exportTimes": Flag("export_times", "write each iteration's times as JSON", _text),
    "--exportProfile": Flag("export_profile", "write the per-layer times as JSON", _text),
    "--loadInputs": Flag("raw_inputs", "NAME:FILE,...: raw inputs (others random)", _name_files),
    "--exportOutput": Flag("export_output", "write the last run's outputs as JSON", _text),
    "--verbose": Flag("verbose", "show tracebacks on errors"),
    "-v": Flag("verbose", "as --verbose"),
    "--backend": Flag("backend", "tensorkiln's own: auto, reference or cuda", _text),
}

# The rest of trtexec's flags (TensorRT 10), each refused by name; some with what to use instead.
UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(
        """--minShapesCalib --optShapesCalib --maxShapesCalib
        --memPoolSize --workspace --profilingVerbosity --avgTiming --minTiming --refit
        --stripWeights --stripAllWeights --weightless --versionCompatible --vc
        --pluginInstanceNorm --pi --uint8AsymmetricQuantizationDLA --useRuntime --leanDLLPath
        --excludeLeanRuntime --monitorMemory --sparsity --stronglyTyped --directIO
        --layerOutputTypes --layerDeviceTypes
        --decomposableAttentions --safe --dumpKernelText --buildDLAStandalone
        --allowGPUFallback --consistency --restricted --asyncFileReader --getPlanVersionOnly
        --noBuilderCache --noCompilationCache --errorOnTimingCacheMiss --preview --maxTactics
        --hardwareCompatibilityLevel --runtimePlatform --tempdir --tempfileControls
        --maxAuxStreams --profile --calibProfile --allowWeightStreaming --markDebug
        --markUnfusedTensorsAsDebugTensors --tilingOptimizationLevel --l2LimitForTiling
        --remoteAutoTuningConfig --refitFromOnnx --sleepTime --idleTime --infStreams --streams
        --exposeDMA --useManagedMemory --useSpinWait --threads --timeDeserialize --timeRefit
        --persistentCacheRatio --useProfile --allocationStrategy --saveDebugTensors
        --saveAllDebugTensors --weightStreamingBudget --dumpRefit --dumpRawBindingsToFile
        --dumpLayerInfo --dumpOptimizationProfile --exportLayerInfo --device --useDLACore
        --staticPlugins --dynamicPlugins --setPluginsToSerialize --ignoreParsedPluginLibs
        --safetyPlugins --plugins --uff --uffInput --uffNHWC --model --deploy --output --batch
        --maxBatch --explicitBatch""".split(),  # noqa: SIM905 (a list of 95 names, kept compact)
        "",
    ),
    "--int4": "INT4 is not implemented yet",
    "--tacticSources": "`tensorkiln build --tactic-sources` chooses tactic kinds",
    "--dumpOutput": "--exportOutput=FILE.json writes the outputs",
}

EPILOG = """examples: trtexec command lines, unchanged but for the program's name
  tensorkiln trtexec --onnx=model.onnx --saveEngine=model.engine --fp16
  tensorkiln trtexec --onnx=model.onnx --minShapes=input:1x3x224x224 \\
      --optShapes=input:8x3x224x224 --maxShapes=input:32x3x224x224 --shapes=input:8x3x224x224
  tensorkiln trtexec --loadEngine=model.engine --shapes='input:0':1x128 --useCudaGraph \\
      --iterations=100 --warmUp=500 --duration=10 --dumpProfile --exportTimes=times.json

--onnx builds (as `tensorkiln build`; --saveEngine writes the engine) and then runs it (as
`tensorkiln run`) unless --skipInference; --loadEngine runs an engine. Values follow '=' as in
trtexec; shapes are NAME:DxDx... joined by ',' (a name with ':' in single quotes; NAME: or
NAME:scalar for 0-d). --warmUp is in milliseconds, --duration in seconds (trtexec's units).
Any other trtexec flag is refused by name (exit 2).

flags:
"""


# what only a build uses: with --loadEngine these would do nothing, so they are refused
BUILD_ONLY = (
    "save_engine",
    "min_shapes",
    "opt_shapes",
    "max_shapes",
    "timing_cache",
    "opt_level",
    "input_io_formats",
    "output_io_formats",
    "best",
    "calib_cache",
    "layer_precisions",
    "precision_constraints",
    "no_tf32",
    "backend",
    *build.PRECISION_FLAGS,
)


class UsageError(Exception):
    """A flag trtexec would not accept, or one tensorkiln does not implement: exit 2."""


def add_parser(sub: Any) -> None:
    # '+' as the prefix: every '--flag=value' reaches the handler as it was written
    p = sub.add_parser(
        "trtexec",
        help="run trtexec command lines (its flags, translated to build and run)",
        description="trtexec's flags, translated to `tensorkiln build` and `tensorkiln run`.",
        epilog=EPILOG + _flag_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prefix_chars="+",
        add_help=False,
    )
    p.add_argument("flags", nargs="*", metavar="--flag[=value]")
    p.set_defaults(handler=run_trtexec, help_text=p.format_help)


def _flag_table() -> str:
    lines = []
    for name, flag in SUPPORTED.items():
        value = "" if flag.convert is None else "=VALUE"
        lines.append(f"  {name + value:<34}{flag.help}")
    return "\n".join(lines) + "\n"


def parse_flags(argv: Sequence[str]) -> dict[str, Any]:
    """trtexec's command line -> {dest: value}; raises UsageError naming the first bad flag."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for i, arg in enumerate(argv):
        name, eq, text = arg.partition("=")
        if not name.startswith("-"):
            raise UsageError(
                f"unexpected argument '{arg}': trtexec flags take their value after '=', "
                "e.g. --onnx=model.onnx"
            )
        if name in UNSUPPORTED:
            hint = UNSUPPORTED[name]
            raise UsageError(
                f"trtexec flag {name} is not supported by tensorkiln"
                + (f" ({hint})" if hint else "")
            )
        flag = SUPPORTED.get(name)
        if flag is None:
            raise UsageError(f"unknown trtexec flag {name}")
        if flag.dest in given:
            raise UsageError(f"{name} is given twice (as {given[flag.dest]} before)")
        given[flag.dest] = name
        following = argv[i + 1] if i + 1 < len(argv) else "VALUE"
        values[flag.dest] = _value(name, flag, eq, text, following)
    return values


def _value(name: str, flag: Flag, eq: str, text: str, following: str) -> Any:
    if flag.convert is None:
        if eq:
            raise UsageError(f"{name} is a switch and takes no value, got '{name}={text}'")
        return True
    if not eq:
        value = "VALUE" if following.startswith("-") else following
        raise UsageError(
            f"{name} needs a value: {name}={value} (trtexec flags take their value after '=')"
        )
    try:
        return flag.convert(text)
    except ValueError as exc:
        raise UsageError(f"{name}: {exc}") from None


def run_trtexec(args: argparse.Namespace) -> int:
    if any(a in ("--help", "-h") for a in args.flags):
        print(args.help_text())
        return 0
    try:
        opts = parse_flags(args.flags)
        _check_combination(opts)
    except UsageError as exc:
        _usage_error(str(exc))
    # main reads it when an error reaches it; `tensorkiln --verbose trtexec ...` set it already
    args.verbose = getattr(args, "verbose", False) or opts.get("verbose", False)
    loaded = _build(opts) if "onnx" in opts else _load(opts["load_engine"])
    if opts.get("skip_inference"):
        return 0
    shapes = parse_shapes(opts.get("shapes"), "--shapes")
    return run.run_loaded(_run_args(opts), loaded, shapes)


def _usage_error(message: str) -> NoReturn:
    print(f"tensorkiln: error: {message} (see 'tensorkiln trtexec --help')", file=sys.stderr)
    raise SystemExit(2)


def _check_combination(opts: dict[str, Any]) -> None:
    if ("onnx" in opts) == ("load_engine" in opts):
        raise UsageError("give one model: --onnx=MODEL.onnx or --loadEngine=FILE.engine")
    if "load_engine" in opts:
        for dest in BUILD_ONLY:
            if dest in opts:
                name = next(n for n, f in SUPPORTED.items() if f.dest == dest)
                raise UsageError(f"{name} is a build flag; it has no use with --loadEngine")
    if opts.get("skip_inference") and "load_engine" in opts:
        raise UsageError("--skipInference with --loadEngine leaves nothing to do")


def _placeholder_calibration(opts: dict[str, Any]) -> RandomCalibration | None:
    """trtexec builds --int8/--fp8/--best without a calibration cache on placeholder ranges (for
    speed, not accuracy): here, ranges calibrated on random inputs, with a warning."""
    quantized = opts.get("int8") or opts.get("fp8") or opts.get("best")
    if not quantized or opts.get("calib_cache"):
        return None
    print(
        "tensorkiln: warning: no calibration cache (--calib): INT8/FP8 ranges come from random "
        "inputs, as trtexec's placeholder ranges do; the engine's speed is meaningful, its "
        "accuracy is not (calibrate with `tensorkiln build --calib-data`)",
        file=sys.stderr,
    )
    return RandomCalibration()


def _build(opts: dict[str, Any]) -> Loaded:
    """Build with `tensorkiln build`'s code; save the engine if --saveEngine names a file."""
    ranged = any(k in opts for k in ("min_shapes", "opt_shapes", "max_shapes"))
    args = argparse.Namespace(
        model=opts["onnx"],
        from_engine=None,
        output=opts.get("save_engine"),
        # trtexec builds with --shapes when no range is given, and runs with it in either case
        shapes=None if ranged else opts.get("shapes"),
        min_shapes=opts.get("min_shapes"),
        opt_shapes=opts.get("opt_shapes"),
        max_shapes=opts.get("max_shapes"),
        timing_cache=opts.get("timing_cache"),
        tactic_sources=None,
        backend=opts.get("backend", "auto"),
        opt_level=opts.get("opt_level"),
        input_io_formats=opts.get("input_io_formats"),
        output_io_formats=opts.get("output_io_formats"),
        memory_limit=None,
        dump_ir=None,
        embed_source=False,
        best=opts.get("best", False),
        calib_cache=opts.get("calib_cache"),
        calib_data=_placeholder_calibration(opts),
        layer_precisions=opts.get("layer_precisions"),
        **{p: opts.get(p, False) for p in build.PRECISION_FLAGS},
    )
    engine, report, seconds, config = build.build_engine(args)
    if args.output:
        try:
            engine.save(args.output)
        except OSError as exc:
            raise CLIError(f"cannot write '{args.output}': {exc.strerror or exc}") from None
    build.print_report(args, engine, report, seconds, config)
    return Loaded(engine, Path(args.output or opts["onnx"]), report, seconds)


def _load(path: str) -> Loaded:
    p = existing_file(path)
    kind = sniff_file(p)
    if kind is None:
        raise CLIError(
            f"--loadEngine '{p}' is not a tensorkiln engine (no TKENGINE magic); an ONNX model "
            f"goes in --onnx={p}"
        )
    if kind != "engine":
        raise not_a_model(p, kind)
    return Loaded(Engine.load(p), p)


def _run_args(opts: dict[str, Any]) -> argparse.Namespace:
    """`tensorkiln run`'s options for these flags, with trtexec's defaults and units."""
    return argparse.Namespace(
        json=False,
        load_inputs=None,
        seed=None,
        max_input_bytes=RANDOM_INPUT_LIMIT,
        save_outputs=None,
        iterations=opts.get("iterations"),
        duration=opts.get("duration"),
        warmup=opts.get("warmup_ms", 200.0) / 1e3,
        percentile=opts.get("percentile", [90.0, 95.0, 99.0]),
        avg_runs=opts.get("avg_runs"),
        dump_profile=opts.get("dump_profile", False),
        export_times=opts.get("export_times"),
        export_profile=opts.get("export_profile"),
        peak_tflops=None,
        peak_gbps=None,
        profile_by="layer",
        raw_inputs=opts.get("raw_inputs"),
        export_output=opts.get("export_output"),
        use_cuda_graph=opts.get("use_cuda_graph", False),
        device_io=opts.get("device_io", False),
        cpu_compile=False,  # (trtexec has no such flag; TENSORKILN_CPU_COMPILE=1 still applies)
    )
