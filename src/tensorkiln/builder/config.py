"""What a build is asked to do: precisions, shape profiles, optimization level, limits."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from tensorkiln.engine.profile import OptimizationProfile
from tensorkiln.errors import BuildError, InputError
from tensorkiln.ir.graph import PRECISIONS
from tensorkiln.precision.budget import AccuracyBudget
from tensorkiln.precision.calib_data import DEFAULT_BATCH
from tensorkiln.precision.calibrators import CALIBRATORS, DEFAULT_PERCENTILE
from tensorkiln.precision.io import parse_formats
from tensorkiln.precision.policy import PrecisionPolicy

# The precisions each backend's layers can compute in; a backend not listed computes in fp32.
# (INT8/FP8: quantized convolutions and GEMMs, calibrated)
BACKEND_PRECISIONS = {
    "cuda": ("fp32", "tf32", "fp16", "bf16", "int8", "fp8"),
    "reference": ("fp32", "int8", "fp8"),
}
QUANTIZED_PRECISIONS = ("int8", "fp8")
LOG_LEVELS = ("error", "warning", "info", "verbose")
# the kinds of tactic; each tactic's name starts with its kind: "triton_gemm_...", "cudnn_fused"
TACTIC_SOURCES = ("triton", "gluon", "cutlass", "cudnn", "cublas", "cublaslt", "sdpa")


class PrecisionWarning(UserWarning):
    """A precision was allowed that the chosen backend does not implement; the build keeps fp32."""


def implemented_precisions(backend: str) -> tuple[str, ...]:
    """The precisions layers of ``backend`` ('reference', 'cuda', ...) can compute in."""
    return BACKEND_PRECISIONS.get(backend, ("fp32",))


@dataclass
class BuilderConfig:
    """Build options. Precisions a backend does not implement are dropped with a
    :class:`PrecisionWarning` (fp16, bf16, tf32 on the reference backend; int8, fp8 on cuda)."""

    precisions: set[str] = field(default_factory=lambda: {"fp32"})
    profiles: list[OptimizationProfile] = field(default_factory=list)
    timing_cache: str | None = None
    optimization_level: int = 3
    memory_limit: int | None = None
    log_level: str = "warning"
    embed_source: bool = False
    dump_ir: str | None = None  # a folder: the IR is written there after every optimizer pass
    # the kinds of tactic the autotuner may try besides each op's default kernel (cuBLAS/cuDNN
    # through torch): "triton" for the generated kernels; None allows every kind
    tactic_sources: set[str] | None = None
    # tactics never tried, by name or shell-style pattern ("cutlass_fp8_*vd"): a way around one
    # kernel that fails or hangs on some device, without giving up its whole source
    tactic_exclude: list[str] = field(default_factory=list)
    # seconds one tactic's check and timing may take before the build stops (naming the layer
    # and the tactic, the timing cache saved): a kernel that never ends holds the GPU, and no
    # call in this process gets it back, so the process exits (status 3); None: no limit
    tactic_timeout: float | None = None
    # per-layer precision constraints (TensorRT's ILayer.precision): layer name -> precision, a
    # layer of the optimized graph; the default policy honours fp32 on fp16/bf16 engines
    layer_precisions: dict[str, str] = field(default_factory=dict)
    # what decides each layer's precision and format; None: precision.DefaultPolicy
    precision_policy: PrecisionPolicy | None = None
    # the engine's input and output types, trtexec's --inputIOFormats/--outputIOFormats: one
    # format per input (output) in order, or one for all float ones ("fp16", "fp16:chw";
    # precision/io.py); none: float32 in and out
    input_io_formats: list[str] = field(default_factory=list)
    output_io_formats: list[str] = field(default_factory=list)
    # INT8/FP8 calibration (precision/calibration.py): the data (a folder or file of .npy/.npz,
    # or an iterable of feeds), a cache file read when it exists and written when it does not,
    # the calibrator (None: entropy for int8, minmax for fp8) and its percentile, the batch
    # size for data from files, and how many samples to use (None: all)
    calibration_data: Any = None
    calibration_cache: str | None = None
    calibrator: str | None = None
    calibration_percentile: float = DEFAULT_PERCENTILE
    calibration_batch_size: int = DEFAULT_BATCH
    calibration_samples: int | None = None
    # the most a quantized engine's outputs may differ from float32 on the calibration data:
    # "rel_l2:0.02" (or "0.02") or "cosine:0.999"; the fewest layers that meet it stay float32
    accuracy_budget: str | None = None
    # SmoothQuant's alpha for the GEMMs of an INT8/FP8 build (precision/smooth.py), or "auto"
    # (each GEMM measured on the first calibration batch); None: off
    smooth_quant: float | str | None = None
    # INT8/FP8 builds: each quantized layer is also timed in the engine's float precision and
    # the faster kept (TensorRT's choice among the allowed precisions; the build report names
    # the layers kept in float). False quantizes every layer; None: on a GPU, where the timings
    # mean something (on a CPU device the kernels measured are not the GPU's)
    choose_precision_per_layer: bool | None = None
    # run the layers between a key-padding mask's attentions on the real tokens only, packed
    # (passes/remove_padding.py); the outputs are zeros at the masked positions
    remove_padding: bool = False

    def set_flag(self, precision: str) -> None:
        """Allow a precision: 'fp32', 'tf32', 'fp16', 'bf16', 'int8' or 'fp8' (int8/fp8 need
        calibration data, a calibration cache, or a model with Q/DQ nodes)."""
        if precision not in PRECISIONS:
            raise InputError(
                f"unknown precision '{precision}'; choose from {', '.join(PRECISIONS)}"
            )
        self.precisions.add(precision)

    def add_optimization_profile(self, profile: OptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def validate(self) -> None:
        for p in self.precisions:
            if p not in PRECISIONS:
                raise InputError(f"unknown precision '{p}'; choose from {', '.join(PRECISIONS)}")
        self._validate_layer_precisions()
        self._validate_calibration()
        self.input_io_formats = _io_formats(self.input_io_formats, "input")
        self.output_io_formats = _io_formats(self.output_io_formats, "output")
        if not 0 <= self.optimization_level <= 5:
            raise InputError(f"optimization level must be 0..5, got {self.optimization_level}")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise InputError(f"memory limit must be positive, got {self.memory_limit}")
        unknown = set(self.tactic_sources or ()) - set(TACTIC_SOURCES)
        if unknown:
            raise InputError(
                f"unknown tactic source(s) {', '.join(sorted(unknown))}; choose from "
                f"{', '.join(TACTIC_SOURCES)}"
            )
        if not (
            isinstance(self.tactic_exclude, list | tuple)
            and all(isinstance(p, str) and p.strip() for p in self.tactic_exclude)
        ):
            raise InputError(
                "tactic_exclude (--tactic-exclude) must be a list of tactic names or patterns"
            )
        t = self.tactic_timeout
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < 1e9
        ):
            raise InputError(
                f"tactic_timeout (--tactic-timeout) must be a positive number of seconds, got {t!r}"
            )
        if self.log_level not in LOG_LEVELS:
            raise InputError(f"log level must be one of {', '.join(LOG_LEVELS)}")

    def _validate_layer_precisions(self) -> None:
        for name, p in self.layer_precisions.items():
            if not isinstance(name, str) or p not in PRECISIONS:
                raise InputError(
                    f"layer_precisions: layer {name!r} is pinned to {p!r}; give layer names and "
                    f"one of {', '.join(PRECISIONS)}"
                )
            if p in QUANTIZED_PRECISIONS:
                raise BuildError(
                    f"layer_precisions: layer '{name}' is pinned to {p}; a layer is quantized "
                    "by allowing int8/fp8 for the build (set_flag), and layer_precisions keeps "
                    "a layer at a higher precision: pin it to fp32, fp16 or bf16"
                )

    def _validate_calibration(self) -> None:
        if self.calibrator is not None and self.calibrator not in CALIBRATORS:
            raise InputError(
                f"unknown calibrator '{self.calibrator}'; choose from {', '.join(CALIBRATORS)}"
            )
        p = self.calibration_percentile
        if not isinstance(p, int | float) or isinstance(p, bool) or not 50 <= p <= 100:
            raise InputError(f"the calibration percentile must be in [50, 100], got {p!r}")
        n = self.calibration_batch_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InputError(f"the calibration batch size must be a positive integer, got {n!r}")
        n = self.calibration_samples
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise InputError(f"the calibration sample count must be positive, got {n!r}")
        if self.accuracy_budget is not None:
            AccuracyBudget.parse(self.accuracy_budget)
        a = self.smooth_quant
        number = isinstance(a, int | float) and not isinstance(a, bool)
        if a is not None and a != "auto" and not (number and 0 <= a <= 1):
            raise InputError(
                f"smooth_quant (SmoothQuant's alpha) must be in [0, 1] or 'auto', got {a!r}"
            )

    def for_backend(self, backend: str) -> BuilderConfig:
        """A validated copy allowing only the precisions ``backend`` implements.

        Each dropped precision gets a PrecisionWarning, so a request the engine cannot honour is
        never silent, and the engine records only precisions its layers can use.
        """
        self.validate()
        usable = implemented_precisions(backend)
        dropped = sorted(p for p in self.precisions if p not in usable)
        if dropped:
            warnings.warn(
                f"the {backend} backend does not implement {', '.join(dropped)}: the engine stays "
                f"float32 on this backend ({', '.join(usable)} implemented)",
                PrecisionWarning,
                stacklevel=3,
            )
        return replace(self, precisions={p for p in self.precisions if p in usable} | {"fp32"})

    def to_json(self) -> dict:
        return (
            {
                "precisions": sorted(self.precisions),
                "optimization_level": self.optimization_level,
                "memory_limit": self.memory_limit,
                "timing_cache": self.timing_cache,
                "tactic_sources": None
                if self.tactic_sources is None
                else sorted(self.tactic_sources),
            }
            | ({"tactic_exclude": list(self.tactic_exclude)} if self.tactic_exclude else {})
            | ({"layer_precisions": dict(self.layer_precisions)} if self.layer_precisions else {})
            | ({"remove_padding": True} if self.remove_padding else {})
            | (
                {
                    "calibrator": self.calibrator,
                    "calibration_percentile": self.calibration_percentile,
                    "choose_precision_per_layer": self.choose_precision_per_layer,
                }
                if self.precisions & set(QUANTIZED_PRECISIONS)
                else {}
            )
            | {
                k: list(v)
                for k, v in (
                    ("input_io_formats", self.input_io_formats),
                    ("output_io_formats", self.output_io_formats),
                )
                if v
            }
        )


def _io_formats(formats: Any, what: str) -> list[str]:
    """The types of ``formats`` (a list of trtexec formats, or one comma-separated string)."""
    if isinstance(formats, str):
        formats = [formats]
    if not isinstance(formats, list | tuple) or not all(isinstance(f, str) for f in formats):
        raise InputError(f"{what}_io_formats must be a list of formats such as 'fp16:chw'")
    return parse_formats(",".join(formats), f"--{what}-io-formats") if formats else []
