"""Execute an IR graph with the kernels of one backend.

The executor resolves every node's kernel once (a *plan*), then runs the plan: values live in a dict
keyed by Value identity and are dropped after their last use, so peak memory follows the live set.
Subgraphs (If/Loop/Scan bodies) run through :meth:`Scope.run_graph`, which kernels receive as ``_ctx``;
a subgraph sees the values of the scope that runs it.

The executor talks to its :class:`~tensorkiln.backends.Backend` (upload, host copies, scope,
synchronize) and reads its capabilities; it never asks which backend it is.

An *observer* (``run(..., observer=fn)``) sees every value of the top graph as it is produced:
``fn(node, outputs)`` after each node, with the node's outputs as the backend holds them (device
tensors on a torch backend; ``backend.to_host`` copies them). Values computed inside subgraphs
are not shown one by one: the If/Loop/Scan node that runs them is observed with its outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorkiln.backends import Backend, get_backend
from tensorkiln.errors import KernelError, TensorkilnError, UnsupportedOpError
from tensorkiln.ir import Graph, Node, Value, node_reads
from tensorkiln.kernels.derived import scope as derived_scope
from tensorkiln.kernels.registry import KernelEntry, as_outputs, invoke, lookup, node_kwargs
from tensorkiln.ops import RANDOM_OPS
from tensorkiln.runtime.shape_values import ShapeValues, bind, keepable


@dataclass(slots=True)
class _Step:
    node: Node
    kernel: KernelEntry
    inputs: tuple[Value | None, ...]
    outputs: tuple[Value | None, ...]
    free: tuple[Value, ...]  # values whose last use is this step
    # the kernel's keywords, made once at plan time: the attributes, and _n_outputs when the
    # kernel takes it (a run adds only _ctx); the run loop then calls the kernel directly
    kwargs: dict[str, Any]
    # the cpu backend: the kernel's shape-specialized functions by input shapes (see
    # _run_specialized), for kernels that offer them; None elsewhere
    specialized: dict[tuple, Any] | None = None
    # where exactly one input is not a constant: its position (a specialized function is then
    # keyed by that input's shape alone; the constants' shapes never change)
    key_input: int | None = None
    # a top-graph layer whose outputs are kept per input shape where its inputs follow from
    # constants and shapes alone (runtime/shape_values.py)
    keepable: bool = False


# called with (node, outputs) after each top-graph node runs (see the module's docstring)
Observer = Callable[[Node, list[Any]], None]


class Executor:
    """Runs graphs on one backend; plans are made once per graph and reused."""

    def __init__(
        self,
        graph: Graph,
        backend: Backend | str = "reference",
        device: Any = None,
        tactics: Mapping[str, Any] | None = None,
        weights: dict[str, dict[Value, Any]] | None = None,
        *,
        specialized: dict[str, dict[tuple, Any]] | None = None,
    ) -> None:
        """``backend``: a Backend, or a backend's name made on ``device`` by
        :func:`~tensorkiln.backends.get_backend`. ``tactics`` maps top-level node names to the
        function that runs them instead of the op's registered kernel (the autotuner's choices).
        ``weights`` holds the initializers already on a device, per device; executors given the
        same dict share them (an engine's contexts do). ``specialized`` holds the
        shape-specialized functions of the top graph's layers by name, on a backend that keeps
        them; executors given the same dict share them (an engine's contexts do)."""
        backend = get_backend(backend, device)
        self.graph = graph
        self.backend = backend
        self.tactics = dict(tactics or {})
        self._plans: dict[int, list[_Step]] = {}
        self._constants: dict[int, dict[Value, Any]] = {}  # see constants()
        self._specialized = {} if specialized is None else specialized
        self._references: dict[int, KernelEntry | None] = {}  # for shadow_host_values
        check_supported(graph, backend.name)
        self.device = backend.device
        self._on_device = backend.on_device
        # a backend that holds convolution weights channels-last, marked for prepacking, as its
        # convolutions run them (kernels/cpu/conv.py says why)
        held = backend.holds_weights
        self._conv_weights = _conv_weights(graph) if held else frozenset()
        # and takes the inputs only those convolutions read channels-last in one copy
        self._conv_inputs = _conv_inputs(graph, self._conv_weights)
        # shape arithmetic mirrored on the host pays only where a device sync is the alternative
        self._shadow = backend.host_mirror
        self._consts: dict[Value, Any] = (
            {} if weights is None else weights.setdefault(str(self.device), {})
        )
        # values that follow from the constants and the input shapes alone, kept per input
        # shape (runtime/shape_values.py); None where the backend keeps none
        self.shape_values = (
            ShapeValues(backend, graph.initializers) if backend.keeps_shape_values else None
        )
        self._plan(graph)

    def const(self, v: Value) -> Any:
        """The value of initializer ``v`` as this backend's kernels take it (on the device)."""
        if not self._on_device:
            return v.const
        c = self._consts.get(v)
        if c is None:
            c = self.backend.constant(v.const, conv_weight=v in self._conv_weights)
            c = self._consts.setdefault(v, c)  # (another thread may have uploaded it first)
        return c

    def constants(self, graph: Graph) -> dict[Value, Any]:
        """``graph``'s initializers as :meth:`const` gives them, made once per graph: each run
        starts from a copy (a run of a small network would otherwise spend tens of microseconds
        looking each one up)."""
        table = self._constants.get(id(graph))
        if table is None:
            table = self._constants[id(graph)] = {v: self.const(v) for v in graph.initializers}
        return table

    def upload_weights(self) -> None:
        """Put the main graph's initializers on the device now (not at the first run).
        Subgraphs' initializers are uploaded when first used."""
        for v in self.graph.initializers:
            self.const(v)

    def _plan(self, graph: Graph) -> list[_Step]:
        plan = self._plans.get(id(graph))
        if plan is not None:
            return plan
        last_use: dict[Value, int] = {}
        for i, n in enumerate(graph.nodes):
            for v in node_reads(n):
                last_use[v] = i
        keep = set(graph.outputs)
        frees: dict[int, list[Value]] = {}
        for v, i in last_use.items():
            if v not in keep:
                frees.setdefault(i, []).append(v)
        plan = []
        for i, n in enumerate(graph.nodes):
            entry = lookup(n.op, n.domain, graph.opset(n.domain), self.backend.name, node=n.name)
            fn = self.tactics.get(n.name) if graph is self.graph else None
            if fn is not None:
                entry = with_fn(entry, fn)
            kwargs = node_kwargs(entry, n.attrs, len(n.outputs))
            free = tuple(frees.get(i, ()))
            step = _Step(n, entry, tuple(n.inputs), tuple(n.outputs), free, kwargs)
            if graph is self.graph and self.shape_values is not None:
                step.keepable = keepable(n, entry, keep)
            if self._specializes(entry):
                # (shared by name for the top graph; a subgraph's layers keep their own)
                shared = self._specialized if graph is self.graph else {}
                step.specialized = shared.setdefault(n.name, {})
                consts = set(graph.initializers)
                varying = [i for i, v in enumerate(n.inputs) if v is not None and v not in consts]
                if len(varying) == 1:
                    step.key_input = varying[0]
            plan.append(step)
        self._plans[id(graph)] = plan
        return plan

    def _specializes(self, entry: KernelEntry) -> bool:
        """Whether steps of ``entry`` keep shape-specialized functions: on a backend that keeps
        them, where the kernel offers them (a ``specialize`` attribute with the kernel's signature
        that returns a function of the same positional arguments for inputs of those shapes,
        or None)."""
        return (
            self.backend.specializes
            and hasattr(entry.fn, "specialize")
            and not entry.wants_ctx
            and not entry.wants_n_outputs
        )

    def run(
        self,
        feeds: Mapping[Value, Any],
        timings: dict[str, float] | None = None,
        observer: Observer | None = None,
    ) -> list[Any]:
        """Run the top graph with ``feeds`` keyed by its input Values; returns its outputs in order.

        With ``timings``, each top-level node's seconds are added under its name (a node's
        subgraphs count towards it). ``observer(node, outputs)`` is called after each top-level
        node (see the module's docstring).
        """
        scope = Scope(self, {})
        inputs = [feeds[v] for v in self.graph.inputs]
        if not self._on_device:
            return scope.run_graph(self.graph, inputs, timings, observer)
        # (values the kernels derive from one tensor, kept for this run: kernels/derived.py)
        with self.backend.scope(), derived_scope():
            inputs = [self.upload_input(v, x) for v, x in zip(self.graph.inputs, inputs)]
            return scope.run_graph(self.graph, inputs, timings, observer)

    def upload_input(self, v: Value, x: Any, held: bool = False) -> Any:
        """Input ``x`` of graph input ``v`` as the kernels take it (a fresh tensor on the
        device for a numpy array; tensors as they are). ``held``: ``x`` stays unchanged until
        the run's results are on the host (Backend.to_device)."""
        return self.backend.to_device(x, channels_last=v in self._conv_inputs, held=held)

    def shadow_host_values(self, node: Node, env: Mapping[Value, Any]) -> None:
        """Shape arithmetic on the device, mirrored on the host: when a node's small outputs come
        from inputs whose values (or, for Shape and Size, shapes) the host knows, compute them
        with the reference kernel too and attach them, so a later Reshape or Slice reads its
        shape without waiting for the device (and the engine stays capturable as a CUDA graph)."""
        backend = self.backend
        outs = [env.get(v) for v in node.outputs if v is not None]
        if not outs or not all(backend.mirrorable(o) for o in outs):
            return
        args = _host_args(node, env, backend.known_on_host)
        entry = self._reference_kernel(node) if args is not None else None
        if entry is None:
            return
        try:
            results = invoke(entry, args, node.attrs, len(node.outputs))
        except Exception:  # the device kernel ran; the mirror is only a shortcut
            return
        for v, r in zip(node.outputs, results):
            t = env.get(v) if v is not None else None
            if isinstance(r, np.ndarray) and t is not None and tuple(t.shape) == r.shape:
                backend.remember_on_host(t, r)

    def _reference_kernel(self, node: Node) -> KernelEntry | None:
        key = id(node)
        if key not in self._references:
            try:
                opset = self.graph.opset(node.domain)
                entry = lookup(node.op, node.domain, opset, "reference")
                ok = not (entry.wants_ctx or node.op in RANDOM_OPS or any(node.subgraphs()))
                self._references[key] = entry if ok else None
            except TensorkilnError:
                self._references[key] = None
        return self._references[key]

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on the host)."""
        self.backend.synchronize()


class Scope:
    """The values visible while running one graph; kernels with subgraphs receive it as ``_ctx``."""

    __slots__ = ("env", "executor")

    def __init__(self, executor: Executor, env: Mapping[Value, Any]) -> None:
        self.executor = executor
        self.env = env

    def run_graph(
        self,
        graph: Graph,
        inputs: list[Any],
        timings: dict[str, float] | None = None,
        observer: Observer | None = None,
    ) -> list[Any]:
        """Run ``graph`` binding ``inputs`` positionally to its inputs; returns its outputs.
        ``observer`` sees each node's outputs as they are produced (kernels that run
        subgraphs call this without one)."""
        if len(inputs) > len(graph.inputs):
            raise KernelError(
                f"subgraph '{graph.name}' takes {len(graph.inputs)} inputs, got {len(inputs)}"
            )
        local: dict[Value, Any] = dict(self.executor.constants(graph))
        local.update(zip(graph.inputs, inputs))
        env = ChainMap(local, self.env) if self.env else local
        inner = Scope(self.executor, env)
        shadow = self.executor._shadow
        # (CUDA events on a GPU: each layer's GPU time, read once the run is queued)
        timer = None if timings is None else self.executor.backend.layer_timer()
        executor = self.executor
        # (the top graph on a backend that keeps them: the tokens of the values that follow from
        # constants and input shapes alone; runtime/shape_values.py)
        kept_values = executor.shape_values if graph is executor.graph else None
        known: dict[Value, Any] = {}
        for step in executor._plan(graph):
            key = kept = None
            if kept_values is not None and step.keepable:
                key = kept_values.key(step.node, step.inputs, env, known)
                kept = None if key is None else kept_values.get(key)
            if kept is not None:  # (the outputs of an earlier run at these shapes)
                bind(step.outputs, kept[1], kept[0], env, known)
            else:
                if timer is None:
                    _run_step(step, env, inner)
                else:
                    timer.start()
                    _run_step(step, env, inner)
                    timer.stop(step.node.name)
                if shadow:
                    executor.shadow_host_values(step.node, env)
                if key is not None:
                    outs = [None if v is None else env[v] for v in step.outputs]
                    number = kept_values.keep(key, outs)  # type: ignore[union-attr]
                    if number is not None:
                        bind(step.outputs, None, number, env, known)
            if observer is not None:  # (before the step's last uses are dropped)
                observer(step.node, [None if v is None else env[v] for v in step.outputs])
            for v in step.free:
                local.pop(v, None)
        if timer is not None:
            timer.collect(timings)  # type: ignore[arg-type]
        try:
            return [env[v] for v in graph.outputs]
        except KeyError as exc:
            raise KernelError(f"graph '{graph.name}' output {exc} was never computed") from None


def _run_step(step: _Step, env: Mapping[Value, Any], scope: Scope) -> None:
    # invoke()'s calling convention, inlined: this runs once per layer per inference, and on the
    # CPU a small layer's kernel takes only tens of microseconds
    node = step.node
    args = [None if v is None else env[v] for v in step.inputs]
    while args and args[-1] is None:
        args.pop()
    kwargs = step.kwargs
    if step.kernel.wants_ctx:
        kwargs = {**kwargs, "_ctx": scope}
    try:
        if step.specialized is None:
            result = step.kernel.fn(*args, **kwargs)
        else:
            result = _run_specialized(step, args, kwargs)
        result = as_outputs(result, len(step.outputs))
    except TensorkilnError as exc:
        if f"'{node.name}'" in str(exc):
            raise
        raise type(exc)(f"node '{node.name}' ({node.op}): {exc}") from exc
    except Exception as exc:
        raise KernelError(
            f"node '{node.name}' ({node.op}) failed: {type(exc).__name__}: {exc}"
        ) from exc
    for v, r in zip(step.outputs, result):
        if v is not None:
            env[v] = r  # type: ignore[index]
    # A kernel may return more outputs than the node declares (the extras are unused), never
    # fewer than the last declared one.
    if len(result) < len(step.outputs) and any(v is not None for v in step.outputs[len(result) :]):
        raise KernelError(
            f"node '{node.name}' ({node.op}) produced {len(result)} outputs, "
            f"{len(step.outputs)} were asked for"
        )


_SPECIALIZED_SHAPES = 16  # per layer; more input shapes than this run the kernel as it is


def _run_specialized(step: _Step, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The step's kernel on ``args``: the first call at a set of input shapes runs the kernel
    itself (which checks the arguments) and asks it for a function specialized to those shapes,
    then answers with that function too; later calls at the same shapes run it. The table is
    shared by an engine's contexts: every run of a layer at a shape goes through one function. It skips, per call, what depends only on
    the shapes and attributes (checks, geometry, choice of path), which on the CPU is a
    large part of a small layer's time."""
    table = step.specialized
    ki = step.key_input
    if ki is not None:
        key: Any = args[ki].shape
    else:
        key = tuple(None if a is None else a.shape for a in args)
    fn = table.get(key)  # type: ignore[union-attr]
    if fn is not None:
        return fn(*args)
    result = step.kernel.fn(*args, **kwargs)
    if len(table) < _SPECIALIZED_SHAPES:  # type: ignore[arg-type]
        made = step.kernel.fn.specialize(*args, **kwargs)
        if made is None:
            made = functools.partial(step.kernel.fn, **kwargs)
        fn = table.setdefault(key, made)  # type: ignore[union-attr]
        if not isinstance(fn, functools.partial):
            # the first run at these shapes gives what every later one will (the function
            # chosen may be another path than the kernel's, with other roundings)
            return fn(*args)
    return result


