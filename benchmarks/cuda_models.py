"""tensorkiln's cuda backend next to PyTorch eager on the GPU, and checked against onnxruntime.

    python benchmarks/cuda_models.py [--models resnet50,bert,gpt2,vit] [--out DIR]
                                     [--batch-sizes resnet50=128,bert=64,gpt2=32,vit=64]

For each model (random weights: torchvision ResNet-50 and ViT-B/16, transformers BERT-base at
sequence 128 and GPT-2 small at sequence 128), exported with the TorchScript exporter at opset 17:

1. batch 1: build fp32 and fp16 engines (autotuned; ResNet-50's fp32 engine is built twice, cold
   and with the warm timing cache), check each against onnxruntime (CPU) on the same inputs
   (fp32: max |diff| / max |ref| <= 1e-4; fp16: ||diff|| / ||ref|| <= 1e-2), then time tensorkiln
   (layer by layer and as one CUDA graph, inputs and outputs on the GPU) and PyTorch eager in fp32
   and fp16, alternating, in this process; medians of per-call latencies (synchronized).
2. a large batch: fp16 engine vs PyTorch eager fp16 (checked against PyTorch fp32 on the GPU),
   throughput from the median latency.
3. memory, at the large batch: the engine's planned activation peak; what a context reserves
   from the plan before its first run and holds after two runs (layer by layer, and as a CUDA
   graph); PyTorch eager's peak above its weights. ``--memory-only`` runs only this step and the
   large batch's agreement check.

Prints a markdown table for benchmarks/RESULTS.md and writes results.json to --out.
``--device cpu --tiny`` runs the same steps on torch CPU tensors with 2-layer transformers: a
smoke test of this script (tests/benchmarks runs it), whose timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the model helpers of tests/models

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tests.models.test_architectures import (  # noqa: E402
    export,
    max_rel_diff,
    run_onnxruntime,
    token_feeds,
)

import tensorkiln  # noqa: E402
from benchmarks import _common as common  # noqa: E402

SEQ = 128
LARGE = {"resnet50": 128, "bert": 64, "gpt2": 32, "vit": 64}
DEVICE = "cuda"  # --device cpu runs everything on torch CPU tensors (a smoke test of this script)
TINY = False  # --tiny: 2-layer transformers of hidden size 64 at sequence 16 (smoke test)
RUNS = 30  # timed calls per round
KEEP: list = []  # contexts kept alive, so that each measured context has a memory pool of its own


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_activation_bytes(fn) -> int | None:
    """Peak device memory ``fn`` allocates above what was allocated before (None on the CPU)."""
    if DEVICE != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def make_model(name: str) -> torch.nn.Module:
    return common.make_model(name, TINY)


def make_feeds(name: str, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    if name in ("resnet50", "vit"):
        return common.image_feeds(batch, common.TINY_IMAGE if TINY else 224, seed)
    return token_feeds(batch, SEQ, 30522 if name == "bert" else 50257)


def build(
    path: Path, precision: str, cache: Path
) -> tuple[tensorkiln.Engine, float, tensorkiln.builder.BuildReport]:
    return common.build(path, precision, cache, DEVICE)


def latency_ms(fn, runs: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def interleaved(fns: dict, rounds: int = 3) -> dict[str, float]:
    """Each peer's lowest round median, the rounds alternating between peers."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for k, fn in fns.items():
            best[k] = min(best.get(k, float("inf")), latency_ms(fn, RUNS, min(5, RUNS)))
    return best


def cli_run(engine, path: Path) -> dict:
    """`tensorkiln run ENGINE --use-cuda-graph --device-io --json`: trtexec-style statistics."""
    import contextlib
    import io

    from tensorkiln.cli.main import main as tensorkiln_main

    engine.save(path)
    buf = io.StringIO()
    args = [str(path), "--warmup", "0.5", "--duration", "1"]
    if DEVICE == "cuda":
        args += ["--use-cuda-graph", "--device-io"]
    else:  # the smoke test: a few runs
        args = [str(path), "--warmup", "0", "--iterations", "2"]
    with contextlib.redirect_stdout(buf):
        rc = tensorkiln_main(["run", *args, "--json"])
    if rc != 0:
        return {"error": f"tensorkiln run exited {rc}"}
    r = json.loads(buf.getvalue())
    keep = ("throughput_qps", "latency_ms", "enqueue_ms", "compute_ms", "host_ms", "iterations")
    return {k: r[k] for k in keep}


def engine_runner(engine, feeds_dev, graph: bool):
    ctx = engine.create_execution_context(use_cuda_graph=graph)
    return ctx, (lambda: ctx.infer(feeds_dev))


def torch_runner(model, feeds_dev, dtype):
    m = model.to(dtype) if dtype != torch.float32 else model
    args = [x.to(dtype) if x.is_floating_point() else x for x in feeds_dev.values()]

    def run():
        with torch.no_grad():
            return m(*args)

    return run


