"""Kernels: one registry keyed by (op, domain, opset, backend); reference (numpy) kernels live in
:mod:`tensorkiln.kernels.reference`."""

from tensorkiln.kernels.registry import KernelEntry, has_kernel, lookup, register, registered_ops

__all__ = ["KernelEntry", "has_kernel", "lookup", "register", "registered_ops"]
