"""Control flow on the device: If, Loop, Scan and SequenceMap.

The subgraphs run through the executor (``_ctx.run_graph``) on the same backend, so their values
stay torch tensors on the device. Deciding which branch to take or whether to run another iteration
needs If's condition, Loop's trip count and condition and Scan-8's sequence lengths on the host:
those are single scalars (or one int per batch entry) read with ``bool()`` / ``int()`` /
``.tolist()``; everything else stays on the device, and scan outputs are stacked there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorkiln.kernels.cuda.convert import current_device, host_list, torch_dtype
from tensorkiln.kernels.registry import register

Value = Any  # a tensor, a list of tensors (sequence) or None (empty optional)


def _pack(outputs: list[Value]) -> Value | tuple[Value, ...]:
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _host_item(x: torch.Tensor, what: str) -> bool | int | float:
    """The one element of ``x`` on the host (no device sync for a known small constant)."""
    if x.numel() != 1:
        raise ValueError(f"{what} must hold exactly one element, got shape {tuple(x.shape)}.")
    v = host_list(x)
    while isinstance(v, list):
        v = v[0]
    return v


def _flat(v: object) -> list:
    if not isinstance(v, list):
        return [v]
    return [x for item in v for x in _flat(item)]


def _scalar_bool(x: torch.Tensor, what: str) -> bool:
    return bool(_host_item(x, what))  # a host read: the control decision is made there


def _device_of(*values: Value) -> torch.device:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return current_device()


def _empty_output(graph: Any, index: int, device: torch.device) -> torch.Tensor:
    """A stacked output of zero iterations, typed from the subgraph's declared output."""
    dtype, dims = np.dtype(np.float32), ()
    try:
        t = graph.outputs[index].type
        dtype = t.dtype.numpy if t.dtype is not None else dtype
        dims = tuple(d if isinstance(d, int) else 0 for d in (t.shape or ()))
    except (AttributeError, IndexError):
        pass  # the declared type is unknown: float32 of rank 1 is the best guess
    return torch.empty((0, *dims), dtype=torch_dtype(dtype), device=device)


def _stack(frames: list[torch.Tensor], graph: Any, index: int, op: str, device) -> torch.Tensor:
    if not frames:
        return _empty_output(graph, index, device)
    shapes = {tuple(f.shape) for f in frames}
    if len(shapes) > 1:
        raise ValueError(
            f"{op}: scan output {index} changes shape across iterations ({sorted(shapes)}); "
            "all iterations must produce the same shape."
        )
    return torch.stack(frames)


@register("If", since=1, backend="cuda")
def if_(cond: torch.Tensor, *, then_branch: Any, else_branch: Any, _ctx: Any) -> Value:
    """The outputs of ``then_branch`` if ``cond`` is true, else those of ``else_branch``."""
    branch = then_branch if _scalar_bool(cond, "If: cond") else else_branch
    return _pack(_ctx.run_graph(branch, []))


@register("Loop", since=1, backend="cuda")
def loop(
    M: torch.Tensor | None = None,
    cond: torch.Tensor | None = None,
    *v_initial: Value,
    body: Any,
    _ctx: Any,
    _n_outputs: int = 1,
) -> Value:
    """Run ``body`` while ``i < M`` and ``cond``; return the final carried values and the
    per-iteration scan outputs stacked along a new axis 0.

    Without ``cond`` the body's condition output is ignored (a for loop); without ``M`` the loop
    runs until the condition is false.
    """
    device = _device_of(M, cond, *v_initial)
    trips = None if M is None else int(_host_item(M, "Loop: M"))
    keep = True if cond is None else _scalar_bool(cond, "Loop: cond")
    carried = list(v_initial)
    n_carried = len(carried)
    scans: list[list[torch.Tensor]] = [[] for _ in range(_n_outputs - n_carried)]
    i = 0
    while keep and (trips is None or i < trips):
        args = [
            torch.tensor(i, dtype=torch.int64, device=device),
            torch.tensor(keep, dtype=torch.bool, device=device),
            *carried,
        ]
        outs = _ctx.run_graph(body, args)
        if len(outs) != 1 + n_carried + len(scans):
            raise ValueError(
                f"Loop: the body returned {len(outs)} outputs; expected 1 + {n_carried} carried "
                f"+ {len(scans)} scan outputs."
            )
        if cond is not None:
            keep = _scalar_bool(outs[0], "Loop: the body's condition output")
        carried = list(outs[1 : 1 + n_carried])
        for frames, value in zip(scans, outs[1 + n_carried :]):
            frames.append(value)
        i += 1
    stacked = [_stack(f, body, 1 + n_carried + k, "Loop", device) for k, f in enumerate(scans)]
    return _pack(carried + stacked)


