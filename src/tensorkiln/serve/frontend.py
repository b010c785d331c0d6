"""A front-end process of ``tensorkiln serve --frontend-processes N`` (see serve/link.py).

The engine process starts it as ``python -m tensorkiln.serve.frontend --link SOCKET ...`` with
its own addresses and ports; it serves HTTP (and gRPC) on them beside the engine process
(SO_REUSEPORT), answers from the engine process over the link, and exits when the link closes
or on SIGTERM. It is not a command for users: its arguments come from ``tensorkiln serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from tensorkiln.serve.link import RemoteCore
from tensorkiln.serve.protocol import ServeError

log = logging.getLogger("tensorkiln.serve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tensorkiln.serve.frontend")
    p.add_argument("--link", required=True)
    p.add_argument("--index", type=int, default=1)
    p.add_argument("--http-address", default="0.0.0.0")
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-address", default="0.0.0.0")
    p.add_argument("--grpc-port", type=int, default=0, help="0: no gRPC")
    p.add_argument("--grpc-transport", choices=["grpcio", "native"], default="grpcio")
    p.add_argument("--grpc-busy-poll-us", type=int, default=0)
    p.add_argument("--http-max-input-size", type=int, default=64 << 20)
    p.add_argument("--shared-memory", action="store_true")
    p.add_argument("--connect-timeout", type=float, default=30.0)
    return p


async def _connect(core: RemoteCore, path: str, timeout: float) -> None:
    """Connect to the engine process, waiting for its link to appear."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await core.connect(path)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web  # lazy: an optional dependency

    from tensorkiln.serve.http import make_app  # lazy: CLI start time (aiohttp)

    core = RemoteCore(shared_memory=args.shared_memory)
    await _connect(core, args.link, args.connect_timeout)
    app = make_app(core, max_body=args.http_max_input_size, load=False)  # type: ignore[arg-type]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.http_address, args.http_port, reuse_port=True).start()
    grpc_server = None
    if args.grpc_port:
        from tensorkiln.serve import grpc as serve_grpc  # lazy: CLI start time (grpcio)

        address = f"{args.grpc_address}:{args.grpc_port}"
        grpc_server = await serve_grpc.start(
            core,  # type: ignore[arg-type]
            address, reuse_port=True, transport=args.grpc_transport,
            busy_poll_us=args.grpc_busy_poll_us,
        )  # fmt: skip
    await core.serving()
    log.info("front end %d serving (HTTP port %d)", args.index, args.http_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    closed = asyncio.ensure_future(core.closed.wait())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([closed, stopped], return_when=asyncio.FIRST_COMPLETED)
    if grpc_server is not None:
        await grpc_server.stop(5)
    await runner.cleanup()
    await core.close()
    for f in (closed, stopped):
        f.cancel()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(args))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        log.error("front end %d: no engine process at %s (%s)", args.index, args.link, exc)
        return 1
    except (OSError, ServeError) as exc:  # (a port another program holds, say)
        log.error("front end %d: cannot serve: %s", args.index, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
