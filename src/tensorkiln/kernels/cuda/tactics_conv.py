"""ConvAct tactics that hand the convolution to a library another way.

``cudnn_fused``: ConvAct as one cuDNN call (cudnnConvolutionBiasActivationForward).

The default ConvAct route on the GPU runs cuDNN's convolution and then bias, residual and ReLU in
one Triton pass over its output (kernels/triton/epilogue.py): two kernels, and the output written
twice. cuDNN can apply ``relu(conv(x, w) + z + b)`` inside the convolution (PyTorch reaches it as
``torch.cudnn_convolution_relu`` / ``torch.cudnn_convolution_add_relu``; TensorRT fuses the same
way). Its kernels are not always the fastest (a 7x7 channels-last convolution has been measured
many times slower than the plain one), so this is a tactic: the autotuner keeps it only on the
layers where it wins on the layer's real input.

Taken: 2-D convolutions on CUDA devices with ReLU, the residual (if any) added before it, float16,
bfloat16 or float32 operands of one dtype, pads the same on both sides.

``cublas_im2col``: a convolution of few input channels (an image's 3: the stem of a conv net) as
the cuBLAS GEMM of its unfolded input. cuDNN's kernels for 3 channels are slow (ResNet-50's 7x7
stem took 0.83 ms of an 8 ms batch of 256 in fp16 on an H200, 59 TFLOP/s, with the three
channels padded to eight 1.61 ms); unfolding writes the [C*KH*KW, pixels] patches once and the
GEMM then runs at tensor-core speed, writing the channels-last output directly. Bias, residual
and activation follow in the epilogue pass. Taken where C*KH*KW <= 512 with C not a multiple of
8, one group, on CUDA devices.

``cublas_patchify``: a convolution whose windows do not overlap (stride = kernel, no padding, no
dilation: a vision transformer's patch embedding) as one GEMM. Its im2col is a reshape and a
permute of the input, copied once; the GEMM takes the bias in cuBLASLt's epilogue and writes the
channels-last output. ViT-B/16's 16x16 patches of 3 channels (768 taps, past cublas_im2col's
budget) took 0.89 ms of a 10.5 ms batch of 128 in Triton's implicit-GEMM kernel on an H200: a 30
GFLOP GEMM at 33 TFLOP/s. Residual and activation, where the layer has them, follow in the
epilogue pass. Taken for one group, up to 16384 taps, on CUDA devices.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tensorkiln.kernels.cuda.fused_conv import conv_act, conv_epilogue_, geometry_of
from tensorkiln.kernels.cuda.nn import torch_pads
from tensorkiln.kernels.tactics import LayerSpec, tactic

_FLOATS = frozenset(["float16", "bfloat16", "float32"])
_ATTRS = frozenset(
    ["auto_pad", "dilations", "group", "kernel_shape", "pads", "strides", "activation",
     "residual_order"]
)  # fmt: skip


# ConvAct's attributes the tactics read, at their defaults
_DEFAULTS = {
    "auto_pad": "NOTSET", "dilations": None, "kernel_shape": None, "pads": None, "strides": None,
    "group": 1, "activation": "", "residual_order": "add_act",
}  # fmt: skip


def _one_float(spec: LayerSpec) -> bool:
    """The layer's inputs are all of one float dtype the tactics take."""
    present = [d for d in spec.dtypes if d is not None]
    return bool(present) and all(d == present[0] for d in present) and present[0] in _FLOATS


def _fits(spec: LayerSpec) -> bool:
    if spec.device != "cuda" or len(spec.shapes) < 2 or spec.shapes[0] is None:
        return False
    x, w = spec.shapes[0], spec.shapes[1]
    if w is None or len(x) != 4 or len(w) != 4 or not set(spec.attrs) <= _ATTRS:
        return False
    if spec.attrs.get("activation") != "Relu":
        return False
    if spec.attrs.get("residual_order", "add_act") != "add_act":
        return False
    if not _one_float(spec):
        return False
    pads = list(spec.attrs.get("pads") or [0, 0, 0, 0])
    return spec.attrs.get("auto_pad", "NOTSET") == "NOTSET" and pads[:2] == pads[2:]


@tactic("ConvAct", domain="tensorkiln", name="cudnn_fused", supports=_fits)
def conv_act_cudnn_fused(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    **attrs,
) -> torch.Tensor:
    """relu(conv(x, w) + z + b) in one cuDNN call (the default route where it does not apply)."""
    a = {**_DEFAULTS, **attrs}
    g = geometry_of(x, w, a["auto_pad"], a["dilations"], a["kernel_shape"], a["pads"], a["strides"])
    if not x.is_cuda or x.ndim != 4 or tuple(g.begin) != tuple(g.end):
        return conv_act(x, w, b, z, **attrs)
    args = (list(g.strides), list(g.begin), list(g.dilations), int(a["group"]))
    bias = None if b is None else b.reshape(-1).to(x.dtype)
    if z is None:
        return torch.cudnn_convolution_relu(x, w, bias, *args)
    return torch.cudnn_convolution_add_relu(x, w, z, 1.0, bias, *args)


_IM2COL_MAX_K = 512
_ACT_KEYS = ("activation_alpha", "activation_beta", "activation_min", "activation_max")


