"""Optimizer steps against torch.optim (an independent implementation) on fresh random tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.ort_oracle import run_kernel

TRAINING = "ai.onnx.preview.training"


def _tensors(rng, n=2):
    shapes = [tuple(rng.integers(1, 5, size=rng.integers(1, 3))) for _ in range(n)]
    return [rng.standard_normal(s) for s in shapes], [rng.standard_normal(s) for s in shapes]


def _torch(opt_cls, xs, gs, steps, **kw):
    params = [torch.tensor(x, requires_grad=True) for x in xs]
    opt = opt_cls(params, **kw)
    for _ in range(steps):
        for p, g in zip(params, gs):
            p.grad = torch.tensor(g)
        opt.step()
    return [p.detach().numpy() for p in params]


def _steps(op, lr, xs, gs, states, attrs, steps):
    """Run ``steps`` updates with fixed gradients, threading X and the states through."""
    n = len(xs)
    for t in range(steps):
        inputs = {"R": np.array(lr), "T": np.array(t, dtype=np.int64)}
        for i, v in enumerate([*xs, *gs, *[s for group in states for s in group]]):
            inputs[f"in{i}"] = v
        out = run_kernel(op, inputs, attrs, domain=TRAINING, opset=1)
        assert all(o.dtype == x.dtype for o, x in zip(out, xs))
        xs = out[:n]
        states = [out[n * (k + 1) : n * (k + 2)] for k in range(len(states))]
    return xs


def test_adagrad_matches_torch():
    rng = np.random.default_rng()
    xs, gs = _tensors(rng)
    decay = float(rng.uniform(0, 0.5))
    attrs = {"decay_factor": decay, "epsilon": 1e-6}
    got = _steps("Adagrad", 0.1, xs, gs, [[np.zeros_like(x) for x in xs]], attrs, 3)
    ref = _torch(torch.optim.Adagrad, xs, gs, 3, lr=0.1, lr_decay=decay, eps=1e-6)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)


def test_adam_first_step():
    rng = np.random.default_rng()
    xs, gs = _tensors(rng)
    alpha, beta = float(rng.uniform(0.8, 0.95)), float(rng.uniform(0.95, 0.999))
    zeros = [np.zeros_like(x) for x in xs]
    # ONNX's T=0 step has no bias correction, torch's first step has: check it by hand
    attrs = {"alpha": alpha, "beta": beta, "epsilon": 0.0}  # (the schema's default is 1e-6)
    first = _steps("Adam", 0.01, xs, gs, [zeros, zeros], attrs, 1)
    # after the uncorrected T=0 step every x moved by exactly lr * g / |g| * (1 - alpha) / sqrt(1 - beta)
    for f, x, g in zip(first, xs, gs):
        step = 0.01 * (1 - alpha) * np.sign(g) / np.sqrt(1 - beta)
        np.testing.assert_allclose(f, x - step, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["standard", "nesterov"])
def test_momentum_matches_torch(mode):
    rng = np.random.default_rng()
    xs, gs = _tensors(rng)
    alpha, beta = float(rng.uniform(0.5, 0.95)), float(rng.uniform(0.5, 1.0))
    attrs = {"alpha": alpha, "beta": beta, "mode": mode, "norm_coefficient": 0.0}
    got = _steps("Momentum", 0.05, xs, gs, [[np.zeros_like(x) for x in xs]], attrs, 3)
    ref = (
        _torch(
            torch.optim.SGD,
            xs,
            gs,
            3,
            lr=0.05,
            momentum=alpha,
            dampening=1 - beta,
            nesterov=mode == "nesterov",
        )
        if mode == "standard" or beta == 1.0
        else None
    )
    if ref is None:  # torch's nesterov needs dampening 0: compare against beta = 1
        attrs["beta"] = 1.0
        got = _steps("Momentum", 0.05, xs, gs, [[np.zeros_like(x) for x in xs]], attrs, 3)
        ref = _torch(torch.optim.SGD, xs, gs, 3, lr=0.05, momentum=alpha, nesterov=True)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)


def test_bad_input_count():
    with pytest.raises(ValueError, match="multiple of 3"):
        run_kernel(
            "Adagrad",
            {"R": np.array(0.1), "T": np.array(0), "a": np.ones(2)},
            domain=TRAINING,
            opset=1,
        )
