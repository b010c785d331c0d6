"""``tensorkiln``: run, inspect and list what the reference backend supports.

User errors print one line on stderr and exit 1 (usage errors exit 2); ``--verbose`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence

import numpy as np

from tensorkiln.errors import InputError, TensorkilnError

EPILOG_RUN = """examples:
  tensorkiln run model.onnx
  tensorkiln run model.onnx --shapes input:8x3x224x224 --iterations 20
  tensorkiln run model.onnx --load-inputs in.npz --save-outputs out.npz
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tensorkiln",
        description="An open deep-learning inference optimizer and runtime.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run an ONNX model on the CPU reference backend and time it",
        epilog=EPILOG_RUN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("model", help="path to an .onnx file")
    run.add_argument(
        "--shapes", default="", help="input shapes, e.g. 'input:1x3x224x224,mask:1x128'"
    )
    run.add_argument("--load-inputs", metavar="NPZ", help="inputs from an .npz file (by name)")
    run.add_argument("--save-outputs", metavar="NPZ", help="write the outputs to an .npz file")
    run.add_argument("--iterations", type=int, default=10, help="timed runs (default 10)")
    run.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    run.add_argument("--seed", type=int, default=None, help="seed for random inputs")
    run.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)

    insp = sub.add_parser(
        "inspect",
        help="print a model's IR (after import and shape inference)",
        epilog="examples:\n  tensorkiln inspect model.onnx",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    insp.add_argument("model", help="path to an .onnx file")
    insp.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)

    ops = sub.add_parser(
        "ops",
        help="list the operators the reference backend implements",
        epilog="examples:\n  tensorkiln ops\n  tensorkiln ops --domain ai.onnx.ml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ops.add_argument("--domain", default=None, help="only this domain ('ai.onnx' is the default)")
    ops.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_shapes(text: str) -> dict[str, tuple[int, ...]]:
    """'a:1x3x224x224,b:1x128' -> {'a': (1, 3, 224, 224), 'b': (1, 128)}."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, dims = item.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split("x")) if dims else ()
        except ValueError:
            raise InputError(
                f"bad --shapes entry '{item}': expected NAME:DxDx..., e.g. input:1x3x224x224"
            ) from None
    return shapes


def _random_inputs(graph, shapes: dict[str, tuple[int, ...]], seed: int | None) -> dict:
    rng = np.random.default_rng(seed)
    unknown = [n for n in shapes if n not in {v.name for v in graph.inputs}]
    if unknown:
        raise InputError(f"--shapes names unknown input(s) {', '.join(unknown)}")
    feeds = {}
    for v in graph.inputs:
        if v.dtype is None or (v.shape is None and v.name not in shapes):
            raise InputError(f"input '{v.name}' has no declared type/shape; give --shapes")
        shape = shapes.get(v.name) or tuple(d if isinstance(d, int) else 1 for d in v.shape)
        dt = v.dtype.numpy
        if v.dtype.is_float:
            feeds[v.name] = rng.standard_normal(shape).astype(dt)
        elif dt == np.bool_:
            feeds[v.name] = rng.integers(0, 2, shape).astype(bool)
        elif v.dtype.is_integer:
            feeds[v.name] = rng.integers(0, 10, shape).astype(dt)
        else:
            raise InputError(f"cannot make random data for input '{v.name}' of type {v.dtype.name}")
    return feeds


def _cmd_run(args: argparse.Namespace) -> int:
    from tensorkiln.runtime import Runner

    runner = Runner(args.model)
    if args.load_inputs:
        try:
            with np.load(args.load_inputs, allow_pickle=False) as data:
                feeds = {k: data[k] for k in data.files}
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read inputs from '{args.load_inputs}': {exc}") from None
    else:
        feeds = _random_inputs(runner.graph, parse_shapes(args.shapes), args.seed)
    if args.iterations < 1 or args.warmup < 0:
        raise InputError("--iterations must be >= 1 and --warmup >= 0")
    for _ in range(args.warmup):
        outputs = runner.infer(feeds)
    times = []
    for _ in range(args.iterations):
        t0 = time.perf_counter()
        outputs = runner.infer(feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    t = np.array(times)
    print(f"model: {args.model}  backend: reference  iterations: {args.iterations}")
    for name, arr in outputs.items():
        arr = np.asarray(arr)
        print(f"output {name}: {arr.dtype} {list(arr.shape)}")
    print(
        f"latency ms: min {t.min():.3f}  mean {t.mean():.3f}  median {np.median(t):.3f}  "
        f"p90 {np.percentile(t, 90):.3f}  max {t.max():.3f}"
    )
    print(f"throughput: {1e3 / np.median(t):.2f} inferences/s")
    if args.save_outputs:
        np.savez(args.save_outputs, **{k: np.asarray(v) for k, v in outputs.items()})
        print(f"outputs saved to {args.save_outputs}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tensorkiln.frontends.onnx import import_onnx
    from tensorkiln.ir.printer import format_graph

    print(format_graph(import_onnx(args.model)))
    return 0


def _cmd_ops(args: argparse.Namespace) -> int:
    from tensorkiln.kernels.registry import normalize_domain, registered_ops

    domain = None if args.domain is None else normalize_domain(args.domain)
    rows = registered_ops("reference", domain)
    for d, op in rows:
        print(f"{d or 'ai.onnx'}\t{op}")
    print(f"{len(rows)} operators", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"run": _cmd_run, "inspect": _cmd_inspect, "ops": _cmd_ops}
    try:
        return handlers[args.command](args)
    except TensorkilnError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"tensorkiln: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