def _run_scan(
    body: Any,
    ctx: Any,
    states: list[Value],
    slices: list[torch.Tensor],
    n_scan_out: int,
    length: int,
) -> tuple[list[Value], list[list[torch.Tensor]]]:
    """Iterate ``body`` over ``length`` steps; ``slices[j][t]`` is scan input j at step t."""
    frames: list[list[torch.Tensor]] = [[] for _ in range(n_scan_out)]
    n = len(states)
    for t in range(length):
        outs = ctx.run_graph(body, states + [x[t] for x in slices])
        if len(outs) != n + n_scan_out:
            raise ValueError(
                f"Scan: the body returned {len(outs)} outputs; expected {n} states + "
                f"{n_scan_out} scan outputs."
            )
        states = list(outs[:n])
        for f, value in zip(frames, outs[n:]):
            f.append(value)
    return states, frames


def _scan_length(slices: list[torch.Tensor]) -> int:
    lengths = {x.shape[0] for x in slices}
    if len(lengths) != 1:
        raise ValueError(f"Scan: scan inputs have different sequence lengths {sorted(lengths)}.")
    return lengths.pop()


def _flags(values: list[int] | None, n: int, name: str) -> list[int]:
    values = list(values) if values is not None else [0] * n
    if len(values) != n:
        raise ValueError(f"Scan: {name} has {len(values)} entries; expected {n}.")
    return values


@register("Scan", since=9, backend="cuda")
def scan(
    *inputs: torch.Tensor,
    body: Any,
    num_scan_inputs: int,
    scan_input_axes: list[int] | None = None,
    scan_input_directions: list[int] | None = None,
    scan_output_axes: list[int] | None = None,
    scan_output_directions: list[int] | None = None,
    _ctx: Any,
    _n_outputs: int = 1,
) -> Value:
    """Scan (opset 9+): iterate ``body`` over slices of the scan inputs along their scan axes,
    threading the state variables; scan outputs are stacked along ``scan_output_axes``."""
    n_state = len(inputs) - num_scan_inputs
    if n_state < 0:
        raise ValueError(f"Scan: num_scan_inputs={num_scan_inputs} exceeds {len(inputs)} inputs.")
    device = _device_of(*inputs)
    states, scan_in = list(inputs[:n_state]), inputs[n_state:]
    n_out = _n_outputs - n_state
    in_axes = _flags(scan_input_axes, num_scan_inputs, "scan_input_axes")
    in_dirs = _flags(scan_input_directions, num_scan_inputs, "scan_input_directions")
    out_axes = _flags(scan_output_axes, n_out, "scan_output_axes")
    out_dirs = _flags(scan_output_directions, n_out, "scan_output_directions")
    slices = []
    for x, axis, direction in zip(scan_in, in_axes, in_dirs):
        x = torch.movedim(x, axis, 0)
        slices.append(x.flip(0) if direction else x)
    states, frames = _run_scan(body, _ctx, states, slices, n_out, _scan_length(slices))
    outputs = []
    for k, (f, axis, direction) in enumerate(zip(frames, out_axes, out_dirs)):
        y = _stack(f, body, n_state + k, "Scan", device)
        y = y.flip(0) if direction else y
        outputs.append(torch.movedim(y, 0, axis % y.dim()))
    return _pack(states + outputs)


