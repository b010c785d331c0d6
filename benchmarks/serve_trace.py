"""Where a concurrency-1 request's time goes inside `tensorkiln serve` (native gRPC transport)
under Triton's perf_analyzer: timestamps along the server's path, in one server process, and the
medians over every inference request of the run.

    python benchmarks/serve_trace.py --perf-analyzer .perf_analyzer/perf_analyzer \
        [--model-repository R --model M] [--shared-memory none|system|cuda] [--backend cuda]
        [--seconds 4] [--tiny] [--profile FILE] [--busy-poll-us US] [--concurrency N]

Without ``--model-repository`` the ResNet-50 repository of benchmarks/serve_gpu.py is built and
its batch-1 model is traced (``--tiny``: the small conv net). The server runs on an event loop in
this process, perf_analyzer in another. Printed, medians in microseconds:

- taken: from the event loop's wake-up for the request to its dispatch (the copy out of gRPC
  C++ included);
- to the run: parse, feeds (from the dispatch to the core's infer);
- run: the core's infer (checks, the scheduler, the engine);
- answer: the response built, outputs written, serialized (to the hand-over);
- reply: handing the answer to gRPC C++ (tk_reply);
- outside: from the hand-over's return to the next request's wake-up: gRPC C++ sending, the
  client, the network both ways, receiving, and the wake-up itself;
- and perf_analyzer's p50 for the same run.

``--concurrency N`` (above 1) drives the model with N clients at once instead; the stages are
not traced then (they assume one request in flight), only perf_analyzer's figures, the mean
batch the model ran, and with ``--profile`` where the server's thread spent its time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.grpc_floor import _free_port, measure  # noqa: E402

STAGES = (
    ("taken", "wake", "dispatch"),
    ("to the run", "dispatch", "infer_start"),
    ("run", "infer_start", "infer_end"),
    ("answer", "infer_end", "reply_start"),
    ("reply", "reply_start", "reply_end"),
)
# inside "run" and "answer", where the timestamps were taken: the model's batch run (the
# engine, joining and splitting rows), and the outputs' copies into CUDA shared memory
SUBSTAGES = (
    ("run: checks, scheduler", "infer_start", "batch_start"),
    ("run: the model's batch", "batch_start", "batch_end"),
    ("run: results handed back", "batch_end", "infer_end"),
    ("answer: CUDA copies, synchronized", "write_start", "write_end"),
)


class Trace:
    """Timestamps of every inference request, taken by wrappers around the native transport's
    wake-up and dispatch, the core's infer and tk_reply. A request's record travels with the
    task that answers it (a context variable, which the task copies when it is made), so calls
    that overlap it (perf_analyzer's statistics) leave it whole."""

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []
        self._wake = 0.0
        self._current: contextvars.ContextVar = contextvars.ContextVar("request", default=None)
        self._last: dict[str, float] | None = None  # (a worker thread lacks the task's context)

    def install_model(self) -> None:
        """Wrap the model's batch run and the copies into CUDA shared memory (before the models
        load: each scheduler keeps the batch run it was given)."""
        trace, now = self, time.perf_counter
        from tensorkiln.serve import cuda_shm
        from tensorkiln.serve.model import ServedModel

        infer_batch, write = ServedModel.infer_batch, cuda_shm.write

        def timed_batch(model_self, requests):
            record = trace._current.get() or trace._last  # (concurrency 1: the one in flight)
            start = now()
            try:
                return infer_batch(model_self, requests)
            finally:
                if record is not None:
                    record["batch_start"], record["batch_end"] = start, now()

        def timed_write(dst, data):
            record = trace._current.get()
            start = now()
            try:
                return write(dst, data)
            finally:
                if record is not None:
                    record.setdefault("write_start", start)
                    record["write_end"] = now()

        ServedModel.infer_batch = timed_batch
        cuda_shm.write = timed_write

    def install(self, core, native) -> None:
        trace, now = self, time.perf_counter
        take, dispatch = native.NativeServer._take, native.NativeServer._dispatch

        def timed_take(server_self, server):
            trace._wake = now()
            return take(server_self, server)

        def timed_dispatch(server_self, call, name, data, streaming):
            record = None  # (perf_analyzer's statistics and metadata calls: not traced)
            if name.endswith("/ModelInfer"):
                record = {"wake": trace._wake, "dispatch": now()}
                trace.records.append(record)
                trace._last = record
            trace._current.set(record)  # (the task made in dispatch takes it along)
            return dispatch(server_self, call, name, data, streaming)

        infer = core.infer

        async def timed_infer(*args, **kw):
            record = trace._current.get()
            if record is not None:
                record["infer_start"] = now()
            try:
                return await infer(*args, **kw)
            finally:
                if record is not None:
                    record["infer_end"] = now()

        lib = native.library().lib
        reply = lib.tk_reply

        def timed_reply(*args):
            record = trace._current.get()
            start = now()
            try:
                return reply(*args)
            finally:
                if record is not None and "infer_end" in record and "reply_end" not in record:
                    record["reply_start"], record["reply_end"] = start, now()

        native.NativeServer._take = timed_take
        native.NativeServer._dispatch = timed_dispatch
        core.infer = timed_infer
        lib.tk_reply = timed_reply

    def summary(self) -> dict[str, float]:
        """Each stage's median (us) over the complete records, and the count."""
        done = [r for r in self.records if "reply_end" in r]
        out: dict[str, float] = {"requests": len(done)}
        for label, a, b in STAGES:
            out[label] = 1e6 * statistics.median(r[b] - r[a] for r in done)
        for label, a, b in SUBSTAGES:
            have = [r[b] - r[a] for r in done if a in r and b in r]
            if have:
                out[label] = 1e6 * statistics.median(have)
        gaps = [
            nxt["wake"] - r["reply_end"]
            for r, nxt in zip(self.records, self.records[1:])
            if "reply_end" in r and nxt["wake"] > r["reply_end"]
        ]
        out["outside"] = 1e6 * statistics.median(gaps)
        out["server"] = 1e6 * statistics.median(r["reply_end"] - r["wake"] for r in done)
        return out


def _serve(repo: Path, backend: str, port: int, trace: Trace | None, ready: threading.Event,
           holder: dict, busy_poll_us: int = 0) -> None:  # fmt: skip
    from tensorkiln.serve import grpc as serve_grpc
    from tensorkiln.serve import native
    from tensorkiln.serve.core import ServerCore

    loop = asyncio.new_event_loop()
    holder["loop"] = loop

    async def start() -> None:
        if trace is not None:
            trace.install_model()
        core = ServerCore(repo, backend=backend, shared_memory=True)
        await core.load_all()
        if trace is not None:
            trace.install(core, native)
        holder["core"] = core
        holder["server"] = await serve_grpc.start(
            core, f"127.0.0.1:{port}", transport="native", busy_poll_us=busy_poll_us
        )

    loop.run_until_complete(start())
    profile = holder.get("profile")
    if profile is not None:
        profile.enable()
    ready.set()
    loop.run_forever()
    if profile is not None:
        profile.disable()
    loop.run_until_complete(holder["server"].stop(5))
    loop.run_until_complete(holder["core"].close())
    loop.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--perf-analyzer", required=True)
    ap.add_argument("--model-repository", type=Path)
    ap.add_argument("--model", default="resnet50_b1")
    ap.add_argument("--shared-memory", choices=("none", "system", "cuda"), default="none")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--tiny", action="store_true", help="the small conv net (smoke runs)")
    ap.add_argument(
        "--profile", type=Path, help="write cProfile's statistics of the server's thread here"
    )
    ap.add_argument("--busy-poll-us", type=int, default=0, help="serve --grpc-busy-poll-us")
    ap.add_argument(
        "--concurrency", type=int, default=1, help="clients at once (above 1: no trace)"
    )
    ap.add_argument(
        "--stability-percentage", type=int, default=20,
        help="perf_analyzer's: how far apart its last three windows may be (a smoke run that "
        "checks the trace, not the rate, on a machine whose cores the client shares with the "
        "server, can take a loose one)",
    )  # fmt: skip
    args = ap.parse_args()
    repo = args.model_repository
    if repo is None:
        from benchmarks.serve_gpu import make_repository

        work = Path(tempfile.mkdtemp(prefix="serve_trace_"))
        built = argparse.Namespace(
            tiny=args.tiny, precision="fp16" if args.backend == "cuda" else "fp32",
            backend=args.backend, max_batch=64, instances=2, delay_us=200,
        )  # fmt: skip
        make_repository(built, work)
        repo = work / "repo"
    trace = Trace() if args.concurrency == 1 else None
    ready, holder = threading.Event(), {}
    if args.profile is not None:
        import cProfile

        holder["profile"] = cProfile.Profile()
    port = _free_port()
    thread = threading.Thread(
        target=_serve,
        args=(repo, args.backend, port, trace, ready, holder, args.busy_poll_us),
        daemon=True,
    )
    thread.start()
    if not ready.wait(600):
        raise SystemExit("the server did not start")
    try:
        got = measure(
            args.perf_analyzer, args.model, f"127.0.0.1:{port}", int(args.seconds * 1000),
            concurrency=args.concurrency, max_trials=10, shared_memory=args.shared_memory,
            stability=args.stability_percentage,
        )  # fmt: skip
    finally:
        holder["loop"].call_soon_threadsafe(holder["loop"].stop)
        thread.join(30)
    if isinstance(got, str):
        raise SystemExit(f"perf_analyzer: {got}")
    stats = holder["core"].statistics(args.model)[0]
    answered = stats["inference_stats"]["success"]["count"]
    if trace is None:
        runs = stats["execution_count"]
        print(f"{args.model}, tensors: {args.shared_memory}, concurrency {args.concurrency}: "
              f"{answered} requests answered in {runs} runs "
              f"({answered / max(runs, 1):.1f} a run)")  # fmt: skip
        print(f"perf_analyzer: {got[0]:,.0f} infer/s, p50 {got[1]} us")
        if args.profile is not None:
            holder["profile"].dump_stats(args.profile)
        return
    s = trace.summary()
    print(f"{args.model}, tensors: {args.shared_memory}, {s['requests']:.0f} requests traced "
          f"({answered} answered by the model)")  # fmt: skip
    for label, *_ in STAGES + SUBSTAGES:
        if label in s:
            print(f"  {label}: {s[label]:.0f} us")
    print(f"  outside: {s['outside']:.0f} us")
    print(f"  server, wake-up to reply: {s['server']:.0f} us")
    batchers = [b for b in (holder["core"].batcher(args.model, 1),) if b is not None]
    if batchers:
        print(f"  runs on the event loop's thread: {batchers[0].inline_runs}")
    print(f"perf_analyzer p50: {got[1]} us ({got[0]:,.0f} infer/s)")
    if args.profile is not None:
        holder["profile"].dump_stats(args.profile)


if __name__ == "__main__":
    main()
