"""The quantized layers' tensor-core tactics against the numpy reference (exact sums of the
quantized products): torch._int_mm and torch._scaled_mm GEMMs, the 1x1 convolution as an int8
GEMM, and the Triton implicit-GEMM convolution with int8 (int32 sums) and E4M3 operands (on a GPU
where there is one; else on CPU tensors: torch's CPU kernels and Triton's interpreter)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import mark_constant, to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402
from tensorkiln.kernels.tactics import LayerSpec, get_tactic  # noqa: E402
from tests.kernels.triton import DEVICE  # noqa: E402

FP8 = ml_dtypes.float8_e4m3fn


def _q(rng: np.random.Generator, shape: tuple, kind: str) -> np.ndarray:
    if kind == "int8":
        return rng.integers(-127, 128, shape).astype(np.int8)
    return np.clip(rng.standard_normal(shape) * 30, -448, 448).astype(FP8)


def _tol(kind: str, name: str = "") -> float:
    """The relative tolerance (of the output's largest value) a tactic's result keeps to the
    reference's exact float32 sums: int8 sums are exact integers; on a GPU, Hopper's E4M3 tensor
    cores add partial sums with fewer bits than float32 (the sums come out about 1e-4 of the
    largest value off) and cudnn_fp16 rounds its float16 output (5e-4); on the CPU both sum in
    float32."""
    if DEVICE == "cuda" and name.startswith("cudnn_fp16"):
        return 3e-3
    if kind == "int8":
        return 1e-6
    return 1e-3 if DEVICE == "cuda" else 1e-5


def _check(op: str, name: str, args: list, attrs: dict, *, channels_last: bool = False,
           rtol: float = 1e-5) -> None:  # fmt: skip
    tactic = get_tactic(op, "tensorkiln", name)
    assert tactic is not None, name
    spec = LayerSpec(op, "tensorkiln", attrs,
                     tuple(None if a is None else a.shape for a in args),
                     tuple(None if a is None else a.dtype.name for a in args), device="cuda")  # fmt: skip
    assert tactic.applies(spec), f"{name} does not take {spec}"
    ref = invoke(lookup(op, "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    tensors = [None if a is None else to_torch(a, DEVICE) for a in args]
    if channels_last:
        tensors[0] = tensors[0].contiguous(memory_format=torch.channels_last)
    got = to_numpy(tactic.fn(*tensors, **attrs))
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


def _as_engine_runs_it(name: str, args: list, attrs: dict) -> tuple[torch.Tensor, np.ndarray]:
    """QConvAct tactic ``name`` on tensors laid out as the cuda backend has them (the input,
    weight and residual channels-last), asserting it takes the layer; (its output, the
    reference's)."""
    tactic = get_tactic("QConvAct", "tensorkiln", name)
    spec = LayerSpec("QConvAct", "tensorkiln", attrs, tuple(np.shape(a) for a in args),
                     tuple(np.asarray(a).dtype.name for a in args), device="cuda")  # fmt: skip
    assert tactic is not None and tactic.applies(spec), name
    ref = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    tensors = [to_torch(np.asarray(a), DEVICE) for a in args]
    for i in (0, 2, 5):
        tensors[i] = tensors[i].contiguous(memory_format=torch.channels_last)
    return tactic.fn(*tensors, **attrs), ref


_TRITON_QGEMM = "triton_qgemm_64x64x64_w4_s4"


@pytest.mark.parametrize(("kind", "name"), [("int8", "cublas_int8_mm"),
                                           ("float8_e4m3fn", "cublas_fp8_scaled_mm"),
                                           ("int8", _TRITON_QGEMM),
                                           ("float8_e4m3fn", _TRITON_QGEMM)])  # fmt: skip
@pytest.mark.parametrize(
    ("a_shape", "attrs"),
    [((24, 64), {"activation": "Relu"}), ((3, 7, 32), {"alpha": 0.5}), ((5, 48), {}),
     ((40, 96), {"activation": "Gelu", "beta": 0.5})],
)  # fmt: skip
def test_qgemm_tensor_core_tactics(kind, name, a_shape, attrs) -> None:
    if name.startswith("triton"):
        pytest.importorskip("triton")
    rng = np.random.default_rng()
    k, n = a_shape[-1], 32
    args = [_q(rng, a_shape, "int8" if kind == "int8" else "fp8"),
            np.float32(rng.uniform(0.01, 0.1)),
            _q(rng, (n, k), "int8" if kind == "int8" else "fp8"),  # packed (N, K)
            rng.uniform(1e-3, 1e-2, n).astype(np.float32),
            rng.standard_normal(n).astype(np.float32)]  # fmt: skip
    _check("QGemmAct", name, args, {"transB": 1, **attrs}, rtol=_tol(kind))


def test_qgemm_tactics_refuse_what_they_cannot_run() -> None:
    tactic = get_tactic("QGemmAct", "tensorkiln", "cublas_int8_mm")
    int8 = ("int8", "float32", "int8", "float32")

    def spec(a, b, attrs, dtypes=int8):
        return LayerSpec(
            "QGemmAct", "tensorkiln", attrs, (a, (), b, (b[0],)), dtypes, device="cuda"
        )

    assert tactic.applies(spec((4, 64), (32, 64), {"transB": 1}))
    assert not tactic.applies(spec((4, 64), (64, 32), {"transB": 0}))  # an unpacked weight
    assert not tactic.applies(spec((4, 60), (32, 60), {"transB": 1}))  # K not a multiple of 8
    fp8 = ("float8_e4m3fn", "float32", "float8_e4m3fn", "float32")
    assert not tactic.applies(spec((4, 64), (32, 64), {"transB": 1}, fp8))


@pytest.mark.parametrize("residual", [False, True])
def test_pointwise_qconv_as_int8_gemm(residual) -> None:
    rng = np.random.default_rng()
    x = _q(rng, (2, 16, 5, 6), "int8")
    w = _q(rng, (24, 16, 1, 1), "int8")
    args = [x, np.float32(0.05), w, rng.uniform(1e-3, 1e-2, 24).astype(np.float32),
            rng.standard_normal(24).astype(np.float32)]  # fmt: skip
    if residual:
        args.append(rng.standard_normal((2, 24, 5, 6)).astype(np.float32))
    _check("QConvAct", "cublas_int8_mm", args, {"activation": "Relu"}, channels_last=True,
           rtol=1e-6)  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(
    ("x_shape", "w_shape", "attrs"),
    [
        ((1, 32, 7, 6), (32, 32, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 1],
                                         "activation": "Relu"}),
        ((2, 8, 5, 5), (16, 8, 3, 3), {"pads": [1, 0, 2, 1]}),  # few channels: im2col order
    ],
)  # fmt: skip
def test_triton_qconv(kind, x_shape, w_shape, attrs) -> None:
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    m = w_shape[0]
    args = [_q(rng, x_shape, kind), np.float32(0.04), _q(rng, w_shape, kind),
            rng.uniform(1e-3, 1e-2, m).astype(np.float32),
            rng.standard_normal(m).astype(np.float32)]  # fmt: skip
    _check("QConvAct", "triton_qconv_64x64x32_w4_s4", args, attrs, rtol=_tol(kind))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_triton_qconv_as_an_engine_runs_it(kind) -> None:
    """Channels-last activations and weights (as the cuda backend uploads a convolution's
    weight), a float16 residual and a float16 output written by the kernel itself, with a tiling
    for 8-bit operands."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    x_shape, w_shape = (2, 40, 6, 5), (128, 40, 3, 3)
    m = w_shape[0]
    args = [_q(rng, x_shape, kind), np.float32(0.04), _q(rng, w_shape, kind),
            rng.uniform(1e-3, 1e-2, m).astype(np.float32), rng.standard_normal(m).astype(np.float32),
            rng.standard_normal((2, m, 6, 5)).astype(np.float16)]  # fmt: skip
    attrs = {"pads": [1, 1, 1, 1], "activation": "Relu", "out_dtype": 10}
    y, ref = _as_engine_runs_it("triton_qconv_64x128x128_w4_s4", args, attrs)
    assert y.dtype == torch.float16 and y.is_contiguous(memory_format=torch.channels_last)
    got = to_numpy(y).astype(np.float32)
    assert ref.dtype == np.float16
    np.testing.assert_allclose(
        got, ref.astype(np.float32), rtol=1e-3, atol=1e-3 * np.abs(ref).max()
    )


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("residual", [False, True])
def test_qconv_through_the_float16_convolution(kind, residual) -> None:
    """cudnn_fp16: the 8-bit values convolved in a float type with the weight's scale folded in
    (float32 on the CPU, so the check is tight here; float16 on the GPU), X_scale, bias, residual
    and activation in the one-pass epilogue."""
    rng = np.random.default_rng()
    m = 24
    args = [_q(rng, (2, 16, 7, 6), kind), np.float32(0.03), _q(rng, (m, 8, 3, 3), kind),
            rng.uniform(1e-3, 1e-2, m).astype(np.float32),
            rng.standard_normal(m).astype(np.float32)]  # fmt: skip
    if residual:
        args.append(rng.standard_normal((2, m, 4, 6)).astype(np.float32))
    attrs = {"pads": [1, 1, 1, 1], "strides": [2, 1], "group": 2, "activation": "LeakyRelu"}
    _check("QConvAct", "cudnn_fp16", args, attrs, channels_last=True, rtol=_tol(kind, "cudnn_fp16"))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_qconv_of_a_three_channel_image_through_the_float16_convolution(kind, layout) -> None:
    """cudnn_fp16 on a stem (3 input channels, 7x7, stride 2): the image is widened into 4
    channels and the weight given a zero fourth channel; the result is the reference's
    convolution of the 3 channels, from either layout of the input."""
    rng = np.random.default_rng()
    m = 16
    args = [_q(rng, (2, 3, 20, 18), kind), np.float32(0.02), _q(rng, (m, 3, 7, 7), kind),
            rng.uniform(1e-3, 1e-2, m).astype(np.float32),
            rng.standard_normal(m).astype(np.float32)]  # fmt: skip
    attrs = {"pads": [3, 3, 3, 3], "strides": [2, 2], "activation": "Relu"}
    _check("QConvAct", "cudnn_fp16", args, attrs, channels_last=layout == "channels_last",
           rtol=_tol(kind, "cudnn_fp16"))  # fmt: skip


def test_the_float16_weight_is_prepared_once_per_weight() -> None:
    """cudnn_fp16 keeps the prepared weight of a constant weight tensor (a CUDA graph then
    replays the convolution alone) and prepares it again when the weight changes in place or
    another scale is given: every call matches the reference of its own operands."""
    from tensorkiln.kernels.cuda import convert

    rng = np.random.default_rng()
    m, attrs = 16, {"pads": [1, 1, 1, 1]}
    x = _q(rng, (2, 8, 5, 5), "int8")
    w = _q(rng, (m, 8, 3, 3), "int8")
    scales = [rng.uniform(1e-3, 1e-2, m).astype(np.float32) for _ in range(2)]
    tactic = get_tactic("QConvAct", "tensorkiln", "cudnn_fp16")
    xt, wt = to_torch(x, DEVICE), mark_constant(to_torch(w, DEVICE))
    st = [mark_constant(to_torch(s, DEVICE)) for s in scales]
    xs = to_torch(np.float32(0.02), DEVICE)
    reference = lookup("QConvAct", "tensorkiln", 1, "reference")

    def check(w_now: np.ndarray, scale: np.ndarray, got: torch.Tensor) -> None:
        ref = invoke(reference, [x, np.float32(0.02), w_now, scale], attrs, 1)[0]
        tol = _tol("int8", "cudnn_fp16")
        np.testing.assert_allclose(to_numpy(got), ref, rtol=tol, atol=tol * np.abs(ref).max())

    check(w, scales[0], tactic.fn(xt, xs, wt, st[0], **attrs))
    (kept,) = (v[1] for v in convert._KEPT[wt].values())
    check(w, scales[0], tactic.fn(xt, xs, wt, st[0], **attrs))
    assert next(iter(convert._KEPT[wt].values()))[1] is kept  # (not prepared again)
    check(w, scales[1], tactic.fn(xt, xs, wt, st[1], **attrs))  # another scale
    w2 = w.copy()
    w2[0] = -w2[0]
    wt.copy_(to_torch(w2, DEVICE))  # the weight changed in place
    check(w2, scales[1], tactic.fn(xt, xs, wt, st[1], **attrs))
    # a weight computed at run time (not an engine's constant) is never kept
    w3 = to_torch(w2, DEVICE)
    check(w2, scales[1], tactic.fn(xt, xs, w3, st[1], **attrs))
    assert w3 not in convert._KEPT


def _codes_agree(got: np.ndarray, want: np.ndarray) -> None:
    """Two quantized outputs (int8 codes or E4M3 values) computed from sums in different orders
    and precisions: int8 equal but for values on a rounding edge, one step apart; E4M3 (float32
    sums, coarser still on Hopper's FP8 tensor cores, against exact ones) within one step of the
    largest value and 2**-6 of the norm, few values apart."""
    assert got.dtype == want.dtype
    g, w = got.astype(np.float64), want.astype(np.float64)
    if want.dtype == np.int8:
        steps = np.abs(g - w)
        assert steps.max() <= 1 and (steps > 0).mean() < 0.02
    else:
        top = np.abs(w).max()
        assert np.abs(g - w).max() <= np.exp2(np.floor(np.log2(top)) - 3)
        assert np.linalg.norm(g - w) <= np.linalg.norm(w) / 64 and (g != w).mean() < 0.02
    assert len(np.unique(want)) > 16  # (not saturated: the check means something)


CONV_TACTICS = ["cublas_int8_mm", "cudnn_fp16", "triton_qconv_64x64x32_w4_s4"]


def _conv_case(kind: str, name: str | None) -> tuple[tuple[int, ...], dict]:
    """A 64-channel QConvAct of 32 channels for tactic ``name``: its weight's shape (1x1 for
    the int8 GEMM and for a name ending in ':1x1', else 3x3, padded) and attributes (ReLU);
    skips what the tactic cannot take."""
    if name == "cublas_int8_mm" and kind == "fp8":
        pytest.skip("the int8 GEMM takes int8 operands only")
    pytest.importorskip("triton")
    if name == "cublas_int8_mm" or (name or "").endswith(":1x1"):
        return (64, 32, 1, 1), {"activation": "Relu"}
    return (64, 32, 3, 3), {"activation": "Relu", "pads": [1, 1, 1, 1]}


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("name", CONV_TACTICS)
def test_qconv_tactics_write_the_quantized_output(kind, name) -> None:
    """With Y_scale (fuse_requantize), each tactic writes the next layer's 8-bit input from its
    epilogue; the reference quantizes its float32 result."""
    rng = np.random.default_rng()
    w_shape, attrs = _conv_case(kind, name)
    attrs["out_dtype"] = 3 if kind == "int8" else 17
    xs = np.float32(0.05)
    args = [_q(rng, (2, 32, 6, 5), kind), xs, _q(rng, w_shape, kind),
            rng.uniform(1e-3, 3e-3, 64).astype(np.float32),
            rng.standard_normal(64).astype(np.float32),
            rng.standard_normal((2, 64, 6, 5)).astype(np.float16)]  # fmt: skip
    ref_float = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args,
                       {**attrs, "out_dtype": 1}, 1)[0]  # fmt: skip
    y_scale = np.float32(np.abs(ref_float).max() / (127 if kind == "int8" else 448))
    args.append(y_scale)
    y, want = _as_engine_runs_it(name, args, attrs)
    _codes_agree(to_numpy(y), want)


@pytest.mark.parametrize(("kind", "name"), [("int8", "cublas_int8_mm"),
                                            ("float8_e4m3fn", "cublas_fp8_scaled_mm"),
                                            ("int8", _TRITON_QGEMM),
                                            ("float8_e4m3fn", _TRITON_QGEMM)])  # fmt: skip
def test_qgemm_tactics_write_the_quantized_output(kind, name) -> None:
    if name.startswith("triton"):
        pytest.importorskip("triton")
    rng = np.random.default_rng()
    q = "int8" if kind == "int8" else "fp8"
    attrs = {"transB": 1, "activation": "Relu", "out_dtype": 3 if kind == "int8" else 17}
    args = [_q(rng, (40, 64), q), np.float32(0.05), _q(rng, (48, 64), q),
            rng.uniform(1e-3, 3e-3, 48).astype(np.float32),
            rng.standard_normal(48).astype(np.float32)]  # fmt: skip
    ref_float = invoke(lookup("QGemmAct", "tensorkiln", 1, "reference"), args,
                       {**attrs, "out_dtype": 1}, 1)[0]  # fmt: skip
    args.append(np.float32(np.abs(ref_float).max() / (127 if kind == "int8" else 448)))
    tactic = get_tactic("QGemmAct", "tensorkiln", name)
    want = invoke(lookup("QGemmAct", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    got = to_numpy(tactic.fn(*[to_torch(np.asarray(a), DEVICE) for a in args], **attrs))
    _codes_agree(got, want)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("requantize", [False, True])
def test_pointwise_qconv_on_the_triton_gemm(kind, requantize) -> None:
    """triton_qconv on a 1x1 QConvAct of a channels-last input runs the Triton GEMM of the
    pixels: 8-bit operands, scale, bias, residual and ReLU in the epilogue, and with Y_scale the
    output written in 8 bits; against the reference."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    m, c = 128, 48
    attrs = {"activation": "Relu", "out_dtype": (3 if kind == "int8" else 17) if requantize else 1}
    args = [_q(rng, (2, c, 5, 6), kind), np.float32(0.05), _q(rng, (m, c, 1, 1), kind),
            rng.uniform(1e-3, 3e-3, m).astype(np.float32), rng.standard_normal(m).astype(np.float32),
            rng.standard_normal((2, m, 5, 6)).astype(np.float32)]  # fmt: skip
    if requantize:
        ref_float = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args,
                           {**attrs, "out_dtype": 1}, 1)[0]  # fmt: skip
        args.append(np.float32(np.abs(ref_float).max() / (127 if kind == "int8" else 448)))
    y, want = _as_engine_runs_it("triton_qconv_64x128x128_w4_s4", args, attrs)
    assert y.is_contiguous(memory_format=torch.channels_last)
    got = to_numpy(y)
    if requantize:
        _codes_agree(got, want)
    else:
        tol = _tol(kind)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_the_tilings_timed_for_a_large_int8_gemm_are_8_bit_ones() -> None:
    """The autotuner times the few best-estimated Triton tilings of a layer: for BERT-base's
    int8 GEMMs at batch 64 those are large tiles with deep K steps, not the fp16 tilings
    registered first (which were all it timed before the 8-bit tactics had an estimate)."""
    pytest.importorskip("triton")
    from tensorkiln.kernels.tactics import tactics_for
    from tensorkiln.tactics.autotune import _prune

    int8 = ("int8", "float32", "int8", "float32", "float16")
    for n, k in ((2304, 768), (768, 3072)):
        spec = LayerSpec("QGemmAct", "tensorkiln", {"transB": 1},
                         ((64, 128, k), (), (n, k), (n,), (n,)), int8, device="cuda")  # fmt: skip
        applicable = [t for t in tactics_for("QGemmAct", "tensorkiln") if t.applies(spec)]
        kept, _ = _prune(applicable, spec, 4)
        tiles = [t.name.removeprefix("triton_qgemm_") for t in kept if t.name.startswith("triton")]
        assert len(tiles) == 4, tiles
        for tile in tiles:
            bm, bn, bk = (int(d) for d in tile.split("_")[0].split("x"))
            assert bm >= 128 and bn >= 128 and bk >= 64, tiles


