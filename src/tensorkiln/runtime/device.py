"""Running a cuda engine: input binding (numpy, torch, DLPack), one stream per context, and
whole-engine CUDA graphs captured per input shape.

Inputs given as numpy arrays are copied to the device and the outputs come back as numpy arrays;
inputs given as torch tensors on the engine's device (or any DLPack producer) are used in place and
the outputs are torch tensors. Callers may pass their own output tensors to be written.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorkiln.backends import Backend
from tensorkiln.errors import InputError
from tensorkiln.ir import Graph, TensorType, Value
from tensorkiln.kernels.common.packing import bucket, kept, tokens_hint
from tensorkiln.runtime.io import _check_shape, bind_inputs


def bind_device_inputs(
    graph: Graph, feeds: Mapping[str, Any], backend: Backend
) -> tuple[dict[Value, Any], bool]:
    """Check ``feeds`` against the graph's inputs; returns (value -> tensor-or-array, whether the
    caller gave tensors, in which case outputs are returned as tensors)."""
    if not isinstance(feeds, Mapping):
        raise InputError(f"inputs must be a dict of name -> array, got {type(feeds).__name__}")
    tensors = {k: _as_tensor(k, x) for k, x in feeds.items() if _is_tensor_like(x)}
    if not tensors:
        return bind_inputs(graph, feeds), False
    expected = {v.name: v for v in graph.inputs}
    host = {k: x for k, x in feeds.items() if k not in tensors}
    host.update({k: _placeholder(expected.get(k), t, backend) for k, t in tensors.items()})
    bound = bind_inputs(graph, host)  # names, dtypes and shapes checked once, the same way
    symbols: dict = {}
    for v in graph.inputs:
        t = tensors.get(v.name)
        if t is None:
            continue
        if t.device != backend.device:
            t = t.to(backend.device)
        if isinstance(v.type, TensorType) and v.type.shape is not None:
            _check_shape(v.name, v.type.shape, tuple(t.shape), symbols)
        bound[v] = t
    return bound, True


def _is_tensor_like(x: Any) -> bool:
    import torch  # lazy: torch is optional (a backend on a device has it)

    return isinstance(x, torch.Tensor) or (
        not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__")
    )


def _as_tensor(name: str, x: Any) -> Any:
    import torch  # lazy: torch is optional (a backend on a device has it)

    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.from_dlpack(x)
    except Exception as exc:
        raise InputError(f"input '{name}': cannot take it through DLPack ({exc})") from None


def _placeholder(v: Value | None, t: Any, backend: Backend) -> np.ndarray:
    """A zero-stride numpy stand-in with ``t``'s dtype and shape, for the shared checks."""
    try:
        dt = backend.host_dtype(t.dtype)
    except KeyError:
        want = v.dtype.name if v is not None and v.dtype is not None else "?"
        raise InputError(
            f"input '{v.name if v else '?'}' expects dtype {want}, got torch {t.dtype}"
        ) from None
    return np.lib.stride_tricks.as_strided(
        np.zeros(1, dt), shape=tuple(t.shape), strides=(0,) * t.dim()
    )


def write_outputs(results: dict[str, Any], outputs: Mapping[str, Any]) -> None:
    """Copy results into caller-supplied output tensors (same shape and dtype)."""
    for name, buf in outputs.items():
        if name not in results:
            raise InputError(
                f"output buffer for '{name}', which is not an output; outputs are "
                f"{', '.join(map(repr, results))}"
            )
        r = results[name]
        if tuple(buf.shape) != tuple(r.shape) or buf.dtype != r.dtype:
            raise InputError(
                f"output buffer '{name}' is {buf.dtype}{list(buf.shape)}; the output is "
                f"{r.dtype}{list(r.shape)}"
            )
        buf.copy_(r)


# Held while a context queues work on the GPU, and while a CUDA graph is captured. torch hands
# out streams from a small fixed pool, so two contexts may share a CUDA stream, and work another
# thread queued on the stream being captured would land in (or break) the capture. Queueing is
# Python work serialized by the GIL anyway; the lock makes captures exclusive at little cost.
ENQUEUE_LOCK = threading.RLock()


