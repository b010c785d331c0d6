"""Control flow written once: If, Loop, Scan (8 and 9+) and SequenceMap for both kernel trees.

These kernels are host logic around subgraph runs: ``_ctx.run_graph(graph, inputs)`` binds
``inputs`` positionally to the graph's inputs and returns its outputs in order (values the subgraph
reads from enclosing scopes are resolved by the executor). The few array operations they need
(read a scalar to decide, stack scan frames, move an axis, make a scalar) go through an
:class:`Arrays` adapter that each backend supplies: numpy in kernels/reference/control.py, torch in
kernels/cuda/control.py, where the values stay on the device and only the control decisions (If's
condition, Loop's trip count and condition, Scan-8's sequence lengths) are read on the host.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

Value = Any  # an array, a list of arrays (sequence) or None (empty optional)


class Arrays(Protocol):
    """The array operations control flow needs, on one backend's arrays."""

    def items(self, x: Any) -> list:
        """``x``'s values as a flat host list (a device read where they are not known)."""

    def index(self, value: int | bool, like: tuple[Value, ...]) -> Any:
        """A 0-d int64 (or bool) array of ``value``, where the arrays of ``like`` live."""

    def stack(self, frames: list[Any]) -> Any: ...

    def moveaxis(self, x: Any, source: int, destination: int) -> Any: ...

    def flip0(self, x: Any) -> Any: ...

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: tuple[Value, ...]) -> Any: ...

    def zeros(self, shape: tuple[int, ...], like: Any) -> Any:
        """Zeros of ``shape`` in ``like``'s dtype, where ``like`` lives."""


def _pack(outputs: list[Value]) -> Value | tuple[Value, ...]:
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _flags(values: list[int] | None, n: int, name: str) -> list[int]:
    values = list(values) if values is not None else [0] * n
    if len(values) != n:
        raise ValueError(f"Scan: {name} has {len(values)} entries; expected {n}.")
    return values


def _state_count(inputs: tuple[Value, ...], num_scan_inputs: int) -> int:
    n_state = len(inputs) - num_scan_inputs
    if n_state < 0:
        raise ValueError(f"Scan: num_scan_inputs={num_scan_inputs} exceeds {len(inputs)} inputs.")
    return n_state


def _declared(graph: Any, index: int) -> tuple[np.dtype, tuple[int, ...]]:
    """dtype and frame shape of a subgraph output, for a stacked output of zero iterations."""
    dtype, dims = np.dtype(np.float32), ()
    try:
        t = graph.outputs[index].type
        dtype = t.dtype.numpy if t.dtype is not None else dtype
        dims = tuple(d if isinstance(d, int) else 0 for d in (t.shape or ()))
    except (AttributeError, IndexError):
        pass  # the declared type is unknown: float32 of rank 1 is the best guess
    return dtype, dims