def _batch_scan_output(
    frames: list[list[torch.Tensor]], max_len: int, body: Any, index: int, device: torch.device
) -> torch.Tensor:
    """Stack per-batch scan frames into [batch, max_len, ...], zero-padding short sequences."""
    template = next((f[0] for f in frames if f), None)
    if template is None:
        return torch.stack([_empty_output(body, index, device)] * len(frames))
    out = template.new_zeros((len(frames), max_len, *template.shape))
    for b, f in enumerate(frames):
        if f:
            out[b, : len(f)] = _stack(f, body, index, "Scan", device)
    return out


@register("Scan", since=1, backend="cuda")
def scan_8(
    sequence_lens: torch.Tensor | None,
    *inputs: torch.Tensor,
    body: Any,
    num_scan_inputs: int,
    directions: list[int] | None = None,
    _ctx: Any,
    _n_outputs: int = 1,
) -> Value:
    """Scan (opset 8): axis 0 of every input is a batch, axis 1 of scan inputs the sequence.

    Each batch entry is scanned separately for ``sequence_lens[b]`` steps; scan outputs of shorter
    sequences are padded with zeros to the longest one.
    """
    n_state = len(inputs) - num_scan_inputs
    if n_state < 0:
        raise ValueError(f"Scan: num_scan_inputs={num_scan_inputs} exceeds {len(inputs)} inputs.")
    device = _device_of(*inputs)
    scan_in = inputs[n_state:]
    dirs = _flags(directions, num_scan_inputs, "directions")
    batch = inputs[0].shape[0]
    max_len = scan_in[0].shape[1] if scan_in else 0
    # the per-batch step counts drive the host loop
    lens = [max_len] * batch if sequence_lens is None else _flat(host_list(sequence_lens))
    if len(lens) != batch or any(n < 0 or n > max_len for n in lens):
        raise ValueError(
            f"Scan: sequence_lens must have {batch} entries between 0 and {max_len}, got {lens}."
        )
    n_out = _n_outputs - n_state
    final_states: list[list[Value]] = []
    frames: list[list[list[torch.Tensor]]] = [[] for _ in range(n_out)]
    for b in range(batch):
        n = int(lens[b])
        slices = [x[b, :n].flip(0) if d else x[b, :n] for x, d in zip(scan_in, dirs)]
        states = [s[b] for s in inputs[:n_state]]
        states, batch_frames = _run_scan(body, _ctx, states, slices, n_out, n)
        final_states.append(states)
        for k, f in enumerate(batch_frames):
            frames[k].append(f)
    outputs = [torch.stack(s) for s in zip(*final_states)]
    outputs += [
        _batch_scan_output(f, max_len, body, n_state + k, device) for k, f in enumerate(frames)
    ]
    return _pack(outputs)


@register("SequenceMap", since=1, backend="cuda")
def sequence_map(
    input_sequence: list[torch.Tensor],
    *additional_inputs: Value,
    body: Any,
    _ctx: Any,
    _n_outputs: int = 1,
) -> Value:
    """Apply ``body`` to each element of ``input_sequence`` (and of sequence additional inputs;
    tensor additional inputs are passed whole to every call); each output is a sequence."""
    n = len(input_sequence)
    for extra in additional_inputs:
        if isinstance(extra, list) and len(extra) != n:
            raise ValueError(
                f"SequenceMap: an additional sequence has {len(extra)} elements; the input "
                f"sequence has {n}."
            )
    results: list[list[torch.Tensor]] = [[] for _ in range(_n_outputs)]
    for i in range(n):
        args = [input_sequence[i]]
        args += [a[i] if isinstance(a, list) else a for a in additional_inputs]
        for seq, value in zip(results, _ctx.run_graph(body, args)):
            seq.append(value)
    return _pack(results)