class GraphRunner:
    """Whole-engine CUDA graphs, one per set of input shapes, replayed on later calls.

    The first call with new shapes runs the engine twice to warm up (kernel compilation and
    autotuning caches), then captures a third run into a graph whose inputs and outputs are fixed
    tensors. Later calls copy the inputs into place and replay. An engine that cannot be captured
    (a layer reads device values on the host, say) runs eagerly, with one warning.

    An engine that removes padding (passes/remove_padding.py) runs on about as many rows as its
    mask input keeps (``tokens``: its position among the inputs, and PackIndex's ``padding``).
    The count is read back before each call (one synchronization; a caller that counted a host
    mask passes it), rounded up to one of 32 packed lengths per input shape
    (:func:`~tensorkiln.kernels.common.packing.bucket`), and graphs are captured per length too;
    the capture's PackIndex takes the length from
    :func:`~tensorkiln.kernels.common.packing.tokens_hint`. The graphs of one input shape share
    their input tensors, so that a call queues the copies into them and the count before it
    waits for the count: after the wait only the replay is left to launch, and the GPU idles for
    the time the host takes to wake and launch it, not for the whole call's host work.
    """

    def __init__(self, run: Any, backend: Backend, tokens: tuple[int, int] | None = None) -> None:
        import torch

        self._run = run  # inputs (list of tensors) -> outputs (list)
        self.tokens = tokens
        self._device = backend.device
        self._graphs: dict[tuple, Any] = {}
        # padding removal: the input tensors the graphs of each input shape share, and the host
        # side of the token count's read-back (pinned, made on the first packed call)
        self._shared: dict[tuple, list[Any]] = {}
        self._count: tuple[Any, Any] | None = None
        # the graphs' memory: a MemPool, which device_memory_bytes() can measure, where torch has it
        # (recycled, never destroyed: see backends/pools.py)
        self.pool, self._stream = backend.acquire_pool("graphs")  # (captures run on the stream)
        weakref.finalize(self, backend.release_pool, self.pool, self._stream, "graphs")
        self._pool_id = self.pool.id if self.pool is not None else torch.cuda.graph_pool_handle()
        self.eager_reason: str | None = None

    def __call__(self, inputs: list[Any], count: int | None = None) -> list[Any]:
        """Replay (or capture) the graph for ``inputs``; ``count``: the tokens the mask keeps,
        where the caller knows it (else read back from the mask)."""
        import torch

        if self.eager_reason is not None or not all(isinstance(x, torch.Tensor) for x in inputs):
            return self._run(inputs)  # (with the caller's tokens_hint, if any)
        if self.tokens is not None:
            return self._call_packed(inputs, count)
        key = shapes_key(inputs)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(inputs)
            if entry is None:
                return self._run(inputs)
            self._graphs[key] = entry
        return self.replay(entry, inputs)

    def _call_packed(self, inputs: list[Any], count: int | None) -> list[Any]:
        """__call__ for an engine that removes padding: stage the inputs in the shape's shared
        tensors, count, and replay the graph of that packed length (captured on first use)."""
        sig = shapes_key(inputs)
        shared = self._shared.get(sig)
        if shared is None:  # the first call with these shapes: its capture makes the tensors
            rows = self._rows(inputs[self.tokens[0]], count)  # type: ignore[index]
            with tokens_hint(rows):
                entry = self._capture(inputs)
            if entry is None:
                return self._run(inputs)
            self._shared[sig] = entry[1]
            self._graphs[(*sig, rows)] = entry
            return self.replay(entry, inputs)
        rows = self.stage(shared, inputs, count)
        entry = self._graphs.get((*sig, rows))
        if entry is None:
            with tokens_hint(rows):
                entry = self._capture(shared, shared=True)
            if entry is None:
                return self._run(inputs)
            self._graphs[(*sig, rows)] = entry
        return self.replay(entry, None)

    def replay_packed(self, inputs: list[Any]) -> list[Any] | None:
        """Replay for an engine that removes padding, where the graph for the inputs' shapes and
        packed length is captured already; None (nothing replayed) where it is not."""
        sig = shapes_key(inputs)
        shared = self._shared.get(sig)
        if shared is None or self.eager_reason is not None:
            return None
        entry = self._graphs.get((*sig, self.stage(shared, inputs)))
        return None if entry is None else self.replay(entry, None)

    def stage(self, shared: list[Any], inputs: list[Any], count: int | None = None) -> int:
        """Copy ``inputs`` into ``shared`` on the current stream and return the packed length:
        ``count`` rounded up, or the shared mask's count, read back after the copies are queued
        (the one synchronization of a call)."""
        for s, x in zip(shared, inputs):
            s.copy_(x)
        return self._rows(shared[self.tokens[0]], count)  # type: ignore[index]

    def _rows(self, mask: Any, count: int | None) -> int:
        """The packed length for ``mask``: ``count`` (or the tokens the mask keeps, read back
        into pinned memory: one synchronization) rounded up (kernels/common/packing.bucket)."""
        import torch

        if count is None:
            if self._count is None:
                self._count = (
                    torch.empty((), dtype=torch.int64, pin_memory=True),
                    torch.cuda.Event(),
                )
            host, done = self._count
            host.copy_(torch.count_nonzero(mask), non_blocking=True)
            done.record()
            done.synchronize()
            count = kept(int(host), mask.numel(), self.tokens[1])  # type: ignore[index]
        return bucket(count, mask.numel())

    def entry_for(self, inputs: list[Any]) -> tuple | None:
        """The captured graph for inputs of these shapes and dtypes (None: not captured; an
        engine that removes padding has one per packed length, found by replay_packed)."""
        if self.eager_reason is not None:
            return None
        return self._graphs.get(shapes_key(inputs))

    @staticmethod
    def replay(entry: tuple, inputs: list[Any] | None) -> list[Any]:
        """Copy ``inputs`` into the captured graph ``entry``'s inputs (None: staged already),
        replay it on the current stream, and return copies of its outputs."""
        import torch

        graph, static_in, static_out = entry
        for s, x in zip(static_in, inputs or ()):
            s.copy_(x)
        graph.replay()
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in static_out]

    def _capture(self, inputs: list[Any], shared: bool = False) -> tuple | None:
        """Warm up and capture a graph; its inputs are copies of ``inputs``, or with ``shared``
        ``inputs`` themselves (the tensors another graph of the same shapes reads)."""
        import torch

        # Normal tensors even when the first call comes under torch.inference_mode: later calls
        # outside it copy into them, and PyTorch refuses in-place writes to inference tensors there.
        with torch.inference_mode(False):
            static_in = list(inputs) if shared else [x.clone() for x in inputs]
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        try:
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run(static_in)
            torch.cuda.current_stream(self._device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # One capture at a time, with no other context queueing work (ENQUEUE_LOCK), and in
            # thread-local mode, so that other threads' host calls do not break it.
            with (
                ENQUEUE_LOCK,
                torch.cuda.graph(
                    graph,
                    pool=self._pool_id,
                    stream=self._stream,
                    capture_error_mode="thread_local",
                ),
            ):
                static_out = self._run(static_in)
        except Exception as exc:  # not capturable: run eagerly from now on
            torch.cuda.synchronize(self._device)
            self.eager_reason = f"{type(exc).__name__}: {str(exc)[:300]}"
            warnings.warn(
                f"the engine cannot run as a CUDA graph ({self.eager_reason}); running it "
                "layer by layer",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        return graph, static_in, static_out


def shapes_key(inputs: list[Any]) -> tuple:
    """The inputs' shapes and dtypes (what a captured graph, and a run's speed, depend on),
    hashable."""
    return tuple(
        (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else type(x).__name__ for x in inputs
    )
