"""``tensorkiln compare``: tensorkiln against onnxruntime (the independent reference) on one input."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from tensorkiln.cli.common import (
    CLIError,
    add_subcommand,
    check_feed_names,
    existing_file,
    input_shapes,
    load_inputs,
    load_or_build,
    non_negative,
    parse_shapes,
    print_table,
    random_inputs,
    save_npz,
)

DEFAULT_ATOL = 1e-5
DEFAULT_RTOL = 1e-3

EPILOG = f"""examples:
  tensorkiln compare model.onnx
  tensorkiln compare model.onnx --engine model.engine --seed 0
  tensorkiln compare model.onnx --shapes input:4x3x224x224 --atol 1e-4 --rtol 1e-2
  tensorkiln compare model.onnx --load-inputs in.npz

An output passes when every element satisfies |a - b| <= atol + rtol * |b|, with a from tensorkiln
and b from onnxruntime (CPU); defaults atol {DEFAULT_ATOL:g}, rtol {DEFAULT_RTOL:g}. NaNs in the same
places agree. Exit status: 0 when all outputs pass, 1 when any fails. Needs onnxruntime.
"""


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "compare", "compare tensorkiln's outputs with onnxruntime's", EPILOG)
    p.add_argument("model", help="the .onnx model (onnxruntime runs it)")
    p.add_argument(
        "--engine", help="a tensorkiln engine to check (default: build the model in memory)"
    )
    p.add_argument(
        "--atol",
        type=non_negative(float),
        default=DEFAULT_ATOL,
        help=f"absolute tolerance (default {DEFAULT_ATOL:g})",
    )
    p.add_argument(
        "--rtol",
        type=non_negative(float),
        default=DEFAULT_RTOL,
        help=f"relative tolerance (default {DEFAULT_RTOL:g})",
    )
    p.add_argument("--shapes", help="input shapes, e.g. input:1x3x224x224")
    p.add_argument(
        "--load-inputs", metavar="NPZ", help="inputs from an .npz file (default: random)"
    )
    p.add_argument("--seed", type=int, help="seed for the random inputs")
    p.add_argument(
        "--save-outputs",
        metavar="NPZ",
        help="write both sides' outputs (tensorkiln:NAME, onnxruntime:NAME)",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(handler=run_compare)


def onnxruntime_outputs(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of ``model`` (a path) under onnxruntime's CPU provider."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise CLIError(
            "compare needs onnxruntime as its reference; install it with `pip install onnxruntime`"
        ) from None
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise CLIError(f"onnxruntime cannot load '{model}': {_first_line(exc)}") from None
    names = [o.name for o in session.get_outputs()]
    try:
        results = session.run(names, feeds)
    except Exception as exc:
        raise CLIError(f"onnxruntime failed to run '{model}': {_first_line(exc)}") from None
    return dict(zip(names, results))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def error_stats(a: Any, b: Any, atol: float, rtol: float) -> dict:
    """Error of ``a`` (tensorkiln) against ``b`` (reference), and whether it is within tolerance."""
    a, b = np.asarray(a), np.asarray(b)
    row = {"shape": list(b.shape), "dtype": str(b.dtype)}
    if a.shape != b.shape:
        return {
            **row,
            "passed": False,
            "problem": f"shape {list(a.shape)} != reference {list(b.shape)}",
        }
    if not (_numeric(a) and _numeric(b)):
        same = bool(np.array_equal(a, b))
        return {**row, "passed": same, "problem": None if same else "values differ"}
    x, y = a.astype(np.float64), b.astype(np.float64)
    both_nan = np.isnan(x) & np.isnan(y)
    diff = np.where(both_nan, 0.0, np.abs(x - y))
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only: an infinite error
    mag = np.abs(y)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / mag)
    ok = np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    return {
        **row,
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "max_rel": float(rel.max()) if rel.size else 0.0,
        "mean_abs": float(diff.mean()) if diff.size else 0.0,
        "mismatched": int(ok.size - ok.sum()),
        "passed": bool(ok.all()),
        "problem": None,
    }


def _numeric(a: np.ndarray) -> bool:
    return (
        a.dtype.kind in "biufc" or a.dtype.name in ("bfloat16",) or a.dtype.name.startswith("float")
    )


def run_compare(args: argparse.Namespace) -> int:
    model = existing_file(args.model)
    shapes = parse_shapes(args.shapes)
    loaded = load_or_build(args.engine or args.model, {} if args.engine else shapes)
    engine = loaded.engine
    if args.load_inputs:
        feeds = load_inputs(args.load_inputs)
        check_feed_names(engine, feeds, f"'{args.load_inputs}'")
    else:
        feeds = random_inputs(engine, input_shapes(engine, shapes), args.seed)
    with engine.create_execution_context() as ctx:
        for name, arr in feeds.items():
            ctx.set_input_shape(name, np.shape(arr))
        ours = ctx.infer(feeds)
    ref = onnxruntime_outputs(model, feeds)
    rows = {}
    for name, b in ref.items():
        if name not in ours:
            rows[name] = {"passed": False, "problem": "tensorkiln does not produce this output"}
        else:
            rows[name] = error_stats(ours[name], b, args.atol, args.rtol)
    for name in ours.keys() - ref.keys():
        rows[name] = {"passed": False, "problem": "onnxruntime does not produce this output"}
    if args.save_outputs:
        save_npz(
            args.save_outputs,
            {
                **{f"tensorkiln:{k}": v for k, v in ours.items()},
                **{f"onnxruntime:{k}": v for k, v in ref.items()},
            },
        )
    failed = [n for n, r in rows.items() if not r["passed"]]
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(model),
                    "engine": args.engine,
                    "atol": args.atol,
                    "rtol": args.rtol,
                    "outputs": rows,
                    "passed": not failed,
                },
                indent=2,
            )
        )
    else:
        _print_text(args, loaded, rows)
    if failed:
        print(
            f"tensorkiln: FAILED: {len(failed)} of {len(rows)} output(s) exceed atol {args.atol:g} + "
            f"rtol {args.rtol:g} * |reference|: {', '.join(failed)}",
            file=sys.stderr if args.json else sys.stdout,
        )
        return 1
    if not args.json:
        print(
            f"PASSED: all {len(rows)} output(s) within atol {args.atol:g} + rtol {args.rtol:g} * |reference|"
        )
    return 0


def _print_text(args: argparse.Namespace, loaded: Any, rows: dict) -> None:
    what = str(loaded.path) if loaded.built is None else f"{loaded.path.name} built in memory"
    print(f"tensorkiln ({what}, backend {loaded.engine.backend}) vs onnxruntime (CPU)")

    def num(r: dict, k: str) -> str:
        return f"{r[k]:.3e}" if k in r else "-"

    table = []
    for name, r in rows.items():
        verdict = "pass" if r["passed"] else "FAIL"
        if r.get("problem"):
            verdict += f" ({r['problem']})"
        elif not r["passed"]:
            verdict += f" ({r['mismatched']} elements)"
        table.append([name, num(r, "max_abs"), num(r, "max_rel"), num(r, "mean_abs"), verdict])
    print_table(["output", "max abs", "max rel", "mean abs", "result"], table)
