"""``tensorkiln serve``: a model repository behind the KServe v2 protocol, with Triton's flags."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any

from tensorkiln.backends import NAMES as BACKEND_NAMES
from tensorkiln.cli.common import CLIError, add_subcommand

# Triton's --pinned-memory-pool-byte-size default (serve/model.py PINNED_POOL_BYTES, not
# imported here: the CLI starts without the server's modules)
_PINNED_POOL = 256 << 20

EPILOG = """examples:
  tensorkiln serve --model-repository models/
  tensorkiln serve --model-repository models/ --http-port 8080 --backend cuda
  tensorkiln serve --model-repository models/ --model-control-mode explicit --load-model digits
  tensorkiln serve --model-repository models/ --model-control-mode poll --repository-poll-secs 5

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
    p.add_argument("--grpc-port", type=int, default=8001, help="default: 8001")
    p.add_argument("--grpc-address", default="0.0.0.0", help="default: 0.0.0.0 (every interface)")
    p.add_argument(
        "--allow-grpc", type=_flag, default=True, metavar="BOOL",
        help="serve gRPC too (default: true; false: HTTP alone)",
    )  # fmt: skip
    p.add_argument(
        "--grpc-transport", choices=["grpcio", "native"], default="grpcio",
        help="what carries gRPC: grpcio's Python server (default), or native: gRPC C++ "
        "(built on first use; needs g++, pkg-config and libgrpc++-dev, or "
        "TENSORKILN_GRPC_LIBRARY naming a built library), about a millisecond less a request",
    )  # fmt: skip
    p.add_argument(
        "--grpc-busy-poll-us", type=int, default=0, metavar="US",
        help="with --grpc-transport native: after each answer, poll for the next request this "
        "many microseconds instead of sleeping until it wakes the server (default: 0, off). "
        "Cuts 0.1-0.2 ms off each request at low load, for a CPU core kept busy while "
        "requests keep coming; 2000 suits a client that sends the next request at once",
    )  # fmt: skip
    p.add_argument(
        "--metrics-port", type=int, default=8002, help="Prometheus /metrics (default: 8002)"
    )
    p.add_argument(
        "--allow-metrics", type=_flag, default=True, metavar="BOOL",
        help="serve /metrics (default: true)",
    )  # fmt: skip
    p.add_argument(
        "--model-control-mode", choices=["none", "explicit", "poll"], default="none",
        help="none (default): load every model at start; explicit: load only --load-model at "
        "start, the rest through the repository API; poll: load every model at start, then "
        "follow the repository folder (models added, changed or removed)",
    )  # fmt: skip
    p.add_argument(
        "--repository-poll-secs", type=int, default=15, metavar="SECONDS",
        help="with --model-control-mode poll: seconds between scans of the repository "
        "(default: 15)",
    )  # fmt: skip
    p.add_argument(
        "--load-model", action="append", default=[], metavar="NAME",
        help="with --model-control-mode explicit: a model to load at start (repeatable; '*' for all)",
    )  # fmt: skip
    p.add_argument(
        "--allow-shared-memory", type=_flag, default=False, metavar="BOOL",
        help="serve Triton's system shared-memory extension to clients on this machine "
        "(default: false; a client can then name any shared-memory object the server may open)",
    )  # fmt: skip
    p.add_argument(
        "--pinned-memory-pool-byte-size", type=int, default=_PINNED_POOL, metavar="BYTES",
        help="page-locked memory that inference requests to models on a GPU are received into, "
        "at most, so that their tensors go to the GPU from where they arrived (default: "
        f"{_PINNED_POOL}, as Triton's; 0: none, requests are staged)",
    )  # fmt: skip
    p.add_argument(
        "--http-max-input-size", type=int, default=64 << 20, metavar="BYTES",
        help="the largest request body accepted (default: 64 MiB)",
    )  # fmt: skip
    p.add_argument(
        "--frontend-processes", type=int, default=0, metavar="N",
        help="N more processes handle HTTP and gRPC on the same ports (the kernel spreads "
        "connections over them), handing tensors to this one, which runs the models "
        "(default: 0; a request costs the server about a millisecond of Python, so one process "
        "tops out near a thousand requests a second)",
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
        help="0 (default): info; 1 or more: debug, and a line per request",
    )
    p.add_argument(
        "--log-format", choices=["default", "json"], default="default",
        help="json: one JSON object per line (ts, level, logger, message), for log collectors",
    )  # fmt: skip
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        from aiohttp import web  # lazy: cli start time (and an optional dependency)
    except ImportError:
        raise CLIError("tensorkiln serve needs aiohttp: pip install 'tensorkiln[serve]'") from None
    from tensorkiln.serve.core import ServerCore  # lazy: cli start time
    from tensorkiln.serve.http import make_app  # lazy: cli start time

    ports = {"--http-port": args.http_port}
    if args.allow_grpc:
        ports["--grpc-port"] = args.grpc_port
    if args.allow_metrics:
        ports["--metrics-port"] = args.metrics_port
    for flag, port in ports.items():
        if not 0 < port < 65536:
            raise CLIError(f"{flag} {port} is not a port (1 to 65535)")
    if len(set(ports.values())) != len(ports):
        raise CLIError(
            f"two services on one port: {', '.join(f'{k} {v}' for k, v in ports.items())}"
        )
    if args.http_max_input_size < 1:
        raise CLIError(f"--http-max-input-size {args.http_max_input_size} must be 1 or more")
    if args.load_model and args.model_control_mode != "explicit":
        raise CLIError("--load-model needs --model-control-mode explicit (as tritonserver's)")
    if args.repository_poll_secs < 1:
        raise CLIError(f"--repository-poll-secs {args.repository_poll_secs} must be 1 or more")
    if args.pinned_memory_pool_byte_size < 0:
        raise CLIError(
            f"--pinned-memory-pool-byte-size {args.pinned_memory_pool_byte_size} must be 0 or more"
        )
    if not 0 <= args.frontend_processes <= 64:
        raise CLIError(f"--frontend-processes {args.frontend_processes} must be 0 to 64")
    if not 0 <= args.grpc_busy_poll_us <= 1_000_000:
        raise CLIError(f"--grpc-busy-poll-us {args.grpc_busy_poll_us} must be 0 to 1000000")
    if args.grpc_busy_poll_us and args.grpc_transport != "native":
        raise CLIError("--grpc-busy-poll-us needs --grpc-transport native")
    if args.allow_grpc and args.grpc_transport == "native":
        _native_transport()
    handler = logging.StreamHandler()
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if args.log_verbose > 0 else logging.INFO,
                        handlers=[handler], force=True)  # fmt: skip
    core = ServerCore(
        args.model_repository, backend=args.backend, cache_dir=args.engine_cache,
        control_mode=args.model_control_mode, shared_memory=args.allow_shared_memory,
        pinned_pool_bytes=args.pinned_memory_pool_byte_size,
    )  # fmt: skip
    explicit = args.model_control_mode == "explicit"
    app = make_app(core, max_body=args.http_max_input_size, load=not explicit)
    if explicit and args.load_model:
        wanted = core.repository.names() if "*" in args.load_model else args.load_model

        async def load_wanted(_app: web.Application) -> None:
            for name in wanted:
                await core.load(name)  # (an explicitly asked model that fails stops the start)

        app.on_startup.append(load_wanted)
    if args.model_control_mode == "poll":
        _with_polling(app, core, args.repository_poll_secs)
    if args.allow_metrics:
        _with_metrics(app, core, args.http_address, args.metrics_port)
    # (a line per request only when asked: at load, logging is the server's bottleneck)
    access_log = logging.getLogger("aiohttp.access") if args.log_verbose > 0 else None
    if args.frontend_processes:
        # The front ends alone listen on the ports: a connection the kernel gave this process
        # would put its protocol work on the interpreter that runs every model. This process
        # serves its app on a Unix socket beside the link instead (run_app keeps the startup,
        # signals and graceful shutdown of the single-process server).
        import shutil  # lazy: cli start time
        import tempfile  # lazy: as above

        folder = tempfile.mkdtemp(prefix="tensorkiln-serve-")  # (0700: this user's alone)
        try:
            _with_frontends(app, core, args, folder)
            web.run_app(
                app, path=os.path.join(folder, "http.sock"), shutdown_timeout=30,
                access_log=access_log, print=None,
            )  # fmt: skip
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return 0
    if args.allow_grpc:
        _with_grpc(
            app, core, f"{args.grpc_address}:{args.grpc_port}", args.grpc_transport,
            args.grpc_busy_poll_us,
        )  # fmt: skip
    web.run_app(
        app, host=args.http_address, port=args.http_port, shutdown_timeout=30,
        access_log=access_log,
        print=lambda line: logging.getLogger("tensorkiln.serve").info(
            "HTTP service at %s:%d (KServe v2)", args.http_address, args.http_port
        ),
    )  # fmt: skip
    return 0


