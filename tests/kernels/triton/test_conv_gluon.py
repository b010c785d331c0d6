"""kernels/triton/conv_gluon.py, the Gluon 8-bit convolution for Hopper (1x1 and 3x3, stride 1
or 2).

Gluon kernels have no interpreter, so on any machine: the pixel blocks it picks, the shapes it
takes, and its compiled form for sm_90 (every tap one four-dimensional TMA load, both WGMMA
operands from shared memory, the output stored by TMA). On an H200 (marked gpu): its results
against float64 arithmetic on the same 8-bit values, at shapes whose tiles run past the image's
rows, columns and the last image, and through the tactic registry as an engine calls it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton.experimental.gluon")

from tensorkiln.kernels.common.window import Geometry  # noqa: E402
from tensorkiln.kernels.triton import conv_gluon as cg  # noqa: E402
from tests.kernels.triton import compile_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _pixels_covered(nb: int, h: int, w: int, block: tuple[int, int, int]) -> int:
    bb, bh, bw = block
    return math.ceil(nb / bb) * bb * math.ceil(h / bh) * bh * math.ceil(w / bw) * bw


@pytest.mark.parametrize(("nb", "h", "w"), [(256, 56, 56), (256, 28, 28), (256, 14, 14),
                                            (256, 7, 7), (3, 5, 6), (1, 1, 1), (2, 112, 40)])  # fmt: skip
@pytest.mark.parametrize("min_bw", [4, 16])
def test_pixel_blocks_are_128_pixels_of_the_fewest_wasted(nb, h, w, min_bw) -> None:
    """Powers of two whose product is 128, columns at least ``min_bw`` wide (or the row), and
    no block of those covers fewer pixels (counted here by brute force)."""
    bb, bh, bw = cg.blocks(nb, h, w, min_bw)
    assert bb * bh * bw == 128 and all(v & (v - 1) == 0 for v in (bb, bh, bw))
    assert bw >= min(min_bw, 1 << (w - 1).bit_length())
    got = _pixels_covered(nb, h, w, (bb, bh, bw))
    for other_bw in (2**i for i in range(8)):
        for other_bh in (2**i for i in range(8)):
            if other_bw * other_bh > 128 or other_bw < min(min_bw, 1 << (w - 1).bit_length()):
                continue
            other = (128 // (other_bw * other_bh), other_bh, other_bw)
            assert got <= _pixels_covered(nb, h, w, other), other
    if (nb, h, w) == (256, 56, 56) and min_bw == 4:  # (ResNet's first stage: no pixel wasted)
        assert got == nb * h * w


def test_takes_only_its_convolutions() -> None:
    """1x1 or 3x3 padded by half the window, stride 1 or 2 (2: even sides), no dilation, one
    group, int8 or E4M3, channels in whole K steps and output channels in 16s."""

    def geom(k, s, p, d=1, out=(6, 4)):
        return Geometry((k, k), (s, s), (d, d), (p, p), (p, p), out)

    x = (2, 64, 6, 4)
    assert cg.applies(x, (48, 64, 3, 3), "int8", geom(3, 1, 1), 1)
    assert cg.applies(x, (48, 64, 3, 3), "float8_e4m3fn", geom(3, 2, 1, out=(3, 2)), 1)
    assert cg.applies(x, (48, 64, 1, 1), "int8", geom(1, 1, 0), 1)
    assert cg.applies(x, (48, 64, 1, 1), "int8", geom(1, 2, 0, out=(3, 2)), 1)
    assert cg.applies((2, 128, 6, 4), (48, 128, 3, 3), "int8", geom(3, 1, 1), 1, block_k=128)
    for other_x, other_w, dtype, g, group in (
        (x, (48, 64, 3, 3), "float16", geom(3, 1, 1), 1),
        (x, (48, 32, 3, 3), "int8", geom(3, 1, 1), 2),
        ((2, 96, 6, 4), (48, 96, 3, 3), "int8", geom(3, 1, 1), 1),  # (96: not in 64s)
        (x, (40, 64, 3, 3), "int8", geom(3, 1, 1), 1),  # (40 output channels)
        ((2, 64, 5, 4), (48, 64, 3, 3), "int8", geom(3, 2, 1, out=(3, 2)), 1),  # (odd height)
        (x, (48, 64, 3, 3), "int8", geom(3, 3, 1, out=(2, 2)), 1),  # (stride 3)
        (x, (48, 64, 3, 3), "int8", geom(3, 1, 2, 2), 1),  # (dilated)
        (x, (48, 64, 3, 3), "int8", geom(3, 1, 0, out=(4, 2)), 1),  # (unpadded)
        (x, (48, 64, 5, 5), "int8", geom(5, 1, 2), 1),
    ):
        assert not cg.applies(other_x, other_w, dtype, g, group), (other_w, g)


def test_tma_reads_a_dense_aligned_copy_only_where_it_must() -> None:
    """A channels-last input from an aligned address is read in place; one a byte into a
    buffer (``contiguous`` would hand it back unmoved), or channels-first, is copied to an
    aligned dense NHWC tensor with the same values."""
    x = torch.randint(-128, 128, (2, 6, 5, 32), dtype=torch.int8)  # (NHWC values)
    assert cg._nhwc(x.permute(0, 3, 1, 2)).data_ptr() == x.data_ptr()
    flat = torch.empty(x.numel() + 1, dtype=torch.int8)
    shifted = flat[1:].view(2, 6, 5, 32)
    shifted.copy_(x)
    for variant in (shifted.permute(0, 3, 1, 2), x.permute(0, 3, 1, 2).contiguous()):
        got = cg._nhwc(variant)
        assert got.data_ptr() % 16 == 0 and got.is_contiguous() and torch.equal(got, x)


_CHILD = r"""
import json, re, sys
sys.path[:0] = [sys.argv[1] + "/src"]
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from tensorkiln.kernels.triton import conv_gluon as cg
out = {}
cases = (("fp8", torch.float8_e4m3fn, torch.float8_e4m3fn, cg.CONFIGS[0], 3, 1),
         ("int8", torch.int8, torch.int8, cg.CONFIGS[2], 3, 1),
         ("fp8-f16-unpromoted", torch.float8_e4m3fn, torch.float16, cg.CONFIGS[-1], 3, 1),
         ("int8-stride2", torch.int8, torch.int8, cg.CONFIGS[0], 3, 2),
         ("fp8-1x1-stride2", torch.float8_e4m3fn, torch.float8_e4m3fn, cg.CONFIGS[2], 1, 2),
         ("int8-1x1-residual", torch.int8, torch.int8, cg.CONFIGS[0], 1, 1))
