"""ResNet-50's stem in 8 bits, tactic by tactic, as a quantized engine runs it: the 7 x 7
convolution of stride 2 over the 3-channel image (scale, bias, ReLU and the pool's 8-bit input
fused), then the 3 x 3 max pool of stride 2 over its output; then both in one kernel
(``conv_stem.conv_stem_pool``: the QConvPool layer's fused tactics), against the two apart.

    python benchmarks/qconv_stem.py [--batch 256] [--reps 20] [--precision fp8|int8|both]

The convolution's tactics are the engine's (``kernels/cuda/tactics_quant.py``): ``cudnn_fp16``
(the image widened into 4 float16 channels, cuDNN's convolution, a requantizing pass) and
``triton_qconv_stem_*`` (``kernels/triton/conv_stem.py``: the image packed into 4 channels with
its padding, one 8-bit K step per window row); the pool's are ``triton`` and ``triton_p128``
and the default kernel. The image is NCHW, as the engine hands a quantized stem its input; the
weight channels-last and marked constant, as uploaded. Each convolution's output is first
checked against ``cudnn_fp16``'s (within one output step, or 1/64 of the norm, as the tactic
tests allow; its own float16 rounding is the reference's here), each pool's against the default
kernel's (exact); times are the median of ``--reps`` replays of a CUDA graph of 20 calls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks._common import graph_time_ms, norm_rel_torch, steps_off  # noqa: E402

from tensorkiln.kernels.common.conv import conv_geometry  # noqa: E402
from tensorkiln.kernels.cuda.convert import mark_constant  # noqa: E402
from tensorkiln.kernels.registry import lookup  # noqa: E402
from tensorkiln.kernels.tactics import get_tactic  # noqa: E402
from tensorkiln.kernels.triton import conv_stem  # noqa: E402
from tensorkiln.kernels.triton.gemm import Epilogue  # noqa: E402

CONV = {"pads": [3, 3, 3, 3], "strides": [2, 2], "activation": "Relu"}
POOL = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}


def _operands(dtype: torch.dtype, batch: int, side: int, seed: int, device: str) -> tuple:
    """QConvAct's inputs for the stem: the image, X_scale, W, W_scale, bias, no residual,
    Y_scale. The scales put the sums' spread at tens of output steps (int8 codes, E4M3 units),
    the bias's at a few: a convolution that went wrong would not hide under the bias."""
    g = torch.Generator(device=device).manual_seed(seed)
    if dtype == torch.int8:
        x = torch.randint(-128, 128, (batch, 3, side, side), device=device, generator=g,
                          dtype=torch.int8)  # fmt: skip
        w = torch.randint(-128, 128, (64, 3, 7, 7), device=device, generator=g, dtype=torch.int8)
        w_scale = 1e-3 + 1e-3 * torch.rand(64, device=device, generator=g)
    else:
        x = torch.randn(batch, 3, side, side, device=device, generator=g).to(dtype)
        w = torch.randn(64, 3, 7, 7, device=device, generator=g).to(dtype)
        w_scale = 0.5 + torch.rand(64, device=device, generator=g)
    w = mark_constant(w.contiguous(memory_format=torch.channels_last))
    x_scale = torch.tensor(0.02, device=device)
    bias = 0.1 * torch.randn(64, device=device, generator=g)
    y_scale = torch.tensor(0.05, device=device)
    return x, x_scale, w, mark_constant(w_scale), mark_constant(bias), None, y_scale


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def stem_rows(
    dtype: torch.dtype, batch: int, reps: int, *, side: int = 224, device: str = "cuda",
    timer=graph_time_ms,
) -> list[str]:  # fmt: skip
    """One line a tactic: its time (``timer(fn, reps)``, ms) or why it was not timed."""
    kind = "int8" if dtype == torch.int8 else "fp8"
    args = _operands(dtype, batch, side, 7, device)
    attrs = {**CONV, "out_dtype": 3 if dtype == torch.int8 else 17}
    names = ["cudnn_fp16", *(f"triton_qconv_stem_{c.name}" for c in conv_stem.CONFIGS)]
    rows, want, best = [], None, None
    for name in names:
        fn = get_tactic("QConvAct", "tensorkiln", name).fn
        try:
            got = fn(*args, **attrs)
            _sync(device)
        except Exception as exc:  # (a tiling the compiler refuses)
            rows.append(f"{kind} conv {name}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        if want is None:
            nonzero = float((got.view(torch.uint8) != 0).float().mean())
            want, note = got, f"the reference here, {nonzero:.0%} of its outputs nonzero"
        else:
            off, rel = steps_off(got, want), norm_rel_torch([got], [want])
            note = f"{off:.3%} more than a step off, rel L2 {rel:.1e}"
            if off > 1e-3 and rel > 2**-6:
                rows.append(f"{kind} conv {name}: {note}; not timed")
                continue
        t = timer(lambda fn=fn: fn(*args, **attrs), reps)
        rows.append(f"{kind} conv {name}: {t:.4f} ms ({note})")
        best = (t, name, got) if best is None or t < best[0] else best
    if best is None:
        return rows
    y = best[2]  # (the pool reads the fastest convolution's output, laid out as it wrote it)
    pools = {"default": lookup("MaxPool", "", 22, "cuda").fn}
    pools |= {name: get_tactic("MaxPool", "", name).fn for name in ("triton", "triton_p128")}
    exact = pools["default"](y, **POOL)
    pool_best = None
    for name, fn in pools.items():
        got = fn(y, **POOL)
        _sync(device)
        same = bool(torch.equal(got.view(torch.uint8), exact.view(torch.uint8)))
        t = timer(lambda fn=fn: fn(y, **POOL), reps)
        rows.append(f"{kind} pool {name}: {t:.4f} ms ({'equal' if same else 'DIFFERS'})")
        pool_best = t if pool_best is None or t < pool_best else pool_best
    return rows + fused_rows(args, attrs, exact, best[0] + pool_best, reps, device, timer, kind)


def fused_rows(args, attrs, want, apart_ms, reps, device, timer, kind) -> list[str]:
    """conv_stem_pool's configurations (the stem and its pool in one kernel), each checked
    against the pool of the fastest convolution's output (``want``) and timed; ``apart_ms``:
    that convolution's time plus the fastest pool's."""
    x, x_scale, w, w_scale, bias, _, y_scale = args
    geom = conv_geometry(x.shape, w.shape, "NOTSET", None, None, CONV["pads"], CONV["strides"])
    out = {3: torch.int8, 17: torch.float8_e4m3fn}[attrs["out_dtype"]]
    bn = conv_stem.block_n(w.shape[0])
    packed = conv_stem.pack_weight(w, bn)  # (once, as the tactics keep it for a constant)
    rows = []
    for cfg in conv_stem.POOL_CONFIGS:

        def fn(cfg=cfg):
            return conv_stem.conv_stem_pool(
                x, w, bias, geom=geom, scale=(x_scale, w_scale), epilogue=Epilogue.of("Relu"),
                out_dtype=out, y_scale=y_scale, w_packed=packed, config=cfg,
            )  # fmt: skip

        name = f"conv_stem_pool_{cfg.name}"
        try:
            got = fn()
            _sync(device)
        except Exception as exc:  # (a tiling the compiler refuses)
            rows.append(f"{kind} stem+pool {name}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        off, rel = steps_off(got, want), norm_rel_torch([got], [want])
        note = f"{off:.3%} more than a step off the pool of the fastest, rel L2 {rel:.1e}"
        if off > 1e-3 and rel > 2**-6:
            rows.append(f"{kind} stem+pool {name}: {note}; not timed")
            continue
        t = timer(fn, reps)
        rows.append(
            f"{kind} stem+pool {name}: {t:.4f} ms, {apart_ms / t:.2f}x the fastest convolution "
            f"and pool apart ({apart_ms:.4f} ms; {note})"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--precision", choices=("fp8", "int8", "both"), default="both")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("qconv_stem: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    dtypes = {"fp8": [torch.float8_e4m3fn], "int8": [torch.int8]}.get(
        args.precision, [torch.float8_e4m3fn, torch.int8]
    )
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for dtype in dtypes:
        for row in stem_rows(dtype, args.batch, args.reps):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
