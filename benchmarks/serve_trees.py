"""The server from several source trees side by side under Triton's perf_analyzer: which change
bought which latency or throughput, measured in one run on one host, rounds alternating.

    git archive COMMIT src | tar -x -C /tmp/before      # (a tree of an earlier commit)
    python benchmarks/serve_trees.py --perf-analyzer .perf_analyzer/perf_analyzer \
        --tree before=/tmp/before/src --tree now=src [--cpp-stand-in build/grpc_floor_stand_in] \
        [--loads b1:1,b1:64,dyn:64,b1:1:cuda] [--rounds 3] [--backend cuda] [--tiny] \
        [--library before=/tmp/before/libtk_grpc.so] [--busy-poll now=2000]

One `tensorkiln serve` process per tree (native gRPC transport, all started before the first
measurement, each on its own ports, over the same repository of two prebuilt engines: ResNet-50
fp16 at batch 1 without dynamic batching, "b1", and with it, "dyn"); each load (model and
concurrency, and where the tensors travel: in the message, or with ``:cuda`` / ``:system`` in
Triton's shared memory) is driven against each tree in turn, every round. Printed: perf_analyzer's
throughput and p50 latency. ``--cpp-stand-in`` adds, every round, the p50 at concurrency 1 of
gRPC C++ answering with a recorded response (benchmarks/grpc_floor.py's stand-in: the
protocol's floor on this host; with the tensors where the concurrency-1 loads put them), and
the end adds the in-process run back to back and at the gaps a concurrency-1 client leaves:
numpy in and out, and GPU tensors in and out (the peer of a client whose tensors are in CUDA
shared memory). ``--library LABEL=PATH`` gives one tree's server a native transport library of
its own (``TENSORKILN_GRPC_LIBRARY``: a tree of another transport version); ``--busy-poll
LABEL=US`` its own ``--grpc-busy-poll-us`` (one tree may be listed twice under two labels).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.grpc_floor import _free_port, measure, stand_in  # noqa: E402
from benchmarks.serve_gpu import make_repository, wait_ready  # noqa: E402

MODELS = {"b1": "resnet50_b1", "dyn": "resnet50"}


def _perf(
    perf_analyzer: str, model: str, port: int, concurrency: int, interval_ms: int, shm: str
) -> str:
    got = measure(
        perf_analyzer, model, f"127.0.0.1:{port}", interval_ms,
        concurrency=concurrency, max_trials=10, shared_memory=shm,
    )  # fmt: skip
    return got if isinstance(got, str) else f"{got[0]:,.0f} infer/s, p50 {got[1]:,} us"


def _where(shm: str) -> str:
    """How a load's tensors travel, as its printed rows say it."""
    return "" if shm == "none" else f" ({shm} shared memory)"


