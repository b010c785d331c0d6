"""Precision: which dtype each layer computes in (fp32, tf32, fp16, bf16; int8/fp8 later), decided
by a precision policy (:mod:`tensorkiln.precision.policy`)."""

from tensorkiln.precision.cancellation import cancellation_prone, kept_fp32_notes
from tensorkiln.precision.policy import (
    TOLERANCE,
    DefaultPolicy,
    PrecisionPlan,
    PrecisionPolicy,
    engine_precision,
)
from tensorkiln.precision.reduce import KEEP_FP32_INPUTS, reduce_precision

__all__ = [
    "KEEP_FP32_INPUTS",
    "TOLERANCE",
    "DefaultPolicy",
    "PrecisionPlan",
    "PrecisionPolicy",
    "cancellation_prone",
    "engine_precision",
    "kept_fp32_notes",
    "reduce_precision",
]
