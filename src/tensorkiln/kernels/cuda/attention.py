"""Attention on the device: Attention (opset 23, 24, 25), RotaryEmbedding, LinearAttention and
FlexAttention, as torch code.

Attention goes through torch's scaled_dot_product_attention (flash / memory-efficient kernels on
the GPU) whenever its semantics fit: no softcap, no qk_matmul output, the default softmax precision.
The structural masks (causal with a KV cache, sliding windows, key padding) are folded into one
additive bias built on the device, since SDPA's own ``is_causal`` aligns queries to the first key.
Everything else runs as explicit matmul + softmax in float32 (float64 for float64 inputs), like
the reference. Grouped-query attention never repeats K/V: Q is viewed as [B, kv_heads, group * q,
head] against each K/V head.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from tensorkiln.kernels.registry import register

_PRECISIONS = {1: torch.float32, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16}


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
    if precision is None:
        return ct
    if precision not in _PRECISIONS:
        raise ValueError(
            f"softmax_precision {precision} unsupported; use 1 (FLOAT), 10 (FLOAT16), "
            "11 (DOUBLE) or 16 (BFLOAT16)"
        )
    return _PRECISIONS[precision]


def _to_4d(x: torch.Tensor, num_heads: int | None, name: str) -> torch.Tensor:
    """[B, S, H*D] -> [B, H, S, D]; 4D inputs pass through."""
    if x.dim() == 4:
        if num_heads and num_heads != x.shape[1]:
            raise ValueError(f"{name} has {x.shape[1]} heads but the head count attribute says "
                             f"{num_heads}")  # fmt: skip
        return x
    if x.dim() != 3:
        raise ValueError(f"{name} must be rank 3 or 4, got shape {tuple(x.shape)}")
    if not num_heads or x.shape[2] % num_heads:
        raise ValueError(
            f"{name} is 3D {tuple(x.shape)}: q_num_heads/kv_num_heads must be set and divide its "
            f"hidden size (got {num_heads})"
        )
    b, s, hidden = x.shape
    return x.reshape(b, s, num_heads, hidden // num_heads).transpose(1, 2)


def _from_4d(y: torch.Tensor) -> torch.Tensor:
    b, h, s, d = y.shape
    return y.transpose(1, 2).reshape(b, s, h * d)


def _group(hq: int, hkv: int) -> int:
    if hq % hkv:
        raise ValueError(f"q_num_heads ({hq}) must be a multiple of kv_num_heads ({hkv})")
    return hq // hkv


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: [B, Hq, M, K] @ b: [B, Hkv, K, N] with query head h using kv head h // (Hq // Hkv)."""
    bs, hq, m, k = a.shape
    hkv = b.shape[1]
    g = _group(hq, hkv)
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
    if mask.shape[-1] > kv_len:
        raise ValueError(
            f"attn_mask's last axis ({mask.shape[-1]}) is longer than the total key length "
            f"({kv_len})"
        )
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
    g = _group(hq, hkv)
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
    """Shared body of every Attention version."""
    if not q.dim() == k.dim() == v.dim():
        raise ValueError(
            f"Q, K, V must have the same rank, got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if (past_key is None) != (past_value is None):
        raise ValueError("past_key and past_value must be given together")
    if nonpad is not None and past_key is not None:
        raise ValueError("nonpad_kv_seqlen cannot be combined with past_key/past_value")
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
    if k4.shape[-1] != head or v4.shape[1:3] != k4.shape[1:3]:
        raise ValueError(
            f"incompatible Q/K/V heads: Q {tuple(q4.shape)}, K {tuple(k4.shape)}, "
            f"V {tuple(v4.shape)}"
        )
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
    if mode not in (0, 1, 2, 3):
        raise ValueError(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {mode}")
    return (y, k4, v4, qk[mode].to(q.dtype))[:n_outputs]


@register("Attention", since=23, backend="cuda")
def attention_23(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    *,
    is_causal: int = 0,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    qk_matmul_output_mode: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    softmax_precision: int | None = None,
    _n_outputs: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Scaled dot-product attention with mask, causal, GQA, KV cache and softcap (opset 23)."""
    attrs = dict(locals())
    attrs.update(left_window_size=-1, right_window_size=-1)
    return _attention(q, k, v, attn_mask, past_key, past_value, None, attrs, _n_outputs)


@register("Attention", since=24, backend="cuda")
def attention_24(
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
    q_num_heads: int | None = None,
    qk_matmul_output_mode: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    softmax_precision: int | None = None,
    _n_outputs: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Opset 24 adds nonpad_kv_seqlen (external KV cache) and masks shorter than the keys."""
    attrs = dict(locals())
    attrs.update(left_window_size=-1, right_window_size=-1)
    return _attention(q, k, v, attn_mask, past_key, past_value, nonpad_kv_seqlen, attrs, _n_outputs)


@register("Attention", since=25, backend="cuda")
def attention_25(
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
    """Opset 25 adds sliding windows (left_window_size, right_window_size)."""
    if left_window_size < -1 or right_window_size < -1:
        raise ValueError(
            f"window sizes must be -1 or non-negative, got left={left_window_size}, "
            f"right={right_window_size}"
        )
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
    if x.dim() == 4:
        xs = x.transpose(1, 2)  # [B, S, H, D]
    elif x.dim() == 3:
        if not num_heads or x.shape[2] % num_heads:
            raise ValueError(f"3D input {tuple(x.shape)} needs num_heads dividing its hidden size")
        xs = x.reshape(x.shape[0], x.shape[1], num_heads, -1)
    else:
        raise ValueError(f"input must be rank 3 or 4, got shape {tuple(x.shape)}")
    head = xs.shape[-1]
    rot = rotary_embedding_dim or head
    if rot % 2 or rot > head:
        raise ValueError(f"rotary_embedding_dim {rot} must be even and at most head size {head}")
    if position_ids is not None:
        pos = position_ids.to(torch.int64)
        cos_cache, sin_cache = cos_cache[pos], sin_cache[pos]
    if cos_cache.shape[-1] != rot // 2 or sin_cache.shape[-1] != rot // 2:
        raise ValueError(
            f"cos/sin caches' last axis ({cos_cache.shape[-1]}, {sin_cache.shape[-1]}) must be "
            f"rotary_embedding_dim / 2 = {rot // 2}"
        )
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
    if x.dim() != 3 or x.shape[2] % heads:
        raise ValueError(f"{name} must be [B, T, {heads} * D], got shape {tuple(x.shape)}")
    return _to_4d(x, heads, name)


def _linear_gates(decay, beta, b, t, hkv, dk, ct):
    """decay -> [B, Hkv, T, dk|1] (log-space), beta -> [B, Hkv|1, T, 1]; None stays None."""
    g = bt = None
    if decay is not None:
        if decay.dim() != 3 or decay.shape[2] not in (hkv, hkv * dk):
            raise ValueError(
                f"decay must be [B, T, {hkv}] or [B, T, {hkv * dk}], got {tuple(decay.shape)}"
            )
        g = decay.reshape(b, t, hkv, -1).transpose(1, 2).to(ct)
    if beta is not None:
        if beta.dim() != 3 or beta.shape[2] not in (hkv, 1):
            raise ValueError(f"beta must be [B, T, {hkv}] or [B, T, 1], got {tuple(beta.shape)}")
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
    if update_rule not in ("linear", "gated", "delta", "gated_delta"):
        raise ValueError(f"update_rule must be linear, gated, delta or gated_delta: {update_rule}")
    if not q_num_heads or not kv_num_heads or q_num_heads % kv_num_heads:
        raise ValueError(f"q_num_heads ({q_num_heads}) must be a positive multiple of "
                         f"kv_num_heads ({kv_num_heads})")  # fmt: skip
    gated, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    if gated != (decay is not None) or delta != (beta is not None):
        raise ValueError(
            f"update_rule '{update_rule}' needs {'decay' if gated else 'no decay'} and "
            f"{'beta' if delta else 'no beta'} input"
        )
    ct = _compute_dtype(query.dtype)
    q = _heads_last(query, q_num_heads, "query").to(ct)
    k = _heads_last(key, kv_num_heads, "key").to(ct)
    v = _heads_last(value, kv_num_heads, "value").to(ct)
    b, _, t, dk = q.shape
    dv = v.shape[-1]
    g, bt = _linear_gates(decay, beta, b, t, kv_num_heads, dk, ct)
    shape = (b, kv_num_heads, dk, dv)
    if past_state is not None and tuple(past_state.shape) != shape:
        raise ValueError(f"past_state must be {shape}, got {tuple(past_state.shape)}")
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
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"{name} must keep the shape {tuple(x.shape)}, returned "
                         f"{tuple(out.shape)}")  # fmt: skip
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
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError(
            f"FlexAttention needs rank-4 Q, K, V; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.shape[-1] != q.shape[-1] or v.shape[1:3] != k.shape[1:3]:
        raise ValueError(
            f"incompatible Q/K/V shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
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
