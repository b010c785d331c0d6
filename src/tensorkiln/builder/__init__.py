"""The builder: model in, engine out."""

from tensorkiln.builder.builder import Builder, BuildReport
from tensorkiln.builder.config import BuilderConfig, OptimizationProfile, PrecisionWarning
from tensorkiln.engine.memory import MemoryPlan, plan_memory

__all__ = [
    "BuildReport",
    "Builder",
    "BuilderConfig",
    "MemoryPlan",
    "OptimizationProfile",
    "PrecisionWarning",
    "plan_memory",
]
