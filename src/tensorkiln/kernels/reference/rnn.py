"""Recurrent layers: RNN, GRU, LSTM.

All three share one driver: the input projection ``X @ W^T + Wb`` is computed for every time step in
one matmul, then a per-direction loop over time applies the cell's step function. ``sequence_lens``
is honoured the way onnxruntime does it: steps past a sample's length leave its state unchanged and
write zeros to ``Y``, so ``Y_h``/``Y_c`` hold the state after the last valid step (for the reverse
direction the walk starts at step ``length - 1``).

The behaviour is the same from opset 1 to 22 (opset 14 added ``layout``, 22 bfloat16; opset 1's
``output_sequence`` only said whether ``Y`` is produced), so each op is registered once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tensorkiln.kernels.registry import register

Act = Callable[[np.ndarray], np.ndarray]
State = tuple[np.ndarray, ...]
Step = Callable[[np.ndarray, State], State]

# name -> (function of (x, alpha, beta), default alpha, default beta); None: takes no such parameter
_ACTIVATIONS: dict[str, tuple[Callable, float | None, float | None]] = {
    "relu": (lambda x, a, b: np.maximum(x, 0), None, None),
    "tanh": (lambda x, a, b: np.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: 1.0 / (1.0 + np.exp(-x)), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: np.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: np.where(x > a, x, 0), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * np.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: np.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: np.where(x >= 0, x, a * np.expm1(np.minimum(x, 0))), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + np.abs(x)), None, None),
    "softplus": (lambda x, a, b: np.logaddexp(x, 0), None, None),
}


def _activations(
    names: Sequence[str] | None,
    alphas: Sequence[float] | None,
    betas: Sequence[float] | None,
    defaults: Sequence[str],
    num_directions: int,
) -> list[list[Act]]:
    """Per direction, the activation functions; alphas/betas are consumed in order by the
    functions that take them (as onnxruntime does), falling back to each function's default."""
    n = len(defaults)
    names = list(names) if names else list(defaults) * num_directions
    if len(names) == n and num_directions == 2:
        names = names * 2
    if len(names) != n * num_directions:
        raise ValueError(
            f"activations has {len(names)} entries; expected {n * num_directions} "
            f"({n} per direction, {num_directions} direction(s))"
        )
    alpha_it, beta_it = iter(alphas or []), iter(betas or [])
    funcs: list[Act] = []
    for name in names:
        key = name.lower()
        if key not in _ACTIVATIONS:
            raise ValueError(f"unknown activation '{name}'; known: {sorted(_ACTIVATIONS)}")
        fn, da, db = _ACTIVATIONS[key]
        a = next(alpha_it, da) if da is not None else None
        b = next(beta_it, db) if db is not None else None
        funcs.append(lambda x, fn=fn, a=a, b=b: fn(x, a, b))
    return [funcs[d * n : (d + 1) * n] for d in range(num_directions)]


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _clipper(clip: float | None) -> Act:
    if clip is None:
        return lambda x: x
    return lambda x: np.clip(x, -clip, clip)


def _num_directions(direction: str) -> int:
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ValueError(
            f"direction must be 'forward', 'reverse' or 'bidirectional', got '{direction}'"
        )
    return 2 if direction == "bidirectional" else 1


def _run_direction(
    xw: np.ndarray, state: State, step: Step, lengths: np.ndarray | None, reverse: bool
) -> tuple[np.ndarray, State]:
    """Loop over time. ``xw``: [T, B, G*H] input projections; returns Y [T, B, H] and the state."""
    seq_len = xw.shape[0]
    ys = np.zeros((seq_len, *state[0].shape), dtype=state[0].dtype)
    for t in range(seq_len - 1, -1, -1) if reverse else range(seq_len):
        new = step(xw[t], state)
        if lengths is None:
            ys[t] = new[0]
        else:
            active = (t < lengths)[:, None]
            new = tuple(np.where(active, n, s) for n, s in zip(new, state))
            ys[t] = np.where(active, new[0], 0)
        state = new
    return ys, state


