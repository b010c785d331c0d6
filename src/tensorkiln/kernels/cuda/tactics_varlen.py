"""PackedAttention's ``sdpa_flash_varlen`` tactic: FlashAttention-2's variable-length kernel, the
one PyTorch's scaled_dot_product_attention runs for nested tensors, on the packed rows directly.

Padding removal (passes/remove_padding.py) packs the tokens into [T, H*D] rows and gives each
attention the cumulative ends of its sequences; FlashAttention-2 takes exactly that layout
(``cu_seqlens``, with a leading zero), causal or not, and reads Q, K and V through their row
strides, so the Split views of one QKV GEMM go in as they are.

The ends come from the engine's graph, which may come from a stranger: before FlashAttention-2
reads rows by them they are made non-decreasing, within [0, T], with no sequence longer than the
mask's S, on the device (a sequence past T, or ending before it starts, would read other memory;
one longer than S would write past FlashAttention-2's per-row buffers). That costs a few small
kernels, paid once per ``ends`` tensor: every attention of a run shares PackIndex's
(kernels/derived.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tensorkiln.kernels.cuda.packing import packed_attention as packed_fallback
from tensorkiln.kernels.cuda.tactics_attention import fits_packed
from tensorkiln.kernels.derived import derived
from tensorkiln.kernels.tactics import LayerSpec, tactic

_HALF = (torch.float16, torch.bfloat16)
_MAX_HEAD = 256


def available() -> bool:
    """Whether this torch has FlashAttention-2's kernel and the GPU runs it (sm80 or later)."""
    if not torch.cuda.is_available() or not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    try:
        return torch.cuda.get_device_capability() >= (8, 0)
    except (RuntimeError, AssertionError):
        return False


def _fits(spec: LayerSpec) -> bool:
    """A packed attention layer (:func:`fits_packed`) on a GPU that runs FlashAttention-2, Q, K
    and V of one width, heads a multiple of 8 wide (what FlashAttention-2 takes)."""
    if spec.device != "cuda" or not fits_packed(spec) or not available():
        return False
    shapes = spec.shapes[:3]
    if any(s is None or len(s) != 2 for s in shapes) or len({s[1] for s in shapes}) != 1:
        return False
    return (shapes[0][1] // int(spec.attrs["num_heads"])) % 8 == 0


def cu_seqlens(ends: torch.Tensor, rows: int, longest: int) -> torch.Tensor:
    """FlashAttention-2's cumulative sequence lengths for ``ends`` (one past each sequence's
    last row), safe whatever ``ends`` holds: [0, ...] int32, non-decreasing, no step over
    ``longest`` (FlashAttention-2 sizes per-row buffers by it), none past ``rows``. Computed
    once per ``ends`` tensor (kernels/derived.py)."""

    def make() -> torch.Tensor:
        e = ends.reshape(-1).to(torch.int64)
        lengths = torch.diff(e, prepend=e.new_zeros(1)).clamp(0, longest)
        cu = torch.cumsum(lengths, 0).clamp(max=rows)
        return torch.cat([e.new_zeros(1), cu]).to(torch.int32)

    return derived(ends, ("cu_seqlens", rows, longest), make)


def _runs(q: Any, k: Any, v: Any, heads: int) -> bool:
    """Whether these operands go to FlashAttention-2 as they are."""
    if not all(isinstance(x, torch.Tensor) and x.is_cuda for x in (q, k, v)):
        return False
    if q.dtype not in _HALF or k.dtype != q.dtype or v.dtype != q.dtype or heads <= 0:
        return False
    if any(x.ndim != 2 or x.shape != q.shape or x.stride(1) != 1 for x in (k, v)):
        return False
    if q.ndim != 2 or q.stride(1) != 1 or q.shape[1] % heads:
        return False
    width = q.shape[1] // heads
    return width % 8 == 0 and 0 < width <= _MAX_HEAD and q.shape[0] > 0


@tactic("PackedAttention", domain="tensorkiln", name="sdpa_flash_varlen", supports=_fits)
def packed_attention_flash_varlen(q, k, v, ends, m, *, scale=0.0, num_heads=0, causal=0):
    """Attention within each packed sequence by FlashAttention-2's variable-length kernel;
    the default (SDPA on padded copies) where it does not take the operands."""
    heads = int(num_heads)
    if m.ndim != 2 or not _runs(q, k, v, heads):
        return packed_fallback(q, k, v, ends, m, scale=scale, num_heads=num_heads, causal=causal)
    t, width = q.shape[0], q.shape[1] // heads
    s = float(scale) if scale else 1.0 / math.sqrt(width)
    longest = int(m.shape[1])  # (a bound on every sequence's length: the grid's query blocks)
    cu = cu_seqlens(ends, t, longest)
    out = torch.ops.aten._flash_attention_forward(
        *(x.view(t, heads, width) for x in (q, k, v)), cu, cu, longest, longest, 0.0,
        bool(causal), False, scale=s,
    )[0]  # fmt: skip
    return out.reshape(t, heads * width)
