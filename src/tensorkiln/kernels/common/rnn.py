"""Recurrent layers written once: RNN, GRU and LSTM for both kernel trees (com.microsoft's
DynamicQuantizeLSTM, an LSTM over quantized weights, is kernels/common/contrib.py's).

All share one driver: the input projection ``X @ W^T + Wb`` is computed for every time step in one
matmul, then a per-direction loop over time applies the cell's step function (the recurrence is
inherently sequential). ``sequence_lens`` is honoured the way onnxruntime does it: steps past a
sample's length leave its state unchanged and write zeros to ``Y``, so ``Y_h``/``Y_c`` hold the
state after the last valid step (for the reverse direction the walk starts at step
``length - 1``); the lengths act as a mask, so on the device they are never read back.

The behaviour is the same from opset 1 to 22 (opset 14 added ``layout``, 22 bfloat16; opset 1's
``output_sequence`` only said whether ``Y`` is produced), so each op is registered once.

The array operations go through an :class:`RnnArrays` adapter each backend supplies (numpy in
kernels/reference/rnn.py, torch in kernels/cuda/rnn.py, where a step's GEMM and bias add are one
``addmm``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

Act = Callable[[Any], Any]
State = tuple[Any, ...]
Step = Callable[[Any, State], State]


class RnnArrays(Protocol):
    """The array operations the recurrent layers need, on one backend's arrays."""

    float32: Any  # the backend's float32 dtype
    m: Any  # the array module (numpy or torch): matmul, where, tanh, expm1, abs as it spells them

    def compute_dtype(self, x: Any) -> Any:
        """float64 for float64 inputs, else float32."""

    def astype(self, x: Any, dtype: Any) -> Any: ...

    def zeros(self, shape: tuple[int, ...], dtype: Any, like: Any) -> Any: ...

    def addmm(self, c: Any, a: Any, b: Any) -> Any:
        """``c + a @ b`` for 2-D ``a`` and ``b``."""

    def swap01(self, x: Any) -> Any:
        """``x`` with its first two axes swapped."""

    def stack(self, arrays: list[Any], axis: int) -> Any: ...

    def permute(self, x: Any, perm: tuple[int, ...]) -> Any: ...

    def clip(self, x: Any, lo: float | None, hi: float | None) -> Any: ...

    def lengths(self, sequence_lens: Any, batch: int, seq_len: int) -> Any:
        """The per-sample step counts as an int64 [batch] array, or None when every sample runs
        ``seq_len`` steps."""

    def dtype_name(self, x: Any) -> str:
        """``x``'s dtype as numpy spells it (int8, uint8, float32, ...)."""

    def sigmoid(self, x: Any) -> Any: ...

    def logaddexp0(self, x: Any) -> Any:
        """log(exp(x) + 1), without overflow."""


