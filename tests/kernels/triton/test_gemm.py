"""Triton GEMM tactics (GemmAct, Gemm, MatMul) against the numpy reference kernels.

Shapes are small and odd (masked edges, K not a multiple of the K step) because the interpreter is
slow; the large-shape test runs on the GPU only.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tensorkiln.kernels import triton as tk_triton  # noqa: E402
from tensorkiln.kernels.tactics import LayerSpec, get_tactic, tactics_for  # noqa: E402
from tensorkiln.kernels.triton import gemm  # noqa: E402
from tests.kernels.triton import DEVICE, check, rand  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
SMALL = "triton_gemm_64x64x64_w4_s4"
WIDE = "triton_gemm_128x64x64_w4_s4"
ACTS = [
    ("", {}),
    ("Relu", {}),
    ("LeakyRelu", {"activation_alpha": 0.2}),
    ("Clip", {"activation_min": -0.5, "activation_max": 1.0}),
    ("Clip", {"activation_max": 0.25}),
    ("Sigmoid", {}),
    ("Swish", {"activation_alpha": 1.5}),
    ("HardSigmoid", {}),
    ("HardSwish", {}),
    ("Gelu", {}),
    ("GeluTanh", {}),
    ("Tanh", {}),
]


def _gemm_act(a, b, c=None, **attrs):
    args = [a, b] if c is None else [a, b, c]
    return check("GemmAct", "tensorkiln", attrs.pop("tactic", SMALL), args, attrs)


@pytest.mark.parametrize(
    "act, params", ACTS, ids=[f"{a or 'none'}{i}" for i, (a, _) in enumerate(ACTS)]
)
def test_activations_float32(act, params):
    # values around zero and out to a few units: every activation's branches are taken
    _gemm_act(rand(37, 45), rand(45, 29), rand(29), alpha=0.75, activation=act, **params)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("act", ["", "Gelu", "Swish"])
def test_narrow_dtypes(dtype, act):
    _gemm_act(
        rand(70, 45, dtype=dtype), rand(45, 33, dtype=dtype), rand(33, dtype=dtype),
        activation=act, tactic=WIDE,
    )  # fmt: skip


@pytest.mark.parametrize("trans_a, trans_b", [(0, 1), (1, 0), (1, 1)])
def test_transposed_operands(trans_a, trans_b):
    a = rand(45, 37) if trans_a else rand(37, 45)
    b = rand(29, 45) if trans_b else rand(45, 29)
    _gemm_act(a, b, rand(37, 1), alpha=2.0, beta=0.5, transA=trans_a, transB=trans_b)


@pytest.mark.parametrize("c_shape", [(), (1,), (29,), (37, 29), (1, 29)])
def test_bias_broadcast(c_shape):
    _gemm_act(rand(37, 45), rand(45, 29), rand(*c_shape), beta=-1.5, activation="Relu")


def test_beta_zero_ignores_c():
    c = np.full((29,), np.nan, np.float32)
    _gemm_act(rand(37, 45), rand(45, 29), c, beta=0.0)


def test_batched_a_folds_into_rows():
    _gemm_act(rand(3, 7, 45), rand(45, 29), rand(1, 29), activation="GeluTanh")


def test_strided_operands():
    """Transposed views are read through their strides, not copied."""
    check(
        "GemmAct", "tensorkiln", SMALL, [rand(37, 45), rand(45, 29), rand(29)],
        {"activation": "Tanh"}, transform=lambda t: t.t().contiguous().t() if t.dim() == 2 else t,
    )  # fmt: skip


def test_plain_gemm():
    check("Gemm", "", SMALL, [rand(45, 37), rand(29, 45), rand(29)], {"transA": 1, "transB": 1})


def test_matmul_folded_and_batched():
    check("MatMul", "", SMALL, [rand(2, 3, 11, 45), rand(45, 29)])
    check("MatMul", "", SMALL, [rand(2, 1, 11, 45), rand(3, 45, 29)])
    check("MatMul", "", "triton_gemm_16x64x128_w4_s4", [rand(1, 3, 45), rand(2, 1, 45, 19)])


def test_every_config_runs():
    ran = set()
    for m, n in [(20, 70), (130, 130)]:  # few rows, then many (each config fits one of them)
        args = [rand(m, 70, dtype=np.float16), rand(70, n, dtype=np.float16)]
        spec = _spec("GemmAct", [a.shape for a in args], ("float16", "float16"))
        for t in tactics_for("GemmAct", "tensorkiln"):
            if t.name not in ran and t.applies(spec):
                check("GemmAct", "tensorkiln", t.name, args, {"activation": "Relu"})
                ran.add(t.name)
    assert ran == {f"triton_gemm_{c.name}" for c in gemm.CONFIGS}


def test_empty_rows():
    got = get_tactic("GemmAct", "tensorkiln", SMALL).fn(
        torch.zeros(0, 8, device=DEVICE), torch.ones(8, 5, device=DEVICE)
    )
    assert got.shape == (0, 5)


def test_tf32_precision_setting():
    assert tk_triton.fp32_dot_precision() == "ieee"
    tk_triton.set_fp32_dot_precision("tf32")
    try:
        assert gemm.dot_precision(torch.float32) == "tf32"
        assert gemm.dot_precision(torch.float16) == "tf32"
        a, b = torch.randn(20, 40, device=DEVICE), torch.randn(40, 24, device=DEVICE)
        got = gemm.matmul(a, b, config=gemm.CONFIGS[5])
        torch.testing.assert_close(got, a @ b, rtol=1e-2, atol=1e-2)
    finally:
        tk_triton.set_fp32_dot_precision("ieee")
    with pytest.raises(ValueError, match="ieee"):
        tk_triton.set_fp32_dot_precision("fast")


def _spec(op, shapes, dtypes, attrs=None, device=DEVICE, domain="tensorkiln"):
    return LayerSpec(op, domain, attrs or {}, tuple(shapes), tuple(dtypes), device=device)


def test_supports_rejects_what_the_kernel_does_not_take(monkeypatch):
    t = get_tactic("GemmAct", "tensorkiln", SMALL)
    f32 = ("float32", "float32")
    assert t.applies(_spec("GemmAct", [(8, 16), (16, 4)], f32))
    assert not t.applies(_spec("GemmAct", [(8, 16), (16, 4)], ("float64", "float64")))
    assert not t.applies(_spec("GemmAct", [(8, 16), (16, 4)], ("float16", "float32")))
    assert not t.applies(_spec("GemmAct", [(8, 16), (4, 16)], f32))  # K differs
    assert not t.applies(_spec("GemmAct", [(2, 8, 16), (16, 4)], f32, {"transA": 1}))
    assert not t.applies(_spec("GemmAct", [(8, 16), (16, 4)], f32, {"activation": "Elu"}))
    assert not t.applies(_spec("GemmAct", [(8, 16), (16, 4), (8,)], (*f32, "float32")))
    assert not t.applies(_spec("GemmAct", [(2, 8, 16), (16, 4), (8, 4)], (*f32, "float32")))
    assert not t.applies(_spec("GemmAct", [(8, 16), (16, 4)], f32, {"unknown": 1}))
    m = get_tactic("MatMul", "", SMALL)
    assert not m.applies(_spec("MatMul", [(16,), (16, 4)], f32, domain=""))
    assert not m.applies(_spec("MatMul", [(2, 8, 16), (3, 16, 4)], f32, domain=""))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not t.applies(_spec("GemmAct", [(8, 16), (16, 4)], f32, device="cpu"))
    assert t.applies(_spec("GemmAct", [(8, 16), (16, 4)], f32, device="cuda"))


def test_tile_pruning():
    """Tiles far larger than the problem, or too thin for a large one, are not offered."""
    shapes, f16 = [(4, 512), (512, 1024)], ("float16", "float16")
    names = {
        t.name
        for t in tactics_for("GemmAct", "tensorkiln")
        if t.applies(_spec("GemmAct", shapes, f16))
    }
    assert "triton_gemm_16x64x128_w4_s4" in names and "triton_gemm_128x256x64_w8_s3" not in names
    shapes = [(4096, 512), (512, 1024)]
    names = {
        t.name
        for t in tactics_for("GemmAct", "tensorkiln")
        if t.applies(_spec("GemmAct", shapes, f16))
    }
    assert "triton_gemm_128x256x64_w8_s3" in names and "triton_gemm_16x64x128_w4_s4" not in names
    f32 = ("float32", "float32")  # 128x256x64 in three stages overflows shared memory in float32
    names = {
        t.name
        for t in tactics_for("GemmAct", "tensorkiln")
        if t.applies(_spec("GemmAct", shapes, f32))
    }
    assert "triton_gemm_128x256x64_w8_s3" not in names


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["f16", "bf16", "f32"])
def test_large_on_gpu(dtype):
    """Every tactic that takes a BERT-sized GEMM, in float16; in bfloat16 and float32 the first
    three (each tactic compiles per dtype: all of them three times took most of a 90 s limit)."""
    args = [rand(4, 250, 768, dtype=dtype), rand(768, 1536, dtype=dtype), rand(1536, dtype=dtype)]
    spec = _spec("GemmAct", [a.shape for a in args], [a.dtype.name for a in args], device="cuda")
    taking = [t for t in tactics_for("GemmAct", "tensorkiln") if t.applies(spec)]
    assert taking
    for t in taking if dtype == np.float16 else taking[:3]:
        check("GemmAct", "tensorkiln", t.name, args, {"activation": "Gelu"}, device="cuda")
