"""The checks of Attention, RotaryEmbedding, LinearAttention and FlexAttention, written once for
both kernel trees.

They read shapes (tuples of ints: numpy shapes and torch.Size alike) and attributes, never values,
so the cuda kernels call them without a device synchronization. Each raises ValueError saying what
is wrong; the executor names the node.
"""

from __future__ import annotations

from collections.abc import Sequence

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
