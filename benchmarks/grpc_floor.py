"""What gRPC in Python costs by itself at concurrency 1: `tensorkiln serve` against a bare grpcio
KServe service that answers every ModelInfer with a response recorded from the real server.

    python benchmarks/grpc_floor.py --model-repository DIR --model NAME \
        --perf-analyzer PATH [--backend cpu] [--rounds 2] [--interval-ms 3000] \
        [--cpp-stand-in build/grpc_floor_stand_in] [--transports grpcio,native]

The server runs as one process (no front-end processes), once per ``--transports`` entry (its
``--grpc-transport``). The stand-in is a grpc.aio server (and,
as a second variant, grpcio's thread-pool server) with the same channel options as the real one;
it parses each request as the real one does (the raw input contents viewed as arrays) and
returns the recorded response: no model, no checks, no queue. Its metadata, config and server
metadata are the real server's, read in this process; the stand-in runs in a child process
that never opens a client channel (a synchronous gRPC client in the process changes how
grpc.aio polls). With ``--cpp-stand-in``, a third stand-in in C++ (gRPC C++'s synchronous
server, the same answers: benchmarks/grpc_floor_cpp/, built by its build.sh) shows what the
protocol costs outside Python. Triton's perf_analyzer drives each in turn at concurrency 1,
batch 1, rounds alternating; printed: its p50 latency for each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.serve_gpu import wait_ready  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stub(recorded: Path, port: int, mode: str) -> None:
    """The stand-in service (run in a child process)."""
    import grpc
    from google.protobuf import json_format

    from tensorkiln.serve import protocol
    from tensorkiln.serve.grpc import SERVICE, _request_type

    def message(name):
        return protocol.message(f"inference.{name}")

    blobs = recorded.read_bytes().split(b"\0SPLIT\0")
    meta, config, server_meta, answer = blobs
    served = [0]

    def infer(request):
        for raw in request.raw_input_contents:
            np.frombuffer(raw, np.uint8)  # (viewed, as the real server views it)
        served[0] += 1
        reply = message("ModelInferResponse").FromString(answer)
        reply.id = request.id
        return reply

    def statistics(request):  # what perf_analyzer reads around each measurement
        n = served[0]
        stat = {"count": str(n), "ns": str(n * 1000)}
        parts = ("success", "queue", "compute_input", "compute_infer", "compute_output")
        stats = {
            "model_stats": [
                {
                    "name": request.name, "version": "1", "last_inference": "1",
                    "inference_count": str(n), "execution_count": str(n),
                    "inference_stats": dict.fromkeys(parts, stat),
                }
            ]
        }  # fmt: skip
        return json_format.ParseDict(stats, message("ModelStatisticsResponse")())

    answers = {
        "ServerLive": lambda r: message("ServerLiveResponse")(live=True),
        "ServerReady": lambda r: message("ServerReadyResponse")(ready=True),
        "ModelReady": lambda r: message("ModelReadyResponse")(ready=True),
        "ServerMetadata": lambda r: message("ServerMetadataResponse").FromString(server_meta),
        "ModelMetadata": lambda r: message("ModelMetadataResponse").FromString(meta),
        "ModelConfig": lambda r: message("ModelConfigResponse").FromString(config),
        "ModelStatistics": statistics,
        "ModelInfer": infer,
    }

    def handler(name, fn):
        if mode == "sync":
            behaviour = lambda request, context: fn(request)  # noqa: E731
        else:

            async def behaviour(request, context):
                return fn(request)

        return grpc.unary_unary_rpc_method_handler(
            behaviour,
            request_deserializer=_request_type(name).FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )

    generic = grpc.method_handlers_generic_handler(
        SERVICE, {n: handler(n, fn) for n, fn in answers.items()}
    )
    options = [  # the real server's
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.http2.lookahead_bytes", 16 << 20),
    ]
    if mode == "sync":
        from concurrent.futures import ThreadPoolExecutor

        server = grpc.server(ThreadPoolExecutor(4), options=options)
        server.add_generic_rpc_handlers((generic,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("ready", flush=True)
        server.wait_for_termination()
        return

    async def main():
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((generic,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def _record(url: str, model: str, path: Path) -> None:
    """The real server's metadata, config, server metadata and one response, to ``path``."""
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(url)
    meta = client.get_model_metadata(model)
    inputs = []
    rng = np.random.default_rng()
    for t in meta.inputs:
        shape = [1 if d < 0 else d for d in t.shape]
        x = tc.InferInput(t.name, shape, t.datatype)
        x.set_data_from_numpy(rng.standard_normal(shape).astype(_np_dtype(t.datatype)))
        inputs.append(x)
    answer = client.infer(model, inputs).get_response()
    blobs = [meta, client.get_model_config(model), client.get_server_metadata(), answer]
    path.write_bytes(b"\0SPLIT\0".join(m.SerializeToString() for m in blobs))
    client.close()


def _np_dtype(datatype: str) -> np.dtype:
    from tritonclient.utils import triton_to_np_dtype

    return np.dtype(triton_to_np_dtype(datatype))


