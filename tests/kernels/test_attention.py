"""Attention-family reference kernels against onnxruntime, torch and independent loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from tensorkiln.kernels.registry import lookup
from tests.kernels.ort_oracle import check_against_ort

B, HQ, HKV, SQ, SKV, D, DV = 2, 4, 2, 5, 7, 8, 6


def _qkv(rng, hkv=HKV, sq=SQ, skv=SKV, dtype=np.float32):
    q = rng.standard_normal((B, HQ, sq, D)).astype(dtype)
    k = rng.standard_normal((B, hkv, skv, D)).astype(dtype)
    v = rng.standard_normal((B, hkv, skv, DV)).astype(dtype)
    return q, k, v


def _attn(opset, *args, **attrs):
    return lookup("Attention", "", opset).fn(*args, **attrs)


@pytest.mark.parametrize("is_causal", [0, 1])
@pytest.mark.parametrize("hkv", [HQ, HKV, 1])
def test_attention_against_torch_sdpa(is_causal, hkv):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, hkv=hkv, skv=SQ)
    y = _attn(23, q, k, v, is_causal=is_causal, scale=0.3)
    rep = HQ // hkv
    kt = torch.from_numpy(k).repeat_interleave(rep, dim=1)
    vt = torch.from_numpy(v).repeat_interleave(rep, dim=1)
    expected = F.scaled_dot_product_attention(
        torch.from_numpy(q), kt, vt, is_causal=bool(is_causal), scale=0.3
    )
    np.testing.assert_allclose(y, expected.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_attention_mask_against_ort(mask_kind):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    if mask_kind == "bool":
        mask = rng.random((SQ, SKV)) > 0.3
        mask[:, 0] = True
    else:
        mask = rng.standard_normal((B, 1, SQ, SKV)).astype(np.float32)
    ins = {"Q": q, "K": k, "V": v, "attn_mask": mask}
    check_against_ort("Attention", ins, {"softcap": 2.0}, opset=23, rtol=1e-4, atol=1e-5)


def test_attention_3d_past_and_qk_output_against_ort():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    pk, pv = _qkv(rng, skv=3)[1:]
    ins = {
        "Q": q.transpose(0, 2, 1, 3).reshape(B, SQ, HQ * D),
        "K": k.transpose(0, 2, 1, 3).reshape(B, SKV, HKV * D),
        "V": v.transpose(0, 2, 1, 3).reshape(B, SKV, HKV * DV),
        "attn_mask": rng.standard_normal((SQ, SKV + 3)).astype(np.float32),
        "past_key": pk,
        "past_value": pv,
    }
    attrs = {"q_num_heads": HQ, "kv_num_heads": HKV}
    # mode 2 without causal: onnxruntime writes float32's lowest where the spec's bias is -inf
    for mode, causal in ((0, 1), (2, 0)):
        got = check_against_ort(
            "Attention", ins, {**attrs, "qk_matmul_output_mode": mode, "is_causal": causal},
            n_outputs=4, opset=23, rtol=1e-4, atol=1e-5,
        )  # fmt: skip
        assert got[1].shape == (B, HKV, SKV + 3, D)


def test_attention_fp16_against_ort():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, dtype=np.float16)
    ins = {"Q": q, "K": k, "V": v}
    check_against_ort("Attention", ins, {"is_causal": 1}, opset=23, rtol=5e-3, atol=5e-3)


def _naive_attention(q, k, v, allowed, scale):
    """Per (batch, head, query) loop over allowed keys, in float64."""
    out = np.zeros((*q.shape[:3], v.shape[-1]))
    rep = q.shape[1] // k.shape[1]
    for b, h, i in np.ndindex(*q.shape[:3]):
        keys = np.flatnonzero(allowed[b, h, i])
        if keys.size == 0:
            continue  # a fully masked row is zero
        s = np.array([q[b, h, i] @ k[b, h // rep, j] for j in keys], dtype=np.float64) * scale
        p = np.exp(s - s.max())
        out[b, h, i] = (p / p.sum()) @ v[b, h // rep, keys]
    return out


def test_attention_nonpad_causal_against_loop():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, sq=3, skv=8)
    nonpad = np.array([8, 2], dtype=np.int64)  # batch 1: offset -1, its first query sees nothing
    y = _attn(24, q, k, v, None, None, None, nonpad, is_causal=1)
    i = np.arange(3)[:, None]
    j = np.arange(8)
    allowed = np.stack([(j <= i + n - 3) & (j < n) for n in nonpad])[:, None]
    allowed = np.broadcast_to(allowed, (B, HQ, 3, 8))
    np.testing.assert_allclose(y, _naive_attention(q, k, v, allowed, D**-0.5), atol=1e-5)
    assert np.all(y[1, :, 0] == 0)


def test_attention_window_with_past_against_loop():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    pk, pv = _qkv(rng, skv=4)[1:]
    y, pres_k, _ = _attn(
        25, q, k, v, None, pk, pv, left_window_size=3, right_window_size=1, _n_outputs=3
    )
    pos = np.arange(SQ)[:, None] + 4
    j = np.arange(SKV + 4)
    allowed = np.broadcast_to((j >= pos - 3) & (j <= pos + 1), (B, HQ, SQ, SKV + 4))
    np.testing.assert_allclose(y, _naive_attention(q, pres_k, np.concatenate([pv, v], 2),
                                                   allowed, D**-0.5), atol=1e-5)  # fmt: skip


def test_attention_rejects_mismatched_heads():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, hkv=3)
    with pytest.raises(ValueError, match="multiple"):
        _attn(23, q, k, v)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rot_dim", [0, 4])
def test_rotary_embedding_against_ort(interleaved, rot_dim):
    rng = np.random.default_rng()
    x = rng.standard_normal((B, 3, SQ, D)).astype(np.float32)
    half = (rot_dim or D) // 2
    angles = rng.random((16, half)) * 6
    ins = {
        "X": x,
        "cos_cache": np.cos(angles).astype(np.float32),
        "sin_cache": np.sin(angles).astype(np.float32),
        "position_ids": rng.integers(0, 16, (B, SQ)),
    }
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": rot_dim}
    check_against_ort("RotaryEmbedding", ins, attrs, opset=23, rtol=1e-5, atol=1e-5)


def test_rotary_embedding_3d_without_positions_against_ort():
    rng = np.random.default_rng()
    x = rng.standard_normal((B, SQ, 3 * D)).astype(np.float32)
    angles = rng.random((B, SQ, D // 2)) * 6
    ins = {
        "X": x,
        "cos_cache": np.cos(angles).astype(np.float32),
        "sin_cache": np.sin(angles).astype(np.float32),
    }
    check_against_ort("RotaryEmbedding", ins, {"num_heads": 3}, opset=23, rtol=1e-5, atol=1e-5)


def _linear_attention_loop(q, k, v, rule, decay=None, beta=None, scale=None):
    """Per (batch, q-head) sequential recurrence in float64, straight from the spec's formulas."""
    b, t, hq, dk = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    out = np.zeros((b, t, hq, dv))
    scale = scale or dk**-0.5
    for bi, h in np.ndindex(b, hq):
        kh = h // (hq // hkv)
        s = np.zeros((dk, dv))
        for i in range(t):
            kt, vt = k[bi, i, kh].astype(np.float64), v[bi, i, kh].astype(np.float64)
            if rule in ("gated", "gated_delta"):
                s = np.exp(decay[bi, i, kh])[:, None] * s
            if rule in ("delta", "gated_delta"):
                s = s + beta[bi, i, kh] * np.outer(kt, vt - s.T @ kt)
            else:
                s = s + np.outer(kt, vt)
            out[bi, i, h] = scale * (q[bi, i, h] @ s)
    return out.reshape(b, t, hq * dv)


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_linear_attention_against_loop(rule):
    rng = np.random.default_rng()
    t, hq, hkv, dk, dv = 6, 4, 2, 5, 3
    q = rng.standard_normal((B, t, hq, dk)).astype(np.float32)
    k = rng.standard_normal((B, t, hkv, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, t, hkv, dv)).astype(np.float32)
    decay = -rng.random((B, t, hkv, dk)).astype(np.float32)
    beta = rng.random((B, t, hkv)).astype(np.float32)
    gated, delta = "gated" in rule, "delta" in rule
    fn = lookup("LinearAttention", "", 27).fn
    y, state = fn(
        q.reshape(B, t, -1), k.reshape(B, t, -1), v.reshape(B, t, -1), None,
        decay.reshape(B, t, -1) if gated else None, beta if delta else None,
        q_num_heads=hq, kv_num_heads=hkv, update_rule=rule,
    )  # fmt: skip
    expected = _linear_attention_loop(q, k, v, rule, decay, beta)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    assert state.shape == (B, hkv, dk, dv) and state.dtype == np.float32


