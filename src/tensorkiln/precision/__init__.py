"""Precision: which dtype each layer computes in (fp32, tf32, fp16, bf16; int8/fp8 later)."""

from tensorkiln.precision.reduce import KEEP_FP32_INPUTS, reduce_precision

__all__ = ["KEEP_FP32_INPUTS", "reduce_precision"]
