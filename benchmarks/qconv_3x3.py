"""8-bit 3x3 convolutions against cuDNN's float16 one, for #14's ResNet-50 target: what a
quantized ResNet-50 needs is a 3x3 convolution faster in 8 bits than cuDNN is in 16.

    python benchmarks/qconv_3x3.py [--batch 256] [--reps 20] [--precision fp8|int8|both]

For each stride-1 3x3 layer of ResNet-50 (64, 128, 256 and 512 channels at 56, 28, 14 and 7
pixels square) at ``--batch``, channels-last, with the per-channel scale, bias, ReLU and the
next layer's quantization fused, as a quantized engine runs it:

- cuDNN's float16 convolution (``F.conv2d``, channels-last: the fp16 engine's kernel);
- the project's Triton implicit-GEMM convolution (``kernels/triton/conv.py``, pointer loads
  with masks) at its tilings and at wider K steps;
- an experimental kernel here, ``tma_conv3x3``: A's rows are the output pixels of the NHWC input
  viewed as a (pixels, channels) matrix, each tap's tile is one TMA load of that matrix shifted
  by the tap's offset (rows before the first or past the last pixel come back as zeros), and
  the rows whose shifted pixel falls outside its image (the padding) are zeroed in registers.

Each 8-bit result is first checked against float64 arithmetic on the same 8-bit values (within
one output step); times are the median of ``--reps`` replays of a CUDA graph of 20 calls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tensorkiln.kernels.triton import interpreting  # noqa: E402
from tensorkiln.kernels.triton.gemm import TileConfig, swizzle  # noqa: E402
from tensorkiln.kernels.triton.quantize import qout, requantize, storable  # noqa: E402

# ResNet-50's stride-1 3x3 layers: (channels, pixels square, uses)
LAYERS = ((64, 56, 3), (128, 28, 3), (256, 14, 5), (512, 7, 2))


@triton.jit
def _tma_conv3x3_kernel(
    x_ptr, w_ptr, col_ptr, b_ptr, q_ptr, y_ptr, P, H, W, C, OC,
    QUANT: tl.constexpr, QOUT: tl.constexpr, RELU: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    x_desc = tl.make_tensor_descriptor(
        x_ptr, shape=[P, C], strides=[C, 1], block_shape=[BLOCK_M, BLOCK_K]
    )
    w_desc = tl.make_tensor_descriptor(
        w_ptr, shape=[OC, 9 * C], strides=[9 * C, 1], block_shape=[BLOCK_N, BLOCK_K]
    )
    pid_m, pid_n = swizzle(tl.program_id(0), tl.cdiv(P, BLOCK_M), tl.cdiv(OC, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ow = rm % W
    oh = (rm // W) % H
    if QUANT == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_steps = tl.cdiv(C, BLOCK_K)
    for step in tl.range(0, 9 * c_steps, num_stages=STAGES):
        tap = step // c_steps
        c0 = (step % c_steps) * BLOCK_K
        dh = tap // 3 - 1
        dw = tap % 3 - 1
        # (a row whose shifted pixel lies in another image row or image is padding: zero)
        a = x_desc.load([pid_m * BLOCK_M + dh * W + dw, c0])
        inside = (oh + dh >= 0) & (oh + dh < H) & (ow + dw >= 0) & (ow + dw < W)
        a = tl.where(inside[:, None], a, tl.zeros_like(a))
        b = w_desc.load([pid_n * BLOCK_N, tap * C + c0])
        if QUANT == 1:
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        elif UPCAST:  # (the interpreter has no E4M3 dot)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc)
        else:
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < OC
    v = acc.to(tl.float32) * tl.load(col_ptr + rn, mask=n_ok, other=0.0)[None, :]
    v = v + tl.load(b_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if RELU:
        v = tl.maximum(v, 0.0)
    v = requantize(v, tl.load(q_ptr), QOUT)
    y_ptrs = y_ptr + rm[:, None] * OC + rn[None, :]
    tl.store(y_ptrs, v.to(y_ptr.dtype.element_ty), mask=(rm < P)[:, None] & n_ok[None, :])


_ALLOCATOR_SET = False


def _allocator() -> None:
    """Device-side tensor descriptors need scratch memory from the caller."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        triton.set_allocator(
            lambda size, align, stream: (
                torch.empty(size, dtype=torch.int8, device="cuda")
                if torch.cuda.is_available()
                else torch.empty(size, dtype=torch.int8)
            )
        )
        _ALLOCATOR_SET = True


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
    """``quantize(relu(conv3x3(x_q, w_q) * col + bias), y_scale)``, stride 1, padding 1: ``x_q``
    (N, C, H, W) and ``w_q`` (OC, C, 3, 3) int8 or E4M3, channels-last; ``col`` and ``bias``
    float32 of OC; the output in x_q's type, channels-last. C and OC multiples of 16."""
    nb, c, h, w = x_q.shape
    oc = w_q.shape[0]
    if w_q.shape[1:] != (c, 3, 3) or c % 16 or oc % 16:
        raise ValueError(f"tma_conv3x3: X {tuple(x_q.shape)}, W {tuple(w_q.shape)}")
    config = config or TMA_CONFIGS[0]
    _allocator()
    x2 = x_q.permute(0, 2, 3, 1).reshape(nb * h * w, c)  # (a view when channels-last)
    w2 = w_q.permute(0, 2, 3, 1).reshape(oc, 9 * c)
    if not (x2.is_contiguous() and w2.is_contiguous()):
        raise ValueError("tma_conv3x3: X and W must be channels-last")
    y = torch.empty((nb, oc, h, w), dtype=x_q.dtype, device=x_q.device,
                    memory_format=torch.channels_last)  # fmt: skip
    p = nb * h * w
    grid = (triton.cdiv(p, config.block_m) * triton.cdiv(oc, config.block_n),)
    _tma_conv3x3_kernel[grid](
        x2, w2, col, bias, y_scale, storable(y), p, h, w, c, oc,
        QUANT=1 if x_q.dtype == torch.int8 else 2, QOUT=qout(x_q.dtype), RELU=relu,
        UPCAST=interpreting() and x_q.dtype == torch.float8_e4m3fn,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        STAGES=config.stages, GROUP_M=config.group_m, num_warps=config.warps,
    )  # fmt: skip
    return y


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


