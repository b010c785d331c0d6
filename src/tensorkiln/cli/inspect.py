"""``tensorkiln inspect``: what an engine holds (or an ONNX model's IR).

Engines are described from their plan, read through the container checks (and the plan's types)
only, so an engine built for another device or tensorkiln version can still be inspected; whether
it loads here is reported. A damaged engine is an error. Names from the file are shown escaped.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tensorkiln.cli.common import (
    add_subcommand,
    existing_file,
    is_engine_file,
    mib,
    print_table,
    shape_str,
)
from tensorkiln.engine import Engine
from tensorkiln.engine import format as fmt
from tensorkiln.engine.schema import printable
from tensorkiln.errors import EngineCompatibilityError
from tensorkiln.frontends.onnx import import_onnx
from tensorkiln.ir.printer import format_graph

EPILOG = """examples:
  tensorkiln inspect model.engine
  tensorkiln inspect model.engine --json
  tensorkiln inspect model.onnx          # the IR after import and shape inference
"""


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "inspect", "describe an engine, or print an ONNX model's IR", EPILOG)
    p.add_argument("model", help="an engine file or an .onnx model")
    p.add_argument("--json", action="store_true", help="print the description as one JSON object")
    p.set_defaults(handler=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    path = existing_file(args.model)
    if not is_engine_file(path):
        return _inspect_onnx(path, args.json)
    info = describe_engine(path)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_engine(info)
    return 0


def describe_engine(path: Any) -> dict:
    """The engine's plan as a plain dict for people: IO with profile ranges, layers, memory, target."""
    plan, tensors = fmt.read(path)  # the container's checks and the plan's types
    try:
        Engine.load(path)
        loadable, why = True, None
    except EngineCompatibilityError as exc:  # intact, but built for elsewhere: still described
        loadable, why = False, str(exc)
    # (an EngineFormatError, a damaged engine, is the command's error: nothing to describe)
    profiles = plan.get("profiles") or []
    io = plan.get("io") or {}

    def spec(d: dict, is_input: bool) -> dict:
        out = {"name": d.get("name"), "dtype": d.get("dtype"), "shape": d.get("shape")}
        shape = d.get("shape") or []
        out["dynamic_axes"] = [i for i, x in enumerate(shape) if not isinstance(x, int)]
        if is_input:
            out["profiles"] = [p[d["name"]] if d.get("name") in p else None for p in profiles]
        return out

    memory = plan.get("memory") or {}
    weights = {k: v for k, v in tensors.items() if not k.startswith("source/")}
    return {
        "file": str(path),
        "format_version": plan.get("format_version"),
        "tensorkiln_version": plan.get("tensorkiln_version"),
        "backend": plan.get("backend"),
        "target": plan.get("target"),
        "loadable_here": loadable,
        "not_loadable_because": why,
        "inputs": [spec(d, True) for d in io.get("inputs", [])],
        "outputs": [spec(d, False) for d in io.get("outputs", [])],
        "num_profiles": len(profiles),
        "layers": [
            {
                k: layer.get(k)
                for k in (
                    "name",
                    "op",
                    "impl",
                    "precision",
                    "compute_precision",
                    "format",
                    "tactic",
                    "timings_ms",
                    "tactic_eager",
                    "timings_eager_ms",
                    "rejected",
                    "fallback",
                )
                if k in layer
            }
            for layer in plan.get("layers", [])
        ],
        "memory": {
            "peak_bytes": memory.get("peak_bytes"),
            "naive_bytes": memory.get("naive_bytes"),
            "buffers": len(memory.get("buffers", [])),
            "dynamic": memory.get("dynamic", []),
            "alignment": memory.get("alignment"),
        },
        "weights": {"tensors": len(weights), "bytes": int(sum(a.nbytes for a in weights.values()))},
        "source": plan.get("source"),
        "build": plan.get("build"),
    }


# ------------------------------------------------------------------ output
# Everything an engine names (layers, ops, tactics, IO, source, target, errors quoting them) is
# text from a stranger: it is shown with control characters escaped, so an ESC sequence in a layer
# name cannot drive the terminal, and in rich tables with markup escaped, so '[bold]' is shown, not
# obeyed. (JSON output needs neither: json.dumps escapes control characters itself.)


def _say(text: str = "") -> None:
    print(printable(text))


def _table(headers: list[str], rows: list[list[Any]], title: str) -> None:
    print_table(headers, rows, title=printable(title))


