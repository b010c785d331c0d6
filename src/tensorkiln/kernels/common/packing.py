"""Padding removal's ops (passes/remove_padding.py), written once for every kernel tree.

``PackIndex(M)`` keeps the tokens where the key-padding mask M [B, S] is nonzero: their flat
indices (row-major, int64 [T]) and one past each sequence's last packed row (int32 [B]).
``PackTokens(X, index)`` gathers X [B, S, ...]'s rows; ``UnpackTokens(Y, index, M)`` scatters them
back into zeros of [B, S, ...]; ``PackedAttention(Q, K, V, ends, M)`` attends within each packed
sequence (every key of a sequence visible, as the mask it came from kept exactly those).

T depends on M's values. A device backend that must know it without reading M back (a CUDA graph
is captured for one T) sets it with :func:`tokens_hint` around the run: M's count, or a
:func:`bucket` above it (the extra rows index row B * S, a row of padding); the indices are
computed on the device without a synchronization.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from tensorkiln.errors import KernelError

_local = threading.local()


@contextlib.contextmanager
def tokens_hint(count: int | None) -> Iterator[None]:
    """PackIndex kernels run in this thread inside the block take ``count`` as M's token count."""
    before = getattr(_local, "count", None)
    _local.count = count
    try:
        yield
    finally:
        _local.count = before


ROW_STEPS = 32  # a CUDA graph's packed length: the token count rounded up to capacity / this


def bucket(count: int, capacity: int) -> int:
    """The packed length a CUDA graph is captured for, ``count`` tokens of ``capacity`` (B * S)
    kept: rounded up to a 32nd of the capacity (16 rows at least), so that a stream of masks
    with ever new counts replays a few graphs instead of capturing one per count. The rows past
    the count are padding of their own: PackIndex points them at row B * S, which PackTokens
    clamps into the input and UnpackTokens drops; attention never reads them."""
    step = max(16, -(-capacity // ROW_STEPS))
    return min(capacity, -(-count // step) * step)


def kept(nonzero: int, total: int, padding: int) -> int:
    """The tokens a mask of ``total`` entries, ``nonzero`` of them nonzero, keeps: the nonzero
    ones, or with PackIndex's ``padding`` (nonzero marks a pad) the others."""
    return total - nonzero if padding else nonzero


def hinted_count() -> int | None:
    """The token count set by :func:`tokens_hint` in this thread (None: none)."""
    return getattr(_local, "count", None)


def check_mask(m: Any) -> tuple[int, int]:
    """M's (B, S); a clear error for anything but a [B, S] mask."""
    if m.ndim != 2:
        raise KernelError(
            f"PackIndex: the key-padding mask must be [batch, sequence]; got shape {tuple(m.shape)}"
        )
    return int(m.shape[0]), int(m.shape[1])


def check_packed(x: Any, index: Any, what: str) -> None:
    if x.ndim < 1 or x.shape[0] != index.shape[0]:
        raise KernelError(
            f"{what}: {tuple(x.shape)} does not hold one row per packed token ({index.shape[0]})"
        )


def token_rows(x: Any) -> int:
    """The B * S token rows of PackTokens' input [B, S, ...]; a clear error for fewer axes."""
    if x.ndim < 2:
        raise KernelError(
            f"PackTokens: the input must be [batch, sequence, ...]; got shape {tuple(x.shape)}"
        )
    return int(x.shape[0]) * int(x.shape[1])


def head_widths(q: Any, k: Any, v: Any, num_heads: int) -> tuple[int, int]:
    """The head widths of packed [T, H*D] ``q`` (and ``k``) and ``v``; a clear error for
    operands that are not."""
    widths = []
    for x, what in ((q, "Q"), (k, "K"), (v, "V")):
        if x.ndim != 2 or num_heads <= 0 or x.shape[1] % num_heads or x.shape[0] != q.shape[0]:
            raise KernelError(
                f"PackedAttention: {what} {tuple(x.shape)} is not [tokens, {num_heads} heads * "
                f"width] with Q's {q.shape[0]} tokens"
            )
        widths.append(int(x.shape[1]) // num_heads)
    if widths[0] != widths[1]:
        raise KernelError(
            f"PackedAttention: Q and K heads differ in width ({widths[0]}, {widths[1]})"
        )
    return widths[0], widths[2]


def packed_attention(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    ends: Any,
    m: Any,
    *,
    scale: float = 0.0,
    num_heads: int = 0,
    causal: int = 0,
) -> Any:
    """softmax(Q K^T * scale) V over each sequence's rows of the packed [T, H*D] operands
    (``ends``: one past each sequence's last row; ``m``: the [B, S] mask, whose S bounds every
    length; ``causal``: each row sees its sequence's rows up to itself).
    ``xp.attend_packed(q, k, v, ends, batch, longest, scale, heads, widths, causal)`` is a
    tree's math."""
    widths = head_widths(q, k, v, num_heads)
    b, s = check_mask(m)
    return xp.attend_packed(q, k, v, ends, b, s, scale, num_heads, widths, int(bool(causal)))
