"""tensorkiln.ConvAct on the cuda backend: torch's convolution (cuDNN on the GPU) + epilogue.

``Y = act(conv(X, W) + B + Z)`` (``residual_order="add_act"``) or ``act(conv(X, W) + B) + Z``
(``"act_add"``), as :mod:`tensorkiln.kernels.reference.fused_conv` defines it. The bias goes into the
convolution call (cuDNN adds it in its epilogue); the residual and the activation then run in place on
the convolution's fresh output, so the op allocates nothing beyond its result. Symmetric padding is
the convolution's own; asymmetric padding (auto_pad SAME_* with an odd total, or explicit pads) pads
the input first. One to three spatial axes map onto F.conv1d/2d/3d; more are reduced tap by tap along
the first spatial axis to convolutions of one axis fewer.

The entries of ConvAct and Conv (signature, checks, geometry) are kernels/common/conv.py's, shared
with the reference and the Triton tactics; TorchConvArrays here is ConvAct's torch path. The
in-place activations here are shared with :mod:`tensorkiln.kernels.cuda.fused_gemm`. The
convolution follows the device's precision settings: on CUDA, float32 convolutions use TF32 when
``torch.backends.cudnn.allow_tf32`` is set (torch's default).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import conv as common
from tensorkiln.kernels.common.conv import conv_geometry
from tensorkiln.kernels.common.window import Geometry
from tensorkiln.kernels.cpu import native as cpu_native
from tensorkiln.kernels.cpu.conv import (
    cpu_layout,
    fused_activation,
    packed_conv,
    pointwise_gemm,
    residual_conv,
    specialized_conv,
)
from tensorkiln.kernels.registry import register
from tensorkiln.kernels.triton import available as triton_available
from tensorkiln.ops.fused import ACTIVATION_DEFAULTS

if triton_available():
    from tensorkiln.kernels.triton import epilogue
    from tensorkiln.kernels.triton.gemm import ACT_CODES, Epilogue
else:  # (no Triton: ConvAct runs its torch epilogue)
    epilogue, ACT_CODES, Epilogue = None, {}, None

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

# nn.Hardsigmoid's relu6(x + 3) / 6 as ONNX writes it (alpha 1/6 in float32, beta 0.5)
_TORCH_HARDSIGMOID = (0.1666666716337204, 0.5)


def activate_(
    y: torch.Tensor,
    activation: str,
    alpha: float | None = None,
    beta: float | None = None,
    lo: float | None = None,
    hi: float | None = None,
) -> torch.Tensor:
    """Apply ``activation`` to the fresh tensor ``y`` in place and return it."""
    if activation == "":
        return y
    a, b = ACTIVATION_DEFAULTS.get(activation, (None, None))
    alpha = a if alpha is None else alpha
    beta = b if beta is None else beta
    if activation == "Relu":
        return y.relu_()
    if activation == "Tanh":
        return y.tanh_()
    if activation == "Sigmoid":
        return y.sigmoid_()
    if activation == "Clip":
        return y if lo is None and hi is None else y.clamp_(lo, hi)
    if activation == "LeakyRelu":
        return F.leaky_relu_(y, alpha)
    if activation == "Swish":
        if alpha == 1.0:
            return F.silu(y, inplace=True)
        return y.mul_(torch.sigmoid(y * alpha))
    if activation == "HardSigmoid":
        if y.device.type == "cpu" and (alpha, beta) == _TORCH_HARDSIGMOID:
            # torch's constants (what nn.Hardsigmoid exports, in SE blocks): one pass, not three
            return F.hardsigmoid(y, inplace=True)
        return y.mul_(alpha).add_(beta).clamp_(0.0, 1.0)
    if activation == "HardSwish":
        return F.hardswish(y, inplace=True)
    if activation in ("Gelu", "GeluTanh"):
        return torch.ops.aten.gelu_(y, approximate="tanh" if activation == "GeluTanh" else "none")
    raise ValueError(f"unknown activation {activation!r}")  # check_activation runs first


def _torch_pads(begin: Sequence[int], end: Sequence[int]) -> list[int]:
    """F.pad's argument: (begin, end) pairs from the last axis backwards."""
    out: list[int] = []
    for b, e in zip(reversed(begin), reversed(end)):
        out += [b, e]
    return out


