"""Gemm and tensorkiln.GemmAct on the cuda backend: one cuBLAS(Lt) GEMM with its bias and activation.

The entries (signatures, checks, transposes, bias layout, integer path) are
:mod:`tensorkiln.kernels.common.gemm`'s, shared with the reference and the Triton tactics; this
module supplies the torch product. Transposes are strided views that cuBLAS reads as they are;
integer products, which cuBLAS lacks, multiply and sum in int64 (cuda/math.py).

The GEMM and the bias are one ``addmm``. Relu, and on CUDA the tanh GELU, go into the GEMM's
epilogue too through ``torch._addmm_activation`` (cuBLASLt's RELU_BIAS / GELU_BIAS when the bias is
a contiguous row vector; torch falls back to addmm + the in-place activation otherwise). Its GELU is
the tanh form on CUDA but the erf form on the CPU, so the erf GELU, and every activation on the CPU
other than Relu, runs in place on the GEMM's fresh output instead.

One tactic, ``cublaslt_gelu_tanh``, computes the erf GELU (BERT's, ViT's) by its tanh form in that
epilogue, saving the separate pass over the FFN's widest activation (13% of BERT-base's fp16 GPU
time at batch 64 on an H200). The two forms differ by at most 5e-4 absolutely, far inside fp16's
rounding of the GEMM itself; the autotuner checks the tactic against the exact erf oracle like
any other, so it is taken only where the engine's precision tolerates it (fp16 and bf16 engines,
16-bit operands), as TensorRT's fused GELU kernels use the same form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import gemm as common
from tensorkiln.kernels.cpu import native as cpu_native
from tensorkiln.kernels.cuda.fused_conv import activate_
from tensorkiln.kernels.cuda.math import int_matmul
from tensorkiln.kernels.registry import register
from tensorkiln.kernels.tactics import LayerSpec, tactic


def _fused_epilogue(activation: str, a: torch.Tensor) -> bool | None:
    """``use_gelu`` for torch._addmm_activation when it computes ``activation`` on A, else None."""
    if activation == "Relu":
        return False if a.shape[1] > 0 else None
    if activation == "GeluTanh" and a.device.type == "cuda":
        # (an empty inner dimension skips the epilogue in torch's CUDA path: not fused then)
        return True if a.shape[1] > 0 else None
    return None


class TorchGemmArrays:
    """:class:`tensorkiln.kernels.common.gemm.GemmArrays` on torch tensors."""

    integer_dtypes = frozenset(
        {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16}
        | {torch.uint32, torch.uint64}
    )

    int_matmul = staticmethod(int_matmul)

    float64 = torch.float64

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def affine(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        bias: torch.Tensor | None,
        alpha: float,
        beta: float,
        act: tuple,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        # (dtypes are singletons: `is` keeps this check cheap on the per-call path)
        b = b if b.dtype is dtype else b.to(dtype)
        if bias is None:
            y = torch.mm(a, b)
            if alpha != 1.0:
                y.mul_(alpha)
            return activate_(y, *act) if act[0] else y
        bias = bias if bias.dtype is dtype else bias.to(dtype)
        use_gelu = _fused_epilogue(act[0], a) if act[0] else None
        if use_gelu is not None:
            return torch._addmm_activation(bias, a, b, beta=beta, alpha=alpha, use_gelu=use_gelu)
        y = torch.addmm(bias, a, b, beta=beta, alpha=alpha)  # the bias broadcasts to (M, N)
        return activate_(y, *act) if act[0] else y


gemm = bind(common.gemm, TorchGemmArrays(), __name__)
gemm_act = bind(common.gemm_act, TorchGemmArrays(), __name__)
register("Gemm", since=1, backend="cuda")(gemm)
register("GemmAct", domain="tensorkiln", since=1, backend="cuda")(gemm_act)


def _specializer(kernel: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def specialize(
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
        **attrs: Any,
    ) -> Callable[..., torch.Tensor] | None:
        """On the cpu backend, the native GEMM for these shapes and constants where it applies
        and is the faster (cpu_native.specialize_gemm: float32 only, a classifier head's GEMV at
        batch 1, no residual); None otherwise."""
        if z is not None:
            return None
        return cpu_native.specialize_gemm(kernel, a, b, c, attrs)

    return specialize


# the executor asks for them on the cpu backend
gemm.specialize = _specializer(gemm)  # type: ignore[attr-defined]
gemm_act.specialize = _specializer(gemm_act)  # type: ignore[attr-defined]


def _gelu_epilogue_ok(spec: LayerSpec) -> bool:
    """An erf-GELU GemmAct of 16-bit operands with a bias row, on a GPU."""
    if spec.device != "cuda" or spec.attrs.get("activation") != "Gelu":
        return False
    if not set(spec.attrs) <= {"alpha", "beta", "transA", "transB", "activation"}:
        return False
    if len(spec.shapes) != 3 or spec.shapes[2] is None or len(spec.shapes[1]) != 2:
        return False  # (a residual Z, a fourth input, comes without an activation)
    dtypes = set(spec.dtypes[:3])
    if len(dtypes) != 1 or dtypes.pop() not in ("float16", "bfloat16"):
        return False
    n = spec.shapes[1][0] if spec.attrs.get("transB", 0) else spec.shapes[1][1]
    return tuple(spec.shapes[2]) in ((n,), (1, n))


@tactic("GemmAct", domain="tensorkiln", name="cublaslt_gelu_tanh", supports=_gelu_epilogue_ok)
def gemm_gelu_tanh(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, **attrs: Any):
    """GemmAct's erf GELU by its tanh form, in cuBLASLt's GELU_BIAS epilogue."""
    return gemm_act(a, b, c, **{**attrs, "activation": "GeluTanh"})
