"""Attention, RotaryEmbedding, LinearAttention and FlexAttention written once for both kernel
trees, with their checks.

The checks read shapes (tuples of ints: numpy shapes and torch.Size alike) and attributes, never
values, so the cuda kernels run them without a device synchronization; each raises ValueError
saying what is wrong (the executor names the node). The kernels (:class:`AttentionOps`) run over an
:class:`AttentionArrays` adapter each backend supplies: numpy in kernels/reference/attention.py,
torch in kernels/cuda/attention.py, whose ``fused`` hands Attention to SDPA's flash and
memory-efficient kernels where its semantics fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

# softmax_precision's TensorProto codes -> the dtype's name (numpy's and torch's spelling)
SOFTMAX_PRECISIONS = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}

Shape = Sequence[int]


def softmax_precision(precision: int | None) -> str | None:
    """The name of the softmax dtype ``precision`` asks for; None for the compute dtype."""
    if precision is None:
        return None
    if precision not in SOFTMAX_PRECISIONS:
        raise ValueError(
            f"softmax_precision {precision} unsupported; use 1 (FLOAT), 10 (FLOAT16), "
            "11 (DOUBLE) or 16 (BFLOAT16)"
        )
    return SOFTMAX_PRECISIONS[precision]


def split_heads(shape: Shape, num_heads: int | None, name: str) -> tuple[int, ...] | None:
    """For a [B, S, H*D] input, the [B, S, H, D] shape to view it as before moving the heads
    forward; None for a [B, H, S, D] input, which passes through."""
    shape = tuple(shape)
    if len(shape) == 4:
        if num_heads and num_heads != shape[1]:
            raise ValueError(
                f"{name} has {shape[1]} heads but the head count attribute says {num_heads}"
            )
        return None
    if len(shape) != 3:
        raise ValueError(f"{name} must be rank 3 or 4, got shape {shape}")
    if not num_heads or shape[2] % num_heads:
        raise ValueError(
            f"{name} is 3D {shape}: q_num_heads/kv_num_heads must be set and divide its "
            f"hidden size (got {num_heads})"
        )
    b, s, hidden = shape
    return (b, s, num_heads, hidden // num_heads)


def group(hq: int, hkv: int) -> int:
    """How many query heads share one K/V head."""
    if hq % hkv:
        raise ValueError(f"q_num_heads ({hq}) must be a multiple of kv_num_heads ({hkv})")
    return hq // hkv


def check_inputs(
    q: Shape, k: Shape, v: Shape, past_key: bool, past_value: bool, nonpad: bool
) -> None:
    """Attention's input combinations: equal ranks, a whole KV cache, no cache with nonpad."""
    if not len(q) == len(k) == len(v):
        raise ValueError(f"Q, K, V must have the same rank, got {tuple(q)}, {tuple(k)}, {tuple(v)}")
    if past_key != past_value:
        raise ValueError("past_key and past_value must be given together")
    if nonpad and past_key:
        raise ValueError("nonpad_kv_seqlen cannot be combined with past_key/past_value")


def check_heads(q4: Shape, k4: Shape, v4: Shape) -> None:
    """Q, K and V in [B, H, S, D] agree on the head size, and K and V on heads and length."""
    if k4[-1] != q4[-1] or tuple(v4[1:3]) != tuple(k4[1:3]):
        raise ValueError(f"incompatible Q/K/V heads: Q {tuple(q4)}, K {tuple(k4)}, V {tuple(v4)}")


def check_windows(left: int, right: int) -> None:
    if left < -1 or right < -1:
        raise ValueError(f"window sizes must be -1 or non-negative, got left={left}, right={right}")


def check_mask_length(mask_len: int, kv_len: int) -> None:
    if mask_len > kv_len:
        raise ValueError(
            f"attn_mask's last axis ({mask_len}) is longer than the total key length ({kv_len})"
        )


