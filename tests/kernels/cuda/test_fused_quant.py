"""The cuda backend's quantized convolution and GEMM against the numpy reference on fresh random
int8 and float8 operands (torch CPU tensors here; the same code runs on the GPU). Both sum the
quantized products exactly, so they agree to float32 rounding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = ml_dtypes.float8_e4m3fn


def _quantized(rng: np.random.Generator, shape: tuple, kind: str) -> np.ndarray:
    if kind == "int8":
        return rng.integers(-127, 128, shape).astype(np.int8)
    return np.clip(rng.standard_normal(shape) * 40, -448, 448).astype(FP8)


def _both(op: str, args: list, attrs: dict) -> tuple[np.ndarray, np.ndarray]:
    ref = invoke(lookup(op, "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    inputs = [None if a is None else to_torch(a, DEVICE) for a in args]
    got = to_numpy(invoke(lookup(op, "tensorkiln", 1, "cuda"), inputs, attrs, 1)[0])
    assert got.dtype == ref.dtype == np.float32 and got.shape == ref.shape
    return got, ref


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(
    ("x_shape", "w_shape", "attrs"),
    [
        ((2, 16, 9, 9), (8, 16, 3, 3), {"pads": [1, 1, 1, 1], "activation": "Relu"}),
        ((1, 8, 10, 10), (8, 1, 3, 3), {"group": 8, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
        ((2, 32, 5, 5), (12, 32, 1, 1), {"activation": "Clip", "activation_min": 0.0,
                                         "activation_max": 6.0}),
    ],
)  # fmt: skip
def test_qconv_act(kind, x_shape, w_shape, attrs) -> None:
    rng = np.random.default_rng()
    m = w_shape[0]
    args = [
        _quantized(rng, x_shape, kind),
        np.float32(rng.uniform(0.01, 0.1)),
        _quantized(rng, w_shape, kind),
        rng.uniform(1e-3, 1e-2, m).astype(np.float32),
        rng.standard_normal(m).astype(np.float32),
    ]
    got, ref = _both("QConvAct", args, attrs)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    # a residual: ResNet's act(conv + b + z)
    z = rng.standard_normal(ref.shape).astype(np.float32)
    got, ref = _both("QConvAct", [*args, z], attrs)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(
    ("a_shape", "b_shape", "attrs"),
    [
        ((7, 40), (24, 40), {"transB": 1, "activation": "Relu"}),
        ((2, 5, 64), (64, 16), {}),  # a MatMul's: (batch, sequence, hidden)
        ((40, 7), (40, 24), {"transA": 1, "alpha": 0.5, "beta": 2.0, "activation": "Gelu"}),
    ],
)
def test_qgemm_act(kind, a_shape, b_shape, attrs) -> None:
    rng = np.random.default_rng()
    n = b_shape[0] if attrs.get("transB") else b_shape[1]
    args = [
        _quantized(rng, a_shape, kind),
        np.float32(rng.uniform(0.01, 0.1)),
        _quantized(rng, b_shape, kind),
        rng.uniform(1e-3, 1e-2, n).astype(np.float32),
        rng.standard_normal(n).astype(np.float32),
    ]
    got, ref = _both("QGemmAct", args, attrs)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_float_operands_are_refused() -> None:
    x = to_torch(np.zeros((1, 2, 3, 3), np.float32), DEVICE)
    w = to_torch(np.zeros((2, 2, 1, 1), np.int8), DEVICE)
    s = to_torch(np.float32(1.0), DEVICE)
    with pytest.raises(ValueError, match="int8 or float8"):
        invoke(lookup("QConvAct", "tensorkiln", 1, "cuda"), [x, s, w, s], {}, 1)


@pytest.mark.parametrize("requantize", [False, True])
def test_the_exact_qconv_writes_the_layout_its_tactics_write(monkeypatch, requantize) -> None:
    """cuDNN computes float64 convolutions NCHW whatever the operands' layout (as torch asks it
    to); every tactic writes channels-last from a channels-last input or weight. The exact
    default follows the tactics, so the autotuner times each layer on the layout the engine
    will give it. (The NCHW float64 convolution is simulated on the CPU.)"""
    from tensorkiln.kernels.cuda import fused_quant

    real = fused_quant.conv_nd
    monkeypatch.setattr(fused_quant, "conv_nd", lambda *a: real(*a).contiguous())
    rng = np.random.default_rng()
    args = [
        _quantized(rng, (2, 16, 7, 7), "int8"),
        np.float32(rng.uniform(0.01, 0.1)),
        _quantized(rng, (24, 16, 3, 3), "int8"),
        rng.uniform(1e-3, 1e-2, 24).astype(np.float32),
        rng.standard_normal(24).astype(np.float32),
    ]
    attrs = {"pads": [1, 1, 1, 1], "strides": [2, 2], "activation": "Relu"}
    if requantize:
        args += [None, np.float32(0.05)]  # (no residual; Y_scale)
        attrs["out_dtype"] = 3
    want = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    inputs = [None if a is None else to_torch(a, DEVICE) for a in args]
    for i in (0, 2):
        inputs[i] = inputs[i].contiguous(memory_format=torch.channels_last)
    got = invoke(lookup("QConvAct", "tensorkiln", 1, "cuda"), inputs, attrs, 1)[0]
    assert got.is_contiguous(memory_format=torch.channels_last) and not got.is_contiguous()
    np.testing.assert_allclose(to_numpy(got).astype(np.float32), want.astype(np.float32),
                               rtol=1e-6, atol=1e-6 * np.abs(want.astype(np.float32)).max())  # fmt: skip
    plain = [
        None if a is None else to_torch(a, DEVICE) for a in args
    ]  # (NCHW operands: NCHW out, as before)
    assert invoke(lookup("QConvAct", "tensorkiln", 1, "cuda"), plain, attrs, 1)[0].is_contiguous()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_held_8_bit_weight_makes_the_stems_output_channels_last(monkeypatch, kind) -> None:
    """The cuda backend holds a convolution's 4-D weight channels-last, int8 as well as E4M3
    (backends/cuda.py's hold_conv_weight), so that a quantized stem reading an NCHW 8-bit image
    writes channels-last in either type, and every default kernel after it keeps that layout:
    the autotuner times an INT8 engine's tactics on the layout they will be given, as FP8's.
    Values against the reference backend's kernel."""
    from tensorkiln.backends.cuda import hold_conv_weight
    from tensorkiln.kernels.cuda import fused_quant

    real = fused_quant.conv_nd  # (cuDNN's float64 convolution writes NCHW: simulated here)
    monkeypatch.setattr(fused_quant, "conv_nd", lambda *a: real(*a).contiguous())
    rng = np.random.default_rng()
    args = [
        _quantized(rng, (2, 3, 16, 16), kind),
        np.float32(rng.uniform(0.01, 0.1)),
        _quantized(rng, (8, 3, 7, 7), kind),
        rng.uniform(1e-3, 1e-2, 8).astype(np.float32),
        rng.standard_normal(8).astype(np.float32),
        None,
        np.float32(0.05),
    ]
    attrs = {"pads": [3, 3, 3, 3], "strides": [2, 2], "activation": "Relu"}
    attrs["out_dtype"] = 3 if kind == "int8" else 17
    want = invoke(lookup("QConvAct", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    inputs = [None if a is None else to_torch(a, DEVICE) for a in args]
    assert inputs[0].is_contiguous()  # (the image as QuantizeLinear writes it: NCHW)
    held = hold_conv_weight(inputs[2])
    assert held.is_contiguous(memory_format=torch.channels_last) and not held.is_contiguous()
    assert torch.equal(held.view(torch.uint8), inputs[2].view(torch.uint8))
    inputs[2] = held
    got = invoke(lookup("QConvAct", "tensorkiln", 1, "cuda"), inputs, attrs, 1)[0]
    assert got.is_contiguous(memory_format=torch.channels_last) and not got.is_contiguous()
    assert np.array_equal(to_numpy(got).view(np.uint8), want.view(np.uint8))


def test_only_4_d_weights_are_held_channels_last() -> None:
    from tensorkiln.backends.cuda import hold_conv_weight

    w = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
    assert hold_conv_weight(w) is w
