"""The Triton max pool tactic (kernels/triton/pool.py) against the numpy reference kernel, on
fresh random inputs (through Triton's interpreter without a GPU).

Max pooling is exact in any float dtype, so the pool must equal the reference bit for bit:
channels-last and row-major inputs, pads, strides, dilations, ceil_mode, auto_pad, NaN; the
indices output goes to the default kernel.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402
from tensorkiln.kernels.tactics import get_tactic  # noqa: E402
from tests.kernels.triton import DEVICE, check, rand  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)

POOLS = [
    ((2, 8, 9, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 70, 7, 6), {"kernel_shape": [2, 2]}),
    ((2, 5, 8, 7), {"kernel_shape": [3, 2], "strides": [2, 1], "ceil_mode": 1}),
    ((1, 4, 9, 9), {"kernel_shape": [3, 3], "dilations": [2, 2], "pads": [2, 0, 1, 2]}),
    ((1, 3, 7, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
]


def _channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


def _reference_pool(x: np.ndarray, attrs: dict) -> np.ndarray:
    return invoke(lookup("MaxPool", "", 22, "reference"), [x], attrs, 1)[0]


@pytest.mark.parametrize("name", ["triton", "triton_p128"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("layout", ["channels_last", "row_major"])
@pytest.mark.parametrize("shape,attrs", POOLS)
def test_max_pool_equals_the_reference(shape, attrs, layout, dtype, name) -> None:
    x = rand(*shape).astype(dtype)
    transform = _channels_last if layout == "channels_last" else None
    got = check("MaxPool", "", name, [x], attrs, transform=transform)
    want = _reference_pool(x.astype(np.float32), attrs).astype(dtype)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_max_pool_keeps_the_layout_and_propagates_nan() -> None:
    x = rand(2, 16, 6, 6)
    x[1, 3, 2, 2] = np.nan
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    fn = get_tactic("MaxPool", "", "triton").fn
    t = _channels_last(to_torch(x, DEVICE))
    y = fn(t, **attrs)
    assert y.is_contiguous(memory_format=torch.channels_last)
    got, want = to_numpy(y), _reference_pool(x, attrs)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got).any()
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))


def test_max_pool_indices_output_goes_to_the_default_kernel() -> None:
    x = rand(1, 4, 6, 6)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    fn = get_tactic("MaxPool", "", "triton").fn
    y, idx = fn(to_torch(x, DEVICE), **attrs, _n_outputs=2)
    want_y, want_idx = invoke(lookup("MaxPool", "", 22, "reference"), [x], attrs, 2)
    np.testing.assert_array_equal(to_numpy(y), want_y)
    np.testing.assert_array_equal(to_numpy(idx), want_idx)


E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [np.dtype(np.int8), E4M3], ids=["int8", "e4m3"])
@pytest.mark.parametrize("shape,attrs", POOLS)
def test_max_pool_of_8_bit_tensors_equals_the_reference(shape, attrs, dtype) -> None:
    """A quantized engine pools its 8-bit tensors (the max commutes with quantizing): the Triton
    tactic and the cuda backend's default kernel (float16 inside for E4M3, which torch does not
    pool) give the reference kernel's values on the same 8-bit input, in its type."""
    wide = rand(*shape) * 40
    x = np.clip(np.rint(wide), -127, 127).astype(dtype) if dtype.kind == "i" else wide.astype(dtype)
    want = _reference_pool(x, attrs)
    assert want.dtype == dtype
    t = _channels_last(to_torch(x, DEVICE))
    for name in ("triton", "triton_p128", None):
        fn = get_tactic("MaxPool", "", name).fn if name else lookup("MaxPool", "", 22, "cuda").fn
        y = fn(t, **attrs)
        got = to_numpy(y)
        assert got.dtype == dtype, name
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
