"""ExecutionContext: one stream of inference on an engine, with its own activation memory.

Several contexts can run the same engine from different threads at once: each has its own executor
state, the engine's graph and weights are only read. One context may also be shared by threads:
what a call leaves behind for the next (input shapes set, the last call's timings) is kept per
thread, so one thread never reads another's.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorkiln.backends import Backend
from tensorkiln.errors import EngineCompatibilityError, InputError
from tensorkiln.ir import Graph
from tensorkiln.kernels.common.packing import kept, tokens_hint
from tensorkiln.kernels.evaluate import infer_at_shapes
from tensorkiln.kernels.tactics import tactic_functions
from tensorkiln.runtime import cpu_compile
from tensorkiln.runtime.cpu_threads import ThreadChoice
from tensorkiln.runtime.device import (
    ENQUEUE_LOCK,
    GraphRunner,
    bind_device_inputs,
    shapes_key,
    write_outputs,
)
from tensorkiln.runtime.executor import Executor, Observer
from tensorkiln.runtime.io import bind_inputs
from tensorkiln.runtime.mathmode import math_mode


class ExecutionContext:
    """Runs an engine: ``with engine.create_execution_context() as ctx: ctx.infer(feeds)``.

    Threads: a context may be used by several threads. :meth:`infer` is safe to call from any
    of them at once (on the GPU, calls on one context run in turn on its stream: for work that
    overlaps, create one context per thread, as TensorRT requires). The state a call leaves for
    later calls is kept per thread: the shapes set with :meth:`set_input_shape` (and so what
    :meth:`get_tensor_shape` answers), :attr:`last_compute_s` and :attr:`last_gpu_s`. A thread
    sees only the shapes it set itself, never another thread's.
    """

    def __init__(
        self,
        engine: Any,
        profile_index: int = 0,
        *,
        use_cuda_graph: bool = False,
        compile: bool | None = None,
    ) -> None:
        if engine.profiles and not 0 <= profile_index < len(engine.profiles):
            raise InputError(
                f"profile index {profile_index} is out of range; the engine has "
                f"{len(engine.profiles)} profile(s)"
            )
        self.engine = engine
        self.profile_index = profile_index
        self.profile = engine.profiles[profile_index] if engine.profiles else None
        self.backend: Backend = engine.runtime_backend
        backend = self.backend
        self._executor = _executor(engine, "graph" if use_cuda_graph else "eager")
        self.precision = engine.build.get("precision", "fp32")
        self._stream = None
        self._graphs = None
        self._pool = None
        # a backend whose thread count is measured per set of input shapes (cpu_threads.py)
        self._threads = ThreadChoice() if backend.thread_tuning else None
        backend.prepare()
        # padding removal's mask input and PackIndex's polarity (None: the engine packs nothing)
        self._tokens = _token_mask(engine.graph)
        self._compiled = _compiled_runs(engine, backend, compile, packs=self._tokens is not None)
        # per thread: input shapes set, the last call's compute time and CUDA events
        self._local = threading.local()
        if backend.on_device and not backend.streams:  # torch CPU tensors: nothing is reserved
            _check_fits(engine.memory, backend, held=0)
        if backend.streams:
            # The context's activations come from its own memory pool, on the pool's own stream
            # (CUDA graphs capture into a pool of their own). The memory plan is reserved in the
            # pool before the first run (see _reserve); device_memory_bytes() shows what a run
            # needed beyond it. Pools are recycled, never destroyed (see backends/pools.py).
            self._pool, self._stream = backend.acquire_pool("activations")
            weakref.finalize(self, backend.release_pool, self._pool, self._stream, "activations")
            # before anything is allocated; a recycled pool's memory counts as available
            _check_fits(engine.memory, backend, held=self.device_memory_bytes())
            # the weights go to the device once per engine, outside any context's pool: every
            # context of the engine reads the same tensors
            self._executor.upload_weights()
            if not (use_cuda_graph and backend.cuda_graphs):
                self._reserve(engine.memory)
            else:  # (a graph's activations are in its own pool, taken at capture)
                # (the runner must not hold the context: a cycle would leave a dropped context's
                # graphs and memory to the garbage collector, on whichever thread it runs)
                executor, graph_inputs = self._executor, engine.graph.inputs
                self._graphs = GraphRunner(
                    lambda inputs: executor.run(dict(zip(graph_inputs, inputs))),
                    backend,
                    self._tokens,
                )
        # output shapes per set of input shapes: the same for every thread (a race only
        # computes an entry twice)
        self._out_cache: dict[tuple, dict[str, tuple[int, ...] | None]] = {}
        # CUDA graphs: feeds already checked once (names, shapes, dtypes, device) -> the graph
        # input order and the captured graph, for calls that only replay (see _replay_known)
        self._known_feeds: dict[tuple, tuple[tuple[str, ...], tuple]] = {}
        # the same for numpy feeds (names, shapes, dtypes) -> graph input order and graph
        # (see _replay_known_host)
        self._known_host: dict[tuple, tuple[tuple[str, ...], tuple]] = {}

    # -------------------------------------------------------------- per-thread state
    @property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """The input shapes this thread has set."""
        shapes = getattr(self._local, "shapes", None)
        if shapes is None:
            shapes = self._local.shapes = {}
        return shapes

    @property
    def last_compute_s(self) -> float:
        """Seconds this thread's last :meth:`infer` spent running layers (0.0 before one)."""
        return getattr(self._local, "compute_s", 0.0)

    @last_compute_s.setter
    def last_compute_s(self, seconds: float) -> None:
        self._local.compute_s = seconds

    def _thread_events(self) -> tuple[Any, Any]:
        """This thread's pair of CUDA timing events (made on its first call)."""
        events = getattr(self._local, "events", None)
        if events is None:
            import torch  # lazy: torch is optional (only a GPU backend times with events)

            events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._local.events = events
        return events

    # -------------------------------------------------------------- shapes
    def set_input_shape(self, name: str, shape: Any) -> None:
        """Declare the shape of input ``name`` for the next runs; checked against the profile."""
        spec = {s.name: s for s in self.engine.inputs}.get(name)
        if spec is None:
            raise InputError(
                f"unknown input '{name}'; the engine's inputs are "
                f"{', '.join(repr(s.name) for s in self.engine.inputs)}"
            )
        shape = tuple(int(d) for d in shape)
        self._check_shape(name, spec.shape, shape)
        self._shapes[name] = shape

    def _check_shape(self, name: str, declared: Any, shape: tuple[int, ...]) -> None:
        if declared is not None:
            if len(declared) != len(shape):
                raise InputError(
                    f"input '{name}' has rank {len(declared)}, got shape {list(shape)}"
                )
            for axis, (d, s) in enumerate(zip(declared, shape)):
                if isinstance(d, int) and d != s:
                    raise InputError(
                        f"input '{name}' axis {axis} is fixed at {d}, got shape {list(shape)}"
                    )
        if self.profile is not None and name in self.profile.shapes:
            lo, _, hi = self.profile.shapes[name]
            if len(lo) != len(shape) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
                raise InputError(
                    f"input '{name}' shape {list(shape)} is outside optimization profile "
                    f"{self.profile_index}: min {list(lo)}, max {list(hi)}. Rebuild the engine with "
                    "a profile that covers it (--min-shapes/--max-shapes)."
                )

    def get_tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of an input (as set) or of an output (inferred from the inputs' shapes).

        An output whose size depends on input values (NonZero, ...) has -1 in those axes.
        """
        if name in self._shapes:
            return self._shapes[name]
        spec = {s.name: s for s in self.engine.inputs}.get(name)
        if (
            spec is not None
            and spec.shape is not None
            and all(isinstance(d, int) for d in spec.shape)
        ):
            return tuple(spec.shape)  # a fixed input needs no set_input_shape
        outputs = self._output_shapes()
        if name not in outputs:
            raise InputError(f"'{name}' is not an input or output of this engine")
        return outputs[name]

    def _output_shapes(self) -> dict[str, tuple[int, ...] | None]:
        missing = [s.name for s in self.engine.inputs if s.name not in self._shapes]
        fixed = {
            s.name: s.shape
            for s in self.engine.inputs
            if s.name in missing
            and s.shape is not None
            and all(isinstance(d, int) for d in s.shape)
        }
        still = [m for m in missing if m not in fixed]
        if still:
            raise InputError(
                f"set the shape of input(s) {', '.join(still)} first (set_input_shape; shapes "
                "are kept per thread, so set them in the thread that asks)"
            )
        shapes = {**fixed, **self._shapes}
        key = tuple(sorted(shapes.items()))
        if key not in self._out_cache:
            self._out_cache[key] = _infer_output_shapes(self.engine.graph, shapes)
        return self._out_cache[key]

    # -------------------------------------------------------------- running
    def infer(
        self,
        feeds: Mapping[str, Any],
        *,
        layer_times: dict[str, float] | None = None,
        outputs: Mapping[str, Any] | None = None,
        observer: Observer | None = None,
    ) -> dict[str, Any]:
        """Run on ``feeds`` (name -> array); returns output name -> array.

        On the cuda backend, numpy inputs are copied to the GPU and numpy arrays come back;
        torch tensors (or DLPack producers) are used in place and torch tensors come back.
        ``outputs`` (name -> torch tensor) are written with the results as well.
        ``layer_times``, when given, receives each layer's seconds (added up over calls).
        :attr:`last_compute_s` holds the time this thread's last call spent running layers, the
        rest of the call being host-side work (input checks, output gathering).
        ``observer(node, outputs)``, when given, sees every layer's outputs as they are produced
        (as the backend holds them: ``ctx.backend.to_host`` copies them to numpy); such a call
        runs layer by layer (no CUDA graph, no compiled program).
        """
        if self.backend.on_device:
            if self._known_feeds and layer_times is None and observer is None and not outputs:
                named = self._replay_known(feeds)
                if named is not None:
                    return named
            if self._known_host and layer_times is None and observer is None and not outputs:
                named = self._replay_known_host(feeds)
                if named is not None:
                    return named
            return self._infer_device(feeds, layer_times, outputs, observer)
        bound = bind_inputs(self.engine.graph, feeds)
        for v, arr in bound.items():
            if isinstance(arr, np.ndarray):
                self._check_shape(v.name, v.shape, arr.shape)
        t0 = time.perf_counter()
        results = self._executor.run(bound, layer_times, observer)
        self.last_compute_s = time.perf_counter() - t0
        return {v.name: r for v, r in zip(self.engine.graph.outputs, results)}

    def _infer_device(self, feeds, layer_times, outputs, observer) -> dict[str, Any]:
        import contextlib

        import torch  # lazy: torch is optional (a backend on a device has it)

        backend = self.backend
        graph = self.engine.graph
        bound, as_tensors = bind_device_inputs(graph, feeds, backend)
        for v, arr in bound.items():
            if hasattr(arr, "shape"):
                self._check_shape(v.name, v.shape, tuple(arr.shape))
        t0 = time.perf_counter()
        stream = self._stream
        events = self._thread_events() if stream is not None else ()
        caller = torch.cuda.current_stream(stream.device) if stream is not None else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        plain = layer_times is None and observer is None  # (else: layer by layer)
        use_graph = self._graphs is not None and plain
        pool = (
            torch.cuda.use_mem_pool(self._pool)
            if self._pool is not None and not use_graph
            else contextlib.nullcontext()
        )
        # (a backend without CUDA math has no TF32 or Triton dots to set)
        mode = math_mode(self.precision) if backend.math_modes else contextlib.nullcontext()
        # padding removal: a mask given on the host is counted there, with no read-back (every
        # run below takes it; a CUDA graph's capture sets its own, rounded up)
        count = self._host_count(bound)
        with ENQUEUE_LOCK, mode, backend.inference(), ctx, pool, tokens_hint(count):
            if stream is not None:
                stream.wait_stream(caller)
            # (numpy in, numpy out: the call returns after the results are read back, so the
            # caller's arrays are held unchanged until the device has read them)
            held = not as_tensors
            inputs = [self._executor.upload_input(v, bound[v], held) for v in graph.inputs]
            if stream is not None:
                for x in inputs:  # the caller may free its tensors before this stream is done
                    if isinstance(x, torch.Tensor) and x.is_cuda:
                        x.record_stream(stream)
                events[0].record(stream)  # after the uploads: layers only
            if use_graph:
                results = self._graphs(inputs, count)
            elif self._compiled is not None and plain:
                key = shapes_key(inputs)
                results = self._threads.run(
                    key,
                    lambda: self._compiled.run(
                        key, inputs, lambda: self._executor.run(dict(zip(graph.inputs, inputs)))
                    ),
                )
            elif self._threads is not None and plain:
                results = self._threads.run(
                    shapes_key(inputs),
                    lambda: self._executor.run(dict(zip(graph.inputs, inputs))),
                )
            else:
                results = self._executor.run(dict(zip(graph.inputs, inputs)), layer_times, observer)
            if stream is not None:
                events[1].record(stream)
                self._local.timed = events
            named = {v.name: r for v, r in zip(graph.outputs, results)}
            if outputs:
                write_outputs(named, outputs)
        if stream is not None:
            caller.wait_stream(stream)
            for r in results:  # tell the allocator these tensors are used on the caller's stream
                if isinstance(r, torch.Tensor) and r.is_cuda:
                    r.record_stream(caller)
        if not as_tensors:
            named = {k: backend.to_host(r) for k, r in named.items()}
            if use_graph and not outputs and count is None:
                self._remember_host(feeds, inputs)
        elif use_graph and not outputs:
            self._remember_feeds(feeds, inputs)
        self.last_compute_s = time.perf_counter() - t0
        return named

    # A batch-1 call replays a graph of a few hundred microseconds: the checks, binding and mode
    # switches of _infer_device cost as much again on the host. Feeds whose names, shapes, dtypes
    # and device a call has already checked (device tensors, nothing else) skip straight to the
    # replay; the first call with any new feed signature takes the full path.
    _KNOWN_FEEDS_MAX = 64

    def _host_count(self, bound: Mapping[Any, Any]) -> int | None:
        """The tokens a PackIndex layer keeps, where its mask is a host array (else None)."""
        if self._tokens is None:
            return None
        index, padding = self._tokens
        mask = bound.get(self.engine.graph.inputs[index])
        if not isinstance(mask, np.ndarray):
            return None
        return kept(int(np.count_nonzero(mask)), mask.size, padding)

    def _remember_feeds(self, feeds: Mapping[str, Any], inputs: list[Any]) -> None:
        sig = _feed_signature(feeds)
        if sig is None or len(self._known_feeds) >= self._KNOWN_FEEDS_MAX:
            return
        if self._tokens is not None:
            # padding removal: the graph depends on the mask's count too, so the entry is looked
            # up on every call (GraphRunner.replay_packed)
            entry = None
        else:
            entry = self._graphs.entry_for(inputs)
            if entry is None:
                return
        order = tuple(v.name for v in self.engine.graph.inputs)
        if set(order) != set(feeds) or len(order) != len(inputs):
            return
        # (a feed the full path moved to another device is not one to replay from)
        if all(feeds[name].device == x.device for name, x in zip(order, inputs)):
            self._known_feeds[sig] = (order, entry)

    def _replay_known(self, feeds: Mapping[str, Any]) -> dict[str, Any] | None:
        """The outputs of replaying the graph captured for feeds like these (tensors on the
        device, checked by an earlier call), or None when the feeds are not known."""
        import torch  # lazy: torch is optional (only a GPU backend replays graphs)

        sig = _feed_signature(feeds)
        known = self._known_feeds.get(sig) if sig is not None else None
        if known is None:
            return None
        order, entry = known
        inputs = [feeds[name] for name in order]
        stream = self._stream
        events = self._thread_events()
        handoff = self._handoff_events()
        caller = torch.cuda.current_stream(stream.device_index)
        t0 = time.perf_counter()
        # (the stream switch and hand-off as plain calls on events made once per thread: the
        # context-manager and wait_stream forms query devices and make events on every call)
        with ENQUEUE_LOCK, self.backend.inference():
            handoff[0].record(caller)
            stream.wait_event(handoff[0])
            torch.cuda.set_stream(stream)
            try:
                for x in inputs:  # the caller may free its tensors before this stream is done
                    x.record_stream(stream)
                events[0].record(stream)
                if entry is None:  # padding removal: the graph for the mask's count, if captured
                    results = self._graphs.replay_packed(inputs)
                else:
                    results = self._graphs.replay(entry, inputs)
                events[1].record(stream)
            finally:
                torch.cuda.set_stream(caller)
            self._local.timed = events
            handoff[1].record(stream)
            caller.wait_event(handoff[1])
        if results is None:  # (a packed length not captured yet: the full path captures it)
            return None
        for r in results:
            if isinstance(r, torch.Tensor) and r.is_cuda:
                r.record_stream(caller)
        self.last_compute_s = time.perf_counter() - t0
        return {v.name: r for v, r in zip(self.engine.graph.outputs, results)}

    # numpy in, numpy out: the full path uploads each input into a fresh device tensor (via a
    # fresh page-locked copy), converts its layout, copies it into the graph's input, replays,
    # clones the outputs and reads them back with a synchronous copy, under the full path's
    # checks and mode switches: twice the host time of a batch-1 replay. Known host feeds go
    # through this thread's page-locked buffers straight into the graph's inputs, and the
    # graph's outputs straight into page-locked memory.
    def _remember_host(self, feeds: Mapping[str, Any], inputs: list[Any]) -> None:
        import torch  # lazy: torch is optional (only a GPU backend replays graphs)

        sig = _feed_signature(feeds, host=True)
        if (
            sig is None
            or self._tokens is not None
            or len(self._known_host) >= self._KNOWN_FEEDS_MAX
        ):
            return
        entry = self._graphs.entry_for(inputs)
        order = tuple(v.name for v in self.engine.graph.inputs)
        if entry is None or set(order) != set(feeds) or len(order) != len(entry[1]):
            return
        _, static_in, static_out = entry
        for name, s in zip(order, static_in):
            a = feeds[name]
            # (only inputs the upload moved as they are: no cast, no reshape)
            if not isinstance(s, torch.Tensor) or tuple(s.shape) != a.shape:
                return
            try:
                if self.backend.host_dtype(s.dtype) != a.dtype:
                    return
            except (KeyError, TypeError):
                return
        if not all(isinstance(o, torch.Tensor) and o.is_cuda for o in static_out):
            return
        self._known_host[sig] = (order, entry)

    def _replay_known_host(self, feeds: Mapping[str, Any]) -> dict[str, Any] | None:
        """The outputs (numpy) of replaying the graph captured for numpy feeds like these (names,
        shapes, dtypes checked by an earlier call), or None when the feeds are not known."""
        import torch  # lazy: torch is optional (only a GPU backend replays graphs)

        sig = _feed_signature(feeds, host=True)
        known = self._known_host.get(sig) if sig is not None else None
        if known is None:
            return None
        order, (graph, static_in, static_out) = known
        buffers = self._host_buffers()
        done = buffers.done
        done.synchronize()  # (this thread's buffers are free: a call that failed half-way)
        sources = [buffers.source(i, feeds[n], s) for i, (n, s) in enumerate(zip(order, static_in))]
        stream = self._stream
        events = self._thread_events()
        caller = torch.cuda.current_stream(stream.device_index)
        t0 = time.perf_counter()
        with ENQUEUE_LOCK:
            torch.cuda.set_stream(stream)
            try:
                for s, x in zip(static_in, sources):
                    s.copy_(x, non_blocking=True)
                events[0].record(stream)
                graph.replay()
                events[1].record(stream)
                hosts = [buffers.sink(j, o) for j, o in enumerate(static_out)]
                for h, o in zip(hosts, static_out):
                    h.copy_(o, non_blocking=True)
                done.record(stream)
            finally:
                torch.cuda.set_stream(caller)
            self._local.timed = events
        done.synchronize()
        to_host = self.backend.to_host
        named = {v.name: to_host(h).copy() for v, h in zip(self.engine.graph.outputs, hosts)}
        self.last_compute_s = time.perf_counter() - t0
        return named

    def _host_buffers(self) -> _HostBuffers:
        buffers = getattr(self._local, "host_buffers", None)
        if buffers is None:
            buffers = self._local.host_buffers = _HostBuffers()
        return buffers

    def _handoff_events(self) -> tuple[Any, Any]:
        """This thread's pair of events (no timing) for handing work between the caller's
        stream and the context's."""
        events = getattr(self._local, "handoff", None)
        if events is None:
            import torch  # lazy: torch is optional (only a GPU backend hands work over)

            events = (torch.cuda.Event(), torch.cuda.Event())
            self._local.handoff = events
        return events

    def _reserve(self, memory: Mapping[str, Any]) -> None:
        """Reserve the memory plan in the context's pool: its buffers are allocated and freed
        once, on the context's stream, in the order a run at the plan's shapes (the profile's
        largest) allocates and frees them, so the pool holds the blocks such a run takes before
        it starts. Kernels' own scratch memory (library workspaces) is not in the plan and is
        added by the first run that needs it."""
        import torch  # lazy: torch is optional (only a GPU backend reserves)

        buffers = memory.get("buffers") or []
        if self._pool is None or not buffers:
            return
        steps: dict[int, tuple[list, list]] = {}
        for name, _, size, first, last in buffers:
            steps.setdefault(first, ([], []))[0].append((name, size))
            steps.setdefault(last, ([], []))[1].append(name)
        live: dict[str, Any] = {}
        dev = self._executor.device
        try:
            with torch.cuda.use_mem_pool(self._pool), torch.cuda.stream(self._stream):
                for step in sorted(steps):
                    made, freed = steps[step]
                    for name, size in made:
                        live[name] = torch.empty(size, dtype=torch.uint8, device=dev)
                    for name in freed:
                        live.pop(name, None)
        except torch.OutOfMemoryError:  # another process took the memory since _check_fits
            raise _too_big(memory.get("peak_bytes", 0), None, f"out of memory on {dev}") from None
        finally:
            live.clear()  # (graph outputs: freed at the end)

    def synchronize(self) -> None:
        """Wait until the work this context queued on the GPU is done (no-op on the CPU)."""
        if self._stream is not None:
            self._stream.synchronize()

    @property
    def last_gpu_s(self) -> float | None:
        """Seconds the GPU spent on this thread's last call's layers (CUDA events around them,
        input and output copies excluded); None on the reference backend and before a call.
        Waits for that call to finish."""
        events = getattr(self._local, "timed", None)
        if events is None:
            return None
        events[1].synchronize()
        return events[0].elapsed_time(events[1]) / 1e3

    def device_memory_bytes(self) -> int:
        """Bytes of device memory this context holds for activations (its pool's segments)."""
        pools = [self._pool] if self._pool is not None else []
        if self._graphs is not None:
            pools.append(self._graphs.pool)
        total = 0
        for p in pools:
            snapshot = p.snapshot() if hasattr(p, "snapshot") else []
            total += sum(seg.get("total_size", 0) for seg in snapshot)
        return total

    def input_buffers(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """The device tensors that the CUDA graph for feeds like ``feeds`` (device tensors of
        these names, shapes and dtypes) reads its inputs from, by name, holding ``feeds``' values
        (one :meth:`infer` call on ``feeds`` puts them there, capturing the graph if it was not
        yet). Write the next inputs into them and pass them to :meth:`infer`: the replay then
        copies nothing before it runs, as TensorRT's bound input addresses. Other tensors still
        work, copied in. Only for a context that replays CUDA graphs (``use_cuda_graph=True``,
        on a GPU), not for an engine that removes padding (its graphs read inputs staged per
        call); :func:`in_graph_buffers` falls back to the feeds themselves there."""
        if self._graphs is None or self._tokens is not None:
            raise RuntimeError(
                "input_buffers: this context replays no CUDA graph of its own inputs (create it "
                "with use_cuda_graph=True on a GPU; an engine that removes padding stages its "
                "inputs on every call)"
            )
        sig = _feed_signature(feeds)
        if sig is None:
            raise TypeError("input_buffers takes a dict of device tensors (name -> torch.Tensor)")
        self.infer(feeds)
        known = self._known_feeds.get(sig)
        if known is None or known[1] is None:
            reason = self.cuda_graph_fallback or "the feeds do not name the engine's inputs"
            raise RuntimeError(f"input_buffers: no CUDA graph for these feeds ({reason})")
        order, (_, static_in, _) = known
        return dict(zip(order, static_in))

    @property
    def cuda_graph_fallback(self) -> str | None:
        """Why CUDA graphs were not used (None when they were, or were not asked for)."""
        return None if self._graphs is None else self._graphs.eager_reason

    def __enter__(self) -> ExecutionContext:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def in_graph_buffers(ctx: ExecutionContext, feeds: dict[str, Any]) -> dict[str, Any]:
    """``ctx``'s CUDA graph's own input buffers holding ``feeds`` (device tensors), which its
    replays read in place (:meth:`ExecutionContext.input_buffers`); ``feeds`` themselves where
    the context replays no graph of its own inputs."""
    try:
        return ctx.input_buffers(feeds)
    except (RuntimeError, TypeError):
        return feeds


def _check_fits(memory: Mapping[str, Any], backend: Backend, held: int) -> None:
    """Refuse a context whose memory plan cannot fit where it would run.

    The plan was checked against the engine's graph on loading (it is what the graph needs at the
    profile's largest shapes), but a graph may still allow shapes larger than this device: on a
    GPU the plan is reserved before the first run, and must fit the memory free now plus what the
    context's (recycled) pool ``held`` already; on the CPU nothing is reserved ahead, and the
    bound is the machine's memory.
    """
    need = memory.get("peak_bytes") or 0
    limit, what = backend.memory_limit()
    if limit is not None and need > limit + held:
        raise _too_big(need, limit + held, what)


def _too_big(need: int, limit: int | None, what: str) -> EngineCompatibilityError:
    fits = f"more than the {limit:,} bytes {what}" if limit is not None else f"and failed: {what}"
    return EngineCompatibilityError(
        f"the engine's activation memory plan needs {need:,} bytes per context (at its "
        f"profile's largest shapes), {fits}; free memory, create fewer contexts, or rebuild the "
        "engine with smaller --max-shapes"
    )


def _compiled_runs(engine: Any, backend: Backend, compile: bool | None, packs: bool) -> Any:
    """The compiled path (runtime/cpu_compile.py) where asked for and the backend has it; not
    for an engine that ``packs`` tokens (its layers' shapes follow the mask's values, and a
    program is traced per input shapes)."""
    if not cpu_compile.wanted(compile):
        return None
    if packs:
        if compile:
            warnings.warn(
                "this engine removes padding: its layers' shapes follow the mask's values, so "
                "it runs the plain loop, not a compiled program",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    if not backend.compiles:
        if compile is None:  # (the environment asks for every context: only cpu ones take it)
            return None
        raise InputError(
            f"compile=True is for the cpu backend; this engine is for '{engine.backend}' "
            "(leave compile off, or build the engine with --backend cpu)"
        )
    return cpu_compile.for_engine(engine)


def _executor(engine: Any, mode: str) -> Executor:
    """The engine's executor: its backend, shared weights and shape-specialized functions,
    and the tactics the builder chose (for ``mode``: "graph" or "eager")."""
    return Executor(
        engine.graph,
        engine.runtime_backend,
        tactics=tactic_functions(engine.graph, engine.layers, mode),
        weights=engine.device_weights,
        specialized=engine.cpu_specialized,
    )


def _infer_output_shapes(graph: Graph, shapes: dict[str, tuple[int, ...]]) -> dict:
    """Output shapes for concrete input shapes, by shape inference on a copy of the graph."""
    g = infer_at_shapes(graph, shapes)
    out = {}
    for v in g.outputs:
        s = v.shape
        out[v.name] = None if s is None else tuple(d if isinstance(d, int) else -1 for d in s)
    return out


def _feed_signature(feeds: Any, host: bool = False) -> tuple | None:
    """(name, shape, dtype, device) of every feed, when ``feeds`` is a dict of torch tensors
    (with ``host``: (name, shape, dtype), when it is a dict of numpy arrays); None otherwise."""
    if host:
        kind: type = np.ndarray
    else:
        import torch  # lazy: torch is optional (only a GPU backend replays graphs)

        kind = torch.Tensor
    if type(feeds) is not dict:
        return None
    sig = []
    for name, x in feeds.items():
        if type(x) is not kind:
            return None
        sig.append((name, x.shape, x.dtype) if host else (name, x.shape, x.dtype, x.device))
    return tuple(sig)


class _HostBuffers:
    """One thread's page-locked buffers for a context's known host feeds (inputs by position,
    outputs by position), grown as needed, and the event that says the last call's copies are
    done. A thread's call returns after its copies are done, so its next call may reuse them."""

    def __init__(self) -> None:
        import torch  # lazy: torch is optional (only a GPU backend replays graphs)

        from tensorkiln.kernels.cuda.convert import page_locked_bytes  # lazy: torch (cuda tree)

        self._torch = torch
        self._page_locked = page_locked_bytes
        self._inputs: dict[int, Any] = {}
        self._outputs: dict[int, Any] = {}
        self.done = torch.cuda.Event()

    def _buffer(self, held: dict[int, Any], key: int, nbytes: int) -> Any:
        buf = held.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._torch.empty(max(nbytes, 1), dtype=self._torch.uint8, pin_memory=True)
            held[key] = buf
        return buf[:nbytes]

    def source(self, key: int, array: np.ndarray, like: Any) -> Any:
        """A page-locked tensor (dtype and shape of ``like``) holding ``array``'s values:
        ``array`` itself where it lies in page-locked memory already (a server's staging
        buffer), else a copy in this thread's buffer."""
        here = self._page_locked(array)
        if here is not None:
            return here.view(like.dtype).view(like.shape)
        buf = self._buffer(self._inputs, key, array.nbytes)
        np.copyto(buf.numpy().view(array.dtype).reshape(array.shape), array)
        return buf.view(like.dtype).view(like.shape)

    def sink(self, key: int, like: Any) -> Any:
        """This thread's page-locked tensor for output ``key`` (dtype and shape of ``like``)."""
        nbytes = like.numel() * like.element_size()
        return self._buffer(self._outputs, key, nbytes).view(like.dtype).view(like.shape)


def _token_mask(graph: Any) -> tuple[int, int] | None:
    """The position among the graph's inputs of the mask a PackIndex layer reads (padding
    removal) and the layer's ``padding`` attribute, or None."""
    for n in graph.nodes:
        if n.domain == "tensorkiln" and n.op == "PackIndex":
            for i, v in enumerate(graph.inputs):
                if n.inputs and n.inputs[0] is v:
                    return i, int(n.attrs.get("padding", 0) or 0)
    return None
