"""The Backend seam: what the runtime, the engine, the autotuner and the builder ask of a backend.

A backend is an object (Polygraphy's runners, onnxruntime's execution providers): code above this
package asks it to move values, hold constants, open a scope, synchronize or measure memory, and
reads its capabilities; it never branches on a backend's name. The name stays in files, configs
and messages only.
"""

from __future__ import annotations

import contextlib
import os
import time
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from tensorkiln.kernels.registry import KERNELS_OF


class Backend(ABC):
    """One backend on one device. Subclasses set the name, the device and the capabilities."""

    name: str = ""  # what engine files, configs and messages call it
    device: Any = None  # the torch device its values live on; None: numpy arrays on the host

    # capabilities (class attributes; a subclass overrides what it has)
    on_device: bool = False  # values are device tensors: inputs and constants are uploaded
    streams: bool = False  # its own streams, memory pools and CUDA events (a GPU)
    cuda_graphs: bool = False  # whole-engine CUDA graph capture and replay
    host_mirror: bool = False  # small shape values mirrored on the host (no device sync)
    keeps_shape_values: bool = False  # values that follow from input shapes kept per shape
    math_modes: bool = False  # TF32 and reduced-precision switches apply (runtime/mathmode.py)
    autotunes: bool = False  # layers have tactic candidates that the builder times
    specializes: bool = False  # kernels' shape-specialized functions are kept per layer
    holds_weights: bool = False  # convolution weights held channels-last, prepacked
    thread_tuning: bool = False  # the thread count is measured per set of input shapes
    compiles: bool = False  # the opt-in torch.compile path (runtime/cpu_compile.py)

    def plain(self) -> Backend:
        """This backend on its kernels' plain route: weights as they are, no shape-specialized
        functions (what torch.compile traces); itself where it has no other route."""
        return self

    @property
    def kernels(self) -> str:
        """The kernel registry key this backend runs (cpu runs the cuda tree's torch kernels)."""
        return KERNELS_OF.get(self.name, self.name)

    # ------------------------------------------------------------------ values
    @abstractmethod
    def to_device(self, value: Any, *, channels_last: bool = False, held: bool = False) -> Any:
        """A host value (numpy array, list of them) as this backend's kernels take it.
        ``channels_last``: the value is read only by convolutions that take that layout.
        ``held``: the caller leaves ``value`` unchanged until the run's results are back on the
        host, so a backend may read it where it lies (no staging copy)."""

    @abstractmethod
    def to_host(self, value: Any) -> Any:
        """A value of this backend as numpy (lists of values element-wise)."""

    @abstractmethod
    def constant(self, array: np.ndarray, *, conv_weight: bool = False) -> Any:
        """An initializer uploaded once (``conv_weight``: held as the convolutions run it)."""

    def device_dtype(self, dtype: Any) -> Any:
        """This backend's dtype for a numpy dtype (or its name); TypeError when it has none."""
        return np.dtype(dtype)

    def host_dtype(self, dtype: Any) -> np.dtype:
        """The numpy dtype of one of this backend's dtypes; KeyError when it has none."""
        return np.dtype(dtype)

    # ------------------------------------------------------------------ host mirror
    def mirrorable(self, value: Any) -> bool:
        """Whether ``value`` is small enough, and not yet known, to be mirrored on the host."""
        return False

    def known_on_host(self, value: Any) -> np.ndarray | None:
        """The host copy of ``value``'s values, when this backend keeps one."""
        return None

    def remember_on_host(self, value: Any, array: np.ndarray) -> None:
        """Attach ``array`` (the values of ``value``) as its host copy."""
        return None

    def unchanging(self, value: Any) -> None:
        """Mark ``value`` as never written from now on (the executor keeps it per input shapes),
        so that kernels may keep what they prepare from it, as from a constant."""
        return None

    # ------------------------------------------------------------------ scopes
    def scope(self) -> AbstractContextManager[Any]:
        """Entered around a run: the device new tensors are made on."""
        return contextlib.nullcontext()

    def inference(self) -> AbstractContextManager[Any]:
        """Entered around a run: no autograd bookkeeping."""
        return contextlib.nullcontext()

    def capturing(self) -> bool:
        """Whether the work queued now is being captured into a CUDA graph (kernels run then
        only when the graph is replayed)."""
        return False

    def prepare(self) -> None:
        """Process-wide setup before a context of this backend first runs (allocator, ...)."""
        return None

    def acquire_pool(self, kind: str = "activations") -> tuple[Any, Any]:
        """A (memory pool, stream) pair for one context's ``kind`` of memory, on a backend with
        streams; its memory is recycled, never destroyed (:meth:`release_pool` gives it back)."""
        raise NotImplementedError(f"the {self.name} backend has no streams or memory pools")

    def release_pool(self, pool: Any, stream: Any, kind: str = "activations") -> None:
        """Give back a pair from :meth:`acquire_pool` once its context is gone."""
        raise NotImplementedError(f"the {self.name} backend has no streams or memory pools")

    def synchronize(self) -> None:
        """Wait for the work queued on the device (a no-op on the host)."""
        return None

    def layer_timer(self) -> LayerTimer:
        """A timer of one run's layers as this backend runs them: the host clock around each
        layer (after waiting for queued work) by default; CUDA events on a GPU."""
        return HostLayerTimer(self)

    # ------------------------------------------------------------------ memory and target
    def memory_limit(self) -> tuple[int | None, str]:
        """(bytes a context may plan for, what that bound is); None: unknown."""
        return host_memory()

    def allocated(self) -> int:
        """Bytes of device memory this process holds (0 on the host)."""
        return 0

    @abstractmethod
    def target(self) -> dict[str, Any]:
        """What an engine for this backend is bound to on this machine (recorded in the file)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device!r})"


class LayerTimer:
    """Times the layers of one run: ``start()`` before a layer, ``stop(name)`` after it, then
    ``collect(times)`` adds each layer's seconds to ``times`` under its name."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, name: str) -> None:
        raise NotImplementedError

    def collect(self, times: dict[str, float]) -> None:
        raise NotImplementedError


class HostLayerTimer(LayerTimer):
    """The host clock around each layer, the backend's queued work waited for on both sides."""

    __slots__ = ("_backend", "_t0", "_times")

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._t0 = 0.0
        self._times: dict[str, float] = {}

    def start(self) -> None:
        self._backend.synchronize()
        self._t0 = time.perf_counter()

    def stop(self, name: str) -> None:
        self._backend.synchronize()
        self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - self._t0

    def collect(self, times: dict[str, float]) -> None:
        for name, secs in self._times.items():
            times[name] = times.get(name, 0.0) + secs
        self._times.clear()


def host_memory() -> tuple[int | None, str]:
    """This machine's memory, the bound of a context that runs on the CPU."""
    try:  # (POSIX; elsewhere no bound is known)
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of this machine's memory"
    except (AttributeError, ValueError, OSError):
        return None, ""