def _recurrent(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    sequence_lens: np.ndarray | None,
    initial: Sequence[np.ndarray | None],
    make_step: Callable[[int, np.ndarray], Step],
    *,
    n_gates: int,
    direction: str,
    layout: int,
) -> tuple[np.ndarray, ...]:
    """Shared driver: returns (Y, final state...) in the output layout and ``x``'s dtype.

    ``make_step(d, rb)`` builds direction ``d``'s step from its recurrence bias ``rb``.
    """
    num_dirs = _num_directions(direction)
    ct = _compute_dtype(x.dtype)
    if x.ndim != 3:
        raise ValueError(f"X must be rank 3, got shape {x.shape}")
    if layout:
        x = x.transpose(1, 0, 2)
        initial = [None if s is None else s.transpose(1, 0, 2) for s in initial]
    if w.shape[0] != num_dirs:
        raise ValueError(f"W has {w.shape[0]} directions but direction='{direction}'")
    seq_len, batch, _ = x.shape
    hidden = w.shape[1] // n_gates
    bias = np.zeros((num_dirs, 2 * n_gates * hidden), ct) if b is None else b.astype(ct)
    lengths = None
    if sequence_lens is not None and np.any(np.asarray(sequence_lens) != seq_len):
        lengths = np.asarray(sequence_lens).astype(np.int64).reshape(batch)
        if np.any(lengths < 0) or np.any(lengths > seq_len):
            raise ValueError(f"sequence_lens {lengths.tolist()} out of range [0, {seq_len}]")
    xc = x.astype(ct)
    ys, finals = [], []
    for d in range(num_dirs):
        wb, rb = bias[d, : n_gates * hidden], bias[d, n_gates * hidden :]
        xw = np.matmul(xc, w[d].astype(ct).T) + wb  # all time steps at once
        state = tuple(
            np.zeros((batch, hidden), ct) if s is None else s[d].astype(ct) for s in initial
        )
        reverse = direction == "reverse" or d == 1
        y, final = _run_direction(xw, state, make_step(d, rb), lengths, reverse)
        ys.append(y)
        finals.append(final)
    y = np.stack(ys, axis=1)  # [T, D, B, H]
    outs = [y.transpose(2, 0, 1, 3) if layout else y]
    for k in range(len(initial)):
        s = np.stack([f[k] for f in finals])  # [D, B, H]
        outs.append(s.transpose(1, 0, 2) if layout else s)
    return tuple(o.astype(x.dtype) for o in outs)


def _weights(r: np.ndarray, ct: np.dtype) -> list[np.ndarray]:
    return [r[d].astype(ct).T for d in range(r.shape[0])]


def _check_hidden(hidden_size: int | None, r: np.ndarray) -> None:
    if hidden_size is not None and hidden_size != r.shape[-1]:
        raise ValueError(f"hidden_size={hidden_size} but R has shape {r.shape}")


@register("RNN", since=1)
def rnn(
    x: np.ndarray,
    w: np.ndarray,
    r: np.ndarray,
    b: np.ndarray | None = None,
    sequence_lens: np.ndarray | None = None,
    initial_h: np.ndarray | None = None,
    *,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    output_sequence: int = 0,
    _n_outputs: int = 2,
) -> tuple[np.ndarray, ...]:
    """Elman RNN: H = f(X W^T + H R^T + Wb + Rb)."""
    _check_hidden(hidden_size, r)
    acts = _activations(
        activations, activation_alpha, activation_beta, ["Tanh"], _num_directions(direction)
    )
    rt, cl = _weights(r, _compute_dtype(x.dtype)), _clipper(clip)

    def make_step(d: int, rb: np.ndarray) -> Step:
        f = acts[d][0]
        return lambda xw, s: (f(cl(xw + s[0] @ rt[d] + rb)),)

    outs = _recurrent(
        x, w, b, sequence_lens, [initial_h], make_step, n_gates=1, direction=direction,
        layout=layout,
    )  # fmt: skip
    return outs[: max(_n_outputs, 1)]


