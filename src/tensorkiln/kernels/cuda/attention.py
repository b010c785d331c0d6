"""Attention on the device: Attention (one kernel for opsets 23-25), RotaryEmbedding, LinearAttention and
FlexAttention, as torch code.

Attention goes through torch's scaled_dot_product_attention (flash / memory-efficient kernels on
the GPU) whenever its semantics fit: no softcap, no qk_matmul output, the default softmax precision.
The structural masks (causal with a KV cache, sliding windows, key padding) are folded into one
additive bias built on the device, since SDPA's own ``is_causal`` aligns queries to the first key.
Everything else runs as explicit matmul + softmax in float32 (float64 for float64 inputs), like
the reference. Grouped-query attention never repeats K/V: Q is viewed as [B, kv_heads, group * q,
head] against each K/V head. The shape and attribute checks are kernels/common/attention.py's,
shared with the reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from tensorkiln.kernels.common import attention as checks
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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _softmax_dtype(precision: int | None, ct: torch.dtype) -> torch.dtype:
    name = checks.softmax_precision(precision)
    return ct if name is None else getattr(torch, name)


def _to_4d(x: torch.Tensor, num_heads: int | None, name: str) -> torch.Tensor:
    """[B, S, H*D] -> [B, H, S, D]; 4D inputs pass through."""
    split = checks.split_heads(x.shape, num_heads, name)
    return x if split is None else x.reshape(split).transpose(1, 2)


def _from_4d(y: torch.Tensor) -> torch.Tensor:
    b, h, s, d = y.shape
    return y.transpose(1, 2).reshape(b, s, h * d)


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: [B, Hq, M, K] @ b: [B, Hkv, K, N] with query head h using kv head h // (Hq // Hkv)."""
    bs, hq, m, k = a.shape
    hkv = b.shape[1]
    g = checks.group(hq, hkv)
    out = torch.matmul(a.reshape(bs, hkv, g, m, k), b.unsqueeze(2))
    return out.reshape(bs, hq, m, b.shape[-1])


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis; an all -inf row gives zeros, not NaN."""
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(x - m)
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s == 0, torch.ones_like(s), s)


def _mask_bias(mask: torch.Tensor, kv_len: int, ct: torch.dtype) -> torch.Tensor:
    """attn_mask as an additive bias; a mask shorter than kv_len is padded as disallowed."""
    checks.check_mask_length(mask.shape[-1], kv_len)
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=ct, device=mask.device)
        bias = bias.masked_fill(~mask, -math.inf)
    else:
        bias = mask.to(ct)
    if mask.shape[-1] < kv_len:
        bias = F.pad(bias, (0, kv_len - mask.shape[-1]), value=-math.inf)
    return bias


def _structural_bias(
    q_len: int,
    kv_len: int,
    past_len: int,
    nonpad: torch.Tensor | None,
    device: torch.device,
    ct: torch.dtype,
    *,
    is_causal: int,
    left: int,
    right: int,
) -> torch.Tensor | None:
    """Causal, sliding-window and key-padding mask as a [B|1, 1, q, kv] bias; None if none apply.

    Query 0 sits at absolute position ``past_len``, or ``nonpad[b] - q_len`` with an external cache.
    """
    if not (is_causal or left >= 0 or right >= 0 or nonpad is not None):
        return None
    if nonpad is not None:
        offset = (nonpad.to(device=device, dtype=torch.int64).reshape(-1) - q_len).view(-1, 1, 1, 1)
    else:
        offset = torch.full((1, 1, 1, 1), past_len, dtype=torch.int64, device=device)
    pos = torch.arange(q_len, device=device).view(q_len, 1) + offset  # absolute query positions
    j = torch.arange(kv_len, device=device)
    allowed = torch.ones((*pos.shape[:2], q_len, kv_len), dtype=torch.bool, device=device)
    if is_causal:
        allowed &= j <= pos
    if left >= 0:
        allowed &= j >= pos - left
    if right >= 0:
        allowed &= j <= pos + right
    if nonpad is not None:
        allowed &= j < nonpad.to(device=device, dtype=torch.int64).view(-1, 1, 1, 1)
    return torch.zeros(allowed.shape, dtype=ct, device=device).masked_fill(~allowed, -math.inf)


def _attention_bias(
    attn_mask: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    past_len: int,
    nonpad: torch.Tensor | None,
    device: torch.device,
    ct: torch.dtype,
    **structure: int,
) -> torch.Tensor | None:
    """The additive bias (0 / -inf / float mask values) broadcastable to [B, Hq, q, kv]."""
    bias = None if attn_mask is None else _mask_bias(attn_mask, kv_len, ct)
    struct = _structural_bias(q_len, kv_len, past_len, nonpad, device, ct, **structure)
    if struct is not None:
        bias = struct if bias is None else bias + struct
    return bias


def _dead_rows(bias: torch.Tensor | None) -> torch.Tensor | None:
    """Rows of the bias with no allowed key (their output is zeros, not NaN)."""
    if bias is None:
        return None
    return torch.isneginf(bias.amax(dim=-1, keepdim=True))


def _sdpa(
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
    g = checks.group(hq, hkv)
    # fp16/bf16 run in float32, as the reference: the fused fp16 kernels round the probabilities
    # to fp16 before the second matmul, one or two fp16 steps off the oracle
    dt = _compute_dtype(q4.dtype)
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


def _explicit(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    bias: torch.Tensor | None,
    attrs: dict[str, Any],
    ct: torch.dtype,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """matmul + softmax + matmul as the reference does it; also returns the qk stages."""
    head = q4.shape[-1]
    scale = attrs["scale"]
    root = math.sqrt(1.0 / math.sqrt(head) if scale is None else scale)
    raw = _grouped_matmul(q4.to(ct) * root, (k4.to(ct) * root).transpose(-1, -2))
    softcap = attrs["softcap"]
    capped = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    logits = capped if bias is None else capped + bias
    sm_dtype = _softmax_dtype(attrs["softmax_precision"], ct)
    probs = _softmax(logits.to(sm_dtype)).to(ct)
    dead = _dead_rows(bias)
    if dead is not None:
        probs = torch.where(dead, torch.zeros((), dtype=ct, device=probs.device), probs)
    y = _grouped_matmul(probs, v4.to(ct)).to(out_dtype)
    return y, (raw, capped, logits.expand(raw.shape), probs)


def _fits_sdpa(attrs: dict[str, Any], ct: torch.dtype, n_outputs: int) -> bool:
    return (
        n_outputs < 4
        and attrs["softcap"] <= 0
        and _softmax_dtype(attrs["softmax_precision"], ct) == ct
    )


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    past_key: torch.Tensor | None,
    past_value: torch.Tensor | None,
    nonpad: torch.Tensor | None,
    attrs: dict[str, Any],
    n_outputs: int,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The body of Attention."""
    checks.check_inputs(
        q.shape, k.shape, v.shape, past_key is not None, past_value is not None, nonpad is not None
    )
    q4 = _to_4d(q, attrs["q_num_heads"], "Q")
    k4 = _to_4d(k, attrs["kv_num_heads"], "K")
    v4 = _to_4d(v, attrs["kv_num_heads"], "V")
    past_len = 0
    if past_key is not None:
        past_len = past_key.shape[2]
        k4 = torch.cat([past_key, k4.to(past_key.dtype)], dim=2)
        v4 = torch.cat([past_value, v4.to(past_value.dtype)], dim=2)
    q_len, head = q4.shape[2], q4.shape[3]
    kv_len = k4.shape[2]
    checks.check_heads(q4.shape, k4.shape, v4.shape)
    ct = _compute_dtype(q.dtype)
    bias = _attention_bias(
        attn_mask, q_len, kv_len, past_len, nonpad, q.device, ct, is_causal=attrs["is_causal"],
        left=attrs["left_window_size"], right=attrs["right_window_size"],
    )  # fmt: skip
    qk = None
    if _fits_sdpa(attrs, ct, n_outputs):
        scale = attrs["scale"]
        scale = 1.0 / math.sqrt(head) if scale is None else scale
        y = _sdpa(q4, k4, v4, bias, scale, q.dtype)
    else:
        y, qk = _explicit(q4, k4, v4, bias, attrs, ct, q.dtype)
    if q.dim() == 3:
        y = _from_4d(y)
    if n_outputs <= 1:
        return y
    if qk is None:
        return (y, k4, v4)[:n_outputs]
    mode = attrs["qk_matmul_output_mode"]
    checks.check_qk_mode(mode)
    return (y, k4, v4, qk[mode].to(q.dtype))[:n_outputs]


