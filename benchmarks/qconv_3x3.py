"""8-bit 3x3 convolutions against cuDNN's float16 one, for #14's ResNet-50 target: what a
quantized ResNet-50 needs is a 3x3 convolution faster in 8 bits than cuDNN is in 16.

    python benchmarks/qconv_3x3.py [--batch 256] [--reps 20] [--precision fp8|int8|both]
        [--kernels triton,tma,gluon,cutlass] [--quick]

For each stride-1 3x3 layer of ResNet-50 (64, 128, 256 and 512 channels at 56, 28, 14 and 7
pixels square) at ``--batch``, channels-last, with the per-channel scale, bias, ReLU and the
next layer's quantization fused, as a quantized engine runs it:

- cuDNN's float16 convolution (``F.conv2d``, channels-last: the fp16 engine's kernel);
- the project's Triton implicit-GEMM convolution (``kernels/triton/conv.py``, pointer loads
  with masks) at its tilings and at wider K steps;
- ``kernels/triton/conv_tma.py``: A's rows are the output pixels of the NHWC input viewed as a
  (pixels, channels) matrix, each tap's tile is one TMA load of that matrix shifted by the
  tap's offset (rows before the first or past the last pixel come back as zeros), and the rows
  whose shifted pixel falls outside its image (the padding) are zeroed in registers;
- ``kernels/triton/conv_gluon.py``: one four-dimensional TMA box of the NHWC input a tap, the
  padding TMA's zeros, both WGMMA operands from shared memory;
- ``cutlass``: the kernel library's implicit-GEMM convolutions (``TENSORKILN_CUTLASS_KERNELS``,
  built by ``benchmarks/cutlass_gemm_build.py``): CUTLASS's persistent, warp-specialized Hopper
  GEMM with A read by TMA's im2col mode, every ``conv3x3s1`` kernel of the layer's type.

Each 8-bit result is first checked against float64 arithmetic on the same 8-bit values: within
one output step, or (where Hopper's FP8 sums leave outputs near zero further off) within 1/64
of the norm, as the tactic tests allow; times are the median of ``--reps`` replays of a CUDA
graph of 20 calls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tensorkiln.kernels.common.window import Geometry  # noqa: E402
from tensorkiln.kernels.cuda import cutlass_fp8  # noqa: E402
from tensorkiln.kernels.triton import conv, conv_gluon, conv_tma  # noqa: E402
from tensorkiln.kernels.triton.gemm import Epilogue, TileConfig  # noqa: E402

# ResNet-50's stride-1 3x3 layers: (channels, pixels square, uses)
LAYERS = ((64, 56, 3), (128, 28, 3), (256, 14, 5), (512, 7, 2))


def tma_conv3x3(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    col: torch.Tensor,
    bias: torch.Tensor,
    y_scale: torch.Tensor,
    *,
    relu: bool = True,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``quantize(relu(conv3x3(x_q, w_q) * col + bias), y_scale)`` through
    ``kernels/triton/conv_tma.py`` (stride 1, padding 1), in x_q's 8-bit type, channels-last."""
    one = torch.ones(1, device=x_q.device)
    return conv_tma.conv3x3(
        x_q, w_q, bias, scale=(one, col), epilogue=Epilogue.of("Relu" if relu else ""),
        out_dtype=x_q.dtype, y_scale=y_scale, config=config or TMA_CONFIGS[0],
    )  # fmt: skip


def reference(x_q, w_q, col, bias, y_scale, relu: bool = True) -> torch.Tensor:
    """The same in float64 on the 8-bit values, then quantized as QuantizeLinear does."""
    acc = torch.nn.functional.conv2d(x_q.double(), w_q.double(), padding=1)
    v = acc * col.double().reshape(1, -1, 1, 1) + bias.double().reshape(1, -1, 1, 1)
    if relu:
        v = v.clamp_min(0)
    q = v / y_scale.double()
    if x_q.dtype == torch.int8:
        return torch.round(q).clamp(-128, 127).to(torch.int8)
    return q.clamp(-448, 448).float().to(torch.float8_e4m3fn)