def _host_args(node: Node, env: Mapping[Value, Any], host_values: Any) -> list | None:
    """The node's inputs as host arrays, or None when one is not known on the host."""
    if node.op in ("Shape", "Size") and node.domain == "" and node.inputs[0] is not None:
        x = env.get(node.inputs[0])
        if not hasattr(x, "shape"):
            return None
        shape = tuple(x.shape)  # known on the host whatever the values
        return [np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, (0,) * len(shape))]
    args = []
    for v in node.inputs:
        if v is None:
            args.append(None)
            continue
        known = host_values(env.get(v))
        if known is None:
            return None
        args.append(known)
    return args


def with_fn(entry: KernelEntry, fn: Any) -> KernelEntry:
    """``entry`` with its function replaced by ``fn`` (a tactic with the kernel's signature)."""
    params = inspect.signature(fn).parameters
    return dataclasses.replace(
        entry,
        fn=fn,
        wants_n_outputs="_n_outputs" in params,
        wants_ctx="_ctx" in params,
        wants_opset="_opset" in params,
    )


# where each convolution reads its weight: Conv and ConvAct input 1, QConvAct and QConvPool
# (X_q, X_scale, W_q) input 2
_WEIGHT_INPUT = {
    ("", "Conv"): 1,
    ("tensorkiln", "ConvAct"): 1,
    ("tensorkiln", "QConvAct"): 2,
    ("tensorkiln", "QConvPool"): 2,
}