def _im2col_fits(spec: LayerSpec) -> bool:
    if spec.device != "cuda" or len(spec.shapes) < 2 or spec.shapes[0] is None:
        return False
    x, w = spec.shapes[0], spec.shapes[1]
    if w is None or len(x) != 4 or len(w) != 4 or int(spec.attrs.get("group", 1)) != 1:
        return False
    if not _one_float(spec):
        return False
    return x[1] % 8 != 0 and math.prod(w[1:]) <= _IM2COL_MAX_K


@tactic("ConvAct", domain="tensorkiln", name="cublas_im2col", supports=_im2col_fits)
def conv_act_im2col(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    **attrs,
) -> torch.Tensor:
    """act(conv(x, w) + b + z) as unfold + one GEMM into a channels-last output, then the
    epilogue (the default route where it does not apply)."""
    a = {**_DEFAULTS, **attrs}
    if x.ndim != 4 or int(a["group"]) != 1:
        return conv_act(x, w, b, z, **attrs)
    g = geometry_of(x, w, a["auto_pad"], a["dilations"], a["kernel_shape"], a["pads"], a["strides"])
    n, m = x.shape[0], w.shape[0]
    oh, ow = g.out
    if z is not None and tuple(z.shape) != (n, m, oh, ow):
        return conv_act(x, w, b, z, **attrs)  # (its error names the shapes)
    xp = F.pad(x, torch_pads(g.begin, g.end)) if g.padded else x
    cols = F.unfold(xp, g.kernel, dilation=g.dilations, stride=g.strides)  # [N, C*KH*KW, OH*OW]
    w2 = w.to(x.dtype).contiguous().reshape(m, -1)  # (the unfold's (C, KH, KW) order)
    y = torch.matmul(cols.transpose(1, 2), w2.t())  # [N, OH*OW, M]: channels-last pixels
    y = y.view(n, oh, ow, m).permute(0, 3, 1, 2)
    act = tuple(a.get(k) for k in _ACT_KEYS)
    bias = None if b is None else b.to(x.dtype)
    return conv_epilogue_(y, bias, z, a["activation"], act, a["residual_order"] == "act_add")


_PATCHIFY_MAX_K = 16384


def _patchify_fits(spec: LayerSpec) -> bool:
    if spec.device != "cuda" or len(spec.shapes) < 2 or spec.shapes[0] is None:
        return False
    x, w = spec.shapes[0], spec.shapes[1]
    if w is None or len(x) != 4 or len(w) != 4 or int(spec.attrs.get("group", 1)) != 1:
        return False
    if not _one_float(spec) or math.prod(w[1:]) > _PATCHIFY_MAX_K:
        return False
    a = spec.attrs
    kernel = list(a.get("kernel_shape") or w[2:])
    if list(a.get("strides") or [1, 1]) != kernel or list(kernel) == [1, 1]:
        return False  # (1x1 windows: the default route's GEMM on the channels-last view)
    if any(int(d) != 1 for d in a.get("dilations") or [1, 1]):
        return False
    return a.get("auto_pad", "NOTSET") in ("NOTSET", "VALID") and not any(a.get("pads") or [0])


@tactic("ConvAct", domain="tensorkiln", name="cublas_patchify", supports=_patchify_fits)
def conv_act_patchify(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    **attrs,
) -> torch.Tensor:
    """act(conv(x, w) + b + z) for windows that do not overlap: the patches gathered by one
    copy, one GEMM with the bias into a channels-last output, then the epilogue if any (the
    default route where it does not apply)."""
    a = {**_DEFAULTS, **attrs}
    if x.ndim != 4 or int(a["group"]) != 1:
        return conv_act(x, w, b, z, **attrs)
    g = geometry_of(x, w, a["auto_pad"], a["dilations"], a["kernel_shape"], a["pads"], a["strides"])
    if g.padded or tuple(g.strides) != tuple(g.kernel) or any(d != 1 for d in g.dilations):
        return conv_act(x, w, b, z, **attrs)
    n, c = x.shape[:2]
    m = w.shape[0]
    (oh, ow), (kh, kw) = g.out, g.kernel
    if z is not None and tuple(z.shape) != (n, m, oh, ow):
        return conv_act(x, w, b, z, **attrs)  # (its error names the shapes)
    patches = x[:, :, : oh * kh, : ow * kw].reshape(n, c, oh, kh, ow, kw)
    cols = patches.permute(0, 2, 4, 1, 3, 5).reshape(n * oh * ow, c * kh * kw)  # (one copy)
    w2 = w.to(x.dtype).contiguous().reshape(m, -1)  # (C, KH, KW), the patches' order
    if b is None:
        y = torch.mm(cols, w2.t())
    else:
        y = torch.addmm(b.reshape(-1).to(x.dtype), cols, w2.t())  # (bias in the epilogue)
    y = y.view(n, oh, ow, m).permute(0, 3, 1, 2)  # channels-last [N, M, OH, OW]
    if z is None and not a["activation"]:
        return y
    act = tuple(a.get(k) for k in _ACT_KEYS)
    return conv_epilogue_(y, None, z, a["activation"], act, a["residual_order"] == "act_add")
