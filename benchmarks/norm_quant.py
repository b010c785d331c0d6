"""What a LayerNorm that also writes its output quantized (an 8-bit engine's LayerNorm before a
quantized GEMM) costs on the GPU, and where: the library's kernel plain and quantizing, beside
a copy of it written here whose quantization changes one thing at a time.

    python benchmarks/norm_quant.py [--rows 8192] [--cols 768] [--reps 20]

Every call is timed inside a CUDA graph of 20 calls (these kernels take microseconds; a single
call timed with events measures Python's launch instead), the median of ``--reps`` replays.
Variants (each one's E4M3 codes checked against the library's first, within one step):
- ``library``, ``library E4M3``: kernels/triton/norm.py's ``normalize``, plain and quantizing;
- ``copy, plain``: the copy below, no quantized output (it should time as ``library``);
- ``copy, requantize``: the library's quantization (its division, clamp, NaN test, codes as
  integers stored as bytes): it should time as ``library E4M3``;
- ``copy, div + cast``: the IEEE division, then Triton's float-to-E4M3 conversion (the
  hardware's, which saturates) stored as float8;
- ``copy, mul + cast``: the same with ``y * (1 / scale)`` instead of the division;
each with the residual read (``+res``, BERT's LayerNorms after attention and FFN) and not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import graph_time_ms as _time

from tensorkiln.kernels.triton.norm import _row_block, _summed, _written, normalize, row_tile
from tensorkiln.kernels.triton.quantize import requantize


@triton.jit
def _norm_copy(
    X, R, W, B, Y, Q, QS, n_rows, N, eps,
    HAS_RES: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    _, cols, _, cmask, mask, offs = _row_block(n_rows, N, ROWS, BLOCK_N)
    # (the library's reads and writes, with its quantization left out and done below)
    x = _summed(X, R, Y, Y, offs, mask, HAS_RES, False)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = _written(xc, inv, W, B, Y, Q, QS, cols, cmask, offs, mask, True, 0)
    if MODE == 1:
        code = requantize(y.to(tl.float32), tl.load(QS), 2)
        tl.store(Q + offs, code.to(tl.uint8).to(tl.float8e4nv, bitcast=True), mask=mask)
    if MODE == 2:
        q = tl.math.div_rn(y.to(tl.float32), tl.load(QS))
        tl.store(Q + offs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    if MODE == 3:
        q = y.to(tl.float32) * (1.0 / tl.load(QS))
        tl.store(Q + offs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    rows, n = args.rows, args.cols
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(rows, n, device="cuda", generator=g).half()
    r = torch.randn(rows, n, device="cuda", generator=g).half()
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).half()
    b = (0.1 * torch.randn(n, device="cuda", generator=g)).half()
    scale = torch.tensor(4.0 / 448, device="cuda")
    e4m3 = torch.float8_e4m3fn
    q = torch.empty(rows, n, device="cuda", dtype=e4m3)
    y = torch.empty_like(x)
    block_n, per, warps = row_tile(n, rows)
    print(f"{torch.cuda.get_device_name()}, {rows} x {n} fp16, torch {torch.__version__}")
    print("variant | rows a program | warps | ms | GB/s")
    for res in (False, True):
        tag = " +res" if res else ""
        resid = r if res else None
        want = torch.empty_like(q)
        normalize(x, w, b, resid, eps=1e-12, quantized=(want, scale))
        want = want.float()
        step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2**-6))) - 3)
        read = (2 if res else 1) * n * 2
        for label, fn, nbytes in (
            ("library", lambda rr=resid: normalize(x, w, b, rr, eps=1e-12), read + 2 * n),
            ("library E4M3",
             lambda rr=resid: normalize(x, w, b, rr, eps=1e-12, quantized=(q, scale)),
             read + 3 * n),
        ):  # fmt: skip
            ms = _time(fn, args.reps)
            print(f"{label}{tag} | {per} | {warps} | {ms:.4f} | {rows * nbytes / ms / 1e6:.0f}")
        # The quantizing LayerNorm's tactics at other tiles
        for tile in ((1, 4), (4, 4)):
            label = "library E4M3 tile"

            def tactic(rr=resid, tile=tile) -> None:
                normalize(x, w, b, rr, eps=1e-12, quantized=(q, scale), tile=tile)

            tactic()
            torch.cuda.synchronize()
            err = float(((q.float() - want).abs() / step).max())
            if err > 0:
                print(f"{label}{tag} {tile}: codes {err:.1f} steps off the default tile's")
            ms = _time(tactic, args.reps)
            print(f"{label}{tag} | {tile[0]} | {tile[1]} | {ms:.4f} | "
                  f"{rows * (read + 3 * n) / ms / 1e6:.0f}")  # fmt: skip
        names = {
            0: "copy, plain",
            1: "copy, requantize",
            2: "copy, div + cast",
            3: "copy, mul + cast",
        }
        for mode, label in names.items():
            tiles = [(per, warps)] if mode < 2 else [(a, nw) for a in (1, 2, 4) for nw in (2, 4, 8)]
            for rows_a, nw in tiles:

                def run(rows_a=rows_a, nw=nw, mode=mode, res=res) -> None:
                    _norm_copy[(triton.cdiv(rows, rows_a),)](
                        x, r, w, b, y, q, scale, rows, n, 1e-12, HAS_RES=res, MODE=mode,
                        ROWS=rows_a, BLOCK_N=block_n, num_warps=nw,
                    )  # fmt: skip

                try:
                    run()
                    torch.cuda.synchronize()
                except Exception as exc:  # (a tile Triton cannot compile here)
                    print(f"{label}{tag} {rows_a}x{nw}: {type(exc).__name__}: {exc}"[:300])
                    continue
                if mode:
                    err = float(((q.float() - want).abs() / step).max())
                    if err > 1.0:
                        print(f"{label}{tag} {rows_a}x{nw}: codes {err:.1f} steps off, not timed")
                        continue
                ms = _time(run, args.reps)
                nbytes = read + (3 if mode else 2) * n
                print(f"{label}{tag} | {rows_a} | {nw} | {ms:.4f} | {rows * nbytes / ms / 1e6:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