def _in_process(repo: Path, calls: int = 300) -> None:
    from tensorkiln.engine import Engine

    engine = Engine.load(repo / "resnet50_b1" / "1" / "model.engine")
    ctx = engine.create_execution_context(use_cuda_graph=engine.runtime_backend.cuda_graphs)
    name = engine.inputs[0].name
    x = np.random.default_rng().standard_normal((1, *engine.inputs[0].shape[1:])).astype(np.float32)
    import torch

    runs = [("numpy", lambda: ctx.infer({name: x}))]
    if torch.cuda.is_available():  # (a smoke run on the reference backend has no GPU)
        on_gpu = torch.from_numpy(x).cuda()

        def device() -> None:  # (GPU tensors in and out, the results ready to read)
            ctx.infer({name: on_gpu})
            torch.cuda.current_stream().synchronize()

        runs.append(("GPU tensors", device))
    for label, run in runs:
        for _ in range(50):
            run()
        for gap_ms in (0.0, 1.5):
            times = []
            for _ in range(calls):
                if gap_ms:
                    time.sleep(gap_ms / 1e3)
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
            p50 = 1e3 * statistics.median(times)
            print(f"in-process run, {label}, gap {gap_ms:g} ms: p50 {p50:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--perf-analyzer", required=True)
    ap.add_argument(
        "--tree", action="append", required=True, metavar="LABEL=SRC",
        help="a source tree's src folder, labelled (repeatable; two or more)",
    )  # fmt: skip
    ap.add_argument("--loads", default="b1:1,b1:64,dyn:64", help="model:concurrency, ...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interval-ms", type=int, default=2000)
    ap.add_argument(
        "--warmup", type=int, default=1,
        help="unmeasured passes over every load and tree before the first round",
    )  # fmt: skip
    ap.add_argument("--cpp-stand-in", help="benchmarks/grpc_floor_cpp/build.sh makes it")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small conv net at 32x32 (smoke runs)")
    ap.add_argument("--work", default="/tmp/tk_serve_trees")
    ap.add_argument("--grpc-busy-poll-us", type=int, default=0, help="each server's (serve's flag)")
    ap.add_argument("--library", action="append", default=[], help="LABEL=PATH (repeatable)")
    ap.add_argument("--busy-poll", action="append", default=[], help="LABEL=US (repeatable)")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    libraries = dict(t.split("=", 1) for t in args.library)
    busy = {label: int(us) for label, us in (t.split("=", 1) for t in args.busy_poll)}
    if not set(libraries) | set(busy) <= set(trees):
        ap.error("--library and --busy-poll name labels of --tree")
    loads = [
        (MODELS[m], int(c), shm[0] if shm else "none")
        for m, c, *shm in (x.split(":") for x in args.loads.split(","))
    ]
    work = Path(args.work)
    repo = work / "repo"
    if not repo.is_dir():
        work.mkdir(parents=True, exist_ok=True)
        built = argparse.Namespace(
            tiny=args.tiny, precision="fp16" if args.backend == "cuda" else "fp32",
            backend=args.backend, max_batch=64, instances=2, delay_us=200,
        )  # fmt: skip
        make_repository(built, work)
    # (each server finds its own tree first, then what the caller's path adds beyond a src)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    extra = [p for p in extra if Path(p).resolve() != (ROOT / "src").resolve()]
    logs = Path(tempfile.mkdtemp(prefix="serve_trees_"))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for label, tree in trees.items():
            http, grpc_port, metrics = (_free_port() for _ in range(3))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(tree).resolve()), *extra]))
            if label in libraries:
                env["TENSORKILN_GRPC_LIBRARY"] = str(Path(libraries[label]).resolve())
            spin = busy.get(label, args.grpc_busy_poll_us)
            log = logs / f"{label}.log"
            proc = subprocess.Popen(
                [sys.executable, "-m", "tensorkiln", "serve", "--model-repository", str(repo),
                 "--backend", args.backend, "--http-port", str(http), "--grpc-port",
                 str(grpc_port), "--metrics-port", str(metrics), "--grpc-transport", "native",
                 "--engine-cache", str(logs / "cache"), "--allow-shared-memory", "true",
                 *(["--grpc-busy-poll-us", str(spin)] if spin else [])],
                env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=str(logs),
            )  # fmt: skip
            servers[label] = (proc, grpc_port)
            wait_ready(http, proc, log)
            print(f"{label} ({tree}, busy polling {spin} us): ready", flush=True)
        recorded = logs / "recorded.bin"
        if args.cpp_stand_in:
            first = next(iter(servers.values()))[1]
            subprocess.run(
                [sys.executable, str(ROOT / "benchmarks" / "grpc_floor.py"), "--record",
                 f"127.0.0.1:{first}", "resnet50_b1", str(recorded)],
                check=True,
            )  # fmt: skip
        stand_in_port = _free_port()
        # (the floor where the concurrency-1 loads' tensors travel)
        floor_modes = sorted({shm for _, c, shm in loads if c == 1}, reverse=True) or ["none"]

        def every_load(tag: str) -> None:
            """One measurement of each load on each tree, printed behind ``tag``."""
            for model, concurrency, shm in loads:
                for label, (_, port) in servers.items():
                    said = _perf(
                        args.perf_analyzer, model, port, concurrency, args.interval_ms, shm
                    )
                    print(f"{tag}: {model} c{concurrency}{_where(shm)} {label}: {said}", flush=True)

        # (the first measurements after a start ran slow: engines' first runs at each load, the
        # host and the GPU coming out of idle; perf_analyzer's stable windows do not hide it all)
        for _ in range(args.warmup):
            every_load("warm-up")
        for round_ in range(1, args.rounds + 1):
            every_load(f"round {round_}")
            for shm in floor_modes if args.cpp_stand_in else ():
                with stand_in([args.cpp_stand_in, str(recorded), str(stand_in_port)]):
                    said = _perf(
                        args.perf_analyzer, "resnet50_b1", stand_in_port, 1, args.interval_ms, shm
                    )
                print(
                    f"round {round_}: resnet50_b1 c1{_where(shm)} bare C++ gRPC: {said}", flush=True
                )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    _in_process(repo)


if __name__ == "__main__":
    main()
