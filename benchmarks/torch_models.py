"""Coverage of tensorkiln.torch.compile: models nobody here wrote, straight from PyTorch.

    python benchmarks/torch_models.py [--models bert,gpt2,...] [--backend cpu|cuda|reference]
                                      [--precision fp32|fp16] [--device cpu|cuda] [--full]
                                      [--no-tuning] [--out DIR]

For each model (random weights; transformers' built from small configs of their real
architectures unless --full, torchvision's and timm's as published), in one process:
tensorkiln.torch.compile on the example inputs, then the compiled module and eager PyTorch on
fresh inputs of the same shapes. A row says how the module was built (one engine, or partly in
PyTorch and why, or the error), the engine's layer count, the build seconds, and the relative L2
error of every output against eager fp32 (torchvision's detections compared as sets: see
_match_detections). Models whose library is not importable here are
listed as such (torchvision and timm import on the GPU machine, not beside the CPU build of
torch here). Writes results.md and results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tensorkiln.torch as tkt  # noqa: E402
from tensorkiln.builder import BuilderConfig  # noqa: E402

S = 16  # tokens per sequence
B = 2  # batch


def _ids(vocab: int, s: int = S) -> dict:
    mask = torch.ones(B, s, dtype=torch.int64)
    mask[-1, s // 2 :] = 0  # one padded sequence
    return {"input_ids": torch.randint(0, vocab, (B, s)), "attention_mask": mask}


def _pixels(config, default: int) -> torch.Tensor:
    """A batch of images of the size the config's model takes (``default`` where it takes any)."""
    size = getattr(config, "image_size", default)
    h, w = size if isinstance(size, list | tuple) else (size, size)
    return torch.randn(B, 3, h, w)


def _hf(name: str, full: bool) -> Callable[[], tuple]:
    """A transformers model of a small config (the architecture's own code) and its inputs."""

    def make() -> tuple:
        import transformers as tf

        small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128)  # fmt: skip
        text = dict(small, vocab_size=1000, max_position_embeddings=128)
        vision = dict(small, image_size=32, patch_size=8)
        conv = dict(num_channels=3, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
        specs = {
            "bert": (tf.BertConfig, tf.BertModel, text, lambda c: _ids(c.vocab_size)),
            "distilbert": (tf.DistilBertConfig, tf.DistilBertModel,
                           dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=1000),
                           lambda c: _ids(c.vocab_size)),
            "roberta": (tf.RobertaConfig, tf.RobertaModel, text, lambda c: _ids(c.vocab_size)),
            "electra": (tf.ElectraConfig, tf.ElectraModel, dict(text, embedding_size=32),
                        lambda c: _ids(c.vocab_size)),
            "gpt2": (tf.GPT2Config, tf.GPT2Model,
                     dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, use_cache=False),
                     lambda c: _ids(c.vocab_size)),
            "llama": (tf.LlamaConfig, tf.LlamaModel,
                      dict(text, num_key_value_heads=2, use_cache=False),
                      lambda c: _ids(c.vocab_size)),
            "t5": (tf.T5Config, tf.T5Model,
                   dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                        vocab_size=1000, use_cache=False),
                   lambda c: {**_ids(c.vocab_size),
                              "decoder_input_ids": torch.randint(0, c.vocab_size, (B, 8))}),
            "bart": (tf.BartConfig, tf.BartModel,
                     dict(d_model=64, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4,
                          encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000,
                          max_position_embeddings=128, use_cache=False),
                     lambda c: {**_ids(c.vocab_size),
                                "decoder_input_ids": torch.randint(0, c.vocab_size, (B, 8))}),
            "whisper": (tf.WhisperConfig, tf.WhisperModel,
                        dict(d_model=64, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4,
                             encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
                             max_source_positions=32, vocab_size=1000, use_cache=False,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             decoder_start_token_id=1),
                        lambda c: {"input_features": torch.randn(
                                       B, c.num_mel_bins, 2 * c.max_source_positions),
                                   "decoder_input_ids": torch.randint(0, c.vocab_size, (B, 8))}),
            "wav2vec2": (tf.Wav2Vec2Config, tf.Wav2Vec2Model,
                         dict(small, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                              num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4),
                         lambda c: {"input_values": torch.randn(B, 1600)}),
            "vit": (tf.ViTConfig, tf.ViTModel, vision,
                    lambda c: {"pixel_values": _pixels(c, 32)}),
            "deit": (tf.DeiTConfig, tf.DeiTModel, vision,
                     lambda c: {"pixel_values": _pixels(c, 32)}),
            "dinov2": (tf.Dinov2Config, tf.Dinov2Model, vision,
                       lambda c: {"pixel_values": _pixels(c, 32)}),
            "clip_vision": (tf.CLIPVisionConfig, tf.CLIPVisionModel, vision,
                            lambda c: {"pixel_values": _pixels(c, 32)}),
            "swin": (tf.SwinConfig, tf.SwinModel,
                     dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                          num_heads=[2, 4], window_size=4),
                     lambda c: {"pixel_values": _pixels(c, 32)}),
            "convnext": (tf.ConvNextConfig, tf.ConvNextModel, conv,
                         lambda c: {"pixel_values": torch.randn(B, 3, 64, 64)}),
            "resnet_hf": (tf.ResNetConfig, tf.ResNetModel,
                          dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                               depths=[1, 1, 1, 1]),
                          lambda c: {"pixel_values": torch.randn(B, 3, 64, 64)}),
            "segformer": (tf.SegformerConfig, tf.SegformerForSemanticSegmentation,
                          dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                               num_attention_heads=[1, 2, 4, 8], decoder_hidden_size=64,
                               num_labels=5),
                          lambda c: {"pixel_values": torch.randn(B, 3, 64, 64)}),
            "yolos": (tf.YolosConfig, tf.YolosForObjectDetection,
                      dict(small, image_size=[32, 32], patch_size=8, num_detection_tokens=5,
                           num_labels=3),
                      lambda c: {"pixel_values": _pixels(c, 32)}),
        }  # fmt: skip
        config_cls, model_cls, kwargs, inputs = specs[name]
        config = config_cls() if full else config_cls(**kwargs)
        if hasattr(config, "use_cache"):  # (a KV cache is no tensor: torch.export refuses it)
            config.use_cache = False
        model = model_cls(config).eval()
        return model, (), inputs(config)

    return make