for kind, xdt, ydt, tile, k, stride in cases:
    cl = torch.channels_last
    x = torch.empty(2, 64, 56, 56, dtype=xdt).contiguous(memory_format=cl)
    w = torch.empty(tile.block_n, 64, k, k, dtype=xdt).contiguous(memory_format=cl)
    o = 56 // stride
    y = torch.empty(2, tile.block_n, o, o, dtype=ydt).contiguous(memory_format=cl)
    z = torch.empty_like(y) if "residual" in kind else None
    xd, wd, yd, zd, _ = cg.descriptors(x, w, y, tile, cg.blocks(2, o, o, tile.min_bw), stride, z)
    sig = {"x_desc": mangle_type(xd), "w_desc": mangle_type(wd), "y_desc": mangle_type(yd),
           "z_desc": mangle_type(zd),
           **{k: "*fp32" for k in ("b_ptr", "xs_ptr", "ws_ptr", "q_ptr", "zs_ptr")},
           **{k: "i32" for k in ("C", "OC", "s_ws", "tiles_h", "tiles_w")},
           **{k: "fp32" for k in ("p0", "p1", "lo", "hi")},
           **{k: "constexpr" for k in ("KH", "KW", "PAD", "STRIDE", "HAS_B", "ACT", "HAS_Z",
                                       "Z_AFTER", "Z_SCALED", "QUANT", "QOUT", "PROMOTE",
                                       "STAGES", "num_warps")}}
    quant = 1 if xdt == torch.int8 else 2
    const = {"KH": k, "KW": k, "PAD": k // 2, "STRIDE": stride, "HAS_B": True, "ACT": 1,
             "HAS_Z": z is not None, "Z_AFTER": False, "Z_SCALED": z is not None,
             "QUANT": quant,
             "QOUT": {torch.int8: 1, torch.float8_e4m3fn: 2}.get(ydt, 0),
             "PROMOTE": tile.promote and quant == 2, "STAGES": tile.stages,
             "num_warps": tile.warps}
    src = GluonASTSource(fn=cg._conv_kernel, signature=sig, constexprs=const)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.warps})
    ptx = k.asm["ptx"]
    mma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.(\w+)\.(\w+)\.(\w+) \{[^}]*\}, "
                     r"(\S+), (\S+),", ptx)
    out[kind] = {"wgmma": sorted({m[:4] for m in mma}),
                 "a_from_smem": all(m[4].startswith("%rd") for m in mma) and bool(mma),
                 "load_x": len(re.findall(r"cp\.async\.bulk\.tensor\.[45]d\.shared::cluster\.global", ptx)),
                 "load5d": len(re.findall(r"cp\.async\.bulk\.tensor\.5d\.shared::cluster\.global", ptx)),
                 "load2d": len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global", ptx)),
                 "store4d": len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.global\.shared", ptx)),
                 "local": len(re.findall(r"(ld|st)\.local", ptx))}