def operands(nb: int, c: int, hw: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Random 8-bit operands spanning their range, per-channel scales, bias, output scale."""
    g = torch.Generator(device=device).manual_seed(seed)
    if dtype == torch.int8:
        x = torch.randint(-128, 128, (nb, c, hw, hw), generator=g, device=device, dtype=dtype)
        w = torch.randint(-128, 128, (c, c, 3, 3), generator=g, device=device, dtype=dtype)
        unit = 127.0
    else:
        x = (torch.randn(nb, c, hw, hw, generator=g, device=device) * 64).to(dtype)
        w = (torch.randn(c, c, 3, 3, generator=g, device=device) * 64).to(dtype)
        unit = 64.0
    x = x.contiguous(memory_format=torch.channels_last)
    w = w.contiguous(memory_format=torch.channels_last)
    col = (0.5 + torch.rand(c, generator=g, device=device)) / (unit * unit * (9 * c) ** 0.5)
    bias = 0.2 * torch.randn(c, generator=g, device=device)
    y_scale = torch.tensor([1.0 / 100.0], device=device)
    return x, w, col, bias, y_scale


def _layer_row(
    dtype: torch.dtype,
    c: int,
    hw: int,
    batch: int,
    reps: int,
    quick: bool = False,
    families: tuple[str, ...] = ("triton", "tma", "gluon"),
) -> dict:
    """One layer's times (ms): cuDNN float16, and the best tiling of each 8-bit kernel."""
    from benchmarks._common import graph_time_ms, steps_off

    kind = "int8" if dtype == torch.int8 else "fp8"
    x, w, col, bias, ys = operands(batch, c, hw, dtype, "cuda")
    want = reference(x, w, col, bias, ys)
    x16, w16 = x.half(), w.half()
    row: dict = {
        "cuDNN fp16": graph_time_ms(lambda: torch.nn.functional.conv2d(x16, w16, padding=1), reps)
    }
    geom = Geometry((3, 3), (1, 1), (1, 1), (1, 1), (1, 1), (hw, hw))
    relu = conv.Epilogue.of("Relu")
    one = torch.ones(1, device="cuda")

    def triton_conv(cfg: TileConfig) -> torch.Tensor:
        return conv.conv_act(x, w, bias, geom=geom, epilogue=relu, config=cfg, scale=(one, col),
                             out_dtype=dtype, y_scale=ys)  # fmt: skip

    def tma(cfg: TileConfig) -> torch.Tensor:
        return tma_conv3x3(x, w, col, bias, ys, config=cfg)

    def gluon(cfg) -> torch.Tensor:
        return conv_gluon.conv(x, w, bias, scale=(one, col), epilogue=relu, out_dtype=dtype,
                               y_scale=ys, config=cfg)  # fmt: skip

    library = cutlass_fp8.library() if "cutlass" in families else None
    image = x.permute(0, 2, 3, 1).contiguous()  # (NHWC: a view's copy only if not channels-last)
    taps = w.permute(0, 2, 3, 1).reshape(c, 9 * c).contiguous()  # (OHWI's columns)

    col_y, bias_y = col / ys, bias / ys  # (the scales and bias over Y_scale: ReLU commutes)

    def cutlass(cfg) -> torch.Tensor:  # (only tiles no wider than the layer's channels run)
        d = torch.empty((batch * hw * hw, c), dtype=dtype, device="cuda")
        library.run(cfg.name, image, taps, d, col_y, bias_y)  # type: ignore[union-attr]
        return d.view(batch, hw, hw, c).permute(0, 3, 1, 2)

    cutlass_configs = ()
    if library is not None:
        code = "i8" if kind == "int8" else "fp8"
        cutlass_configs = tuple(
            SimpleNamespace(name=name, block_n=k["tile"][1])
            for name, k in library.kernels.items()
            if k.get("conv") == [3, 1, 1] and k["a"] == code and k["activation"] == "relu"
            and c % (32 * k.get("k_steps", 4)) == 0
        )  # fmt: skip
    elif "cutlass" in families:
        print(f"  cutlass: no kernel library ({cutlass_fp8.ENV} names none, or it did not load)")
    kernels = (("triton", TRITON_CONFIGS, triton_conv), ("tma", TMA_CONFIGS, tma),
               ("gluon", conv_gluon.CONFIGS, gluon), ("cutlass", cutlass_configs, cutlass))  # fmt: skip
    if quick:  # (a few tilings each: compiling every one takes minutes)
        kernels = (("triton", (conv.CONFIGS[-1], WIDER_K[0]), triton_conv),
                   ("tma", TMA_CONFIGS[:4], tma), ("gluon", conv_gluon.CONFIGS, gluon),
                   ("cutlass", cutlass_configs, cutlass))  # fmt: skip
    kernels = tuple(k for k in kernels if k[0] in families)
    for name, configs, fn in kernels:
        best = None
        for cfg in configs:
            if cfg.block_n > max(64, c):
                continue
            if name == "gluon" and (c % cfg.block_k or (kind == "int8" and not cfg.promote)):
                continue
            label = f"  {name} {cfg.name} {kind} {c}@{hw}"
            try:
                got = fn(cfg)
                torch.cuda.synchronize()
            except Exception as exc:  # (a tiling the compiler refuses)
                print(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            off = steps_off(got, want)
            g, wf = got.float(), want.float()
            rel = float(torch.linalg.vector_norm(g - wf) / torch.linalg.vector_norm(wf))
            if off > 1e-3 and rel > 2**-6:  # (the tactic tests' bound: within 1/64 of the norm)
                print(f"{label}: {off:.2%} off by more than one step, rel L2 {rel:.1e}, not timed")
                continue
            if off > 1e-3:  # (Hopper's FP8 sums at a long K: near-zero outputs a few steps off)
                print(f"{label}: {off:.2%} off by more than one step, rel L2 {rel:.1e}")
            t = graph_time_ms(lambda fn=fn, cfg=cfg: fn(cfg), reps)
            print(f"{label}: {t:.4f} ms", flush=True)
            if best is None or t < best[0]:
                best = (t, cfg.name)
        if best is not None:
            row[f"{name} {kind}"] = best[0]
            row[f"{name} {kind} tile"] = best[1]
    return row


TMA_CONFIGS = tuple(
    TileConfig(*t)
    for t in ((128, 64, 64, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 128, 4, 3),
              (64, 64, 64, 4, 4), (128, 128, 128, 8, 3), (256, 64, 64, 8, 3))
)  # fmt: skip
WIDER_K = (TileConfig(128, 64, 64, 4, 3), TileConfig(128, 64, 128, 4, 3))
TRITON_CONFIGS = (*conv.CONFIGS, *WIDER_K)  # (the tactics' tilings, and wider K steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--precision", choices=("fp8", "int8", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="two Triton and four TMA tilings only")
    p.add_argument("--kernels", default="triton,tma,gluon",
                   help="which 8-bit kernels to time (comma-separated: triton, tma, gluon, "
                        "cutlass)")  # fmt: skip
    args = p.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    dtypes = {"fp8": [torch.float8_e4m3fn], "int8": [torch.int8]}.get(
        args.precision, [torch.float8_e4m3fn, torch.int8]
    )
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    totals: dict[str, float] = {}
    for dtype in dtypes:
        kind = "int8" if dtype == torch.int8 else "fp8"
        for c, hw, uses in LAYERS:
            row = _layer_row(dtype, c, hw, args.batch, args.reps, args.quick,
                             tuple(args.kernels.split(",")))  # fmt: skip
            cells = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"({v})"
                               for k, v in row.items())  # fmt: skip
            print(f"{kind} {c}ch @{hw} x{uses}: {cells}", flush=True)
            for k, v in row.items():
                if isinstance(v, float) and (k != "cuDNN fp16" or dtype == dtypes[0]):
                    totals[k] = totals.get(k, 0.0) + uses * v
    print("\nWeighted by use (the 13 stride-1 3x3 layers):")
    for k, v in totals.items():
        print(f"  {k}: {v:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
