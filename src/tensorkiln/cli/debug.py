"""``tensorkiln debug precision``: which layers must stay in higher precision for an INT8/FP8
engine to stay within a tolerance of float32 (Polygraphy's ``debug precision``, without the
rebuild loop: every layer's sensitivity is measured on one quantized graph)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tensorkiln.backends import get_backend, resolve
from tensorkiln.builder.builder import optimize
from tensorkiln.cli import plots
from tensorkiln.cli.build import add_calibration_options
from tensorkiln.cli.common import (
    CLIError,
    add_backend_option,
    add_subcommand,
    existing_file,
    print_table,
)
from tensorkiln.frontends.onnx import import_onnx
from tensorkiln.precision.budget import AccuracyBudget, run_with, search
from tensorkiln.precision.calib_data import CalibrationData
from tensorkiln.precision.calibration import CalibrationRequest, calibrate
from tensorkiln.precision.quantize import (
    BUDGET_BATCHES,
    budget_feeds,
    calibrated_tensors,
    insert_qdq,
    quantizable,
)
from tensorkiln.runtime.executor import Executor

EPILOG = """examples:
  tensorkiln debug precision model.onnx --int8 --calib-data calib/ --rel-l2 0.02
  tensorkiln debug precision model.onnx --fp8 --calib-data calib.npz --cosine 0.999 --json

Quantizes the optimized graph's convolutions and GEMMs as `tensorkiln build --int8` does, then, on
the first calibration batches, measures the outputs' error against float32 with every layer
quantized and with each layer alone kept in float32, and finds the fewest layers to keep for the
tolerance. Prints the layers by how much error keeping them removes, and the --layer-precisions
value that keeps them (or use `tensorkiln build --accuracy-budget`, which does this itself).
"""


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "debug", "accuracy debugging tools", "examples:\n"
                       "  tensorkiln debug precision model.onnx --int8 --calib-data calib/\n")  # fmt: skip
    tools = p.add_subparsers(dest="tool", required=True, metavar="TOOL")
    q = add_subcommand(
        tools, "precision", "find the layers an INT8/FP8 engine must keep in float32", EPILOG
    )
    q.add_argument("model", help="the .onnx model")
    kind = q.add_mutually_exclusive_group(required=True)
    kind.add_argument("--int8", action="store_true", help="quantize to INT8")
    kind.add_argument("--fp8", action="store_true", help="quantize to FP8 (E4M3)")
    tol = q.add_mutually_exclusive_group()
    tol.add_argument("--rel-l2", type=float, metavar="T", help="outputs' relative L2 error <= T "
                     "(default 0.01)")  # fmt: skip
    tol.add_argument("--cosine", type=float, metavar="C", help="outputs' cosine similarity >= C")
    add_calibration_options(q)
    add_backend_option(q, "the backend to run on (default: auto)")
    q.add_argument(
        "--plot",
        metavar="DIR",
        help="write DIR/layers.png (each layer's error when kept in float32) and "
        "DIR/histograms/<tensor>.png (its calibration histogram and ranges); needs matplotlib",
    )
    q.add_argument("--json", action="store_true", help="print the result as one JSON object")
    q.set_defaults(handler=run_debug_precision)


def _plot(
    folder: str, found: Any, budget: AccuracyBudget, request: Any, table: Any, p: str
) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"layer": k, "rel_l2": e, "passed": k not in found.kept}
            for k, e in sorted(found.sensitivity.items(), key=lambda kv: kv[1])]  # fmt: skip
    limit = budget.value if budget.metric == "rel_l2" else 1.0 - budget.value
    what = "relative L2" if budget.metric == "rel_l2" else "1 - worst cosine"
    plots.layer_errors(rows, limit, out / "layers.png", f"{what} with the layer in float32",
                       "error when each layer alone stays float32 (red: kept)")  # fmt: skip
    if request.histograms:
        plots.histograms(request.histograms, table.amax, p, out / "histograms")
    elif request.histograms is not None:
        print("(the ranges came from the calibration cache: no histograms to draw)")


def run_debug_precision(args: argparse.Namespace) -> int:
    model = existing_file(args.model)
    precision = "int8" if args.int8 else "fp8"
    budget = AccuracyBudget.parse(
        f"cosine:{args.cosine}" if args.cosine is not None else f"rel_l2:{args.rel_l2 or 0.01}"
    )
    if args.calib_data is None:
        raise CLIError("debug precision measures on calibration data: give --calib-data")
    name, device = resolve(args.backend, None)
    backend = get_backend(name, device)
    graph = import_onnx(str(model), backend=name)
    optimize(graph, 3, backend=name)
    layers = quantizable(graph)
    if not layers:
        raise CLIError(f"'{model}' has no convolution or GEMM with a constant weight to quantize")
    data = CalibrationData(args.calib_data, args.calib_batch, args.calib_samples)
    request = CalibrationRequest(data, args.calib_cache, args.calibrator, args.calib_percentile,
                                 keep_batches=BUDGET_BATCHES)  # fmt: skip
    if args.plot:
        request.histograms = {}
    tensors = calibrated_tensors(layers)

    def factory(g: Any) -> Executor:
        return Executor(g, backend)

    table = calibrate(graph, factory, tensors, precision, request)
    switches = insert_qdq(graph, table, layers, precision)
    feeds = budget_feeds(graph, request)
    found = search(graph, switches, budget, feeds, run_with(factory), rank_all=True)
    ops = {s.node.name: s.node.op for s in switches}
    ranked = sorted(found.sensitivity.items(), key=lambda kv: kv[1])
    spec = ",".join(f"{k}:fp32" for k in found.kept)
    if args.plot:
        _plot(args.plot, found, budget, request, table, precision)
    if args.json:
        print(json.dumps({
            "model": str(model), "precision": precision, "budget": budget.__dict__,
            "all_quantized": found.all_quantized, "final": found.final, "kept": found.kept,
            "layer_precisions": spec,
            "sensitivity": [{"layer": k, "op": ops[k], "error_when_kept": e} for k, e in ranked],
        }, indent=2))  # fmt: skip
        return 0
    print(f"{model.name}: {len(switches)} layers quantized to {precision}, measured on "
          f"{sum(len(next(iter(f.values()))) for f in feeds)} samples against float32")  # fmt: skip
    print(f"every layer quantized: {budget.shown(found.all_quantized)}")
    rows = [[k, ops[k], budget.shown(e), "keep" if k in found.kept else ""] for k, e in ranked]
    print_table(["layer", "op", "error when kept in float32", "verdict"], rows)
    if not found.kept:
        print(f"PASSED: every layer can be quantized ({budget.shown(found.all_quantized)})")
    else:
        print(f"keep {len(found.kept)} of {len(switches)} layers in float32 for "
              f"{budget.shown(found.final)}: --layer-precisions '{spec}'")  # fmt: skip
    return 0
