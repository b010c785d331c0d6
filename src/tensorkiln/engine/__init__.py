"""Engines: the built, serializable form of a model."""

from tensorkiln.engine.engine import Engine, TensorSpec

__all__ = ["Engine", "TensorSpec"]
