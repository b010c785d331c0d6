"""Attention: Attention (one kernel for opsets 23-25), RotaryEmbedding, LinearAttention, FlexAttention.

Internally Q is [batch, q_heads, q_len, head], K/V [batch, kv_heads, kv_len, head]. Grouped-query
attention never materializes repeated K/V: Q is viewed as [batch, kv_heads, group, q_len, head]
and multiplied against each K/V head once (query head h uses K/V head h // group).

Arithmetic runs in float32 (float64 for float64 inputs), the result is cast to the output dtype.
float16/bfloat16 inputs are not rounded at every intermediate step: the oracle stays accurate for
long sequences (the ONNX reference, running numpy's bfloat16 matmul, accumulates in bfloat16)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from tensorkiln.kernels.common import attention as checks
from tensorkiln.kernels.registry import register


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _softmax_dtype(precision: int | None, ct: np.dtype) -> np.dtype:
    name = checks.softmax_precision(precision)
    if name is None:
        return ct
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _to_4d(x: np.ndarray, num_heads: int | None, name: str) -> np.ndarray:
    """[B, S, H*D] -> [B, H, S, D]; 4D inputs pass through."""
    split = checks.split_heads(x.shape, num_heads, name)
    return x if split is None else x.reshape(split).transpose(0, 2, 1, 3)


def _from_4d(y: np.ndarray) -> np.ndarray:
    b, h, s, d = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, s, h * d)


def _grouped_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a: [B, Hq, M, K] @ b: [B, Hkv, K, N] with query head h using kv head h // (Hq // Hkv)."""
    bs, hq, m, _ = a.shape
    hkv = b.shape[1]
    out = np.matmul(a.reshape(bs, hkv, checks.group(hq, hkv), m, a.shape[-1]), b[:, :, None])
    return out.reshape(bs, hq, m, b.shape[-1])


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; an all -inf row gives zeros, not NaN."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    e = np.exp(x - m)
    s = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(s == 0, 1, s)


def _mask_bias(mask: np.ndarray, kv_len: int, ct: np.dtype) -> np.ndarray:
    """attn_mask as an additive bias; a mask shorter than kv_len is padded as disallowed."""
    checks.check_mask_length(mask.shape[-1], kv_len)
    is_bool = mask.dtype == np.bool_
    bias = np.where(mask, 0, -np.inf).astype(ct) if is_bool else mask.astype(ct)
    if mask.shape[-1] < kv_len:
        pad = [(0, 0)] * (bias.ndim - 1) + [(0, kv_len - mask.shape[-1])]
        bias = np.pad(bias, pad, constant_values=-np.inf)
    return bias


def _allowed(
    q_len: int,
    kv_len: int,
    offset: np.ndarray,
    *,
    is_causal: int,
    left: int,
    right: int,
    nonpad: np.ndarray | None,
) -> np.ndarray | None:
    """Structural mask [B|1, 1, q, kv]: causal, sliding window and key padding; None if none apply.

    ``offset`` ([B|1, 1, 1, 1]) is the absolute position of query 0: the number of valid keys
    before the query block.
    """
    pos = np.arange(q_len)[:, None] + offset  # absolute query positions
    j = np.arange(kv_len)
    allowed = None

    def both(a: np.ndarray | None, c: np.ndarray) -> np.ndarray:
        return c if a is None else a & c

    if is_causal:
        allowed = both(allowed, j <= pos)
    if left >= 0:
        allowed = both(allowed, j >= pos - left)
    if right >= 0:
        allowed = both(allowed, j <= pos + right)
    if nonpad is not None:
        allowed = both(allowed, j < nonpad.reshape(-1, 1, 1, 1))
    return allowed


