"""Triton Softmax and LogSoftmax over the last axis, max and sum in float32.

A row that fits one block (``N <= MAX_BLOCK``) is read once into a ``[ROWS, BLOCK_N]`` tile (several
rows a program when rows are short). Longer rows take one program each: an online pass keeps a
running maximum and a sum rescaled to it per lane, then a second pass writes
``exp(x - max) / sum`` (``x - max - log(sum)`` for LogSoftmax).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from tensorkiln.kernels.triton.norm import row_tile

MAX_BLOCK = 16384
LOOP_BLOCK = 4096


@triton.jit
def _softmax_rows(X, Y, n_rows, N, LOG: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
    y = x - tl.max(x, axis=1)[:, None]
    e = tl.where(mask, tl.exp(y), 0.0)
    total = tl.sum(e, axis=1)[:, None]
    out = y - tl.log(total) if LOG else e / total
    tl.store(Y + offs, out.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_long_rows(X, Y, N, LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * N
    Y += row * N
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(X + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        seen = m_new != float("-inf")  # lanes that have seen a finite value (or +inf)
        s = tl.where(seen, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(m != float("-inf"), s * tl.exp(m - top), 0.0), axis=0)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        y = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32) - top
        out = y - tl.log(total) if LOG else tl.exp(y) / total
        tl.store(Y + cols, out.to(Y.dtype.element_ty), mask=mask)


def softmax_last(x, *, log: bool = False):
    """Softmax (or LogSoftmax) of ``x`` over its last axis, in ``x``'s dtype."""
    import torch

    shape = x.shape
    n = shape[-1] if x.dim() else 1
    rows = x.numel() // n if n else 0
    x2 = x.reshape(rows, n).contiguous()
    y = torch.empty_like(x2)
    with np.errstate(all="ignore"):  # the interpreter computes masked-off lanes too
        if rows and n > MAX_BLOCK:
            _softmax_long_rows[(rows,)](x2, y, n, LOG=log, BLOCK_N=LOOP_BLOCK, num_warps=8)
        elif rows and n:
            block_n, per, warps = row_tile(n, rows)
            grid = (triton.cdiv(rows, per),)
            _softmax_rows[grid](x2, y, rows, n, LOG=log, ROWS=per, BLOCK_N=block_n, num_warps=warps)
    return y.reshape(shape)
