"""Padding removal on its own: one masked encoder built with and without --remove-padding, same
inputs, same process; outputs checked against PyTorch fp32 at the kept positions first.

    python benchmarks/remove_padding.py                       # BERT-base, batch 8, s128, cpu
    python benchmarks/remove_padding.py --backend cuda --batch 64 --fp16
    python benchmarks/remove_padding.py --tiny --backend reference   (a smoke run)

The inputs mask the last ``--pad`` of every sequence (1/8 by default, as gpu_models.py's BERT
rows). Prints one line per engine (median ms per batch over ``--runs`` calls) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import export_dynamic, make_model, padded_token_feeds  # noqa: E402

from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402


def measure(path: Path, feeds: dict, want: np.ndarray, args, packed: bool) -> dict:
    config = BuilderConfig()
    config.remove_padding = packed
    if args.fp16:
        config.set_flag("fp16")
    t0 = time.perf_counter()
    builder = Builder(args.backend)
    engine = builder.build(path, config, progress=False)
    built = time.perf_counter() - t0
    if packed and not builder.last_report.passes.get("remove_padding"):
        raise SystemExit(f"not packed: {builder.last_report.notes}")
    ctx = engine.create_execution_context(use_cuda_graph=args.backend == "cuda")
    name = engine.outputs[0].name
    keep = feeds["attention_mask"] != 0
    got = np.asarray(ctx.infer(feeds)[name], np.float64)
    err = float(np.linalg.norm(got[keep] - want[keep]) / np.linalg.norm(want[keep]))
    for _ in range(args.warmup):
        ctx.infer(feeds)
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        ctx.infer(feeds)
        times.append(time.perf_counter() - t0)
    return {"ms": 1e3 * statistics.median(times), "build_s": built, "err": err}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["bert", "bert_large"], default="bert")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--pad", type=float, default=1 / 8, help="the masked share of every sequence")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke runs)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    seq = 16 if args.tiny else args.seq
    pad = round(seq * args.pad)
    model = make_model(args.model, args.tiny)
    vocab = model.m.config.vocab_size
    feeds = padded_token_feeds(args.batch, seq, vocab, pad, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = export_dynamic(
            model, padded_token_feeds(2, seq, vocab, pad, seed=0), Path(tmp) / "model.onnx"
        )
        with torch.no_grad():
            out = model(*(torch.from_numpy(v) for v in feeds.values()))
        want = (out[0] if isinstance(out, tuple | list) else out).double().numpy()
        rows = {packed: measure(path, feeds, want, args, packed) for packed in (False, True)}
    for packed, r in rows.items():
        print(
            f"{'packed' if packed else 'padded'}: {r['ms']:.2f} ms per batch of {args.batch} "
            f"(build {r['build_s']:.1f} s; rel. L2 error at kept positions {r['err']:.1e})"
        )
    print(f"padding removal: {rows[False]['ms'] / rows[True]['ms']:.2f}x")
    bound = 1e-2 if args.fp16 else 1e-4
    return 0 if all(r["err"] < bound for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