def _attention_bias(
    attn_mask: np.ndarray | None,
    batch: int,
    q_len: int,
    kv_len: int,
    past_len: int,
    nonpad: np.ndarray | None,
    ct: np.dtype,
    **structure: int,
) -> np.ndarray | None:
    """The additive bias (0 / -inf / float mask values) broadcastable to [B, Hq, q, kv]."""
    bias = None if attn_mask is None else _mask_bias(attn_mask, kv_len, ct)
    if nonpad is not None:
        nonpad = np.asarray(nonpad).astype(np.int64).reshape(-1)
        if nonpad.shape[0] != batch or np.any(nonpad < 0) or np.any(nonpad > kv_len):
            raise ValueError(
                f"nonpad_kv_seqlen must have {batch} entries in [0, {kv_len}], got {nonpad}"
            )
        offset = (nonpad - q_len).reshape(-1, 1, 1, 1)
    else:
        offset = np.full((1, 1, 1, 1), past_len)
    allowed = _allowed(q_len, kv_len, offset, nonpad=nonpad, **structure)
    if allowed is not None:
        struct = np.where(allowed, 0, -np.inf).astype(ct)
        bias = struct if bias is None else bias + struct
    return bias


def _attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    attn_mask: np.ndarray | None,
    past_key: np.ndarray | None,
    past_value: np.ndarray | None,
    nonpad: np.ndarray | None,
    attrs: dict[str, Any],
    n_outputs: int,
) -> np.ndarray | tuple[np.ndarray, ...]:
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
        k4 = np.concatenate([past_key, k4], axis=2)
        v4 = np.concatenate([past_value, v4], axis=2)
    b, _, q_len, head = q4.shape
    kv_len = k4.shape[2]
    checks.check_heads(q4.shape, k4.shape, v4.shape)

    ct = _compute_dtype(q.dtype)
    scale = attrs["scale"]
    root = np.sqrt(1.0 / np.sqrt(head) if scale is None else scale)
    raw = _grouped_matmul(q4.astype(ct) * root, (k4.astype(ct) * root).swapaxes(-1, -2))
    softcap = attrs["softcap"]
    capped = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
    bias = _attention_bias(
        attn_mask, b, q_len, kv_len, past_len, nonpad, ct, is_causal=attrs["is_causal"],
        left=attrs["left_window_size"], right=attrs["right_window_size"],
    )  # fmt: skip
    logits = capped if bias is None else capped + bias
    sm_dtype = _softmax_dtype(attrs["softmax_precision"], ct)
    probs = _softmax(logits.astype(sm_dtype)).astype(ct)
    if bias is not None:  # a row with no allowed key gives zeros, decided on the bias alone
        probs = np.where(np.isneginf(np.max(bias, axis=-1, keepdims=True)), 0, probs)
    y = _grouped_matmul(probs, v4.astype(ct)).astype(q.dtype)
    if q.ndim == 3:
        y = _from_4d(y)
    if n_outputs <= 1:
        return y
    mode = attrs["qk_matmul_output_mode"]
    checks.check_qk_mode(mode)
    qk = (raw, capped, np.broadcast_to(logits, raw.shape), probs)[mode].astype(q.dtype)
    return (y, k4, v4, qk)[:n_outputs]


