"""benchmarks/qconv_3x3.py's TMA 3x3 convolution (kernels/triton/conv_tma.py) as the benchmark
runs it: interpreted, against the benchmark's float64 reference on the same 8-bit values
(padding, image edges and a last row tile that runs past the pixels included), and the kernel's
compiled form for Hopper: TMA loads feeding WGMMA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks._common import steps_off  # noqa: E402

from benchmarks import qconv_3x3 as q  # noqa: E402
from tensorkiln.kernels.triton.gemm import TileConfig  # noqa: E402
from tests.kernels.triton import compile_child  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize(("nb", "c", "hw"), [(2, 16, 5), (3, 32, 6)])
def test_matches_float64_arithmetic_on_the_8_bit_values(dtype, nb: int, c: int, hw: int) -> None:
    x, w, col, bias, ys = q.operands(nb, c, hw, dtype, "cpu", seed=nb * 10 + c)
    want = q.reference(x, w, col, bias, ys)
    # 16-pixel row tiles: taps reach across image rows and images, the last tile runs past the end
    got = q.tma_conv3x3(x, w, col, bias, ys, config=TileConfig(16, 16, 16, 1, 1))
    assert got.dtype == dtype and got.shape == want.shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert steps_off(got, want) == 0.0  # (none more than one output step away)
    assert float((got.float() == want.float()).float().mean()) > 0.98
    assert 0.2 < float((want.float() == 0).float().mean()) < 0.8  # (ReLU bites, not everywhere)
    assert float(want.float().abs().max()) > 60  # (the codes span the range)


_CHILD = r"""
import json, re, sys
sys.path[:0] = [sys.argv[1] + "/src"]
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tensorkiln.kernels.triton import conv_tma
out = {}
for kind, el, y in (("fp8", "fp8e4nv", "*u8"), ("int8", "i8", "*i8")):
    sig = {"x_desc": f"tensordesc<{el}[128, 64]>", "w_desc": f"tensordesc<{el}[64, 64]>",
           "b_ptr": "*fp32", "y_ptr": y, "xs_ptr": "*fp32", "ws_ptr": "*fp32", "q_ptr": "*fp32",
           **{k: "i32" for k in ("P", "H", "W", "C", "OC", "s_ws")},
           **{k: "fp32" for k in ("p0", "p1", "lo", "hi")},
           **{k: "constexpr" for k in ("HAS_B", "ACT", "QUANT", "QOUT", "UPCAST", "BLOCK_M",
                                       "BLOCK_N", "BLOCK_K", "STAGES", "GROUP_M")}}
    const = {"HAS_B": True, "ACT": 1, "QUANT": 2 if kind == "fp8" else 1,
             "QOUT": 2 if kind == "fp8" else 1, "UPCAST": False, "BLOCK_M": 128, "BLOCK_N": 64,
             "BLOCK_K": 64, "STAGES": 3, "GROUP_M": 8}
    src = ASTSource(fn=conv_tma._conv3x3_kernel, signature=sig, constexprs=const)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    out[kind] = {"wgmma": re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.(\w+)\.(\w+)", ptx),
                 "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx))}
print(json.dumps(out))
"""


def test_compiles_for_hopper_to_tma_loads_and_wgmma(tmp_path: Path) -> None:
    got = compile_child(_CHILD, ROOT, tmp_path)
    # 8-bit tensor-core instructions of 64 rows by the 64-column tile, 32 deep
    assert got["fp8"]["wgmma"] and all(
        w == ["m64n64k32", "f32", "e4m3"] for w in got["fp8"]["wgmma"]
    ), got["fp8"]["wgmma"]
    assert got["int8"]["wgmma"] and all(
        w == ["m64n64k32", "s32", "s8"] for w in got["int8"]["wgmma"]
    ), got["int8"]["wgmma"]
    assert got["fp8"]["tma"] > 0 and got["int8"]["tma"] > 0  # (the tiles come in through TMA)