@contextlib.contextmanager
def stand_in(cmd: list[str], env: dict[str, str] | None = None) -> Iterator[None]:
    """A stand-in server (``cmd``) running, from its "ready" line to the end of the block."""
    stub = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        stub.stdout.readline()  # "ready"
        yield
    finally:
        stub.terminate()
        stub.wait(20)


def measure(
    perf_analyzer: str,
    model: str,
    url: str,
    interval_ms: int,
    *,
    concurrency: int = 1,
    max_trials: int = 20,
    shared_memory: str = "none",
    stability: int = 20,
) -> tuple[float, int] | str:
    """perf_analyzer over gRPC at batch 1 and ``concurrency``: (infer/s, p50 us), or what went
    wrong. ``shared_memory``: where the tensors travel (none: in the message; system; cuda).
    ``stability``: how far apart (percent) the last three windows may be."""
    cmd = [perf_analyzer, "-m", model, "-u", url, "-i", "grpc", "--concurrency-range",
           f"{concurrency}:{concurrency}", "-b", "1", "--measurement-interval", str(interval_ms),
           "--percentile", "50",
           # (three windows within 20% of each other, up to 20 windows: on a machine whose cores
           # the client shares with the server, 10% in 10 windows often never settles)
           "--stability-percentage", str(stability), "--max-trials", str(max_trials),
           "--shared-memory", shared_memory]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rate = re.search(r"Throughput: ([\d.]+) infer/sec", done.stdout)
    p50 = re.search(r"p50 latency: (\d+) usec", done.stdout)
    if rate and p50:
        return float(rate.group(1)), int(p50.group(1))
    said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()
    return f"failed (exit {done.returncode}): {said[-1]}"


def _p50(perf_analyzer: str, model: str, url: str, interval_ms: int) -> str:
    got = measure(perf_analyzer, model, url, interval_ms)
    return got if isinstance(got, str) else f"{got[1]} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repository", type=Path)
    ap.add_argument("--model")
    ap.add_argument("--perf-analyzer")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interval-ms", type=int, default=3000)
    ap.add_argument(
        "--cpp-stand-in",
        help="also time this C++ stand-in binary (benchmarks/grpc_floor_cpp/build.sh makes it)",
    )
    ap.add_argument(
        "--transports", default="grpcio",
        help="comma-separated --grpc-transport values: one server each (default: grpcio)",
    )  # fmt: skip
    ap.add_argument("--stub", nargs=3, metavar=("RECORDED", "PORT", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--record", nargs=3, metavar=("URL", "MODEL", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record:
        _record(args.record[0], args.record[1], Path(args.record[2]))
        return
    if args.stub:
        _stub(Path(args.stub[0]), int(args.stub[1]), args.stub[2])
        return
    if not (args.model_repository and args.model and args.perf_analyzer):
        ap.error("--model-repository, --model and --perf-analyzer are required")
    # (the children find the project first, then whatever the caller's path adds)
    path = [str(ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    transports = args.transports.split(",")
    stub_port = _free_port()
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for transport in transports:  # (one at a time: they share the engine cache)
                http, grpc_port, metrics = (_free_port() for _ in range(3))
                server_log = Path(tmp) / f"server_{transport}.log"
                server = subprocess.Popen(
                    [sys.executable, "-m", "tensorkiln", "serve", "--model-repository",
                     str(args.model_repository), "--backend", args.backend, "--http-port",
                     str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics),
                     "--engine-cache", str(Path(tmp) / "cache"), "--grpc-transport", transport],
                    env=env, stdout=server_log.open("w"), stderr=subprocess.STDOUT,
                )  # fmt: skip
                servers[transport] = (server, grpc_port)
                wait_ready(http, server, server_log)
            recorded = Path(tmp) / "recorded.bin"
            # (in a child: this process starts the stand-ins, which must not inherit a channel)
            subprocess.run(
                [sys.executable, __file__, "--record", f"127.0.0.1:{servers[transports[0]][1]}",
                 args.model, str(recorded)],
                check=True, env=env,
            )  # fmt: skip
            for round_ in range(1, args.rounds + 1):
                for transport, (_, grpc_port) in servers.items():
                    p50 = _p50(
                        args.perf_analyzer, args.model, f"127.0.0.1:{grpc_port}", args.interval_ms
                    )
                    print(f"round {round_}: tensorkiln serve ({transport}) p50 {p50}", flush=True)
                for mode in ("aio", "sync", "c++") if args.cpp_stand_in else ("aio", "sync"):
                    cmd = [sys.executable, __file__, "--stub", str(recorded), str(stub_port), mode]
                    if mode == "c++":
                        cmd = [args.cpp_stand_in, str(recorded), str(stub_port)]
                    with stand_in(cmd, env):
                        p50 = _p50(
                            args.perf_analyzer,
                            args.model,
                            f"127.0.0.1:{stub_port}",
                            args.interval_ms,
                        )
                    what = "bare C++ gRPC" if mode == "c++" else f"bare grpcio ({mode})"
                    print(f"round {round_}: {what} p50 {p50}", flush=True)
        finally:
            for server, _ in servers.values():
                server.terminate()
                server.wait(30)


if __name__ == "__main__":
    main()
