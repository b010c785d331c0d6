"""The quantizing Triton kernels compile for Hopper (sm_90) on a machine without a GPU: Triton
compiles for a stated target (PTX, then ptxas, both in its wheel), so the compiled forms that
only a GPU runs, which the interpreter never sees, are checked here too. Each kernel is compiled
with the hardware's E4M3 conversion (as on a GPU of compute capability 8.9 and up) and without
it, and the PTX is read for the conversion: there where it is asked for, absent where not.
(Whether the compiled kernels compute the right values only a GPU can say:
tests/kernels/triton/test_quantize.py runs on CUDA tensors there.)

Run in child processes, one a variant, each with a cache of its own: the test suite interprets
Triton (TRITON_INTERPRET=1), and the kernels' modules read that when they are imported; and
Triton's compile cache does not tell the variants apart (the flag is a module global).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

from tests.kernels.triton import compile_child

ROOT = Path(__file__).resolve().parents[3]

_CHILD = r"""
import json, sys
sys.path[:0] = [sys.argv[1] + "/src"]
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tensorkiln.kernels.triton import norm, quantize

target = GPUTarget("cuda", 90, 32)
out = {}
hardware = sys.argv[2] == "hardware"
quantize.HARDWARE_E4M3 = tl.constexpr(hardware)  # (read when a kernel is compiled)
kernels = {
    "quantize": (quantize._quantize_kernel,
                 {"x_ptr": "*fp16", "s_ptr": "*fp32", "z_ptr": "*fp32", "y_ptr": "*u8",
                  "N": "i32", "lo": "fp32", "hi": "fp32", "HAS_Z": "constexpr",
                  "FLOAT8": "constexpr", "BLOCK": "constexpr"},
                 {"HAS_Z": False, "FLOAT8": True, "BLOCK": 1024}),
    "layernorm": (norm._norm_rows,
                  {"X": "*fp16", "R": "*fp16", "W": "*fp16", "B": "*fp16", "Y": "*fp16",
                   "S": "*fp16", "MEAN": "*fp32", "INV": "*fp32", "Q": "*u8", "QS": "*fp32",
                   "n_rows": "i32", "N": "i32", "eps": "fp32", "R_ROWS": "i32",
                   "HAS_RES": "constexpr",
                   "HAS_B": "constexpr", "STORE_S": "constexpr", "STATS": "constexpr",
                   "RMS": "constexpr", "QOUT": "constexpr", "ROWS": "constexpr",
                   "BLOCK_N": "constexpr"},
                  {"HAS_RES": True, "HAS_B": True, "STORE_S": False, "STATS": False,
                   "RMS": False, "QOUT": 2, "ROWS": 2, "BLOCK_N": 1024}),
}
for name, (fn, signature, constexprs) in kernels.items():
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    ptx = triton.compile(src, target=target).asm["ptx"]
    out[f"{name}{'_hw' if hardware else ''}"] = {
        "fma": ptx.count("fma.rn.f32"), "div": ptx.count("div.rn.f32"),
        "cvt_e4m3": ptx.count("e4m3x2.f32"),
    }
print(json.dumps(out))
"""


@pytest.mark.parametrize("variant", ["hardware", "integer"])
def test_quantizing_kernels_compile_for_sm90(tmp_path: Path, variant: str) -> None:
    counts = compile_child(_CHILD, ROOT, tmp_path / "triton-cache", variant)
    assert len(counts) == 2
    for name, c in counts.items():
        assert (c["cvt_e4m3"] > 0) == name.endswith("_hw"), (name, c)


_WIDEN_CHILD = r"""
import json, sys
sys.path[:0] = [sys.argv[1] + "/src"]
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tensorkiln.kernels.triton import quantize

src = ASTSource(
    fn=quantize._widen_padded_kernel,
    signature={"x_ptr": "*u8", "y_ptr": "*fp16", "C": "i32", "H": "i32", "W": "i32",
               "HP": "i32", "WP": "i32", "top": "i32", "left": "i32",
               "sn": "i64", "sc": "i64", "sh": "i64", "sw": "i64", "CP": "constexpr",
               "FLOAT8": "constexpr", "WIDEN": "constexpr", "BLOCK": "constexpr"},
    constexprs={"CP": 4, "FLOAT8": True, "WIDEN": True, "BLOCK": 256},  # (a stem's row)
    attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},  # (as launched)
)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print(json.dumps({"stores": ptx.count("st.global"), "wide": ptx.count("st.global.v2")
                  + ptx.count("st.global.v4"),
                  "divisions": sum(ptx.count(f"{op}.{t}64") for op in ("div", "rem")
                                   for t in ("s", "u"))}))