def _rowwise_args(rng: np.random.Generator, n: int = 48, k: int = 64) -> list:
    """A row-wise FP8 QGemmAct's inputs: E4M3 A (3, 7, k) and packed W (n, k), a per-tensor
    X_scale, per-column W_scale and a float16 bias."""
    return [_q(rng, (3, 7, k), "fp8"), np.float32(rng.uniform(0.01, 0.1)), _q(rng, (n, k), "fp8"),
            rng.uniform(1e-3, 1e-2, n).astype(np.float32),
            rng.standard_normal(n).astype(np.float16)]  # fmt: skip


def _spec_of(args: list, attrs: dict):
    """``spec(**changed_attrs)``: the QGemmAct LayerSpec of ``args`` on a GPU."""
    dtypes = tuple(np.asarray(a).dtype.name for a in args)
    shapes = tuple(np.shape(a) for a in args)
    return lambda **at: LayerSpec(
        "QGemmAct", "tensorkiln", {**attrs, **at}, shapes, dtypes, device="cuda"
    )


@pytest.mark.parametrize("out_dtype", [10, 16])
def test_the_rowwise_fp8_gemm_writes_16_bits_with_scales_and_bias_fused(out_dtype) -> None:
    """cublas_fp8_rowwise: E4M3 operands, the activation's scale per row and the weight's per
    column with alpha and the bias in the GEMM, fp16/bf16 out; against the reference to 16-bit
    rounding. It takes no activation, no Y_scale and no unpacked weight."""
    rng = np.random.default_rng()
    k = 64
    args = _rowwise_args(rng, k=k)
    attrs = {"transB": 1, "alpha": 0.5, "out_dtype": out_dtype}
    tactic = get_tactic("QGemmAct", "tensorkiln", "cublas_fp8_rowwise")
    spec = _spec_of(args, attrs)
    assert tactic.applies(spec())
    assert not tactic.applies(spec(activation="Relu"))
    assert not tactic.applies(spec(out_dtype=1))
    assert not tactic.applies(spec(transB=0))
    want = invoke(lookup("QGemmAct", "tensorkiln", 1, "reference"), args,
                  {**attrs, "out_dtype": 1}, 1)[0]  # fmt: skip
    tol = 1e-2 if out_dtype == 10 else 2e-2
    tensors = [to_torch(np.asarray(a), DEVICE) for a in args]
    got = tactic.fn(*tensors, **attrs)
    assert got.dtype == (torch.float16 if out_dtype == 10 else torch.bfloat16)
    np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=tol,
                               atol=tol * np.abs(want).max())  # fmt: skip
    # with the scales and bias an engine's constants, their row/column vectors are kept; a
    # second call at another batch (rows) still matches the reference
    for i in (1, 3, 4):
        mark_constant(tensors[i])
    for rows in ((3, 7), (5, 2)):
        a = _q(rng, (*rows, k), "fp8")
        want = invoke(lookup("QGemmAct", "tensorkiln", 1, "reference"), [a, *args[1:]],
                      {**attrs, "out_dtype": 1}, 1)[0]  # fmt: skip
        got = tactic.fn(to_torch(a, DEVICE), *tensors[1:], **attrs)
        np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=tol,
                                   atol=tol * np.abs(want).max())  # fmt: skip
    from tensorkiln.kernels.cuda import convert

    assert {("rows", 21), ("rows", 10)} <= set(convert._KEPT[tensors[1]])


