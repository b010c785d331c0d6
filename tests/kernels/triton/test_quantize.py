"""QuantizeLinear in one pass (kernels/triton/quantize.py) against the numpy reference, bit for
bit, on fresh random inputs with the hard cases mixed in: ties at .5, values past the range, -0,
E4M3 subnormals and NaN.

CPU tensors run through Triton's interpreter; on the GPU the same checks run on CUDA tensors.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.reference import quant as reference  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402
from tensorkiln.kernels.triton import quantize  # noqa: E402
from tests.kernels.triton import DEVICE  # noqa: E402

TARGETS = {  # numpy type, torch type, ONNX type
    "int8": (np.int8, torch.int8, 3),
    "uint8": (np.uint8, torch.uint8, 2),
    "e4m3": (ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn, 17),
}


def _input(shape, rng, scale: float, dtype) -> np.ndarray:
    """Normal values spread over the range and past it, with exact ties, zeros of both signs,
    tiny values (E4M3 subnormals after the division) and, for float8, NaN."""
    x = rng.standard_normal(shape) * 60 * scale
    flat = x.reshape(-1)
    n = flat.size
    picks = rng.choice(n, size=min(n, 64), replace=False)
    ties = (rng.integers(-140, 140, size=picks.size) + 0.5) * scale
    flat[picks[:16]] = ties[:16]
    flat[picks[16:20]] = [0.0, -0.0, 1e-3 * scale, -3e-3 * scale]
    flat[picks[20:24]] = [1e4 * scale, -1e4 * scale, 449 * scale, -470 * scale]
    return x.astype(dtype)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "flat"])
@pytest.mark.parametrize("x_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("zero_point", [None, "zero", "shifted"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_one_pass_equals_the_reference(target, zero_point, x_dtype, layout):
    rng = np.random.default_rng()
    np_t, torch_t, onnx_t = TARGETS[target]
    scale = np.array(rng.uniform(0.01, 0.2), dtype=np.float32)
    shape = (2, 8, 5, 3) if layout != "flat" else (77,)
    x = _input(shape, rng, float(scale), x_dtype)
    if target == "e4m3":
        x.reshape(-1)[3] = np.nan
    zp = None
    if zero_point is not None:
        shifted = zero_point == "shifted" and target != "e4m3"  # (float8 zero points are 0)
        value = {"int8": 7, "uint8": 128}.get(target, 0) if shifted else 0
        zp = np.array(value).astype(np_t)
    attrs = {"output_dtype": onnx_t} if zp is None else {}
    want = reference.quantize_linear(x, scale, zp, **attrs)
    assert want.dtype == np.dtype(np_t)
    tx = to_torch(x, DEVICE)
    if layout == "nhwc":
        tx = tx.contiguous(memory_format=torch.channels_last)
    tz = None if zp is None else to_torch(zp, DEVICE)
    ts = to_torch(scale, DEVICE)
    assert quantize.applies(tx, ts, tz, torch_t, True)
    y = quantize.quantize(tx, ts, tz, torch_t)
    assert y.dtype == torch_t and y.stride() == tx.stride()
    got = to_numpy(y)
    if target == "e4m3":
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(nan, np.isnan(got.astype(np.float32)))
        got, want = got[~nan], want[~nan]
    assert np.array_equal(_bits(got), _bits(want))

    # the registered cuda kernel gives the same values
    kernel = lookup("QuantizeLinear", "", 21, "cuda")
    again = to_numpy(invoke(kernel, [tx, ts, tz], attrs, 1)[0])
    if target == "e4m3":
        again = again[~np.isnan(again.astype(np.float32))]
    assert np.array_equal(_bits(again), _bits(got))


def test_cases_it_leaves_to_the_torch_composition():
    x = torch.randn(4, 6)
    s = torch.tensor(0.1)
    assert not quantize.applies(x, torch.tensor([0.1, 0.2]), None, torch.int8, True)  # per axis
    assert not quantize.applies(x, s.half(), None, torch.int8, True)  # divides in float16
    assert not quantize.applies(x.t(), s, None, torch.int8, True)  # not dense
    assert not quantize.applies(x.double(), s, None, torch.int8, True)
    assert not quantize.applies(x, s, None, torch.float8_e4m3fn, False)  # NaN on overflow
    assert not quantize.applies(x, s, torch.tensor(0, dtype=torch.uint8), torch.int8, True)
    assert not quantize.applies(x, s, None, torch.float8_e5m2, True)
    assert quantize.applies(x, s, None, torch.int8, True)


def _e4m3_hard_cases() -> np.ndarray:
    """Every finite E4M3 value, each midpoint between neighbours (ties, rounded to the even
    code) and the float32 values just either side of it, subnormals included, both signs; values
    past 448 up to float32's largest and infinity (saturated to 448); zeros of both signs; NaN."""
    codes = np.arange(0, 0x7F, dtype=np.uint8)  # (0x7F is NaN)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)
    near = [np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))]
    big = np.array([448.0, 449.0, 464.0, 465.0, 480.0, 1e4, 3.0e38, np.inf], np.float32)
    pos = np.concatenate([values, mids, *near, big])
    return np.concatenate([pos, -pos, np.array([0.0, -0.0, np.nan, -np.nan], np.float32)])