def to_dev(feeds):
    return {k: torch.from_numpy(v).to(DEVICE) for k, v in feeds.items()}


def first(out):
    return out[0] if isinstance(out, tuple | list) else out


def bench_model(name: str, folder: Path, cache: Path, large: int, log) -> dict:
    res: dict = {"model": name}
    model = make_model(name)
    feeds = make_feeds(name, 1)
    path = export(model, feeds, folder / f"{name}_b1", dynamo=False)
    ref = run_onnxruntime(path, feeds)
    if not all(np.abs(r).max() > 0 for r in ref):  # nothing to compare against
        raise ValueError(f"{name}: onnxruntime's output is all zeros; randomize its weights")
    model = model.to(DEVICE)
    dev = to_dev(feeds)
    engines = {}
    for precision in ("fp32", "fp16"):
        engine, secs, report = build(path, precision, cache)
        tc = report.timing_cache
        res[f"build_{precision}_s"] = secs
        res[f"build_{precision}_cache"] = tc
        if name == "resnet50" and precision == "fp32":
            _, warm, report2 = build(path, precision, cache)
            tc2 = report2.timing_cache
            res["build_fp32_warm_s"], res["build_fp32_warm_cache"] = warm, tc2
        ctx = engine.create_execution_context()
        got = ctx.infer(feeds)
        got = [got[o.name] for o in engine.outputs]
        res[f"{precision}_max_rel_vs_ort"] = max_rel_diff(got, ref)
        res[f"{precision}_norm_rel_vs_ort"] = common.norm_rel(got, ref)
        gctx = engine.create_execution_context(use_cuda_graph=True)
        gout = gctx.infer(dev)
        gout = [gout[o.name].float().cpu().numpy() for o in engine.outputs]
        res[f"{precision}_graph_norm_rel_vs_ort"] = common.norm_rel(gout, ref)
        res[f"{precision}_graph_fallback"] = gctx.cuda_graph_fallback
        res[f"{precision}_tuned_layers"] = sum(1 for x in engine.layers if x.get("timings_ms"))
        res[f"{precision}_non_default"] = sum(
            1 for x in engine.layers if x.get("tactic", "default") != "default"
        )
        res[f"{precision}_planned_peak_bytes"] = engine.memory.get("peak_bytes")
        res[f"{precision}_tensorkiln_run"] = cli_run(engine, folder / f"{name}_{precision}.engine")
        engines[precision] = engine
        log(
            f"{name} {precision}: built in {secs:.1f}s, cache {tc}, "
            f"max_rel {res[f'{precision}_max_rel_vs_ort']:.2e} "
            f"norm_rel {res[f'{precision}_norm_rel_vs_ort']:.2e}"
        )
    peers = {}
    for precision, engine in engines.items():
        _, peers[f"tk_{precision}"] = engine_runner(engine, dev, False)
        _, peers[f"tk_{precision}_graph"] = engine_runner(engine, dev, True)
    peers["torch_fp32"] = torch_runner(model, dev, torch.float32)
    times = interleaved(peers)
    model16 = model.half()
    times.update(interleaved({"torch_fp16": torch_runner(model16, dev, torch.float16)}))
    res["b1_ms"] = times
    log(f"{name} batch 1 ms: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()))
    res.update(large_batch(name, folder, cache, large, log, timed=True))
    return res


def context_memory(engine, feeds_dev, keep: list) -> dict:
    """Device memory of the engine's contexts: what one reserves from the memory plan before its
    first run, and what it holds after two runs, layer by layer and as a CUDA graph. The contexts
    go to ``keep``, so that the next ones get pools of their own (a dropped context's pool, with
    its memory, is handed to the next context made)."""
    eager = engine.create_execution_context()
    reserved = eager.device_memory_bytes()
    graph = engine.create_execution_context(use_cuda_graph=True)
    for ctx in (eager, graph):
        for _ in range(2):
            ctx.infer(feeds_dev)
            sync()
    keep += [eager, graph]
    return {
        "fp16_large_context_reserved_bytes": reserved,
        "fp16_large_context_pool_bytes": eager.device_memory_bytes(),
        "fp16_large_graph_pool_bytes": graph.device_memory_bytes(),
    }


def large_batch(name: str, folder: Path, cache: Path, large: int, log, timed: bool) -> dict:
    """The fp16 engine at a large batch: agreement with PyTorch fp32, memory against PyTorch eager
    fp16's, and (``timed``) throughput against it."""
    res: dict = {"model": name}
    model = make_model(name).to(DEVICE)
    feeds = make_feeds(name, large, seed=1)
    dev = to_dev(feeds)
    with torch.no_grad():
        want = first(model(*dev.values())).float()
    res["torch_fp32_peak_activation_bytes"] = peak_activation_bytes(
        lambda: torch_runner(model, dev, torch.float32)()
    )
    path = export(model.cpu(), feeds, folder / f"{name}_b{large}", dynamo=False)
    model = model.to(DEVICE)
    engine, secs, _ = build(path, "fp16", cache)
    res["large_batch"] = large
    res["build_fp16_large_s"] = secs
    res["fp16_large_planned_peak_bytes"] = engine.memory.get("peak_bytes")
    res.update(context_memory(engine, dev, KEEP))
    ctx = engine.create_execution_context(use_cuda_graph=True)
    KEEP.append(ctx)
    got = first(list(ctx.infer(dev).values())).float()
    res["fp16_large_graph_fallback"] = ctx.cuda_graph_fallback
    res["fp16_large_norm_rel_vs_torch_fp32"] = float(
        torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)
    )
    model16 = model.half()
    res["torch_fp16_large_peak_activation_bytes"] = peak_activation_bytes(
        torch_runner(model16, dev, torch.float16)
    )
    mib = {k: (v or 0) / 2**20 for k, v in res.items() if k.endswith("_bytes")}
    log(
        f"{name} batch {large} fp16 MiB: planned {mib['fp16_large_planned_peak_bytes']:.0f}, "
        f"reserved {mib['fp16_large_context_reserved_bytes']:.0f}, context pool "
        f"{mib['fp16_large_context_pool_bytes']:.0f}, graph context "
        f"{mib['fp16_large_graph_pool_bytes']:.0f}, PyTorch eager fp16 peak "
        f"{mib['torch_fp16_large_peak_activation_bytes']:.0f}"
    )
    if not timed:
        return res
    t = interleaved(
        {
            "tk_fp16_graph": lambda: ctx.infer(dev),
            "torch_fp16": torch_runner(model16, dev, torch.float16),
        }
    )
    res["large_ms"] = t
    res["large_per_s"] = {k: large * 1e3 / v for k, v in t.items()}
    log(f"{name} batch {large} fp16 ms: " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))
    return res


