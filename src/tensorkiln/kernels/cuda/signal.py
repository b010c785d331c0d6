"""Signal processing on the device: DFT, STFT, the Blackman/Hamming/Hann windows, MelWeightMatrix.

Complex tensors follow ONNX's convention: a trailing axis of size 2 holds (real, imaginary); a
trailing axis of size 1 marks a real signal. Transforms run in ``torch.fft`` (cuFFT on the GPU) at
the input's precision (complex128 for float64, complex64 otherwise) and are cast back to the
input's dtype. The scalar inputs (dft_length, axis, frame_step, frame_length, window sizes and the
mel parameters) are read to the host: they decide shapes.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from onnx.helper import tensor_dtype_to_np_dtype

from tensorkiln.kernels.cuda.convert import current_device, host_list, torch_dtype
from tensorkiln.kernels.registry import register


def _scalar(value: torch.Tensor | int | float, name: str) -> float | int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        v = host_list(value)  # no device sync for a known small constant
        while isinstance(v, list):
            v = v[0]
        return v
    return value


def _scalar_int(value: torch.Tensor | int, name: str) -> int:
    return int(_scalar(value, name))


def _to_complex(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """[..., 1|2] float -> (complex [...], is_real), complex64 unless ``x`` is float64."""
    if x.dim() < 2 or x.shape[-1] not in (1, 2):
        raise ValueError(
            "a signal's last axis must be 1 (real) or 2 (real, imaginary); got shape "
            f"{tuple(x.shape)}"
        )
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if x.shape[-1] == 1:
        return torch.complex(xf[..., 0], torch.zeros_like(xf[..., 0])), True
    return torch.complex(xf[..., 0], xf[..., 1]), False


def _from_complex(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.view_as_real(y.resolve_conj()).to(dtype)


def _dft(
    x: torch.Tensor, dft_length: int | None, axis: int, inverse: int, onesided: int
) -> torch.Tensor:
    rank = x.dim()
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
        return torch.fft.irfft(sig, n=n, dim=ax).unsqueeze(-1).to(x.dtype)
    n = dft_length if dft_length is not None else x.shape[ax]
    y = torch.fft.ifft(sig, n=n, dim=ax) if inverse else torch.fft.fft(sig, n=n, dim=ax)
    if onesided:
        if not is_real:
            raise ValueError("onesided=1 with inverse=0 (RFFT) needs a real input (last axis 1)")
        y = y.narrow(ax, 0, n // 2 + 1)
    return _from_complex(y, x.dtype)


@register("DFT", since=17, backend="cuda")
def dft_17(
    x: torch.Tensor,
    dft_length: torch.Tensor | None = None,
    *,
    axis: int = 1,
    inverse: int = 0,
    onesided: int = 0,
) -> torch.Tensor:
    """DFT with the axis as an attribute (opset 17-19)."""
    n = None if dft_length is None else _scalar_int(dft_length, "dft_length")
    return _dft(x, n, axis, inverse, onesided)


@register("DFT", since=20, backend="cuda")
def dft_20(
    x: torch.Tensor,
    dft_length: torch.Tensor | None = None,
    axis: torch.Tensor | None = None,
    *,
    inverse: int = 0,
    onesided: int = 0,
) -> torch.Tensor:
    """DFT with the axis as an optional scalar input, default -2 (opset 20)."""
    n = None if dft_length is None else _scalar_int(dft_length, "dft_length")
    ax = -2 if axis is None else _scalar_int(axis, "axis")
    return _dft(x, n, ax, inverse, onesided)


@register("STFT", since=17, backend="cuda")
def stft(
    signal: torch.Tensor,
    frame_step: torch.Tensor,
    window: torch.Tensor | None = None,
    frame_length: torch.Tensor | None = None,
    *,
    onesided: int = 1,
) -> torch.Tensor:
    """Short-time Fourier transform: [batch, length, 1|2] -> [batch, frames, bins, 2]."""
    if signal.dim() != 3:
        raise ValueError(
            f"signal must be rank 3 [batch, length, 1|2], got shape {tuple(signal.shape)}"
        )
    sig, is_real = _to_complex(signal)
    length = sig.shape[1]
    step = _scalar_int(frame_step, "frame_step")
    if frame_length is not None:
        flen = _scalar_int(frame_length, "frame_length")
    else:
        flen = window.shape[0] if window is not None else length
    if window is not None and (window.dim() != 1 or window.shape[0] != flen):
        raise ValueError(
            f"window must be 1-D of length frame_length={flen}, got {tuple(window.shape)}"
        )
    if step < 1 or flen < 1 or flen > length:
        raise ValueError(
            f"need frame_step >= 1 and 1 <= frame_length <= signal length {length}; "
            f"got frame_step={step}, frame_length={flen}"
        )
    if onesided and not is_real:
        raise ValueError("onesided=1 needs a real signal (last axis 1); set onesided=0")
    frames = sig.unfold(1, flen, step)  # [batch, frames, flen]
    if window is not None:
        frames = frames * window.to(frames.real.dtype)
    y = torch.fft.rfft(frames.real, dim=-1) if onesided else torch.fft.fft(frames, dim=-1)
    return _from_complex(y, signal.dtype)


def _out_dtype(output_datatype: int) -> torch.dtype:
    return torch_dtype(tensor_dtype_to_np_dtype(output_datatype))


def _device(x: object) -> torch.device:
    return x.device if isinstance(x, torch.Tensor) else current_device()


def _window(size: torch.Tensor, periodic: int, output_datatype: int, coeffs: list[float]):
    """sum_k (-1)^k a_k cos(2 pi k n / N), N = size if periodic else size - 1."""
    n = _scalar_int(size, "size")
    if n < 0:
        raise ValueError(f"window size must be non-negative, got {n}")
    dtype, device = _out_dtype(output_datatype), _device(size)
    denom = n if periodic else n - 1
    if denom <= 0:  # a symmetric window of length 1 is [1]
        return torch.ones(n, dtype=dtype, device=device)
    idx = torch.arange(n, dtype=torch.float64, device=device)
    res = torch.zeros(n, dtype=torch.float64, device=device)
    for k, a in enumerate(coeffs):
        res = res + (-1) ** k * a * torch.cos(2 * math.pi * k * idx / denom)
    return res.to(dtype)


@register("HannWindow", since=17, backend="cuda")
def hann_window(size: torch.Tensor, *, output_datatype: int = 1, periodic: int = 1) -> torch.Tensor:
    """0.5 - 0.5 cos(2 pi n / N)."""
    return _window(size, periodic, output_datatype, [0.5, 0.5])


@register("HammingWindow", since=17, backend="cuda")
def hamming_window(
    size: torch.Tensor, *, output_datatype: int = 1, periodic: int = 1
) -> torch.Tensor:
    """25/46 - 21/46 cos(2 pi n / N)."""
    return _window(size, periodic, output_datatype, [25.0 / 46.0, 21.0 / 46.0])


@register("BlackmanWindow", since=17, backend="cuda")
def blackman_window(
    size: torch.Tensor, *, output_datatype: int = 1, periodic: int = 1
) -> torch.Tensor:
    """0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)."""
    return _window(size, periodic, output_datatype, [0.42, 0.5, 0.08])


def _mel_edges(n_mel: int, n_dft: int, rate: float, lo: float, hi: float) -> list[int]:
    """The num_mel_bins + 2 band edges as spectrogram bins, from host scalars (numpy, so the
    floor lands exactly where the reference's does)."""

    def mel(hz: float) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)

    lo_mel, hi_mel = mel(lo), mel(hi)
    mels = lo_mel + np.arange(n_mel + 2) * ((hi_mel - lo_mel) / (n_mel + 2))
    hz = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    return np.floor((n_dft + 1) * hz / rate).astype(np.int64).tolist()