def _torchvision(name: str) -> Callable[[], tuple]:
    def make() -> tuple:
        import torchvision

        heads = name.startswith(("fcn", "deeplab", "lraspp", "fasterrcnn", "retinanet", "ssd"))
        # (random weights throughout: a head's backbone would otherwise download its own)
        extra = {"weights_backbone": None} if heads else {}
        model = torchvision.models.get_model(name, weights=None, **extra).eval()
        size = 224 if "raft" not in name else 128
        if name.startswith(("fcn", "deeplab", "lraspp")):
            size = 128
        return model, (torch.randn(B, 3, size, size),), {}

    return make


def _timm(name: str) -> Callable[[], tuple]:
    def make() -> tuple:
        import timm

        model = timm.create_model(name, pretrained=False).eval()
        size = model.default_cfg.get("input_size", (3, 224, 224))
        return model, (torch.randn(B, *size),), {}

    return make


def models(full: bool) -> dict[str, tuple[str, Callable]]:
    """name -> (library, maker)."""
    out = {}
    for n in ("bert", "distilbert", "roberta", "electra", "gpt2", "llama", "t5", "bart",
              "whisper", "wav2vec2", "vit", "deit", "dinov2", "clip_vision", "swin", "convnext",
              "resnet_hf", "segformer", "yolos"):  # fmt: skip
        out[n] = ("transformers", _hf(n, full))
    for n in ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_400mf",
              "convnext_tiny", "vit_b_16", "swin_t", "fcn_resnet50", "deeplabv3_resnet50",
              "lraspp_mobilenet_v3_large", "fasterrcnn_resnet50_fpn", "retinanet_resnet50_fpn",
              "ssdlite320_mobilenet_v3_large"):  # fmt: skip
        out[f"tv_{n}"] = ("torchvision", _torchvision(n))
    for n in ("resnet50d", "efficientnet_b0", "convnext_tiny", "vit_small_patch16_224",
              "deit_small_patch16_224", "mobilevitv2_050"):  # fmt: skip
        out[f"timm_{n}"] = ("timm", _timm(n))
    return out


