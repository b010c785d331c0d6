"""Triton LayerNorm and RMSNorm over the last axis (tensorkiln.LayerNorm/RMSNorm, ONNX
LayerNormalization).

Rows of ``N`` contiguous values. A row that fits one block (``N <= MAX_BLOCK``) is read once: the
program holds ``ROWS`` such rows in a ``[ROWS, BLOCK_N]`` tile (many rows per program when rows are
short), computes the mean and the variance of the centred values in float32 (two passes over
registers, as the reference) and writes ``(x - mean) / sqrt(var + eps) * scale + bias`` in the
input's dtype. Longer rows take one program each and loop over the row in blocks (statistics, then
the normalized writes; an added residual is written first and read back).

With a residual, ``s = x + residual`` is rounded to the input's dtype (what the second output
stores, and what the reference normalizes).

A row whose length is not a power of two fills a block of the next power of two, the rest of it
masked: a quarter of a 768-wide row's block (BERT-base's) computes nothing. Held as two
power-of-two blocks instead (768 as 512 + 256) the quantizing kernel had 13% fewer instructions
for sm_90 but ran no faster on an H200 (0.0141 ms either way on 8192 x 768 values), so rows stay
one block.
"""

from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from tensorkiln.kernels.triton.quantize import qout, quantize_into, requantize, storable

MAX_BLOCK = 16384  # longest row held in registers at once (float32: 64 values a thread at 8 warps)
LOOP_BLOCK = 4096


@triton.jit
def _row_block(n_rows, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's ROWS rows of N values as a [ROWS, BLOCK_N] tile: (rows, cols, row mask,
    column mask, tile mask, offsets)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    return rows, cols, rmask, cmask, mask, rows.to(tl.int64)[:, None] * N + cols[None, :]


