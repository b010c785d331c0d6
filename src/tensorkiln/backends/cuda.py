"""The cuda backend: PyTorch as the CUDA layer (memory, streams, events, cuBLAS, cuDNN, CUDA
graphs) with Triton for generated kernels. On a CPU device (``Builder("cuda", device="cpu")``)
the same kernels run on CPU tensors, Triton's through its interpreter: how tests run them."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from tensorkiln.backends import pools
from tensorkiln.backends.base import LayerTimer, host_memory
from tensorkiln.backends.torch_common import TorchBackend
from tensorkiln.errors import TensorkilnError
from tensorkiln.kernels.cpu import conv as held_conv
from tensorkiln.kernels.cuda.convert import mark_constant, upload


class CudaBackend(TorchBackend):
    """The torch and Triton kernels on ``device`` (a CUDA device, or the CPU for tests)."""

    name = "cuda"
    host_mirror = True
    keeps_shape_values = True
    math_modes = True
    autotunes = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        gpu = device.type == "cuda"
        self.streams = gpu
        self.cuda_graphs = gpu
        # On a GPU, 2-D convolutions run channels-last (NHWC) from weight to weight: cuDNN's
        # tensor-core convolutions are NHWC kernels, and an NCHW tensor costs a transpose in and
        # out of every one of them (16% of ResNet-50's time at batch 256 in fp16). Elementwise
        # ops, pooling and the Triton convolution keep the layout they are given, so the layout
        # changes once at the stem and where a tensor leaves the convolutions (a Flatten).
        self.holds_weights = gpu

    def to_device(self, value: Any, *, channels_last: bool = False, held: bool = False) -> Any:
        t = upload(value, self.device, held=held)
        if channels_last and self.holds_weights and _image(t):
            return t.contiguous(memory_format=torch.channels_last)
        return t

    def constant(self, array: np.ndarray, *, conv_weight: bool = False) -> Any:
        c = super().constant(array)
        if conv_weight and self.holds_weights:
            c = mark_constant(hold_conv_weight(c))
            self.remember_on_host(c, array)
        return c

    def acquire_pool(self, kind: str = "activations") -> tuple[Any, Any]:
        """A (memory pool, stream) pair of ``kind`` for one context (backends/pools.py)."""
        return pools.acquire(self.device, kind)

    def release_pool(self, pool: Any, stream: Any, kind: str = "activations") -> None:
        """Give back a pair from :meth:`acquire_pool` once its context is gone."""
        pools.release(pool, stream, self.device, kind)

    def capturing(self) -> bool:
        return self.streams and torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        if self.streams:
            torch.cuda.synchronize(self.device)

    def layer_timer(self) -> LayerTimer:
        """CUDA events around each layer on the current stream (GPU time, host launch overhead
        and synchronization excluded); the host clock on a CPU device."""
        if not self.streams:
            return super().layer_timer()
        lead = self.__dict__.setdefault("_profile_lead", [0.0])  # (shared by this backend's runs)
        return CudaEventLayerTimer(lead)

    def memory_limit(self) -> tuple[int | None, str]:
        if not self.streams:
            return host_memory()
        free, _ = torch.cuda.mem_get_info(self.device)
        name = torch.cuda.get_device_name(self.device)
        return free, f"free on {name} (its context's pool included)"

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.streams else 0

    def target(self) -> dict[str, Any]:
        if not self.streams:  # the kernels on torch CPU tensors
            return {"device": "cpu", "torch_device": "cpu", "torch": torch.__version__}
        props = torch.cuda.get_device_properties(self.device)
        return {
            "device": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        }


def hold_conv_weight(w: Any) -> Any:
    """A convolution's constant weight as this backend holds it: a 4-D weight channels-last,
    int8 as well as floating point (E4M3 among them). An 8-bit layer's default kernel writes
    channels-last where its input or weight is, as its tactics do; with int8 weights held NCHW,
    an INT8 engine's default kernels wrote every activation NCHW, so that the autotuner timed
    each layer's tactics on NCHW inputs (a layout copy in every call) while FP8's were
    channels-last."""
    w = held_conv.hold_weight(w)
    if isinstance(w, torch.Tensor) and w.ndim == 4 and w.dtype in (torch.int8, torch.uint8):
        return w.contiguous(memory_format=torch.channels_last)
    return w


def _image(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim == 4 and t.is_floating_point()


# torch.cuda._sleep spins for a number of GPU clock cycles: about 2e9 a second on an H100/H200
# (a slower clock holds longer, which only slows the profiling runs); at most 50 ms a run
_SPIN_CYCLES_PER_S = 2.0e9
_MAX_HOLD_S = 0.05


class CudaEventLayerTimer(LayerTimer):
    """A pair of CUDA events recorded on the current stream around each layer; nothing waits
    until :meth:`collect`.

    Event times include any wait of the GPU for the host to launch a layer's kernels, and at
    batch 1 that wait is most of them (each layer done before the host queued the next). So each
    run starts by holding the GPU in a spin kernel for 1.5x the host time the previous run took
    to queue its layers (``lead``, shared by the runs of one backend; none before the first):
    the host queues the whole run meanwhile and the GPU then runs the layers back to back, as a
    CUDA graph replays them, and each layer's events measure its kernels."""

    __slots__ = ("_lead", "_marks", "_t0")

    def __init__(self, lead: list[float] | None = None) -> None:
        self._marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event | None]] = []
        self._lead = lead if lead is not None else [0.0]
        self._t0 = 0.0

    def start(self) -> None:
        if not self._marks:  # the run's first layer
            self._t0 = time.perf_counter()
            hold = min(1.5 * self._lead[0], _MAX_HOLD_S)
            if hold > 0 and hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(int(hold * _SPIN_CYCLES_PER_S))
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks.append(("", event, None))

    def stop(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        _, begin, _ = self._marks[-1]
        self._marks[-1] = (name, begin, event)

    def collect(self, times: dict[str, float]) -> None:
        if not self._marks:
            return
        self._lead[0] = time.perf_counter() - self._t0  # (the host's time to queue the run)
        last = self._marks[-1][2]
        if last is not None:
            last.synchronize()
        for name, begin, end in self._marks:
            if end is not None:
                times[name] = times.get(name, 0.0) + begin.elapsed_time(end) / 1e3
        self._marks.clear()


def make(device: Any = None) -> CudaBackend:
    """The cuda backend on ``device`` (None: the current CUDA device; 'cpu' runs its kernels on
    CPU tensors, for tests)."""
    if device is None:
        if not torch.cuda.is_available():
            raise TensorkilnError(
                "the cuda backend needs a CUDA device and this machine has none (torch "
                f"{torch.__version__}); use the reference backend"
            )
        device = "cuda"
    return CudaBackend(torch.device(device))