def test_every_e4m3_midpoint_rounds_as_the_reference():
    """Bit for bit against the reference at every rounding boundary of E4M3: on the GPU this is
    the hardware conversion, through the interpreter the integer one."""
    x = _e4m3_hard_cases()
    rng = np.random.default_rng()
    x = x[rng.permutation(x.size)]  # (in a fresh order: neighbours share no block)
    scale = np.array(1.0, np.float32)
    want = reference.quantize_linear(x, scale, None, output_dtype=17)
    got = to_numpy(quantize.quantize(to_torch(x, DEVICE), to_torch(scale, DEVICE), None,
                                     torch.float8_e4m3fn))  # fmt: skip
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    assert np.array_equal(_bits(got)[~nan], _bits(want)[~nan])


@pytest.mark.parametrize("target", ["int8", "e4m3"])
def test_the_division_rounds_as_ieee_at_every_scale(target):
    """x / scale is the correctly rounded quotient for scales that are not powers of two (on the
    GPU the kernels divide through the reciprocal and one correction): values placed at the
    target's rounding boundaries times the scale, where a quotient one float32 step off
    changes the code, and random ones, against the reference, bit for bit."""
    rng = np.random.default_rng()
    _, torch_t, onnx_t = TARGETS[target]
    for scale_value in rng.uniform(0.001, 3.0, size=6):
        scale = np.array(scale_value, np.float32)
        if target == "int8":
            grid = np.arange(-128, 128, dtype=np.float64) + 0.5
        else:
            grid = _e4m3_hard_cases().astype(np.float64)
            grid = grid[np.isfinite(grid)]
        ties = (grid * np.float64(scale)).astype(np.float32)  # (rounded: just off the boundary)
        nearby = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)),
                                 np.nextafter(ties, np.float32(-np.inf))])  # fmt: skip
        x = np.concatenate([nearby, (rng.standard_normal(4096) * 100 * scale).astype(np.float32)])
        x = x[rng.permutation(x.size)]
        want = reference.quantize_linear(x, scale, None, output_dtype=onnx_t)
        got = to_numpy(quantize.quantize(to_torch(x, DEVICE), to_torch(scale, DEVICE), None,
                                         torch_t))  # fmt: skip
        assert np.array_equal(_bits(got), _bits(want)), float(scale)


@pytest.mark.parametrize("out", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("source", ["int8", "e4m3"])
@pytest.mark.parametrize("layout", ["row_major", "channels_last"])
def test_widening_gives_the_numpy_values(source, out, layout):
    """widen: 8-bit values in a float type in one pass, exact, NaN codes kept, the input's
    layout kept; the oracle is numpy's (ml_dtypes') conversion of the same codes."""
    rng = np.random.default_rng()
    codes = rng.integers(0, 256, size=(3, 6, 5, 7), dtype=np.uint8)
    codes.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)  # (every code, NaN included)
    np_type = np.int8 if source == "int8" else ml_dtypes.float8_e4m3fn
    x = codes.view(np_type)
    t = to_torch(x, DEVICE)
    if layout == "channels_last":
        t = t.contiguous(memory_format=torch.channels_last)
    assert quantize.widen_applies(t, out)
    y = quantize.widen(t, out)
    assert y.dtype == out and y.stride() == t.stride()
    got = to_numpy(y.float())
    want = x.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))
    assert not quantize.widen_applies(t[:, :, ::2], out)  # (not dense: torch's cast)
    assert not quantize.widen_applies(t, torch.int32)


@pytest.mark.parametrize("source", ["int8", "e4m3"])
@pytest.mark.parametrize("layout", ["row_major", "channels_last", "strided"])
def test_padded_widening_adds_zero_channels(source, layout):
    """widen_padded: a 3-channel 8-bit image as float16 with a fourth, zero channel,
    channels-last, from any input layout; the oracle is numpy's (ml_dtypes') conversion of the
    same codes, padded by numpy."""
    rng = np.random.default_rng()
    codes = rng.integers(0, 256, size=(2, 3, 9, 11), dtype=np.uint8)
    np_type = np.int8 if source == "int8" else ml_dtypes.float8_e4m3fn
    x = codes.view(np_type)
    t = to_torch(x, DEVICE)
    if layout == "channels_last":
        t = t.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":  # (every other column of a wider image)
        wide = np.repeat(codes, 2, axis=3).view(np_type)
        t = to_torch(wide, DEVICE)[..., ::2]
        x = wide[..., ::2]
    y = quantize.widen_padded(t, torch.float16, 4)
    assert y.shape == (2, 4, 9, 11) and y.is_contiguous(memory_format=torch.channels_last)
    got = to_numpy(y.float())
    want = np.zeros((2, 4, 9, 11), np.float32)
    want[:, :3] = x.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))
    with pytest.raises(ValueError, match="at most 2 channels"):
        quantize.widen_padded(t, torch.float16, 2)
    with pytest.raises(ValueError, match="power of two"):
        quantize.widen_padded(t, torch.float16, 6)
