"""tensorkiln.Attention's Triton tactics, ``triton_flash_m64`` and ``triton_flash_m128``
(kernels/triton/flash_attention.py; 64 or 128 query rows per program; ``_s3``: a three-stage
pipeline over key blocks instead of two), ``triton_flash_short_m128_x1_s3`` and its kin for keys
that fit one block (a persistent grid, ``x1``: one program an SM, each looping over tiles of
query rows, ``_s3``: three stages of that loop's pipeline), and PackedAttention's,
``triton_flash_packed_m64`` / ``_m128`` (and ``_s3``): the same kernel reading each sequence's
rows of the packed operands (padding removal), where the default scatters them into padded
tensors for SDPA.

The default kernel is SDPA, which picks cuDNN's or its own flash kernels, but with a mask it
wants the mask broadcast to aligned strides (some are materialized at [B, H, Sq, Sk]), a causal
op with a mask gets the triangle folded into a materialized mask, and the empty-row rule runs
after it. The Triton kernel reads any broadcast mask through its strides, skips the key blocks
a causal row cannot see and writes zeros for empty rows itself; the autotuner keeps whichever is
faster on the layer's real inputs. float16 and bfloat16, head widths up to 256; the checks and
head layouts are the shared FusedAttention's. An Attention writing its output quantized
(q_dtype, Y_scale) gets it from the kernel's epilogue, where the default quantizes SDPA's output
in a second kernel.
"""

from __future__ import annotations

import math

import torch

from tensorkiln.kernels.common.fused import FusedAttention
from tensorkiln.kernels.cuda.fused_attention import TorchAttentionArrays, prepare_mask
from tensorkiln.kernels.cuda.fused_quant import out_type
from tensorkiln.kernels.cuda.packing import packed_attention as packed_fallback
from tensorkiln.kernels.tactics import LayerSpec, tactic
from tensorkiln.kernels.triton import available, interpreting

_HALF = frozenset(["float16", "bfloat16"])


def _head_width(spec: LayerSpec) -> int | None:
    q = spec.shapes[0]
    if q is None:
        return None
    if spec.attrs.get("input_layout", "bhsd") == "bsd":
        heads = int(spec.attrs.get("num_heads", 0) or 0)
        return q[-1] // heads if heads > 0 and len(q) == 3 and q[-1] % heads == 0 else None
    return q[-1] if len(q) == 4 else None


def _half_on_device(spec: LayerSpec, inputs: int) -> bool:
    """At least ``inputs`` inputs, Q, K and V of one 16-bit float type, on a GPU (or Triton's
    interpreter)."""
    if not (spec.device == "cuda" or interpreting()) or len(spec.shapes) < inputs:
        return False
    dtypes = spec.dtypes[:3]
    return len(set(dtypes)) == 1 and dtypes[0] in _HALF


def fits_packed(spec: LayerSpec) -> bool:
    """A PackedAttention layer of 16-bit Q, K, V [T, H*D] on a GPU, heads up to 256 wide."""
    if not _half_on_device(spec, 5):
        return False
    q, heads = spec.shapes[0], int(spec.attrs.get("num_heads", 0) or 0)
    return q is not None and len(q) == 2 and heads > 0 and q[1] % heads == 0 and q[1] <= 256 * heads


def _fits(spec: LayerSpec) -> bool:
    width = _head_width(spec) if _half_on_device(spec, 3) else None
    return width is not None and 0 < width <= 256


def _key_length(spec: LayerSpec) -> int | None:
    k = spec.shapes[1] if len(spec.shapes) > 1 else None
    if k is None:
        return None
    axis = 1 if spec.attrs.get("input_layout", "bhsd") == "bsd" else 2
    return k[axis] if len(k) > axis and isinstance(k[axis], int) else None


# The persistent one-block kernel's tactics: (query rows a program, programs an SM, pipeline
# stages over its tiles), the fastest of 24 on an H200 for BERT-base's attention at batch 64
# (S = 128, key padding mask, float16): 0.0213, 0.0239 and 0.0245 ms against 0.0269 for the
# grid kernel (m64) and 0.0263 for cuDNN's through SDPA; benchmarks/attention_backends.py.
SHORT_TILES = ((128, 1, 3), (128, 2, 3), (64, 2, 2))

