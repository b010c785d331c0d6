"""Signal kernels (DFT, STFT, windows, MelWeightMatrix) against onnxruntime and torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorkiln.kernels.registry import lookup
from tests.kernels.ort_oracle import check_against_ort


def _complex(x: np.ndarray) -> np.ndarray:
    return x[..., 0] + 1j * x[..., 1]


@pytest.mark.parametrize("inverse", [0, 1])
@pytest.mark.parametrize("axis", [1, 2, -2])
def test_dft20_complex_against_torch(axis, inverse):
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 6, 7, 2)).astype(np.float32)
    fn = lookup("DFT", "", 20).fn
    got = fn(x, None, np.array(axis, dtype=np.int64), inverse=inverse)
    ax = axis % 4
    t = torch.from_numpy(_complex(x).astype(np.complex64))
    expected = (torch.fft.ifft if inverse else torch.fft.fft)(t, dim=ax).numpy()
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(_complex(got), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [5, 12])
def test_dft_length_against_ort(n):
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 8, 1)).astype(np.float32)
    ins = {"input": x, "dft_length": np.array(n, dtype=np.int64)}
    check_against_ort("DFT", ins, {"axis": 1}, opset=17, rtol=1e-4, atol=1e-4)


def test_rfft_and_irfft_against_ort():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 10, 4, 1)).astype(np.float32)
    axis = {"axis": np.array(1, dtype=np.int64)}
    spec = check_against_ort(
        "DFT", {"input": x, "dft_length": None, **axis}, {"onesided": 1}, opset=20,
        rtol=1e-4, atol=1e-4,
    )[0]  # fmt: skip
    assert spec.shape == (3, 6, 4, 2)
    back = lookup("DFT", "", 20).fn(spec, None, axis["axis"], onesided=1, inverse=1)
    np.testing.assert_allclose(back, x, rtol=1e-4, atol=1e-5)  # irfft(rfft(x)) == x


def test_dft17_matches_numpy_double():
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 9, 2))
    got = lookup("DFT", "", 17).fn(x, axis=-2)
    assert got.dtype == np.float64
    np.testing.assert_allclose(_complex(got), np.fft.fft(_complex(x), axis=1), rtol=1e-10)


def test_dft_rejects_last_axis():
    x = np.random.default_rng().standard_normal((2, 4, 1)).astype(np.float32)
    with pytest.raises(ValueError, match="axis"):
        lookup("DFT", "", 20).fn(x, None, np.array(2, dtype=np.int64))


@pytest.mark.parametrize("with_window", [False, True])
@pytest.mark.parametrize("onesided", [0, 1])
def test_stft_against_ort(with_window, onesided):
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 64, 1)).astype(np.float32)
    window = np.hanning(16).astype(np.float32) if with_window else None
    ins = {
        "signal": x,
        "frame_step": np.array(5, dtype=np.int64),
        "window": window,
        "frame_length": np.array(16, dtype=np.int64),
    }
    got = check_against_ort("STFT", ins, {"onesided": onesided}, opset=17, rtol=1e-4, atol=1e-4)
    assert got[0].shape == (2, (64 - 16) // 5 + 1, 9 if onesided else 16, 2)


def test_stft_against_torch():
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 50, 1)).astype(np.float32)
    window = rng.random(12).astype(np.float32)
    got = lookup("STFT", "", 17).fn(x, np.array(4), window)
    expected = torch.stft(
        torch.from_numpy(x[..., 0]), n_fft=12, hop_length=4, window=torch.from_numpy(window),
        center=False, return_complex=True,
    ).numpy()  # fmt: skip
    np.testing.assert_allclose(_complex(got), expected.transpose(0, 2, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows_against_ort(op, periodic):
    size = int(np.random.default_rng().integers(2, 40))
    attrs = {"periodic": periodic, "output_datatype": 11}
    got = check_against_ort(op, {"size": np.array(size, np.int64)}, attrs, opset=17, rtol=1e-6)
    assert got[0].dtype == np.float64


@pytest.mark.parametrize("op", ["hann_window", "hamming_window", "blackman_window"])
def test_windows_against_torch(op):
    size = int(np.random.default_rng().integers(2, 40))
    fn = lookup({"hann_window": "HannWindow", "hamming_window": "HammingWindow",
                 "blackman_window": "BlackmanWindow"}[op], "", 17).fn  # fmt: skip
    for periodic in (0, 1):
        # onnx's Hamming uses alpha=25/46, beta=21/46 (torch's defaults are 0.54, 0.46)
        kw = {"alpha": 25 / 46, "beta": 21 / 46} if op == "hamming_window" else {}
        expected = getattr(torch, op)(size, periodic=bool(periodic), dtype=torch.float64, **kw)
        got = fn(np.array(size), periodic=periodic, output_datatype=11)
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-12)


def test_mel_weight_matrix_against_ort():
    rng = np.random.default_rng()
    ins = {
        "num_mel_bins": np.array(int(rng.integers(4, 20)), np.int64),
        "dft_length": np.array(int(rng.integers(64, 512)), np.int64),
        "sample_rate": np.array(16000, np.int64),
        "lower_edge_hertz": np.array(float(rng.uniform(0, 200)), np.float32),
        "upper_edge_hertz": np.array(float(rng.uniform(4000, 8000)), np.float32),
    }
    got = check_against_ort("MelWeightMatrix", ins, opset=17)[0]
    assert got.max() == 1.0
