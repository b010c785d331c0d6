"""Where a served batch-1 request's time goes without any network: the engine run alone, the
served model's run (staging the rows, the engine, the outputs) on the event loop's thread and
through a worker thread, the server core around it (checks, the scheduler, the worker thread,
statistics) and the gRPC service around that (parse, feeds, response, serialize), each timed
in one process.

    python benchmarks/serve_path.py [--calls 300] [--gaps-ms 0,2] [--instances 1,2] [--profile]

ResNet-50 fp16 on the cuda backend with CUDA graphs (a small conv net on the cpu backend where
there is no GPU); p50 and p90 of ``--calls`` calls after 30 warm ones, back to back and with
idle gaps between calls (a client at concurrency 1 leaves the GPU idle between requests).
``--profile`` adds the functions that took the most time of the event loop's thread, and of the
engine's threads, over the gRPC handler's calls (cProfile, one profile per thread).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]


def _summary(times: list[float]) -> str:
    times = sorted(times)
    return f"p50 {1e3 * statistics.median(times):.3f} ms, p90 {1e3 * times[int(0.9 * len(times))]:.3f} ms"


async def _profiled(model, call, calls: int) -> None:
    """Print where ``calls`` calls of ``call`` spent the loop thread's time and the engine
    threads' (the served model's runs, each profiled in the thread that makes it)."""
    import cProfile
    import pstats
    import threading

    workers: list[cProfile.Profile] = []
    run = model._run
    loop_thread = threading.get_ident()

    def profiled_run(feeds):
        if threading.get_ident() == loop_thread:  # (a run on the loop: in the loop's profile)
            return run(feeds)
        prof = cProfile.Profile()
        prof.enable()
        try:
            return run(feeds)
        finally:
            prof.disable()
            workers.append(prof)

    model._run = profiled_run
    loop = cProfile.Profile()
    loop.enable()
    try:
        for _ in range(calls):
            await call()
    finally:
        loop.disable()
        model._run = run
    for what, prof in (("event loop thread", [loop]), ("engine threads", workers)):
        print(f"--- {what}, {calls} calls, by own time", flush=True)
        if not prof:
            print("(no runs there)")
            continue
        stats = pstats.Stats(prof[0])
        for more in prof[1:]:
            stats.add(more)
        stats.sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--gaps-ms", default="0,2")
    ap.add_argument("--instances", default="1,2")
    ap.add_argument("--profile", action="store_true", help="also profile the handler's calls")
    args = ap.parse_args()
    import torch
    from benchmarks._common import export_dynamic, image_feeds, make_model

    from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
    from tensorkiln.serve import grpc as serve_grpc
    from tensorkiln.serve import protocol
    from tensorkiln.serve.core import ServerCore

    gpu = torch.cuda.is_available()
    backend, side = ("cuda", 224) if gpu else ("cpu", 32)
    gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    work = Path(tempfile.mkdtemp(prefix="serve_path_"))
    onnx_path = export_dynamic(
        make_model("resnet50", tiny=not gpu), image_feeds(2, side, 0), work / "model.onnx"
    )
    config = BuilderConfig()
    if gpu:
        config.set_flag("fp16")
    profile = OptimizationProfile()
    shape = (3, side, side)
    profile.set_shape("input", (1, *shape), (1, *shape), (64, *shape))
    config.add_optimization_profile(profile)
    engine = Builder(backend).build(str(onnx_path), config, progress=False)
    x = np.random.default_rng().standard_normal((1, *shape)).astype(np.float32)

    ctx = engine.create_execution_context(use_cuda_graph=engine.runtime_backend.cuda_graphs)
    for gap in gaps:
        for _ in range(30):
            ctx.infer({"input": x})
        times = []
        for _ in range(args.calls):
            if gap:
                time.sleep(gap)
            t = time.perf_counter()
            ctx.infer({"input": x})
            times.append(time.perf_counter() - t)
        print(f"engine run, gap {gap * 1e3:g} ms: {_summary(times)}", flush=True)

    request = protocol.message("inference.ModelInferRequest")(model_name="b1")
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    data = bytearray(request.SerializeToString())
    path = f"/{serve_grpc.SERVICE}/ModelInfer"

    async def served(instances: int) -> None:
        repo = work / f"repo{instances}"
        (repo / "b1" / "1").mkdir(parents=True)
        engine.save(repo / "b1" / "1" / "model.engine")
        (repo / "b1" / "config.pbtxt").write_text(
            f'name: "b1"\nmax_batch_size: 64\ninstance_group [ {{ count: {instances} '
            "kind: KIND_GPU } ]\noptimization { cuda { graphs: true } }\n"
        )
        core = ServerCore(repo, backend=backend, cache_dir=str(work / "cache"))
        await core.load_all()
        answer = serve_grpc.native_answer(serve_grpc.InferenceService(core))
        # (first, the served answers agree with the engine's own)
        want = next(iter(ctx.infer({"input": x}).values())).astype(np.float64)
        _, outs = await core.infer("b1", "", {"input": x}, [])
        reply = protocol.message("inference.ModelInferResponse").FromString(
            await answer(path, data, False)
        )
        got = [next(iter(outs.values())), np.frombuffer(reply.raw_output_contents[0], np.float32)]
        for y in got:
            err = float(np.linalg.norm(y.reshape(want.shape) - want) / np.linalg.norm(want))
            if not err <= 1e-3:
                raise SystemExit(f"the served answer differs from the engine's ({err:.2e})")
        model = core.model("b1", "")
        batcher = core.batcher("b1", model.version)
        assert batcher is not None
        inline_max_s = batcher.inline_max_s
        hop = ThreadPoolExecutor(1)

        async def inline() -> None:
            model.infer_batch([{"input": x}])

        async def off_loop():  # (the core as it was before lone requests ran on the loop)
            batcher.inline_max_s = 0.0
            try:
                return await core.infer("b1", "", {"input": x}, [])
            finally:
                batcher.inline_max_s = inline_max_s

        calls = {
            "served model's run, on the loop's thread": inline,
            "served model's run, through a worker thread": lambda: (
                asyncio.get_running_loop().run_in_executor(hop, model.infer_batch, [{"input": x}])
            ),
            "server core, runs on worker threads only": off_loop,
            "server core": lambda: core.infer("b1", "", {"input": x}, []),
            "gRPC service handler": lambda: answer(path, data, False),
        }
        try:
            inline_before = batcher.inline_runs
            for gap in gaps:
                for what, call in calls.items():
                    for _ in range(30):
                        await call()
                    times = []
                    for _ in range(args.calls):
                        if gap:
                            await asyncio.sleep(gap)
                        t = time.perf_counter()
                        await call()
                        times.append(time.perf_counter() - t)
                    print(
                        f"{what}, {instances} instance(s), gap {gap * 1e3:g} ms: {_summary(times)}",
                        flush=True,
                    )
            print(f"(runs on the loop's thread: {batcher.inline_runs - inline_before})")
            if args.profile:
                await _profiled(model, lambda: answer(path, data, False), args.calls)
        finally:
            hop.shutdown()
            await core.close()

    for instances in (int(i) for i in args.instances.split(",")):
        asyncio.run(served(instances))


if __name__ == "__main__":
    main()