@register("Attention", since=23, backend="cuda")
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    nonpad_kv_seqlen: torch.Tensor | None = None,
    *,
    is_causal: int = 0,
    kv_num_heads: int | None = None,
    left_window_size: int = -1,
    q_num_heads: int | None = None,
    qk_matmul_output_mode: int = 0,
    right_window_size: int = -1,
    scale: float | None = None,
    softcap: float = 0.0,
    softmax_precision: int | None = None,
    _n_outputs: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Scaled dot-product attention, every version (see the reference's ``attention``)."""
    checks.check_windows(left_window_size, right_window_size)
    attrs = dict(locals())
    return _attention(q, k, v, attn_mask, past_key, past_value, nonpad_kv_seqlen, attrs, _n_outputs)


@register("RotaryEmbedding", since=23, backend="cuda")
def rotary_embedding(
    x: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    interleaved: int = 0,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
) -> torch.Tensor:
    """Rotate the first rotary_embedding_dim features of each head (halves or even/odd pairs)."""
    dims = checks.rotary_dims(x.shape, num_heads)
    xs = x.transpose(1, 2) if x.dim() == 4 else x.reshape(dims)  # [B, S, H, D]
    if position_ids is not None:
        pos = position_ids.to(torch.int64)
        cos_cache, sin_cache = cos_cache[pos], sin_cache[pos]
    rot = checks.rotary_width(dims[-1], rotary_embedding_dim, cos_cache.shape, sin_cache.shape)
    ct = _compute_dtype(x.dtype)
    cos = cos_cache.to(ct).unsqueeze(2)
    sin = sin_cache.to(ct).unsqueeze(2)
    xr = xs[..., :rot].to(ct)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rotated = torch.stack([real, imag], dim=-1).reshape(xr.shape)
    else:
        rotated = torch.cat([real, imag], dim=-1)
    out = torch.cat([rotated.to(x.dtype), xs[..., rot:]], dim=-1)
    return out.reshape(x.shape) if x.dim() == 3 else out.transpose(1, 2)


def _heads_last(x: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    """[B, T, H*D] -> [B, H, T, D] for LinearAttention's packed inputs."""
    checks.check_packed(x.shape, heads, name)
    return _to_4d(x, heads, name)


def _linear_gates(decay, beta, b, t, hkv, dk, ct):
    """decay -> [B, Hkv, T, dk|1] (log-space), beta -> [B, Hkv|1, T, 1]; None stays None."""
    checks.check_gates(
        None if decay is None else decay.shape, None if beta is None else beta.shape, hkv, dk
    )
    g = bt = None
    if decay is not None:
        g = decay.reshape(b, t, hkv, -1).transpose(1, 2).to(ct)
    if beta is not None:
        bt = beta.reshape(b, t, beta.shape[2], 1).transpose(1, 2).to(ct)
    return g, bt


@register("LinearAttention", since=27, backend="cuda")
def linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None = None,
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    scale: float = 0.0,
    update_rule: str = "gated_delta",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent linear attention (linear / gated / delta / gated_delta state updates)."""
    gated, delta = checks.linear_rule(
        update_rule, q_num_heads, kv_num_heads, decay is not None, beta is not None
    )
    ct = _compute_dtype(query.dtype)
    q = _heads_last(query, q_num_heads, "query").to(ct)
    k = _heads_last(key, kv_num_heads, "key").to(ct)
    v = _heads_last(value, kv_num_heads, "value").to(ct)
    b, _, t, dk = q.shape
    dv = v.shape[-1]
    g, bt = _linear_gates(decay, beta, b, t, kv_num_heads, dk, ct)
    shape = (b, kv_num_heads, dk, dv)
    checks.check_state(None if past_state is None else past_state.shape, shape)
    if past_state is None:
        state = torch.zeros(shape, dtype=ct, device=query.device)
    else:
        state = past_state.to(ct)
    scale = scale or 1.0 / math.sqrt(dk)
    outs = []
    for i in range(t):  # the recurrence is inherently sequential
        kt, vt = k[:, :, i, :, None], v[:, :, i, None, :]  # [B, H, dk, 1], [B, H, 1, dv]
        if gated:
            state = state * torch.exp(g[:, :, i, :, None])
        if delta:
            vt = bt[:, :, i, :, None] * (vt - torch.matmul(kt.transpose(-1, -2), state))
        state = state + kt * vt
        outs.append(_grouped_matmul(q[:, :, i, None, :], state)[:, :, 0] * scale)
    out = torch.stack(outs, dim=2) if outs else q.new_zeros((b, q_num_heads, 0, dv))
    state_dtype = query.dtype if past_state is None else past_state.dtype
    return _from_4d(out).to(query.dtype), state.to(state_dtype)


def _run_mod(ctx: Any, graph: Any, x: torch.Tensor, name: str) -> torch.Tensor:
    if ctx is None:
        raise ValueError(f"FlexAttention's {name} subgraph needs an executor to run it")
    (out,) = ctx.run_graph(graph, [x])
    checks.check_mod(name, out.shape, x.shape)
    return out.to(x.dtype)


@register("FlexAttention", domain="ai.onnx.preview", since=1, backend="cuda")
def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    prob_mod: Any = None,
    scale: float | None = None,
    score_mod: Any = None,
    softmax_precision: int | None = None,
    _ctx: Any = None,
) -> torch.Tensor:
    """softmax(score_mod(Q K^T * scale)) -> prob_mod -> @ V, with GQA; the mods are subgraphs."""
    checks.check_flex(q.shape, k.shape, v.shape)
    ct = _compute_dtype(q.dtype)
    sm = _softmax_dtype(softmax_precision, ct)
    root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    scores = _grouped_matmul(q.to(ct) * root, (k.to(ct) * root).transpose(-1, -2)).to(sm)
    if score_mod is not None:
        scores = _run_mod(_ctx, score_mod, scores, "score_mod")
    probs = _softmax(scores)
    if prob_mod is not None:
        probs = _run_mod(_ctx, prob_mod, probs, "prob_mod")
    return _grouped_matmul(probs.to(ct), v.to(ct)).to(q.dtype)