@pytest.mark.parametrize("quantized", [False, True], ids=["fp16-out", "fp8-out"])
def test_the_rowwise_fp8_gemm_with_an_activation_finishes_in_one_pass(quantized) -> None:
    """cublas_fp8_rowwise_act: the row-wise GEMM writes 16 bits with the scales applied, then
    one Triton pass adds the bias, applies GELU and (with Y_scale) quantizes; against the
    reference QGemmAct: to 16-bit rounding, or within one step of the E4M3 grid. It leaves to
    cublas_fp8_rowwise the layers without an activation or a quantized output."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    args = _rowwise_args(rng)
    attrs = {"transB": 1, "alpha": 0.5, "activation": "Gelu", "out_dtype": 10}
    reference = lookup("QGemmAct", "tensorkiln", 1, "reference")
    wide = invoke(reference, args, {**attrs, "out_dtype": 1}, 1)[0]
    if quantized:
        args.append(np.float32(np.abs(wide).max() / 300))
        attrs["out_dtype"] = 17
    tactic = get_tactic("QGemmAct", "tensorkiln", "cublas_fp8_rowwise_act")
    spec = _spec_of(args, attrs)
    assert tactic.applies(spec())
    assert not tactic.applies(spec(transB=0))
    if not quantized:
        assert not tactic.applies(spec(activation=""))  # (cublas_fp8_rowwise's)
    want = invoke(reference, args, attrs, 1)[0]
    got = tactic.fn(*(to_torch(np.asarray(a), DEVICE) for a in args), **attrs)
    if quantized:
        assert got.dtype == torch.float8_e4m3fn
        got_v = got.float().cpu().numpy()
        want_v = want.astype(np.float32)
        # one E4M3 step (1/8 of the value's power of two, 2**-9 below 2**-6), plus what float16
        # rounding of the sums before the activation moves (2**-11 of them, in Y_scale's units):
        # near zero, where a GELU of cancelling sums lands, that is more than E4M3's fine steps
        step = np.exp2(np.floor(np.log2(np.maximum(np.abs(want_v), 2.0**-6))) - 3)
        rounding = 2.0**-10 * np.abs(wide).max() / args[5]
        assert (np.abs(got_v - want_v) <= step * 1.001 + rounding).all()
        assert (got_v == want_v).mean() > 0.9
    else:
        assert got.dtype == torch.float16
        np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=1e-2,
                                   atol=1e-2 * np.abs(want).max())  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_triton_tactics_take_a_per_tensor_weight_scale(kind) -> None:
    """The Triton kernels form X_scale * W_scale themselves: with one weight scale for all
    channels (read with a zero stride) as with one per channel; GEMM and convolution against
    the reference."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    q = "int8" if kind == "int8" else "fp8"
    gemm_args = [_q(rng, (40, 64), q), np.float32(0.05), _q(rng, (48, 64), q),
                 np.float32(rng.uniform(1e-3, 1e-2)), rng.standard_normal(48).astype(np.float32)]  # fmt: skip
    _check("QGemmAct", _TRITON_QGEMM, gemm_args, {"transB": 1, "alpha": 0.5}, rtol=_tol(kind))
    conv_args = [_q(rng, (2, 32, 6, 6), q), np.float32(0.04), _q(rng, (32, 32, 3, 3), q),
                 np.float32(rng.uniform(1e-3, 1e-2)), rng.standard_normal(32).astype(np.float32)]  # fmt: skip
    _check("QConvAct", "triton_qconv_64x64x32_w4_s4", conv_args, {"pads": [1, 1, 1, 1]},
           rtol=_tol(kind))  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("name", [*CONV_TACTICS, "triton_qconv_64x64x32_w4_s4:1x1", None])
