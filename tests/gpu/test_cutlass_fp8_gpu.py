"""The CUTLASS FP8 tactics on an H200 against the layers' exact kernels: every kernel of the
library that claims a QGemmAct (ReLU, none and GELU), a 1x1 QConvAct (with and without a
quantized residual) or, through a convolution kernel (implicit GEMM), a 3x3 or strided 1x1
QConvAct writes what the exact kernel writes, to one E4M3 step of the output's largest value
(the autotuner's own check of E4M3 outputs); and a call at a shape the kernels do not take runs
the exact kernel.

Needs a kernel library (``python benchmarks/cutlass_gemm_build.py --kernel ...`` on any machine
with CUTLASS's DSL) named by TENSORKILN_CUTLASS_KERNELS:
    TENSORKILN_CUTLASS_KERNELS=build/cutlass_gemm PYTHONPATH=src python3 -m pytest -q -m gpu \\
        tests/gpu/test_cutlass_fp8_gpu.py
"""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda import cutlass_fp8 as cf  # noqa: E402
from tensorkiln.kernels.cuda.fused_quant import qconv_act, qgemm_act  # noqa: E402
from tensorkiln.kernels.tactics import LayerSpec  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not os.environ.get(cf.ENV), reason=f"{cf.ENV} names no kernel library"),
]
E4M3 = torch.float8_e4m3fn


