"""2-D convolutions on the CPU: channels-last layout, and oneDNN with prepacked weights and the
activation fused into the convolution.

torch's NCHW convolutions on the CPU fall back to slow loops for grouped and depthwise kernels (a
depthwise 3x3 of 96x112x112 takes 44 ms in NCHW, 0.16 ms channels-last, on 2 cores), so on the CPU
the cpu backend's 2-D convolutions run channels-last and their outputs stay so for the next
layers. oneDNN also reorders the weights into its blocked layout at every call unless given them
prepacked: the cpu backend holds each convolution weight channels-last and marked
(:func:`hold_weight`), and the first call with a geometry keeps the packed copy on the weight
tensor, as the host copies of small values are kept (convert.py). The cuda backend's kernels run
on CPU tensors in tests as they are, NCHW and unpacked: these paths need a held weight. Measured per layer at batch 1, 1 thread: a 512x512 3x3 at 7x7 takes 2.39 ms
through F.conv2d + in-place ReLU, 1.35 ms prepacked with the ReLU fused; small 1x1 convolutions
are faster as one GEMM (see _SMALL_1X1_MACS), so they run as one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tensorkiln.kernels.common.window import Geometry
from tensorkiln.kernels.cpu import native as cpu_native

_PACKED = "_tensorkiln_packed"  # on a weight tensor: {(pads, strides, dilations, group): packed}
_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_convolution_pointwise"
)
# 1x1 convolutions with fewer multiply-adds (batch x height x width x weight elements) run as a
# plain GEMM (pointwise_gemm; F.conv2d's own GEMM when strided): oneDNN's call costs about 40
# microseconds whatever the size, and its kernels win only on larger products. Measured, oneDNN
# (prepacked, hardswish fused) against addmm + hardswish, 1 and 2 threads: 16->16 at 1x56x56
# (0.8M) 51 against 30 us; 96->576 at 1x7x7 (2.7M) 66 against 47; 16->72 at 1x56x56 (3.6M) 128
# against 129 (179 against 147 on 2 threads); 16->72 at 4x56x56 (14M) 389 against 658; 96->576
# at 16x7x7 (43M) 542 against 700; 2048->512 at 1x7x7 (51M) 670 against 900.
_SMALL_1X1_MACS = 8_000_000

# ConvAct's activations that oneDNN fuses, with their scalars: (name, scalars, algorithm)
_PLAIN = {
    "": "none",
    "Relu": "relu",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
    "HardSwish": "hardswish",
}


def hold_weight(w: torch.Tensor) -> torch.Tensor:
    """The cpu backend's copy of convolution weight ``w`` (a constant, never an activation):
    channels-last, and marked so that convolutions run channels-last with it and keep a
    prepacked copy of it (which lives as long as the weight does)."""
    if w.ndim != 4 or not w.is_floating_point():
        return w
    w = w.contiguous(memory_format=torch.channels_last)
    setattr(w, _PACKED, {})
    return w


def channels_last_input(x: Any) -> torch.Tensor | None:
    """A float32 4-D numpy input that only convolutions with held weights read, as a fresh
    channels-last tensor: one copy where uploading (a clone, so that kernels never write into the
    caller's array) and the first convolution's layout change would make two (0.72 + 2.24 ms for
    16x3x224x224 on 2 threads). None for anything else (uploaded as usual)."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 4:
        return None
    with warnings.catch_warnings():  # (a read-only array: only read, into the copy)
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.ascontiguousarray(x))
    y = torch.empty_like(t, memory_format=torch.channels_last)
    if not cpu_native.to_channels_last(t, y):  # (torch's copy: 73 us for 1x3x224x224, 2 threads)
        y.copy_(t)
    return y


