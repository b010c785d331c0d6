"""What the 8-bit stem kernels take (kernels/triton/conv_stem.py), backend-neutral: the optimizer
fuses a stem and its max pool into one layer (tensorkiln.QConvPool) only where a kernel can
then pool the stem's tiles itself.

The stem kernel reads an image packed into ``CP`` channels, each window row ``TAPS`` pixels
wide as one K step; the fused pool is ResNet's (:data:`POOL`) after a ReLU, so that every value
is at least 0 and the pool's padding can be zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

CP = 4  # channels of the packed image
TAPS = 8  # window columns a K step reads
# the pool the stem kernel fuses: ONNX MaxPool's attributes as ResNet's stem has them
POOL = {"kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def fuses_pool(pool_attrs: dict, activation: str) -> bool:
    """Whether a stem kernel fuses this MaxPool (its attributes as ONNX names them) after a
    convolution with ``activation``: a 3 x 3 window of stride 2 padded by 1 on every side, no
    dilation, floor rounding, no indices' order, and the activation ReLU."""
    a = pool_attrs
    return (
        activation == "Relu"
        and tuple(a.get("kernel_shape") or ()) == POOL["kernel_shape"]
        and tuple(a.get("strides") or (1, 1)) == POOL["strides"]
        and tuple(a.get("pads") or (0, 0, 0, 0)) == POOL["pads"]
        and tuple(a.get("dilations") or (1, 1)) == (1, 1)
        and not a.get("ceil_mode", 0)
        and _text(a.get("auto_pad", "NOTSET")) == "NOTSET"
        and not a.get("storage_order", 0)
    )


def takes_image(w_shape: Sequence[int], group: int, dilations: Sequence[int] | None) -> bool:
    """Whether a 2-D convolution of weight ``w_shape`` (OC, C, KH, KW) is a stem kernel's: at
    most CP input channels, a window at most TAPS wide, one group, no dilation."""
    if len(w_shape) != 4 or group != 1 or any(d != 1 for d in dilations or ()):
        return False
    return w_shape[1] <= CP and w_shape[3] <= TAPS
