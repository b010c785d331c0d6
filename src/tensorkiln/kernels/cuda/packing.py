"""Padding removal's ops in torch (kernels/common/packing.py defines them).

PackIndex reads the token count back to the host, one synchronization, unless a caller that
knows it set it (:func:`tensorkiln.kernels.common.packing.tokens_hint`: a CUDA graph is captured
per count); the indices themselves are a cumulative sum and a scatter on the device. The default
PackedAttention scatters Q, K and V into padded [B, H, S, D] tensors and runs SDPA with a key mask;
the Triton tactic (tactics_attention.py) attends on the packed rows directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import packing as common
from tensorkiln.kernels.registry import register

DOMAIN = "tensorkiln"


def _flat_index(keep: torch.Tensor, count: int) -> torch.Tensor:
    """The flat indices of the True entries of ``keep`` (1-D) in ``count`` slots, without reading
    anything back: a cumulative sum gives each kept token its slot, and the dropped tokens all
    land on one extra slot, cut off after the scatter. Slots past the kept entries (a bucketed
    count, kernels/common/packing.bucket) hold ``keep.numel()``: a row past the tokens."""
    pos = torch.cumsum(keep, 0) - 1  # (int64: a bool cumsum counts in int64)
    # (clamped: more kept entries than ``count`` must not write past the end)
    target = torch.where(keep, pos, count).clamp_(0, count)
    index = torch.full((count + 1,), keep.numel(), dtype=torch.int64, device=keep.device)
    index.scatter_(0, target, torch.arange(keep.numel(), dtype=torch.int64, device=keep.device))
    return index[:count]


@register("PackIndex", domain=DOMAIN, since=1, backend="cuda")
def pack_index(m: torch.Tensor, *, padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens' flat indices (int64 [T]) and each sequence's end row (int32 [B])."""
    common.check_mask(m)
    keep = (m == 0) if padding else (m != 0)
    count = common.hinted_count()
    if count is None:
        count = int(keep.sum())
    ends = torch.cumsum(keep.sum(dim=1), 0).to(torch.int32)
    return _flat_index(keep.reshape(-1), count), ends


@register("PackTokens", domain=DOMAIN, since=1, backend="cuda")
def pack_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """X [B, S, ...]'s rows at the flat token indices, [T, ...]."""
    rows = common.token_rows(x)
    # (indices clamped to the rows, as the gathers are: an unchecked one faults the device;
    # PackIndex's are in range, an engine file's wiring may not be)
    return x.reshape(rows, *x.shape[2:]).index_select(0, index.clamp(0, max(rows - 1, 0)))


@register("UnpackTokens", domain=DOMAIN, since=1, backend="cuda")
def unpack_tokens(y: torch.Tensor, index: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Y [T, ...] back at its tokens of [B, S, ...], zeros at the dropped ones."""
    b, s = common.check_mask(m)
    common.check_packed(y, index, "UnpackTokens")
    # (one row more, for the padding rows of a bucketed count, dropped after; indices clamped
    # into it: see pack_tokens)
    out = torch.zeros((b * s + 1, *y.shape[1:]), dtype=y.dtype, device=y.device)
    out.index_copy_(0, index.clamp(0, b * s), y)
    return out[: b * s].reshape(b, s, *y.shape[1:])


def _padded(x: torch.Tensor, index: torch.Tensor, b: int, s: int, heads: int) -> torch.Tensor:
    """Packed [T, H*D] rows scattered into zeros of [B, H, S, D] (rows indexed B * S, padding of
    a bucketed count, land in a row dropped after)."""
    out = torch.zeros((b * s + 1, x.shape[1]), dtype=x.dtype, device=x.device)
    out.index_copy_(0, index, x)
    return out[: b * s].reshape(b, s, heads, -1).transpose(1, 2)


class TorchPacked:
    """The packed attention's math on torch tensors: SDPA on padded copies."""

    @staticmethod
    def attend_packed(q, k, v, ends, b, s, scale, heads, widths, causal=0) -> torch.Tensor:
        # each sequence's rows at the start of its padded row (attention does not see positions)
        lengths = torch.diff(ends.to(torch.int64), prepend=ends.new_zeros(1, dtype=torch.int64))
        keep = torch.arange(s, device=q.device)[None, :] < lengths[:, None]
        index = _flat_index(keep.reshape(-1), q.shape[0])
        qp, kp, vp = (_padded(x, index, b, s, heads) for x in (q, k, v))
        kp, vp = kp.to(qp.dtype), vp.to(qp.dtype)
        hidden = keep[:, None, None, :]  # (padded keys hidden; padded query rows dropped below)
        if causal:  # (a sequence's rows start its padded row: positions are the same)
            hidden = hidden & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        y = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=hidden, scale=scale or None)
        return y.transpose(1, 2).reshape(b * s, -1).index_select(0, index.clamp(0, b * s - 1))


packed_attention = bind(common.packed_attention, TorchPacked(), __name__)
register("PackedAttention", domain=DOMAIN, since=1, backend="cuda")(packed_attention)