def _within_a_step(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == E4M3 and got.shape == want.shape
    g, w = got.float(), want.float()
    top = float(w.abs().max())
    assert top > 0
    step = 2.0 ** (math.floor(math.log2(top)) - 3)  # (E4M3: three mantissa bits)
    assert float((g - w).abs().max()) <= step, (float((g - w).abs().max()), step)


def _agrees(kind: str, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """An 8-bit output of kernel ``name`` against the exact kernel's: within one E4M3 step, or
    one int8 code (and the int8 codes span the range, so the check means something)."""
    if kind == "fp8":
        _within_a_step(got, want)
        return
    diff = (got.int() - want.int()).abs()
    assert int(diff.max()) <= 1, (name, int(diff.max()))
    assert int(want.int().abs().max()) > 60


def _library():
    lib = cf.library()
    assert lib is not None, f"{cf.ENV} is set but its library did not load (see the log)"
    return lib


def _fp8_operands(seed: int, m: int, n: int, k: int):
    """E4M3 A (m x k) and packed B (n x k), A's scale and B's per-channel scales, and the
    generator they were drawn from."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=g).to(E4M3)
    b = torch.randn(n, k, device="cuda", generator=g).to(E4M3)
    b_scale = 0.01 + 0.02 * torch.rand(n, device="cuda", generator=g)
    return g, a, b, torch.tensor(0.05, device="cuda"), b_scale


@pytest.mark.parametrize("activation", ["Relu", "", "Gelu"])
def test_gemm_kernels_match_the_exact_kernel(activation: str) -> None:
    _library()
    m, n, k = 512, 256, 384
    g, a, b, a_scale, b_scale = _fp8_operands(11, m, n, k)
    c = 0.2 * torch.randn(n, device="cuda", generator=g)
    y_scale = torch.tensor(0.03, device="cuda")
    attrs = {"transB": 1, "activation": activation, "out_dtype": 17, "alpha": 0.75, "beta": 0.5}
    spec = LayerSpec("QGemmAct", "tensorkiln", attrs, ((m, k), (), (n, k), (n,), (n,), ()),
                     ("float8_e4m3fn", "float32", "float8_e4m3fn", "float32", "float32",
                      "float32"))  # fmt: skip
    names = cf._kernels_for(spec)
    assert names, "the library has no kernel for this layer"
    want = qgemm_act(a, a_scale, b, b_scale, c, y_scale, **attrs)
    resolve = cf._resolver("QGemmAct", cf._gemm_fn)
    for name in names:
        got = resolve(name).fn(a, a_scale, b, b_scale, c, y_scale, **attrs)
        torch.cuda.synchronize()
        _within_a_step(got, want)
    # a shape the kernels do not take (M not a multiple of 128) runs the exact kernel
    odd = resolve(names[0]).fn(a[:200], a_scale, b, b_scale, c, y_scale, **attrs)
    assert torch.equal(odd.float(), qgemm_act(a[:200], a_scale, b, b_scale, c, y_scale,
                                              **attrs).float())  # fmt: skip


@pytest.mark.parametrize("n", [384, 512])
@pytest.mark.parametrize("bias", [True, False])
def test_float16_output_kernels_match_the_exact_kernel(bias: bool, n: int) -> None:
    """The per-channel kernels that write float16 (a GEMM with no Y_scale and no activation, as
    BERT's QKV, attention-output and second FFN GEMMs are): to float16's rounding of the
    exact kernel's result. (N = 512 is whole pairs of 128-column tiles: the clusters' kernels.)"""
    _library()
    m, k = 512, 256
    g, a, b, a_scale, b_scale = _fp8_operands(13, m, n, k)
    c = 0.5 * torch.randn(n, device="cuda", generator=g) if bias else None
    attrs = {"transB": 1, "activation": "", "out_dtype": 10, "alpha": 0.75, "beta": 0.5}
    spec = LayerSpec("QGemmAct", "tensorkiln", attrs,
                     ((m, k), (), (n, k), (n,), (n,) if bias else None, None),
                     ("float8_e4m3fn", "float32", "float8_e4m3fn", "float32",
                      "float32" if bias else None, None))  # fmt: skip
    names = cf._kernels_for(spec)
    assert names, "the library has no float16-output kernel"
    want = qgemm_act(a, a_scale, b, b_scale, c, None, **attrs).float()
    resolve = cf._resolver("QGemmAct", cf._gemm_fn)
    for name in names:
        got = resolve(name).fn(a, a_scale, b, b_scale, c, None, **attrs)
        torch.cuda.synchronize()
        assert got.dtype == torch.float16 and got.shape == want.shape
        # (float32 sums in another order, then rounded to float16: a few float16 steps)
        torch.testing.assert_close(
            got.float(), want, rtol=4e-3, atol=4e-3 * float(want.abs().max())
        )


@pytest.mark.parametrize("n", [384, 512])
@pytest.mark.parametrize("out", ["int8", "float16"])
def test_int8_kernels_match_the_exact_kernel(out: str, n: int) -> None:
    """The int8 kernels (exact int32 sums): a GELU GEMM writing int8 to within one code of the
    exact kernel's, its output scale after the GELU; one writing float16 to float16's rounding.
    (N = 512 is whole pairs of 128-column tiles: the clusters' kernels.)"""
    _library()
    g = torch.Generator(device="cuda").manual_seed(14)
    m, k = 512, 768
    a = torch.randint(-128, 128, (m, k), device="cuda", generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), device="cuda", generator=g, dtype=torch.int8)
    a_scale = torch.tensor(0.02, device="cuda")
    b_scale = 0.0005 + 0.001 * torch.rand(n, device="cuda", generator=g)
    c = 0.5 * torch.randn(n, device="cuda", generator=g)
    y_scale = torch.tensor(0.03, device="cuda") if out == "int8" else None
    act = "Gelu" if out == "int8" else ""
    attrs = {"transB": 1, "activation": act, "out_dtype": 3 if out == "int8" else 10,
             "alpha": 0.75, "beta": 0.5}  # fmt: skip
    spec = LayerSpec("QGemmAct", "tensorkiln", attrs,
                     ((m, k), (), (n, k), (n,), (n,), () if y_scale is not None else None),
                     ("int8", "float32", "int8", "float32", "float32",
                      "float32" if y_scale is not None else None))  # fmt: skip
    names = cf._kernels_for(spec)
    assert names, f"the library has no int8 kernel writing {out}"
    want = qgemm_act(a, a_scale, b, b_scale, c, y_scale, **attrs)
    resolve = cf._resolver("QGemmAct", cf._gemm_fn)
    for name in names:
        got = resolve(name).fn(a, a_scale, b, b_scale, c, y_scale, **attrs)
        torch.cuda.synchronize()
        assert got.dtype == want.dtype and got.shape == want.shape
        if out == "int8":
            diff = (got.int() - want.int()).abs()
            assert int(diff.max()) <= 1, (name, int(diff.max()))
            # (rounding boundaries the approximate GELU lands on the other side of)
            assert float((diff > 0).float().mean()) < 0.05
            assert int(want.int().abs().max()) > 60  # (the codes span the range)
        else:
            w = want.float()
            torch.testing.assert_close(got.float(), w, rtol=2e-3, atol=2e-3 * float(w.abs().max()))


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("residual", [True, False])
def test_pointwise_conv_kernels_match_the_exact_kernel(residual: bool, stride: int) -> None:
    _library()
    g = torch.Generator(device="cuda").manual_seed(12)
    nb, c_in, m, hw = 4, 128, 256, 16 * stride
    out = hw // stride
    x = torch.randn(nb, c_in, hw, hw, device="cuda", generator=g).to(E4M3)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(m, c_in, 1, 1, device="cuda", generator=g).to(E4M3)
    w = w.contiguous(memory_format=torch.channels_last)
    x_scale = torch.tensor(0.04, device="cuda")
    w_scale = 0.01 + 0.02 * torch.rand(m, device="cuda", generator=g)
    bias = 0.2 * torch.randn(m, device="cuda", generator=g)
    y_scale = torch.tensor(0.05, device="cuda")
    z = z_scale = None
    if residual:
        z = torch.randn(nb, m, out, out, device="cuda", generator=g).to(E4M3)
        z = z.contiguous(memory_format=torch.channels_last)
        z_scale = torch.tensor(0.1, device="cuda")
    attrs = {"activation": "Relu", "out_dtype": 17, "group": 1, "strides": [stride, stride]}
    for _, got, want in _each_conv_kernel(x, x_scale, w, w_scale, bias, z, y_scale, z_scale, attrs):
        _within_a_step(got, want)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize(("c_in", "stride"), [(64, 1), (256, 1), (256, 2)])
def test_residual_kernels_over_several_tiles_a_cta(kind: str, c_in: int, stride: int) -> None:
    """The residual kernels at a size where every CTA runs several tiles (32 x 32 x 32 output
    pixels by 256 channels: 1,024 tiles of 128 x 64 for 264 CTAs), so that the kernels with two
    residual buffers read each tile's residual from the buffer its predecessor filled, and the
    others refill their one buffer tile after tile; K = 64 and 256 (one main-loop stage and
    several), stride 1 and 2 (GEMM and convolution kernels). Within one E4M3 step or one int8
    code of the exact kernel, and the two-buffer kernels among those run."""
    lib = _library()
    g = torch.Generator(device="cuda").manual_seed(31 + c_in + stride)
    nb, m, hw, cl = 32, 256, 32 * stride, torch.channels_last
    if kind == "fp8":
        x = torch.randn(nb, c_in, hw, hw, device="cuda", generator=g).to(E4M3)
        w = torch.randn(m, c_in, 1, 1, device="cuda", generator=g).to(E4M3)
        z = torch.randn(nb, m, 32, 32, device="cuda", generator=g).to(E4M3)
        x_scale, code = torch.tensor(0.04, device="cuda"), 17
        # (the sums, the bias and the residual each about one unit of the output's scale)
        w_scale = (0.5 + torch.rand(m, device="cuda", generator=g)) * 1.25 / c_in**0.5
    else:

        def codes(*shape):
            return torch.randint(-128, 128, shape, device="cuda", generator=g, dtype=torch.int8)

        x, w, z = codes(nb, c_in, hw, hw), codes(m, c_in, 1, 1), codes(nb, m, 32, 32)
        x_scale, code = torch.tensor(0.02, device="cuda"), 3
        w_scale = (0.0005 + 0.001 * torch.rand(m, device="cuda", generator=g)) * (64 / c_in) ** 0.5
    x, w, z = (t.contiguous(memory_format=cl) for t in (x, w, z))
    bias = 0.05 * torch.randn(m, device="cuda", generator=g)
    y_scale = torch.tensor(0.05, device="cuda")
    z_scale = torch.tensor(0.05 if kind == "fp8" else 0.03, device="cuda")
    attrs = {"activation": "Relu", "out_dtype": code, "group": 1, "strides": [stride, stride]}
    ran = []
    for name, got, want in _each_conv_kernel(x, x_scale, w, w_scale, bias, z, y_scale, z_scale,
                                             attrs):  # fmt: skip
        ran.append(name)
        _agrees(kind, name, got, want)
    doubles = [
        n for n in ran if lib.kernels[n.removeprefix(cf.PREFIX)].get("residual_buffers") == 2
    ]
    print(f"{len(ran)} kernels, {len(doubles)} with two residual buffers")
    assert ran
    if any(k.get("residual_buffers") == 2 for k in lib.kernels.values()):
        assert doubles, "the library's two-buffer residual kernels did not claim this layer"


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize(("c_in", "c_out", "hw"), [(512, 2048, 7), (256, 1024, 14)])
def test_float16_residual_kernels_match_the_exact_kernel(kind, c_in, c_out, hw) -> None:
    """The residual kernels that write float16 (a network's last block: ResNet-50's layer4.2
    conv3, 512 channels to 2,048 at 7 x 7, adds the 8-bit shortcut before a float pool reads
    the sum), at 128 images (whole tiles of 128 pixels): to float16's rounding of the exact
    kernel's result, and past the ReLU, so the check means something."""
    _library()
    g = torch.Generator(device="cuda").manual_seed(41 + c_in)
    nb, cl = 128, torch.channels_last
    if kind == "fp8":
        x = torch.randn(nb, c_in, hw, hw, device="cuda", generator=g).to(E4M3)
        w = torch.randn(c_out, c_in, 1, 1, device="cuda", generator=g).to(E4M3)
        z = torch.randn(nb, c_out, hw, hw, device="cuda", generator=g).to(E4M3)
        x_scale = torch.tensor(0.04, device="cuda")
        w_scale = (0.5 + torch.rand(c_out, device="cuda", generator=g)) * 1.25 / c_in**0.5
    else:

        def codes(*shape):
            return torch.randint(-128, 128, shape, device="cuda", generator=g, dtype=torch.int8)

        x, w = codes(nb, c_in, hw, hw), codes(c_out, c_in, 1, 1)
        z = codes(nb, c_out, hw, hw)
        x_scale = torch.tensor(0.02, device="cuda")
        w_scale = (0.0005 + 0.001 * torch.rand(c_out, device="cuda", generator=g)) * (
            64 / c_in
        ) ** 0.5
    x, w, z = (t.contiguous(memory_format=cl) for t in (x, w, z))
    bias = 0.05 * torch.randn(c_out, device="cuda", generator=g)
    z_scale = torch.tensor(0.05, device="cuda")
    attrs = {"activation": "Relu", "out_dtype": 10, "group": 1}
    ran = []
    for name, got, want in _each_conv_kernel(x, x_scale, w, w_scale, bias, z, None, z_scale,
                                             attrs):  # fmt: skip
        ran.append(name)
        assert got.dtype == want.dtype == torch.float16, name
        assert float((want > 0).float().mean()) > 0.2  # (past the ReLU)
        # (float32 sums in another order, then rounded to float16: a few float16 steps)
        torch.testing.assert_close(
            got.float(), want.float(), rtol=4e-3, atol=4e-3 * float(want.float().abs().max())
        )
    print(f"{len(ran)} float16 residual kernels")


def _each_conv_kernel(x, x_scale, w, w_scale, bias, z, y_scale, z_scale, attrs):
    """(name, output, the exact kernel's output) for each library kernel that claims this 1x1
    QConvAct; outputs channels-last."""
    kind = "int8" if x.dtype == torch.int8 else "float8_e4m3fn"
    m, zs, ys = w.shape[0], z is not None, y_scale is not None
    shapes = (tuple(x.shape), (), tuple(w.shape), (m,), (m,), tuple(z.shape) if zs else None,
              () if ys else None, () if zs else None)  # fmt: skip
    dtypes = (kind, "float32", kind, "float32", "float32", kind if zs else None,
              "float32" if ys else None, "float32" if zs else None)  # fmt: skip
    names = cf._kernels_for(LayerSpec("QConvAct", "tensorkiln", attrs, shapes, dtypes))
    assert names, f"the library has no {kind} kernel for this layer"
    want = qconv_act(x, x_scale, w, w_scale, bias, z, y_scale, z_scale, **attrs)
    want = want.contiguous(memory_format=torch.channels_last)
    resolve = cf._resolver("QConvAct", cf._conv_fn)
    for name in names:
        got = resolve(name).fn(x, x_scale, w, w_scale, bias, z, y_scale, z_scale, **attrs)
        torch.cuda.synchronize()
        assert got.dtype == want.dtype and got.is_contiguous(memory_format=torch.channels_last)
        yield name, got, want


@pytest.mark.parametrize(("act", "residual"), [("Relu", False), ("", False), ("Relu", True)])
@pytest.mark.parametrize("stride", [1, 2])
def test_int8_pointwise_conv_kernels_match_the_exact_kernel(
    stride: int, act: str, residual: bool
) -> None:
    """int8 1x1 convolutions writing int8 (exact int32 sums, ReLU or none, stride 1 or 2, an int8
    residual or none): within one code of the exact kernel, the project's rounding."""
    _library()
    g = torch.Generator(device="cuda").manual_seed(15)
    nb, c_in, m, hw = 4, 128, 256, 16 * stride
    cl = torch.channels_last
    x = torch.randint(-128, 128, (nb, c_in, hw, hw), device="cuda", generator=g,
                      dtype=torch.int8).contiguous(memory_format=cl)  # fmt: skip
    w = torch.randint(-128, 128, (m, c_in, 1, 1), device="cuda", generator=g,
                      dtype=torch.int8).contiguous(memory_format=cl)  # fmt: skip
    x_scale = torch.tensor(0.02, device="cuda")
    w_scale = 0.0005 + 0.001 * torch.rand(m, device="cuda", generator=g)
    bias = 0.5 * torch.randn(m, device="cuda", generator=g)
    y_scale = torch.tensor(0.05, device="cuda")
    out = hw // stride
    z = z_scale = None
    if residual:
        z = torch.randint(-128, 128, (nb, m, out, out), device="cuda", generator=g,
                          dtype=torch.int8).contiguous(memory_format=cl)  # fmt: skip
        z_scale = torch.tensor(0.03, device="cuda")
    attrs = {"activation": act, "out_dtype": 3, "group": 1, "strides": [stride, stride]}
    kernels = _each_conv_kernel(x, x_scale, w, w_scale, bias, z, y_scale, z_scale, attrs)
    for name, got, want in kernels:
        diff = (got.int() - want.int()).abs()
        assert int(diff.max()) <= 1, (name, int(diff.max()))
        assert int(want.int().abs().max()) > 60  # (the codes span the range)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize(
    ("window", "stride", "channels", "act"),
    [(3, 1, 64, "Relu"), (3, 1, 128, "Relu"), (3, 2, 128, "Relu"), (1, 2, 256, "")],
)
def test_implicit_gemm_conv_kernels_match_the_exact_kernel(
    kind: str, window: int, stride: int, channels: int, act: str
) -> None:
    """The conv kernels (A read through TMA's im2col mode): 3x3 padded by 1 at stride 1 and 2
    and 1x1 at stride 2, on 14 x 14 outputs, so that a tile of 128 pixels spans rows and
    images, against the exact kernel: within one E4M3 step, or one int8 code."""
    _library()
    g = torch.Generator(device="cuda").manual_seed(20 + window + stride + channels)
    nb, m, hw = 32, 128, 14 * stride
    cl = torch.channels_last
    if kind == "fp8":
        x = torch.randn(nb, channels, hw, hw, device="cuda", generator=g).to(E4M3)
        w = torch.randn(m, channels, window, window, device="cuda", generator=g).to(E4M3)
        x_scale, code = torch.tensor(0.04, device="cuda"), 17
        w_scale = (0.01 + 0.02 * torch.rand(m, device="cuda", generator=g)) / window
    else:
        x = torch.randint(-128, 128, (nb, channels, hw, hw), device="cuda", generator=g,
                          dtype=torch.int8)  # fmt: skip
        w = torch.randint(-128, 128, (m, channels, window, window), device="cuda", generator=g,
                          dtype=torch.int8)  # fmt: skip
        x_scale, code = torch.tensor(0.02, device="cuda"), 3
        w_scale = (0.0005 + 0.001 * torch.rand(m, device="cuda", generator=g)) / window
    x, w = x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)
    bias = 0.2 * torch.randn(m, device="cuda", generator=g)
    y_scale = torch.tensor(0.05, device="cuda")
    attrs = {"activation": act, "out_dtype": code, "group": 1, "strides": [stride, stride],
             "pads": [window // 2] * 4}  # fmt: skip
    ran = []
    for name, got, want in _conv_kernels(x, x_scale, w, w_scale, bias, None, y_scale, None, attrs):
        ran.append(name)
        _agrees(kind, name, got, want)
    assert ran, "the library has no conv kernel for this convolution"


# ResNet-50's strided layers at 224 x 224: (input channels, output channels, window, input size)
STRIDED = [(128, 128, 3, 56), (256, 256, 3, 28), (512, 512, 3, 14),
           (256, 512, 1, 56), (512, 1024, 1, 28), (1024, 2048, 1, 14)]  # fmt: skip


@pytest.mark.parametrize(("c_in", "c_out", "window", "hw"), STRIDED)
def test_conv_kernels_on_resnet50s_strided_layers(c_in: int, c_out: int, window: int, hw: int):
    """Every conv kernel that claims one of ResNet-50's stride-2 layers (a 3x3 with ReLU, or a
    shortcut 1x1 adding the block's 8-bit residual, as a quantized engine runs it), in E4M3 at
    its real channel counts and image size, at least 16 images and as many as make whole tiles
    of 128 output pixels (the kernels' M; at 7 x 7 that is 128 images, as at ResNet-50's batch
    of 256): within one E4M3 step of the exact kernel (over K >= 2,048 the kernels that promote
    their sums; the others' differences printed)."""
    _library()
    g = torch.Generator(device="cuda").manual_seed(c_in + window)
    out, cl = hw // 2, torch.channels_last
    nb = max(16, 128 // math.gcd(out * out, 128))
    x = (
        torch.randn(nb, c_in, hw, hw, device="cuda", generator=g)
        .to(E4M3)
        .contiguous(memory_format=cl)
    )
    w = torch.randn(c_out, c_in, window, window, device="cuda", generator=g).to(E4M3)
    w = w.contiguous(memory_format=cl)
    x_scale, y_scale = torch.tensor(0.04, device="cuda"), torch.tensor(0.05, device="cuda")
    w_scale = (0.01 + 0.02 * torch.rand(c_out, device="cuda", generator=g)) / (window * 8)
    bias = 0.2 * torch.randn(c_out, device="cuda", generator=g)
    z = z_scale = None
    if window == 1:
        z = torch.randn(nb, c_out, out, out, device="cuda", generator=g).to(E4M3)
        z, z_scale = z.contiguous(memory_format=cl), torch.tensor(0.1, device="cuda")
    attrs = {"activation": "Relu", "out_dtype": 17, "group": 1, "strides": [2, 2],
             "pads": [window // 2] * 4}  # fmt: skip
    ran = []
    for name, got, want in _conv_kernels(x, x_scale, w, w_scale, bias, z, y_scale, z_scale, attrs):
        if c_in * window * window >= 2048 and not name.endswith("p"):  # (Hopper's FP8 sums: see
            off = float((got.float() - want.float()).abs().max())  # the promoted kernels' test)
            print(f"{name}: largest difference {off:.4g}, unpromoted over K >= 2048")
            continue
        _within_a_step(got, want)
        ran.append(name)
    assert ran, "the library has no conv kernel for this layer that must hold"


def test_promoted_fp8_conv_kernels_hold_over_a_long_k() -> None:
    """A 3x3 convolution of 512 channels sums 4,608 products: the kernels that promote their E4M3
    sums into float32 every K step stay within one E4M3 step of the exact kernel; the others'
    largest differences are printed (Hopper's FP8 sums are narrower than float32), which is what
    the autotuner's check decides on."""
    _library()
    g = torch.Generator(device="cuda").manual_seed(44)
    # (ResNet-50's last stage's channels on an 8 x 8 map: 2,048 pixels, as the kernels take a
    # multiple of 128; its 7 x 7 at a batch of 32, 1,568, is one no library kernel takes)
    nb, c, hw = 32, 512, 8
    cl = torch.channels_last
    x = torch.randn(nb, c, hw, hw, device="cuda", generator=g).to(E4M3).contiguous(memory_format=cl)
    w = torch.randn(c, c, 3, 3, device="cuda", generator=g).to(E4M3).contiguous(memory_format=cl)
    x_scale = torch.tensor(0.04, device="cuda")
    w_scale = (0.01 + 0.02 * torch.rand(c, device="cuda", generator=g)) / 24
    bias = 0.2 * torch.randn(c, device="cuda", generator=g)
    y_scale = torch.tensor(0.02, device="cuda")
    attrs = {"activation": "Relu", "out_dtype": 17, "group": 1, "strides": [1, 1],
             "pads": [1, 1, 1, 1]}  # fmt: skip
    promoted = []
    for name, got, want in _conv_kernels(x, x_scale, w, w_scale, bias, None, y_scale, None, attrs):
        off = float((got.float() - want.float()).abs().max())
        print(
            f"{name}: largest difference {off:.4g} (largest output {float(want.float().max()):.4g})"
        )
        if name.endswith("p"):
            _within_a_step(got, want)
            promoted.append(name)
    assert promoted, "the library has no promoted FP8 conv kernel for this convolution"


def _conv_kernels(*args):
    """_each_conv_kernel's results for the library's conv kernels (implicit GEMM) only."""
    for name, got, want in _each_conv_kernel(*args):
        if name.startswith(cf.PREFIX + "conv"):
            yield name, got, want


def _mlp(rng, rows: int):
    """Three GEMMs (256 -> 1024, GELU; 1024 -> 256, ReLU; 256 -> 256): the first two write an
    8-bit output for the next, the shapes the kernels take."""
    from onnx import TensorProto, helper, numpy_helper

    inits = {
        "w1": rng.standard_normal((1024, 256)) * 0.06, "b1": rng.standard_normal(1024) * 0.1,
        "w2": rng.standard_normal((256, 1024)) * 0.03, "b2": rng.standard_normal(256) * 0.1,
        "w3": rng.standard_normal((256, 256)) * 0.06, "b3": rng.standard_normal(256) * 0.1,
    }  # fmt: skip
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], "fc1", transB=1),
        helper.make_node("Gelu", ["h1"], ["g1"], "gelu1"),
        helper.make_node("Gemm", ["g1", "w2", "b2"], ["h2"], "fc2", transB=1),
        helper.make_node("Relu", ["h2"], ["r2"], "relu2"),
        helper.make_node("Gemm", ["r2", "w3", "b3"], ["y"], "fc3", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a.astype("float32"), k) for k, a in inits.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_an_fp8_engine_times_the_kernels_and_matches_the_reference(tmp_path) -> None:
    """An FP8 build with the library configured: the autotuner times the CUTLASS tactics of the
    8-bit-output GEMMs and accepts them (its own check against the float32 oracle), and the
    engine's output, whichever tactics won, is the reference backend's to E4M3's rounding."""
    import numpy as np
    import onnx

    from tensorkiln.builder import Builder, BuilderConfig

    _library()
    rng = np.random.default_rng()
    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(rng, 1024), path)
    calib = [{"x": rng.standard_normal((1024, 256)).astype(np.float32)} for _ in range(2)]
    ref_config = BuilderConfig()
    ref_config.set_flag("fp8")
    ref_config.calibration_data = calib
    ref_config.calibration_cache = str(tmp_path / "calib.json")
    ref = Builder("reference").build(path, ref_config)
    config = BuilderConfig()
    config.set_flag("fp8")
    config.calibration_cache = str(tmp_path / "calib.json")
    engine = Builder("cuda").build(path, config)
    timed = {
        x["name"]: sorted(x.get("timings_ms", {}))
        for x in engine.layers
        if x["op"].endswith("QGemmAct")
    }
    print({x["name"]: x.get("tactic") for x in engine.layers}, timed)
    cutlass = [n for names in timed.values() for n in names if n.startswith(cf.PREFIX)]
    assert cutlass, f"no CUTLASS tactic was timed: {timed}"
    for x in engine.layers:
        rejected = {k: v for k, v in x.get("rejected", {}).items() if k.startswith(cf.PREFIX)}
        assert not rejected, (x["name"], rejected)
    x = rng.standard_normal((1024, 256)).astype(np.float32)
    want = ref.create_execution_context().infer({"x": x})["y"]
    got = np.asarray(engine.create_execution_context().infer({"x": x})["y"])
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-2
