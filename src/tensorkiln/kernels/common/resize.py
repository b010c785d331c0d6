"""Backend-neutral parts of Resize and Upsample: the options each opset allows, the options a
Resize node resolves to, and the output plan (length and scale of every resized axis), computed
on the host from the small scales/sizes vectors. Shared by the reference and cuda trees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# Resize-10 takes (X, scales) and maps coordinates as Upsample does ("asymmetric"); from 11 the
# inputs are (X, roi, scales, sizes) and the coordinate mode is an attribute; 13 drops
# tf_half_pixel_for_nn; 18 adds antialias, axes and keep_aspect_ratio_policy; 19 adds
# half_pixel_symmetric.
ROI_INPUT = 11
COORD_MODES_11 = (
    "half_pixel",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_half_pixel_for_nn",
    "tf_crop_and_resize",
)
COORD_MODES_13 = tuple(m for m in COORD_MODES_11 if m != "tf_half_pixel_for_nn")
COORD_MODES_19 = (*COORD_MODES_13, "half_pixel_symmetric")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
# Upsample takes its scales as an attribute before opset 9, as an input from 9.
UPSAMPLE_SCALES_INPUT = 9


def _version(opset: int) -> int:
    """The Resize schema version ``opset`` selects (for messages and the allowed modes)."""
    return max(v for v in (10, 11, 13, 18, 19) if v <= max(opset, 10))


def coordinate_modes(opset: int) -> tuple[str, ...]:
    """The coordinate_transformation_mode values Resize allows at ``opset``."""
    v = _version(opset)
    return COORD_MODES_11 if v < 13 else COORD_MODES_13 if v < 19 else COORD_MODES_19


def check_option(value: str, allowed: tuple[str, ...], what: str, opset: int) -> None:
    """Raise ValueError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(
            f"Resize-{_version(opset)}: {what} '{value}' is not one of {', '.join(allowed)}"
        )


def legacy_options(mode: str) -> dict[str, Any]:
    """The options of Resize-10 and Upsample: ``mode`` in asymmetric coordinates."""
    return dict(
        mode=mode,
        coordinate_transformation_mode="asymmetric",
        nearest_mode="simple",
        cubic_coeff_a=-0.75,
        antialias=False,
        exclude_outside=False,
        extrapolation_value=0.0,
    )


def upsample_mode(mode: str) -> str:
    """Upsample's mode as Resize spells it ('bilinear' is 'linear'); raises for others."""
    mode = "linear" if mode == "bilinear" else mode
    if mode not in ("nearest", "linear"):
        raise ValueError(f"Upsample: mode '{mode}' is not one of nearest, linear")
    return mode


def resize_options(opset: int, attrs: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:
    """(axes, keep_aspect_ratio_policy, options) of a Resize-11+ node with resolved ``attrs``,
    the modes checked against what ``opset`` allows."""
    opts = dict(attrs)
    check_option(
        opts["coordinate_transformation_mode"],
        coordinate_modes(opset),
        "coordinate_transformation_mode",
        opset,
    )
    check_option(opts["nearest_mode"], NEAREST_MODES, "nearest_mode", opset)
    axes = opts.pop("axes", None)
    policy = opts.pop("keep_aspect_ratio_policy", "stretch")
    opts["antialias"] = bool(opts.get("antialias", 0))
    opts["exclude_outside"] = bool(opts["exclude_outside"])
    return axes, policy, opts


# The attributes of Resize (of its newest opset), as the kernels name their keywords.
RESIZE_ATTRIBUTES = (
    "antialias",
    "axes",
    "coordinate_transformation_mode",
    "cubic_coeff_a",
    "exclude_outside",
    "extrapolation_value",
    "keep_aspect_ratio_policy",
    "mode",
    "nearest_mode",
)


def resize_arguments(opset: int, roi: Any, scales: Any, sizes: Any, keywords: dict[str, Any]):
    """(roi, scales, sizes, axes, policy, options) of a Resize node at ``opset`` whose inputs are
    ``roi``, ``scales``, ``sizes`` and whose resolved attributes are in ``keywords`` (a kernel's
    locals): Resize-10's (X, scales) moved into place, the options checked."""
    attrs = {k: keywords[k] for k in RESIZE_ATTRIBUTES}
    if opset < ROI_INPUT:  # Resize-10's second input is its scales
        check_option(attrs["mode"], ("nearest", "linear"), "mode", opset)
        return None, roi, None, None, "stretch", legacy_options(attrs["mode"])
    axes, policy, opts = resize_options(opset, attrs)
    return roi, scales, sizes, axes, policy, opts


def resolve_axes(axes: Sequence[int] | None, rank: int) -> list[int]:
    """Resize's ``axes`` as non-negative axes of a ``rank``-D input (all axes when absent)."""
    out = list(range(rank)) if not axes else [int(a) + rank if a < 0 else int(a) for a in axes]
    if any(not 0 <= a < rank for a in out) or len(set(out)) != len(out):
        raise ValueError(f"Resize: invalid axes {out} for a {rank}-D input")
    return out


def present(v: Any) -> bool:
    """Whether an optional host vector is given and not empty."""
    return v is not None and np.asarray(v).size > 0


def plan(shape: tuple[int, ...], scales, sizes, axes: list[int], policy: str):
    """Output length and scale of every resized axis."""
    in_len = np.array([shape[a] for a in axes], dtype=np.int64)
    if present(scales) and present(sizes):
        raise ValueError("Resize: give only one of 'scales' and 'sizes', not both")
    if present(sizes):
        sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        if sizes.size != len(axes):
            raise ValueError(f"Resize: 'sizes' has {sizes.size} values for {len(axes)} axes")
        ratio = sizes / in_len
        if policy == "stretch":
            return sizes.tolist(), ratio.tolist()
        if policy not in ("not_larger", "not_smaller"):
            raise ValueError(f"Resize: unknown keep_aspect_ratio_policy '{policy}'")
        s = float(ratio.min() if policy == "not_larger" else ratio.max())
        return [int(s * n + 0.5) for n in in_len], [s] * len(axes)
    if not present(scales):
        raise ValueError("Resize: one of 'scales' and 'sizes' must be given")
    scales = np.asarray(scales).reshape(-1)
    if scales.size != len(axes):
        raise ValueError(f"Resize: 'scales' has {scales.size} values for {len(axes)} axes")
    if (scales <= 0).any():
        raise ValueError(f"Resize: scales must be positive, got {scales.tolist()}")
    # The product is taken in the scales' own precision (float32 in practice), as onnxruntime
    # does, so that e.g. 10 * float32(0.7) gives 7 rather than 6.
    out = np.floor(scales * in_len.astype(scales.dtype)).astype(np.int64)
    return out.tolist(), scales.astype(np.float64).tolist()