def _tactic_cells(layer: dict) -> list[str]:
    """The chosen tactic with its time, and the other candidates' times, fastest first."""
    name = layer.get("tactic", "default")
    times = layer.get("timings_ms") or {}
    chosen = f"{name} {times[name]:.4f}" if name in times else name
    others = sorted((t, k) for k, t in times.items() if k != name)
    rest = ", ".join(f"{k} {t:.4f}" for t, k in others)
    rejected = layer.get("rejected") or {}
    if rejected:
        rest += (", " if rest else "") + f"{len(rejected)} rejected"
    if layer.get("fallback"):  # tuning could not measure it: the default kernel was kept
        rest += (", " if rest else "") + f"default kept: {layer['fallback']}"
    eager = layer.get("tactic_eager", name)
    if eager != name:  # launch overhead changes the winner when the engine runs layer by layer
        ms = (layer.get("timings_eager_ms") or {}).get(eager)
        chosen += f" (layer by layer: {eager}" + (f" {ms:.4f})" if ms is not None else ")")
    return [chosen, rest or "-"]


def _print_engine(info: dict) -> None:
    target = ", ".join(f"{k} {v}" for k, v in (info["target"] or {}).items())
    _say(f"engine: {info['file']}")
    _say(
        f"tensorkiln {info['tensorkiln_version']}, format {info['format_version']}, "
        f"backend {info['backend']}, target: {target}"
    )
    if info["loadable_here"]:
        _say("loads on this machine: yes")
    else:
        _say(f"loads on this machine: no ({info['not_loadable_because']})")
    src = info["source"] or {}
    _say(
        f"source: {src.get('name')}  sha256 {src.get('sha256')}  "
        f"embedded: {'yes' if src.get('embedded') else 'no'}"
    )
    build = info["build"] or {}
    config = build.get("config") or {}
    if config:
        _say(
            f"built with: precisions {', '.join(config.get('precisions', []))}, optimization level "
            f"{config.get('optimization_level')}, memory limit {config.get('memory_limit') or 'none'}"
        )
    for note in build.get("notes") or ():  # layers kept in fp32, shapes tuned at a guess, ...
        _say(f"note: {note}")
    _say()
    _print_io(info)
    _say()
    layers = info["layers"]
    tuned = any("tactic" in x for x in layers)
    _table(
        ["layer", "op", "implementation", "precision", "computes in", "format"]
        + (["tactic (ms, as a CUDA graph)", "runners-up (ms)"] if tuned else []),
        [
            [x["name"], x["op"], x["impl"], x["precision"]]
            # (engines written before layers recorded these: the engine-wide precision, linear)
            + [
                x.get("compute_precision", build.get("precision", "fp32")),
                x.get("format", "linear"),
            ]
            + (_tactic_cells(x) if tuned else [])
            for x in layers
        ],
        title=f"layers ({len(layers)})",
    )
    _say()
    m = info["memory"]
    if m["peak_bytes"] is not None:
        naive = m["naive_bytes"] or 0
        saved = f", {1 - m['peak_bytes'] / naive:.0%} less" if naive else ""
        _say(
            f"activation memory: planned peak {m['peak_bytes']:,} bytes ({mib(m['peak_bytes'])}) vs "
            f"naive {naive:,} bytes ({mib(naive)}{saved}); {m['buffers']} buffers"
            + (", sized for the profiles' max shapes" if info["num_profiles"] else "")
        )
    dyn = m["dynamic"]
    _say(
        f"dynamic buffers (sized at run time): {len(dyn)}"
        + (f": {', '.join(dyn[:8])}" if dyn else "")
    )
    if len(dyn) > 8:
        _say(f"  ... and {len(dyn) - 8} more")
    w = info["weights"]
    _say(f"weights: {w['tensors']} tensors, {w['bytes']:,} bytes ({mib(w['bytes'])})")


def _print_io(info: dict) -> None:
    rows = []
    for kind, specs in (("input", info["inputs"]), ("output", info["outputs"])):
        for s in specs:
            ranges = []
            for i, r in enumerate(s.get("profiles", [])):
                if r is not None:
                    ranges.append(f"#{i} min {r['min']} opt {r['opt']} max {r['max']}")
            dyn = ",".join(str(a) for a in s["dynamic_axes"]) or "-"
            rows.append(
                [kind, s["name"], s["dtype"], shape_str(s["shape"]), dyn, "; ".join(ranges) or "-"]
            )
    _table(["io", "name", "dtype", "shape", "dynamic axes", "profile ranges"], rows, title="io")


def _inspect_onnx(path: Any, as_json: bool) -> int:
    graph = import_onnx(path)
    if not as_json:
        for line in format_graph(graph).splitlines():  # names from the model, escaped too
            _say(line)
        return 0

    def value(v: Any) -> dict:
        dtype = v.dtype.name if v.dtype is not None else None
        return {"name": v.name, "dtype": dtype, "shape": None if v.shape is None else list(v.shape)}

    print(
        json.dumps(
            {
                "file": str(path),
                "graph": graph.name,
                "opsets": {d or "ai.onnx": v for d, v in graph.opsets.items()},
                "inputs": [value(v) for v in graph.inputs],
                "outputs": [value(v) for v in graph.outputs],
                "nodes": [{"name": n.name, "op": n.op, "domain": n.domain} for n in graph.nodes],
            },
            indent=2,
        )
    )
    return 0
