"""`tensorkiln run --dump-profile / --export-profile`: the per-layer profile as a table and JSON,
with FLOPs, bytes, achieved rates and the roofline (runtime/profile.py computes them)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from tensorkiln.cli.common import print_table
from tensorkiln.runtime.peaks import device_peaks
from tensorkiln.runtime.profile import group_by_op, profile_layers, summarize


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got '{text}'")
    return value


def add_profile_options(p: argparse.ArgumentParser) -> None:
    """--peak-tflops, --peak-gbps and --profile-by, for --dump-profile and --export-profile."""
    p.add_argument(
        "--peak-tflops",
        type=_positive_float,
        metavar="T",
        help="the profile's roofline: the device's peak TFLOP/s, for every layer (default: "
        "NVIDIA's datasheet figure for an H200, H100 or A100 at the layer's precision; none "
        "elsewhere)",
    )
    p.add_argument(
        "--peak-gbps",
        type=_positive_float,
        metavar="G",
        help="the profile's roofline: the device's peak memory bandwidth in GB/s (default: "
        "the datasheet figure of a known GPU)",
    )
    p.add_argument(
        "--profile-by",
        choices=("layer", "op"),
        default="layer",
        help="the profile's rows: one per layer (default), or per op type, added up",
    )


def profile_report(
    args: argparse.Namespace, ctx: Any, engine: Any, feeds: dict, runs: int
) -> dict[str, Any]:
    """The profile of ``runs`` iterations as --export-profile writes it and the table shows it."""
    backend = engine.runtime_backend
    device = str(backend.target().get("device", backend.name))
    peaks = device_peaks(
        device, getattr(args, "peak_tflops", None), getattr(args, "peak_gbps", None)
    )
    layers = profile_layers(ctx, feeds, runs, peaks)
    report: dict[str, Any] = {
        "iterations": runs,
        "device": device,
        "timed_by": "cuda events" if backend.streams else "host clock",
        "peaks": None
        if peaks is None
        else {
            "device": peaks.name,
            "tflops": peaks.tflops or None,
            "gbps": peaks.gbps,
            "source": peaks.source,
        },
        "summary": summarize(layers),
        "layers": layers,
    }
    if getattr(args, "profile_by", "layer") == "op":
        report["by_op"] = group_by_op(layers)
    return report


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_profile(report: dict[str, Any]) -> None:
    """The table of rows (per op type when the report has them), then the summary line."""
    by_op = "by_op" in report
    rows = report["by_op"] if by_op else report["layers"]
    headers = ["op" if by_op else "layer", "layers" if by_op else "op", "avg ms", "%"]
    headers += ["GFLOP", "MB", "TFLOP/s", "GB/s", "bound", "% roofline"]
    cells = [
        [
            r["name"],
            str(r["layers"]) if by_op else r["op"],
            f"{r['average_ms']:.4f}",
            f"{r['percent']:.1f}",
            _num(r["gflop"], ".4g"),
            _num(r["mb"], ".4g"),
            _num(r["tflops"], ".3g"),
            _num(r["gbps"], ".4g"),
            r["bound"] or "-",
            _num(r["roofline_percent"], ".1f"),
        ]
        for r in rows
    ]
    peaks = report["peaks"]
    roof = "no roofline: unknown device peaks (give --peak-tflops and --peak-gbps)"
    if peaks is not None:
        tflops = peaks["tflops"] or {}
        if len(set(tflops.values())) == 1:  # (one figure for every precision: --peak-tflops)
            shown = f"{next(iter(tflops.values())):g}"
        else:
            shown = ", ".join(f"{k} {v:g}" for k, v in tflops.items()) or "unknown"
        gbps = "unknown" if peaks["gbps"] is None else f"{peaks['gbps']:g}"
        roof = f"roofline: {peaks['device']} ({peaks['source']}): TFLOP/s {shown}; GB/s {gbps}"
    title = (
        f"per-layer profile ({report['iterations']} iterations){' by op type' if by_op else ''}"
        f", timed by {report['timed_by']}\n{roof}"
    )
    print_table(headers, cells, title=title)
    print(summary_line(report["summary"]))


def summary_line(s: dict[str, Any]) -> str:
    """Totals: FLOPs, time per run, overall TFLOP/s, and the op types taking the most time."""
    top = ", ".join(f"{t['op']} {t['percent']:.1f}%" for t in s["top_ops"])
    unknown = (
        f" ({s['layers_without_flops']} layers not counted)" if s["layers_without_flops"] else ""
    )
    return (
        f"total: {s['gflop']:.4g} GFLOP{unknown}, {s['mb']:.4g} MB in {s['average_ms']:.4f} ms "
        f"per run over {s['layers']} layers = {_num(s['tflops'], '.3g')} TFLOP/s, "
        f"{_num(s['gbps'], '.4g')} GB/s; top op types by time: {top}"
    )
