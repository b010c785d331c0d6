"""ConvAct as one cuDNN call: ``cudnn_fused`` (cudnnConvolutionBiasActivationForward).

The default ConvAct route on the GPU runs cuDNN's convolution and then bias, residual and ReLU in
one Triton pass over its output (kernels/triton/epilogue.py): two kernels, and the output written
twice. cuDNN can apply ``relu(conv(x, w) + z + b)`` inside the convolution (PyTorch reaches it as
``torch.cudnn_convolution_relu`` / ``torch.cudnn_convolution_add_relu``; TensorRT fuses the same
way). Its kernels are not always the fastest (a 7x7 channels-last convolution has been measured
many times slower than the plain one), so this is a tactic: the autotuner keeps it only on the
layers where it wins on the layer's real input.

Taken: 2-D convolutions on CUDA devices with ReLU, the residual (if any) added before it, float16,
bfloat16 or float32 operands of one dtype, pads the same on both sides.
"""

from __future__ import annotations

import torch

from tensorkiln.kernels.cuda.fused_conv import conv_act, geometry_of
from tensorkiln.kernels.tactics import LayerSpec, tactic

_FLOATS = frozenset(["float16", "bfloat16", "float32"])
_ATTRS = frozenset(
    ["auto_pad", "dilations", "group", "kernel_shape", "pads", "strides", "activation",
     "residual_order"]
)  # fmt: skip


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
    present = [d for d in spec.dtypes if d is not None]
    if not present or any(d != present[0] for d in present) or present[0] not in _FLOATS:
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
    a = {"auto_pad": "NOTSET", "dilations": None, "kernel_shape": None, "pads": None,
         "strides": None, "group": 1, **attrs}  # fmt: skip
    g = geometry_of(x, w, a["auto_pad"], a["dilations"], a["kernel_shape"], a["pads"], a["strides"])
    if not x.is_cuda or x.ndim != 4 or tuple(g.begin) != tuple(g.end):
        return conv_act(x, w, b, z, **attrs)
    args = (list(g.strides), list(g.begin), list(g.dilations), int(a["group"]))
    bias = None if b is None else b.reshape(-1).to(x.dtype)
    if z is None:
        return torch.cudnn_convolution_relu(x, w, bias, *args)
    return torch.cudnn_convolution_add_relu(x, w, z, 1.0, bias, *args)
