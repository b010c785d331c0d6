"""Recurrent layers on the device: RNN, GRU, LSTM.

As the reference: the input projection ``X @ W^T + Wb`` of every time step is one matmul, then a
per-direction loop over time applies the cell (the recurrence is inherently sequential). With
``sequence_lens``, steps past a sample's length leave its state unchanged and write zeros to ``Y``
(onnxruntime's behaviour); the lengths stay on the device and act as a mask, so no value is read
back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tensorkiln.kernels.registry import register

Act = Callable[[torch.Tensor], torch.Tensor]
State = tuple[torch.Tensor, ...]
Step = Callable[[torch.Tensor, State], State]


def _leaky(x, a, b):
    return torch.where(x >= 0, x, a * x)


def _elu(x, a, b):
    return torch.where(x >= 0, x, a * torch.expm1(torch.clamp(x, max=0)))


# name -> (function of (x, alpha, beta), default alpha, default beta); None: takes no such parameter
_ACTIVATIONS: dict[str, tuple[Callable, float | None, float | None]] = {
    "relu": (lambda x, a, b: torch.relu(x), None, None),
    "tanh": (lambda x, a, b: torch.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: torch.sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (_leaky, 0.01, None),
    "thresholdedrelu": (lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x)), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * torch.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: torch.clamp(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (_elu, 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + torch.abs(x)), None, None),
    "softplus": (lambda x, a, b: torch.logaddexp(x, torch.zeros_like(x)), None, None),
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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _clipper(clip: float | None) -> Act:
    if clip is None:
        return lambda x: x
    return lambda x: torch.clamp(x, -clip, clip)


def _num_directions(direction: str) -> int:
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ValueError(
            f"direction must be 'forward', 'reverse' or 'bidirectional', got '{direction}'"
        )
    return 2 if direction == "bidirectional" else 1


def _run_direction(
    xw: torch.Tensor, state: State, step: Step, lengths: torch.Tensor | None, reverse: bool
) -> tuple[torch.Tensor, State]:
    """Loop over time. ``xw``: [T, B, G*H] input projections; returns Y [T, B, H] and the state."""
    seq_len = xw.shape[0]
    ys: list[torch.Tensor | None] = [None] * seq_len
    for t in range(seq_len - 1, -1, -1) if reverse else range(seq_len):
        new = step(xw[t], state)
        if lengths is None:
            ys[t] = new[0]
        else:
            active = (lengths > t).unsqueeze(1)
            new = tuple(torch.where(active, n, s) for n, s in zip(new, state))
            ys[t] = torch.where(active, new[0], torch.zeros_like(new[0]))
        state = new
    if not seq_len:
        return state[0].new_zeros((0, *state[0].shape)), state
    return torch.stack(ys), state  # type: ignore[arg-type]


def _recurrent(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    sequence_lens: torch.Tensor | None,
    initial: Sequence[torch.Tensor | None],
    make_step: Callable[[int, torch.Tensor], Step],
    *,
    n_gates: int,
    direction: str,
    layout: int,
) -> tuple[torch.Tensor, ...]:
    """Shared driver: returns (Y, final state...) in the output layout and ``x``'s dtype.

    ``make_step(d, rb)`` builds direction ``d``'s step from its recurrence bias ``rb``.
    """
    num_dirs = _num_directions(direction)
    ct = _compute_dtype(x.dtype)
    if x.dim() != 3:
        raise ValueError(f"X must be rank 3, got shape {tuple(x.shape)}")
    if layout:
        x = x.transpose(0, 1)
        initial = [None if s is None else s.transpose(0, 1) for s in initial]
    if w.shape[0] != num_dirs:
        raise ValueError(f"W has {w.shape[0]} directions but direction='{direction}'")
    batch = x.shape[1]
    hidden = w.shape[1] // n_gates
    if b is None:
        bias = torch.zeros((num_dirs, 2 * n_gates * hidden), dtype=ct, device=x.device)
    else:
        bias = b.to(ct)
    lengths = None if sequence_lens is None else sequence_lens.reshape(batch).to(torch.int64)
    xc = x.to(ct)
    ys, finals = [], []
    for d in range(num_dirs):
        wb, rb = bias[d, : n_gates * hidden], bias[d, n_gates * hidden :]
        xw = torch.matmul(xc, w[d].to(ct).T) + wb  # all time steps at once
        state = tuple(
            torch.zeros((batch, hidden), dtype=ct, device=x.device) if s is None else s[d].to(ct)
            for s in initial
        )
        reverse = direction == "reverse" or d == 1
        y, final = _run_direction(xw, state, make_step(d, rb), lengths, reverse)
        ys.append(y)
        finals.append(final)
    y = torch.stack(ys, dim=1)  # [T, D, B, H]
    outs = [y.permute(2, 0, 1, 3) if layout else y]
    for k in range(len(initial)):
        s = torch.stack([f[k] for f in finals])  # [D, B, H]
        outs.append(s.transpose(0, 1) if layout else s)
    return tuple(o.to(x.dtype) for o in outs)


def _weights(r: torch.Tensor, ct: torch.dtype) -> list[torch.Tensor]:
    return [r[d].to(ct).T for d in range(r.shape[0])]


def _check_hidden(hidden_size: int | None, r: torch.Tensor) -> None:
    if hidden_size is not None and hidden_size != r.shape[-1]:
        raise ValueError(f"hidden_size={hidden_size} but R has shape {tuple(r.shape)}")


@register("RNN", since=1, backend="cuda")
def rnn(
    x: torch.Tensor,
    w: torch.Tensor,
    r: torch.Tensor,
    b: torch.Tensor | None = None,
    sequence_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
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
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Elman RNN: H = f(X W^T + H R^T + Wb + Rb)."""
    _check_hidden(hidden_size, r)
    acts = _activations(
        activations, activation_alpha, activation_beta, ["Tanh"], _num_directions(direction)
    )
    rt, cl = _weights(r, _compute_dtype(x.dtype)), _clipper(clip)

    def make_step(d: int, rb: torch.Tensor) -> Step:
        f = acts[d][0]
        return lambda xw, s: (f(cl(torch.addmm(xw + rb, s[0], rt[d]))),)

    outs = _recurrent(
        x, w, b, sequence_lens, [initial_h], make_step, n_gates=1, direction=direction,
        layout=layout,
    )  # fmt: skip
    return outs[0] if _n_outputs <= 1 else outs[:_n_outputs]


