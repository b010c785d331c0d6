"""Triton implicit-GEMM convolution tactics (ConvAct, Conv) against the numpy reference kernels.

Shapes are small (the interpreter is slow) but odd: strides, asymmetric pads and dilations leave
masked edges along every axis; the large-shape test runs on the GPU only.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tensorkiln.kernels.common.conv import conv_geometry  # noqa: E402
from tensorkiln.kernels.cuda.convert import to_torch  # noqa: E402
from tensorkiln.kernels.tactics import LayerSpec, get_tactic, tactics_for  # noqa: E402
from tensorkiln.runtime.mathmode import math_mode  # noqa: E402
from tests.kernels.triton import DEVICE, check, rand  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
SMALL = "triton_conv_64x64x32_w4_s4"
GEOMETRY = {"strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2]}


def _conv_act(x, w, b=None, z=None, tactic=SMALL, **attrs):
    args = [x, w, b, z]
    while args[-1] is None:
        args.pop()
    return check("ConvAct", "tensorkiln", tactic, args, attrs)


def _residual(xs, ws, attrs):
    """A random residual of the conv's output shape."""
    g = conv_geometry(
        xs, ws, attrs.get("auto_pad", "NOTSET"), attrs.get("dilations"), None,
        attrs.get("pads"), attrs.get("strides"),
    )  # fmt: skip
    return (xs[0], ws[0], *g.out)


def test_bias_residual_relu_float32():
    xs, ws = (2, 5, 11, 9), (7, 5, 3, 3)
    z = rand(*_residual(xs, ws, GEOMETRY))
    _conv_act(rand(*xs), rand(*ws), rand(7), z, activation="Relu", **GEOMETRY)


@pytest.mark.parametrize(
    "dtype, act, params",
    [
        (np.float16, "LeakyRelu", {"activation_alpha": 0.1}),
        (BF16, "HardSwish", {}),
        (np.float16, "Clip", {"activation_min": 0.0, "activation_max": 6.0}),
    ],
    ids=["float16-leaky", "bfloat16-hardswish", "float16-relu6"],
)
def test_narrow_dtypes_residual_after(dtype, act, params):
    xs, ws = (2, 5, 11, 9), (7, 5, 3, 3)
    z = rand(*_residual(xs, ws, GEOMETRY), dtype=dtype)
    _conv_act(
        rand(*xs, dtype=dtype), rand(*ws, dtype=dtype), rand(7, dtype=dtype), z,
        activation=act, residual_order="act_add", **params, **GEOMETRY,
    )  # fmt: skip


def test_groups_same_upper():
    x, w = rand(1, 32, 6, 7), rand(34, 16, 3, 3)
    _conv_act(x, w, rand(34), activation="Sigmoid", group=2, auto_pad="SAME_UPPER")


def test_conv_1d():
    attrs = {"strides": [2], "pads": [2, 1], "dilations": [2]}
    z = rand(*_residual((2, 6, 19), (5, 6, 3), attrs))
    _conv_act(rand(2, 6, 19), rand(5, 6, 3), None, z, activation="Gelu", **attrs)


def test_plain_conv_many_channels():
    """More input channels than one K step: the reduction runs over channel blocks too."""
    check("Conv", "", SMALL, [rand(1, 40, 5, 5), rand(9, 40, 1, 1)], {"kernel_shape": [1, 1]})
    check("Conv", "", SMALL, [rand(1, 40, 5, 5), rand(9, 40, 3, 3), rand(9)], {"pads": [1] * 4})


def _spec(shapes, dtypes, attrs=None, device=DEVICE):
    return LayerSpec("ConvAct", "tensorkiln", attrs or {}, tuple(shapes), tuple(dtypes), device)