@functools.lru_cache(maxsize=4096)
def _geometry(x_shape, w_shape, auto_pad, dilations, kernel_shape, pads, strides) -> Geometry:
    return conv_geometry(x_shape, w_shape, auto_pad, dilations, kernel_shape, pads, strides)


def geometry_of(
    x: torch.Tensor, w: torch.Tensor, auto_pad, dilations, kernel_shape, pads, strides
) -> Geometry:
    """The convolution's window geometry, memoized: a layer's attributes are fixed and its
    shapes repeat from run to run, so each layer resolves its padding once per input shape
    (tens of microseconds a call otherwise, which is much of a small layer's time on the CPU)."""

    def t(v: Sequence[int] | None) -> tuple[int, ...] | None:
        return None if v is None else tuple(v)

    return _geometry(
        tuple(x.shape), tuple(w.shape), auto_pad, t(dilations), t(kernel_shape), t(pads), t(strides)
    )


def _conv_valid(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
    padding: tuple[int, ...],
    group: int,
) -> torch.Tensor:
    """Convolution with symmetric ``padding``; more than 3 spatial axes go tap by tap."""
    n = x.ndim - 2
    if n <= 3:
        x, w = cpu_layout(x, w)
        return _CONV[n](x, w, b, strides, padding, dilations, group)
    if any(padding):
        x = F.pad(x, _torch_pads(padding, padding))
    # y[:, :, o] = sum over taps t of conv_{n-1}(x[:, :, o*s + t*d], w[:, :, t]): the first spatial
    # axis is folded into the batch, one (n-1)-d convolution per tap of the kernel along it
    s0, d0 = strides[0], dilations[0]
    out0 = (x.shape[2] - (w.shape[2] - 1) * d0 - 1) // s0 + 1
    batch, m = x.shape[0], w.shape[0]
    y = None
    for t in range(w.shape[2]):
        rows = x[:, :, t * d0 : t * d0 + (out0 - 1) * s0 + 1 : s0]
        rows = rows.movedim(2, 1).reshape(batch * out0, x.shape[1], *x.shape[3:])
        part = _conv_valid(
            rows, w[:, :, t], None, strides[1:], dilations[1:], (0,) * (n - 1), group
        )
        y = part if y is None else y.add_(part)
    y = y.reshape(batch, out0, m, *y.shape[2:]).movedim(1, 2).contiguous()
    return y if b is None else y.add_(b.reshape(m, *(1,) * n))


def conv(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, g: Geometry, group: int
) -> torch.Tensor:
    """The convolution of ``x`` with ``w`` (+ per-channel ``b``) under geometry ``g``."""
    padding = g.begin
    if g.begin != g.end:
        x = F.pad(x, _torch_pads(g.begin, g.end))
        padding = (0,) * len(g.begin)
    return _conv_valid(x, w, b, g.strides, g.dilations, padding, group)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class TorchConvArrays:
    """:class:`tensorkiln.kernels.common.conv.ConvArrays` of ConvAct on torch tensors (Conv's
    convolution is cuda/nn.py's)."""

    geometry = staticmethod(geometry_of)

    def conv_act(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        z: torch.Tensor | None,
        g: Geometry,
        group: int,
        act: tuple,
        after: bool,
    ) -> torch.Tensor:
        activation, act = act[0], act[1:]
        m = w.shape[0]
        bias = None if b is None else _as(b.reshape(m), x.dtype)
        # on the CPU, oneDNN with the weight prepacked and the activation fused where it can, and
        # the residual too where the activation comes after it (or there is none)
        if z is not None and (not after or activation == ""):
            with_z = residual_conv(x, w, g, group, z, activation)
            if with_z is not None:
                return with_z(x, bias, z)
        post = None if z is not None else fused_activation(activation, act[0], act[2], act[3])
        y = packed_conv(x, w, bias, g, group, post or ("none", [], ""))
        if y is not None and post is not None:
            return y
        if y is None and x.is_cuda:
            y = _gpu_conv_act(x, w, bias, z, g, group, activation, act, after)
            if y is not None:
                return y
        if y is None:
            y = pointwise_gemm(x, w, bias, g, group)
        if y is None:
            y = conv(x, _as(w, x.dtype), bias, g, group)
        return _torch_epilogue_(y, z, activation, act, after)