@register("MelWeightMatrix", since=17, backend="cuda")
def mel_weight_matrix(
    num_mel_bins: torch.Tensor,
    dft_length: torch.Tensor,
    sample_rate: torch.Tensor,
    lower_edge_hertz: torch.Tensor,
    upper_edge_hertz: torch.Tensor,
    *,
    output_datatype: int = 1,
) -> torch.Tensor:
    """[dft_length // 2 + 1, num_mel_bins] triangular filters with peak 1, evenly spaced in mel
    (band edges as onnxruntime and onnx's reference compute them)."""
    n_mel = _scalar_int(num_mel_bins, "num_mel_bins")
    n_dft = _scalar_int(dft_length, "dft_length")
    rate = float(_scalar(sample_rate, "sample_rate"))
    lo = float(_scalar(lower_edge_hertz, "lower_edge_hertz"))
    hi = float(_scalar(upper_edge_hertz, "upper_edge_hertz"))
    if n_mel < 1 or n_dft < 1 or rate <= 0 or not 0 <= lo < hi:
        raise ValueError(
            "MelWeightMatrix needs num_mel_bins >= 1, dft_length >= 1, sample_rate > 0 and "
            f"0 <= lower_edge_hertz < upper_edge_hertz; got {n_mel}, {n_dft}, {rate}, {lo}, {hi}"
        )
    device = _device(num_mel_bins)
    edges = torch.tensor(_mel_edges(n_mel, n_dft, rate, lo, hi), device=device)
    left, center, right = edges[:-2], edges[1:-1], edges[2:]
    j = torch.arange(n_dft // 2 + 1, device=device).unsqueeze(1)
    rising = torch.where(
        center == left,
        torch.ones((), dtype=torch.float64, device=device),
        (j - left) / torch.clamp(center - left, min=1).to(torch.float64),
    )
    falling = (right - j) / torch.clamp(right - center, min=1).to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    out = torch.where((j >= left) & (j <= center), rising, zero)
    out = torch.where((j >= center) & (j < right), falling, out)
    return out.to(_out_dtype(output_datatype))
