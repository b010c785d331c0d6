"""Attention on the device: Attention (one kernel for opsets 23-25), RotaryEmbedding,
LinearAttention and FlexAttention, as kernels/common/attention.py writes them once, over the torch
operations below.

Attention goes through torch's scaled_dot_product_attention (flash / memory-efficient kernels on
the GPU) whenever its semantics fit: no softcap, no qk_matmul output, the default softmax precision.
The structural masks (causal with a KV cache, sliding windows, key padding) are folded into one
additive bias built on the device, since SDPA's own ``is_causal`` aligns queries to the first key.
Everything else runs as explicit matmul + softmax in float32 (float64 for float64 inputs), like
the reference. Grouped-query attention never repeats K/V: for SDPA, Q is viewed as
[B, kv_heads, group * q, head] against each K/V head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tensorkiln.kernels.common.attention import AttentionOps, group
from tensorkiln.kernels.registry import register


def sdpa_mask(mask: torch.Tensor | None, q: torch.Tensor, keys: int) -> torch.Tensor | None:
    """``mask`` as the GPU's fused SDPA kernels take it.

    The memory-efficient kernel wants a unit stride on the key axis and pads masks whose key
    length is not a multiple of 8 itself, which fails for masks broadcast along the key axis
    (size 1, or an expanded view with stride 0). Such masks, and any mask of an unaligned key
    length, are materialized at the full [B, H, Sq, Sk] shape; an aligned row-contiguous mask (the
    usual [B, 1, 1, S] padding mask, say) is passed as is, broadcast by SDPA.
    """
    if mask is None or mask.ndim == 0:
        return mask
    if mask.shape[-1] == keys and mask.stride(-1) == 1 and keys % 8 == 0:
        return mask
    full = torch.broadcast_shapes(tuple(mask.shape), (*q.shape[:-1], keys))
    return mask.expand(full).contiguous()


def _dead_rows(bias: torch.Tensor | None) -> torch.Tensor | None:
    """Rows of the bias with no allowed key (their output is zeros, not NaN)."""
    if bias is None:
        return None
    return torch.isneginf(bias.amax(dim=-1, keepdim=True))


def sdpa(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """SDPA over [B, Hq, q, D] x [B, Hkv, kv, D]; query heads grouped onto their K/V head."""
    b, hq, q_len, _ = q4.shape
    hkv, kv_len = k4.shape[1], k4.shape[2]
    g = group(hq, hkv)
    # fp16/bf16 run in float32, as the reference: the fused fp16 kernels round the probabilities
    # to fp16 before the second matmul, one or two fp16 steps off the oracle
    dt = torch.float64 if q4.dtype == torch.float64 else torch.float32
    q, k, v = q4.to(dt), k4.to(dt), v4.to(dt)
    mask = None if bias is None else bias.to(dt)
    if g > 1:
        q = q.reshape(b, hkv, g * q_len, q.shape[-1])
        if mask is not None:
            mask = mask.expand(b, hq, q_len, kv_len).reshape(b, hkv, g * q_len, kv_len)
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=sdpa_mask(mask, q, k.shape[-2]), scale=scale
    )
    y = y.reshape(b, hq, q_len, v.shape[-1])
    dead = _dead_rows(bias)
    if dead is not None:
        y = torch.where(dead, torch.zeros((), dtype=y.dtype, device=y.device), y)
    return y.to(out_dtype)


class TorchAttentionArrays:
    """:class:`tensorkiln.kernels.common.attention.AttentionArrays` on torch tensors."""

    m = torch
    fused = staticmethod(sdpa)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def dtype(self, name: str) -> torch.dtype:
        return getattr(torch, name)

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def swap(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return x.transpose(a, b)

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        return x.amax(dim=-1, keepdim=True)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=-1, keepdim=True)

    def cat(self, arrays: list[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.cat(arrays, dim=axis)

    def stack(self, arrays: list[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.stack(arrays, dim=axis)

    def broadcast_to(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return x.expand(shape)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, like: Any) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=like.device)

    def arange(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(n, device=like.device)

    def pad_last(self, x: torch.Tensor, count: int, value: float) -> torch.Tensor:
        return F.pad(x, (0, count), value=value)

    def is_bool(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.bool

    def rows(self, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return table[index.to(torch.int64)]

    def key_lengths(self, nonpad: torch.Tensor, batch: int, kv_len: int) -> torch.Tensor:
        return nonpad.to(torch.int64).reshape(-1)  # stays on the device: a mask, never read


OPS = AttentionOps(TorchAttentionArrays())
register("Attention", since=23, backend="cuda")(OPS.attention)
register("RotaryEmbedding", since=23, backend="cuda")(OPS.rotary_embedding)
register("LinearAttention", since=27, backend="cuda")(OPS.linear_attention)
register("FlexAttention", domain="ai.onnx.preview", since=1, backend="cuda")(OPS.flex_attention)
