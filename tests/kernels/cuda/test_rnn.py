"""The cuda backend's RNN, GRU and LSTM against the numpy reference, on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

T, B, I, H = 5, 3, 4, 6
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _compare(op, args, attrs, n_outputs, rtol=1e-5, atol=1e-5):
    ref = invoke(lookup(op, "", 22, "reference"), args, attrs, n_outputs)
    got = invoke(lookup(op, "", 22, "cuda"), [to_torch(a, DEVICE) for a in args], attrs, n_outputs)
    for g, r in zip(got, ref):
        g = to_numpy(g)
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_allclose(g.astype(np.float64), r.astype(np.float64), rtol=rtol,
                                   atol=atol)  # fmt: skip


def _inputs(rng, op, dirs, layout=0, dtype=np.float32, lens=True):
    g = GATES[op]
    x = rng.standard_normal((B, T, I) if layout else (T, B, I)).astype(dtype)
    w = (rng.standard_normal((dirs, g * H, I)) * 0.5).astype(dtype)
    r = (rng.standard_normal((dirs, g * H, H)) * 0.5).astype(dtype)
    b = rng.standard_normal((dirs, 2 * g * H)).astype(dtype)
    seq = rng.integers(0, T + 1, B).astype(np.int32) if lens else None
    h0 = rng.standard_normal((B, dirs, H) if layout else (dirs, B, H)).astype(dtype)
    args = [x, w, r, b, seq, h0]
    if op == "LSTM":
        args.append(rng.standard_normal(h0.shape).astype(dtype))
        args.append(rng.standard_normal((dirs, 3 * H)).astype(dtype))
    return args


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_directions_sequence_lens_initial_states(op, direction):
    rng = np.random.default_rng()
    dirs = 2 if direction == "bidirectional" else 1
    attrs = {"direction": direction, "hidden_size": H}
    _compare(op, _inputs(rng, op, dirs), attrs, 3 if op == "LSTM" else 2)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_layout_clip_and_fp16(op):
    rng = np.random.default_rng()
    args = _inputs(rng, op, 2, layout=1, dtype=np.float16)
    attrs = {"direction": "bidirectional", "layout": 1, "clip": 1.5}
    _compare(op, args, attrs, 3 if op == "LSTM" else 2, rtol=2e-3, atol=2e-3)


def test_activations_with_alpha_beta():
    rng = np.random.default_rng()
    args = _inputs(rng, "LSTM", 2, lens=False)
    acts = ["HardSigmoid", "ScaledTanh", "Elu", "Sigmoid", "Affine", "Softplus"]
    attrs = {
        "direction": "bidirectional",
        "activations": acts,
        "activation_alpha": [0.3, 0.8, 0.7, 1.3],
        "activation_beta": [0.4, 1.2, -0.2],
        "input_forget": 1,
    }
    _compare("LSTM", args, attrs, 3)
    attrs = {"direction": "bidirectional", "activations": ["Softsign", "Relu", "Sigmoid", "Tanh"]}
    _compare("GRU", _inputs(rng, "GRU", 2), {**attrs, "linear_before_reset": 1}, 2)
    attrs = {"direction": "bidirectional", "activations": ["LeakyRelu", "ThresholdedRelu"],
             "activation_alpha": [0.05, 0.2]}  # fmt: skip
    _compare("RNN", _inputs(rng, "RNN", 2), attrs, 2)


def test_only_y_and_missing_optional_inputs():
    rng = np.random.default_rng()
    x, w, r = _inputs(rng, "GRU", 1)[:3]
    ref = invoke(lookup("GRU", "", 22), [x, w, r], {}, 2)[0]
    (got,) = invoke(lookup("GRU", "", 22, "cuda"), [to_torch(a, DEVICE) for a in (x, w, r)], {}, 1)
    np.testing.assert_allclose(to_numpy(got), ref, rtol=1e-5, atol=1e-5)


def test_non_contiguous_weights():
    rng = np.random.default_rng()
    x, w, r = _inputs(rng, "RNN", 1)[:3]
    wt = to_torch(np.ascontiguousarray(w.transpose(0, 2, 1)), DEVICE).transpose(1, 2)
    got = lookup("RNN", "", 22, "cuda").fn(to_torch(x, DEVICE), wt, to_torch(r, DEVICE))
    ref = lookup("RNN", "", 22).fn(x, w, r)
    np.testing.assert_allclose(to_numpy(got[0]), ref[0], rtol=1e-5, atol=1e-5)