def test_supports_rejects_what_the_kernel_does_not_take():
    t = get_tactic("ConvAct", "tensorkiln", SMALL)
    f32 = ("float32", "float32")
    assert t.applies(_spec([(1, 8, 9, 9), (16, 8, 3, 3)], f32))
    assert not t.applies(_spec([(1, 8, 9, 9, 9), (16, 8, 3, 3, 3)], f32))  # 3-D
    assert not t.applies(_spec([(1, 32, 9, 9), (32, 1, 3, 3)], f32, {"group": 32}))  # depthwise
    assert not t.applies(_spec([(1, 8, 9, 9), (16, 8, 3, 3)], ("float64", "float64")))
    assert not t.applies(_spec([(1, 8, 9, 9), (16, 8, 3, 3)], f32, {"kernel_shape": [5, 5]}))
    assert not t.applies(_spec([(1, 8, 2, 2), (16, 8, 3, 3)], f32))  # no output
    assert not t.applies(_spec([(1, 8, 9, 9), (16, 8, 3, 3), (8,)], (*f32, "float32")))
    residual = [(1, 8, 9, 9), (16, 8, 3, 3), None, (1, 16, 9, 9)]
    assert not t.applies(_spec(residual, (*f32, None, "float32")))  # Z is 7x7
    bad_order = {"residual_order": "mul"}
    assert not t.applies(_spec([(1, 8, 9, 9), (16, 8, 3, 3)], f32, bad_order))
    assert not get_tactic("Conv", "", SMALL).applies(
        LayerSpec("Conv", "", {"activation": "Relu"}, ((1, 8, 9, 9), (16, 8, 3, 3)), f32)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["f16", "bf16", "f32"])
def test_resnet_block_on_gpu(dtype):
    xs, ws = (4, 64, 56, 56), (128, 64, 3, 3)
    attrs = {"strides": [2, 2], "pads": [1, 1, 1, 1], "activation": "Relu"}
    args = [rand(*xs, dtype=dtype), rand(*ws, dtype=dtype), rand(128, dtype=dtype)]
    args.append(rand(*_residual(xs, ws, attrs), dtype=dtype))
    # under an fp32 engine's math mode: no TF32 (torch's default lets cuDNN use it)
    with math_mode("fp32"):
        for t in tactics_for("ConvAct", "tensorkiln"):
            spec = _spec([a.shape for a in args], [a.dtype.name for a in args], attrs, "cuda")
            if t.applies(spec):
                check("ConvAct", "tensorkiln", t.name, args, attrs, device="cuda")


def _nhwc(t):
    return t.contiguous(memory_format=torch.channels_last) if t.ndim == 4 else t


def test_channels_last_in_channels_last_out():
    """NHWC activations and weights (the cuda backend's layout on a GPU): the same values as the
    reference, and the output stays channels-last for the next layer."""
    xs, ws = (2, 6, 9, 7), (8, 6, 3, 3)
    x, w, b, z = rand(*xs), rand(*ws), rand(8), rand(*_residual(xs, ws, GEOMETRY))
    check(
        "ConvAct", "tensorkiln", SMALL, [x, w, b, z], {"activation": "Relu", **GEOMETRY},
        transform=_nhwc,
    )  # fmt: skip
    fn = get_tactic("ConvAct", "tensorkiln", SMALL).fn
    tensors = [_nhwc(torch.from_numpy(a).to(DEVICE)) for a in (x, w, b, z)]
    y = fn(*tensors, activation="Relu", **GEOMETRY)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    nchw = fn(
        *(torch.from_numpy(a).to(DEVICE) for a in (x, w, b, z)), activation="Relu", **GEOMETRY
    )
    assert nchw.is_contiguous()


@pytest.mark.parametrize(
    "dtype, act, order",
    [
        (np.float32, "Relu", "add_act"),
        (np.float16, "Relu", "add_act"),
        (BF16, "Sigmoid", "act_add"),
    ],
    ids=["float32", "float16", "bfloat16-act_add"],
)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_pointwise_channels_last_runs_as_a_gemm(dtype, act, order, with_bias):
    """A 1x1 convolution of a channels-last input (ResNet's expansions, with their residual): the
    GEMM over its (pixels, channels) view gives the reference's values, channels-last out."""
    xs, ws = (2, 24, 5, 7), (40, 24, 1, 1)
    attrs = {"activation": act, "residual_order": order}
    x, w = rand(*xs, dtype=dtype), rand(*ws, dtype=dtype)
    b = rand(40, dtype=dtype) if with_bias else None
    z = rand(2, 40, 5, 7, dtype=dtype)
    args = [x, w, b, z]
    check("ConvAct", "tensorkiln", SMALL, args, attrs, transform=_nhwc)
    fn = get_tactic("ConvAct", "tensorkiln", SMALL).fn
    tensors = [None if a is None else _nhwc(to_torch(a, DEVICE)) for a in args]
    y = fn(*tensors, **attrs)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
