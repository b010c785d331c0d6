"""The one-pass epilogue of ConvAct on the GPU (kernels/triton/epilogue.py) and the GPU route of
ConvAct that uses it, against the numpy reference ConvAct on fresh random inputs.

The epilogue alone is checked through the reference ConvAct of a 1x1 identity convolution, whose
output is ``act(x + b + z)``; the route is checked on CPU tensors through Triton's interpreter
(the caller only takes it for CUDA tensors) and, on a GPU, through the registered kernel with the
cuda backend's channels-last weights.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tensorkiln.kernels.cpu.conv import hold_weight  # noqa: E402
from tensorkiln.kernels.cuda import fused_conv  # noqa: E402
from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.reference.fused_conv import conv_act as reference  # noqa: E402
from tensorkiln.kernels.triton import epilogue as ep  # noqa: E402
from tensorkiln.kernels.triton.gemm import Epilogue  # noqa: E402
from tests.kernels.triton import DEVICE, rand  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
ACTS = [
    ("", {}),
    ("Relu", {}),
    ("LeakyRelu", {"activation_alpha": 0.2}),
    ("Clip", {"activation_min": -0.5, "activation_max": 1.5}),
    ("Sigmoid", {}),
    ("Swish", {}),
    ("HardSigmoid", {}),
    ("HardSwish", {}),
    ("Gelu", {}),
    ("GeluTanh", {}),
    ("Tanh", {}),
]


def _params(attrs: dict) -> tuple:
    return tuple(
        attrs.get(k)
        for k in ("activation_alpha", "activation_beta", "activation_min", "activation_max")
    )


def _expected(x, b, z, activation, attrs, order):
    """act(x + b + z) by the reference ConvAct of a 1x1 identity convolution, in float32."""
    c = x.shape[1]
    eye = np.eye(c, dtype=np.float32).reshape(c, c, *(1,) * (x.ndim - 2))
    args = [x.astype(np.float32), eye, None if b is None else b.astype(np.float32)]
    if z is not None:
        args.append(z.astype(np.float32))
    return reference(*args, activation=activation, residual_order=order, **attrs)


def _close(got: np.ndarray, want: np.ndarray, dtype) -> None:
    tol = 1e-5 if np.dtype(dtype) == np.float32 else 1e-2
    g = got.astype(np.float64)
    np.testing.assert_allclose(g, want, rtol=tol, atol=tol * max(float(np.abs(want).max()), 1.0))


@pytest.mark.parametrize("activation, attrs", ACTS, ids=[a or "none" for a, _ in ACTS])
def test_every_activation_nhwc_with_bias_and_residual(activation, attrs):
    x, b, z = rand(2, 6, 5, 3), rand(6), rand(2, 6, 5, 3)
    y = to_torch(x, DEVICE).contiguous(memory_format=torch.channels_last)
    zt = to_torch(z, DEVICE).contiguous(memory_format=torch.channels_last)
    assert ep.applies(y, zt)
    got = ep.epilogue_(y, to_torch(b, DEVICE), zt, Epilogue.of(activation, *_params(attrs)))
    assert got.is_contiguous(memory_format=torch.channels_last)
    _close(to_numpy(got), _expected(x, b, z, activation, attrs, "add_act"), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize(
    "shape, nhwc", [((2, 7, 4, 6), False), ((3, 5, 9), False), ((1, 4, 1, 1), True)]
)
@pytest.mark.parametrize("order", ["add_act", "act_add"])
def test_layouts_dtypes_and_residual_order(dtype, shape, nhwc, order):
    x, b, z = rand(*shape, dtype=dtype), rand(shape[1], dtype=dtype), rand(*shape, dtype=dtype)
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    y = to_torch(x, DEVICE).contiguous(memory_format=fmt)
    zt = to_torch(z, DEVICE).contiguous(memory_format=fmt)
    got = ep.epilogue_(y, to_torch(b, DEVICE), zt, Epilogue.of("Relu"), order == "act_add")
    _close(to_numpy(got), _expected(x, b, z, "Relu", {}, order), dtype)


def test_bias_only_and_residual_only():
    x, b, z = rand(2, 3, 4, 4), rand(3), rand(2, 3, 4, 4)
    got = ep.epilogue_(to_torch(x, DEVICE), to_torch(b, DEVICE), None, Epilogue.of(""))
    _close(to_numpy(got), _expected(x, b, None, "", {}, "add_act"), np.float32)
    got = ep.epilogue_(to_torch(x, DEVICE), None, to_torch(z, DEVICE), Epilogue.of("Tanh"))
    _close(to_numpy(got), _expected(x, None, z, "Tanh", {}, "add_act"), np.float32)


def test_applies_only_to_dense_pairs_of_one_layout():
    y = torch.randn(2, 3, 4, 5)
    assert ep.applies(y, None) and ep.applies(y, torch.randn(2, 3, 4, 5))
    assert not ep.applies(y, torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last))
    assert not ep.applies(y, torch.randn(2, 3, 4, 5).half())
    assert not ep.applies(y.transpose(2, 3), None)  # neither NCHW nor NHWC
    assert not ep.applies(y.double(), None)
    with pytest.raises(ValueError, match="bias of 4 values for 3 channels"):
        ep.epilogue_(y, torch.randn(4), None, Epilogue.of("Relu"))


def _route_case(kernel: int, order: str, nhwc_z: bool):
    xs, ws = (2, 8, 6, 5), (6, 8, kernel, kernel)
    pads = [kernel // 2] * 4
    x, w, b = rand(*xs), rand(*ws), rand(6)
    z = rand(2, 6, 6, 5)
    attrs = {"pads": pads, "activation": "LeakyRelu", "activation_alpha": 0.1}
    want = reference(x, w, b, z, residual_order=order, **attrs)
    return x, w, b, z, attrs, want, nhwc_z


@pytest.mark.parametrize("kernel", [1, 3], ids=["1x1-gemm", "3x3-conv"])
@pytest.mark.parametrize("order", ["add_act", "act_add"])
@pytest.mark.parametrize("nhwc_z", [True, False], ids=["z-nhwc", "z-nchw"])
def test_gpu_route_of_conv_act(kernel, order, nhwc_z):
    """ConvAct's GPU route (cuBLAS or cuDNN, then this epilogue) on the cuda backend's held,
    channels-last weights; a residual in the other layout is taken too."""
    x, w, b, z, attrs, want, _ = _route_case(kernel, order, nhwc_z)
    cl = torch.channels_last
    xt = to_torch(x, DEVICE).contiguous(memory_format=cl)
    wt = hold_weight(to_torch(w, DEVICE))
    zt = to_torch(z, DEVICE)
    zt = zt.contiguous(memory_format=cl) if nhwc_z else zt
    g = fused_conv.geometry_of(xt, wt, "NOTSET", None, None, attrs["pads"], None)
    act = ("LeakyRelu", 0.1, None, None, None)
    got = fused_conv._gpu_conv_act(xt, wt, to_torch(b, DEVICE), zt, g, 1, act[0], act[1:],
                                   order == "act_add")  # fmt: skip
    assert got is not None and got.is_contiguous(memory_format=cl)
    np.testing.assert_allclose(to_numpy(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=str)
@pytest.mark.parametrize("kernel", [1, 3], ids=["1x1-gemm", "3x3-conv"])
def test_registered_conv_act_on_the_gpu(dtype, kernel):
    """The registered cuda ConvAct on CUDA tensors in the backend's layout, fp16 and fp32."""
    from tensorkiln.kernels.registry import invoke, lookup

    x, w, b, z, attrs, _, _ = _route_case(kernel, "add_act", True)
    x, w, b, z = (a.astype(dtype) for a in (x, w, b, z))
    want = reference(*(a.astype(np.float32) for a in (x, w, b, z)), **attrs)
    cl = torch.channels_last
    args = [
        to_torch(x, "cuda").contiguous(memory_format=cl),
        hold_weight(to_torch(w, "cuda")),
        to_torch(b, "cuda"),
        to_torch(z, "cuda").contiguous(memory_format=cl),
    ]
    got = invoke(lookup("ConvAct", "tensorkiln", 1, "cuda"), args, attrs, 1)[0]
    assert got.is_contiguous(memory_format=cl)
    tol = 1e-3 if dtype == np.float32 else 2e-2  # (fp32 convolutions may run in TF32)
    g = to_numpy(got).astype(np.float64)
    assert np.linalg.norm(g - want) <= tol * np.linalg.norm(want)


@pytest.mark.parametrize("kernel", [1, 3], ids=["1x1-gemm", "3x3-conv"])
@pytest.mark.parametrize("activation", ["Relu", "Sigmoid", ""])
def test_gpu_route_without_a_residual(kernel, activation):
    """No residual: a 1x1 convolution with ReLU is one GEMM with bias and ReLU in its epilogue
    (torch._addmm_activation), other activations and the 3x3 take the one-pass epilogue."""
    x, w, b = rand(2, 8, 6, 5), rand(6, 8, kernel, kernel), rand(6)
    pads = [kernel // 2] * 4
    want = reference(x, w, b, pads=pads, activation=activation)
    xt = to_torch(x, DEVICE).contiguous(memory_format=torch.channels_last)
    wt = hold_weight(to_torch(w, DEVICE))
    g = fused_conv.geometry_of(xt, wt, "NOTSET", None, None, pads, None)
    got = fused_conv._gpu_conv_act(
        xt, wt, to_torch(b, DEVICE), None, g, 1, activation, (None, None, None, None), False
    )
    assert got is not None and got.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_allclose(to_numpy(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