@register("GRU", since=1, backend="cuda")
def gru(
    x: torch.Tensor,
    w: torch.Tensor,
    r: torch.Tensor,
    b: torch.Tensor | None = None,
    sequence_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
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
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """GRU with gates (z, r, h); ``linear_before_reset`` applies r after the recurrence matmul."""
    _check_hidden(hidden_size, r)
    acts = _activations(
        activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"],
        _num_directions(direction),
    )  # fmt: skip
    rt, cl = _weights(r, _compute_dtype(x.dtype)), _clipper(clip)
    hid = r.shape[-1]

    def make_step(d: int, rb: torch.Tensor) -> Step:
        f, g = acts[d]
        r_zr, r_h = rt[d][:, : 2 * hid], rt[d][:, 2 * hid :]
        rb_zr, rb_h = rb[: 2 * hid], rb[2 * hid :]

        def step(xw: torch.Tensor, s: State) -> State:
            h = s[0]
            zr = torch.addmm(xw[:, : 2 * hid] + rb_zr, h, r_zr)
            z, rg = f(cl(zr[:, :hid])), f(cl(zr[:, hid:]))
            if linear_before_reset:
                pre = xw[:, 2 * hid :] + rg * torch.addmm(rb_h, h, r_h)
            else:
                pre = torch.addmm(xw[:, 2 * hid :] + rb_h, rg * h, r_h)
            return ((1 - z) * g(cl(pre)) + z * h,)

        return step

    outs = _recurrent(
        x, w, b, sequence_lens, [initial_h], make_step, n_gates=3, direction=direction,
        layout=layout,
    )  # fmt: skip
    return outs[0] if _n_outputs <= 1 else outs[:_n_outputs]


@register("LSTM", since=1, backend="cuda")
def lstm(
    x: torch.Tensor,
    w: torch.Tensor,
    r: torch.Tensor,
    b: torch.Tensor | None = None,
    sequence_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
    initial_c: torch.Tensor | None = None,
    p: torch.Tensor | None = None,
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
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """LSTM with gates (i, o, f, c), optional peepholes P = (p_i, p_o, p_f)."""
    outs = lstm_layer(
        x, w, r, b, sequence_lens, initial_h, initial_c, p,
        activation_alpha=activation_alpha, activation_beta=activation_beta,
        activations=activations, clip=clip, direction=direction, hidden_size=hidden_size,
        input_forget=input_forget, layout=layout,
    )  # fmt: skip
    return outs[0] if _n_outputs <= 1 else outs[:_n_outputs]


def lstm_layer(
    x: torch.Tensor,
    w: torch.Tensor,
    r: torch.Tensor,
    b: torch.Tensor | None = None,
    sequence_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
    initial_c: torch.Tensor | None = None,
    p: torch.Tensor | None = None,
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
) -> tuple[torch.Tensor, ...]:
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

    def make_step(d: int, rb: torch.Tensor) -> Step:
        f, g, h_act = acts[d]
        peep = None if p is None else p[d].to(ct)

        def step(xw: torch.Tensor, s: State) -> State:
            h, c = s
            h = h if recurrent_input is None else recurrent_input(h)
            gates = torch.addmm(xw + rb, h, rt[d])
            gi, go = gates[:, :hid], gates[:, hid : 2 * hid]
            gf, gc = gates[:, 2 * hid : 3 * hid], gates[:, 3 * hid :]
            if peep is not None:
                gi, gf = gi + peep[:hid] * c, gf + peep[2 * hid :] * c
            i = f(cl(gi))
            fg = 1 - i if input_forget else f(cl(gf))
            c_new = fg * c + i * g(cl(gc))
            if peep is not None:
                go = go + peep[hid : 2 * hid] * c_new
            o = f(cl(go))
            return o * h_act(c_new), c_new

        return step

    outs = _recurrent(
        x, w, b, sequence_lens, [initial_h, initial_c], make_step, n_gates=4,
        direction=direction, layout=layout,
    )  # fmt: skip
    return outs
