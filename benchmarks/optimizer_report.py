"""What the graph optimizer does to real models: node counts, fusions, agreement and speed.

    python benchmarks/optimizer_report.py                       # full size: ResNet-50, BERT-base,
                                                                # GPT-2 small, ViT-B/16
    python benchmarks/optimizer_report.py --small --models bert  # quick

For each model and torch exporter: nodes after import, nodes in the level-3 engine, how many
attention blocks, LayerNorms, conv and GEMM epilogues and pointwise chains were fused, the largest
difference between the optimized and unoptimized outputs (relative to the output's magnitude),
and both graphs' median latency on the reference backend, measured in the same process on the
same inputs. Parameters are random but non-trivial (biases and norms are not 0 and 1), so bias and
scale fusions are exercised as they would be on trained weights.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.models import test_architectures as arch

import tensorkiln
from tensorkiln.builder import Builder, BuilderConfig

torch = arch.torch

FUSED = {
    "tensorkiln.Attention": "attention",
    "tensorkiln.LayerNorm": "layernorm",
    "tensorkiln.RMSNorm": "rmsnorm",
    "tensorkiln.ConvAct": "conv",
    "tensorkiln.GemmAct": "gemm",
    "tensorkiln.Pointwise": "pointwise",
}


def build_vit(full: bool = False):
    from transformers import ViTConfig, ViTModel

    if full:  # ViT-B/16: 224x224, patch 16, 12 layers, hidden 768
        config = ViTConfig()
    else:
        config = ViTConfig(
            image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=128,
        )  # fmt: skip
    torch.manual_seed(0)

    class Vit(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit = ViTModel(config, add_pooling_layer=False)

        def forward(self, pixel_values):
            return self.vit(pixel_values=pixel_values).last_hidden_state

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, config.image_size, config.image_size)).astype(np.float32)
    return Vit().eval(), {"pixel_values": x}


BUILDERS = {**arch.BUILDERS, "vit": build_vit}


def nontrivial_parameters(model) -> None:
    """Random biases and norm parameters: zero biases would be removed as x + 0 by clean-up."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def median_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def report(name: str, exporter: str, full: bool, runs: int, folder: Path) -> dict:
    model, feeds = BUILDERS[name](full=full)
    nontrivial_parameters(model)
    path = arch.export(model, feeds, folder / f"{name}-{exporter}", dynamo=exporter == "dynamo")
    plain = tensorkiln.Runner(path)
    builder = Builder()
    engine = builder.build(path, BuilderConfig(optimization_level=3), progress=False)
    ctx = engine.create_execution_context()
    feeds = {n: feeds[n] for n in plain.input_names}
    ref = plain.infer(feeds)
    got = ctx.infer(feeds)
    diff = max(
        float(np.abs(got[k].astype(np.float64) - ref[k]).max() / max(np.abs(ref[k]).max(), 1e-30))
        for k in ref
    )
    ops = collections.Counter(
        f"{n.domain}.{n.op}" if n.domain else n.op for n in engine.graph.nodes
    )
    fused = {label: ops.get(op, 0) for op, label in FUSED.items()}
    return {
        "model": name,
        "exporter": exporter,
        "nodes_before": len(plain.graph.nodes),
        "nodes_after": len(engine.graph.nodes),
        **fused,
        "max_rel_diff": diff,
        "plain_ms": median_ms(lambda: plain.infer(feeds), runs),
        "optimized_ms": median_ms(lambda: ctx.infer(feeds), runs),
        "optimize_s": builder.last_report.phases.get("optimize", 0.0),
        "left": ", ".join(f"{op} {n}" for op, n in ops.most_common() if op not in FUSED)[:80],
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models", nargs="+", default=["resnet50", "bert", "gpt2", "vit"], choices=BUILDERS
    )
    p.add_argument("--exporters", nargs="+", default=["torchscript", "dynamo"])
    p.add_argument("--small", action="store_true", help="small configs (quick)")
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tk-opt-") as tmp:
        for name in args.models:
            for exporter in args.exporters:
                row = report(name, exporter, not args.small, args.runs, Path(tmp))
                print(row, file=sys.stderr, flush=True)
                rows.append(row)
    print(
        "| model | exporter | nodes | engine layers | attention | LayerNorm | ConvAct | GemmAct "
        "| Pointwise | max rel diff | unoptimized ms | optimized ms | speedup | optimize s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['exporter']} | {r['nodes_before']} | {r['nodes_after']} | "
            f"{r['attention']} | {r['layernorm']} | {r['conv']} | {r['gemm']} | {r['pointwise']} | "
            f"{r['max_rel_diff']:.1e} | {r['plain_ms']:.1f} | {r['optimized_ms']:.1f} | "
            f"{r['plain_ms'] / r['optimized_ms']:.2f}x | {r['optimize_s']:.1f} |"
        )
    print("\nops left outside fusions:")
    for r in rows:
        print(f"- {r['model']} {r['exporter']}: {r['left']}")
    print(
        f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, numpy {np.__version__}, "
        f"torch {torch.__version__}, tensorkiln {tensorkiln.__version__}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
