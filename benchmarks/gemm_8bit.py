"""Where an 8-bit GEMM's time goes, on BERT-base's four GEMM shapes at batch 64 x 128 tokens:
the Triton 8-bit GEMM (the `triton_qgemm_<tile>` tactics' kernel) for each tiling, plain (16-bit
output with the bias), with the activation, and with the activation and a quantized output,
against cuBLAS fp16 (`torch.nn.functional.linear`), `torch._int_mm`, `torch._scaled_mm` and
cuBLASLt's FP8 GEMM called directly with its epilogue (bias, activation, E4M3 output).
``--shapes resnet``: ResNet-50's 1x1 convolutions at batch 256 instead (channels-last GEMMs).

    python benchmarks/gemm_8bit.py [--reps 50] [--kinds int8,fp8] [--shapes bert|resnet]
        [--no-triton] [--tiny --device cpu]

Every Triton result is first checked against the same product in float64 from the same 8-bit
operands (16-bit outputs to 2e-3 relative L2 for INT8, 1e-2 for FP8; 8-bit outputs to one
quantization step of the output's range); a tiling that disagrees is reported, not timed. Times: the median of ``--reps``
calls, each between CUDA events. ``--tiny --device cpu`` runs small shapes through Triton's
interpreter (the check only: times there mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

SHAPES = (  # (M, N, K, activation): BERT-base's QKV, attention output, MLP GEMMs at 64 x 128
    (8192, 2304, 768, ""),
    (8192, 768, 768, ""),
    (8192, 3072, 768, "Gelu"),
    (8192, 768, 3072, ""),
)
RESNET_SHAPES = (  # ResNet-50's 1x1 convolutions at batch 256 as GEMMs of the channels-last view
    (802816, 64, 64, "Relu"), (802816, 256, 64, ""), (802816, 64, 256, "Relu"),
    (200704, 128, 512, "Relu"), (200704, 512, 128, ""), (50176, 256, 1024, "Relu"),
    (50176, 1024, 256, ""), (12544, 512, 2048, "Relu"), (12544, 2048, 512, ""),
)  # fmt: skip
TINY_SHAPES = ((64, 64, 128, ""), (64, 128, 128, "Gelu"))
TILES = (  # (block_m, block_n, block_k, warps, stages)
    (128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (64, 128, 128, 4, 4), (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 4), (128, 128, 128, 4, 4), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3),
    (128, 256, 128, 8, 4), (128, 128, 256, 8, 3), (64, 256, 128, 4, 4), (128, 64, 128, 4, 4),
)  # fmt: skip
TINY_TILES = ((32, 32, 32, 4, 2), (64, 64, 64, 4, 2))


def _bench(torch, fn, reps: int, device: str) -> float:
    for _ in range(3):
        fn()
    if device != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rel(got, want) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--kinds", default="int8,fp8")
    ap.add_argument("--tiny", action="store_true", help="small shapes and tiles (a smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", choices=["bert", "resnet"], default="bert")
    ap.add_argument("--no-triton", action="store_true", help="the library peers only")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from tensorkiln.kernels.triton import gemm
    from tensorkiln.kernels.triton.gemm import Epilogue, TileConfig

    dev = args.device
    gen = torch.Generator(device="cpu").manual_seed(int(time.time()))
    tiles = [TileConfig(*t) for t in (TINY_TILES if args.tiny else TILES)]
    eight = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
    shapes = TINY_SHAPES if args.tiny else (RESNET_SHAPES if args.shapes == "resnet" else SHAPES)
    for m, n, k, act in shapes:
        flops = 2 * m * n * k
        a16 = torch.randn(m, k, generator=gen).to(dev, torch.float16)
        w16 = (torch.randn(n, k, generator=gen) * 0.05).to(dev, torch.float16)
        bias = torch.randn(n, generator=gen).to(dev, torch.float16)
        c = bias.reshape(1, -1).expand(m, n)
        print(f"== M {m} N {n} K {k} {act or 'no activation'}")
        if dev == "cuda":
            fp16 = partial(torch.nn.functional.linear, a16, w16, bias)
            t = _bench(torch, fp16, args.reps, dev)
            print(f"   cuBLAS fp16 linear: {t:.4f} ms ({flops / t / 1e9:.0f} TFLOP/s)")
        for kind in args.kinds.split(","):
            if kind == "int8":
                a8 = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8).to(dev)
                w8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(dev)
                xs = torch.tensor([0.02], device=dev)
                peer = ("torch._int_mm", lambda a8=a8, w8=w8: torch._int_mm(a8, w8.t()))
            else:
                a8 = (a16 * 8).to(torch.float8_e4m3fn)
                w8 = (w16 * 64).to(torch.float8_e4m3fn)
                xs = torch.tensor([1 / 8], device=dev)
                one = torch.ones((), device=dev)
                peer = (
                    "torch._scaled_mm (16-bit out)",
                    lambda a8=a8, w8=w8, one=one: torch._scaled_mm(
                        a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.float16
                    ),
                )
            ws = (torch.rand(n, generator=gen) * 0.02 + 0.01).to(dev)
            if kind == "fp8":
                ws = torch.full((n,), 1 / 64, device=dev)
            exact = (a8.double() @ w8.double().t()) * xs.double() * ws.double() + bias.double()
            if dev == "cuda":
                t = _bench(torch, peer[1], args.reps, dev)
                print(f"   {peer[0]}: {t:.4f} ms ({flops / t / 1e9:.0f} TOP/s, sums only)")
            if dev == "cuda" and kind == "fp8":
                _cublaslt_fp8(torch, args, a8, w8, xs, ws[:1], bias, act, exact, flops)
            for cfg in tiles if not args.no_triton else ():
                if cfg.smem_bytes(1) > gemm.SMEM_LIMIT:
                    continue
                row = []
                for mode in ("plain", "act", "act+q"):
                    if mode == "act" and not act:
                        continue
                    ep = Epilogue.of(act if mode != "plain" else "")
                    want = _activate(torch, act, exact) if mode != "plain" else exact
                    y_scale = None
                    out_t = torch.float16
                    if mode == "act+q":
                        out_t = eight[kind]
                        top = 127.0 if kind == "int8" else 448.0
                        y_scale = torch.tensor([float(want.abs().max()) / top], device=dev)
                    y = torch.empty((m, n), device=dev, dtype=out_t)

                    def run(y=y, ep=ep, y_scale=y_scale, a8=a8, w8=w8, ws=ws, xs=xs, cfg=cfg, c=c):
                        gemm.launch(
                            a8.unsqueeze(0), w8.t().unsqueeze(0), y.unsqueeze(0), c, None,
                            alpha=1.0, beta=1.0,
                            epilogue=ep, residual_after=False, config=cfg, scale=(xs, ws),
                            y_scale=y_scale,
                        )  # fmt: skip

                    run()
                    err, bound = _error(kind, y, y_scale, want)
                    if not err <= bound:
                        row.append(f"WRONG ({err:.2e} > {bound})")
                        continue
                    row.append(f"{_bench(torch, run, args.reps, dev):.4f}")
                modes = "plain / act / act+q" if act else "plain / q"
                print(f"   triton {kind} {cfg.name} ({modes}): {' / '.join(row)} ms")


def _error(kind: str, y, y_scale, want) -> tuple[float, float]:
    """(error, bound) of an output ``y`` against the float64 ``want``: a 16-bit output in
    relative L2 (int8 sums are exact, so the float32 scaling and 16-bit output remain: 2e-3;
    Hopper adds E4M3 products with fewer bits than float32: 1e-2); an 8-bit one (``y_scale``)
    in steps of the output's range (1 for int8, 32 at E4M3's largest value), at most one."""
    if y_scale is None:
        return _rel(y.double(), want), (2e-3 if kind == "int8" else 1e-2)
    step = float(y_scale) * (1.0 if kind == "int8" else 32.0)
    return float((y.double() * float(y_scale) - want).abs().max()) / step, 1.0


def _activate(torch, act: str, v, approximate: str = "none"):
    if act == "Gelu":
        return torch.nn.functional.gelu(v, approximate=approximate)
    return torch.relu(v) if act == "Relu" else v


def _cublaslt_fp8(torch, args, a8, w8, xs, ws, bias, act, exact, flops) -> None:
    """cuBLASLt's FP8 GEMM in one call (kernels/cuda/cublaslt.py's fp8_matmul; per-tensor
    scales): the bias and the activation in its epilogue, a 16-bit or an E4M3 output, with
    and without fast accumulation; each checked as the Triton rows are first."""
    from tensorkiln.kernels.cuda.cublaslt import fp8_matmul

    activation = {"Gelu": "GeluTanh"}.get(act, act)
    want = _activate(torch, act, exact, approximate="tanh")  # (cuBLASLt's GELU: the tanh form)
    for out in ("fp16", "e4m3"):
        for fast in (False, True):
            y_scale = None
            if out == "e4m3":
                y_scale = torch.tensor([float(want.abs().max()) / 448.0], device=a8.device)

            def call(y_scale=y_scale, out=out, fast=fast):
                return fp8_matmul(
                    a8, w8, xs, ws, bias=bias, activation=activation,
                    out_dtype=torch.float16 if out == "fp16" else torch.float8_e4m3fn,
                    y_scale=y_scale, fast_accum=fast,
                )  # fmt: skip

            tag = f"cuBLASLt FP8 ({act or 'bias'} in the epilogue, {out} out{', fast' * fast})"
            y = call()
            if y is None:
                print(f"   {tag}: not supported")
                continue
            err, bound = _error("fp8", y, y_scale, want)
            if not err <= bound:
                print(f"   {tag}: WRONG ({err:.2e} > {bound})")
                continue
            t = _bench(torch, call, args.reps, "cuda")
            print(f"   {tag}: {t:.4f} ms ({flops / t / 1e9:.0f} TOP/s)")


if __name__ == "__main__":
    main()
