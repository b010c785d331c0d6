"""``tensorkiln compare``: tensorkiln against onnxruntime (the independent reference) on one input."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tensorkiln.builder import Builder
from tensorkiln.cli import layerwise, plots
from tensorkiln.cli.common import (
    CLIError,
    Loaded,
    add_subcommand,
    existing_file,
    load_or_build,
    non_negative,
    not_a_model,
    parse_shapes,
    print_table,
    save_npz,
    sniff_file,
)
from tensorkiln.cli.inputs import (
    add_input_limit_option,
    check_feed_names,
    input_shapes,
    load_inputs,
    random_inputs,
)
from tensorkiln.frontends.onnx import load_model_proto

DEFAULT_REL_L2 = 1e-4  # a correct fp32 engine: ~1e-7..1e-5; a wrong one: ~1
DEFAULT_ATOL = 1e-5  # Polygraphy's defaults, for --check-error-stat
DEFAULT_RTOL = 1e-5
ERROR_STATS = ("max", "mean", "median", "elemwise")

EPILOG = f"""examples:
  tensorkiln compare model.onnx
  tensorkiln compare model.onnx --engine model.engine --seed 0
  tensorkiln compare model.onnx --engine fp16.engine --rel-l2 1e-2 --cosine 0.9999
  tensorkiln compare model.onnx --check-error-stat median --atol 1e-4 --rtol 1e-3
  tensorkiln compare model.onnx --load-inputs in.npz --json
  tensorkiln compare model.onnx --engine int8.engine --layerwise --rel-l2 5e-2
  tensorkiln compare model.onnx --engine int8.engine --layerwise --reference fp32

Per output, a from tensorkiln and b from onnxruntime (CPU): the magnitude of both sides (mean and
max |x|), the absolute error |a - b| (max, mean, median), the relative error |a - b| / |b| (max,
mean, median), the relative L2 error ||a - b|| / ||b|| and the cosine similarity of a and b.

An output passes when every chosen criterion holds:
  --rel-l2 T            relative L2 error <= T (default {DEFAULT_REL_L2:g}; 0 turns it off). It does
                        not depend on the output's scale, so a wrong output of magnitude 1e-9 fails
                        and one element off by a rounding step in a large output passes. When b is
                        all zeros, a must be within --atol of it.
  --cosine C            cosine similarity >= C (off unless given; e.g. 0.9999)
  --check-error-stat S  Polygraphy's check, on when S, --atol or --rtol is given: S is max, mean
                        or median (that statistic of the absolute error <= atol or of the relative
                        error <= rtol) or elemwise (each element within atol or rtol, the default
                        S); atol {DEFAULT_ATOL:g} and rtol {DEFAULT_RTOL:g} unless given.
Integer and boolean outputs must be equal; NaNs in the same places agree. Exit status: 0 when all
outputs pass, 1 when any fails. With --engine, the engine must have been built from this model
(its recorded sha256). Needs onnxruntime.

