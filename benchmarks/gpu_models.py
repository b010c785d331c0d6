"""tensorkiln against every way a PyTorch user runs the model on the GPU, in one process.

    python benchmarks/gpu_models.py [--models resnet50,bert,vit,gpt2,bert_large]
        [--peers tensorkiln,eager,compile,max-autotune,reduce-overhead] [--batch large|1|both]
        [--out DIR] [--inductor-cache DIR] [--timing-cache FILE] [--static-export] [--kernels N]
        [--rounds N]
    python benchmarks/gpu_models.py --merge DIR          # no GPU needed
    python benchmarks/gpu_models.py --device cpu --tiny  # the smoke test (CI)

The models, fp16, random weights: ResNet-50 224x224 (batch 256 and 1), BERT-base at sequence 128
with the last 1/8 of every sequence padded (64 and 1), ViT-B/16 224x224 (128 and 1), GPT-2 small
at sequence 512, no padding (32 and 1), BERT-large at sequence 384, padded as BERT-base (128).
Each is exported once with the TorchScript exporter (opset 17, dynamic batch axis; with
--static-export, once per batch without one); tensorkiln builds an fp16 engine per batch (profile
min 1 / opt B / max B; batch 1: 1 / 1 / 1; none for a static export), float16 in and out as the
PyTorch peers are (I/O formats fp16:chw: no casts at the engine's edges), and runs it
as one CUDA graph on device tensors (``create_execution_context(use_cuda_graph=True)``, as
``tensorkiln run --use-cuda-graph --device-io``). Its peers, on the same inputs, under
torch.inference_mode: PyTorch eager fp16 (conv nets channels_last), torch.compile (default mode),
mode="max-autotune-no-cudagraphs" and mode="reduce-overhead", each compiled after
torch._dynamo.reset() for its batch alone.

Before timing, every peer's output is compared with PyTorch fp32 eager's (TF32 off) on the same
inputs: the largest relative L2 error over the outputs. A row is flagged, not stopped, when
tensorkiln's error is above 2x PyTorch eager fp16's + 1e-3; a peer that fails shows
"failed: <reason>" in its cell and the run goes on. Throughput at the large batch: the best of 3
loops of 20 calls timed with CUDA events (after warm-up); batch-1 latency: the median of 200
calls, each synchronized. With ``--rounds N`` every peer of a throughput row is timed N times,
in turns once all are built (A B C, A B C, ...), and its median is reported, the rounds under
"values" in the JSON: peers timed once each, one after the other, also differ by the GPU's drift
between their turns. Per row, also: tensorkiln's build seconds (and those of a second, warm
build from the timing cache the first filled), its planned activation memory and what its context
holds after the runs, and its share of the fp16 GEMM peak (the model's
FLOPs, counted once with FlopCounterMode on the fp32 eager model at that batch, per tensorkiln's
time per inference, over the peak of an 8192^3 fp16 matmul measured at the start).

With ``--kernels N`` each peer is also run 20 times under the PyTorch profiler after its timing:
its kernels per call, their summed GPU time and the top N go into the JSON and a section of
results.md (where a batch-1 call's time goes: kernels, or the host between them). With
``--layers N`` each tensorkiln engine is also run layer by layer with CUDA events around each
layer (what `tensorkiln run --dump-profile` shows): the N slowest layers, with their op, tactic,
precisions and the kernels they launched, go into the JSON and results.md (which layer a kernel
belongs to, and what the autotuner chose for it), with every layer that launches a copy.

Each model's rows go to DIR/<model>.json as soon as they are measured; the end of a run (and
``--merge DIR``) writes DIR/results.md and DIR/results.json from every model file in DIR, so
several calls (one model or peer set at a time) make one table. Inductor's cache is kept in
--inductor-cache (default /tmp/tensorkiln-bench-inductor), so a second call on the same machine
reuses compiled kernels. Progress goes to stderr. ``--device cpu --tiny`` runs 2-layer
transformers, a small conv net for ResNet-50 and a 32x32 ViT on torch CPU tensors (torch.compile
peers skipped: Inductor's C++ compile takes minutes there): a smoke test whose timings mean
nothing.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the model helpers of tests/models

import torch  # noqa: E402

from benchmarks import _common as common  # noqa: E402
from benchmarks import _gpu_table as table  # noqa: E402
from tensorkiln.builder import BuilderConfig  # noqa: E402
from tensorkiln.runtime.context import in_graph_buffers  # noqa: E402


@dataclass(frozen=True)
class Spec:
    image: bool  # an image model (else token ids and an attention mask)
    size: int  # image side or sequence length
    large: int  # the large batch
    batch1: bool = True  # also measured at batch 1
    vocab: int = 30522
    pad: bool = False  # mask the last 1/8 of every sequence
    channels_last: bool = False  # a conv net: PyTorch eager runs it channels_last


SPECS = {
    "resnet50": Spec(True, 224, 256, channels_last=True),
    "bert": Spec(False, 128, 64, pad=True),
    "vit": Spec(True, 224, 128),
    "gpt2": Spec(False, 512, 32, vocab=50257),
    "bert_large": Spec(False, 384, 128, batch1=False, pad=True),
}
PEERS = (
    "tensorkiln",
    "tensorkiln-int8",
    "tensorkiln-fp8",
    "tensorkiln-packed",
    "tensorkiln-torch",
    "eager",
    "compile",
    "max-autotune",
    "reduce-overhead",
)
MODES = {
    "compile": None,
    "max-autotune": "max-autotune-no-cudagraphs",
    "reduce-overhead": "reduce-overhead",
}


@dataclass
class Settings:
    device: str = "cuda"
    tiny: bool = False
    loops: int = 3  # throughput: the best of this many loops
    iters: int = 20  # calls per throughput loop
    warmup: int = 5
    latency_runs: int = 200  # batch 1: median of this many synchronized calls
    kernels: int = 0  # > 0: also profile each peer's kernels, keeping this many of the top ones
    layers: int = 0  # > 0: also profile tensorkiln's layers, keeping this many of the slowest
    precision: str = "fp16"  # tensorkiln's: fp16, or int8/fp8 (with fp16 for the other layers)
    quantize_all: bool = False  # int8/fp8: every layer quantized (no per-layer precision choice)
    tactic_sources: set[str] | None = None  # tensorkiln's builds (None: every source)
    tactic_exclude: tuple[str, ...] = ()  # tactics tensorkiln's builds never try
    tactic_timeout: float | None = None  # a tactic that takes longer ends the run, named
    rounds: int = 1  # throughput: times each peer is timed, in turns (the median is reported)
    peer: str = ""  # the peer being measured
    # this row's throughput callables by peer (fn, batch, under inference mode), for the rounds
    # after the first
    timers: dict = field(default_factory=dict)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


S = Settings()
KEEP: list = []  # tensorkiln contexts kept alive: each measured context has a memory pool of its own


def feeds_for(name: str, batch: int, seed: int) -> dict:
    spec = SPECS[name]
    if spec.image:
        return common.image_feeds(batch, common.TINY_IMAGE if S.tiny else spec.size, seed)
    seq = 16 if S.tiny else spec.size
    return common.padded_token_feeds(batch, seq, spec.vocab, seq // 8 if spec.pad else 0, seed)


def outputs(out) -> list:
    return list(out) if isinstance(out, tuple | list) else [out]


# ---------------------------------------------------------------- timing


def throughput(fn, batch: int) -> float:
    """Items per second: the best of S.loops loops of S.iters calls (CUDA events on the GPU)."""
    for _ in range(S.warmup):
        fn()
    S.sync()
    best = float("inf")
    for _ in range(S.loops):
        if S.device == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(S.iters):
                fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            for _ in range(S.iters):
                fn()
            ms = (time.perf_counter() - t0) * 1e3
        best = min(best, ms / S.iters)
    return batch * 1e3 / best


def timed(fn, batch: int) -> float:
    """:func:`throughput`, with ``fn`` kept for the rounds after the first (see :func:`rounds`)."""
    S.timers[S.peer] = (fn, batch, torch.is_inference_mode_enabled())
    return throughput(fn, batch)


def rounds(row: dict) -> None:
    """Time every peer of a throughput row again, in turns, ``S.rounds - 1`` more times, and
    report the median of its rounds (the rounds themselves under "values"): peers timed one
    after the other, once each, differ by the GPU's drift between their turns as well (an H200's
    reduce-overhead BERT-base ran 18,064-19,216 seq/s over seven such runs). A peer whose
    compiled function a later peer's torch._dynamo.reset() dropped compiles again in its warm-up;
    one that fails a round keeps the rounds it has."""
    values = {peer: [row["peers"][peer]["value"]] for peer in S.timers}
    for _ in range(S.rounds - 1):
        for peer, (fn, batch, inference) in S.timers.items():
            try:
                with torch.inference_mode(inference):  # (as its first round ran)
                    values[peer].append(throughput(fn, batch))
            except Exception as exc:  # (the cell keeps its first rounds)
                common.log(f"{row['model']} batch {row['batch']}: {peer} round failed: {exc}")
    for peer, got in values.items():
        row["peers"][peer]["values"] = got
        row["peers"][peer]["value"] = statistics.median(got)


def latency_ms(fn) -> float:
    """The median of S.latency_runs calls, each synchronized (perf_counter around both)."""
    for _ in range(S.warmup * 2):
        fn()
        S.sync()
    samples = []
    for _ in range(S.latency_runs):
        t0 = time.perf_counter()
        fn()
        S.sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def kernel_profile(fn, calls: int = 20, top: int = 15) -> dict:
    """What the device ran for ``calls`` calls of ``fn`` (the PyTorch profiler: CUDA kernels on
    the GPU, torch ops on the CPU), per call: the number of kernels, their summed time and the
    ``top`` kernels by time (name, ms per call, launches per call)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = S.device == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    fn()
    S.sync()
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        S.sync()
    totals: dict[str, list] = {}
    for e in prof.events():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if (cuda and e.device_type != torch.autograd.DeviceType.CUDA) or us <= 0:
            continue
        entry = totals.setdefault(e.name[:120], [0.0, 0])
        entry[0] += us
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        "kernels_per_call": sum(n for _, n in totals.values()) / calls,
        "ms_per_call": sum(t for t, _ in totals.values()) / calls / 1e3,
        "top": [[name, t / calls / 1e3, n / calls] for name, (t, n) in ranked[:top]],
        "clock": "CUDA kernels (PyTorch profiler)" if cuda else "CPU ops (PyTorch profiler)",
    }