class ControlFlow:
    """The control-flow kernels over one backend's :class:`Arrays` (register the bound methods)."""

    def __init__(self, xp: Arrays) -> None:
        self.xp = xp

    def _item(self, x: Any, what: str) -> Any:
        values = self.xp.items(x)
        if len(values) != 1:
            raise ValueError(
                f"{what} must hold exactly one element, got shape {tuple(np.shape(x))}."
            )
        return values[0]

    def _stack(self, frames: list[Any], graph: Any, index: int, op: str, like: tuple) -> Any:
        if not frames:
            dtype, dims = _declared(graph, index)
            return self.xp.empty((0, *dims), dtype, like)
        shapes = {tuple(np.shape(f)) for f in frames}
        if len(shapes) > 1:
            raise ValueError(
                f"{op}: scan output {index} changes shape across iterations ({sorted(shapes)}); "
                "all iterations must produce the same shape."
            )
        return self.xp.stack(frames)

    def if_(self, cond: Any, *, then_branch: Any, else_branch: Any, _ctx: Any) -> Value:
        """The outputs of ``then_branch`` if ``cond`` is true, else those of ``else_branch``."""
        branch = then_branch if bool(self._item(cond, "If: cond")) else else_branch
        return _pack(_ctx.run_graph(branch, []))

    def loop(
        self,
        M: Any = None,
        cond: Any = None,
        *v_initial: Value,
        body: Any,
        _ctx: Any,
        _n_outputs: int = 1,
    ) -> Value:
        """Run ``body`` while ``i < M`` and ``cond``; return the final carried values and the
        per-iteration scan outputs stacked along a new axis 0.

        Without ``cond`` the body's condition output is ignored (a for loop); without ``M`` the
        loop runs until the condition is false.
        """
        like = (M, cond, *v_initial)
        trips = None if M is None else int(self._item(M, "Loop: M"))
        keep = True if cond is None else bool(self._item(cond, "Loop: cond"))
        carried = list(v_initial)
        n_carried = len(carried)
        scans: list[list[Any]] = [[] for _ in range(_n_outputs - n_carried)]
        i = 0
        while keep and (trips is None or i < trips):
            args = [self.xp.index(i, like), self.xp.index(keep, like), *carried]
            outs = _ctx.run_graph(body, args)
            if len(outs) != 1 + n_carried + len(scans):
                raise ValueError(
                    f"Loop: the body returned {len(outs)} outputs; expected 1 + {n_carried} "
                    f"carried + {len(scans)} scan outputs."
                )
            if cond is not None:
                keep = bool(self._item(outs[0], "Loop: the body's condition output"))
            carried = list(outs[1 : 1 + n_carried])
            for frames, value in zip(scans, outs[1 + n_carried :]):
                frames.append(value)
            i += 1
        stacked = [
            self._stack(f, body, 1 + n_carried + k, "Loop", like) for k, f in enumerate(scans)
        ]
        return _pack(carried + stacked)

    def _run_scan(
        self, body: Any, ctx: Any, states: list[Value], slices: list[Any], n_out: int, length: int
    ) -> tuple[list[Value], list[list[Any]]]:
        """Iterate ``body`` over ``length`` steps; ``slices[j][t]`` is scan input j at step t."""
        frames: list[list[Any]] = [[] for _ in range(n_out)]
        n = len(states)
        for t in range(length):
            outs = ctx.run_graph(body, states + [x[t] for x in slices])
            if len(outs) != n + n_out:
                raise ValueError(
                    f"Scan: the body returned {len(outs)} outputs; expected {n} states + "
                    f"{n_out} scan outputs."
                )
            states = list(outs[:n])
            for f, value in zip(frames, outs[n:]):
                f.append(value)
        return states, frames

    def scan(
        self,
        *inputs: Any,
        body: Any,
        num_scan_inputs: int,
        directions: list[int] | None = None,
        scan_input_axes: list[int] | None = None,
        scan_input_directions: list[int] | None = None,
        scan_output_axes: list[int] | None = None,
        scan_output_directions: list[int] | None = None,
        _ctx: Any,
        _n_outputs: int = 1,
        _opset: int = 9,
    ) -> Value:
        """Scan: iterate ``body`` over slices of the scan inputs along their scan axes, threading
        the state variables; scan outputs are stacked along ``scan_output_axes``. Scan-8 differs:
        its first input is sequence_lens and axis 0 of every input is a batch (see _scan_8)."""
        if _opset < 9:
            return self._scan_8(inputs, body, num_scan_inputs, directions, _ctx, _n_outputs)
        n_state = _state_count(inputs, num_scan_inputs)
        states, scan_in = list(inputs[:n_state]), inputs[n_state:]
        n_out = _n_outputs - n_state
        in_axes = _flags(scan_input_axes, num_scan_inputs, "scan_input_axes")
        in_dirs = _flags(scan_input_directions, num_scan_inputs, "scan_input_directions")
        out_axes = _flags(scan_output_axes, n_out, "scan_output_axes")
        out_dirs = _flags(scan_output_directions, n_out, "scan_output_directions")
        slices = []
        for x, axis, direction in zip(scan_in, in_axes, in_dirs):
            x = self.xp.moveaxis(x, axis, 0)
            slices.append(self.xp.flip0(x) if direction else x)
        lengths = {x.shape[0] for x in slices}
        if len(lengths) != 1:
            raise ValueError(
                f"Scan: scan inputs have different sequence lengths {sorted(lengths)}."
            )
        states, frames = self._run_scan(body, _ctx, states, slices, n_out, lengths.pop())
        outputs = []
        for k, (f, axis, direction) in enumerate(zip(frames, out_axes, out_dirs)):
            y = self._stack(f, body, n_state + k, "Scan", inputs)
            y = self.xp.flip0(y) if direction else y
            outputs.append(self.xp.moveaxis(y, 0, axis % y.ndim))
        return _pack(states + outputs)

    def _scan_8(
        self,
        inputs: tuple[Any, ...],
        body: Any,
        num_scan_inputs: int,
        directions: list[int] | None,
        ctx: Any,
        n_outputs: int,
    ) -> Value:
        """Scan-8: axis 0 of every input is a batch, axis 1 of scan inputs the sequence. Each batch
        entry is scanned separately for ``sequence_lens[b]`` steps; scan outputs of shorter
        sequences are padded with zeros to the longest one."""
        sequence_lens, inputs = inputs[0], inputs[1:]
        n_state = _state_count(inputs, num_scan_inputs)
        scan_in = inputs[n_state:]
        dirs = _flags(directions, num_scan_inputs, "directions")
        batch = inputs[0].shape[0]
        max_len = scan_in[0].shape[1] if scan_in else 0
        # the per-batch step counts drive the host loop
        lens = [max_len] * batch if sequence_lens is None else self.xp.items(sequence_lens)
        if len(lens) != batch or any(n < 0 or n > max_len for n in lens):
            raise ValueError(
                f"Scan: sequence_lens must have {batch} entries between 0 and {max_len}, "
                f"got {lens}."
            )
        n_out = n_outputs - n_state
        final_states: list[list[Value]] = []
        frames: list[list[list[Any]]] = [[] for _ in range(n_out)]
        for b in range(batch):
            n = int(lens[b])
            slices = [self.xp.flip0(x[b, :n]) if d else x[b, :n] for x, d in zip(scan_in, dirs)]
            states = [s[b] for s in inputs[:n_state]]
            states, batch_frames = self._run_scan(body, ctx, states, slices, n_out, n)
            final_states.append(states)
            for k, f in enumerate(batch_frames):
                frames[k].append(f)
        outputs = [self.xp.stack(list(s)) for s in zip(*final_states)]
        outputs += [
            self._batch_output(f, max_len, body, n_state + k, inputs) for k, f in enumerate(frames)
        ]
        return _pack(outputs)

    def _batch_output(
        self, frames: list[list[Any]], max_len: int, body: Any, index: int, like: tuple
    ) -> Any:
        """Stack per-batch scan frames into [batch, max_len, ...], zero-padding short ones."""
        template = next((f[0] for f in frames if f), None)
        if template is None:
            return self.xp.stack([self._stack([], body, index, "Scan", like)] * len(frames))
        out = self.xp.zeros((len(frames), max_len, *template.shape), template)
        for b, f in enumerate(frames):
            if f:
                out[b, : len(f)] = self._stack(f, body, index, "Scan", like)
        return out

    def sequence_map(
        self,
        input_sequence: list[Any],
        *additional_inputs: Value,
        body: Any,
        _ctx: Any,
        _n_outputs: int = 1,
    ) -> Value:
        """Apply ``body`` to each element of ``input_sequence`` (and of sequence additional
        inputs; tensor additional inputs are passed whole to every call); each output is a
        sequence."""
        n = len(input_sequence)
        for extra in additional_inputs:
            if isinstance(extra, list) and len(extra) != n:
                raise ValueError(
                    f"SequenceMap: an additional sequence has {len(extra)} elements; the input "
                    f"sequence has {n}."
                )
        results: list[list[Any]] = [[] for _ in range(_n_outputs)]
        for i in range(n):
            args = [input_sequence[i]]
            args += [a[i] if isinstance(a, list) else a for a in additional_inputs]
            for seq, value in zip(results, _ctx.run_graph(body, args)):
                seq.append(value)
        return _pack(results)
