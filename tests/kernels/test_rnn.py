"""RNN, GRU, LSTM reference kernels against onnxruntime and torch on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorkiln.kernels.registry import lookup
from tests.kernels.ort_oracle import check_against_ort

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
T, B, I, H = 5, 3, 4, 6


def _inputs(op: str, rng: np.random.Generator, num_dirs: int, *, layout: int = 0, lens=None):
    g = GATES[op]
    x = rng.standard_normal((B, T, I) if layout else (T, B, I)).astype(np.float32)
    ins = {
        "X": x,
        "W": rng.standard_normal((num_dirs, g * H, I)).astype(np.float32) * 0.5,
        "R": rng.standard_normal((num_dirs, g * H, H)).astype(np.float32) * 0.5,
        "B": rng.standard_normal((num_dirs, 2 * g * H)).astype(np.float32) * 0.5,
        "sequence_lens": lens,
        "initial_h": rng.standard_normal((B, num_dirs, H) if layout else (num_dirs, B, H)).astype(
            np.float32
        ),
    }
    if op == "LSTM":
        ins["initial_c"] = rng.standard_normal(ins["initial_h"].shape).astype(np.float32)
        ins["P"] = rng.standard_normal((num_dirs, 3 * H)).astype(np.float32) * 0.5
    return ins


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_against_ort(op, direction):
    rng = np.random.default_rng()
    num_dirs = 2 if direction == "bidirectional" else 1
    ins = _inputs(op, rng, num_dirs)
    n_out = 3 if op == "LSTM" else 2
    check_against_ort(
        op, ins, {"hidden_size": H, "direction": direction}, n_outputs=n_out, opset=14,
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_sequence_lens_against_ort(op):
    rng = np.random.default_rng()
    lens = np.array([T, 2, 4], dtype=np.int32)
    ins = _inputs(op, rng, 2, lens=lens)
    n_out = 3 if op == "LSTM" else 2
    attrs = {"hidden_size": H, "direction": "bidirectional"}
    got = check_against_ort(op, ins, attrs, n_outputs=n_out, opset=14, rtol=1e-4, atol=1e-5)
    assert np.all(got[0][2:, :, 1] == 0)  # past sample 1's length: zeros


@pytest.mark.parametrize(
    "op,attrs",
    [
        ("RNN", {"activations": ["Relu"], "clip": 1.5}),
        ("GRU", {"linear_before_reset": 1, "clip": 0.8}),
        ("GRU", {"activations": ["HardSigmoid", "LeakyRelu"], "activation_alpha": [0.3, 0.1],
                 "activation_beta": [0.4]}),
        ("LSTM", {"input_forget": 1, "clip": 1.0}),
        ("LSTM", {"activations": ["HardSigmoid", "Tanh", "Softsign"]}),
    ],
)  # fmt: skip
def test_options_against_ort(op, attrs):
    rng = np.random.default_rng()
    ins = _inputs(op, rng, 1)
    n_out = 3 if op == "LSTM" else 2
    check_against_ort(
        op, ins, {"hidden_size": H, **attrs}, n_outputs=n_out, opset=14, rtol=1e-4, atol=1e-5
    )


def _call(op, ins, **attrs):
    return lookup(op, "", 22).fn(*ins.values(), **attrs)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_layout_matches_transposed(op):
    rng = np.random.default_rng()
    ins = _inputs(op, rng, 2, layout=1)
    got = _call(op, ins, direction="bidirectional", layout=1)
    flipped = {k: (v.transpose(1, 0, 2) if k in ("X", "initial_h", "initial_c") else v)
               for k, v in ins.items()}  # fmt: skip
    ref = _call(op, flipped, direction="bidirectional")
    np.testing.assert_allclose(got[0], ref[0].transpose(2, 0, 1, 3), rtol=1e-6, atol=1e-5)
    for g, r in zip(got[1:], ref[1:]):
        np.testing.assert_allclose(g, r.transpose(1, 0, 2), rtol=1e-6, atol=1e-5)


def _torch_weights(mod, w, r, b, reorder):
    with torch.no_grad():
        for d, sfx in enumerate(["", "_reverse"][: w.shape[0]]):
            g = w.shape[1] // H
            getattr(mod, f"weight_ih_l0{sfx}").copy_(torch.from_numpy(reorder(w[d], g)))
            getattr(mod, f"weight_hh_l0{sfx}").copy_(torch.from_numpy(reorder(r[d], g)))
            getattr(mod, f"bias_ih_l0{sfx}").copy_(torch.from_numpy(reorder(b[d, : g * H], g)))
            getattr(mod, f"bias_hh_l0{sfx}").copy_(torch.from_numpy(reorder(b[d, g * H :], g)))


def _reorder(order):
    def fn(a, g):
        parts = np.split(a, g)
        return np.ascontiguousarray(np.concatenate([parts[i] for i in order]))

    return fn


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_against_torch(op):
    """torch's gate order differs (GRU r,z,n; LSTM i,f,g,o); its GRU is linear_before_reset=1."""
    rng = np.random.default_rng()
    ins = _inputs(op, rng, 2)
    ins.pop("P", None)
    if op == "GRU":
        mod, order = torch.nn.GRU(I, H, bidirectional=True), [1, 0, 2]
        state = (torch.from_numpy(ins["initial_h"]),)
    else:
        mod, order = torch.nn.LSTM(I, H, bidirectional=True), [0, 2, 3, 1]
        state = ((torch.from_numpy(ins["initial_h"]), torch.from_numpy(ins["initial_c"])),)
    _torch_weights(mod, ins["W"], ins["R"], ins["B"], _reorder(order))
    with torch.no_grad():
        y_t, _ = mod(torch.from_numpy(ins["X"]), *state)
    attrs = {"direction": "bidirectional"}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    y = _call(op, ins, **attrs)[0]  # [T, D, B, H]
    expected = y_t.numpy().reshape(T, B, 2, H).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_float16_output_dtype():
    rng = np.random.default_rng()
    ins = {k: (v.astype(np.float16) if v is not None else None)
           for k, v in _inputs("LSTM", rng, 1).items()}  # fmt: skip
    outs = _call("LSTM", ins)
    assert all(o.dtype == np.float16 for o in outs)
    ref = _call("LSTM", {k: (v.astype(np.float32) if v is not None else None)
                         for k, v in ins.items()})  # fmt: skip
    np.testing.assert_allclose(outs[0].astype(np.float32), ref[0], rtol=1e-2, atol=1e-2)


def test_bad_direction():
    rng = np.random.default_rng()
    with pytest.raises(ValueError, match="direction"):
        _call("RNN", _inputs("RNN", rng, 1), direction="sideways")
