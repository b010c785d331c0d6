"""The cudnn_fused ConvAct tactic (kernels/cuda/tactics_conv.py): which layers it takes, and on a
GPU its results against the numpy reference ConvAct on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402
from tensorkiln.kernels.tactics import LayerSpec, get_tactic  # noqa: E402

TACTIC = get_tactic("ConvAct", "tensorkiln", "cudnn_fused")
GEOMETRY = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}


def _spec(attrs, dtype="float16", device="cuda", residual=True, x=(4, 16, 14, 14)):
    shapes = [x, (32, x[1], 3, 3), (32,)] + ([(4, 32, 7, 7)] if residual else [])
    return LayerSpec(
        "ConvAct", "tensorkiln", attrs, tuple(shapes), (dtype,) * len(shapes), device=device
    )


def test_it_takes_relu_convolutions_on_cuda_devices_only():
    relu = {"activation": "Relu", **GEOMETRY}
    assert TACTIC.applies(_spec(relu))
    assert TACTIC.applies(_spec(relu, "bfloat16", residual=False))
    assert not TACTIC.applies(_spec(relu, device="cpu"))
    assert not TACTIC.applies(_spec({**GEOMETRY, "activation": "Sigmoid"}))
    assert not TACTIC.applies(_spec({**relu, "residual_order": "act_add"}))
    assert not TACTIC.applies(_spec({**relu, "pads": [1, 1, 0, 0]}))
    assert not TACTIC.applies(_spec({**relu, "auto_pad": "SAME_UPPER"}))
    assert not TACTIC.applies(_spec(relu, x=(4, 16, 14)))  # 1-D


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "plain"])
def test_it_computes_conv_act_on_the_gpu(dtype, residual):
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 16, 14, 14)).astype(dtype)
    w = (rng.standard_normal((32, 16, 3, 3)) / 12).astype(dtype)
    b = rng.standard_normal(32).astype(dtype)
    args = [x, w, b] + ([rng.standard_normal((4, 32, 7, 7)).astype(dtype)] if residual else [])
    attrs = {"activation": "Relu", **GEOMETRY}
    wide = [a.astype(np.float32) for a in args]
    want = invoke(lookup("ConvAct", "tensorkiln", 1, "reference"), wide, attrs, 1)[0]
    cl = torch.channels_last
    tensors = [to_torch(a, "cuda") for a in args]
    tensors = [t.contiguous(memory_format=cl) if t.ndim == 4 else t for t in tensors]
    got = to_numpy(TACTIC.fn(*tensors, **attrs)).astype(np.float64)
    tol = 1e-2 if dtype == np.float16 else 1e-4
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


IM2COL = get_tactic("ConvAct", "tensorkiln", "cublas_im2col")


def test_im2col_takes_convolutions_of_few_channels_on_cuda_devices():
    stem = LayerSpec(
        "ConvAct", "tensorkiln", {"kernel_shape": [7, 7]}, ((8, 3, 64, 64), (16, 3, 7, 7)),
        ("float16", "float16"), device="cuda",
    )  # fmt: skip
    assert IM2COL.applies(stem)
    cpu = LayerSpec("ConvAct", "tensorkiln", {}, stem.shapes, stem.dtypes, device="cpu")
    assert not IM2COL.applies(cpu)
    wide = LayerSpec("ConvAct", "tensorkiln", {}, ((8, 16, 64, 64), (16, 16, 3, 3)),
                     ("float16", "float16"), device="cuda")  # fmt: skip
    assert not IM2COL.applies(wide)  # 16 channels: cuDNN's own kernels are good
    big = LayerSpec("ConvAct", "tensorkiln", {}, ((8, 3, 64, 64), (16, 3, 15, 15)),
                    ("float16", "float16"), device="cuda")  # fmt: skip
    assert not IM2COL.applies(big)  # 675 taps per output: past the unfold's budget


@pytest.mark.parametrize(
    "attrs,residual",
    [
        ({"kernel_shape": [7, 7], "strides": [2, 2], "pads": [3, 3, 3, 3], "activation": "Relu"},
         False),
        ({"kernel_shape": [3, 3], "pads": [0, 1, 2, 1], "dilations": [2, 1],
          "activation": "LeakyRelu", "activation_alpha": 0.1}, True),
        ({"kernel_shape": [3, 2], "strides": [1, 2], "activation": "Sigmoid",
          "residual_order": "act_add"}, True),
    ],
    ids=["stem", "asymmetric-dilated-residual", "act-then-residual"],
)  # fmt: skip
def test_im2col_gives_the_convolution(attrs, residual):
    """On CPU tensors (the tactic is taken on GPUs; the unfold and GEMM are plain torch), against
    the numpy reference ConvAct."""
    from tensorkiln.kernels.common.conv import conv_geometry

    rng = np.random.default_rng()
    x = rng.standard_normal((2, 3, 17, 15)).astype(np.float32)
    w = (rng.standard_normal((8, 3, *attrs["kernel_shape"])) / 5).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    args = [x, w, b]
    if residual:
        g = conv_geometry(x.shape, w.shape, "NOTSET", attrs.get("dilations"), None,
                          attrs.get("pads"), attrs.get("strides"))  # fmt: skip
        args.append(rng.standard_normal((2, 8, *g.out)).astype(np.float32))
    want = invoke(lookup("ConvAct", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    tensors = [to_torch(a, "cpu") for a in args]
    tensors[1] = tensors[1].contiguous(memory_format=torch.channels_last)  # (as weights are held)
    got = to_numpy(IM2COL.fn(*tensors, **attrs))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def _check_half_on_the_gpu(tactic, args, attrs):
    """``tactic`` on float16 CUDA tensors (the weight channels-last, as held) gives a
    channels-last output within 1e-2 of the numpy reference ConvAct in float32."""
    want = invoke(
        lookup("ConvAct", "tensorkiln", 1, "reference"), [a.astype(np.float32) for a in args],
        attrs, 1,
    )[0]  # fmt: skip
    tensors = [to_torch(a, "cuda") for a in args]
    tensors[1] = tensors[1].contiguous(memory_format=torch.channels_last)
    y = tactic.fn(*tensors, **attrs)
    assert y.is_contiguous(memory_format=torch.channels_last)
    got = to_numpy(y).astype(np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_im2col_on_the_gpu_in_half():
    rng = np.random.default_rng()
    args = [
        rng.standard_normal((4, 3, 64, 64)).astype(np.float16),
        (rng.standard_normal((64, 3, 7, 7)) / 10).astype(np.float16),
        rng.standard_normal(64).astype(np.float16),
    ]
    attrs = {"kernel_shape": [7, 7], "strides": [2, 2], "pads": [3, 3, 3, 3], "activation": "Relu"}
    _check_half_on_the_gpu(IM2COL, args, attrs)


PATCHIFY = get_tactic("ConvAct", "tensorkiln", "cublas_patchify")


def _patch_spec(attrs, x=(8, 3, 224, 224), w=(768, 3, 16, 16), device="cuda", group=None):
    attrs = {**attrs, **({"group": group} if group else {})}
    return LayerSpec(
        "ConvAct", "tensorkiln", attrs, (x, w, (w[0],)), ("float16",) * 3, device=device
    )


def test_patchify_takes_convolutions_whose_windows_do_not_overlap():
    vit = {"kernel_shape": [16, 16], "strides": [16, 16]}
    assert PATCHIFY.applies(_patch_spec(vit))
    assert PATCHIFY.applies(_patch_spec({"strides": [16, 16]}))  # (kernel from the weight)
    assert PATCHIFY.applies(_patch_spec({**vit, "pads": [0, 0, 0, 0], "auto_pad": "VALID"}))
    assert PATCHIFY.applies(_patch_spec({"kernel_shape": [2, 2], "strides": [2, 2]},
                                        x=(8, 96, 56, 56), w=(192, 96, 2, 2)))  # fmt: skip
    assert not PATCHIFY.applies(_patch_spec(vit, device="cpu"))
    assert not PATCHIFY.applies(_patch_spec({**vit, "strides": [8, 8]}))  # overlapping
    assert not PATCHIFY.applies(_patch_spec({**vit, "pads": [1, 1, 1, 1]}))
    assert not PATCHIFY.applies(_patch_spec({**vit, "dilations": [2, 2]}))
    assert not PATCHIFY.applies(_patch_spec({**vit, "auto_pad": "SAME_UPPER"}))
    assert not PATCHIFY.applies(_patch_spec(vit, x=(8, 6, 224, 224), w=(768, 3, 16, 16), group=2))
    assert not PATCHIFY.applies(_patch_spec({"kernel_shape": [1, 1], "strides": [1, 1]},
                                            w=(768, 3, 1, 1)))  # fmt: skip


@pytest.mark.parametrize(
    "attrs,residual,bias,x",
    [
        ({"kernel_shape": [4, 4], "strides": [4, 4]}, False, True, (2, 3, 16, 12)),
        ({"kernel_shape": [4, 4], "strides": [4, 4]}, False, False, (2, 3, 17, 15)),
        ({"kernel_shape": [2, 3], "strides": [2, 3], "activation": "Relu"}, True, True,
         (3, 5, 9, 10)),
        ({"kernel_shape": [2, 2], "strides": [2, 2], "activation": "Sigmoid",
          "residual_order": "act_add"}, True, True, (2, 8, 6, 6)),
    ],
    ids=["vit-like", "edges-dropped-no-bias", "relu-residual", "act-then-residual"],
)  # fmt: skip
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_patchify_gives_the_convolution(attrs, residual, bias, x, channels_last):
    """On CPU tensors (the tactic is taken on GPUs; the copy and GEMM are plain torch), against
    the numpy reference ConvAct."""
    from tensorkiln.kernels.common.conv import conv_geometry

    rng = np.random.default_rng()
    xs = rng.standard_normal(x).astype(np.float32)
    w = (rng.standard_normal((8, x[1], *attrs["kernel_shape"])) / 5).astype(np.float32)
    args = [xs, w, rng.standard_normal(8).astype(np.float32) if bias else None]
    if residual:
        g = conv_geometry(xs.shape, w.shape, "NOTSET", None, None, None, attrs.get("strides"))
        args.append(rng.standard_normal((x[0], 8, *g.out)).astype(np.float32))
    want = invoke(lookup("ConvAct", "tensorkiln", 1, "reference"), args, attrs, 1)[0]
    tensors = [None if a is None else to_torch(a, "cpu") for a in args]
    tensors[1] = tensors[1].contiguous(memory_format=torch.channels_last)  # (as weights are held)
    if channels_last:
        tensors[0] = tensors[0].contiguous(memory_format=torch.channels_last)
    y = PATCHIFY.fn(*tensors, **attrs)
    assert tuple(y.shape) == want.shape
    np.testing.assert_allclose(to_numpy(y), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_patchify_on_the_gpu_in_half():
    rng = np.random.default_rng()
    args = [
        rng.standard_normal((4, 3, 224, 224)).astype(np.float16),
        (rng.standard_normal((768, 3, 16, 16)) / 30).astype(np.float16),
        rng.standard_normal(768).astype(np.float16),
    ]
    attrs = {"kernel_shape": [16, 16], "strides": [16, 16]}
    _check_half_on_the_gpu(PATCHIFY, args, attrs)