print(json.dumps(out))
"""


def test_compiles_for_hopper_to_tma_taps_and_wgmma_from_shared_memory(tmp_path: Path) -> None:
    got = compile_child(_CHILD, ROOT, tmp_path)
    assert got["fp8"]["wgmma"] == [["m64n64k32", "f32", "e4m3", "e4m3"]], got["fp8"]
    assert got["int8"]["wgmma"] == [["m64n128k32", "s32", "s8", "s8"]], got["int8"]
    for kind, case in got.items():
        # A and B as shared-memory descriptors (64-bit registers), not A's fragments in registers
        assert case["a_from_smem"], (kind, case)
        assert case["load_x"] > 0 and case["load2d"] > 0 and case["store4d"] == 1, (kind, case)
        # (a residual: its tile one more 4-D load, issued before the sums)
        if "residual" in kind:
            assert case["load_x"] == got["int8"]["load_x"] + 1, (kind, case, got["int8"])
        assert case["local"] == 0, (kind, case)  # (nothing spilled)
        # (stride 2: each tap one five-dimensional box of the (N, H/2, 2, W/2, 2C) view)
        assert (case["load5d"] > 0) == ("stride2" in kind), (kind, case)


# --- on the GPU ---------------------------------------------------------------------------

needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")


def _operands(seed, nb, c, oc, h, w, dtype, k=3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cl = torch.channels_last
    if dtype == torch.int8:
        x = torch.randint(-128, 128, (nb, c, h, w), generator=g, device="cuda").to(dtype)
        wq = torch.randint(-128, 128, (oc, c, k, k), generator=g, device="cuda").to(dtype)
        unit = 127.0
    else:
        x = (torch.randn(nb, c, h, w, generator=g, device="cuda") * 64).to(dtype)
        wq = (torch.randn(oc, c, k, k, generator=g, device="cuda") * 64).to(dtype)
        unit = 64.0
    ws = (0.5 + torch.rand(oc, generator=g, device="cuda")) / (unit * unit * (k * k * c) ** 0.5)
    xs = torch.tensor([1.0], device="cuda")
    bias = 0.2 * torch.randn(oc, generator=g, device="cuda")
    return x.contiguous(memory_format=cl), wq.contiguous(memory_format=cl), xs, ws, bias


def _act(relu: bool):
    from tensorkiln.kernels.triton.gemm import Epilogue

    return Epilogue.of("Relu" if relu else "")


def _reference(x, wq, xs, ws, bias, relu, stride=1):
    pad = wq.shape[2] // 2
    acc = torch.nn.functional.conv2d(x.double(), wq.double(), stride=stride, padding=pad)
    v = acc * (xs.double() * ws.double()).reshape(1, -1, 1, 1) + bias.double().reshape(1, -1, 1, 1)
    return v.clamp_min(0) if relu else v


def _quantized(v: torch.Tensor, ys: float, dtype: torch.dtype) -> torch.Tensor:
    q = v / ys
    if dtype == torch.int8:
        return torch.round(q).clamp(-128, 127).to(torch.int8)
    return q.clamp(-448, 448).float().to(dtype)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tile", cg.CONFIGS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize(("nb", "c", "oc", "h", "w", "k", "stride"), [
    (3, 64, 80, 7, 7, 3, 1), (2, 128, 144, 14, 14, 3, 1), (2, 64, 64, 28, 20, 3, 1),
    (1, 256, 64, 5, 9, 3, 1), (3, 64, 80, 14, 10, 3, 2), (2, 128, 64, 8, 6, 1, 2),
    (2, 64, 96, 9, 7, 1, 1),
])  # fmt: skip
@pytest.mark.parametrize("relu", [True, False])
def test_float_outputs_match_float64_sums(tile, dtype, nb, c, oc, h, w, k, stride, relu) -> None:
    """Float32 and float16 outputs against float64 sums of the same 8-bit values: tiles that run
    past the rows, columns and images; 3x3 and 1x1, stride 1 and 2; output channels past a
    tile's width."""
    if c % tile.block_k or (dtype == torch.int8 and not tile.promote):
        pytest.skip("not a shape or type this tiling takes")
    x, wq, xs, ws, bias = _operands(nb * 1000 + c + oc + k, nb, c, oc, h, w, dtype, k)
    want = _reference(x, wq, xs, ws, bias, relu, stride)
    for out in (torch.float32, torch.float16):
        got = cg.conv(x, wq, bias, scale=(xs, ws), stride=stride, epilogue=_act(relu),
                      out_dtype=out, config=tile)  # fmt: skip
        assert got.dtype == out and got.shape == want.shape
        assert got.is_contiguous(memory_format=torch.channels_last)
        err = float((got.double() - want).norm() / want.norm())
        # int8: exact sums, then float32 (or float16) rounding; E4M3: Hopper's FP8 sums keep
        # fewer bits than float32, held to the tactic tests' bound (1/64 of the norm; a tap or
        # pixel read from the wrong place is off by the norm itself)
        bound = {torch.float32: 1e-6, torch.float16: 1e-3}[out]
        if dtype != torch.int8:
            bound = 2**-6
        assert err <= bound, (out, err)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize(("nb", "c", "oc", "h", "w"), [(3, 64, 80, 7, 7), (2, 64, 64, 28, 20)])