# name -> (function of (xp, x, alpha, beta), default alpha, default beta); None: no such parameter
_ACTIVATIONS: dict[str, tuple[Callable, float | None, float | None]] = {
    "relu": (lambda xp, x, a, b: xp.m.where(x < 0, 0, x), None, None),
    "tanh": (lambda xp, x, a, b: xp.m.tanh(x), None, None),
    "sigmoid": (lambda xp, x, a, b: xp.sigmoid(x), None, None),
    "affine": (lambda xp, x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda xp, x, a, b: xp.m.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda xp, x, a, b: xp.m.where(x > a, x, 0), 1.0, None),
    "scaledtanh": (lambda xp, x, a, b: a * xp.m.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda xp, x, a, b: xp.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (
        lambda xp, x, a, b: xp.m.where(x >= 0, x, a * xp.m.expm1(xp.clip(x, None, 0))),
        1.0,
        None,
    ),
    "softsign": (lambda xp, x, a, b: x / (1 + xp.m.abs(x)), None, None),
    "softplus": (lambda xp, x, a, b: xp.logaddexp0(x), None, None),
}


def num_directions(direction: str) -> int:
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ValueError(
            f"direction must be 'forward', 'reverse' or 'bidirectional', got '{direction}'"
        )
    return 2 if direction == "bidirectional" else 1


def activation_specs(
    names: Sequence[str] | None,
    alphas: Sequence[float] | None,
    betas: Sequence[float] | None,
    defaults: Sequence[str],
    directions: int,
) -> list[list[tuple[str, float | None, float | None]]]:
    """Per direction, each activation's (name, alpha, beta); alphas/betas are consumed in order by
    the functions that take them (as onnxruntime does), falling back to each one's default."""
    n = len(defaults)
    names = list(names) if names else list(defaults) * directions
    if len(names) == n and directions == 2:
        names = names * 2
    if len(names) != n * directions:
        raise ValueError(
            f"activations has {len(names)} entries; expected {n * directions} "
            f"({n} per direction, {directions} direction(s))"
        )
    alpha_it, beta_it = iter(alphas or []), iter(betas or [])
    specs = []
    for name in names:
        key = name.lower()
        if key not in _ACTIVATIONS:
            raise ValueError(f"unknown activation '{name}'; known: {sorted(_ACTIVATIONS)}")
        _, da, db = _ACTIVATIONS[key]
        a = next(alpha_it, da) if da is not None else None
        b = next(beta_it, db) if db is not None else None
        specs.append((key, a, b))
    return [specs[d * n : (d + 1) * n] for d in range(directions)]


def check_hidden(hidden_size: int | None, r_shape: Sequence[int]) -> None:
    if hidden_size is not None and hidden_size != r_shape[-1]:
        raise ValueError(f"hidden_size={hidden_size} but R has shape {tuple(r_shape)}")


class Recurrent:
    """RNN, GRU and LSTM over one backend's :class:`RnnArrays` (register the bound methods)."""

    def __init__(self, xp: RnnArrays) -> None:
        self.xp = xp

    def _activations(self, names, alphas, betas, defaults, direction: str) -> list[list[Act]]:
        specs = activation_specs(names, alphas, betas, defaults, num_directions(direction))
        xp = self.xp
        return [
            [lambda x, f=_ACTIVATIONS[k][0], a=a, b=b: f(xp, x, a, b) for k, a, b in per_dir]
            for per_dir in specs
        ]

    def _clipper(self, clip: float | None) -> Act:
        if clip is None:
            return lambda x: x
        return lambda x: self.xp.clip(x, -clip, clip)

    def _run_direction(
        self, xw: Any, state: State, step: Step, lengths: Any, reverse: bool
    ) -> tuple[Any, State]:
        """Loop over time. ``xw``: [T, B, G*H] input projections; returns Y [T, B, H] and the
        final state."""
        seq_len = xw.shape[0]
        ys: list[Any] = [None] * seq_len
        for t in range(seq_len - 1, -1, -1) if reverse else range(seq_len):
            new = step(xw[t], state)
            if lengths is None:
                ys[t] = new[0]
            else:
                active = (lengths > t)[:, None]
                new = tuple(self.xp.m.where(active, n, s) for n, s in zip(new, state))
                ys[t] = self.xp.m.where(active, new[0], 0)
            state = new
        if not seq_len:
            return self.xp.zeros((0, *state[0].shape), state[0].dtype, state[0]), state
        return self.xp.stack(ys, 0), state

    def _recurrent(
        self,
        x: Any,
        w: Any,
        b: Any,
        sequence_lens: Any,
        initial: Sequence[Any],
        make_step: Callable[[int, Any], Step],
        *,
        n_gates: int,
        direction: str,
        layout: int,
    ) -> tuple[Any, ...]:
        """The driver: returns (Y, final state...) in the output layout and ``x``'s dtype.

        ``make_step(d, rb)`` builds direction ``d``'s step from its recurrence bias ``rb``.
        """
        xp = self.xp
        num_dirs = num_directions(direction)
        ct = xp.compute_dtype(x)
        if x.ndim != 3:
            raise ValueError(f"X must be rank 3, got shape {tuple(x.shape)}")
        if layout:
            x = xp.swap01(x)
            initial = [None if s is None else xp.swap01(s) for s in initial]
        if w.shape[0] != num_dirs:
            raise ValueError(f"W has {w.shape[0]} directions but direction='{direction}'")
        seq_len, batch = x.shape[0], x.shape[1]
        hidden = w.shape[1] // n_gates
        if b is None:
            bias = xp.zeros((num_dirs, 2 * n_gates * hidden), ct, x)
        else:
            bias = xp.astype(b, ct)
        lengths = None if sequence_lens is None else xp.lengths(sequence_lens, batch, seq_len)
        xc = xp.astype(x, ct)
        ys, finals = [], []
        for d in range(num_dirs):
            wb, rb = bias[d, : n_gates * hidden], bias[d, n_gates * hidden :]
            xw = xp.m.matmul(xc, xp.astype(w[d], ct).T) + wb  # all time steps at once
            state = tuple(
                xp.zeros((batch, hidden), ct, x) if s is None else xp.astype(s[d], ct)
                for s in initial
            )
            reverse = direction == "reverse" or d == 1
            y, final = self._run_direction(xw, state, make_step(d, rb), lengths, reverse)
            ys.append(y)
            finals.append(final)
        y = xp.stack(ys, 1)  # [T, D, B, H]
        outs = [xp.permute(y, (2, 0, 1, 3)) if layout else y]
        for k in range(len(initial)):
            s = xp.stack([f[k] for f in finals], 0)  # [D, B, H]
            outs.append(xp.swap01(s) if layout else s)
        return tuple(xp.astype(o, x.dtype) for o in outs)

    def _weights(self, r: Any, ct: Any) -> list[Any]:
        return [self.xp.astype(r[d], ct).T for d in range(r.shape[0])]

    def rnn(
        self,
        x: Any,
        w: Any,
        r: Any,
        b: Any = None,
        sequence_lens: Any = None,
        initial_h: Any = None,
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
    ) -> tuple[Any, ...]:
        """Elman RNN: H = f(X W^T + H R^T + Wb + Rb)."""
        check_hidden(hidden_size, r.shape)
        acts = self._activations(
            activations, activation_alpha, activation_beta, ["Tanh"], direction
        )
        rt, cl = self._weights(r, self.xp.compute_dtype(x)), self._clipper(clip)

        def make_step(d: int, rb: Any) -> Step:
            f = acts[d][0]
            return lambda xw, s: (f(cl(self.xp.addmm(xw + rb, s[0], rt[d]))),)

        outs = self._recurrent(
            x, w, b, sequence_lens, [initial_h], make_step, n_gates=1, direction=direction,
            layout=layout,
        )  # fmt: skip
        return outs[: max(_n_outputs, 1)]

    def gru(
        self,
        x: Any,
        w: Any,
        r: Any,
        b: Any = None,
        sequence_lens: Any = None,
        initial_h: Any = None,
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
    ) -> tuple[Any, ...]:
        """GRU with gates (z, r, h); ``linear_before_reset`` applies r after the recurrence
        matmul."""
        check_hidden(hidden_size, r.shape)
        acts = self._activations(
            activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"], direction
        )
        rt, cl = self._weights(r, self.xp.compute_dtype(x)), self._clipper(clip)
        hid = r.shape[-1]
        addmm = self.xp.addmm

        def make_step(d: int, rb: Any) -> Step:
            f, g = acts[d]
            r_zr, r_h = rt[d][:, : 2 * hid], rt[d][:, 2 * hid :]
            rb_zr, rb_h = rb[: 2 * hid], rb[2 * hid :]

            def step(xw: Any, s: State) -> State:
                h = s[0]
                zr = addmm(xw[:, : 2 * hid] + rb_zr, h, r_zr)
                z, rg = f(cl(zr[:, :hid])), f(cl(zr[:, hid:]))
                if linear_before_reset:
                    pre = xw[:, 2 * hid :] + rg * addmm(rb_h, h, r_h)
                else:
                    pre = addmm(xw[:, 2 * hid :] + rb_h, rg * h, r_h)
                return ((1 - z) * g(cl(pre)) + z * h,)

            return step

        outs = self._recurrent(
            x, w, b, sequence_lens, [initial_h], make_step, n_gates=3, direction=direction,
            layout=layout,
        )  # fmt: skip
        return outs[: max(_n_outputs, 1)]

    def lstm(
        self,
        x: Any,
        w: Any,
        r: Any,
        b: Any = None,
        sequence_lens: Any = None,
        initial_h: Any = None,
        initial_c: Any = None,
        p: Any = None,
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
    ) -> tuple[Any, ...]:
        """LSTM with gates (i, o, f, c), optional peepholes P = (p_i, p_o, p_f)."""
        outs = self.lstm_layer(
            x, w, r, b, sequence_lens, initial_h, initial_c, p,
            activation_alpha=activation_alpha, activation_beta=activation_beta,
            activations=activations, clip=clip, direction=direction, hidden_size=hidden_size,
            input_forget=input_forget, layout=layout,
        )  # fmt: skip
        return outs[: max(_n_outputs, 1)]

    def lstm_layer(
        self,
        x: Any,
        w: Any,
        r: Any,
        b: Any = None,
        sequence_lens: Any = None,
        initial_h: Any = None,
        initial_c: Any = None,
        p: Any = None,
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
    ) -> tuple[Any, ...]:
        """LSTM returning (Y, Y_h, Y_c). ``recurrent_input`` maps the hidden state before it is
        multiplied by R (a quantized LSTM rounds it to its activation grid there); the state
        itself is kept as it is."""
        check_hidden(hidden_size, r.shape)
        acts = self._activations(
            activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh", "Tanh"], direction
        )
        ct = self.xp.compute_dtype(x)
        rt, cl = self._weights(r, ct), self._clipper(clip)
        hid = r.shape[-1]
        addmm = self.xp.addmm

        def make_step(d: int, rb: Any) -> Step:
            f, g, h_act = acts[d]
            peep = None if p is None else self.xp.astype(p[d], ct)

            def step(xw: Any, s: State) -> State:
                h, c = s
                h = h if recurrent_input is None else recurrent_input(h)
                gates = addmm(xw + rb, h, rt[d])
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

        return self._recurrent(
            x, w, b, sequence_lens, [initial_h, initial_c], make_step, n_gates=4,
            direction=direction, layout=layout,
        )  # fmt: skip
