"""``tensorkiln``: build, run, inspect and compare engines; trtexec's flags; list supported ops.

User errors print one line, ``tensorkiln: error: ...``, on stderr and exit 1 (usage errors exit 2);
``--verbose``, before or after the command, adds the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from tensorkiln.backends import NAMES as BACKEND_NAMES
from tensorkiln.cli import build, compare, debug, inspect, perf, run, serve, trtexec
from tensorkiln.cli.common import (
    ArgumentParser,
    add_common,
    add_subcommand,
    import_plugins,
    parse_shapes,
)
from tensorkiln.engine.schema import printable
from tensorkiln.errors import TensorkilnError
from tensorkiln.kernels.registry import host_ops, normalize_domain, registered_ops
from tensorkiln.version import __version__

__all__ = ["main", "parse_shapes"]

EPILOG = """examples:
  tensorkiln build model.onnx -o model.engine --shapes input:8x3x224x224
  tensorkiln run model.engine --dump-profile
  tensorkiln inspect model.engine
  tensorkiln compare model.onnx --engine model.engine
  tensorkiln trtexec --onnx=model.onnx --saveEngine=model.engine --shapes=input:8x3x224x224
  tensorkiln debug precision model.onnx --int8 --calib-data calib/ --rel-l2 0.02
  tensorkiln ops --domain ai.onnx.ml
  tensorkiln serve --model-repository models/
  tensorkiln perf -m digits --concurrency-range 1:16

Run `tensorkiln COMMAND --help` for each command's options.
"""


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="tensorkiln",
        description="An open deep-learning inference optimizer and runtime: ONNX model in, engine out.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"tensorkiln {__version__}")
    add_common(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    build.add_parser(sub)
    run.add_parser(sub)
    inspect.add_parser(sub)
    compare.add_parser(sub)
    trtexec.add_parser(sub)
    debug.add_parser(sub)
    serve.add_parser(sub)
    perf.add_parser(sub)
    _add_ops(sub)
    return p


def _add_ops(sub: Any) -> None:
    p = add_subcommand(
        sub,
        "ops",
        "list the operators a backend implements",
        "examples:\n  tensorkiln ops\n  tensorkiln ops --domain ai.onnx.ml\n"
        "  tensorkiln ops --backend cuda   (ops that run on the host are marked, with why)\n",
    )
    p.add_argument("--domain", default=None, help="only this domain ('ai.onnx' is the default one)")
    p.add_argument(
        "--backend",
        choices=BACKEND_NAMES,
        default="reference",
        help="default: reference",
    )
    p.set_defaults(handler=_run_ops)


def _run_ops(args: argparse.Namespace) -> int:
    domain = None if args.domain is None else normalize_domain(args.domain)
    rows = registered_ops(args.backend, domain)
    host = host_ops(args.backend)
    for d, op in rows:
        why = host.get((d, op))
        print(f"{d or 'ai.onnx'}\t{op}" + (f"\thost: {why}" if why else ""))
    extra = f", {sum((d, o) in host for d, o in rows)} of them on the host" if host else ""
    print(f"{len(rows)} operators{extra}", file=sys.stderr)
    return 0


def _one_line(text: str) -> str:
    """A message on one line, with control characters escaped: messages quote names from files."""
    return "; ".join(printable(line.strip()) for line in text.splitlines() if line.strip())


def _verbose(args: argparse.Namespace) -> bool:
    # read when an error arrives: `trtexec` learns of its --verbose only while it runs
    return bool(getattr(args, "verbose", False))


def _show_warning(message: Any, category: Any, *_: Any, **__: Any) -> None:
    """Warnings (a precision the backend does not implement, ...) as one line on stderr."""
    print(f"tensorkiln: warning: {_one_line(str(message))}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.showwarning = _show_warning
        return _handle(args)


def _handle(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "plugins", None):
            import_plugins(args.plugins)
        return args.handler(args)
    except TensorkilnError as exc:
        if _verbose(args):
            traceback.print_exc()
        print(f"tensorkiln: error: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `tensorkiln ... | head`: the reader has gone, say nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # unreadable or unwritable files named on the command line
        if _verbose(args):
            traceback.print_exc()
        where = f" '{exc.filename}'" if exc.filename else ""
        print(f"tensorkiln: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