@register("GRU", since=1)
def gru(
    x: np.ndarray,
    w: np.ndarray,
    r: np.ndarray,
    b: np.ndarray | None = None,
    sequence_lens: np.ndarray | None = None,
    initial_h: np.ndarray | None = None,
    *,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    layout: int = 0,
    linear_before_reset: int = 0,
    output_sequence: int = 0,
    _n_outputs: int = 2,
) -> tuple[np.ndarray, ...]:
    """GRU with gates (z, r, h); ``linear_before_reset`` applies r after the recurrence matmul."""
    _check_hidden(hidden_size, r)
    acts = _activations(
        activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"],
        _num_directions(direction),
    )  # fmt: skip
    rt, cl = _weights(r, _compute_dtype(x.dtype)), _clipper(clip)
    hid = r.shape[-1]

    def make_step(d: int, rb: np.ndarray) -> Step:
        f, g = acts[d]
        r_zr, r_h = rt[d][:, : 2 * hid], rt[d][:, 2 * hid :]
        rb_zr, rb_h = rb[: 2 * hid], rb[2 * hid :]

        def step(xw: np.ndarray, s: State) -> State:
            h = s[0]
            zr = xw[:, : 2 * hid] + h @ r_zr + rb_zr
            z, rg = f(cl(zr[:, :hid])), f(cl(zr[:, hid:]))
            if linear_before_reset:
                pre = xw[:, 2 * hid :] + rg * (h @ r_h + rb_h)
            else:
                pre = xw[:, 2 * hid :] + (rg * h) @ r_h + rb_h
            return ((1 - z) * g(cl(pre)) + z * h,)

        return step

    outs = _recurrent(
        x, w, b, sequence_lens, [initial_h], make_step, n_gates=3, direction=direction,
        layout=layout,
    )  # fmt: skip
    return outs[: max(_n_outputs, 1)]


@register("LSTM", since=1)
def lstm(
    x: np.ndarray,
    w: np.ndarray,
    r: np.ndarray,
    b: np.ndarray | None = None,
    sequence_lens: np.ndarray | None = None,
    initial_h: np.ndarray | None = None,
    initial_c: np.ndarray | None = None,
    p: np.ndarray | None = None,
    *,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    layout: int = 0,
    output_sequence: int = 0,
    _n_outputs: int = 3,
) -> tuple[np.ndarray, ...]:
    """LSTM with gates (i, o, f, c), optional peepholes P = (p_i, p_o, p_f)."""
    outs = lstm_layer(
        x, w, r, b, sequence_lens, initial_h, initial_c, p,
        activation_alpha=activation_alpha, activation_beta=activation_beta,
        activations=activations, clip=clip, direction=direction, hidden_size=hidden_size,
        input_forget=input_forget, layout=layout,
    )  # fmt: skip
    return outs[: max(_n_outputs, 1)]


def lstm_layer(
    x: np.ndarray,
    w: np.ndarray,
    r: np.ndarray,
    b: np.ndarray | None = None,
    sequence_lens: np.ndarray | None = None,
    initial_h: np.ndarray | None = None,
    initial_c: np.ndarray | None = None,
    p: np.ndarray | None = None,
    *,
    activation_alpha: list[float] | None = None,
    activation_beta: list[float] | None = None,
    activations: list[str] | None = None,
    clip: float | None = None,
    direction: str = "forward",
    hidden_size: int | None = None,
    input_forget: int = 0,
    layout: int = 0,
    recurrent_input: Act | None = None,
) -> tuple[np.ndarray, ...]:
    """LSTM with gates (i, o, f, c), optional peepholes P = (p_i, p_o, p_f); returns (Y, Y_h,
    Y_c). ``recurrent_input`` maps the hidden state before it is multiplied by R (a quantized
    LSTM rounds it to its activation grid there); the state itself is kept as it is."""
    _check_hidden(hidden_size, r)
    acts = _activations(
        activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh", "Tanh"],
        _num_directions(direction),
    )  # fmt: skip
    ct = _compute_dtype(x.dtype)
    rt, cl = _weights(r, ct), _clipper(clip)
    hid = r.shape[-1]
    peep = np.zeros((r.shape[0], 3 * hid), ct) if p is None else p.astype(ct)

    def make_step(d: int, rb: np.ndarray) -> Step:
        f, g, h_act = acts[d]
        p_i, p_o, p_f = peep[d, :hid], peep[d, hid : 2 * hid], peep[d, 2 * hid :]

        def step(xw: np.ndarray, s: State) -> State:
            h, c = s
            h = h if recurrent_input is None else recurrent_input(h)
            gates = xw + h @ rt[d] + rb
            i = f(cl(gates[:, :hid] + p_i * c))
            if input_forget:
                fg = 1 - i
            else:
                fg = f(cl(gates[:, 2 * hid : 3 * hid] + p_f * c))
            c_new = fg * c + i * g(cl(gates[:, 3 * hid :]))
            o = f(cl(gates[:, hid : 2 * hid] + p_o * c_new))
            return o * h_act(c_new), c_new

        return step

    outs = _recurrent(
        x, w, b, sequence_lens, [initial_h, initial_c], make_step, n_gates=4,
        direction=direction, layout=layout,
    )  # fmt: skip
    return outs
