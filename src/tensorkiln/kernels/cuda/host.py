"""Ops the cuda backend runs on the host, each with the reason it is not GPU-native.

Such an op's reference (numpy) kernel runs on copies of its inputs, and its outputs go back to the
device. Every host op is listed here, by name and reason, so the copy is never silent:
``tensorkiln ops --backend cuda`` prints the list and a test keeps it honest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

import tensorkiln.kernels.reference  # noqa: F401  (registers the kernels wrapped here)
from tensorkiln.kernels.cuda.convert import current_device, to_numpy, to_torch
from tensorkiln.kernels.registry import _REGISTRY, KernelEntry, normalize_domain, register

HOST_OPS: dict[tuple[str, str], str] = {}  # (domain, op) -> why it runs on the host


def _device_of(args: tuple) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            return a[0].device
    return current_device()


def _host_call(entry: KernelEntry) -> Callable:
    @functools.wraps(entry.fn)
    def run(
        *args: Any, _n_outputs: int = 1, _ctx: Any = None, _opset: int = 0, **attrs: Any
    ) -> Any:
        device = _device_of(args)
        if entry.wants_n_outputs:
            attrs["_n_outputs"] = _n_outputs
        if entry.wants_ctx:
            attrs["_ctx"] = _ctx
        if entry.wants_opset:
            attrs["_opset"] = _opset
        result = entry.fn(*[to_numpy(a) for a in args], **attrs)
        if isinstance(result, tuple):
            return tuple(to_torch(r, device) for r in result)
        return to_torch(result, device)

    return run


def register_host(ops: str | list[str], reason: str, *, domain: str = "") -> None:
    """Run ``ops`` on the cuda backend through their reference kernels, for ``reason``."""
    domain = normalize_domain(domain)
    for op in [ops] if isinstance(ops, str) else ops:
        entries = _REGISTRY.get(("reference", domain, op))
        if not entries:
            raise KeyError(f"no reference kernel for {domain or 'ai.onnx'}.{op}")
        HOST_OPS[(domain, op)] = reason
        for e in entries:
            register(op, domain=domain, since=e.since, backend="cuda")(_host_call(e))