def test_qconv_tactics_read_a_quantized_residual(kind, name) -> None:
    """With Z_scale (fuse_requantize's residual rule), the residual is int8 or E4M3 and read as
    Z * Z_scale: each tactic (and the cuda backend's exact default, None), channels-last as an
    engine runs it, agrees with the reference, whose result is the float layer's with the
    residual dequantized first (DequantizeLinear's reference kernel)."""
    rng = np.random.default_rng()
    w_shape, attrs = _conv_case(kind, name)
    z_q, z_scale = _q(rng, (2, 64, 6, 5), kind), np.float32(rng.uniform(0.01, 0.05))
    args = [_q(rng, (2, 32, 6, 5), kind), np.float32(0.05), _q(rng, w_shape, kind),
            rng.uniform(1e-3, 3e-3, 64).astype(np.float32),
            rng.standard_normal(64).astype(np.float32), z_q, None, z_scale]  # fmt: skip
    reference = lookup("QConvAct", "tensorkiln", 1, "reference")
    ref = invoke(reference, args, attrs, 1)[0]
    dq = invoke(lookup("DequantizeLinear", "", 21, "reference"), [z_q, z_scale], {}, 1)[0]
    np.testing.assert_array_equal(ref, invoke(reference, [*args[:5], dq], attrs, 1)[0])
    tensors = [None if a is None else to_torch(np.asarray(a), DEVICE) for a in args]
    for i in (0, 2, 5):
        tensors[i] = tensors[i].contiguous(memory_format=torch.channels_last)
    if name is None:
        fn = lookup("QConvAct", "tensorkiln", 1, "cuda").fn
    else:
        # (':1x1': the Triton convolution's channels-last 1x1 route, its GEMM kernel)
        tactic = get_tactic("QConvAct", "tensorkiln", name.split(":")[0])
        spec = LayerSpec("QConvAct", "tensorkiln", attrs,
                         tuple(None if a is None else np.shape(a) for a in args),
                         tuple(None if a is None else np.asarray(a).dtype.name for a in args),
                         device="cuda")  # fmt: skip
        assert tactic is not None and tactic.applies(spec), name
        fn = tactic.fn
    got = to_numpy(fn(*tensors, **attrs))
    tol = _tol(kind, name or "")
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


