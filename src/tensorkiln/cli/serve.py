"""``tensorkiln serve``: a model repository behind the KServe v2 protocol, with Triton's flags."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from tensorkiln.backends import NAMES as BACKEND_NAMES
from tensorkiln.cli.common import CLIError, add_subcommand

EPILOG = """examples:
  tensorkiln serve --model-repository models/
  tensorkiln serve --model-repository models/ --http-port 8080 --backend cuda
  tensorkiln serve --model-repository models/ --model-control-mode explicit --load-model digits

  then, from Python (pip install 'tritonclient[http]'):
    import numpy as np, tritonclient.http as http
    client = http.InferenceServerClient("localhost:8000")
    x = http.InferInput("input", [1, 1, 8, 8], "FP32")
    x.set_data_from_numpy(np.random.rand(1, 1, 8, 8).astype(np.float32))
    print(client.infer("digits", [x]).as_numpy("logits"))

The repository has Triton's layout: <repo>/<model>/config.pbtxt (or config.json) and numbered
version folders holding model.engine or model.onnx (built on load, kept in --engine-cache).
Ctrl-C or SIGTERM stops accepting requests, finishes those in flight and exits 0.
"""

DEFAULT_CACHE = Path.home() / ".cache" / "tensorkiln" / "engines"


def add_parser(sub: Any) -> None:
    p = add_subcommand(
        sub, "serve", "serve a model repository over KServe v2 (Triton's protocol)", EPILOG
    )
    p.add_argument("--model-repository", required=True, metavar="DIR", help="the model repository")
    p.add_argument("--http-port", type=int, default=8000, help="default: 8000")
    p.add_argument("--http-address", default="0.0.0.0", help="default: 0.0.0.0 (every interface)")
    p.add_argument(
        "--model-control-mode", choices=["none", "explicit"], default="none",
        help="none (default): load every model at start; explicit: load only --load-model at "
        "start, the rest through the repository API",
    )  # fmt: skip
    p.add_argument(
        "--load-model", action="append", default=[], metavar="NAME",
        help="with --model-control-mode explicit: a model to load at start (repeatable; '*' for all)",
    )  # fmt: skip
    p.add_argument(
        "--http-max-input-size", type=int, default=64 << 20, metavar="BYTES",
        help="the largest request body accepted (default: 64 MiB)",
    )  # fmt: skip
    p.add_argument(
        "--backend", choices=BACKEND_NAMES, default="reference",
        help="the backend ONNX models are built for on load (default: reference)",
    )  # fmt: skip
    p.add_argument(
        "--engine-cache", default=os.environ.get("TENSORKILN_ENGINE_CACHE", str(DEFAULT_CACHE)),
        metavar="DIR", help=f"where engines built from ONNX models are kept (default: {DEFAULT_CACHE})",
    )  # fmt: skip
    p.add_argument(
        "--log-verbose",
        type=int,
        default=0,
        metavar="N",
        help="0 (default): info; 1 or more: debug",
    )
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        from aiohttp import web  # lazy: cli start time (and an optional dependency)
    except ImportError:
        raise CLIError("tensorkiln serve needs aiohttp: pip install 'tensorkiln[serve]'") from None
    from tensorkiln.serve.core import ServerCore  # lazy: cli start time
    from tensorkiln.serve.http import make_app  # lazy: cli start time

    if not 0 < args.http_port < 65536:
        raise CLIError(f"--http-port {args.http_port} is not a port (1 to 65535)")
    if args.http_max_input_size < 1:
        raise CLIError(f"--http-max-input-size {args.http_max_input_size} must be 1 or more")
    if args.load_model and args.model_control_mode != "explicit":
        raise CLIError("--load-model needs --model-control-mode explicit (as tritonserver's)")
    logging.basicConfig(
        level=logging.DEBUG if args.log_verbose > 0 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    core = ServerCore(args.model_repository, backend=args.backend, cache_dir=args.engine_cache)
    explicit = args.model_control_mode == "explicit"
    app = make_app(core, max_body=args.http_max_input_size, load=not explicit)
    if explicit and args.load_model:
        wanted = core.repository.names() if "*" in args.load_model else args.load_model

        async def load_wanted(_app: web.Application) -> None:
            for name in wanted:
                await core.load(name)  # (an explicitly asked model that fails stops the start)

        app.on_startup.append(load_wanted)
    web.run_app(
        app, host=args.http_address, port=args.http_port, shutdown_timeout=30,
        print=lambda line: logging.getLogger("tensorkiln.serve").info(
            "HTTP service at %s:%d (KServe v2)", args.http_address, args.http_port
        ),
    )  # fmt: skip
    return 0
