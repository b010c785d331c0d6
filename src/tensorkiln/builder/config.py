"""What a build is asked to do: precisions, shape profiles, optimization level, limits."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from tensorkiln.engine.profile import OptimizationProfile
from tensorkiln.errors import BuildError, InputError
from tensorkiln.ir.graph import PRECISIONS
from tensorkiln.precision.io import parse_formats
from tensorkiln.precision.policy import PrecisionPolicy

# Precisions no backend has kernels for yet: asking for one is an error, not a silent no-op.
NOT_IMPLEMENTED = ("int8", "fp8")
# The precisions each backend's layers can compute in; a backend not listed computes in fp32.
BACKEND_PRECISIONS = {"cuda": ("fp32", "tf32", "fp16", "bf16")}
LOG_LEVELS = ("error", "warning", "info", "verbose")
# the kinds of tactic; each tactic's name starts with its kind: "triton_gemm_...", "cudnn_fused"
TACTIC_SOURCES = ("triton", "cudnn", "cublas")


class PrecisionWarning(UserWarning):
    """A precision was allowed that the chosen backend does not implement; the build keeps fp32."""


def implemented_precisions(backend: str) -> tuple[str, ...]:
    """The precisions layers of ``backend`` ('reference', 'cuda', ...) can compute in."""
    return BACKEND_PRECISIONS.get(backend, ("fp32",))


def _not_implemented(precisions: Any) -> None:
    later = [p for p in NOT_IMPLEMENTED if p in precisions]
    if later:
        names = "/".join(p.upper() for p in later)
        raise BuildError(
            f"{names} {'is' if len(later) == 1 else 'are'} not implemented yet: no tensorkiln "
            f"backend has {names} kernels; build without "
            + " and ".join(f"--{p} (set_flag('{p}'))" for p in later)
            + "; fp16 and bf16 are the reduced precisions the cuda backend implements"
        )


@dataclass
class BuilderConfig:
    """Build options. Precisions a backend does not implement are refused (int8, fp8) or
    dropped with a :class:`PrecisionWarning` (fp16, bf16, tf32 on the reference backend)."""

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

    def set_flag(self, precision: str) -> None:
        """Allow a precision: 'fp32', 'tf32', 'fp16' or 'bf16' ('int8' and 'fp8' raise
        BuildError: no backend implements them yet)."""
        if precision not in PRECISIONS:
            raise InputError(
                f"unknown precision '{precision}'; choose from {', '.join(PRECISIONS)}"
            )
        _not_implemented({precision})
        self.precisions.add(precision)

    def add_optimization_profile(self, profile: OptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def validate(self) -> None:
        for p in self.precisions:
            if p not in PRECISIONS:
                raise InputError(f"unknown precision '{p}'; choose from {', '.join(PRECISIONS)}")
        _not_implemented(self.precisions)
        self._validate_layer_precisions()
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
        if self.log_level not in LOG_LEVELS:
            raise InputError(f"log level must be one of {', '.join(LOG_LEVELS)}")

    def _validate_layer_precisions(self) -> None:
        for name, p in self.layer_precisions.items():
            if not isinstance(name, str) or p not in PRECISIONS:
                raise InputError(
                    f"layer_precisions: layer {name!r} is pinned to {p!r}; give layer names and "
                    f"one of {', '.join(PRECISIONS)}"
                )
            if p in NOT_IMPLEMENTED:
                raise BuildError(
                    f"layer_precisions: layer '{name}' is pinned to {p}, which is not implemented "
                    "yet (no tensorkiln backend has its kernels); pin it to fp32, fp16 or bf16"
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
            | ({"layer_precisions": dict(self.layer_precisions)} if self.layer_precisions else {})
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