def gemm_peak() -> dict:
    """The fp16 matmul peak, measured: best of 5 rounds of 10 8192^3 products (on the CPU,
    --tiny: float32 at 256^3, a stand-in)."""
    cuda = S.device == "cuda"
    n, dtype = (8192, torch.float16) if cuda else (256, torch.float32)
    a, b = (torch.randn(n, n, device=S.device, dtype=dtype) for _ in range(2))
    saved = S.loops, S.iters, S.warmup
    S.loops, S.iters, S.warmup = 5, 10, 3
    try:
        per_s = throughput(lambda: a @ b, 1)
    finally:
        S.loops, S.iters, S.warmup = saved
    return {"flops": 2 * n**3 * per_s, "n": n, "dtype": str(dtype).removeprefix("torch.")}


# ---------------------------------------------------------------- peers


def reference(model, dev: dict) -> tuple[list, int]:
    """PyTorch fp32 eager's outputs (TF32 off) and the FLOPs of that call (MHA's fused fast path
    off and attention by SDPA's math backend, so that the counter sees every matmul the same way
    on every device)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with (
            torch.inference_mode(),
            common._no_mha_fastpath(),
            sdpa_kernel(SDPBackend.MATH),
            FlopCounterMode(display=False) as counter,
        ):
            want = outputs(model(*dev.values()))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    return [w.float() for w in want], int(counter.get_total_flops())


def tuning() -> dict:
    """The autotuner's options of tensorkiln's builds, from the command line."""
    return {
        "tactic_sources": S.tactic_sources,
        "tactic_exclude": S.tactic_exclude,
        "tactic_timeout": S.tactic_timeout,
    }


def tensorkiln_peer(
    path: Path,
    dev: dict,
    want: list,
    large: bool,
    cache: Path,
    precision: str,
    packed: bool = False,
) -> dict:
    """Build the fp16 engine for this batch, run it as a CUDA graph, check it, time it.
    A model with a dynamic batch axis gets a profile: min 1, opt = max = this batch (batch 1:
    1, 1, 1). ``packed``: built with padding removal; outputs compared where the mask keeps a
    token (the engine gives zeros at the others)."""
    shapes = None
    if path.stem == "dynamic":
        shapes = {
            k: ((1, *v.shape[1:]), tuple(v.shape), tuple(v.shape)) if large else (v.shape,) * 3
            for k, v in dev.items()
        }
    flags = "fp16" if precision == "fp16" else f"{precision}+fp16"
    # INT8/FP8: calibrated on this run's own inputs (speed is what is measured here; accuracy
    # with real data is benchmarks/quant_accuracy.py's)
    calib = None
    if precision != "fp16":
        calib = [
            {k: (v.float() if v.is_floating_point() else v).cpu().numpy() for k, v in dev.items()}
        ]
    engine, secs, report = common.build(
        path, flags, cache, S.device, shapes, io_format="fp16", calibration=calib,
        remove_padding=packed, quantize_all=S.quantize_all, **tuning(),
    )  # fmt: skip
    if packed and not report.passes.get("remove_padding"):
        return {"skipped": next((n for n in report.notes if "padding" in n), "not packed")}
    tc = report.timing_cache
    ctx = engine.create_execution_context(use_cuda_graph=True)
    KEEP.append(ctx)
    names = [o.name for o in engine.outputs]
    # fp16 in and out, as the PyTorch peers take and give (trtexec's --inputIOFormats=fp16:chw)
    dev = {k: v.half() if v.is_floating_point() else v for k, v in dev.items()}
    out = ctx.infer(dev)
    got = [out[n] for n in names]
    if packed:
        got, want = (
            _kept_tokens(got, dev["attention_mask"]),
            _kept_tokens(want, dev["attention_mask"]),
        )
    cell = {"err": common.norm_rel_torch(got, want), "build_s": secs}
    cell["timing_cache"] = tc
    # the same build again, every layer's timing from the cache the first one filled
    cell["warm_build_s"] = common.build(
        path, flags, cache, S.device, shapes, io_format="fp16", calibration=calib,
        remove_padding=packed, quantize_all=S.quantize_all, **tuning(),
    )[1]  # fmt: skip
    cell["precision"] = precision
    cell["tactics"] = tactic_summary(engine.layers)
    if precision != "fp16" and S.quantize_all:  # each quantized layer's candidates, timed
        cell["quantized_layers"] = [
            {k: x[k] for k in ("name", "tactic", "timings_ms", "rejected") if k in x}
            for x in engine.layers
            if x.get("op", "").rpartition(".")[2] in ("QConvAct", "QGemmAct", "QConvPool")
        ]
    if report.precision_choice:
        cell["precision_choice"] = choice_summary(report.precision_choice)
    batch = next(iter(dev.values())).shape[0]
    # timed on the inputs in the graph's own buffers (TensorRT's bound input addresses): the
    # replay copies nothing first, as the PyTorch peers read their inputs where they are
    run = in_graph_buffers(ctx, dev)
    cell["inputs"] = "bound" if run is not dev else "copied"
    cell["value"] = (
        timed(lambda: ctx.infer(run), batch) if large else latency_ms(lambda: ctx.infer(run))
    )
    if packed and large:
        # the mask as a tokenizer hands it (a host array): counted on the host, no read-back
        host = {**dev, "attention_mask": dev["attention_mask"].cpu().numpy()}
        cell["value_host_mask"] = throughput(lambda: ctx.infer(host), batch)
    if S.kernels:
        cell["kernels"] = kernel_profile(lambda: ctx.infer(run), top=S.kernels)
    if S.layers:
        cell["layers"] = layer_profile(engine, dev, S.layers)
    cell["planned_bytes"] = engine.memory.get("peak_bytes")
    cell["actual_bytes"] = ctx.device_memory_bytes() if S.device == "cuda" else None
    cell["graph_fallback"] = ctx.cuda_graph_fallback
    return cell


def _kept_tokens(outs: list, mask) -> list:
    """Outputs of [B, S, ...] with the positions the mask drops set to zero (others as given)."""
    keep = mask != 0
    return [
        torch.where(keep.reshape(*keep.shape, *(1,) * (o.ndim - 2)), o, 0)
        if o.ndim >= 2 and tuple(o.shape[:2]) == tuple(keep.shape)
        else o
        for o in outs
    ]


def layer_profile(engine, dev: dict, top: int, runs: int = 10) -> dict:
    """The engine run layer by layer (a context without a CUDA graph; CUDA events around each
    layer): the total per run and the ``top`` slowest layers, each with its op, tactic,
    precisions, milliseconds per run and what it ran (:func:`kernels_by_layer`); and the
    copies (:func:`is_copy`) each layer launches, for every layer that launches any."""
    from tensorkiln.runtime.profile import profile_layers

    ctx = engine.create_execution_context()
    for _ in range(2):
        ctx.infer(dev)
    rows = profile_layers(ctx, dev, runs)
    ran = kernels_by_layer(ctx, dev)
    info = {x["name"]: x for x in engine.layers}
    slowest = []
    for r in rows[:top]:
        layer = info.get(r["name"], {})
        slowest.append(
            {
                "name": r["name"],
                "op": r["op"],
                "tactic": layer.get("tactic", ""),
                "precision": f"{layer.get('precision', '')}/{layer.get('compute_precision', '')}",
                "ms": r["total_ms"] / runs,
                "kernels": ran.get(r["name"], [])[:4],
            }
        )
    copies = {}
    for name, kernels in ran.items():
        if found := [k for k in kernels if is_copy(k[0])]:
            copies[name] = found
    return {
        "ms_per_run": sum(r["total_ms"] for r in rows) / runs,
        "top": slowest,
        "copies": copies,
    }


def is_copy(kernel: str) -> bool:
    """Whether a kernel's name is a copy's (torch's ``direct_copy``, a memcpy): "copy" in its
    name, not counting CuTe's ``CopyAtom`` (a template argument of every CUTLASS kernel)."""
    name = kernel.lower()
    return "memcpy" in name or "copy" in name.replace("copyatom", "")


def kernels_by_layer(ctx, dev: dict) -> dict[str, list]:
    """What each layer ran in one layer-by-layer run under the PyTorch profiler: per layer name,
    ``[kernel, ms, launches]`` by time (CUDA kernels on the GPU, torch ops' self time on the
    CPU). The device is synchronized after each layer and a marker recorded, so a kernel
    belongs to the first layer whose marker follows its end."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = S.device == "cuda"
    prefix = "tensorkiln.layer_done:"

    def mark(node, _outputs) -> None:
        S.sync()
        with record_function(prefix + node.name):
            pass

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        ctx.infer(dev, observer=mark)
        S.sync()
    events = list(prof.events())
    marks = sorted((e.time_range.start, e.name[len(prefix) :]) for e in events
                   if e.name.startswith(prefix))  # fmt: skip
    starts = [t for t, _ in marks]
    out: dict[str, dict[str, list]] = {}
    for e in events:
        if e.name.startswith(prefix):
            continue
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.device_time_total
        else:
            us = e.self_cpu_time_total
        if us <= 0:
            continue
        i = bisect.bisect_left(starts, e.time_range.end)
        if i == len(marks):
            continue
        entry = out.setdefault(marks[i][1], {}).setdefault(e.name[:100], [0.0, 0])
        entry[0] += us / 1e3
        entry[1] += 1
    return {
        layer: sorted(([k, ms, n] for k, (ms, n) in kernels.items()), key=lambda x: -x[1])
        for layer, kernels in out.items()
    }


def choice_summary(choice: dict, top: int = 6) -> dict:
    """An INT8/FP8 build's per-layer precision choice in brief: how many layers were timed both
    ways and kept in each, the summed milliseconds each way, and the layers where the quantized
    form lost by most (quantized ms with its own QuantizeLinear's, float ms, the quantized
    form's tactic); every layer's under "per_layer"."""
    worst = sorted(choice.items(), key=lambda kv: kv[1]["float_ms"] - kv[1]["quantized_ms"])
    return {
        "layers": len(choice),
        "kept_float": sum(c["kept"] == "float" for c in choice.values()),
        "quantized_ms": sum(c["quantized_ms"] for c in choice.values()),
        "quantize_ms": sum(c["quantize_ms"] for c in choice.values()),
        "float_ms": sum(c["float_ms"] for c in choice.values()),
        "worst": [
            [name, c["quantized_ms"], c["quantize_ms"], c["float_ms"], c.get("tactic")]
            for name, c in worst[:top]
        ],
        "per_layer": {
            name: [c["quantized_ms"], c["quantize_ms"], c["float_ms"], c.get("tactic")]
            for name, c in choice.items()
        },
    }


def tactic_summary(layers: list) -> dict:
    """Per op type: how many layers took each tactic, each candidate's median time over the
    layers the autotuner timed it on ("timed_ms", milliseconds per call: by how much the
    others lost), and a few reasons candidates were rejected or the default was kept (what to
    look at when a precision is slower than hoped)."""
    out: dict = {}
    times: dict = {}
    for layer in layers:
        op = layer.get("op", "?")
        entry = out.setdefault(op, {"chosen": {}, "why": []})
        tactic = layer.get("tactic", "default")
        entry["chosen"][tactic] = entry["chosen"].get(tactic, 0) + 1
        for name, ms in (layer.get("timings_ms") or {}).items():
            times.setdefault(op, {}).setdefault(name, []).append(float(ms))
        reasons = [layer["fallback"]] if layer.get("fallback") else []
        reasons += [f"{k}: {v}" for k, v in (layer.get("rejected") or {}).items()]
        for r in reasons:
            if len(entry["why"]) < 6 and r[:200] not in entry["why"]:
                entry["why"].append(r[:200])
    for op, by_name in times.items():
        out[op]["timed_ms"] = {
            name: round(statistics.median(ms), 5) for name, ms in sorted(by_name.items())
        }
    return out


def tensorkiln_torch_peer(model16, args: list, want: list, large: bool, cache: Path) -> dict:
    """tensorkiln.torch.compile of the fp16 module itself (no ONNX file): a dynamic batch axis
    (min 1, max this batch) at the large batch, as the ONNX path's engine has; run on the same
    device tensors, checked, timed. The issue's target: within 5% of the ONNX path."""
    import tensorkiln.torch as tkt

    batch = args[0].shape[0]
    dims = None
    if large:
        axis = torch.export.Dim("batch", min=1, max=batch)
        dims = tuple({0: axis} for _ in args)
    config = BuilderConfig()
    config.timing_cache = str(cache)
    t0 = time.perf_counter()
    fast = tkt.compile(
        model16, tuple(args), dynamic_shapes=dims, precision="fp16", config=config,
        backend="cuda", require_full_compilation=True,  # (on CPU tensors: its kernels there)
    )  # fmt: skip
    cell = {"build_s": time.perf_counter() - t0, "layers": fast.engine.num_layers}
    KEEP.append(fast)
    with torch.inference_mode():
        got = outputs(fast(*args))
    S.sync()
    cell["err"] = common.norm_rel_torch(got, want)
    del got
    run = lambda: fast(*args)  # noqa: E731
    cell["value"] = timed(run, batch) if large else latency_ms(run)
    if S.kernels:
        cell["kernels"] = kernel_profile(run, top=S.kernels)
    return cell


def torch_peer(peer: str, model16, args: list, want: list, large: bool) -> dict:
    """Eager fp16 or one torch.compile mode: compile (first call), check, time."""
    if peer != "eager" and S.device != "cuda":
        return {"skipped": "GPU only (C++ compiles take minutes on the CPU)"}
    fn = model16
    if peer != "eager":
        torch._dynamo.reset()  # a fresh compile for this mode and batch alone
        fn = torch.compile(model16, mode=MODES[peer])
    t0 = time.perf_counter()
    got = outputs(fn(*args))
    S.sync()
    cell = {"err": common.norm_rel_torch(got, want)}
    if peer != "eager":
        cell["compile_s"] = time.perf_counter() - t0
    del got
    batch = args[0].shape[0]
    cell["value"] = timed(lambda: fn(*args), batch) if large else latency_ms(lambda: fn(*args))
    if S.kernels:
        cell["kernels"] = kernel_profile(lambda: fn(*args), top=S.kernels)
    return cell


def failed(exc: BaseException) -> dict:
    traceback.print_exc(file=sys.stderr)
    lines = str(exc).strip().splitlines() or [""]
    return {"failed": f"{type(exc).__name__}: {lines[0][:160]}"}


# ---------------------------------------------------------------- one model


def measure(
    name: str, case: tuple, model16, peers: list, env: dict, cache: Path, save=None
) -> dict:
    batch, path, dev, want, flops = case
    large = batch > 1  # throughput; batch 1: latency
    row: dict = {"model": name, "batch": batch, "large": large, "flops": flops, "peers": {}}
    row["image"] = SPECS[name].image
    row["export"] = "dynamic batch" if path.stem == "dynamic" else "static"
    cl = torch.channels_last if SPECS[name].channels_last else torch.contiguous_format
    args = [
        x.half().contiguous(memory_format=cl) if x.is_floating_point() else x for x in dev.values()
    ]
    with torch.inference_mode():
        row["eager_fp16_err"] = common.norm_rel_torch(outputs(model16(*args)), want)
    S.timers = {}
    for peer in peers:
        common.log(f"{name} batch {batch}: {peer}")
        S.peer = peer
        try:
            if peer == "tensorkiln-torch":  # the same engine, built from the module itself
                cell = tensorkiln_torch_peer(model16, args, want, large, cache)
            elif peer == "tensorkiln-packed" and SPECS[name].image:
                cell = {"skipped": "no attention mask"}
            elif peer == "tensorkiln-packed":
                cell = tensorkiln_peer(path, dev, want, large, cache, S.precision, packed=True)
            elif peer.startswith("tensorkiln"):  # (as `tensorkiln run` runs it)
                # tensorkiln-int8 / -fp8: that precision beside the fp16 engine, same inputs
                precision = peer.partition("-")[2] or S.precision
                cell = tensorkiln_peer(path, dev, want, large, cache, precision)
            else:
                with torch.inference_mode():
                    cell = torch_peer(peer, model16, args, want, large)
        except Exception as exc:  # reported in its cell; the run goes on
            cell = failed(exc)
        row["peers"][peer] = cell
        if "value" not in cell:
            S.timers.pop(peer, None)
        common.log(f"{name} batch {batch}: {peer} {_brief(cell, large)}")
        if save is not None:  # (what a call cut short by its time limit still keeps)
            save(table.derive(row, env["gemm_peak"]["flops"]))
    if large and S.rounds > 1:
        rounds(row)
    S.timers = {}
    torch._dynamo.reset()
    return table.derive(row, env["gemm_peak"]["flops"])


def _brief(cell: dict, large: bool) -> str:
    if "value" not in cell:
        return cell.get("failed") or cell.get("skipped", "")
    unit = "/s" if large else " ms"
    return f"{cell['value']:.4g}{unit}, rel L2 error {cell['err']:.2e}"


def run_batches(name: str, choice: str) -> list[int]:
    spec = SPECS[name]
    large = 4 if S.tiny else spec.large
    batches = {"large": [large], "1": [1], "both": [large, 1]}[choice]
    return batches if spec.batch1 else [b for b in batches if b > 1]  # (BERT-large: large only)


def run_model(name: str, args, env: dict, tmp: Path) -> dict:
    """Export once, take the fp32 references at every batch, then measure each batch; the
    model's file in --out is rewritten after each batch."""
    result: dict = {"environment": env, "model": name, "rows": []}
    model = common.make_model(name, S.tiny)
    batches = run_batches(name, args.batch)
    if not batches:
        common.log(f"{name}: not measured at batch 1; skipped")
        return result
    if args.static_export:  # one model per batch, without a dynamic axis
        paths = [
            common.export_dynamic(
                model, feeds_for(name, b, b), tmp / name / f"batch{b}.onnx", dynamic=False
            )
            for b in batches
        ]
    else:  # one model, a dynamic batch axis
        example = feeds_for(name, min(2, batches[0]), seed=0)
        paths = [common.export_dynamic(model, example, tmp / name / "dynamic.onnx")] * len(batches)
    common.log(f"{name}: exported")
    model = model.to(S.device)
    cases = []
    for batch, path in zip(batches, paths):
        dev = {
            k: torch.from_numpy(v).to(S.device) for k, v in feeds_for(name, batch, batch).items()
        }
        cases.append((batch, path, dev, *reference(model, dev)))
    model16 = model.half()
    if SPECS[name].channels_last:
        model16 = model16.to(memory_format=torch.channels_last)
    file = Path(args.out) / f"{name}.json"
    cache = Path(args.timing_cache) if args.timing_cache else tmp / "tc"
    for case in cases:
        done = list(result["rows"])

        def save(row: dict, done: list = done) -> None:
            write_json(file, with_earlier(file, {**result, "rows": [*done, row]}))

        result["rows"].append(measure(name, case, model16, args.peers, env, cache, save))
        write_json(file, with_earlier(file, result))
    del model, model16, cases
    return result


def with_earlier(file: Path, result: dict) -> dict:
    """``result`` with what an earlier call wrote to ``file`` for this model and was not measured
    now: rows at other batches, and the cells of peers not run this time (same seeds, so the same
    inputs and references)."""
    try:
        earlier = json.loads(file.read_text()).get("rows") or []
    except (OSError, ValueError, AttributeError):
        return result
    rows = {r["batch"]: r for r in earlier if isinstance(r, dict) and "batch" in r}
    for row in result["rows"]:
        old = rows.pop(row["batch"], None)
        if old is not None:
            for peer, cell in old.get("peers", {}).items():
                row["peers"].setdefault(peer, cell)
            table.derive(row, result["environment"]["gemm_peak"]["flops"])
    merged = dict(result)
    merged["rows"] = sorted([*result["rows"], *rows.values()], key=lambda r: -r["batch"])
    return merged


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def free() -> None:
    gc.collect()
    if S.device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(SPECS))
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--batch", choices=("large", "1", "both"), default="both")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small models (a smoke test)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-results")
    ap.add_argument("--inductor-cache", default="/tmp/tensorkiln-bench-inductor")
    ap.add_argument(
        "--timing-cache",
        metavar="FILE",
        help="tensorkiln's builds read and extend this timing cache (default: a new one in a "
        "temporary folder), so that a later call's builds time only what this one did not",
    )
    ap.add_argument(
        "--static-export",
        action="store_true",
        help="export one model per batch, without the dynamic batch axis",
    )
    ap.add_argument("--merge", metavar="DIR", help="only combine DIR/<model>.json into a table")
    ap.add_argument(
        "--tk-precision",
        choices=("fp16", "int8", "fp8"),
        default="fp16",
        help="tensorkiln's engines: fp16, or INT8/FP8 convolutions and GEMMs (the rest fp16), "
        "calibrated on the run's inputs",
    )
    ap.add_argument(
        "--quantize-all",
        action="store_true",
        help="INT8/FP8 engines quantize every layer they can (no per-layer precision choice); "
        "each quantized layer's timed candidates go into the JSON",
    )
    ap.add_argument(
        "--tactic-sources",
        metavar="LIST",
        help="tensorkiln's builds try only these tactic sources (tensorkiln build's "
        "--tactic-sources; default: all)",
    )
    ap.add_argument(
        "--tactic-exclude",
        metavar="LIST",
        help="tactics tensorkiln's builds never try, names or shell-style patterns "
        "(tensorkiln build's --tactic-exclude)",
    )
    ap.add_argument(
        "--tactic-timeout",
        type=float,
        metavar="SECONDS",
        help="a tactic whose check and timing take longer ends the run, naming it, the timing "
        "cache saved (tensorkiln build's --tactic-timeout; default: no limit)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        metavar="N",
        help="after timing, run each tensorkiln engine layer by layer (CUDA events) and keep "
        "its N slowest layers, with op, tactic and precision, in the JSON and results.md",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="time each peer of a throughput row N times, in turns, and report the median",
    )
    ap.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile each peer's kernels (count and GPU time per call, the top N "
        "by time) into the JSON and a section of results.md",
    )
    args = ap.parse_args(argv)
    for what, known in (("models", SPECS), ("peers", PEERS)):
        items = [x.strip() for x in getattr(args, what).split(",") if x.strip()]
        unknown = [x for x in items if x not in known]
        if unknown or not items:
            ap.error(
                f"--{what}: unknown {', '.join(unknown) or '(none given)'}; "
                f"choose from {', '.join(known)}"
            )
        setattr(args, what, items)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return print_merged(Path(args.merge))
    S.device, S.tiny, S.kernels = args.device, args.tiny, max(args.kernels, 0)
    S.layers = max(args.layers, 0)
    S.precision = args.tk_precision
    S.quantize_all = args.quantize_all
    if args.tactic_sources is not None:
        S.tactic_sources = {x.strip() for x in args.tactic_sources.split(",") if x.strip()}
    S.tactic_exclude = tuple(x.strip() for x in (args.tactic_exclude or "").split(",") if x.strip())
    S.tactic_timeout = args.tactic_timeout
    S.rounds = max(args.rounds, 1)
    if S.tiny:
        S.loops, S.iters, S.warmup, S.latency_runs = 3, 2, 1, 5
    if S.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda, but torch sees no GPU (use --device cpu --tiny)", file=sys.stderr
        )
        return 2
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", args.inductor_cache)
    env = common.environment(S.device)
    env["gemm_peak"] = gemm_peak()
    env["timing"] = {
        "loops": S.loops,
        "iters": S.iters,
        "latency_runs": S.latency_runs,
        "rounds": S.rounds,
        "clock": "CUDA events" if S.device == "cuda" else "perf_counter",
    }
    common.log(json.dumps(env))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            common.log(f"{name}: start")
            try:
                run_model(name, args, env, Path(tmp))
            except Exception as exc:  # report (keeping the rows measured) and go on
                file = out / f"{name}.json"
                empty = {"environment": env, "model": name, "rows": []}
                write_json(file, {**with_earlier(file, empty), **failed(exc)})
            free()
    return print_merged(out)


def print_merged(folder: Path) -> int:
    if not folder.is_dir():
        print(f"error: '{folder}' is not a folder", file=sys.stderr)
        return 2
    try:
        results = table.merge(folder, list(SPECS))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lines = table.markdown(results)
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    write_json(folder / "results.json", results)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
