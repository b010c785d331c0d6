"""Tiled Triton GEMM with the GemmAct epilogue: ``Y = act(alpha * A @ B + beta * C [+ R])``.

One kernel serves tensorkiln.GemmAct, Gemm and MatMul. Operands are read through their strides, so
a transposed weight or a transposed activation is a view, never a copy. A of rank > 2 against a
2-D B has its leading dims folded into the rows; batched MatMuls run one batch per grid column.
float16 and bfloat16 operands multiply on tensor cores with a float32 accumulator; float32 operands
multiply as :func:`tensorkiln.kernels.triton.fp32_dot_precision` says ("ieee" or "tf32"). The
epilogue (scale, bias, residual, activation) works on the float32 accumulator before the one store,
in the order the reference kernels use.

Each :class:`TileConfig` is a separate tactic (``triton_gemm_128x128x64_w8_s4``, ...); the builder's
autotuner times them. :func:`activate` and :class:`Epilogue` are shared with the convolution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorkiln.kernels.common.gemm import gemm_layout
from tensorkiln.kernels.triton import fp32_dot_precision, interpreting
from tensorkiln.kernels.triton.quantize import qout, requantize, storable

# --------------------------------------------------------------------------------- activations

ACT_CODES = {
    "": 0,
    "Relu": 1,
    "LeakyRelu": 2,
    "Clip": 3,
    "Sigmoid": 4,
    "Swish": 5,
    "HardSigmoid": 6,
    "HardSwish": 7,
    "Gelu": 8,
    "GeluTanh": 9,
    "Tanh": 10,
}

# the ONNX defaults of the activation parameters (alpha, beta), as the attributes store them
_DEFAULTS = {
    "LeakyRelu": (0.009999999776482582, 0.0),
    "Swish": (1.0, 0.0),
    "HardSigmoid": (0.20000000298023224, 0.5),
}


@dataclass(frozen=True, slots=True)
class Epilogue:
    """The activation of a fused op, its parameters resolved to numbers the kernel takes."""

    code: int = 0
    alpha: float = 0.0
    beta: float = 0.0
    lo: float = float("-inf")
    hi: float = float("inf")

    @classmethod
    def of(
        cls,
        activation: str = "",
        alpha: float | None = None,
        beta: float | None = None,
        lo: float | None = None,
        hi: float | None = None,
    ) -> Epilogue:
        if activation not in ACT_CODES:
            raise ValueError(f"unknown activation {activation!r}; known: {list(ACT_CODES)[1:]}")
        a, b = _DEFAULTS.get(activation, (0.0, 0.0))
        return cls(
            ACT_CODES[activation],
            float(a if alpha is None else alpha),
            float(b if beta is None else beta),
            float("-inf") if lo is None else float(lo),
            float("inf") if hi is None else float(hi),
        )


NO_ACTIVATION = Epilogue()


@triton.jit
def _tanh(x):
    # exp form where it is exact; below |x| = 0.3 (where 1 - e loses digits) the odd Taylor series
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0, -big, big)
    x2 = x * x
    p = -0.008863235529902197  # -1382/155925
    p = p * x2 + 0.021869488536155203  # 62/2835
    p = p * x2 - 0.05396825396825397  # -17/315
    p = p * x2 + 0.13333333333333333  # 2/15
    p = p * x2 - 0.3333333333333333
    small = x + x * x2 * p
    return tl.where(ax < 0.3, small, big)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def activate(v, ACT: tl.constexpr, alpha, beta, lo, hi):
    """The activation ``ACT`` (an :data:`ACT_CODES` value) of the float32 block ``v``."""
    if ACT == 1:
        v = tl.maximum(v, 0.0)
    elif ACT == 2:
        v = tl.where(v >= 0, v, v * alpha)
    elif ACT == 3:
        v = tl.minimum(tl.maximum(v, lo), hi)
    elif ACT == 4:
        v = _sigmoid(v)
    elif ACT == 5:
        v = v * _sigmoid(v * alpha)
    elif ACT == 6:
        v = tl.minimum(tl.maximum(v * alpha + beta, 0.0), 1.0)
    elif ACT == 7:
        v = v * tl.minimum(tl.maximum(v * 0.16666666666666666 + 0.5, 0.0), 1.0)
    elif ACT == 8:
        v = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif ACT == 9:
        v = 0.5 * v * (1.0 + _tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    elif ACT == 10:
        v = _tanh(v)
    return v


@triton.jit
def finish(
    acc, c, r,
    HAS_C: tl.constexpr, HAS_R: tl.constexpr, R_AFTER: tl.constexpr, ACT: tl.constexpr,
    p0, p1, lo, hi,
):  # fmt: skip
    """acc + c (+ r) then the activation (then + r when ``R_AFTER``): the fused ops' epilogue."""
    if HAS_C:
        acc = acc + c
    if HAS_R and not R_AFTER:
        acc = acc + r
    acc = activate(acc, ACT, p0, p1, lo, hi)
    if HAS_R and R_AFTER:
        acc = acc + r
    return acc