@register("Attention", since=23)
def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    attn_mask: np.ndarray | None = None,
    past_key: np.ndarray | None = None,
    past_value: np.ndarray | None = None,
    nonpad_kv_seqlen: np.ndarray | None = None,
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
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Scaled dot-product attention with mask, causal, GQA, KV cache and softcap (opset 23);
    opset 24 adds nonpad_kv_seqlen (external KV cache), opset 25 sliding windows. The newer
    inputs and attributes are absent from older nodes, so one kernel serves every version."""
    checks.check_windows(left_window_size, right_window_size)
    attrs = dict(locals())
    return _attention(q, k, v, attn_mask, past_key, past_value, nonpad_kv_seqlen, attrs, _n_outputs)


@register("RotaryEmbedding", since=23)
def rotary_embedding(
    x: np.ndarray,
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
    position_ids: np.ndarray | None = None,
    *,
    interleaved: int = 0,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
) -> np.ndarray:
    """Rotate the first rotary_embedding_dim features of each head (halves or even/odd pairs)."""
    dims = checks.rotary_dims(x.shape, num_heads)
    xs = x.transpose(0, 2, 1, 3) if x.ndim == 4 else x.reshape(dims)  # [B, S, H, D]
    if position_ids is not None:
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
    rot = checks.rotary_width(dims[-1], rotary_embedding_dim, cos_cache.shape, sin_cache.shape)
    ct = _compute_dtype(x.dtype)
    cos = cos_cache.astype(ct)[:, :, None, :]
    sin = sin_cache.astype(ct)[:, :, None, :]
    xr = xs[..., :rot].astype(ct)
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else np.split(xr, 2, axis=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rotated = np.stack([real, imag], axis=-1).reshape(xr.shape)
    else:
        rotated = np.concatenate([real, imag], axis=-1)
    out = np.concatenate([rotated.astype(x.dtype), xs[..., rot:]], axis=-1)
    return out.reshape(x.shape) if x.ndim == 3 else out.transpose(0, 2, 1, 3)


def _heads_last(x: np.ndarray, heads: int, name: str) -> np.ndarray:
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
        g = decay.reshape(b, t, hkv, -1).transpose(0, 2, 1, 3).astype(ct)
    if beta is not None:
        bt = beta.reshape(b, t, beta.shape[2], 1).transpose(0, 2, 1, 3).astype(ct)
    return g, bt


@register("LinearAttention", since=27)
def linear_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    past_state: np.ndarray | None = None,
    decay: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    *,
    chunk_size: int = 64,
    kv_num_heads: int | None = None,
    q_num_heads: int | None = None,
    scale: float = 0.0,
    update_rule: str = "gated_delta",
) -> tuple[np.ndarray, np.ndarray]:
    """Recurrent linear attention (linear / gated / delta / gated_delta state updates)."""
    gated, delta = checks.linear_rule(
        update_rule, q_num_heads, kv_num_heads, decay is not None, beta is not None
    )
    ct = _compute_dtype(query.dtype)
    q = _heads_last(query, q_num_heads, "query").astype(ct)
    k = _heads_last(key, kv_num_heads, "key").astype(ct)
    v = _heads_last(value, kv_num_heads, "value").astype(ct)
    b, _, t, dk = q.shape
    dv = v.shape[-1]
    g, bt = _linear_gates(decay, beta, b, t, kv_num_heads, dk, ct)
    checks.check_state(None if past_state is None else past_state.shape, (b, kv_num_heads, dk, dv))
    state = np.zeros((b, kv_num_heads, dk, dv), ct) if past_state is None else past_state.astype(ct)
    out = np.empty((b, q_num_heads, t, dv), ct)
    scale = scale or 1.0 / np.sqrt(dk)
    for i in range(t):  # the recurrence is inherently sequential
        kt, vt = k[:, :, i, :, None], v[:, :, i, None, :]  # [B, H, dk, 1], [B, H, 1, dv]
        if gated:
            state = state * np.exp(g[:, :, i, :, None])
        if delta:
            vt = bt[:, :, i, :, None] * (vt - np.matmul(kt.swapaxes(-1, -2), state))
        state = state + kt * vt
        out[:, :, i] = _grouped_matmul(q[:, :, i, None, :], state)[:, :, 0] * scale
    state_dtype = query.dtype if past_state is None else past_state.dtype
    return _from_4d(out).astype(query.dtype), state.astype(state_dtype)


def _run_mod(ctx: Any, graph: Any, x: np.ndarray, name: str) -> np.ndarray:
    if ctx is None:
        raise ValueError(f"FlexAttention's {name} subgraph needs an executor to run it")
    (out,) = ctx.run_graph(graph, [x])
    out = np.asarray(out)
    checks.check_mod(name, out.shape, x.shape)
    return out.astype(x.dtype)


@register("FlexAttention", domain="ai.onnx.preview", since=1)
def flex_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    prob_mod: Any = None,
    scale: float | None = None,
    score_mod: Any = None,
    softmax_precision: int | None = None,
    _ctx: Any = None,
) -> np.ndarray:
    """softmax(score_mod(Q K^T * scale)) -> prob_mod -> @ V, with GQA; the mods are subgraphs."""
    checks.check_flex(q.shape, k.shape, v.shape)
    ct = _compute_dtype(q.dtype)
    sm = _softmax_dtype(softmax_precision, ct)
    root = np.sqrt(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    scores = _grouped_matmul(q.astype(ct) * root, (k.astype(ct) * root).swapaxes(-1, -2))
    scores = scores.astype(sm)
    if score_mod is not None:
        scores = _run_mod(_ctx, score_mod, scores, "score_mod")
    probs = _softmax(scores)
    if prob_mod is not None:
        probs = _run_mod(_ctx, prob_mod, probs, "prob_mod")
    return _grouped_matmul(probs.astype(ct), v.astype(ct)).astype(q.dtype)