def _check_residual(y: torch.Tensor, z: torch.Tensor | None) -> None:
    if z is not None and tuple(z.shape) != tuple(y.shape):
        raise ValueError(
            f"ConvAct: residual Z of shape {tuple(z.shape)} must have the output's {tuple(y.shape)}"
        )


def _torch_epilogue_(
    y: torch.Tensor, z: torch.Tensor | None, activation: str, act: tuple, after: bool
) -> torch.Tensor:
    """act(y + z) (``after``: act(y) + z) in place with torch's ops."""
    _check_residual(y, z)
    if z is not None and not after:
        y.add_(z)
    activate_(y, activation, *act)
    if z is not None and after:
        y.add_(z)
    return y


def _gpu_epilogue_(
    y: torch.Tensor,
    b: torch.Tensor | None,
    z: torch.Tensor | None,
    activation: str,
    act: tuple,
    after: bool,
) -> torch.Tensor:
    """act(y + b + z) (``after``: act(y + b) + z) in one Triton pass (kernels/triton/epilogue.py);
    the caller checks that Triton, the activation and ``y``'s dtype allow it."""
    if epilogue.channel_stride(y) is None:  # (a strided output: dense first)
        y = y.contiguous()
    if z is not None:
        _check_residual(y, z)
        if not epilogue.applies(y, z):  # (another layout or dtype: once into the output's)
            z = torch.empty_like(y).copy_(z)
    return epilogue.epilogue_(y, b, z, Epilogue.of(activation, *act), after)


def _epilogue_takes(t: torch.Tensor, activation: str) -> bool:
    """Whether the Triton epilogue takes a convolution of ``t``'s dtype (the output's) and this
    activation."""
    return epilogue is not None and activation in ACT_CODES and t.dtype in epilogue.FLOATS


def conv_epilogue_(
    y: torch.Tensor,
    b: torch.Tensor | None,
    z: torch.Tensor | None,
    activation: str,
    act: tuple,
    after: bool,
) -> torch.Tensor:
    """ConvAct's epilogue on a fresh convolution output ``y`` (per-channel bias ``b``, residual
    ``z``, activation ``act`` = (alpha, beta, min, max)): one Triton pass on a GPU, torch's ops
    elsewhere. Returns the result (``y``, or a dense copy of a strided ``y``)."""
    if y.is_cuda and _epilogue_takes(y, activation):
        return _gpu_epilogue_(y, b, z, activation, act, after)
    if b is not None:
        y.add_(b.reshape(1, -1, *(1,) * (y.ndim - 2)))
    return _torch_epilogue_(y, z, activation, act, after)


def _gpu_conv_act(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None,
    g: Geometry,
    group: int,
    activation: str,
    act: tuple,
    after: bool,
) -> torch.Tensor | None:
    """ConvAct on a GPU: cuBLAS (a 1x1 convolution as a GEMM on the channels-last view, the bias
    in its epilogue) or cuDNN, then the bias, residual and activation in one Triton pass over the
    output (kernels/triton/epilogue.py); None where Triton or the activation is missing."""
    if not _epilogue_takes(x, activation):
        return None
    relu = z is None and activation == "Relu" and bias is not None
    y = pointwise_gemm(x, w, bias, g, group, relu=relu)
    if y is not None and relu:  # (bias and ReLU in cuBLASLt's epilogue)
        return y
    b = None
    if y is None:
        y, b = conv(x, _as(w, x.dtype), None, g, group), bias
    if b is None and z is None and activation == "":
        return y
    return _gpu_epilogue_(y, b, z, activation, act, after)


conv_act = bind(common.conv_act, TorchConvArrays(), __name__)
register("ConvAct", domain="tensorkiln", since=1, backend="cuda")(conv_act)