_TMA_3X3 = "triton_qconv3x3_128x64x64_w4_s3"


def _tma_3x3_case(kind: str, rng: np.random.Generator, oc: int = 48) -> tuple[list, dict]:
    """A 3x3 QConvAct of 32 channels, padded by 1 (the TMA kernel's), with a bias."""
    args = [_q(rng, (2, 32, 6, 5), kind), np.float32(0.05), _q(rng, (oc, 32, 3, 3), kind),
            rng.uniform(1e-3, 3e-3, oc).astype(np.float32),
            rng.standard_normal(oc).astype(np.float32)]  # fmt: skip
    return args, {"pads": [1, 1, 1, 1]}


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("activation", ["Relu", ""])
@pytest.mark.parametrize("name", [_TMA_3X3, "triton_qconv3x3_128x128x64_w8_s3"])
def test_the_tma_3x3_qconv_against_the_reference(kind, activation, name) -> None:
    """The TMA 3x3 convolution (kernels/triton/conv_tma.py): float32 out against the exact sums,
    48 output channels in a 64- or 128-wide tile (the columns past them masked), an input whose
    6 x 5 images make the taps cross image rows and images."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    args, attrs = _tma_3x3_case(kind, rng, oc=48 if name == _TMA_3X3 else 144)
    attrs["activation"] = activation
    _check("QConvAct", name, args, attrs, channels_last=True, rtol=_tol(kind))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_tma_3x3_qconv_writes_the_quantized_output(kind) -> None:
    """With Y_scale the TMA 3x3 convolution writes the next layer's 8-bit input, channels-last,
    as QuantizeLinear would code the reference's float32 result."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    args, attrs = _tma_3x3_case(kind, rng)
    attrs |= {"activation": "Relu", "out_dtype": 3 if kind == "int8" else 17}
    ref_float = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args,
                       {**attrs, "out_dtype": 1}, 1)[0]  # fmt: skip
    args += [None, np.float32(np.abs(ref_float).max() / (127 if kind == "int8" else 448))]
    want = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    tactic = get_tactic("QConvAct", "tensorkiln", _TMA_3X3)
    spec = LayerSpec("QConvAct", "tensorkiln", attrs,
                     tuple(None if a is None else np.shape(a) for a in args),
                     tuple(None if a is None else np.asarray(a).dtype.name for a in args),
                     device="cuda")  # fmt: skip
    assert tactic is not None and tactic.applies(spec)
    tensors = [None if a is None else to_torch(np.asarray(a), DEVICE) for a in args]
    for i in (0, 2):
        tensors[i] = tensors[i].contiguous(memory_format=torch.channels_last)
    y = tactic.fn(*tensors, **attrs)
    assert y.is_contiguous(memory_format=torch.channels_last)
    _codes_agree(to_numpy(y), want)


def test_the_tma_3x3_qconv_takes_only_its_convolutions() -> None:
    """Other strides, windows, paddings, dilations, groups, channel counts and a residual are
    another tactic's."""
    pytest.importorskip("triton")
    tactic = get_tactic("QConvAct", "tensorkiln", _TMA_3X3)
    base = {"pads": [1, 1, 1, 1]}

    def spec(x=(2, 32, 6, 5), w=(48, 32, 3, 3), attrs=base, dtype="int8", residual=False):
        shapes = (x, (), w, (w[0],), (w[0],), (x[0], w[0], *x[2:]) if residual else None)
        dtypes = (dtype, "float32", dtype, "float32", "float32", dtype if residual else None)
        return LayerSpec("QConvAct", "tensorkiln", attrs, shapes, dtypes, device="cuda")

    assert tactic.applies(spec()) and tactic.applies(spec(dtype="float8_e4m3fn"))
    for other in (spec(attrs={**base, "strides": [2, 2]}), spec(attrs={}),
                  spec(attrs={**base, "dilations": [2, 2]}), spec(w=(48, 32, 1, 1), attrs={}),
                  spec(x=(2, 24, 6, 5), w=(48, 24, 3, 3)), spec(w=(40, 32, 3, 3)),
                  spec(x=(2, 32, 6, 5), w=(48, 16, 3, 3), attrs={**base, "group": 2}),
                  spec(residual=True), spec(dtype="float16")):  # fmt: skip
        assert not tactic.applies(other), other