def check_qk_mode(mode: int) -> None:
    if mode not in (0, 1, 2, 3):
        raise ValueError(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {mode}")


def rotary_dims(shape: Shape, num_heads: int) -> tuple[int, ...]:
    """RotaryEmbedding's [B, S, H, D] view of its input; checks the rank and head count."""
    shape = tuple(shape)
    if len(shape) == 4:
        return (shape[0], shape[2], shape[1], shape[3])
    if len(shape) != 3:
        raise ValueError(f"input must be rank 3 or 4, got shape {shape}")
    if not num_heads or shape[2] % num_heads:
        raise ValueError(f"3D input {shape} needs num_heads dividing its hidden size")
    return (shape[0], shape[1], num_heads, shape[2] // num_heads)


def rotary_width(head: int, rotary_embedding_dim: int, cos: Shape, sin: Shape) -> int:
    """How many features of each head rotate; checks them against the cos/sin caches."""
    rot = rotary_embedding_dim or head
    if rot % 2 or rot > head:
        raise ValueError(f"rotary_embedding_dim {rot} must be even and at most head size {head}")
    if cos[-1] != rot // 2 or sin[-1] != rot // 2:
        raise ValueError(
            f"cos/sin caches' last axis ({cos[-1]}, {sin[-1]}) must be "
            f"rotary_embedding_dim / 2 = {rot // 2}"
        )
    return rot


def linear_rule(
    update_rule: str, q_heads: int | None, kv_heads: int | None, decay: bool, beta: bool
) -> tuple[bool, bool]:
    """LinearAttention's (gated, delta) flags; checks the heads and the inputs the rule needs."""
    if update_rule not in ("linear", "gated", "delta", "gated_delta"):
        raise ValueError(f"update_rule must be linear, gated, delta or gated_delta: {update_rule}")
    if not q_heads or not kv_heads or q_heads % kv_heads:
        raise ValueError(
            f"q_num_heads ({q_heads}) must be a positive multiple of kv_num_heads ({kv_heads})"
        )
    gated, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    if gated != decay or delta != beta:
        raise ValueError(
            f"update_rule '{update_rule}' needs {'decay' if gated else 'no decay'} and "
            f"{'beta' if delta else 'no beta'} input"
        )
    return gated, delta


def check_packed(shape: Shape, heads: int, name: str) -> None:
    """LinearAttention's inputs are [B, T, H*D]."""
    if len(shape) != 3 or shape[2] % heads:
        raise ValueError(f"{name} must be [B, T, {heads} * D], got shape {tuple(shape)}")


def check_gates(decay: Shape | None, beta: Shape | None, hkv: int, dk: int) -> None:
    """decay is [B, T, Hkv] or [B, T, Hkv*dk]; beta [B, T, Hkv] or [B, T, 1]."""
    if decay is not None and (len(decay) != 3 or decay[2] not in (hkv, hkv * dk)):
        raise ValueError(f"decay must be [B, T, {hkv}] or [B, T, {hkv * dk}], got {tuple(decay)}")
    if beta is not None and (len(beta) != 3 or beta[2] not in (hkv, 1)):
        raise ValueError(f"beta must be [B, T, {hkv}] or [B, T, 1], got {tuple(beta)}")


def check_state(state: Shape | None, expected: tuple[int, ...]) -> None:
    if state is not None and tuple(state) != expected:
        raise ValueError(f"past_state must be {expected}, got {tuple(state)}")


def check_flex(q: Shape, k: Shape, v: Shape) -> None:
    """FlexAttention takes rank-4 Q, K, V agreeing on head size, K/V heads and length."""
    if not len(q) == len(k) == len(v) == 4:
        raise ValueError(
            f"FlexAttention needs rank-4 Q, K, V; got {tuple(q)}, {tuple(k)}, {tuple(v)}"
        )
    if k[-1] != q[-1] or tuple(v[1:3]) != tuple(k[1:3]):
        raise ValueError(f"incompatible Q/K/V shapes {tuple(q)}, {tuple(k)}, {tuple(v)}")


def check_mod(name: str, out: Shape, x: Shape) -> None:
    """A FlexAttention mod subgraph keeps its input's shape."""
    if tuple(out) != tuple(x):
        raise ValueError(f"{name} must keep the shape {tuple(x)}, returned {tuple(out)}")


# ---------------------------------------------------------------------------------------------
# The kernels, written once over a backend's array operations


class AttentionArrays(Protocol):
    """The array operations the attention kernels need, on one backend's arrays."""

    m: Any  # the array module (numpy or torch): matmul, exp, tanh, where, isneginf

    def compute_dtype(self, x: Any) -> Any:
        """float64 for float64 inputs, else float32."""

    def dtype(self, name: str) -> Any:
        """The backend's dtype of that numpy name (float32, float16, float64, bfloat16)."""

    def astype(self, x: Any, dtype: Any) -> Any: ...

    def swap(self, x: Any, a: int, b: int) -> Any:
        """``x`` with axes ``a`` and ``b`` swapped."""

    def amax(self, x: Any) -> Any:
        """The maximum over the last axis, kept as an axis of size 1."""

    def sum(self, x: Any) -> Any:
        """The sum over the last axis, kept as an axis of size 1."""

    def cat(self, arrays: list[Any], axis: int) -> Any: ...

    def stack(self, arrays: list[Any], axis: int) -> Any: ...

    def broadcast_to(self, x: Any, shape: tuple[int, ...]) -> Any: ...

    def zeros(self, shape: tuple[int, ...], dtype: Any, like: Any) -> Any: ...

    def arange(self, n: int, like: Any) -> Any:
        """0, 1, ..., n - 1 as int64, where ``like`` lives."""

    def pad_last(self, x: Any, count: int, value: float) -> Any:
        """``x`` with ``count`` entries of ``value`` appended along its last axis."""

    def is_bool(self, x: Any) -> bool: ...

    def rows(self, table: Any, index: Any) -> Any:
        """``table[index]`` for an integer index array (RotaryEmbedding's position_ids)."""

    def key_lengths(self, nonpad: Any, batch: int, kv_len: int) -> Any:
        """nonpad_kv_seqlen as an int64 [batch] array (checked where its values are known)."""

    def fused(self, q4: Any, k4: Any, v4: Any, bias: Any, scale: float, out_dtype: Any) -> Any:
        """softmax(Q K^T * scale + bias) V by a fused kernel, or None to compute it explicitly."""


def _softmax(xp: AttentionArrays, x: Any) -> Any:
    """Softmax over the last axis; an all -inf row gives zeros, not NaN."""
    m = xp.amax(x)
    m = xp.m.where(xp.m.isneginf(m), 0, m)
    e = xp.m.exp(x - m)
    s = xp.sum(e)
    return e / xp.m.where(s == 0, 1, s)


class AttentionOps:
    """Attention, RotaryEmbedding, LinearAttention and FlexAttention over one backend's
    :class:`AttentionArrays` (register the bound methods).

    Internally Q is [batch, q_heads, q_len, head], K/V [batch, kv_heads, kv_len, head]. Grouped-query
    attention never materializes repeated K/V: Q is viewed as [batch, kv_heads, group, q_len, head]
    and multiplied against each K/V head once (query head h uses K/V head h // group). Arithmetic
    runs in float32 (float64 for float64 inputs) and the result is cast to the output dtype;
    float16/bfloat16 inputs are not rounded at every intermediate step, so the numpy oracle stays
    accurate for long sequences.
    """

    def __init__(self, xp: AttentionArrays) -> None:
        self.xp = xp

    def _softmax_dtype(self, precision: int | None, ct: Any) -> Any:
        name = softmax_precision(precision)
        return ct if name is None else self.xp.dtype(name)

    def _to_4d(self, x: Any, num_heads: int | None, name: str) -> Any:
        """[B, S, H*D] -> [B, H, S, D]; 4D inputs pass through."""
        split = split_heads(x.shape, num_heads, name)
        return x if split is None else self.xp.swap(x.reshape(split), 1, 2)

    def _from_4d(self, y: Any) -> Any:
        b, h, s, d = y.shape
        return self.xp.swap(y, 1, 2).reshape(b, s, h * d)

    def _grouped_matmul(self, a: Any, b: Any) -> Any:
        """a: [B, Hq, M, K] @ b: [B, Hkv, K, N] with query head h using kv head h // group."""
        bs, hq, m, k = a.shape
        hkv = b.shape[1]
        out = self.xp.m.matmul(a.reshape(bs, hkv, group(hq, hkv), m, k), b[:, :, None])
        return out.reshape(bs, hq, m, b.shape[-1])

    def _mask_bias(self, mask: Any, kv_len: int, ct: Any) -> Any:
        """attn_mask as an additive bias; a mask shorter than kv_len is padded as disallowed."""
        check_mask_length(mask.shape[-1], kv_len)
        xp = self.xp
        bias = xp.m.where(mask, 0.0, -math.inf) if xp.is_bool(mask) else mask
        bias = xp.astype(bias, ct)
        if mask.shape[-1] < kv_len:
            bias = xp.pad_last(bias, kv_len - mask.shape[-1], -math.inf)
        return bias

    def _structural_bias(
        self, q_len: int, kv_len: int, past_len: int, nonpad: Any, like: Any, ct: Any, **s: int
    ) -> Any:
        """Causal, sliding-window and key-padding mask as a [B|1, 1, q, kv] bias; None if none
        apply. Query 0 sits at absolute position ``past_len``, or ``nonpad[b] - q_len`` with an
        external cache."""
        if not (s["is_causal"] or s["left"] >= 0 or s["right"] >= 0 or nonpad is not None):
            return None
        xp = self.xp
        offset = past_len if nonpad is None else (nonpad - q_len).reshape(-1, 1, 1, 1)
        pos = xp.arange(q_len, like)[:, None] + offset  # absolute query positions
        j = xp.arange(kv_len, like)
        allowed = None
        for rule in (
            (j <= pos) if s["is_causal"] else None,
            (j >= pos - s["left"]) if s["left"] >= 0 else None,
            (j <= pos + s["right"]) if s["right"] >= 0 else None,
            (j < nonpad.reshape(-1, 1, 1, 1)) if nonpad is not None else None,
        ):
            if rule is not None:
                allowed = rule if allowed is None else allowed & rule
        if allowed.ndim < 4:
            allowed = allowed.reshape(1, 1, q_len, kv_len)
        return xp.astype(xp.m.where(allowed, 0.0, -math.inf), ct)

    def _explicit(self, q4, k4, v4, bias, attrs: dict[str, Any], ct) -> tuple[Any, tuple]:
        """matmul + softmax + matmul; also returns the qk stages (raw, capped, biased, probs)."""
        xp = self.xp
        scale = attrs["scale"]
        root = math.sqrt(1.0 / math.sqrt(q4.shape[-1]) if scale is None else scale)
        raw = self._grouped_matmul(
            xp.astype(q4, ct) * root, xp.swap(xp.astype(k4, ct) * root, -1, -2)
        )
        softcap = attrs["softcap"]
        capped = softcap * xp.m.tanh(raw / softcap) if softcap > 0 else raw
        logits = capped if bias is None else capped + bias
        sm_dtype = self._softmax_dtype(attrs["softmax_precision"], ct)
        probs = xp.astype(_softmax(xp, xp.astype(logits, sm_dtype)), ct)
        if bias is not None:  # a row with no allowed key gives zeros, decided on the bias alone
            probs = xp.m.where(xp.m.isneginf(xp.amax(bias)), 0, probs)
        y = self._grouped_matmul(probs, xp.astype(v4, ct))
        return y, (raw, capped, xp.broadcast_to(logits, raw.shape), probs)

    def _keys(self, k4: Any, v4: Any, past_key: Any, past_value: Any) -> tuple[Any, Any, int]:
        """K and V with the cache in front, and the cache's length."""
        if past_key is None:
            return k4, v4, 0
        xp = self.xp
        k4 = xp.cat([past_key, xp.astype(k4, past_key.dtype)], 2)
        v4 = xp.cat([past_value, xp.astype(v4, past_value.dtype)], 2)
        return k4, v4, past_key.shape[2]

    def attention(
        self,
        q: Any,
        k: Any,
        v: Any,
        attn_mask: Any = None,
        past_key: Any = None,
        past_value: Any = None,
        nonpad_kv_seqlen: Any = None,
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
    ) -> Any:
        """Scaled dot-product attention with mask, causal, GQA, KV cache and softcap (opset 23);
        opset 24 adds nonpad_kv_seqlen (an external KV cache) and masks shorter than the keys,
        opset 25 sliding windows. The newer inputs and attributes are absent from older nodes, so
        one kernel serves every version."""
        check_windows(left_window_size, right_window_size)
        has = (past_key is not None, past_value is not None, nonpad_kv_seqlen is not None)
        check_inputs(q.shape, k.shape, v.shape, *has)
        xp = self.xp
        q4 = self._to_4d(q, q_num_heads, "Q")
        k4, v4, past_len = self._keys(
            self._to_4d(k, kv_num_heads, "K"), self._to_4d(v, kv_num_heads, "V"),
            past_key, past_value,
        )  # fmt: skip
        check_heads(q4.shape, k4.shape, v4.shape)
        b, _, q_len, head = q4.shape
        kv_len = k4.shape[2]
        ct = xp.compute_dtype(q)
        nonpad = None
        if nonpad_kv_seqlen is not None:
            nonpad = xp.key_lengths(nonpad_kv_seqlen, b, kv_len)
        bias = None if attn_mask is None else self._mask_bias(attn_mask, kv_len, ct)
        struct = self._structural_bias(
            q_len, kv_len, past_len, nonpad, q, ct, is_causal=is_causal,
            left=left_window_size, right=right_window_size,
        )  # fmt: skip
        if struct is not None:
            bias = struct if bias is None else bias + struct
        y = qk = None
        fits = _n_outputs < 4 and softcap <= 0 and self._softmax_dtype(softmax_precision, ct) == ct
        if fits:
            y = xp.fused(q4, k4, v4, bias, 1.0 / math.sqrt(head) if scale is None else scale, ct)
        if y is None:
            attrs = {"scale": scale, "softcap": softcap, "softmax_precision": softmax_precision}
            y, qk = self._explicit(q4, k4, v4, bias, attrs, ct)
        y = xp.astype(y, q.dtype)
        if q.ndim == 3:
            y = self._from_4d(y)
        if _n_outputs <= 1:
            return y
        if qk is None:
            return (y, k4, v4)[:_n_outputs]
        check_qk_mode(qk_matmul_output_mode)
        return (y, k4, v4, xp.astype(qk[qk_matmul_output_mode], q.dtype))[:_n_outputs]

    def rotary_embedding(
        self,
        x: Any,
        cos_cache: Any,
        sin_cache: Any,
        position_ids: Any = None,
        *,
        interleaved: int = 0,
        num_heads: int = 0,
        rotary_embedding_dim: int = 0,
    ) -> Any:
        """Rotate the first rotary_embedding_dim features of each head (halves or even/odd
        pairs)."""
        xp = self.xp
        dims = rotary_dims(x.shape, num_heads)
        xs = xp.swap(x, 1, 2) if x.ndim == 4 else x.reshape(dims)  # [B, S, H, D]
        if position_ids is not None:
            cos_cache, sin_cache = (
                xp.rows(cos_cache, position_ids),
                xp.rows(sin_cache, position_ids),
            )
        rot = rotary_width(dims[-1], rotary_embedding_dim, cos_cache.shape, sin_cache.shape)
        ct = xp.compute_dtype(x)
        cos = xp.astype(cos_cache, ct)[:, :, None, :]
        sin = xp.astype(sin_cache, ct)[:, :, None, :]
        xr = xp.astype(xs[..., :rot], ct)
        if interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
        else:
            x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
        real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
        if interleaved:
            rotated = xp.stack([real, imag], -1).reshape(xr.shape)
        else:
            rotated = xp.cat([real, imag], -1)
        out = xp.cat([xp.astype(rotated, x.dtype), xs[..., rot:]], -1)
        return out.reshape(x.shape) if x.ndim == 3 else xp.swap(out, 1, 2)

    def _heads_last(self, x: Any, heads: int, name: str) -> Any:
        """[B, T, H*D] -> [B, H, T, D] for LinearAttention's packed inputs."""
        check_packed(x.shape, heads, name)
        return self._to_4d(x, heads, name)

    def _gates(self, decay: Any, beta: Any, b: int, t: int, hkv: int, dk: int, ct: Any):
        """decay -> [B, Hkv, T, dk|1] (log-space), beta -> [B, Hkv|1, T, 1]; None stays None."""
        check_gates(
            None if decay is None else decay.shape, None if beta is None else beta.shape, hkv, dk
        )
        xp = self.xp
        g = bt = None
        if decay is not None:
            g = xp.astype(xp.swap(decay.reshape(b, t, hkv, -1), 1, 2), ct)
        if beta is not None:
            bt = xp.astype(xp.swap(beta.reshape(b, t, beta.shape[2], 1), 1, 2), ct)
        return g, bt

    def linear_attention(
        self,
        query: Any,
        key: Any,
        value: Any,
        past_state: Any = None,
        decay: Any = None,
        beta: Any = None,
        *,
        chunk_size: int = 64,
        kv_num_heads: int | None = None,
        q_num_heads: int | None = None,
        scale: float = 0.0,
        update_rule: str = "gated_delta",
    ) -> tuple[Any, Any]:
        """Recurrent linear attention (linear / gated / delta / gated_delta state updates)."""
        gated, delta = linear_rule(
            update_rule, q_num_heads, kv_num_heads, decay is not None, beta is not None
        )
        xp = self.xp
        ct = xp.compute_dtype(query)
        q = xp.astype(self._heads_last(query, q_num_heads, "query"), ct)
        k = xp.astype(self._heads_last(key, kv_num_heads, "key"), ct)
        v = xp.astype(self._heads_last(value, kv_num_heads, "value"), ct)
        b, _, t, dk = q.shape
        dv = v.shape[-1]
        g, bt = self._gates(decay, beta, b, t, kv_num_heads, dk, ct)
        shape = (b, kv_num_heads, dk, dv)
        check_state(None if past_state is None else past_state.shape, shape)
        state = xp.zeros(shape, ct, query) if past_state is None else xp.astype(past_state, ct)
        scale = scale or 1.0 / math.sqrt(dk)
        outs = []
        for i in range(t):  # the recurrence is inherently sequential
            kt, vt = k[:, :, i, :, None], v[:, :, i, None, :]  # [B, H, dk, 1], [B, H, 1, dv]
            if gated:
                state = state * xp.m.exp(g[:, :, i, :, None])
            if delta:
                vt = bt[:, :, i, :, None] * (vt - xp.m.matmul(xp.swap(kt, -1, -2), state))
            state = state + kt * vt
            outs.append(self._grouped_matmul(q[:, :, i, None, :], state)[:, :, 0] * scale)
        out = xp.stack(outs, 2) if outs else xp.zeros((b, q_num_heads, 0, dv), ct, query)
        state_dtype = query.dtype if past_state is None else past_state.dtype
        return xp.astype(self._from_4d(out), query.dtype), xp.astype(state, state_dtype)

    def _run_mod(self, ctx: Any, graph: Any, x: Any, name: str) -> Any:
        if ctx is None:
            raise ValueError(f"FlexAttention's {name} subgraph needs an executor to run it")
        (out,) = ctx.run_graph(graph, [x])
        check_mod(name, out.shape, x.shape)
        return self.xp.astype(out, x.dtype)

    def flex_attention(
        self,
        q: Any,
        k: Any,
        v: Any,
        *,
        prob_mod: Any = None,
        scale: float | None = None,
        score_mod: Any = None,
        softmax_precision: int | None = None,
        _ctx: Any = None,
    ) -> Any:
        """softmax(score_mod(Q K^T * scale)) -> prob_mod -> @ V, with GQA; the mods are
        subgraphs."""
        check_flex(q.shape, k.shape, v.shape)
        xp = self.xp
        ct = xp.compute_dtype(q)
        sm = self._softmax_dtype(softmax_precision, ct)
        root = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
        scores = self._grouped_matmul(
            xp.astype(q, ct) * root, xp.swap(xp.astype(k, ct) * root, -1, -2)
        )
        scores = xp.astype(scores, sm)
        if score_mod is not None:
            scores = self._run_mod(_ctx, score_mod, scores, "score_mod")
        probs = _softmax(xp, scores)
        if prob_mod is not None:
            probs = self._run_mod(_ctx, prob_mod, probs, "prob_mod")
        return xp.astype(self._grouped_matmul(xp.astype(probs, ct), xp.astype(v, ct)), q.dtype)