def _conv_weights(graph: Graph) -> frozenset[Value]:
    """The initializers that are convolutions' weights."""
    found = set()
    for _, n in graph.walk():
        i = _WEIGHT_INPUT.get((n.domain, n.op))
        w = n.inputs[i] if i is not None and len(n.inputs) > i else None
        if w is not None and w.const is not None:
            found.add(w)
    return frozenset(found)


def _three_channels(n: Node) -> bool:
    """Whether ``n`` is a 2-D quantized convolution of one group over 3 input channels."""
    if _WEIGHT_INPUT.get((n.domain, n.op)) != 2 or len(n.inputs) < 3:
        return False
    w = n.inputs[2]
    shape = None if w is None or w.const is None else np.shape(w.const)
    return shape is not None and len(shape) == 4 and shape[1] == 3 and n.attrs.get("group", 1) == 1


def _conv_inputs(graph: Graph, weights: frozenset[Value]) -> frozenset[Value]:
    """The graph inputs read only as input 0 of convolutions whose weight is in ``weights``, or
    only by QuantizeLinear nodes whose outputs those convolutions alone read (an INT8/FP8
    engine's first layer), anywhere, subgraphs included, and not themselves outputs. Not an
    image of 3 channels quantized for such a convolution (a quantized stem): its tactics lay the
    8-bit image out in one pass from any layout (the float16 route widens it into 4 channels,
    channels-last; the stem kernel packs it into 4 channels with its padding), so a
    channels-last copy of the float input would be a pass of its own for nothing."""
    if not weights:
        return frozenset()
    readers: dict[Value, list[tuple[Node, int]]] = {}
    for _, n in graph.walk():
        for i, v in enumerate(node_reads(n)):
            readers.setdefault(v, []).append((n, i))

    def conv_reads(n: Node, i: int, v: Value) -> bool:
        w = _WEIGHT_INPUT.get((n.domain, n.op))
        conv = w is not None and len(n.inputs) > w and n.inputs[w] in weights
        return conv and i == 0 and v not in n.inputs[1:]

    def quantized_for_convs(n: Node, i: int) -> bool:
        if (n.domain, n.op) != ("", "QuantizeLinear") or i != 0 or not n.outputs:
            return False
        q = n.outputs[0]
        users = readers.get(q, [])
        if not users or q in graph.outputs or any(_three_channels(m) for m, _ in users):
            return False
        return all(conv_reads(m, j, q) for m, j in users)

    return frozenset(
        v
        for v in graph.inputs
        if v not in graph.outputs
        and readers.get(v)
        and all(conv_reads(n, i, v) or quantized_for_convs(n, i) for n, i in readers[v])
    )


def check_supported(graph: Graph, backend: str = "reference") -> None:
    """Raise one UnsupportedOpError listing every node of ``graph`` the backend (by name, as
    engine files and configs give it) cannot run."""
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    for g, n in graph.walk():
        try:
            lookup(n.op, n.domain, g.opset(n.domain), backend, node=n.name)
        except UnsupportedOpError as exc:
            if (n.domain, n.op) not in seen:
                seen.add((n.domain, n.op))
                problems.append(str(exc))
    if len(problems) == 1:
        raise UnsupportedOpError(problems[0])
    if problems:
        raise UnsupportedOpError(
            f"{len(problems)} operators are not supported:\n  " + "\n  ".join(problems)
        )
