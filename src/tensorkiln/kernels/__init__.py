"""Kernels: one registry keyed by (op, domain, opset, kernel tree). The trees: ``reference``
(numpy, the oracle), ``cuda`` (torch and Triton; the cpu backend runs it on CPU tensors) with
``cpu`` (that backend's native and prepacked kernels) and ``triton`` (generated kernels) beside it,
and ``common`` (backend-neutral helpers). :mod:`tensorkiln.kernels.tactics` holds the candidate
implementations the autotuner times. Nothing here knows a backend object (tensorkiln.backends
sits above)."""

from tensorkiln.kernels.registry import KernelEntry, has_kernel, lookup, register, registered_ops

__all__ = ["KernelEntry", "has_kernel", "lookup", "register", "registered_ops"]