def test_the_tma_3x3_qconv_reads_views_at_any_offset_and_layout() -> None:
    """TMA reads dense rows from 16-byte aligned addresses: an input that is a view one byte
    into a buffer, or not channels-last, is copied first, and the result is the same."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    args, attrs = _tma_3x3_case("int8", rng)
    attrs["activation"] = "Relu"
    tactic = get_tactic("QConvAct", "tensorkiln", _TMA_3X3)
    tensors = [to_torch(np.asarray(a), DEVICE) for a in args]
    x = tensors[0].contiguous(memory_format=torch.channels_last)
    flat = torch.empty(x.numel() + 1, dtype=torch.int8, device=x.device)
    shifted = flat[1:].view(2, 6, 5, 32).permute(0, 3, 1, 2)  # (channels-last, one byte in)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 and shifted.is_contiguous(memory_format=torch.channels_last)
    want = to_numpy(tactic.fn(x, *tensors[1:], **attrs))
    for variant in (shifted, tensors[0]):  # (one byte in; channels-first)
        np.testing.assert_array_equal(to_numpy(tactic.fn(variant, *tensors[1:], **attrs)), want)
    ref = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    np.testing.assert_allclose(want, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _HOPPER, reason="the Gluon convolution runs on sm_90 only")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("activation", ["Relu", ""])
@pytest.mark.parametrize(("k", "stride"), [(3, 1), (3, 2), (1, 1), (1, 2)])
@pytest.mark.parametrize("residual", [False, True])
def test_the_gluon_qconv_against_the_reference(kind, activation, k, stride, residual) -> None:
    """Every gluon_qconv tiling that takes the layer (kernels/triton/conv_gluon.py), called as
    an engine calls it: 64 input channels, 80 output channels (past a 64-wide tile), 6 x 4
    images whose pixel blocks run past their rows and columns; with a quantized residual (read
    as Z * Z_scale) or none."""
    from tensorkiln.kernels.triton import conv_gluon

    rng = np.random.default_rng()
    args = [_q(rng, (3, 64, 6, 4), kind), np.float32(0.05), _q(rng, (80, 64, k, k), kind),
            rng.uniform(1e-3, 3e-3, 80).astype(np.float32),
            rng.standard_normal(80).astype(np.float32)]  # fmt: skip
    if residual:
        o = (6 // stride, 4 // stride)
        args += [_q(rng, (3, 80, *o), kind), None, np.float32(rng.uniform(0.01, 0.05))]
    p = k // 2
    attrs = {"pads": [p, p, p, p], "strides": [stride, stride], "activation": activation}
    taken = [c for c in conv_gluon.CONFIGS
             if c.block_k == 64 and c.block_n <= 80 and (kind == "fp8" or c.promote)]  # fmt: skip
    assert taken
    for cfg in taken:
        _check("QConvAct", f"gluon_qconv_{cfg.name}", args, attrs, channels_last=True,
               rtol=_tol(kind) if kind == "int8" else 2**-6)  # fmt: skip


_STEM = "triton_qconv_stem_64_w4_s4"
# (input channels, window, attributes): ResNet's stem, a 5 x 5 window padded unevenly at stride
# 1 over 4 channels, a one-channel 3 x 3 at stride (2, 1)
STEM_CASES = [
    (3, 7, {"pads": [3, 3, 3, 3], "strides": [2, 2], "activation": "Relu"}),
    (4, 5, {"pads": [2, 1, 1, 2], "strides": [1, 1]}),
    (1, 3, {"pads": [1, 1, 1, 1], "strides": [2, 1], "activation": "Relu"}),
]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize(("channels", "window", "attrs"), STEM_CASES)
def test_qconv_of_an_image_through_the_stem_kernel(kind, layout, channels, window, attrs) -> None:
    """triton_qconv_stem: the image packed into 4 channels with its padding, each window row one
    K step; against the reference's exact sums, from either layout of the input, with 24 output
    channels (a tile of 32: the last 8 computed, not written)."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    m = 24
    args = [_q(rng, (2, channels, 19, 18), kind), np.float32(0.02),
            _q(rng, (m, channels, window, window), kind),
            rng.uniform(1e-3, 1e-2, m).astype(np.float32),
            rng.standard_normal(m).astype(np.float32)]  # fmt: skip
    _check("QConvAct", _STEM, args, attrs, channels_last=layout == "channels_last",
           rtol=_tol(kind))  # fmt: skip


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("config", ["64_w4_s4", "128_w4_s3", "256_w8_s3"])
def test_the_stem_kernel_writes_the_quantized_output(kind, config) -> None:
    """With Y_scale, the stem kernel writes the next layer's 8-bit input (ResNet's stem: 3
    channels, 7 x 7 at stride 2, ReLU, 64 output channels), channels-last as the engine runs
    it, over more pixels than one tile of each configuration holds."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    m = 64
    attrs = {"pads": [3, 3, 3, 3], "strides": [2, 2], "activation": "Relu",
             "out_dtype": 3 if kind == "int8" else 17}  # fmt: skip
    args = [_q(rng, (2, 3, 30, 36), kind), np.float32(0.02), _q(rng, (m, 3, 7, 7), kind),
            rng.uniform(1e-3, 1e-2, m).astype(np.float32),
            rng.standard_normal(m).astype(np.float32)]  # fmt: skip
    ref_float = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args,
                       {**attrs, "out_dtype": 1}, 1)[0]  # fmt: skip
    args += [None, np.float32(np.abs(ref_float).max() / (127 if kind == "int8" else 448))]
    tactic = get_tactic("QConvAct", "tensorkiln", f"triton_qconv_stem_{config}")
    want = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    tensors = [None if a is None else to_torch(np.asarray(a), DEVICE) for a in args]
    tensors[2] = tensors[2].contiguous(memory_format=torch.channels_last)  # (as uploaded)
    y = tactic.fn(*tensors, **attrs)
    assert y.is_contiguous(memory_format=torch.channels_last)
    _codes_agree(to_numpy(y), want)


def _stem_pool_case(
    rng, kind: str, quantized: bool, window: int = 7
) -> tuple[list, dict, np.ndarray]:
    """The stem's operands (3 channels, 7 x 7 at stride 2, ReLU, 64 output channels) on a
    37 x 45 image (a 19 x 23 output, pooled to 10 x 12), and the reference's MaxPool of the
    reference's convolution; ``window`` 3: a 3 x 3 stem of stride 1 on a 19 x 23 image (the
    same output)."""
    m = 64
    attrs = {"pads": [3, 3, 3, 3], "strides": [2, 2], "activation": "Relu"}
    image = (2, 3, 37, 45)
    if window == 3:
        attrs, image = (
            {"pads": [1, 1, 1, 1], "strides": [1, 1], "activation": "Relu"},
            (2, 3, 19, 23),
        )
    args = [_q(rng, image, kind), np.float32(0.02), _q(rng, (m, 3, window, window), kind),
            rng.uniform(1e-3, 1e-2, m).astype(np.float32),
            rng.standard_normal(m).astype(np.float32)]  # fmt: skip
    conv = lookup("QConvAct", "tensorkiln", 1, "reference")
    if quantized:
        attrs["out_dtype"] = 3 if kind == "int8" else 17
        top = np.abs(invoke(conv, args, {**attrs, "out_dtype": 1}, 1)[0]).max()
        args += [None, np.float32(top / (127 if kind == "int8" else 448))]
    y = invoke(conv, args, attrs, 1)[0]
    pool = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    return args, attrs, invoke(lookup("MaxPool", "", 22, "reference"), [y], pool, 1)[0]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(
    ("quantized", "config"),
    [(True, (3, 8, 4, 3)), (False, (2, 16, 4, 2)), (True, (4, 64, 4, 3)),
     (True, (3, 16, 4, 2, True)), (False, (2, 8, 4, 1, True))],
)  # fmt: skip
def test_the_stem_and_its_pool_in_one_kernel(kind, quantized, config) -> None:
    """conv_stem_pool: ResNet's stem and its 3 x 3 max pool of stride 2 in one kernel, against
    the reference's convolution then its pool: pooled rows in bands of ``rows`` (the first
    band's top above the image, a band's last rows past it), pooled columns in tiles of
    ``block_p - 1`` (the first tile's halo left of the image, the next tiles' the previous
    tile's last column), the 8-bit output's codes or the float output; ``flat`` configurations
    (the last field) with the whole window one K step."""
    pytest.importorskip("triton")
    from tensorkiln.kernels.common.conv import conv_geometry
    from tensorkiln.kernels.triton import conv_stem
    from tensorkiln.kernels.triton.gemm import Epilogue

    rng = np.random.default_rng()
    args, attrs, want = _stem_pool_case(rng, kind, quantized)
    x, xs, w, ws, b = (to_torch(np.asarray(a), DEVICE) for a in args[:5])
    geom = conv_geometry(x.shape, w.shape, "NOTSET", None, None, attrs["pads"], attrs["strides"])
    out = {3: torch.int8, 17: torch.float8_e4m3fn}.get(attrs.get("out_dtype"), torch.float32)
    y_scale = to_torch(np.asarray(args[6]), DEVICE) if quantized else None
    got = conv_stem.conv_stem_pool(
        x, w.contiguous(memory_format=torch.channels_last), b, geom=geom, scale=(xs, ws),
        epilogue=Epilogue.of("Relu"), out_dtype=out, y_scale=y_scale,
        config=conv_stem.StemPoolConfig(*config),
    )  # fmt: skip
    assert got.shape == want.shape == (2, 64, 10, 12)
    assert got.is_contiguous(memory_format=torch.channels_last)
    if quantized:
        _codes_agree(to_numpy(got), want)
    else:
        tol = _tol(kind)
        np.testing.assert_allclose(to_numpy(got), want, rtol=tol, atol=tol * np.abs(want).max())


def test_a_flat_stem_configuration_refuses_a_window_past_its_k_step() -> None:
    """A flat configuration takes the whole window as one K step of at most FLAT_K values: a
    window of 9 rows (9 x 32 packed values) does not fit it (``fits``, which its tactic's
    support check asks) and is refused by name, while the configurations that loop over the
    window's rows take it: with none named, the first of them runs it."""
    pytest.importorskip("triton")
    from tensorkiln.kernels.common.conv import conv_geometry
    from tensorkiln.kernels.triton import conv_stem
    from tensorkiln.kernels.triton.gemm import Epilogue

    flat = next(c for c in conv_stem.POOL_CONFIGS if c.flat)
    assert conv_stem.fits(flat, (64, 3, 7, 7)) and not conv_stem.fits(flat, (64, 3, 9, 7))
    assert all(conv_stem.fits(c, (64, 3, 9, 7)) for c in conv_stem.POOL_CONFIGS if not c.flat)
    rng = np.random.default_rng()
    x = to_torch(_q(rng, (1, 3, 21, 21), "int8"), DEVICE)
    w = to_torch(_q(rng, (16, 3, 9, 7), "int8"), DEVICE)
    geom = conv_geometry(x.shape, w.shape, "NOTSET", None, None, [4, 3, 4, 3], [2, 2])
    one = torch.ones((), dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match=f"configuration.*{flat.rows}.*W \\(16, 3, 9, 7\\)"):
        conv_stem.conv_stem_pool(x, w, None, geom=geom, scale=(one, one),
                                 epilogue=Epilogue.of("Relu"), config=flat)  # fmt: skip
    # (no configuration named: the first that takes the window, against the reference's
    # convolution then its pool)
    xs, ws = np.float32(0.02), rng.uniform(1e-3, 1e-2, 16).astype(np.float32)
    got = conv_stem.conv_stem_pool(x, w, None, geom=geom, scale=(xs * one, to_torch(ws, DEVICE)),
                                   epilogue=Epilogue.of("Relu"))  # fmt: skip
    attrs = {"pads": [4, 3, 4, 3], "strides": [2, 2], "activation": "Relu"}
    conv = lookup("QConvAct", "tensorkiln", 1, "reference")
    y = invoke(conv, [to_numpy(x), xs, to_numpy(w), ws, None], attrs, 1)[0]
    pool = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    want = invoke(lookup("MaxPool", "", 22, "reference"), [y], pool, 1)[0]
    assert got.shape == want.shape
    tol = _tol("int8")
    np.testing.assert_allclose(to_numpy(got), want, rtol=tol, atol=tol * np.abs(want).max())


_POOL_ATTRS = {"pool_kernel_shape": [3, 3], "pool_strides": [2, 2], "pool_pads": [1, 1, 1, 1]}


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(("quantized", "window"), [(True, 7), (False, 7), (True, 3)])
def test_every_tactic_of_a_stem_with_its_pool(kind, quantized, window) -> None:
    """tensorkiln.QConvPool (passes/fuse_qdq.py's fuse_stem_pool makes it): its reference kernel
    is the reference's convolution then its pool, and each of its cuda tactics (the stem-pool
    kernel's configurations; the stem kernels and cuDNN's float16 route each followed by the
    pool's Triton kernel) takes ResNet's stem and computes the same, from a channels-last
    weight as the engine uploads it."""
    pytest.importorskip("triton")
    from tensorkiln.kernels.tactics import tactics_for

    rng = np.random.default_rng()
    args, attrs, want = _stem_pool_case(rng, kind, quantized, window)
    attrs = {**attrs, **_POOL_ATTRS}
    ref = invoke(lookup("QConvPool", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    assert ref.dtype == want.dtype and np.array_equal(ref.view(np.uint8), want.view(np.uint8))
    spec = LayerSpec("QConvPool", "tensorkiln", attrs,
                     tuple(None if a is None else np.shape(a) for a in args),
                     tuple(None if a is None else np.asarray(a).dtype.name for a in args),
                     device="cuda")  # fmt: skip
    names = [t.name for t in tactics_for("QConvPool", "tensorkiln") if t.applies(spec)]
    assert len(names) == 9, names  # (5 fused, 3 stem kernels + pool, cudnn_fp16 + pool)
    tensors = [None if a is None else to_torch(np.asarray(a), DEVICE) for a in args]
    tensors[2] = tensors[2].contiguous(memory_format=torch.channels_last)
    for name in names:
        got = to_numpy(get_tactic("QConvPool", "tensorkiln", name).fn(*tensors, **attrs))
        assert got.shape == want.shape == (2, 64, 10, 12), name
        if quantized:
            _codes_agree(got, want)
        else:
            tol = _tol(kind, name)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(),
                                       err_msg=name)  # fmt: skip


def test_a_stem_pool_tactic_leaves_out_what_it_does_not_take() -> None:
    """The fused kernel takes only ResNet's pool after a ReLU; the two-kernel tactics take any
    pool after what their convolution takes."""
    pytest.importorskip("triton")
    rng = np.random.default_rng()
    args, attrs, _ = _stem_pool_case(rng, "int8", True)

    def takes(name: str, **change) -> bool:
        a = {**attrs, **_POOL_ATTRS, **change}
        spec = LayerSpec("QConvPool", "tensorkiln", a,
                         tuple(None if x is None else np.shape(x) for x in args),
                         tuple(None if x is None else np.asarray(x).dtype.name for x in args),
                         device="cuda")  # fmt: skip
        return get_tactic("QConvPool", "tensorkiln", name).applies(spec)

    fused, chained = "triton_qconv_stem_pool_r4_p64_w4_s3", "triton_qconv_stem_64_w4_s4+pool"
    assert takes(fused) and takes(chained)
    assert not takes(fused, pool_strides=[1, 1]) and takes(chained, pool_strides=[1, 1])
    assert not takes(fused, activation="Sigmoid") and takes(chained, activation="Sigmoid")
    assert not takes(chained, group=3)


def test_the_stem_pool_kernel_takes_only_resnets_pool_after_relu() -> None:
    from tensorkiln.kernels.common.stem import POOL, fuses_pool

    pool = dict(POOL)
    assert fuses_pool(pool, "Relu")
    assert not fuses_pool(pool, "")  # (negative values: -inf pads)
    for change in ({"kernel_shape": (2, 2)}, {"strides": (1, 1)}, {"pads": (0, 0, 1, 1)},
                   {"ceil_mode": 1}, {"dilations": (2, 2)}, {"auto_pad": "SAME_UPPER"},
                   {"storage_order": 1}):  # fmt: skip
        assert not fuses_pool({**pool, **change}, "Relu"), change


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "attrs", "residual"),
    [
        ((2, 5, 12, 12), (16, 5, 3, 3), {"pads": [1, 1, 1, 1]}, False),  # (5 channels)
        ((2, 3, 12, 12), (16, 3, 9, 9), {"pads": [4, 4, 4, 4]}, False),  # (9 wide)
        ((2, 4, 12, 12), (16, 2, 3, 3), {"group": 2}, False),
        ((2, 3, 12, 12), (16, 3, 3, 3), {"dilations": [2, 2]}, False),
        ((2, 3, 12, 12), (512, 3, 3, 3), {}, False),  # (more output channels than a tile)
        ((2, 3, 12, 12), (16, 3, 3, 3), {"pads": [1, 1, 1, 1]}, True),
    ],
)
def test_the_stem_kernel_leaves_out_what_it_does_not_take(x_shape, w_shape, attrs, residual):
    pytest.importorskip("triton")
    tactic = get_tactic("QConvAct", "tensorkiln", _STEM)
    shapes = [x_shape, (), w_shape, (w_shape[0],), (w_shape[0],)]
    dtypes = ["int8", "float32", "int8", "float32", "float32"]
    if residual:
        shapes.append((x_shape[0], w_shape[0], *x_shape[2:]))
        dtypes.append("float32")
    spec = LayerSpec("QConvAct", "tensorkiln", attrs, tuple(shapes), tuple(dtypes), device="cuda")
    assert not tactic.applies(spec)
    ok = LayerSpec("QConvAct", "tensorkiln", {"pads": [1, 1, 1, 1]},
                   ((2, 3, 12, 12), (), (16, 3, 3, 3), (16,), (16,)),
                   ("int8", "float32", "int8", "float32", "float32"), device="cuda")  # fmt: skip
    assert tactic.applies(ok)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_the_stem_kernels_packed_image(kind, layout) -> None:
    """pack_image: (N, height, width, 4) of the input's type, each value at its place past the
    top and left margins, zeros in the margins and the fourth channel."""
    pytest.importorskip("triton")
    from tensorkiln.kernels.triton import conv_stem

    rng = np.random.default_rng()
    x = _q(rng, (2, 3, 9, 7), kind)
    xt = to_torch(x, DEVICE)
    if layout == "channels_last":
        xt = xt.contiguous(memory_format=torch.channels_last)
    got = to_numpy(conv_stem.pack_image(xt, 2, 3, 13, 16))
    want = np.zeros((2, 13, 16, 4), dtype=x.dtype)
    want[:, 2:11, 3:10, :3] = x.transpose(0, 2, 3, 1)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    with pytest.raises(ValueError, match="does not hold"):
        conv_stem.pack_image(xt, 2, 3, 10, 16)
    with pytest.raises(ValueError, match="at most 4 channels"):
        conv_stem.pack_image(to_torch(_q(rng, (1, 5, 4, 4), kind), DEVICE), 0, 0, 4, 4)