if available():
    from tensorkiln.kernels.triton import flash_attention as flash

    def _fits_short(spec: LayerSpec) -> bool:
        """What _fits takes, with keys few enough for one block (flash.SHORT_KEYS)."""
        sk = _key_length(spec) if _fits(spec) else None
        return sk is not None and 0 < sk <= flash.SHORT_KEYS

    class TritonAttentionArrays(TorchAttentionArrays):
        """The attention math on the Triton flash kernel where it applies, SDPA elsewhere."""

        def __init__(self, block_m: int, stages: int, persistent: int = 0) -> None:
            self.block_m = block_m
            self.stages = stages
            self.persistent = persistent

        def _flash(self, q, k, v, mask, scale, causal, mask_kind, quantized=None):
            """The flash kernel's result (``quantized``: flash.attention's), or None where it
            does not apply."""
            m = None if mask is None else prepare_mask(mask, mask_kind, q.dtype)
            if not flash.applies(q, k, v, m):
                return None
            s = float(scale) if scale else 1.0 / math.sqrt(q.shape[-1])
            return flash.attention(
                q, k, v, m, scale=s, causal=bool(causal), mask_kind=mask_kind,
                block_m=self.block_m, stages=self.stages, quantized=quantized,
                persistent=self.persistent,
            )  # fmt: skip

        def attend(self, q, k, v, mask, scale: float, causal: int, mask_kind: str):
            y = self._flash(q, k, v, mask, scale, causal, mask_kind)
            if y is None:
                return TorchAttentionArrays.attend(q, k, v, mask, scale, causal, mask_kind)
            return y

        def attend_quantized(self, q, k, v, mask, scale, causal, mask_kind, y_scale, q_dtype):
            """The flash kernel writing its output quantized (its epilogue), where it applies."""
            if y_scale.numel() != 1:
                return None
            target = out_type(q_dtype, y_scale)
            y_scale = y_scale.reshape(()).to(device=q.device, dtype=torch.float32)
            return self._flash(q, k, v, mask, scale, causal, mask_kind, (target, y_scale))

    def _flash_fn(block_m: int, stages: int, persistent: int = 0):
        run = FusedAttention(TritonAttentionArrays(block_m, stages, persistent)).fused_attention

        def attention_triton_flash(q, k, v, mask=None, y_scale=None, **attrs):
            """The attention in one Triton pass over blocks of keys (see the module's
            docstring), its output quantized in the same pass with q_dtype."""
            return run(q, k, v, mask, y_scale, **attrs)

        return attention_triton_flash

    def _packed_fn(block_m: int, stages: int):
        def packed_attention_triton_flash(q, k, v, ends, m, *, scale=0.0, num_heads=0, causal=0):
            """Attention within each packed sequence in one Triton pass (see the module's
            docstring); SDPA on padded copies where the kernel does not apply."""
            if m.ndim != 2 or not flash.packed_applies(q, k, v, int(num_heads)):
                return packed_fallback(
                    q, k, v, ends, m, scale=scale, num_heads=num_heads, causal=causal
                )
            s = float(scale) if scale else 1.0 / math.sqrt(q.shape[1] // int(num_heads))
            return flash.packed_attention(
                q, k, v, ends, int(m.shape[1]), heads=int(num_heads), scale=s, block_m=block_m,
                stages=stages, causal=bool(causal),
            )  # fmt: skip

        return packed_attention_triton_flash

    # two pipeline depths per block height: which is faster depends on the shape (an H200, fp16,
    # packed sequences of 336 tokens: 3 stages 6-12% faster; of 112: 2 stages, by as much)
    _KINDS = (
        ("PackedAttention", "triton_flash_packed", fits_packed, _packed_fn),
        ("Attention", "triton_flash", _fits, _flash_fn),
    )
    for _op, _name, _supports, _make in _KINDS:
        for _stages, _suffix in ((2, ""), (3, "_s3")):
            for _block_m in flash.BLOCKS_M:
                tactic(
                    _op, domain="tensorkiln", name=f"{_name}_m{_block_m}{_suffix}",
                    supports=_supports,
                )(_make(_block_m, _stages))  # fmt: skip
    # short sequences (keys up to flash.SHORT_KEYS) on the persistent one-block kernel, timed
    # beside the grid kernel's four (a group of their own for the autotuner's candidate slots)
    for _block_m, _per_sm, _stages in SHORT_TILES:
        tactic(
            "Attention", domain="tensorkiln",
            name=f"triton_flash_short_m{_block_m}_x{_per_sm}{'_s3' if _stages == 3 else ''}",
            supports=_fits_short, group="triton_flash_short",
        )(_flash_fn(_block_m, _stages, _per_sm))  # fmt: skip
    # (keys in blocks of 128 instead of 64, BERT's sequence of 128 in one block, ran slower on
    # an H200: 0.034-0.037 ms against 0.028 for its attention at batch 64)
