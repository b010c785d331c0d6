"""Signal processing: DFT, STFT, the Blackman/Hamming/Hann windows, MelWeightMatrix.

Complex tensors follow ONNX's convention: a trailing axis of size 2 holds (real, imaginary); a
trailing axis of size 1 marks a real signal. Transforms run in ``np.fft`` at the input's precision
(complex128 for float64, complex64 otherwise) and are cast back to the input's dtype.
"""

from __future__ import annotations

import numpy as np
from onnx.helper import tensor_dtype_to_np_dtype

from tensorkiln.kernels.registry import register


def _scalar_int(value: np.ndarray | int, name: str) -> int:
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"{name} must be a scalar, got shape {arr.shape}")
    return int(arr.reshape(-1)[0])


def _to_complex(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """[..., 1|2] float -> (complex [...], is_real), complex64 unless ``x`` is float64."""
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise ValueError(
            f"a signal's last axis must be 1 (real) or 2 (real, imaginary); got shape {x.shape}"
        )
    ct = np.complex128 if x.dtype == np.float64 else np.complex64
    xf = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    if x.shape[-1] == 1:
        return xf[..., 0].astype(ct), True
    return (xf[..., 0] + 1j * xf[..., 1]).astype(ct), False


def _from_complex(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.stack([y.real, y.imag], axis=-1).astype(dtype)


def _dft(
    x: np.ndarray, dft_length: int | None, axis: int, inverse: int, onesided: int
) -> np.ndarray:
    rank = x.ndim
    if not (-rank <= axis <= rank - 2) or axis == -1:
        raise ValueError(
            f"axis {axis} out of range for input of rank {rank}: accepted are "
            f"[{-rank}, -2] and [0, {rank - 2}] (the last axis holds real/imaginary parts)"
        )
    ax = axis % rank
    sig, is_real = _to_complex(x)
    if dft_length is not None and dft_length < 1:
        raise ValueError(f"dft_length must be positive, got {dft_length}")
    if onesided and inverse:  # IRFFT: one-sided complex spectrum -> full real signal
        n = dft_length if dft_length is not None else 2 * (x.shape[ax] - 1)
        if n < 1:
            raise ValueError(f"IRFFT of an axis of length {x.shape[ax]} needs dft_length")
        return np.fft.irfft(sig, n=n, axis=ax)[..., None].astype(x.dtype)
    n = dft_length if dft_length is not None else x.shape[ax]
    y = np.fft.ifft(sig, n=n, axis=ax) if inverse else np.fft.fft(sig, n=n, axis=ax)
    if onesided:
        if not is_real:
            raise ValueError("onesided=1 with inverse=0 (RFFT) needs a real input (last axis 1)")
        y = np.take(y, np.arange(n // 2 + 1), axis=ax)
    return _from_complex(y, x.dtype)


@register("DFT", since=17)
def dft(
    x: np.ndarray,
    dft_length: np.ndarray | None = None,
    axis_input: np.ndarray | None = None,
    *,
    axis: int = 1,
    inverse: int = 0,
    onesided: int = 0,
    _opset: int = 20,
) -> np.ndarray:
    """DFT; the axis is an attribute (default 1) up to opset 19, an optional scalar input
    (default -2) from opset 20."""
    n = None if dft_length is None else _scalar_int(dft_length, "dft_length")
    if _opset >= 20:
        axis = -2 if axis_input is None else _scalar_int(axis_input, "axis")
    return _dft(x, n, axis, inverse, onesided)


@register("STFT", since=17)
def stft(
    signal: np.ndarray,
    frame_step: np.ndarray,
    window: np.ndarray | None = None,
    frame_length: np.ndarray | None = None,
    *,
    onesided: int = 1,
) -> np.ndarray:
    """Short-time Fourier transform: [batch, length, 1|2] -> [batch, frames, bins, 2]."""
    if signal.ndim != 3:
        raise ValueError(f"signal must be rank 3 [batch, length, 1|2], got shape {signal.shape}")
    sig, is_real = _to_complex(signal)
    length = sig.shape[1]
    step = _scalar_int(frame_step, "frame_step")
    if frame_length is not None:
        flen = _scalar_int(frame_length, "frame_length")
    else:
        flen = window.shape[0] if window is not None else length
    if window is not None and (window.ndim != 1 or window.shape[0] != flen):
        raise ValueError(f"window must be 1-D of length frame_length={flen}, got {window.shape}")
    if step < 1 or flen < 1 or flen > length:
        raise ValueError(
            f"need frame_step >= 1 and 1 <= frame_length <= signal length {length}; "
            f"got frame_step={step}, frame_length={flen}"
        )
    if onesided and not is_real:
        raise ValueError("onesided=1 needs a real signal (last axis 1); set onesided=0")
    frames = np.lib.stride_tricks.sliding_window_view(sig, flen, axis=1)[:, ::step]
    if window is not None:
        frames = frames * window.astype(frames.real.dtype)
    y = np.fft.rfft(frames.real, axis=-1) if onesided else np.fft.fft(frames, axis=-1)
    return _from_complex(y, signal.dtype)


def _window(size: np.ndarray, periodic: int, output_datatype: int, coeffs: list[float]):
    """sum_k (-1)^k a_k cos(2 pi k n / N), N = size if periodic else size - 1."""
    n = _scalar_int(size, "size")
    if n < 0:
        raise ValueError(f"window size must be non-negative, got {n}")
    denom = n if periodic else n - 1
    idx = np.arange(n, dtype=np.float64)
    if denom <= 0:  # a symmetric window of length 1 is [1]
        return np.ones(n, dtype=tensor_dtype_to_np_dtype(output_datatype))
    res = np.zeros(n, dtype=np.float64)
    for k, a in enumerate(coeffs):
        res += (-1) ** k * a * np.cos(2 * np.pi * k * idx / denom)
    return res.astype(tensor_dtype_to_np_dtype(output_datatype))


@register("HannWindow", since=17)
def hann_window(size: np.ndarray, *, output_datatype: int = 1, periodic: int = 1) -> np.ndarray:
    """0.5 - 0.5 cos(2 pi n / N)."""
    return _window(size, periodic, output_datatype, [0.5, 0.5])


@register("HammingWindow", since=17)
def hamming_window(size: np.ndarray, *, output_datatype: int = 1, periodic: int = 1) -> np.ndarray:
    """25/46 - 21/46 cos(2 pi n / N)."""
    return _window(size, periodic, output_datatype, [25.0 / 46.0, 21.0 / 46.0])


@register("BlackmanWindow", since=17)
def blackman_window(size: np.ndarray, *, output_datatype: int = 1, periodic: int = 1) -> np.ndarray:
    """0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)."""
    return _window(size, periodic, output_datatype, [0.42, 0.5, 0.08])


def _mel(hz: np.ndarray | float) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


@register("MelWeightMatrix", since=17)
def mel_weight_matrix(
    num_mel_bins: np.ndarray,
    dft_length: np.ndarray,
    sample_rate: np.ndarray,
    lower_edge_hertz: np.ndarray,
    upper_edge_hertz: np.ndarray,
    *,
    output_datatype: int = 1,
) -> np.ndarray:
    """[dft_length // 2 + 1, num_mel_bins] triangular filters with peak 1, evenly spaced in mel.

    The band edges are spectrogram bin indices floor((dft_length + 1) * hz / sample_rate) of
    num_mel_bins + 2 points spaced (high_mel - low_mel) / (num_mel_bins + 2) apart from the low
    edge, as onnxruntime and onnx's reference compute them.
    """
    n_mel = _scalar_int(num_mel_bins, "num_mel_bins")
    n_dft = _scalar_int(dft_length, "dft_length")
    rate = float(np.asarray(sample_rate).reshape(-1)[0])
    lo = float(np.asarray(lower_edge_hertz).reshape(-1)[0])
    hi = float(np.asarray(upper_edge_hertz).reshape(-1)[0])
    if n_mel < 1 or n_dft < 1 or rate <= 0 or not 0 <= lo < hi:
        raise ValueError(
            "MelWeightMatrix needs num_mel_bins >= 1, dft_length >= 1, sample_rate > 0 and "
            f"0 <= lower_edge_hertz < upper_edge_hertz; got {n_mel}, {n_dft}, {rate}, {lo}, {hi}"
        )
    lo_mel, hi_mel = _mel(lo), _mel(hi)
    mels = lo_mel + np.arange(n_mel + 2) * ((hi_mel - lo_mel) / (n_mel + 2))
    hz = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    edges = np.floor((n_dft + 1) * hz / rate).astype(np.int64)
    left, center, right = edges[:-2], edges[1:-1], edges[2:]
    j = np.arange(n_dft // 2 + 1)[:, None]
    rising = np.where(
        center == left, 1.0, (j - left) / np.maximum(center - left, 1).astype(np.float64)
    )
    falling = (right - j) / np.maximum(right - center, 1).astype(np.float64)
    out = np.where((j >= left) & (j <= center), rising, 0.0)
    out = np.where((j >= center) & (j < right), falling, out)
    return out.astype(tensor_dtype_to_np_dtype(output_datatype))