@triton.jit
def _summed(X, R, S, Y, offs, mask, HAS_RES: tl.constexpr, STORE_S: tl.constexpr, roffs=None):
    """A block of x (+ the residual at ``roffs``, else at x's offsets; rounded to Y's dtype and
    stored to S if asked), float32."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        if roffs is None:
            r = tl.load(R + offs, mask=mask, other=0.0)
        else:
            r = tl.load(R + roffs, mask=mask, other=0.0)
        x = x + r.to(tl.float32)
        x = x.to(Y.dtype.element_ty).to(tl.float32)
        if STORE_S:
            tl.store(S + offs, x.to(S.dtype.element_ty), mask=mask)
    return x


@triton.jit
def _written(
    xc, inv, W, B, Y, Q, QS, cols, cmask, offs, mask, HAS_B: tl.constexpr, QOUT: tl.constexpr
):
    """A block of centred values normalized, scaled, shifted and stored, and where QOUT asks,
    quantized as a QuantizeLinear reading Y would; returns what was stored to Y."""
    y = xc * inv[:, None] * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y = y.to(Y.dtype.element_ty)
    tl.store(Y + offs, y, mask=mask)
    if QOUT != 0:
        code = requantize(y.to(tl.float32), tl.load(QS), QOUT)
        tl.store(Q + offs, code.to(Q.dtype.element_ty), mask=mask)
    return y


@triton.jit
def _norm_rows(
    X, R, W, B, Y, S, MEAN, INV, Q, QS, n_rows, N, eps, R_ROWS,
    HAS_RES: tl.constexpr, HAS_B: tl.constexpr, STORE_S: tl.constexpr, STATS: tl.constexpr,
    RMS: tl.constexpr, QOUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    R_PERIODIC: tl.constexpr = False,
):  # fmt: skip
    rows, cols, rmask, cmask, mask, offs = _row_block(n_rows, N, ROWS, BLOCK_N)
    roffs = None
    if R_PERIODIC:  # (the residual's R_ROWS rows repeat: a position embedding over a batch)
        roffs = (rows % R_ROWS).to(tl.int64)[:, None] * N + cols[None, :]
    x = _summed(X, R, S, Y, offs, mask, HAS_RES, STORE_S, roffs)
    if RMS:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        if STATS:
            tl.store(MEAN + rows, mean, mask=rmask)
            tl.store(INV + rows, inv, mask=rmask)
    _written(xc, inv, W, B, Y, Q, QS, cols, cmask, offs, mask, HAS_B, QOUT)


@triton.jit
def _norm_long_rows(
    X, R, W, B, Y, S, MEAN, INV, N, eps,
    HAS_RES: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr, RMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    X += row * N
    Y += row * N
    if HAS_RES:  # the sum goes to S first; the later passes read it from there
        R += row * N
        S += row * N
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            m = cols < N
            s = tl.load(X + cols, mask=m, other=0.0).to(tl.float32)
            s += tl.load(R + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(S + cols, s.to(S.dtype.element_ty), mask=m)
        X = S
    mean = 0.0
    if not RMS:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            acc += tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        xc = tl.where(m, tl.load(X + cols, mask=m, other=0.0).to(tl.float32) - mean, 0.0)
        acc += xc * xc
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    if STATS:
        tl.store(MEAN + row, mean)
        tl.store(INV + row, inv)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        y = (tl.load(X + cols, mask=m, other=0.0).to(tl.float32) - mean) * inv
        y = y * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=m)


def row_tile(n: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_N, rows a program, warps) for rows of ``n`` that fit one block: about 2K values a
    program (short rows share one) and 16 a thread: the fastest tiles on an H200 for rows of 768
    to 8192 columns (3.2-3.8 TB/s; 16 warps on 1K-value rows reached a third of that)."""
    block_n = triton.next_power_of_2(n)
    per = max(1, min(2048 // block_n, 64, triton.next_power_of_2(rows)))
    return block_n, per, min(16, max(4, block_n * per // 512))


def _row_period(small, shape) -> int:
    """The rows of a tensor of shape ``small`` broadcast to ``shape`` (last axes the same) as a
    repeating period: the number of its rows where its leading axes are all 1 ([1, S, H] over
    [B, S, H]: S), else 0 (the broadcast is not a repetition of whole row blocks)."""
    dims = (1,) * (len(shape) - len(small)) + tuple(small)
    lead = 0
    while lead < len(dims) - 1 and dims[lead] == 1:
        lead += 1
    if not shape or tuple(dims[lead:]) != tuple(shape[lead:]):
        return 0
    return math.prod(dims[:-1])


def normalize(
    x,
    scale,
    bias=None,
    residual=None,
    *,
    eps: float,
    rms: bool = False,
    want_sum: bool = False,
    want_stats: bool = False,
    quantized=None,
    tile: tuple[int, int] | None = None,
):
    """Normalize ``x`` (+ ``residual``) over its last axis; returns (y, sum or None, mean, inv_std).

    ``scale`` and ``bias`` hold one value per column (any shape of that size); mean and inv_std
    are float32 of shape ``x.shape[:-1]`` when ``want_stats``. ``quantized``: (an int8 or float8
    E4M3 tensor of the output's shape, a float32 scale tensor of one value) into which y is also
    written quantized (by the kernel itself where rows fit one block). ``tile``: (rows a
    program, warps) for rows that fit one block, instead of :func:`row_tile`'s.
    """
    import torch

    period = 0  # (rows of a residual that repeat over x's, read in place; 0: one row each)
    if residual is not None and residual.shape != x.shape:  # the fused Add broadcasts
        both = torch.broadcast_shapes(x.shape, residual.shape)
        if tuple(x.shape) != tuple(both) and tuple(residual.shape) == tuple(both):
            x, residual = residual, x  # (x + r in float32 either way)
        if tuple(x.shape) == tuple(both) and both and both[-1] <= MAX_BLOCK:
            period = _row_period(residual.shape, both)  # (rows that fit one block)
        if not period:
            x, residual = x.expand(both), residual.expand(both)
    shape = x.shape
    n = shape[-1] if x.dim() else 1
    rows = x.numel() // n if n else 0
    x2 = x.reshape(rows, n).contiguous()
    w = scale.reshape(-1).contiguous()
    b = bias.reshape(-1).contiguous() if bias is not None else w
    if period:
        r = residual.reshape(period, n).contiguous()
    else:
        r = residual.reshape(rows, n).contiguous() if residual is not None else x2
    y = torch.empty_like(x2)
    long_rows = n > MAX_BLOCK
    s = torch.empty_like(x2) if residual is not None and (want_sum or long_rows) else y
    stats = [torch.empty(rows, dtype=torch.float32, device=x.device) for _ in range(want_stats * 2)]
    mean, inv = stats if want_stats else (y, y)  # (unused pointers without the statistics)
    flags = dict(HAS_RES=residual is not None, HAS_B=bias is not None, RMS=rms)
    q, qs = (storable(quantized[0]).reshape(rows, n), quantized[1]) if quantized else (y, y)
    with np.errstate(all="ignore"):  # the interpreter computes masked-off lanes too
        if rows and long_rows:
            _norm_long_rows[(rows,)](
                x2, r, w, b, y, s, mean, inv, n, eps, STATS=want_stats, BLOCK_N=LOOP_BLOCK,
                num_warps=8, **flags,
            )  # fmt: skip
            if quantized:
                quantize_into(y, quantized[1], None, quantized[0].reshape(rows, n))
        elif rows and n:
            block_n, per, warps = row_tile(n, rows)
            if tile is not None:
                per, warps = tile
            qout_code = qout(quantized[0].dtype) if quantized else 0
            _norm_rows[(triton.cdiv(rows, per),)](
                x2, r, w, b, y, s, mean, inv, q, qs, rows, n, eps, max(period, 1),
                STORE_S=s is not y, STATS=want_stats, QOUT=qout_code, ROWS=per, BLOCK_N=block_n,
                R_PERIODIC=period > 0, num_warps=warps, **flags,
            )  # fmt: skip
    out_sum = s.reshape(shape) if want_sum and residual is not None else None
    if not want_stats:
        return y.reshape(shape), out_sum, None, None
    return y.reshape(shape), out_sum, stats[0].reshape(shape[:-1]), stats[1].reshape(shape[:-1])