def cpu_layout(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` channels-last where ``w`` is a weight the cpu backend holds (:func:`hold_weight`);
    both as they are otherwise (the cuda backend's kernels, on any device)."""
    if x.ndim != 4 or getattr(w, _PACKED, None) is None:
        return x, w
    return x.contiguous(memory_format=torch.channels_last), w


# ConvAct's activations that oneDNN applies after a fused residual add (torch's binary
# convolution takes no other): activation -> its unary post-op
_AFTER_ADD = {"": None, "Relu": "relu"}


def fused_activation(
    activation: str, alpha: float | None, lo: float | None, hi: float | None
) -> tuple[str, list[float], str] | None:
    """oneDNN's post-op for a ConvAct activation, or None where it has none (applied after)."""
    if activation in _PLAIN:
        return _PLAIN[activation], [], ""
    if activation == "Swish" and alpha in (None, 1.0):
        return "swish", [], ""
    if activation == "LeakyRelu":
        return "leaky_relu", [0.009999999776482582 if alpha is None else alpha], ""
    if activation == "Clip" and lo is not None and hi is not None:
        return "hardtanh", [lo, hi], ""
    if activation in ("Gelu", "GeluTanh"):
        return "gelu", [], "tanh" if activation == "GeluTanh" else "none"
    return None


def pointwise_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    g: Geometry,
    group: int,
    relu: bool = False,
) -> torch.Tensor | None:
    """A small 1x1 convolution (stride 1, no padding, one group) with a held weight as one GEMM
    on the channels-last view: (N*H*W, C) @ (C, M), no copies in or out. F.conv2d would take
    oneDNN with a weight reorder per call whenever torch runs more than one thread (its 1x1
    heuristic): MobileNetV3-Small at batch 1 takes 8.4 ms on 2 threads that way, 4.8 on 1.
    ``relu`` (with a bias): ReLU too, in cuBLASLt's epilogue on a GPU (no pass of its own)."""
    if getattr(w, _PACKED, None) is None or x.ndim != 4 or not _gemm_applies(x, w, g, group):
        return None
    n, c, h, wd = x.shape
    m = w.shape[0]
    rows = x.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(-1, c)
    w2 = w.reshape(m, c).t()
    if b is None:
        y = torch.mm(rows, w2)
    elif relu:
        y = torch._addmm_activation(b, rows, w2)
    else:
        y = torch.addmm(b, rows, w2)
    return y.reshape(n, h, wd, m).permute(0, 3, 1, 2)


def small_1x1(x: torch.Tensor, w: torch.Tensor, g: Geometry) -> bool:
    """Whether a 1x1 convolution is too small for oneDNN to pay (see _SMALL_1X1_MACS)."""
    return x.shape[0] * g.out[0] * g.out[1] * w.shape[0] * w.shape[1] < _SMALL_1X1_MACS


def _packed(w: torch.Tensor, x: torch.Tensor, g: Geometry, group: int) -> torch.Tensor:
    """``w`` in oneDNN's layout for geometry ``g``, packed at the first call and kept."""
    packs = getattr(w, _PACKED)
    key = (g.begin, g.strides, g.dilations, group)
    packed = packs.get(key)
    if packed is None:  # (the packing suits any batch; the first call's shape only tunes it)
        packed = torch.ops.mkldnn._reorder_convolution_weight(
            w, list(g.begin), list(g.strides), list(g.dilations), group, list(x.shape)
        )
        packed = packs.setdefault(key, packed)
    return packed


def _packed_applies(x: torch.Tensor, w: torch.Tensor, g: Geometry) -> bool:
    return (
        getattr(w, _PACKED, None) is not None
        and _MKLDNN
        and x.device.type == "cpu"
        and x.ndim == 4
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and g.begin == g.end
        and not (g.kernel == (1, 1) and small_1x1(x, w, g))
    )


def specialized_conv(
    x: torch.Tensor,
    w: torch.Tensor,
    g: Geometry,
    group: int,
    post: tuple[str, list[float], str] | None,
    finish: Callable[[torch.Tensor], Any],
) -> Callable[..., torch.Tensor] | None:
    """A function of ``(x, w, b)`` that does what ConvAct's CPU paths (:func:`packed_conv` with
    the activation ``post`` fused, or :func:`pointwise_gemm` then ``finish`` in place) do for
    inputs of ``x``'s shape with the held weight ``w``, with every decision and derived weight
    made once here: the executor calls it for later runs at that shape. ConvAct's Python work
    per call (checks, geometry, path choice) is a visible part of a small layer's time at batch
    1: MobileNetV3-Small went from 4.63 to 4.32 ms with it. None where neither path applies
    (the kernel then runs as it is)."""
    if x.device.type != "cpu" or getattr(w, _PACKED, None) is None or x.ndim != 4:
        return None
    if post is not None and _packed_applies(x, w, g):
        packed = _packed(w, x, g, group)
        pads, strides, dilations = list(g.begin), list(g.strides), list(g.dilations)
        name, scalars, algorithm = post
        run = torch.ops.mkldnn._convolution_pointwise

        def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            x = x.contiguous(memory_format=torch.channels_last)
            b = None if b is None else b.reshape(-1)
            return run(x, packed, b, pads, strides, dilations, group, name, scalars, algorithm)

        return conv
    if _packed_applies(x, w, g) or not _gemm_applies(x, w, g, group):
        return None
    n, c, h, wd = x.shape
    m = w.shape[0]
    w2 = w.reshape(m, c).t()

    def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(-1, c)
        y = torch.mm(rows, w2) if b is None else torch.addmm(b.reshape(-1), rows, w2)
        finish(y)
        return y.view(n, h, wd, m).permute(0, 3, 1, 2)

    return gemm


def _gemm_applies(x: torch.Tensor, w: torch.Tensor, g: Geometry, group: int) -> bool:
    return (
        group == 1
        and len(g.kernel) == 2
        and g.pointwise
        and g.dilations == (1, 1)
        and x.dtype == w.dtype
    )


def residual_conv(
    x: torch.Tensor, w: torch.Tensor, g: Geometry, group: int, z: torch.Tensor, activation: str
) -> Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor] | None:
    """A function of ``(x, b, z)`` that gives ``act(conv(x, w) + b + z)`` for inputs of these
    shapes through oneDNN in one pass (a binary add post-op, then ReLU or nothing), where the
    packed path applies; None otherwise. The residual is read, never written. Two passes over
    the output fewer: ResNet-50's 64->256 1x1 at 16x56x56 takes 21.9 ms against 24.9 with
    add_ and relu_ after, 0.51 against 0.74 at batch 1."""
    if activation not in _AFTER_ADD or not _packed_applies(x, w, g) or z.dtype != x.dtype:
        return None
    if tuple(z.shape) != (x.shape[0], w.shape[0], *g.out):
        return None
    packed = _packed(w, x, g, group)
    pads, strides, dilations = list(g.begin), list(g.strides), list(g.dilations)
    unary = _AFTER_ADD[activation]
    run = torch.ops.mkldnn._convolution_pointwise.binary

    def conv_add(x: torch.Tensor, b: torch.Tensor | None, z: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        z = z.contiguous(memory_format=torch.channels_last)
        b = None if b is None else b.reshape(-1)
        return run(x, z, packed, b, pads, strides, dilations, group, "add", None, unary, [], None)

    return conv_add


def packed_conv(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    g: Geometry,
    group: int,
    post: tuple[str, list[float], str],
) -> torch.Tensor | None:
    """``post(conv(x, w) + b)`` through oneDNN with ``w`` prepacked, channels-last; None where
    this path does not apply (``w`` not marked, not float32 2-D on the CPU, asymmetric padding)
    or does not pay (small 1x1 convolutions)."""
    if not _packed_applies(x, w, g):
        return None
    pads, strides, dilations = list(g.begin), list(g.strides), list(g.dilations)
    packed = _packed(w, x, g, group)
    x = x.contiguous(memory_format=torch.channels_last)
    b = None if b is None else b.contiguous()
    name, scalars, algorithm = post
    return torch.ops.mkldnn._convolution_pointwise(
        x, packed, b, pads, strides, dilations, group, name, scalars, algorithm
    )