--layerwise compares every intermediate tensor the engine and the reference both have (by name;
a fused layer's output is the last fused node's) in the engine's layer order, and names the first
layer beyond the criteria: where an fp16 or INT8 engine starts to go wrong. --reference fp32
compares against a float32 engine built from the model on the same backend instead of
onnxruntime. The exit status is 1 when any layer fails.
"""


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "compare", "compare tensorkiln's outputs with onnxruntime's", EPILOG)
    p.add_argument("model", help="the .onnx model (onnxruntime runs it)")
    p.add_argument(
        "--engine", help="a tensorkiln engine built from MODEL (default: build it in memory)"
    )
    p.add_argument(
        "--rel-l2",
        type=non_negative(float),
        default=DEFAULT_REL_L2,
        metavar="T",
        help=f"largest relative L2 error ||a-b||/||b|| (default {DEFAULT_REL_L2:g}; 0: off)",
    )
    p.add_argument(
        "--cosine", type=_cosine, metavar="C", help="smallest cosine similarity (default: off)"
    )
    p.add_argument(
        "--check-error-stat",
        choices=ERROR_STATS,
        help="also check this statistic against --atol/--rtol (Polygraphy's criterion)",
    )
    p.add_argument(
        "--atol",
        type=non_negative(float),
        help=f"absolute tolerance of --check-error-stat (default {DEFAULT_ATOL:g})",
    )
    p.add_argument(
        "--rtol",
        type=non_negative(float),
        help=f"relative tolerance of --check-error-stat (default {DEFAULT_RTOL:g})",
    )
    p.add_argument("--shapes", help="input shapes, e.g. input:1x3x224x224")
    p.add_argument(
        "--load-inputs", metavar="NPZ", help="inputs from an .npz file (default: random)"
    )
    p.add_argument("--seed", type=int, help="seed for the random inputs")
    add_input_limit_option(p)
    p.add_argument(
        "--save-outputs",
        metavar="NPZ",
        help="write both sides' outputs (tensorkiln:NAME, onnxruntime:NAME)",
    )
    p.add_argument(
        "--layerwise",
        action="store_true",
        help="compare every intermediate tensor, in layer order, and name the first that fails",
    )
    p.add_argument(
        "--reference",
        choices=("onnxruntime", "fp32"),
        default="onnxruntime",
        help="what --layerwise compares against: onnxruntime (default) or a float32 engine "
        "built from the model",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="with --layerwise: also draw each layer's error as a PNG (needs matplotlib)",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(handler=run_compare)


def _cosine(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not -1.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a cosine similarity is in -1..1, got '{text}'")
    return value


@dataclass(frozen=True)
class Criteria:
    """What an output must satisfy; None turns a check off."""

    rel_l2: float | None = DEFAULT_REL_L2
    cosine: float | None = None
    error_stat: str | None = None  # max, mean, median or elemwise, checked against atol/rtol
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Criteria:
        stat = args.check_error_stat
        if stat is None and (args.atol is not None or args.rtol is not None):
            stat = "elemwise"  # tolerances given alone: Polygraphy's default statistic
        return cls(
            rel_l2=args.rel_l2 or None,
            cosine=args.cosine,
            error_stat=stat,
            atol=DEFAULT_ATOL if args.atol is None else args.atol,
            rtol=DEFAULT_RTOL if args.rtol is None else args.rtol,
        )

    def describe(self) -> str:
        parts = []
        if self.rel_l2 is not None:
            parts.append(f"rel L2 <= {self.rel_l2:g}")
        if self.cosine is not None:
            parts.append(f"cosine >= {self.cosine:g}")
        if self.error_stat is not None:
            parts.append(f"{self.error_stat} error within atol {self.atol:g} or rtol {self.rtol:g}")
        return ", ".join(parts) or "no criterion (every output passes)"

    def to_json(self) -> dict:
        return {
            "rel_l2": self.rel_l2,
            "cosine": self.cosine,
            "check_error_stat": self.error_stat,
            "atol": self.atol,
            "rtol": self.rtol,
        }


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


def error_stats(a: Any, b: Any, criteria: Criteria | None = None) -> dict:
    """Error of ``a`` (tensorkiln) against ``b`` (reference), and whether it meets ``criteria``."""
    criteria = criteria or Criteria()
    a, b = np.asarray(a), np.asarray(b)
    row = {"shape": list(b.shape), "dtype": str(b.dtype)}
    if a.shape != b.shape:
        return {
            **row,
            "passed": False,
            "problem": f"shape {list(a.shape)} != reference {list(b.shape)}",
        }
    if not (_floating(a) and _floating(b)):  # integers, booleans, strings: exactly equal
        same = bool(np.array_equal(a, b))
        return {**row, "passed": same, "problem": None if same else "values differ"}
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    diff, rel = _differences(x, y)
    stats = {
        **row,
        "ours": _magnitude(x),
        "reference": _magnitude(y),
        "abs_error": _summary(diff),
        "rel_error": _summary(rel),
        "rel_l2": _rel_l2(x, y, diff),
        "cosine": _cosine_similarity(x, y),
    }
    checks = _checks(stats, diff, rel, criteria)
    failed = [c for c in checks.values() if not c["passed"]]
    return {**stats, "checks": checks, "passed": not failed, "problem": None}


def _floating(a: np.ndarray) -> bool:
    return a.dtype.kind in "fc" or a.dtype.name == "bfloat16" or a.dtype.name.startswith("float")


def _differences(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """|x - y| and |x - y| / |y| per element: equal values (NaN with NaN, inf with the same inf)
    differ by 0; NaN on one side only differs by inf; a difference where y is 0 is inf relative."""
    same = (x == y) | (np.isnan(x) & np.isnan(y))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(same, 0.0, np.abs(x - y))
    diff = np.where(np.isnan(diff), np.inf, diff)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.abs(y))
    return diff, np.where(np.isnan(rel), np.inf, rel)


def _finite(v: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(v), v, 0.0)


def _magnitude(v: np.ndarray) -> dict:
    m = np.abs(_finite(v))
    return {
        "mean_abs": float(m.mean()) if m.size else 0.0,
        "max_abs": float(m.max()) if m.size else 0.0,
        "l2": float(np.linalg.norm(m)),
        "nonfinite": int(np.count_nonzero(~np.isfinite(v))),
    }


def _summary(v: np.ndarray) -> dict:
    if not v.size:
        return {"max": 0.0, "mean": 0.0, "median": 0.0}
    return {"max": float(v.max()), "mean": float(v.mean()), "median": float(np.median(v))}


def _rel_l2(x: np.ndarray, y: np.ndarray, diff: np.ndarray) -> float:
    """||x - y|| / ||y||; inf when y is all zeros and x is not (0 when both are)."""
    err = float(np.linalg.norm(diff))
    ref = float(np.linalg.norm(_finite(y)))
    if err == 0:
        return 0.0
    return err / ref if ref > 0 else float("inf")


def _cosine_similarity(x: np.ndarray, y: np.ndarray) -> float:
    """Cosine of the angle between x and y (their finite parts): 1 when both are all zeros."""
    fx, fy = _finite(x), _finite(y)
    nx, ny = float(np.linalg.norm(fx)), float(np.linalg.norm(fy))
    if nx == 0 or ny == 0:
        return 1.0 if nx == ny else 0.0
    # norms first: the dot product of two large vectors can overflow where the cosine cannot
    return float(np.dot(fx / nx, fy / ny))


def _checks(stats: dict, diff: np.ndarray, rel: np.ndarray, c: Criteria) -> dict[str, dict]:
    """Each criterion in force: its value, its threshold and whether it holds."""
    checks = {}
    if c.rel_l2 is not None:
        if stats["reference"]["l2"] == 0:  # no scale to be relative to: absolute, within atol
            worst = stats["abs_error"]["max"]
            checks["rel_l2"] = _check(worst, c.atol, worst <= c.atol, "max abs (reference is 0)")
        else:
            value = stats["rel_l2"]
            checks["rel_l2"] = _check(value, c.rel_l2, value <= c.rel_l2)
    if c.cosine is not None:
        value = stats["cosine"]
        checks["cosine"] = _check(value, c.cosine, value >= c.cosine)
    if c.error_stat == "elemwise":  # Polygraphy's: an element fails beyond both tolerances
        n = int(np.count_nonzero((diff > c.atol) & (rel > c.rtol)))
        checks["elemwise"] = _check(n, 0, n == 0, "elements beyond atol and rtol")
    elif c.error_stat is not None:
        ab, rel = stats["abs_error"][c.error_stat], stats["rel_error"][c.error_stat]
        # Polygraphy's rule: the statistic fails only when both its absolute and relative
        # forms exceed their tolerances
        ok = ab <= c.atol or rel <= c.rtol
        checks[c.error_stat] = _check([ab, rel], [c.atol, c.rtol], ok, "abs and rel error")
    return checks


def _check(value: Any, threshold: Any, passed: Any, what: str | None = None) -> dict:
    out = {"value": value, "threshold": threshold, "passed": bool(passed)}
    if what:
        out["of"] = what
    return out


def run_compare(args: argparse.Namespace) -> int:
    model = existing_file(args.model)
    _check_is_onnx(model)
    criteria = Criteria.from_args(args)
    shapes = parse_shapes(args.shapes)
    loaded = _engine_of(args.engine, model) if args.engine else load_or_build(model, shapes)
    engine = loaded.engine
    if args.load_inputs:
        feeds = load_inputs(args.load_inputs, args.max_input_bytes)
        check_feed_names(engine, feeds, f"'{args.load_inputs}'")
    else:
        feeds = random_inputs(engine, input_shapes(engine, shapes), args.seed, args.max_input_bytes)
    if args.layerwise:
        return _run_layerwise(args, loaded, model, criteria, feeds)
    if args.reference != "onnxruntime" or args.plot:
        raise CLIError("--reference fp32 and --plot are for --layerwise; add --layerwise")
    with engine.create_execution_context() as ctx:
        for name, arr in feeds.items():
            ctx.set_input_shape(name, np.shape(arr))
        ours = ctx.infer(feeds)
    ref = onnxruntime_outputs(model, feeds)
    rows = _compare_outputs(ours, ref, criteria)
    if args.save_outputs:
        save_npz(
            args.save_outputs,
            {
                **{f"tensorkiln:{k}": v for k, v in ours.items()},
                **{f"onnxruntime:{k}": v for k, v in ref.items()},
            },
        )
    return _report(args, loaded, model, criteria, rows)


def _run_layerwise(
    args: argparse.Namespace, loaded: Loaded, model: Path, criteria: Criteria, feeds: dict
) -> int:
    engine = loaded.engine
    ours = layerwise.engine_tensors(engine, feeds)
    if args.reference == "fp32":
        reference_engine = Builder(engine.backend).build(model, progress=False)
        reference = {t.tensor: t.value for t in layerwise.engine_tensors(reference_engine, feeds)}
        against = f"a float32 engine ({engine.backend})"
    else:
        reference = layerwise.onnxruntime_tensors(load_model_proto(model), feeds)
        against = "onnxruntime (CPU)"
    rows = layerwise.compare_layers(ours, reference, lambda a, b: error_stats(a, b, criteria))
    if not rows:
        raise CLIError(f"no tensor of the engine has a namesake in {against}; nothing to compare")
    first = layerwise.first_failure(rows)
    if args.plot:
        written = plots.layer_errors(rows, criteria.rel_l2, args.plot)
        print(f"wrote {written}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"model": str(model), "engine": args.engine, "reference": against,
                          "criteria": criteria.to_json(), "layers": rows,
                          "first_failure": None if first is None else first["layer"],
                          "passed": first is None}, indent=2))  # fmt: skip
    else:
        print(
            f"tensorkiln ({_label(loaded)}, backend {engine.backend}) vs {against}, layer by layer"
        )
        headers = ["layer", "op", "precision", "tensor", "rel L2", "cosine", "max abs", "result"]
        print_table(headers, [_layer_row(r) for r in rows])
    failed = sum(not r["passed"] for r in rows)
    failure = None if first is None else (
        f"{failed} of {len(rows)} tensors do not meet {criteria.describe()}; the first is "
        f"'{first['tensor']}' of layer '{first['layer']}' ({first['op']}, {first['precision']})"
    )  # fmt: skip
    return _verdict(args, failure, f"all {len(rows)} tensors meet {criteria.describe()}")


def _layer_row(r: dict) -> list[str]:
    row = _row(r["tensor"], r)
    # (the output row's columns: name, ref mean, ours mean, max abs, median abs, max rel,
    # median rel, rel L2, cosine, result)
    return [r["layer"], r["op"], r["precision"], r["tensor"], row[7], row[8], row[3], row[9]]


def _check_is_onnx(model: Path) -> None:
    kind = sniff_file(model)
    if kind == "engine":
        raise CLIError(
            f"'{model}' is an engine; compare needs the ONNX model it was built from: "
            f"`tensorkiln compare MODEL.onnx --engine {model}`"
        )
    if kind is not None:
        raise not_a_model(model, kind)


def _engine_of(path: str, model: Path) -> Loaded:
    """The engine --engine names, refused unless it was built from ``model``."""
    kind = sniff_file(existing_file(path))
    if kind != "engine":
        what = f"it is {kind}" if kind else "it has no TKENGINE magic (an ONNX model?)"
        raise CLIError(
            f"--engine '{path}' is not a tensorkiln engine: {what}; "
            "give the ONNX model first and its engine with --engine"
        )
    loaded = load_or_build(path, {})
    _check_built_from(loaded, model)
    return loaded


def _check_built_from(loaded: Loaded, model: Path) -> None:
    """Refuse an engine whose recorded source sha256 is not this model's."""
    source = loaded.engine.source
    recorded = source.get("sha256") if isinstance(source, dict) else None
    if not isinstance(recorded, str):
        raise CLIError(
            f"'{loaded.path}' does not record the sha256 of the model it was built from, so it "
            f"cannot be checked against '{model}'; rebuild it with `tensorkiln build {model}`"
        )
    # the builder records the sha256 of the serialized model with its external data loaded
    actual = hashlib.sha256(load_model_proto(model).SerializeToString()).hexdigest()
    if actual != recorded:
        name = source.get("name") or "another model"
        raise CLIError(
            f"'{loaded.path}' was built from {name} (sha256 {recorded[:12]}...), not from "
            f"'{model}' (sha256 {actual[:12]}...); compare it with its own model, or rebuild it "
            f"with `tensorkiln build {model}`"
        )


