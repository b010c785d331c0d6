"""Backend test cases we do not run, each with its reason. Patterns are regexes on test names."""

from __future__ import annotations

_ALIGN_CORNERS = (
    "the expected data comes from ONNX's Python reference, which divides by the unrounded "
    "scale * input_length; the spec (and onnxruntime, TensorRT, PyTorch) divides by the output "
    "length - 1, as our Resize does"
)

# pattern -> why it is excluded
EXCLUSIONS: dict[str, str] = {
    r"^test_resize_downsample_scales_linear_align_corners_": _ALIGN_CORNERS,
    r"^test_resize_downsample_scales_cubic_align_corners_": _ALIGN_CORNERS,
}

EXCLUDED = list(EXCLUSIONS)