def _flat(out) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _rel(got, want) -> float:
    errs = []
    for g, w in zip(_flat(got), _flat(want)):
        g, w = g.detach().float().cpu(), w.detach().float().cpu()
        if g.shape != w.shape:
            return float("inf")
        if w.dtype == torch.bool or not w.is_floating_point():
            errs.append(0.0 if torch.equal(g, w) else float("inf"))
            continue
        errs.append(float((g - w).norm() / max(float(w.norm()), 1e-12)))
    return max(errs) if errs else float("inf")


DETECTION_KEYS = {"boxes", "scores", "labels"}


def _is_detections(out) -> bool:
    """torchvision's detection output: a list of dicts of boxes, scores and labels per image."""
    return (
        isinstance(out, list | tuple)
        and len(out) > 0
        and all(isinstance(d, dict) and set(d) >= DETECTION_KEYS for d in out)
    )


def _match_detections(got, want, tol: float) -> tuple[float, float]:
    """(matched share, relative L2 of the matched boxes): detections compared as sets, not in
    order. With random weights a detector's scores crowd near 1, so detections whose scores
    differ in the seventh digit swap places between any two correct runs, and the 100th one in
    one run is the 101st in the other. A detection of ``want`` matches an unmatched one of
    ``got`` with its label, its score within 1e-4 and its box within ``tol`` (relative)."""
    matched = total = 0
    diff = norm = 0.0
    for g, w in zip(got, want):
        gb, gs, gl = (g[k].detach().double().cpu() for k in ("boxes", "scores", "labels"))
        wb, ws, wl = (w[k].detach().double().cpu() for k in ("boxes", "scores", "labels"))
        total += max(len(gb), len(wb))
        scale = float(wb.abs().max()) + 1.0 if len(wb) else 1.0
        free = torch.ones(len(gb), dtype=torch.bool)
        for j in range(len(wb)):
            close = (
                free
                & (gl == wl[j])
                & ((gs - ws[j]).abs() <= 1e-4)
                & ((gb - wb[j]).abs().amax(-1) <= tol * scale)
            )
            hits = torch.nonzero(close).flatten()
            if len(hits):
                k = int(hits[0])
                free[k] = False
                matched += 1
                diff += float(((gb[k] - wb[j]) ** 2).sum())
                norm += float((wb[j] ** 2).sum())
    share = matched / total if total else 1.0
    return share, (diff / norm) ** 0.5 if norm else 0.0


def _move(tree, device):
    return torch.utils._pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree
    )