def _compare_outputs(ours: dict, ref: dict, criteria: Criteria) -> dict[str, dict]:
    rows = {}
    for name, b in ref.items():
        if name not in ours:
            rows[name] = {"passed": False, "problem": "tensorkiln does not produce this output"}
        else:
            rows[name] = error_stats(ours[name], b, criteria)
    for name in ours.keys() - ref.keys():
        rows[name] = {"passed": False, "problem": "onnxruntime does not produce this output"}
    return rows


def _report(
    args: argparse.Namespace, loaded: Loaded, model: Path, criteria: Criteria, rows: dict
) -> int:
    failed = [n for n, r in rows.items() if not r["passed"]]
    if args.json:
        result = {
            "model": str(model),
            "engine": args.engine,
            "criteria": criteria.to_json(),
            "outputs": rows,
            "passed": not failed,
        }
        print(json.dumps(result, indent=2))
    else:
        _print_text(loaded, rows)
    failure = None if not failed else (
        f"{len(failed)} of {len(rows)} output(s) do not meet {criteria.describe()}: "
        f"{', '.join(failed)}"
    )  # fmt: skip
    return _verdict(args, failure, f"all {len(rows)} output(s) meet {criteria.describe()}")


def _verdict(args: argparse.Namespace, failure: str | None, success: str) -> int:
    """The last line and the exit status: FAILED (on stderr after --json's object) or PASSED."""
    if failure is not None:
        print(f"tensorkiln: FAILED: {failure}", file=sys.stderr if args.json else sys.stdout)
        return 1
    if not args.json:
        print(f"PASSED: {success}")
    return 0


