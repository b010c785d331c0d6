"""Helpers shared by the GPU benchmarks (cuda_models.py, gpu_models.py): the models with random
weights, their inputs, the dynamic-batch export, engine builds, agreement metrics, environment.

Imported by the scripts after they put the repository root and src/ on sys.path.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tests.models.test_architectures import Bottleneck, _no_mha_fastpath, _randomize

import tensorkiln
from tensorkiln.builder import Builder, BuilderConfig, BuildReport, OptimizationProfile

os.environ["HF_HUB_OFFLINE"] = "1"

# 2-layer transformers of hidden size 64 (the smoke tests' configs)
TINY_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
BERT_LARGE = dict(
    hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
)
TINY_IMAGE = 32  # --tiny image side (the full models take 224)


def log(line: str) -> None:
    """A progress line on stderr, with the time of day."""
    print(f"[{datetime.datetime.now():%H:%M:%S}] {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- models


class _Bert(torch.nn.Module):
    """BertModel returning last_hidden_state as a plain tensor."""

    def __init__(self, **config) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        self.m = BertModel(BertConfig(**config))

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


class _GPT2(torch.nn.Module):
    """GPT2Model without the KV cache, returning last_hidden_state."""

    def __init__(self, **config) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        self.m = GPT2Model(GPT2Config(**config))

    def forward(self, input_ids, attention_mask):
        out = self.m(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=False
        )
        return out[0]


class _TinyViT(torch.nn.Module):
    """transformers' ViTModel at 32x32 (patch 8, 2 layers of hidden 64): --tiny's ViT, where
    torchvision may not be installed."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTModel

        config = ViTConfig(image_size=TINY_IMAGE, patch_size=8, **TINY_BERT)
        self.m = ViTModel(config, add_pooling_layer=False)

    def forward(self, x):
        return self.m(pixel_values=x, return_dict=False)[0]