def _fresh(tree):
    """Inputs of the same shapes and kinds, drawn again (token ids below the same bound)."""

    def draw(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn_like(t)
        if t.max() <= 1:  # masks: keep the padding pattern
            return t.clone()
        return torch.randint_like(t, 0, int(t.max()) + 1)

    return torch.utils._pytree.tree_map(draw, tree)


def run_one(name: str, library: str, make: Callable, args) -> dict:
    row = {"model": name, "library": library}
    try:
        model, inputs, kwargs = make()
    except ImportError as err:
        row.update(status="not importable here", detail=str(err).splitlines()[0][:200])
        return row
    except Exception as err:  # (a config this script got wrong: say so, go on)
        row.update(status="failed", detail=f"constructing it: {type(err).__name__}: {err}"[:300])
        return row
    torch.manual_seed(0)
    device = args.device or ("cuda" if args.backend == "cuda" else "cpu")
    model = model.to(device)
    inputs, kwargs = _move(inputs, device), _move(kwargs, device)
    half = args.precision == "fp16"
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = BuilderConfig()
            if args.no_tuning:  # (coverage only: each layer's default kernel, nothing timed)
                config.tactic_sources = set()
            compiled = tkt.compile(
                model, inputs, example_kwargs=kwargs, backend=args.backend,
                precision=args.precision, config=config,
            )  # fmt: skip
        row["build_s"] = round(time.perf_counter() - t0, 2)
        fresh_in, fresh_kw = _fresh(inputs), _fresh(kwargs)
        with torch.no_grad():
            want = model(*fresh_in, **fresh_kw)
            got = compiled(*fresh_in, **fresh_kw)
        tol = 5e-3 if half else 1e-4
        if _is_detections(want) and _is_detections(got) and len(got) == len(want):
            share, row["rel_l2"] = _match_detections(got, want, 10 * tol)
            row["matched"] = round(share, 4)
            if share < 0.95:  # (most detections must be found again, not only the top few)
                row["rel_l2"] = float("inf")
        else:
            row["rel_l2"] = _rel(got, want)
        if isinstance(compiled, tkt.CompiledModule):
            row.update(status="one engine", layers=compiled.engine.num_layers)
        else:
            report = compiled.report
            row.update(status="partly in PyTorch", detail=compiled.reason[:300])
            if report is not None:
                row["engines"] = report.engines
                row["fallback"] = dict(list(report.unsupported.items())[:5])
        row["warnings"] = len(caught)
        row["agrees"] = bool(row["rel_l2"] <= tol)
    except Exception as err:  # a row per model, whatever happens
        row.update(
            status="failed", detail=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        )
        row["build_s"] = round(time.perf_counter() - t0, 2)
        if args.verbose:
            traceback.print_exc()
    finally:
        torch._dynamo.reset()
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | library | how it runs | layers / engines | build s | rel. L2 vs eager | agrees |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        how = r["status"] + (f": {r['detail']}" if r.get("detail") else "")
        how = how.replace("|", "\\|")
        size = r.get("layers", r.get("engines", ""))
        err = f"{r['rel_l2']:.1e}" if "rel_l2" in r else ""
        if "matched" in r:
            err += f" ({100 * r['matched']:.0f}% of detections matched)"
        agrees = {True: "yes", False: "**no**"}.get(r.get("agrees"), "")
        lines.append(
            f"| {r['model']} | {r['library']} | {how} | {size} | {r.get('build_s', '')} | {err} "
            f"| {agrees} |"
        )
    counted = [r for r in rows if r["status"] != "not importable here"]
    one = sum(r["status"] == "one engine" and r.get("agrees") for r in counted)
    partial = sum(r["status"] == "partly in PyTorch" and r.get("agrees") for r in counted)
    lines.append("")
    lines.append(
        f"{len(counted)} models tried: {one} as one engine that agrees with eager, {partial} partly "
        f"in PyTorch and agreeing, {len(counted) - one - partial} failed or disagreed."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="", help="comma-separated names (default: all)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "reference"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16"])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default=None,
        help="where the model and inputs live (default: cuda for --backend cuda, else cpu; "
        "--backend cuda --device cpu runs the cuda kernels on CPU tensors)",
    )  # fmt: skip
    p.add_argument("--full", action="store_true", help="transformers' default configs")
    p.add_argument(
        "--no-tuning", action="store_true",
        help="build with each layer's default kernel and time none (a coverage run: the graph "
        "is optimized as usual, the autotuner's minutes per model are skipped)",
    )  # fmt: skip
    p.add_argument("--out", default="torch-models")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    every = models(args.full)
    wanted = [m for m in args.models.split(",") if m] or list(every)
    unknown = sorted(set(wanted) - set(every))
    if unknown:
        p.error(f"unknown models {unknown}; choose from {', '.join(every)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (args.device or ("cuda" if args.backend == "cuda" else "cpu")) == "cuda":
        # eager in strict float32 as the reference: an fp32 engine does not use TF32 either
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    env = {
        "torch": torch.__version__,
        "backend": args.backend,
        "device": args.device,
        "precision": args.precision,
        "tuning": not args.no_tuning,
        "python": sys.version.split()[0],
    }
    rows = []
    for name in wanted:
        library, make = every[name]
        row = run_one(name, library, make, args)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        # (written after every model: a run stopped by a time limit keeps what it measured)
        (out / "results.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        (out / "results.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