"""


def test_padded_widening_compiles_for_sm90(tmp_path: Path) -> None:
    """quantize.widen_padded's kernel (a block of a row's pixels by 4 channels) compiles for
    Hopper, writes each pixel's 4 float16 channels with vector stores (8 bytes and more), and
    divides the row's index into batch and row once, if at all in 64 bits (at most two 64-bit
    divisions in its PTX, where dividing every pixel's index compiled to 25)."""
    counts = compile_child(_WIDEN_CHILD, ROOT, tmp_path / "triton-cache")
    assert counts["stores"] > 0 and counts["wide"] > 0, counts
    assert counts["divisions"] <= 2, counts


# the stem's kernel ("stem") or the stem-and-pool one ("pool"), as ResNet-50's stem launches it:
# the pointers, 64 channels, the packed width 240 and the channels-last output's strides
# divisible by 16, its channel stride 1
_STEM_CHILD = r"""
import json, sys
sys.path[:0] = [sys.argv[1] + "/src"]
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tensorkiln.kernels.triton import conv_stem

pool = sys.argv[2] == "pool"
sizes = ["OC", "OH", "OW", "PH", "PW"] if pool else ["M", "OC", "OH", "OW"]
names = ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "xs_ptr", "ws_ptr", "q_ptr", *sizes, "HP", "WP",
         "KH", "s_ws", "sy_n", "sy_c", "sy_h", "sy_w", "p0", "p1", "lo", "hi"]
aligned = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "xs_ptr", "ws_ptr", "q_ptr", "OC", "WP", "sy_n",
           "sy_h", "sy_w", *(() if pool else ("M",)))
cfg = conv_stem.POOL_CONFIGS[1]
tiling = ({"ROWS": cfg.rows, "BLOCK_P": cfg.block_p, "KPAD": 0} if pool else {"BLOCK_M": 128})
kernel = conv_stem._stem_pool_kernel if pool else conv_stem._stem_kernel
options = ({"num_warps": cfg.warps, "num_stages": cfg.stages} if pool
           else {"num_warps": 4, "num_stages": 3})
out = {}
for quant, eight in ((1, "*i8"), (2, "*fp8e4nv")):
    types = [eight, eight, "*fp32", "*i8" if quant == 1 else "*u8", "*fp32", "*fp32", "*fp32"]
    signature = dict(zip(names, types + ["i32"] * (len(names) - 11) + ["fp32"] * 4))
    constexprs = {"sy_c": 1, "STRIDE_H": 2, "STRIDE_W": 2, "CPK": 4, "HAS_B": True, "ACT": 1,
                  "QUANT": quant, "QOUT": quant, "UPCAST": False, **tiling, "BLOCK_N": 64,
                  "BLOCK_K": 32}
    signature.update({k: "constexpr" for k in constexprs})
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    out[quant] = {"wgmma": ptx.count("wgmma.mma_async.sync.aligned.m64n64k32"),
                  "loads": ptx.count("cp.async.ca.shared.global"),
                  "wide_loads": ptx.count("], 0x8,"), "stores": ptx.count("st.global"),
                  "wide_stores": ptx.count("st.global.v4")}
print(json.dumps(out))
"""


def _stem_ptx(kernel: str, tmp_path: Path) -> None:
    """The stem child's counts for ``kernel``: 8-bit WGMMA, every window load 8 bytes wide, every
    store 16 bytes wide."""
    counts = compile_child(_STEM_CHILD, ROOT, tmp_path / "triton-cache", kernel)
    for quant, c in counts.items():
        assert c["wgmma"] > 0, (quant, c)
        assert c["loads"] > 0 and c["wide_loads"] == c["loads"], (quant, c)
        assert c["stores"] > 0 and c["wide_stores"] == c["stores"], (quant, c)


def test_the_stem_convolution_compiles_for_sm90(tmp_path: Path) -> None:
    """conv_stem's kernel compiles for Hopper with 8-bit tensor-core instructions (WGMMA, K 32,
    int8 and E4M3), its window rows loaded 8 bytes at a time into shared memory ahead of their
    use (cp.async), and its 8-bit output written 16 bytes at a time."""
    _stem_ptx("stem", tmp_path)


def test_the_stem_and_pool_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    """conv_stem_pool's kernel compiles for Hopper: 8-bit WGMMA (K 32) for each of a stem row's
    two tiles, window rows loaded 8 bytes at a time ahead of their use, and the pooled 8-bit
    output written 16 bytes at a time (the gather of the odd columns lowered with the rest)."""
    _stem_ptx("pool", tmp_path)
