"""The cuda backend's attention kernels against the numpy reference, on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

B, HQ, HKV, SQ, SKV, D, DV = 2, 4, 2, 5, 7, 8, 6


def _compare(op, args, attrs=None, *, opset=23, n_outputs=1, domain="", rtol=1e-5, atol=1e-5):
    attrs = attrs or {}
    ref = invoke(lookup(op, domain, opset, "reference"), args, attrs, n_outputs)
    got = invoke(lookup(op, domain, opset, "cuda"), [to_torch(a, DEVICE) for a in args], attrs,
                 n_outputs)  # fmt: skip
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        g = to_numpy(g)
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_allclose(g.astype(np.float64), r.astype(np.float64), rtol=rtol,
                                   atol=atol)  # fmt: skip
    return got


def _qkv(rng, hkv=HKV, sq=SQ, skv=SKV, dtype=np.float32):
    q = rng.standard_normal((B, HQ, sq, D)).astype(dtype)
    k = rng.standard_normal((B, hkv, skv, D)).astype(dtype)
    v = rng.standard_normal((B, hkv, skv, DV)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("hkv", [HQ, HKV, 1])
@pytest.mark.parametrize("is_causal", [0, 1])
def test_attention_sdpa_path(hkv, is_causal):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, hkv=hkv)
    pk, pv = _qkv(rng, hkv=hkv, skv=3)[1:]
    mask = rng.standard_normal((SQ, SKV + 3)).astype(np.float32)
    _compare("Attention", [q, k, v], {"is_causal": is_causal, "scale": 0.3})
    _compare("Attention", [q, k, v, mask, pk, pv], {"is_causal": is_causal}, n_outputs=3)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_qk_output_and_softcap(mode):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    mask = rng.random((B, 1, SQ, SKV)) > 0.3
    attrs = {"qk_matmul_output_mode": mode, "softcap": 2.5, "is_causal": 1}
    _compare("Attention", [q, k, v, mask], attrs, n_outputs=4)


def test_attention_3d_fp16_and_precision():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, dtype=np.float16)
    q3 = q.transpose(0, 2, 1, 3).reshape(B, SQ, HQ * D)
    k3 = k.transpose(0, 2, 1, 3).reshape(B, SKV, HKV * D)
    v3 = v.transpose(0, 2, 1, 3).reshape(B, SKV, HKV * DV)
    heads = {"q_num_heads": HQ, "kv_num_heads": HKV}
    _compare("Attention", [q3, k3, v3], heads, rtol=2e-3, atol=2e-3)
    _compare("Attention", [q3, k3, v3], {**heads, "softmax_precision": 10}, rtol=2e-3, atol=2e-3)


def test_attention_fully_masked_rows_are_zero():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    mask = rng.random((SQ, SKV)) > 0.5
    mask[1] = False
    y = _compare("Attention", [q, k, v, mask])[0]
    assert not torch.isnan(y).any() and (y[:, :, 1] == 0).all()


def test_attention_nonpad_and_windows():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, sq=2, skv=9)
    nonpad = np.array([4, 9], dtype=np.int64)
    mask = rng.standard_normal((2, 6)).astype(np.float32)  # shorter than the keys
    attrs = {"is_causal": 1, "left_window_size": 2, "right_window_size": 0}
    _compare("Attention", [q, k, v, mask, None, None, nonpad], attrs, opset=25)
    _compare("Attention", [q, k, v, None, None, None, nonpad], {"is_causal": 1}, opset=24)


def test_attention_non_contiguous_inputs():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng)
    args = [to_torch(x, DEVICE).transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v)]
    args[0] = to_torch(q.transpose(0, 2, 1, 3).copy(), DEVICE).transpose(1, 2)
    ref = lookup("Attention", "", 23).fn(q, k, v, is_causal=1)
    got = lookup("Attention", "", 23, "cuda").fn(*args, is_causal=1)
    np.testing.assert_allclose(to_numpy(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding(interleaved):
    rng = np.random.default_rng()
    x = rng.standard_normal((B, HQ, SQ, D)).astype(np.float16)
    cos = rng.standard_normal((10, 2)).astype(np.float16)
    sin = rng.standard_normal((10, 2)).astype(np.float16)
    pos = rng.integers(0, 10, (B, SQ)).astype(np.int64)
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": 4}
    _compare("RotaryEmbedding", [x, cos, sin, pos], attrs, rtol=1e-3, atol=1e-3)
    x3 = x.transpose(0, 2, 1, 3).reshape(B, SQ, HQ * D)
    cos, sin = (rng.standard_normal((B, SQ, 2)).astype(np.float16) for _ in range(2))
    _compare("RotaryEmbedding", [x3, cos, sin], {**attrs, "num_heads": HQ}, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_linear_attention(rule):
    rng = np.random.default_rng()
    t, dk, dv = 4, 3, 5
    q = rng.standard_normal((B, t, HQ * dk)).astype(np.float32)
    k = rng.standard_normal((B, t, HKV * dk)).astype(np.float32) * 0.5
    v = rng.standard_normal((B, t, HKV * dv)).astype(np.float32)
    past = rng.standard_normal((B, HKV, dk, dv)).astype(np.float32)
    decay = -rng.random((B, t, HKV)).astype(np.float32) if "gated" in rule else None
    beta = rng.random((B, t, 1)).astype(np.float32) if "delta" in rule else None
    attrs = {"q_num_heads": HQ, "kv_num_heads": HKV, "update_rule": rule}
    _compare("LinearAttention", [q, k, v, past, decay, beta], attrs, opset=27, n_outputs=2,
             rtol=1e-4, atol=1e-4)  # fmt: skip


def test_flex_attention_without_mods():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, dtype=np.float64)
    _compare("FlexAttention", [q, k, v], {"scale": 0.2}, domain="ai.onnx.preview", opset=1)