def test_the_stem_kernels_weight_is_packed_once_per_weight() -> None:
    """The packed weight of a constant weight tensor is kept (a CUDA graph replays the image's
    packing and the convolution alone), and packed again when the weight changes in place."""
    pytest.importorskip("triton")
    from tensorkiln.kernels.cuda import convert

    rng = np.random.default_rng()
    m, attrs = 16, {"pads": [3, 3, 3, 3], "strides": [2, 2]}
    x = _q(rng, (1, 3, 11, 10), "int8")
    w = _q(rng, (m, 3, 7, 7), "int8")
    scale = rng.uniform(1e-3, 1e-2, m).astype(np.float32)
    tactic = get_tactic("QConvAct", "tensorkiln", _STEM)
    xt, wt = to_torch(x, DEVICE), mark_constant(to_torch(w, DEVICE))
    st, xs = mark_constant(to_torch(scale, DEVICE)), to_torch(np.float32(0.02), DEVICE)
    reference = lookup("QConvAct", "tensorkiln", 1, "reference")

    def check(w_now: np.ndarray, got: torch.Tensor) -> None:
        ref = invoke(reference, [x, np.float32(0.02), w_now, scale], attrs, 1)[0]
        np.testing.assert_allclose(to_numpy(got), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())

    check(w, tactic.fn(xt, xs, wt, st, **attrs))
    packed = [v[1] for v in convert._KEPT[wt].values()]
    check(w, tactic.fn(xt, xs, wt, st, **attrs))
    assert [v[1] for v in convert._KEPT[wt].values()] == packed  # (not packed again)
    w2 = w.copy()
    w2[0] = -w2[0]
    wt.copy_(to_torch(w2, DEVICE))  # the weight changed in place
    check(w2, tactic.fn(xt, xs, wt, st, **attrs))
