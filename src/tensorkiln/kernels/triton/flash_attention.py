"""Attention in one Triton pass (FlashAttention's online softmax), masks read where they are.

``softmax(Q K^T * scale + mask) V`` over blocks of keys, with the running maximum and sum kept per
query row in float32, so the [Sq, Sk] scores are never written. What SDPA's fused kernels do not
take without help, this one reads as it is:

* a mask of any broadcast shape ([B, 1, 1, Sk] key padding, [B, 1, Sq, Sk] causal-and-padding,
  [Sq, Sk]) through its strides, a zero stride on the broadcast axes, so it is never expanded to
  [B, H, Sq, Sk]; bool masks hide keys, additive ones are added to the scores; a mask of one
  row for every query (key padding) is read as one vector a block of keys, and its whole
  blocks need no per-score visibility test;
* causal masking (top-left aligned) with a mask at the same time, skipping the key blocks above
  the diagonal;
* key blocks after the last one that any row of a program sees are not visited: a first pass
  over the mask (:func:`_row_ends_kernel`, one read of it) finds each row's last key, so a
  causal triangle written into the mask (every Hugging Face decoder's export: GPT-2's
  [B, 1, S, S]) skips most of what the causal attribute skips, and a padded batch of short
  sequences skips their padding (on an H200, fp16: GPT-2's [32, 12, 512, 64] with its mask
  114 -> 98 us; keys of [64, 12, 512, 64] of which 112 are unpadded 316 -> 118 us);
* rows that see no key give zeros, the op's rule, with no pass after it;
* Q, K and V as strided views (heads split out of [B, S, H*D] without copies); the output is
  written as [B, Sq, H, D] and returned as its [B, H, Sq, D] view;
* optionally the output quantized (int8 or float8 E4M3, one scale) in the same pass, as a
  QuantizeLinear after it would quantize it (a quantized BERT's attention output projection
  reads it so).

Up to SHORT_KEYS keys fit one block, and :func:`_flash_short_kernel` runs them on a persistent
grid (``persistent`` programs an SM, each looping over tiles of query rows with the next tile's
loads in flight): with a program a tile, the grid kernel's one pass per program overlaps its loads
with nothing of its own (BERT-base's attention at batch 64 on an H200: 0.0213 against 0.0269 ms).

float16 and bfloat16 operands (float32 accumulation); head widths up to 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorkiln.kernels.derived import derived
from tensorkiln.kernels.triton import interpreting
from tensorkiln.kernels.triton.quantize import qout, requantize, storable

DTYPES = (torch.float16, torch.bfloat16)
BLOCKS_M = (64, 128)  # query rows per program: one tactic each
MAX_HEAD = 256
LOG2E = 1.4426950408889634
# An additive mask value at or below this hides its key from every practical score: a row that
# sees any key above it gives its keys this far down exp(-30000 + s - max) = 0, so skipping them is
# exact for it. finfo(float16).min (-65504, what the exported finfo(float32).min becomes after the
# cast), -1e9 or -inf are below; -10000 (BERT's old exports) is not, and those blocks are visited.
DEAD = -30000.0
SHORT_KEYS = 128  # keys the persistent one-block kernel takes (attention's ``persistent``)


@triton.jit
def _row_ends_kernel(
    m_ptr, out_ptr, SQ, SK, smb, smh, smm, smn, HM,
    MASK_BOOL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, LIVE_ABOVE: tl.constexpr,
):  # fmt: skip
    """For rows ``program_id(0)`` of mask (batch, head) ``program_id(1)``: one past the last key
    each row sees (above DEAD), an int32 at out[bh, row]; SK for a row that sees no key at all
    (its softmax, over very negative scores or over nothing, needs every key: the additive rule
    for finite values)."""
    bh = tl.program_id(1)
    b = bh // HM
    h = bh % HM
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_ok = offs_m < SQ
    end = tl.zeros((ROWS,), tl.int32)
    for start_n in range(0, SK, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ok = m_ok[:, None] & (offs_n < SK)[None, :]
        mt = tl.load(
            m_ptr + b * smb + h * smh + offs_m[:, None] * smm + offs_n[None, :] * smn,
            mask=ok, other=0,
        )  # fmt: skip
        if MASK_BOOL:
            live = ok & (mt != 0)
        else:
            live = ok & (mt.to(tl.float32) > LIVE_ABOVE)
        end = tl.maximum(end, tl.max(tl.where(live, offs_n[None, :] + 1, 0), axis=1))
    tl.store(out_ptr + bh * SQ + offs_m, tl.where(end == 0, SK, end), mask=m_ok)


@triton.jit
def _attend(
    acc, l_i, m_i, q, start_n, offs_m, m_ok, k_base, v_base, m_base, SK, D, DV,
    skn, skd, svn, svd, smm, smn, qk_scale, offs_n0, offs_d, offs_dv,
    MASKED: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, MASK_ROW: tl.constexpr,
):  # fmt: skip
    """One block of keys from ``start_n`` into the running (acc, l_i, m_i); MASKED: the block
    may hold keys past SK or above the diagonal, or a mask of rows may hide keys (else every
    score counts but for a MASK_ROW mask: one row for every query, a key padding mask, read as
    one vector of the block's keys and added or applied to every row)."""
    offs_n = start_n + offs_n0
    n_ok = offs_n < SK
    k_ok = (offs_d < D)[:, None]
    v_ok = (offs_dv < DV)[None, :]
    if MASKED:  # (whole blocks need no key bound)
        k_ok = k_ok & n_ok[None, :]
        v_ok = v_ok & n_ok[:, None]
    k = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd, mask=k_ok, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k) * qk_scale  # (log2 units: exp2 below)
    if HAS_MASK and MASK_ROW:
        row = tl.load(m_base + offs_n * smn, mask=n_ok, other=0)
        if not MASK_BOOL:
            s = s + (row.to(tl.float32) * 1.4426950408889634)[None, :]
    if MASKED:
        visible = n_ok[None, :] & m_ok[:, None]
        if CAUSAL:
            visible = visible & (offs_m[:, None] >= offs_n[None, :])
        if HAS_MASK and MASK_ROW:
            if MASK_BOOL:
                visible = visible & (row != 0)[None, :]
        elif HAS_MASK:
            mt = tl.load(
                m_base + offs_m[:, None] * smm + offs_n[None, :] * smn,
                mask=m_ok[:, None] & n_ok[None, :], other=0,
            )  # fmt: skip
            if MASK_BOOL:
                visible = visible & (mt != 0)
            else:
                s = s + mt.to(tl.float32) * 1.4426950408889634
        s = tl.where(visible, s, float("-inf"))
    elif HAS_MASK and MASK_BOOL:  # (a row mask over a whole block)
        s = tl.where((row != 0)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED or HAS_MASK:  # (rows with nothing visible yet)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd, mask=v_ok, other=0.0)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _flash_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, bounds_ptr, ends_ptr, qs_ptr, TOKENS, qk_scale, H, SQ, SK,
    D, DV, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn, sob, soh, som, sod, sbb, sbh, sbm,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
    BOUNDS: tl.constexpr, PACKED: tl.constexpr, QOUT: tl.constexpr, MASK_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_off = b * sqb
    k_off = b * skb
    v_off = b * svb
    o_off = b * sob
    if PACKED:  # sequence b is rows [ends[b - 1], ends[b]) of every operand, its keys all visible
        # (causal: those up to each row)
        # (clamped to the TOKENS rows there are: an engine file's ends may be anything)
        row0 = tl.minimum(tl.maximum(tl.load(ends_ptr + b - 1, mask=b > 0, other=0), 0), TOKENS)
        SQ = tl.minimum(tl.maximum(tl.load(ends_ptr + b), row0), TOKENS) - row0
        SK = SQ
        q_off = row0 * sqm
        k_off = row0 * skn
        v_off = row0 * svn
        o_off = row0 * som
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < SQ
    q = tl.load(
        q_ptr + q_off + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=m_ok[:, None] & (offs_d < D)[None, :], other=0.0,
    )  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    hi = SK
    if BOUNDS:  # (an end only: a loaded start measured 2x slower, its loop not pipelined)
        ends = tl.load(bounds_ptr + b * sbb + h * sbh + offs_m * sbm, mask=m_ok, other=0)
        hi = tl.max(ends, axis=0)
    if CAUSAL:
        hi = tl.minimum(hi, (start_m + 1) * BLOCK_M)
    k_base = k_ptr + k_off + h * skh
    v_base = v_ptr + v_off + h * svh
    m_base = m_ptr + b * smb + h * smh
    first_masked = 0
    if not HAS_MASK or MASK_ROW:
        # Key blocks every row of the program sees whole (all keys in range; causal: at or
        # below the first row's diagonal) run without the per-score visibility test (a key
        # padding mask read as one row and added, or applied as one row)
        first_masked = tl.minimum(SK // BLOCK_N * BLOCK_N, hi)
        if CAUSAL:
            first_masked = tl.minimum(first_masked, (start_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N)
        for start_n in range(0, first_masked, BLOCK_N):
            acc, l_i, m_i = _attend(
                acc, l_i, m_i, q, start_n, offs_m, m_ok, k_base, v_base, m_base, SK, D, DV,
                skn, skd, svn, svd, smm, smn, qk_scale, offs_n0, offs_d, offs_dv,
                MASKED=False, HAS_MASK=HAS_MASK, MASK_BOOL=MASK_BOOL, CAUSAL=False,
                UPCAST=UPCAST, MASK_ROW=MASK_ROW,
            )  # fmt: skip
    for start_n in range(first_masked, hi, BLOCK_N):
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, start_n, offs_m, m_ok, k_base, v_base, m_base, SK, D, DV,
            skn, skd, svn, svd, smm, smn, qk_scale, offs_n0, offs_d, offs_dv,
            MASKED=True, HAS_MASK=HAS_MASK, MASK_BOOL=MASK_BOOL, CAUSAL=CAUSAL, UPCAST=UPCAST,
            MASK_ROW=MASK_ROW,
        )  # fmt: skip
    _finish(
        acc, l_i, q_ptr, o_ptr + o_off + h * soh, qs_ptr, offs_m, m_ok, offs_dv, DV, som, sod,
        QOUT=QOUT,
    )  # fmt: skip


@triton.jit
def _finish(
    acc, l_i, q_ptr, o_base, qs_ptr, offs_m, m_ok, offs_dv, DV, som, sod, QOUT: tl.constexpr
):
    """The rows' sums divided out (zeros for a row that saw no key) and stored from ``o_base``,
    quantized where QOUT asks as a QuantizeLinear reading the float output would."""
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    if QOUT != 0:  # the float output as it would be stored, quantized as QuantizeLinear would
        stored = out.to(q_ptr.dtype.element_ty).to(tl.float32)
        out = requantize(stored, tl.load(qs_ptr), QOUT)
    tl.store(
        o_base + offs_m[:, None] * som + offs_dv[None, :] * sod,
        out.to(o_base.dtype.element_ty), mask=m_ok[:, None] & (offs_dv < DV)[None, :],
    )  # fmt: skip


@triton.jit
def _flash_short_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, qs_ptr, qk_scale, H, SQ, SK, D, DV,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn, sob, soh, som, sod, TILES, M_TILES,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
    QOUT: tl.constexpr, MASK_ROW: tl.constexpr, MASKED: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Every key in one block (SK <= BLOCK_N), a persistent grid: each program takes tiles of
    BLOCK_M query rows of one (batch, head), one after another, and the loop's software pipeline
    loads the next tile's Q, K and V while this one computes (one tile a program, as the grid
    kernel runs, leaves the loads of a program's one pass unoverlapped with anything of its own)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for tile in tl.range(tl.program_id(0), TILES, tl.num_programs(0), num_stages=STAGES):
        start_m = tile % M_TILES
        bh = tile // M_TILES
        b = bh // H
        h = bh % H
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < SQ
        q = tl.load(
            q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
            mask=m_ok[:, None] & (offs_d < D)[None, :], other=0.0,
        )  # fmt: skip
        if UPCAST:
            q = q.to(tl.float32)
        acc, l_i, _ = _attend(
            tl.zeros((BLOCK_M, BLOCK_DV), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
            tl.full((BLOCK_M,), float("-inf"), tl.float32), q, 0, offs_m, m_ok,
            k_ptr + b * skb + h * skh, v_ptr + b * svb + h * svh, m_ptr + b * smb + h * smh,
            SK, D, DV, skn, skd, svn, svd, smm, smn, qk_scale, offs_n0, offs_d, offs_dv,
            MASKED=MASKED, HAS_MASK=HAS_MASK, MASK_BOOL=MASK_BOOL, CAUSAL=CAUSAL,
            UPCAST=UPCAST, MASK_ROW=MASK_ROW,
        )  # fmt: skip
        _finish(
            acc, l_i, q_ptr, o_ptr + b * sob + h * soh, qs_ptr, offs_m, m_ok, offs_dv, DV, som,
            sod, QOUT=QOUT,
        )  # fmt: skip


def _row_ends(m: torch.Tensor, boolean: bool) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Per row of the [B, H, Sq, Sk] mask view ``m``: one past the last key it sees
    (:func:`_row_ends_kernel`), computed once per distinct batch, head and row of the mask (a
    broadcast axis, of stride 0, once: a [B, 1, 1, Sk] padding mask is read once per batch).
    Returns the int32 ends [B or 1, H or 1, Sq or 1] and their batch, head and row strides for
    the attention kernel (0 on a broadcast axis)."""
    b, h, sq, sk = m.shape
    mb, mh, mq = (n if st != 0 else 1 for n, st in zip((b, h, sq), m.stride()[:3], strict=True))
    out = torch.empty((mb, mh, mq), dtype=torch.int32, device=m.device)
    rows = 16
    _row_ends_kernel[(triton.cdiv(mq, rows), mb * mh)](
        m, out, mq, sk, *m.stride(), mh,
        MASK_BOOL=boolean, ROWS=rows, BLOCK_N=min(256, triton.next_power_of_2(sk)),
        LIVE_ABOVE=DEAD, num_warps=4,
    )  # fmt: skip
    strides = tuple(st if n > 1 else 0 for n, st in zip((mb, mh, mq), out.stride(), strict=True))
    return out, strides


def _mask_4d(mask: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """``mask`` as a [B, H, Sq, Sk] view (broadcast axes of stride 0, nothing copied)."""
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)) if mask.ndim < 4 else mask
    return m.expand(shape)


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`attention` takes these [B, H, S, D] operands (and mask)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.dtype not in DTYPES:
        return False
    if k.dtype != q.dtype or v.dtype != q.dtype or q.shape[-1] != k.shape[-1]:
        return False
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        return False
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD or 0 in q.shape or 0 in k.shape:
        return False
    if mask is not None:
        if mask.ndim > 4:
            return False
        try:
            torch.broadcast_shapes(tuple(mask.shape), (*q.shape[:3], k.shape[2]))
        except RuntimeError:
            return False
    sizes = [x.numel() for x in (q, k, v)] + ([mask.numel()] if mask is not None else [])
    return max(sizes) < 2**31


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float,
    causal: bool = False,
    mask_kind: str = "",
    block_m: int = 128,
    stages: int = 2,
    quantized: tuple[torch.dtype, torch.Tensor] | None = None,
    persistent: int = 0,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v of [B, H, Sq, D] / [B, H, Sk, D] / [B, H, Sk, Dv]
    operands; ``mask_kind`` "bool" (True: visible) or anything else (additive); ``block_m``
    query rows per program (64: twice the programs, for small batches); ``stages`` the software
    pipeline's depth over key blocks; ``quantized`` (int8 or float8_e4m3fn, a float32 scale of
    one element): the output written quantized, as a QuantizeLinear reading the float output
    would quantize it; ``persistent`` (keys up to SHORT_KEYS): that many programs an SM, each
    looping over tiles of query rows with all the keys in one block (:func:`_flash_short_kernel`),
    instead of a program a tile. Returns [B, H, Sq, Dv], a view of a [B, Sq, H, Dv] tensor. The
    caller checks :func:`applies`."""
    b, h, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    dtype, y_scale = quantized if quantized is not None else (q.dtype, q)
    out = torch.empty((b, sq, h, dv), dtype=dtype, device=q.device)
    o = storable(out).permute(0, 2, 1, 3)
    has_mask = mask is not None
    m = _mask_4d(mask, (b, h, sq, sk)) if has_mask else q
    if has_mask and m.dtype == torch.bool:
        m = m.view(torch.uint8)
    block_m = 64 if sq <= 64 else block_m
    mstrides = m.stride() if has_mask else (0, 0, 0, 0)
    # (the flags both kernels take)
    flags = dict(
        HAS_MASK=has_mask, MASK_BOOL=mask_kind == "bool", CAUSAL=bool(causal),
        UPCAST=interpreting(), QOUT=qout(dtype), MASK_ROW=has_mask and mstrides[2] == 0,
    )  # fmt: skip
    if persistent and sk <= SHORT_KEYS:
        return _short(q, k, v, m, o, out, scale, block_m, stages, y_scale, persistent, mstrides,
                      flags)  # fmt: skip
    block_n = 64
    grid = (triton.cdiv(sq, block_m), b * h)
    bounds, bstrides = q, (0, 0, 0)  # (no bounds: a placeholder pointer)
    if has_mask and sk > block_n:
        # (once for all the layers that read this mask: kernels/derived.py)
        boolean = mask_kind == "bool"
        bounds, bstrides = derived(
            mask, ("row_ends", (b, h, sq, sk), boolean), lambda: _row_ends(m, boolean)
        )
    _flash_kernel[grid](
        q, k, v, m, o, bounds, q, y_scale, 0, float(scale) * LOG2E, h, sq, sk, d, dv,
        *q.stride(), *k.stride(), *v.stride(), *mstrides, *o.stride(), *bstrides,
        BOUNDS=bounds is not q, PACKED=False, **flags, **_tiles(block_m, block_n, d, dv, stages),
    )  # fmt: skip
    return out.permute(0, 2, 1, 3)


def _short(q, k, v, m, o, out, scale, block_m, stages, y_scale, per_sm, mstrides,
           flags) -> torch.Tensor:  # fmt: skip
    """:func:`attention` on the persistent one-block kernel (its arguments, resolved: ``m`` the
    mask's [B, H, Sq, Sk] view or a placeholder, ``flags`` the kernels' common flags)."""
    b, h, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    block_n = max(16, triton.next_power_of_2(sk))
    m_tiles = triton.cdiv(sq, block_m)
    tiles = m_tiles * b * h
    sms = 4 if interpreting() else torch.cuda.get_device_properties(q.device).multi_processor_count
    tiles_kw = _tiles(block_m, block_n, d, dv, stages)
    tiles_kw["num_stages"] = 1  # (the persistent loop's own pipeline: STAGES)
    masked = flags["CAUSAL"] or sk != block_n or (flags["HAS_MASK"] and not flags["MASK_ROW"])
    _flash_short_kernel[(min(tiles, sms * per_sm),)](
        q, k, v, m, o, y_scale, float(scale) * LOG2E, h, sq, sk, d, dv,
        *q.stride(), *k.stride(), *v.stride(), *mstrides, *o.stride(), tiles, m_tiles,
        MASKED=masked, STAGES=stages, **flags, **tiles_kw,
    )  # fmt: skip
    return out.permute(0, 2, 1, 3)


def _tiles(block_m: int, block_n: int, d: int, dv: int, stages: int = 2) -> dict[str, int]:
    """The flash kernel's block sizes and launch settings for head widths ``d`` and ``dv``."""
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "BLOCK_DV": max(16, triton.next_power_of_2(dv)),
        "num_warps": 4 if block_m == 64 else 8,
        "num_stages": stages,
    }


def packed_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> bool:
    """Whether :func:`packed_attention` takes these packed [T, H*D] operands."""
    if any(x.ndim != 2 for x in (q, k, v)) or q.dtype not in DTYPES or heads <= 0:
        return False
    if k.dtype != q.dtype or v.dtype != q.dtype or q.shape != k.shape or v.shape[0] != q.shape[0]:
        return False
    if q.shape[1] % heads or v.shape[1] % heads or 0 in q.shape:
        return False
    if max(q.shape[1], v.shape[1]) // heads > MAX_HEAD:
        return False
    return max(x.numel() for x in (q, k, v)) < 2**31


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ends: torch.Tensor,
    longest: int,
    *,
    heads: int,
    scale: float,
    block_m: int = 128,
    stages: int = 2,
    causal: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale) v within each packed sequence (``causal``: each row sees its
    sequence's rows up to itself): ``q``, ``k``, ``v`` [T, H*D] (strided views are fine),
    ``ends`` int32 [B] one past each sequence's last row, ``longest`` a bound on every
    sequence's length (the grid's query blocks). Returns [T, H*Dv]. The caller checks
    :func:`packed_applies`."""
    t = q.shape[0]
    d, dv = q.shape[1] // heads, v.shape[1] // heads
    out = torch.empty((t, heads * dv), dtype=q.dtype, device=q.device)
    block_m = 64 if longest <= 64 else block_m
    block_n = 64

    def strides(x: torch.Tensor, width: int) -> tuple[int, int, int, int]:
        return 0, width * x.stride(1), x.stride(0), x.stride(1)  # batch (unused), head, row, col

    grid = (triton.cdiv(max(longest, 1), block_m), ends.shape[0] * heads)
    _flash_kernel[grid](
        q, k, v, q, out, q, ends, q, t, float(scale) * LOG2E, heads, longest, longest, d, dv,
        *strides(q, d), *strides(k, d), *strides(v, dv), 0, 0, 0, 0, *strides(out, dv), 0, 0, 0,
        HAS_MASK=False, MASK_BOOL=False, CAUSAL=bool(causal), UPCAST=interpreting(),
        BOUNDS=False, PACKED=True, QOUT=0, MASK_ROW=False,
        **_tiles(block_m, block_n, d, dv, stages),
    )  # fmt: skip
    return out