def test_linear_attention_split_equals_whole():
    """Running the sequence in two calls, passing the state, equals one call."""
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((B, 6, 2 * 4)).astype(np.float32) for _ in range(3))
    beta = rng.random((B, 6, 1)).astype(np.float32)
    decay = -rng.random((B, 6, 2)).astype(np.float32)
    fn = lookup("LinearAttention", "", 27).fn
    kw = {"q_num_heads": 2, "kv_num_heads": 2}
    whole, s_whole = fn(q, k, v, None, decay, beta, **kw)
    first, s1 = fn(q[:, :2], k[:, :2], v[:, :2], None, decay[:, :2], beta[:, :2], **kw)
    second, s2 = fn(q[:, 2:], k[:, 2:], v[:, 2:], s1, decay[:, 2:], beta[:, 2:], **kw)
    np.testing.assert_allclose(np.concatenate([first, second], 1), whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s2, s_whole, rtol=1e-5, atol=1e-6)


def _flex(*args, **kw):
    return lookup("FlexAttention", "ai.onnx.preview", 1).fn(*args, **kw)


def test_flex_attention_against_torch_sdpa():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    y = _flex(q, k, v, scale=0.25)
    rep = HQ // HKV
    expected = F.scaled_dot_product_attention(
        torch.from_numpy(q), torch.from_numpy(k).repeat_interleave(rep, 1),
        torch.from_numpy(v).repeat_interleave(rep, 1), scale=0.25,
    )  # fmt: skip
    np.testing.assert_allclose(y, expected.numpy(), rtol=1e-5, atol=1e-5)


class _OnnxCtx:
    """Stands in for the executor: runs a GraphProto attribute with onnx's evaluator."""

    def run_graph(self, graph, inputs):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        feeds = dict(zip([i.name for i in graph.input], inputs))
        return ReferenceEvaluator(model).run(None, feeds)


def test_flex_attention_score_mod_causal_against_torch():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, hkv=HQ, skv=SQ)
    tri = np.triu(np.full((SQ, SQ), -np.inf, np.float32), 1)
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Add", ["s", "tri"], ["out"])], "causal",
        [info("s", TensorProto.FLOAT, None)], [info("out", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("tri", TensorProto.FLOAT, tri.shape, tri.ravel())],
    )  # fmt: skip
    y = _flex(q, k, v, score_mod=graph, _ctx=_OnnxCtx())
    expected = F.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)), is_causal=True)
    np.testing.assert_allclose(y, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_flex_attention_mod_without_executor_is_a_clear_error():
    rng = np.random.default_rng()
    with pytest.raises(ValueError, match="executor"):
        _flex(*_qkv(rng), prob_mod=object())
