"""The cpu backend: the cuda tree's torch kernels on CPU tensors (oneDNN convolutions and GEMMs,
the native kernels of kernels/cpu), with weights held prepacked and shape-specialized layers."""

from __future__ import annotations

import platform
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from tensorkiln.backends import cpu_memory
from tensorkiln.backends.torch_common import TorchBackend, to_torch
from tensorkiln.errors import TensorkilnError
from tensorkiln.kernels.cpu import conv as cpu_conv


class CpuBackend(TorchBackend):
    """PyTorch on the CPU. ``plain``: the kernels' plain torch route (weights as they are, no
    shape-specialized functions), which torch.compile traces (runtime/cpu_compile.py)."""

    name = "cpu"
    specializes = True
    holds_weights = True
    thread_tuning = True
    compiles = True

    def __init__(self, *, plain: bool = False) -> None:
        super().__init__(torch.device("cpu"))
        if plain:
            self.specializes = self.holds_weights = False

    def plain(self) -> CpuBackend:
        return CpuBackend(plain=True)

    def to_device(self, value: Any, *, channels_last: bool = False, held: bool = False) -> Any:
        if channels_last and self.holds_weights:
            t = cpu_conv.channels_last_input(value)
            if t is not None:
                return t
        return super().to_device(value)

    def constant(self, array: np.ndarray, *, conv_weight: bool = False) -> Any:
        c = to_torch(array, self.device)
        if conv_weight and self.holds_weights:
            c = cpu_conv.hold_weight(c)
        self.remember_on_host(c, array)
        return c

    def inference(self) -> AbstractContextManager[Any]:
        # no_grad, not inference_mode: results are handed to the caller, and inference tensors
        # would refuse the caller's in-place updates outside inference mode
        return torch.no_grad()

    def prepare(self) -> None:
        cpu_memory.tune()

    def target(self) -> dict[str, Any]:
        # recorded, not enforced: torch picks its kernels per ISA at run time
        return {
            "device": "cpu",
            "machine": platform.machine(),
            "torch": torch.__version__,
            "isa": torch.backends.cpu.get_cpu_capability(),
        }


def make(device: Any = None) -> CpuBackend:
    """The cpu backend (``device``: None or the CPU)."""
    if device not in (None, "cpu") and torch.device(device).type != "cpu":
        raise TensorkilnError(f"the cpu backend runs on the CPU, not on '{device}'")
    return CpuBackend()
