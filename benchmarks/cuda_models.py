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
3. memory: the engine's planned activation peak vs PyTorch eager's peak above its weights.

Prints a markdown table for benchmarks/RESULTS.md and writes results.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import tensorkiln  # noqa: E402
from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402

SEQ = 128
LARGE = {"resnet50": 128, "bert": 64, "gpt2": 32, "vit": 64}


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(weights=None).eval()
    if name == "vit":
        import torchvision

        return torchvision.models.vit_b_16(weights=None).eval()
    if name == "bert":
        from transformers import BertConfig, BertModel

        class Bert(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = BertModel(BertConfig())

            def forward(self, input_ids, attention_mask):
                return self.m(
                    input_ids=input_ids, attention_mask=attention_mask, return_dict=False
                )[0]

        return Bert().eval()
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model

        class GPT2(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = GPT2Model(GPT2Config())

            def forward(self, input_ids, attention_mask):
                return self.m(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    use_cache=False,
                    return_dict=False,
                )[0]

        return GPT2().eval()
    raise SystemExit(f"unknown model {name}")


def make_feeds(name: str, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name in ("resnet50", "vit"):
        return {"input": rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)}
    vocab = 30522 if name == "bert" else 50257
    mask = np.ones((batch, SEQ), np.int64)
    if batch > 1:
        mask[-1, SEQ * 2 // 3 :] = 0
    return {
        "input_ids": rng.integers(0, vocab, (batch, SEQ)).astype(np.int64),
        "attention_mask": mask,
    }


def export(model, feeds, path: Path) -> Path:
    args = tuple(torch.from_numpy(x) for x in feeds.values())
    # eval-mode nn.MultiheadAttention (ViT) takes a fused fast path the TorchScript exporter
    # cannot export; the decomposed path computes the same
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, args, str(path), input_names=list(feeds), dynamo=False, opset_version=17
        )
    torch.backends.mha.set_fastpath_enabled(fastpath)
    return path


def ort_outputs(path: Path, feeds) -> list[np.ndarray]:
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()})


def build(path: Path, precision: str, cache: Path) -> tuple[tensorkiln.Engine, float, dict]:
    config = BuilderConfig()
    if precision != "fp32":
        config.set_flag(precision)
    config.timing_cache = str(cache)
    b = Builder("cuda")
    t0 = time.perf_counter()
    engine = b.build(path, config, progress=False)
    return engine, time.perf_counter() - t0, b.last_report.timing_cache


def max_rel(got, want) -> float:
    return max(
        float(np.abs(g.astype(np.float64) - w).max() / max(np.abs(w).max(), 1e-30))
        for g, w in zip(got, want)
    )


def norm_rel(got, want) -> float:
    return max(
        float(np.linalg.norm(g.astype(np.float64) - w) / max(np.linalg.norm(w), 1e-30))
        for g, w in zip(got, want)
    )


def latency_ms(fn, runs: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def interleaved(fns: dict, rounds: int = 3, runs: int = 30) -> dict[str, float]:
    """Each peer's lowest round median, the rounds alternating between peers."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for k, fn in fns.items():
            best[k] = min(best.get(k, float("inf")), latency_ms(fn, runs))
    return best


def cli_run(engine, path: Path) -> dict:
    """`tensorkiln run ENGINE --use-cuda-graph --device-io --json`: trtexec-style statistics."""
    import contextlib
    import io

    from tensorkiln.cli.main import main as tensorkiln_main

    engine.save(path)
    buf = io.StringIO()
    args = [str(path), "--use-cuda-graph", "--device-io", "--warmup", "0.5", "--duration", "1"]
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
    return {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}


def first(out):
    return out[0] if isinstance(out, tuple | list) else out


def bench_model(name: str, folder: Path, cache: Path, large: int, log) -> dict:
    res: dict = {"model": name}
    model = make_model(name)
    feeds = make_feeds(name, 1)
    path = export(model, feeds, folder / f"{name}_b1.onnx")
    ref = ort_outputs(path, feeds)
    model = model.cuda()
    dev = to_dev(feeds)
    engines = {}
    for precision in ("fp32", "fp16"):
        engine, secs, tc = build(path, precision, cache)
        res[f"build_{precision}_s"] = secs
        res[f"build_{precision}_cache"] = tc
        if name == "resnet50" and precision == "fp32":
            _, warm, tc2 = build(path, precision, cache)
            res["build_fp32_warm_s"], res["build_fp32_warm_cache"] = warm, tc2
        ctx = engine.create_execution_context()
        got = ctx.infer(feeds)
        got = [got[o.name] for o in engine.outputs]
        res[f"{precision}_max_rel_vs_ort"] = max_rel(got, ref)
        res[f"{precision}_norm_rel_vs_ort"] = norm_rel(got, ref)
        gctx = engine.create_execution_context(use_cuda_graph=True)
        gout = gctx.infer(dev)
        gout = [gout[o.name].float().cpu().numpy() for o in engine.outputs]
        res[f"{precision}_graph_norm_rel_vs_ort"] = norm_rel(gout, ref)
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
    # large batch, fp16
    model = make_model(name).cuda()
    feeds = make_feeds(name, large, seed=1)
    dev = to_dev(feeds)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        want = first(model(*dev.values())).float()
    torch.cuda.synchronize()
    res["torch_fp32_peak_activation_bytes"] = torch.cuda.max_memory_allocated() - base
    path = export(model.cpu(), feeds, folder / f"{name}_b{large}.onnx")
    model = model.cuda()
    engine, secs, tc = build(path, "fp16", cache)
    res["large_batch"] = large
    res["build_fp16_large_s"] = secs
    res["fp16_large_planned_peak_bytes"] = engine.memory.get("peak_bytes")
    eager = engine.create_execution_context()
    eager.infer(dev)
    res["fp16_large_context_pool_bytes"] = eager.device_memory_bytes()
    del eager
    ctx = engine.create_execution_context(use_cuda_graph=True)
    got = first(list(ctx.infer(dev).values())).float()
    res["fp16_large_graph_fallback"] = ctx.cuda_graph_fallback
    res["fp16_large_norm_rel_vs_torch_fp32"] = float(
        torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)
    )
    model16 = model.half()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch_runner(model16, dev, torch.float16)()
    torch.cuda.synchronize()
    res["torch_fp16_large_peak_activation_bytes"] = torch.cuda.max_memory_allocated() - base
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


def environment() -> dict:
    import onnxruntime
    import triton

    p = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.date.today().isoformat(),
        "device": f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "triton": triton.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": sys.version.split()[0],
        "tensorkiln": tensorkiln.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,bert,gpt2,vit")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batch-sizes", default="")
    args = ap.parse_args()
    large = dict(LARGE)
    for item in filter(None, args.batch_sizes.split(",")):
        k, v = item.split("=")
        large[k] = int(v)
    out = Path(args.out)
    results = {"environment": environment(), "models": []}
    print(json.dumps(results["environment"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "timing.cache"
        for name in args.models.split(","):
            try:
                results["models"].append(
                    bench_model(name, Path(tmp), cache, large[name], lambda s: print(s, flush=True))
                )
            except Exception as exc:  # report and go on with the next model
                import traceback

                traceback.print_exc()
                results["models"].append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
            (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