def _label(loaded: Loaded) -> str:
    """The engine compared: its file, or the model built in memory."""
    return str(loaded.path) if loaded.built is None else f"{loaded.path.name} built in memory"


def _print_text(loaded: Loaded, rows: dict) -> None:
    print(f"tensorkiln ({_label(loaded)}, backend {loaded.engine.backend}) vs onnxruntime (CPU)")
    table = [_row(name, r) for name, r in rows.items()]
    headers = ["output", "ref mean|x|", "ours mean|x|", "max abs", "median abs", "max rel"]
    print_table([*headers, "median rel", "rel L2", "cosine", "result"], table)


def _row(name: str, r: dict) -> list[str]:
    def num(v: Any) -> str:
        return "-" if v is None else f"{v:.3e}"

    verdict = "pass" if r["passed"] else "FAIL"
    if r.get("problem"):
        verdict += f" ({r['problem']})"
    elif not r["passed"]:
        verdict += " (" + ", ".join(_failed_check(k, c) for k, c in r["checks"].items()
                                    if not c["passed"]) + ")"  # fmt: skip
    if "abs_error" not in r:  # exact comparison (integers) or a problem: no statistics
        return [name, *["-"] * 8, verdict]
    ab, rel = r["abs_error"], r["rel_error"]
    return [
        name,
        num(r["reference"]["mean_abs"]),
        num(r["ours"]["mean_abs"]),
        num(ab["max"]),
        num(ab["median"]),
        num(rel["max"]),
        num(rel["median"]),
        num(r["rel_l2"]),
        f"{r['cosine']:.8f}",
        verdict,
    ]


def _failed_check(name: str, c: dict) -> str:
    if name == "elemwise":
        return f"{c['value']} elements beyond atol and rtol"
    if name == "cosine":
        return f"cosine {c['value']:.8f} < {c['threshold']:g}"
    if name == "rel_l2":
        label = "rel L2" if "of" not in c else "max abs"
        return f"{label} {c['value']:.3e} > {c['threshold']:g}"
    return f"{name} abs {c['value'][0]:.3e} > {c['threshold'][0]:g} and rel {c['value'][1]:.3e} > {c['threshold'][1]:g}"