def test_quantized_outputs_are_within_one_step(dtype, nb, c, oc, h, w) -> None:
    x, wq, xs, ws, bias = _operands(nb + c + h, nb, c, oc, h, w, dtype)
    v = _reference(x, wq, xs, ws, bias, True)
    ys = float(v.abs().max()) / (127 if dtype == torch.int8 else 448)
    want = _quantized(v, ys, dtype)
    got = cg.conv(x, wq, bias, scale=(xs, ws), epilogue=_act(True), out_dtype=dtype,
                  y_scale=torch.tensor([ys], device="cuda"), config=cg.CONFIGS[0])  # fmt: skip
    assert got.dtype == dtype and got.is_contiguous(memory_format=torch.channels_last)
    g, wf = got.float(), want.float()
    if dtype == torch.int8:
        assert float((g - wf).abs().max()) <= 1
    else:  # (E4M3: one step of the larger value's exponent; Hopper's FP8 sums may leave a
        # few outputs near zero further off)
        step = torch.exp2(
            torch.floor(torch.log2(torch.maximum(g.abs(), wf.abs()).clamp_min(2**-6))) - 3
        )
        assert float(((g - wf).abs() > step * 1.0001).float().mean()) <= 1e-3
    assert float((g == wf).float().mean()) > 0.98
    assert 0.2 < float((wf == 0).float().mean()) < 0.8  # (ReLU bites, not everywhere)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("z_dtype", [torch.float16, torch.float32, "same"])
@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize(("k", "stride"), [(1, 1), (3, 1), (1, 2)])
def test_the_residual_is_added_before_or_after_the_activation(dtype, z_dtype, after, k, stride):
    """``relu(conv + b + z)`` (or ``relu(conv + b) + z``) with a float residual, or an 8-bit
    one read as ``z * z_scale``, against float64 arithmetic on the same values."""
    nb, c, oc, h, w = 2, 64, 80, 10, 6
    x, wq, xs, ws, bias = _operands(7 + k + stride, nb, c, oc, h, w, dtype, k)
    conv = _reference(x, wq, xs, ws, bias, False, stride)
    g = torch.Generator(device="cuda").manual_seed(3)
    z32 = torch.randn(conv.shape, generator=g, device="cuda")
    if z_dtype == "same":
        z_scale = torch.tensor([0.02], device="cuda")
        z = (z32 / 0.02).clamp(-127, 127).round().to(dtype) if dtype == torch.int8 else (
            (z32 / 0.02).to(dtype))  # fmt: skip
        z_val = z.double() * 0.02
    else:
        z_scale, z = None, z32.to(z_dtype)
        z_val = z.double()
    z = z.contiguous(memory_format=torch.channels_last)
    want = (conv.clamp_min(0) + z_val) if after else (conv + z_val).clamp_min(0)
    got = cg.conv(x, wq, bias, z, scale=(xs, ws), stride=stride, epilogue=_act(True),
                  residual_after=after, out_dtype=torch.float32, z_scale=z_scale,
                  config=cg.CONFIGS[0])  # fmt: skip
    err = float((got.double() - want).norm() / want.norm())
    assert err <= (1e-6 if dtype == torch.int8 else 2**-6), err
