"""Errors raised by tensorkiln.

Every error a user can cause derives from :class:`TensorkilnError`, so callers (and the CLI) can catch
one type. Messages say what was wrong, where (file, node, input) and, when there is one, what to do.
"""

from __future__ import annotations


class TensorkilnError(Exception):
    """Base class of every error tensorkiln raises on purpose."""


class ModelLoadError(TensorkilnError):
    """The model file (or its external data) could not be read or is not a valid model."""


class UnsupportedOpError(TensorkilnError):
    """An operator, domain or opset that tensorkiln cannot run."""


class GraphError(TensorkilnError):
    """The graph is malformed: dangling values, cycles, type or shape conflicts."""


class ShapeInferenceError(GraphError):
    """Shapes or types of a node's inputs are incompatible with the operator."""


class InputError(TensorkilnError):
    """The inputs given to run a model do not match what the model expects."""


class KernelError(TensorkilnError):
    """A kernel failed while running a node; the message names the node."""


class EngineFormatError(TensorkilnError):
    """An engine file is damaged, truncated or not an engine at all."""


class EngineCompatibilityError(TensorkilnError):
    """An intact engine built for another backend, device or tensorkiln version."""


class BuildError(TensorkilnError):
    """A build cannot satisfy its configuration (memory limit, precision, profile)."""
