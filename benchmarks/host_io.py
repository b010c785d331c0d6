"""Where a batch-1 CUDA-graph run's host time goes: numpy in and out through the full path and
through the known-feeds path (ExecutionContext._replay_known_host), against device tensors in
and out, back to back and after idle gaps that the host spends asleep or spinning, with the
GPU's own time for the layers (CUDA events) beside the host's wall time.

    python benchmarks/host_io.py [--calls 300] [--gaps-ms 0,0.3,1,2,5] [--model resnet50]

ResNet-50 fp16 at batch 1 on the cuda backend (needs a GPU). The full path and the known path
are checked to give the same outputs bit for bit first; p50 and p90 of ``--calls`` calls after
50 warm ones. ``--profile`` adds cProfile's top functions of 200 calls of each numpy path.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--gaps-ms", default="0,0.3,1,2,5")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import torch
    from benchmarks._common import export_dynamic, image_feeds, make_model

    from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile

    if not torch.cuda.is_available():
        raise SystemExit("host_io.py times CUDA graphs: it needs a GPU")
    work = Path(tempfile.mkdtemp(prefix="host_io_"))
    onnx_path = export_dynamic(make_model(args.model), image_feeds(2, 224, 0), work / "m.onnx")
    config = BuilderConfig()
    config.set_flag("fp16")
    profile = OptimizationProfile()
    shape = (3, 224, 224)
    profile.set_shape("input", (1, *shape), (1, *shape), (64, *shape))
    config.add_optimization_profile(profile)
    t = time.perf_counter()
    engine = Builder("cuda").build(str(onnx_path), config, progress=False)
    print(f"built in {time.perf_counter() - t:.1f} s", flush=True)
    ctx = engine.create_execution_context(use_cuda_graph=True)
    rng = np.random.default_rng()
    xs = [rng.standard_normal((1, *shape)).astype(np.float32) for _ in range(8)]
    on_gpu = [torch.from_numpy(x).cuda() for x in xs]

    def call(path: str, i: int) -> object:
        if path == "numpy, full path":
            ctx._known_host.clear()  # (the next call takes the full path, and remembers)
        if path == "device tensors":
            out = next(iter(ctx.infer({"input": on_gpu[i % 8]}).values()))
            return out.cpu()  # (the caller reads the answer, as the numpy paths do)
        return next(iter(ctx.infer({"input": xs[i % 8]}).values()))

    paths = ("numpy, full path", "numpy, known feeds", "device tensors")
    for _ in range(50):
        for path in paths:
            call(path, 0)
    for i in range(8):
        full, known = call(paths[0], i), call(paths[1], i)
        if not np.array_equal(full, known):
            raise SystemExit(f"the numpy paths disagree on input {i}")
    print("the full and known numpy paths agree bit for bit on 8 inputs", flush=True)
    for gap in (float(g) for g in args.gaps_ms.split(",")):
        for wait in ("asleep", "spinning") if gap else ("",):
            for path in paths:
                host, gpu = [], []
                for i in range(args.calls):
                    if gap:
                        (time.sleep if wait == "asleep" else _spin)(gap / 1e3)
                    t = time.perf_counter()
                    call(path, i)
                    host.append(time.perf_counter() - t)
                    gpu.append(ctx.last_gpu_s or 0.0)
                host.sort()
                print(
                    f"gap {gap:g} ms {wait:8s} {path:19s}: host p50 "
                    f"{1e3 * statistics.median(host):.3f} ms, p90 "
                    f"{1e3 * host[int(0.9 * len(host))]:.3f} ms; layers on the GPU p50 "
                    f"{1e3 * statistics.median(gpu):.3f} ms",
                    flush=True,
                )
    if args.profile:
        for path in paths[:2]:
            prof = cProfile.Profile()
            prof.enable()
            for i in range(200):
                call(path, i)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            print(f"--- {path}, 200 calls, by own time\n{out.getvalue()}", flush=True)


if __name__ == "__main__":
    main()