def log(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,bert,gpt2,vit")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batch-sizes", default="")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small transformers (a smoke test)")
    ap.add_argument(
        "--memory-only", action="store_true", help="only the large batch's memory and agreement"
    )
    args = ap.parse_args(argv)
    global DEVICE, TINY, SEQ, RUNS
    DEVICE, TINY = args.device, args.tiny
    if TINY:
        SEQ, RUNS = 16, 2
    large = dict(LARGE)
    for item in filter(None, args.batch_sizes.split(",")):
        k, v = item.split("=")
        large[k] = int(v)
    out = Path(args.out)
    results = {"environment": common.environment(DEVICE), "models": []}
    print(json.dumps(results["environment"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "timing.cache"
        for name in args.models.split(","):
            try:
                results["models"].append(
                    large_batch(name, Path(tmp), cache, large[name], log, timed=False)
                    if args.memory_only
                    else bench_model(name, Path(tmp), cache, large[name], log)
                )
            except Exception as exc:  # report and go on with the next model
                import traceback

                traceback.print_exc()
                results["models"].append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
            (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n".join(summary(results)))
    return 0


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summary(results: dict) -> list[str]:
    """Markdown tables of the results: agreement and build times; latency; large batches."""
    rows = [r for r in results["models"] if "error" not in r]
    lines = [
        "| model | fp32 max rel vs ORT | fp16 rel L2 vs ORT | build fp32 s (warm) | build fp16 s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        warm = r.get("build_fp32_warm_s")
        lines.append(
            f"| {r['model']} | {_f(r.get('fp32_max_rel_vs_ort'), '.1e')} | "
            f"{_f(r.get('fp16_norm_rel_vs_ort'), '.1e')} | {_f(r.get('build_fp32_s'), '.1f')}"
            f"{'' if warm is None else f' ({warm:.1f})'} | {_f(r.get('build_fp16_s'), '.1f')} |"
        )
    peers = ["tk_fp32", "tk_fp32_graph", "tk_fp16", "tk_fp16_graph", "torch_fp32", "torch_fp16"]
    lines += ["", "| model, batch 1, ms | " + " | ".join(peers) + " |", "|---|" + "---:|" * 6]
    for r in rows:
        t = r.get("b1_ms", {})
        lines.append(f"| {r['model']} | " + " | ".join(_f(t.get(p), ".3f") for p in peers) + " |")
    lines += [
        "",
        "| model, fp16 | batch | tensorkiln (graph) /s | PyTorch eager /s | planned peak MiB | "
        "context reserved MiB | context after runs MiB | graph context MiB | PyTorch peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        per = r.get("large_per_s", {})
        mib = [
            _f((r.get(f"{k}_bytes") or 0) / 2**20 if f"{k}_bytes" in r else None, ".0f")
            for k in (
                "fp16_large_planned_peak",
                "fp16_large_context_reserved",
                "fp16_large_context_pool",
                "fp16_large_graph_pool",
                "torch_fp16_large_peak_activation",
            )
        ]
        lines.append(
            f"| {r['model']} | {r.get('large_batch')} | {_f(per.get('tk_fp16_graph'), '.0f')} | "
            f"{_f(per.get('torch_fp16'), '.0f')} | " + " | ".join(mib) + " |"
        )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