class JsonFormatter(logging.Formatter):
    """A log record as one JSON object per line: ts (ISO 8601, UTC), level, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"'{text}' is not true or false")


def _grpc_service() -> Any:
    """tensorkiln.serve.grpc, or a CLIError saying how to get grpcio."""
    try:
        from tensorkiln.serve import grpc as serve_grpc  # lazy: cli start time (optional grpcio)
    except ImportError:
        raise CLIError(
            "gRPC needs grpcio: pip install 'tensorkiln[serve]', or pass --allow-grpc false"
        ) from None
    return serve_grpc


def _native_transport() -> None:
    """Build or load the native gRPC transport now: what is missing is said before the start."""
    _grpc_service()
    from tensorkiln.serve import native  # lazy: cli start time

    try:
        native.library()
    except native.NativeUnavailable as exc:
        raise CLIError(f"--grpc-transport native: {exc}") from None


def _with_grpc(
    app: Any, core: Any, address: str, transport: str = "grpcio", busy_poll_us: int = 0
) -> None:
    """Start the gRPC service with the HTTP one, on the same event loop, and stop it first."""
    serve_grpc = _grpc_service()
    held = {}

    async def start(_app: Any) -> None:
        held["server"] = await serve_grpc.start(
            core, address, transport=transport, busy_poll_us=busy_poll_us
        )
        logging.getLogger("tensorkiln.serve").info(
            "gRPC service at %s (KServe v2, %s)", address, transport
        )

    async def stop(_app: Any) -> None:
        if "server" in held:
            await held["server"].stop(30)  # (requests in flight get 30 s to finish)

    app.on_startup.append(start)
    app.on_shutdown.insert(0, stop)


def _with_frontends(app: Any, core: Any, args: argparse.Namespace, folder: str) -> None:
    """Start the link (serve/link.py) in ``folder`` (this user's alone) and
    --frontend-processes processes serving HTTP and gRPC on the ports, after the models are
    loaded; stop them first at shutdown."""
    import asyncio  # lazy: cli start time
    import subprocess  # lazy: as above
    import sys  # lazy: as above

    if args.allow_grpc:  # (the front ends import it: a missing grpcio is said here, once)
        _grpc_service()
    from tensorkiln.serve.link import EngineLink  # lazy: CLI start time

    held: dict[str, Any] = {}

    async def start(_app: Any) -> None:
        path = os.path.join(folder, "engine.sock")
        link = EngineLink(core)
        await link.start(path)
        held.update(link=link, procs=[])
        for i in range(1, args.frontend_processes + 1):
            cmd = [sys.executable, "-m", "tensorkiln.serve.frontend", "--link", path,
                   "--index", str(i), "--http-address", args.http_address,
                   "--http-port", str(args.http_port),
                   "--http-max-input-size", str(args.http_max_input_size)]  # fmt: skip
            if args.allow_grpc:
                cmd += ["--grpc-address", args.grpc_address, "--grpc-port", str(args.grpc_port),
                        "--grpc-transport", args.grpc_transport,
                        "--grpc-busy-poll-us", str(args.grpc_busy_poll_us)]  # fmt: skip
            if args.allow_shared_memory:
                cmd.append("--shared-memory")
            held["procs"].append(subprocess.Popen(cmd))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while link.serving < len(held["procs"]):  # (the service starts once every one listens)
            failed = [p.returncode for p in held["procs"] if p.poll() is not None]
            if failed or loop.time() > deadline:
                why = f"exited with {failed[0]}" if failed else "did not start in 120 s"
                raise CLIError(f"a front-end process {why} (see its log above)")
            await asyncio.sleep(0.05)
        log = logging.getLogger("tensorkiln.serve")
        log.info("%d front-end processes started", args.frontend_processes)
        log.info("HTTP service at %s:%d (KServe v2)", args.http_address, args.http_port)
        if args.allow_grpc:
            log.info("gRPC service at %s:%d (KServe v2)", args.grpc_address, args.grpc_port)

    async def stop(_app: Any) -> None:
        for proc in held.get("procs", []):
            proc.terminate()
        for proc in held.get("procs", []):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if "link" in held:
            await held["link"].close()

    app.on_startup.append(start)
    app.on_shutdown.insert(0, stop)


def _with_polling(app: Any, core: Any, seconds: int) -> None:
    """Rescan the repository every ``seconds`` while the server runs (poll mode)."""
    import asyncio  # lazy: cli start time

    held = {}

    async def poll_forever() -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await core.poll()
            except Exception:  # (a scan that fails is logged; the next one tries again)
                logging.getLogger("tensorkiln.serve").exception("repository poll failed")

    async def start(_app: Any) -> None:
        held["task"] = asyncio.create_task(poll_forever())

    async def stop(_app: Any) -> None:
        if "task" in held:
            held["task"].cancel()

    app.on_startup.append(start)
    app.on_shutdown.insert(0, stop)


def _with_metrics(app: Any, core: Any, host: str, port: int) -> None:
    """Serve /metrics on its own port beside the HTTP service."""
    from aiohttp import web  # lazy: cli start time (and an optional dependency)

    from tensorkiln.serve.http import make_metrics_app  # lazy: cli start time

    metrics = make_metrics_app(core)
    held = {}

    async def start(_app: Any) -> None:
        runner = web.AppRunner(metrics)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        held["runner"] = runner
        logging.getLogger("tensorkiln.serve").info("metrics at %s:%d/metrics", host, port)

    async def stop(_app: Any) -> None:
        if "runner" in held:
            await held["runner"].cleanup()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