@triton.jit
def load_residual(ptrs, mask, scale_ptr, SCALED: tl.constexpr):
    """A residual tile in float32; ``SCALED``: an int8 or E4M3 one times its one float32 scale
    (its DequantizeLinear, fused; loaded with no ``other``, which 8-bit float types refuse)."""
    if SCALED:
        return tl.load(ptrs, mask=mask).to(tl.float32) * tl.load(scale_ptr)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def swizzle(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
    """Tile (row, column) of program ``pid``, GROUP_M row tiles at a time so B stays in L2."""
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


# -------------------------------------------------------------------------------------- kernel


@triton.jit
def dot_step(a, b, acc, QUANT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
             BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + a @ b for one K step: int8 operands (QUANT 1) into int32, E4M3 (QUANT 2) with
    Hopper's narrower tensor-core accumulator folded into float32 after the step, floats at
    PRECISION; UPCAST: through float32 (the interpreter multiplies bfloat16 as raw integers and
    has no fp8 dot)."""
    if QUANT == 1:
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    elif QUANT == 2 and not UPCAST:
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def channel_scale(xs_ptr, ws_ptr, s_ws, cols):
    """X_scale * W_scale (float32) for output columns ``cols``: W_scale has one value per column
    (``s_ws`` 1) or one for all (``s_ws`` 0). Multiplied here, the layer launches no kernel to
    form the product (a CUDA graph replays every kernel a layer launches)."""
    xs = tl.load(xs_ptr).to(tl.float32)
    return xs * tl.load(ws_ptr + cols * s_ws).to(tl.float32)


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, r_ptr, y_ptr, xs_ptr, ws_ptr, q_ptr, rs_ptr,
    M, N, K, s_ws,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cm, s_cn, s_rm, s_rn, s_yb, s_ym, s_yn,
    alpha, beta, p0, p1, lo, hi,
    HAS_C: tl.constexpr, HAS_R: tl.constexpr, R_AFTER: tl.constexpr, ACT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
    QUANT: tl.constexpr, QOUT: tl.constexpr, R_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    batch = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # rows and columns past the edge read valid ones again (wrapped): no masks in the main loop
    a_ptrs = a_ptr + batch * s_ab + (rm % M)[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + batch * s_bb + rk[:, None] * s_bk + (rn % N)[None, :] * s_bn
    if QUANT == 1:  # int8 operands: exact int32 sums
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < left, other=0.0)
        acc = dot_step(a, b, acc, QUANT, UPCAST, PRECISION, BLOCK_K)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    if QUANT != 0:  # the sums of quantized products times A_scale * B_scale per column
        acc = acc.to(tl.float32) * channel_scale(xs_ptr, ws_ptr, s_ws, rn % N)[None, :]
    acc = acc * alpha
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    c = 0.0
    if HAS_C:
        c = tl.load(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, mask=mask, other=0.0)
        c = c.to(tl.float32) * beta
    r = 0.0
    if HAS_R:
        r = load_residual(r_ptr + rm[:, None] * s_rm + rn[None, :] * s_rn, mask, rs_ptr, R_SCALED)
    acc = finish(acc, c, r, HAS_C, HAS_R, R_AFTER, ACT, p0, p1, lo, hi)
    if QOUT != 0:  # the next layer's input quantization, fused (int8, or E4M3 bytes)
        acc = requantize(acc, tl.load(q_ptr), QOUT)
    y_ptrs = y_ptr + batch * s_yb + rm[:, None] * s_ym + rn[None, :] * s_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------- configs


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One tiling of the output: block sizes, warps, pipeline stages, row tiles per L2 group."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8

    @property
    def name(self) -> str:
        b = f"{self.block_m}x{self.block_n}x{self.block_k}"
        return f"{b}_w{self.warps}_s{self.stages}"

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory the pipelined A and B tiles take."""
        return self.stages * (self.block_m + self.block_n) * self.block_k * itemsize


# Tilings known to do well on Hopper: large tiles for large fp16/bf16 GEMMs, 64-wide ones for
# modest sizes, thin-row ones with a long K step for the few rows of batch-1 decoding.
CONFIGS = (
    TileConfig(128, 256, 64, 8, 3),
    TileConfig(128, 128, 64, 8, 4),
    TileConfig(128, 128, 32, 4, 4),
    TileConfig(128, 64, 64, 4, 4),
    TileConfig(64, 128, 64, 4, 4),
    TileConfig(64, 64, 64, 4, 4),
    TileConfig(32, 64, 128, 4, 4),
    TileConfig(16, 64, 128, 4, 4),
)

SMEM_LIMIT = 220 * 1024  # of the 227 KiB an H100/H200 block may take, with room for the epilogue
MAX_GRID_Y = 65535  # the batch runs along grid axis 1
MAX_ELEMENTS = 2**31 - 1  # offsets are 32-bit


def dot_precision(dtype: torch.dtype) -> str:
    # the flag only changes float32 dots; the others take Triton's default
    return fp32_dot_precision() if dtype == torch.float32 else "tf32"


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    c: torch.Tensor | None,
    r: torch.Tensor | None,
    *,
    alpha: float,
    beta: float,
    epilogue: Epilogue,
    residual_after: bool,
    config: TileConfig,
    scale: tuple[torch.Tensor, torch.Tensor] | None = None,
    y_scale: torch.Tensor | None = None,
    r_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[i] = act(alpha * a[i] @ b[i] + beta * c + r) for 3-D a, b, y (any strides, batch-0
    broadcast allowed) and 2-D c, r of y's last two dims (broadcast by zero strides). With
    ``scale`` (X_scale, W_scale: float32, one value and one per column or one), a and b are int8
    or E4M3 and their sums are multiplied by their product first; with ``y_scale`` (one float32),
    y is int8 or E4M3 and the result is quantized to it; with ``r_scale`` (one float32), r is
    int8 or E4M3, read as r * r_scale."""
    batch, m, k = a.shape
    n = b.shape[2]
    if batch == 0 or m == 0 or n == 0:
        return y
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), batch)
    quant = 0 if scale is None else (1 if a.dtype == torch.int8 else 2)
    xs, ws, s_ws = scale_operands(scale, y)
    _gemm_kernel[grid](
        a, b, c if c is not None else y, r if r is not None else y, storable(y),
        xs, ws, y_scale if y_scale is not None else y, r_scale if r_scale is not None else y,
        m, n, k, s_ws,
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        *(c.stride() if c is not None else (0, 0)),
        *(r.stride() if r is not None else (0, 0)),
        y.stride(0), y.stride(1), y.stride(2),
        float(alpha), float(beta), epilogue.alpha, epilogue.beta, epilogue.lo, epilogue.hi,
        HAS_C=c is not None, HAS_R=r is not None, R_AFTER=bool(residual_after),
        ACT=epilogue.code, PRECISION=dot_precision(a.dtype),
        UPCAST=interpreting() and a.dtype in (torch.bfloat16, torch.float8_e4m3fn),
        EVEN_K=k % config.block_k == 0, QUANT=quant,
        QOUT=qout(y.dtype) if y_scale is not None else 0, R_SCALED=r_scale is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return y


def scale_operands(
    scale: tuple[torch.Tensor, torch.Tensor] | None, placeholder: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(X_scale, W_scale, W_scale's stride) as :func:`channel_scale` reads them (float32; a
    placeholder pointer where there is no scale)."""
    if scale is None:
        return placeholder, placeholder, 0
    xs, ws = (t.reshape(-1).to(torch.float32) for t in scale)
    return xs, ws, 1 if ws.numel() > 1 else 0


# ----------------------------------------------------------------------------- op entry points


def gemm_2d(
    a2: torch.Tensor,
    b2: torch.Tensor,
    bias: torch.Tensor | None,
    alpha: float,
    beta: float,
    epilogue: Epilogue = NO_ACTIVATION,
    config: TileConfig = CONFIGS[1],
) -> torch.Tensor:
    """act(alpha * A @ B + beta * bias) of 2-D A (M, K) and B (K, N), any strides; ``bias`` None
    or broadcasting to (M, N)."""
    m, n = a2.shape[0], b2.shape[1]
    y = torch.empty((m, n), dtype=a2.dtype, device=a2.device)
    cb = None if bias is None else bias.expand(m, n)
    launch(
        a2.unsqueeze(0), b2.unsqueeze(0), y.unsqueeze(0), cb, None,
        alpha=alpha, beta=beta, epilogue=epilogue, residual_after=False, config=config,
    )  # fmt: skip
    return y


def batch_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The broadcast batch dims of MatMul operands of rank >= 2, None when they do not broadcast."""
    try:
        return tuple(torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))
    except RuntimeError:
        return None


def matmul(a: torch.Tensor, b: torch.Tensor, *, config: TileConfig = CONFIGS[1]) -> torch.Tensor:
    """MatMul of operands of rank >= 2 (numpy.matmul semantics, batch dims broadcast)."""
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(
            f"MatMul: operands of rank >= 2 only, got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    if all(d == 1 for d in b.shape[:-2]) and b.dim() <= a.dim():
        # A's batch folds into rows (kernels/common/gemm.py's layout of GemmAct's MatMul form)
        a2, b2, _ = gemm_layout(a, b.reshape(b.shape[-2:]), None, 0.0, 0, 0, "MatMul")
        y = gemm_2d(a2, b2, None, 1.0, 0.0, config=config)
        return y.reshape(*a.shape[:-1], y.shape[1])
    batch = batch_shape(a.shape, b.shape)
    if batch is None:
        raise ValueError(f"MatMul: batch dims of {tuple(a.shape)} and {tuple(b.shape)} differ")
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"MatMul: inner dimensions differ: {tuple(a.shape)}, {tuple(b.shape)}")
    # a view when the batch dims flatten with one stride (always for one batch dim); else a copy
    a3 = a.expand(*batch, m, k).reshape(-1, m, k)
    b3 = b.expand(*batch, k, n).reshape(-1, k, n)
    y = torch.empty((a3.shape[0], m, n), dtype=a.dtype, device=a.device)
    launch(
        a3, b3, y, None, None,
        alpha=1.0, beta=0.0, epilogue=NO_ACTIVATION, residual_after=False, config=config,
    )  # fmt: skip
    return y.reshape(*batch, m, n)