def tiny_convnet() -> torch.nn.Module:
    """--tiny's stand-in for ResNet-50: a stem and two ResNet bottlenecks (one strided), pooled
    into a linear classifier, with random BatchNorm statistics."""
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        Bottleneck(16, 8, 1),
        Bottleneck(32, 16, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    _randomize(model)
    return model


def make_model(name: str, tiny: bool = False) -> torch.nn.Module:
    """The model ``name`` in eval mode, random weights drawn from seed 0, made to look trained
    (:func:`trained_looking`)."""
    return trained_looking(_initialized(name, tiny))


def trained_looking(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the parameters that libraries initialize to constants made random, as in a
    trained model: zero biases (every Linear of a fresh transformers model, the BatchNorm shifts
    of torchvision's), LayerNorm scales of one and BatchNorm statistics of the identity. Left at
    their initial values, an optimizer could drop the zero bias adds and the unit scales that
    PyTorch still computes, and the comparison would not be one a user of a trained model sees."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.normal_(0.0, 0.1, generator=gen)
                m.running_var.uniform_(0.5, 1.5, generator=gen)
            norm = isinstance(m, torch.nn.LayerNorm | torch.nn.modules.batchnorm._BatchNorm)
            if norm and m.weight is not None:
                m.weight.uniform_(0.8, 1.2, generator=gen)
            for p in m.parameters(recurse=False):
                if p.numel() > 0 and not p.any():
                    p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def _initialized(name: str, tiny: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if name in ("resnet50", "vit") and tiny:
        return (tiny_convnet() if name == "resnet50" else _TinyViT()).eval()
    if name == "resnet50":
        import torchvision  # lazy: only the GPU machine has it

        return torchvision.models.resnet50(weights=None).eval()
    if name == "vit":
        import torchvision  # lazy: only the GPU machine has it

        # (its classifier head starts at zeros: trained_looking draws it, or every engine would
        # "match" all-zero logits)
        return torchvision.models.vit_b_16(weights=None).eval()
    if name in ("bert", "bert_large"):
        return _Bert(**(TINY_BERT if tiny else BERT_LARGE if name == "bert_large" else {})).eval()
    if name == "gpt2":
        return _GPT2(**(dict(n_embd=64, n_layer=2, n_head=4) if tiny else {})).eval()
    raise SystemExit(f"unknown model '{name}'")


def image_feeds(batch: int, side: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((batch, 3, side, side)).astype(np.float32)}


def padded_token_feeds(batch: int, seq: int, vocab: int, pad: int, seed: int) -> dict:
    """Random token ids; the last ``pad`` positions of every sequence masked out (0)."""
    mask = np.ones((batch, seq), np.int64)
    if pad:
        mask[:, seq - pad :] = 0
    ids = np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask}


# ---------------------------------------------------------------- export and build


def export_dynamic(model: torch.nn.Module, feeds: dict, path: Path, dynamic: bool = True) -> Path:
    """TorchScript export (dynamo=False) at opset 17 with a dynamic batch axis on every input and
    output (``dynamic=False``: at the feeds' shapes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    args = tuple(torch.from_numpy(x) for x in feeds.values())
    with torch.no_grad():
        out = model(*args)
    n_out = len(out) if isinstance(out, tuple | list) else 1
    outputs = [f"output_{i}" for i in range(n_out)]
    with warnings.catch_warnings(), _no_mha_fastpath(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            args,
            str(path),
            input_names=list(feeds),
            output_names=outputs,
            dynamic_axes={n: {0: "batch"} for n in [*feeds, *outputs]} if dynamic else None,
            opset_version=17,
            dynamo=False,
        )
    return path


def build(
    path: Path,
    precision: str,
    cache: Path,
    device: str,
    shapes: dict[str, tuple[tuple, tuple, tuple]] | None = None,
    io_format: str | None = None,
    calibration: list[dict] | None = None,
    remove_padding: bool = False,
    quantize_all: bool = False,
    tactic_sources: set[str] | None = None,
    tactic_exclude: list[str] | tuple = (),
    tactic_timeout: float | None = None,
) -> tuple[tensorkiln.Engine, float, BuildReport]:
    """An engine of the cuda backend on ``device``; ``precision``: one or several joined by '+'
    ("int8+fp16"); ``shapes``: name -> (min, opt, max), one optimization profile; ``io_format``
    ("fp16"...): the type of every float input and output (float32 when None); ``calibration``:
    INT8/FP8 calibration feeds; ``remove_padding``: BuilderConfig.remove_padding;
    ``quantize_all``: every layer that can be quantized is (no per-layer precision choice);
    ``tactic_sources``: BuilderConfig.tactic_sources (None: all); ``tactic_exclude`` and
    ``tactic_timeout``: BuilderConfig's (tactics never tried; a tactic that does not finish
    in that many seconds ends the process, naming it).
    Returns the engine, the build's seconds and the build's report (its ``timing_cache`` hits and
    misses, an INT8/FP8 build's ``precision_choice``)."""
    config = BuilderConfig()
    for p in precision.split("+"):
        if p != "fp32":
            config.set_flag(p)
    config.calibration_data = calibration
    config.remove_padding = remove_padding
    if quantize_all:
        config.choose_precision_per_layer = False
    config.tactic_sources = tactic_sources
    config.tactic_exclude = list(tactic_exclude)
    config.tactic_timeout = tactic_timeout
    if io_format:
        config.input_io_formats = config.output_io_formats = [io_format]
    config.timing_cache = str(cache)
    if shapes:
        profile = OptimizationProfile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    b = Builder("cuda", device=device)
    t0 = time.perf_counter()
    engine = b.build(path, config, progress=False)
    return engine, time.perf_counter() - t0, b.last_report


# ---------------------------------------------------------------- agreement and environment


def norm_rel(got, want) -> float:
    """The largest relative L2 error over the outputs (numpy arrays)."""
    return max(
        float(np.linalg.norm(g.astype(np.float64) - w) / max(np.linalg.norm(w), 1e-30))
        for g, w in zip(got, want)
    )


def norm_rel_torch(got: list, want: list) -> float:
    """The largest relative L2 error over the outputs (tensors, compared in float64)."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} outputs, the reference has {len(want)}")
    errs = []
    for g, w in zip(got, want):
        g, w = g.detach().double(), w.detach().double()
        if tuple(g.shape) != tuple(w.shape):
            raise ValueError(f"output shape {list(g.shape)}, the reference's {list(w.shape)}")
        errs.append(float(torch.linalg.vector_norm(g - w) / torch.linalg.vector_norm(w)))
    return max(errs)


def steps_off(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of 8-bit outputs more than one output step from the reference's (int8: one
    code; E4M3: one step of the larger's exponent)."""
    g, w = got.float(), want.float()
    if got.dtype == torch.int8:
        return float(((g - w).abs() > 1).float().mean())
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(g.abs(), w.abs()).clamp_min(2**-6))) - 3)
    return float(((g - w).abs() > step * 1.0001).float().mean())


def graph_time_ms(fn, reps: int, calls: int = 20) -> float:
    """Milliseconds a call of ``fn``: ``calls`` calls captured in one CUDA graph, the median of
    ``reps`` replays (no launch cost: a launch through Python or ctypes costs the host about as
    long as a small kernel runs, and an engine replays its kernels from a graph). The warm-up
    calls run on a side stream, as capture wants."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def environment(device: str) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "tensorkiln": tensorkiln.__version__,
    }
    for mod in ("onnxruntime", "triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env["device"] = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)"
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    else:
        env["device"] = "cpu (torch CPU tensors; timings say nothing about a GPU)"
    return env