def _specialize_conv_act(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    **attrs: Any,
) -> Callable[..., torch.Tensor] | None:
    """:func:`conv_act` for inputs of these shapes, decided once, on weights the cpu backend
    holds: oneDNN with the activation fused, or with the residual add (and ReLU) fused, or the
    GEMM of a small 1x1 (cpu_conv.specialized_conv, cpu_conv.residual_conv); where the native
    kernels apply (cpu_native.layer: small float32 2-D convolutions), the faster of theirs and
    that, measured here on these inputs; None otherwise. Called after :func:`conv_act` ran (and
    checked) these arguments (``attrs``: its keywords, defaults as in its signature)."""
    if b is not None and b.dtype != x.dtype:
        return None
    a = {**_CONV_ACT_DEFAULTS, **attrs}
    g = geometry_of(x, w, a["auto_pad"], a["dilations"], a["kernel_shape"], a["pads"], a["strides"])
    act = (a["activation_alpha"], a["activation_beta"], a["activation_min"], a["activation_max"])
    group, activation, order = a["group"], a["activation"], a["residual_order"]
    spec = _specialized_torch(x, w, z, g, group, activation, act, order)
    code = cpu_native.activation(activation, *act)
    native = cpu_native.layer(x, w, b, g, group, code, 0 if order == "add_act" else 1)
    if native is None:
        return spec
    generic = functools.partial(conv_act, **attrs)
    run_native = _native_for(native, generic, w, b)
    if cpu_native.always():
        return run_native
    return _faster_of(run_native, spec or generic, x, w, b, z)


# conv_act's keywords and their defaults, for its specialization
_CONV_ACT_DEFAULTS = {
    k: p.default
    for k, p in inspect.signature(conv_act).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def _native_for(
    native: Callable[..., torch.Tensor],
    other: Callable[..., torch.Tensor],
    w0: torch.Tensor,
    b0: torch.Tensor | None,
) -> Callable[..., torch.Tensor]:
    """ConvAct's signature over the native kernel made for weight ``w0`` and bias ``b0`` (any
    other weight or bias goes to ``other``, the kernel itself: the executor specializes layers
    whose weights are constants, so this is a guard)."""

    def run_native(
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if w is not w0 or b is not b0:
            return _call(other, x, w, b, z)
        return native(x, z)

    return run_native


def _faster_of(
    run_native: Callable[..., torch.Tensor],
    other: Callable[..., torch.Tensor],
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    z: torch.Tensor | None,
) -> Callable[..., torch.Tensor]:
    """The faster, measured on these inputs, of the native kernel and ``other``."""
    first = functools.partial(_call, run_native)
    best = cpu_native.faster(first, functools.partial(_call, other), (x, w, b, z))
    return run_native if best is first else other


def _call(fn: Callable[..., torch.Tensor], x, w, b, z) -> torch.Tensor:
    return fn(x, w, b) if z is None else fn(x, w, b, z)  # (the GEMM path takes no residual)


def _specialized_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    z: torch.Tensor | None,
    g: Geometry,
    group: int,
    activation: str,
    act: tuple[float | None, ...],
    residual_order: str,
) -> Callable[..., torch.Tensor] | None:
    """The torch paths of :func:`_specialize_conv_act` (oneDNN, GEMM), or None."""
    if z is not None:
        if residual_order != "add_act" and activation != "":
            return None
        with_z = residual_conv(x, w, g, group, z, activation)
        if with_z is None:
            return None

        def conv_add(
            x: torch.Tensor,
            w: torch.Tensor,
            b: torch.Tensor | None = None,
            z: torch.Tensor | None = None,
        ) -> torch.Tensor:
            return with_z(x, b, z)

        return conv_add
    post = fused_activation(activation, act[0], act[2], act[3])
    return specialized_conv(
        x,
        w,
        g,
        group,
        post,
        functools.partial(
            activate_, activation=activation, alpha=act[0], beta=act[1], lo=act[2], hi=act[3]
        ),
    )


# the executor asks for it where a layer's weight is one the cpu backend holds
conv_act.specialize = _specialize_conv_act  # type: ignore[attr-defined]