def _agree(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of outputs more than one output step from the reference (int8: one code;
    E4M3: one step of the larger's exponent)."""
    g, w = got.float(), want.float()
    if got.dtype == torch.int8:
        return float(((g - w).abs() > 1).float().mean())
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(g.abs(), w.abs()).clamp_min(2**-6))) - 3)
    return float(((g - w).abs() > step * 1.0001).float().mean())


def _layer_row(
    dtype: torch.dtype, c: int, hw: int, batch: int, reps: int, quick: bool = False
) -> dict:
    """One layer's times (ms): cuDNN float16, and the best tiling of each 8-bit kernel."""
    from benchmarks._common import graph_time_ms

    from tensorkiln.kernels.common.window import Geometry
    from tensorkiln.kernels.triton import conv

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

    kernels = (("triton", TRITON_CONFIGS, triton_conv), ("tma", TMA_CONFIGS, tma))
    if quick:  # (a few tilings each: compiling every one takes minutes)
        kernels = (("triton", TRITON_CONFIGS[4:6], triton_conv), ("tma", TMA_CONFIGS[:4], tma))
    for name, configs, fn in kernels:
        best = None
        for cfg in configs:
            if cfg.block_n > max(64, c):
                continue
            label = f"  {name} {cfg.name} {kind} {c}@{hw}"
            try:
                got = fn(cfg)
                torch.cuda.synchronize()
            except Exception as exc:  # (a tiling the compiler refuses)
                print(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            off = _agree(got, want)
            if off > 1e-3:
                print(f"{label}: {off:.2%} off by more than one step, not timed")
                continue
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
TRITON_CONFIGS = (
    TileConfig(128, 128, 64, 8, 3), TileConfig(128, 128, 32, 4, 3), TileConfig(128, 64, 32, 4, 4),
    TileConfig(64, 128, 32, 4, 4), TileConfig(64, 64, 32, 4, 4),  # (kernels/triton/conv.py's)
    TileConfig(128, 64, 64, 4, 3), TileConfig(128, 64, 128, 4, 3),
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--precision", choices=("fp8", "int8", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="two Triton and four TMA tilings only")
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
            row = _layer_row(dtype, c, hw, args.batch, args.reps, args.quick)
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
