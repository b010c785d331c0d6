"""Moving values between numpy (the host) and torch (the device), and the device kernels run on.

The cuda backend's kernels take and return torch tensors. Weights, attributes and the reference
backend speak numpy; these helpers convert both ways, including the dtypes numpy spells through
ml_dtypes (bfloat16, float8), which torch reads by reinterpreting the bytes. Strings and the 4-bit
types have no torch dtype: such values stay numpy arrays on the host.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

_DEVICE: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar(
    "tensorkiln_device", default=None
)

# numpy dtypes torch cannot take directly: (numpy dtype, same-size integer view, torch dtype)
_VIEWED = {
    np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e4m3fnuz): (np.uint8, torch.float8_e4m3fnuz),
    np.dtype(ml_dtypes.float8_e5m2): (np.uint8, torch.float8_e5m2),
    np.dtype(ml_dtypes.float8_e5m2fnuz): (np.uint8, torch.float8_e5m2fnuz),
}
_BACK = {t: (np_dtype, view) for np_dtype, (view, t) in _VIEWED.items()}

_NUMPY_TO_TORCH = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.uint16): torch.uint16,
    np.dtype(np.uint32): torch.uint32,
    np.dtype(np.uint64): torch.uint64,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
} | {k: t for k, (_, t) in _VIEWED.items()}
_TORCH_TO_NUMPY = {t: k for k, t in _NUMPY_TO_TORCH.items()}


def current_device() -> torch.device:
    """The device kernels create new tensors on (set by the executor for each run)."""
    dev = _DEVICE.get()
    if dev is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return dev


@contextlib.contextmanager
def use_device(device: torch.device | str) -> Iterator[torch.device]:
    token = _DEVICE.set(torch.device(device))
    try:
        yield _DEVICE.get()
    finally:
        _DEVICE.reset(token)


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a numpy dtype (or anything np.dtype takes); TypeError when none."""
    if isinstance(dtype, torch.dtype):
        return dtype
    t = _NUMPY_TO_TORCH.get(np.dtype(dtype))
    if t is None:
        raise TypeError(f"dtype {np.dtype(dtype)} has no torch equivalent")
    return t


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return _TORCH_TO_NUMPY[dtype]


def on_device(dtype: np.dtype) -> bool:
    """Whether values of numpy ``dtype`` live on the device (strings and 4-bit types do not)."""
    return np.dtype(dtype) in _NUMPY_TO_TORCH


def to_torch(value: Any, device: torch.device | str | None = None) -> Any:
    """numpy arrays (and lists of them, for sequences) to tensors on ``device``; others as is."""
    if isinstance(value, np.ndarray):
        if not on_device(value.dtype):
            return value
        dev = current_device() if device is None else torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return _filled(value, dev)
        t = _quiet_host_tensor(value)
        # (non-blocking: CUDA copies pageable memory to a staging buffer before the call
        # returns, so the array may change or go at once; inputs take upload(), pinned)
        return t.to(dev, non_blocking=True) if t.device != dev else t.clone()
    if isinstance(value, np.generic):
        return to_torch(np.asarray(value), device)
    if isinstance(value, list):
        return [to_torch(v, device) for v in value]
    return value


def upload(value: Any, device: torch.device | str, *, held: bool = False) -> Any:
    """An engine input on ``device`` without the host waiting for the device's earlier work: a
    numpy array is copied on the host into pinned memory (torch's caching host allocator keeps
    that block until the copy from it has run on the stream), then sent asynchronously; the
    caller's array may change as soon as this returns. ``held``: the caller leaves the array
    unchanged until the run's results are back on the host, so an array already in page-locked
    memory (a server's staging buffer) is sent from where it lies, without the host copy.
    Anything else as :func:`to_torch`."""
    dev = torch.device(device)
    if (
        not isinstance(value, np.ndarray)
        or not on_device(value.dtype)
        or dev.type != "cuda"
        or torch.cuda.is_current_stream_capturing()
    ):
        return to_torch(value, dev)
    t = _quiet_host_tensor(value)
    if held and t.is_pinned():
        return t.to(dev, non_blocking=True)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(dev, non_blocking=True)


def page_locked_bytes(array: np.ndarray) -> torch.Tensor | None:
    """``array``'s bytes as a uint8 CPU tensor over its own memory, where it is C-ordered,
    writable and not empty and lies in page-locked memory (a pinned buffer, or a view of one);
    else None."""
    if not (array.flags.c_contiguous and array.flags.writeable and array.size):
        return None
    t = torch.from_numpy(array.reshape(-1).view(np.uint8))
    return t if t.is_pinned() else None


def _quiet_host_tensor(value: np.ndarray) -> torch.Tensor:
    """:func:`host_tensor`, without torch's warning for a read-only array (the tensor is copied
    to the device before anything could write it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return host_tensor(value)


def host_tensor(value: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``value``'s memory (a C-ordered copy where it is strided), the types
    numpy holds through ml_dtypes (bfloat16, float8) viewed as torch's own."""
    arr = np.ascontiguousarray(value).reshape(value.shape)  # (keeps 0-d arrays 0-d)
    viewed = _VIEWED.get(arr.dtype)
    if viewed is not None:
        return torch.from_numpy(arr.view(viewed[0])).view(viewed[1])
    return torch.from_numpy(arr)


def _filled(value: np.ndarray, device: torch.device) -> torch.Tensor:
    """``value`` made on ``device`` by one fill kernel per element, for CUDA graph capture.

    A captured host-to-device copy would read its (pageable, soon freed) source again at every
    replay, and torch refuses it; fill kernels carry their value in their launch arguments, so
    the graph owns the result. Only small arrays (shapes, indices, scalars) reach here.
    """
    if value.size > HOST_VALUES_LIMIT or value.dtype.kind not in "biuf":
        raise RuntimeError(
            f"cannot upload a host array of {value.size} {value.dtype} values while a CUDA graph "
            "is being captured"
        )
    dtype = torch_dtype(value.dtype)
    out = torch.empty(value.size, dtype=dtype, device=device)
    kind = float if value.dtype.kind == "f" else int if value.dtype.kind in "iu" else bool
    for i, v in enumerate(value.ravel().tolist()):
        out[i].fill_(kind(v))
    return out.reshape(value.shape)


def to_numpy(value: Any) -> Any:
    """Tensors (and lists of them) to numpy arrays on the host; others as is."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():  # (channels-last activations on the CPU): C order for numpy
            t = t.contiguous()
        back = _BACK.get(t.dtype)
        if back is not None:
            return t.contiguous().view(_VIEW_TORCH[back[1]]).numpy().view(back[0])
        return t.resolve_conj().numpy()
    if isinstance(value, list):
        return [to_numpy(v) for v in value]
    return value


_VIEW_TORCH = {np.int16: torch.int16, np.uint8: torch.uint8}


# Host copies of small values (shapes, axes, pads, scales): a kernel that needs such an input's
# values on the host reads them here instead of synchronizing with the device, which also keeps
# engines capturable as CUDA graphs. The executor attaches them to each small initializer it
# uploads, and to the outputs of small shape computations whose inputs it knows on the host.
_HOST_ATTR = "_tensorkiln_host"
HOST_VALUES_LIMIT = 64  # elements
HOST_READ_MISSES = [0]  # host reads of values the host did not know (on a GPU: a device sync)


def remember_host_values(t: torch.Tensor, arr: np.ndarray) -> None:
    """Attach ``arr`` (the values of ``t``) to ``t`` when it is small and numeric."""
    if arr.dtype.kind in "iubf" and arr.size <= HOST_VALUES_LIMIT:
        setattr(t, _HOST_ATTR, np.array(arr))


_CONSTANT_ATTR = "_tensorkiln_constant"


def mark_constant(t: Any) -> Any:
    """Mark ``t`` as an engine's constant (an initializer: never written after upload), which
    kernels may prepare once and keep what they prepared (tactics_quant's float16 weights)."""
    if isinstance(t, torch.Tensor):
        setattr(t, _CONSTANT_ATTR, True)
    return t


def is_constant(t: Any) -> bool:
    """Whether ``t`` is marked by :func:`mark_constant` (views and copies of it are not)."""
    return isinstance(t, torch.Tensor) and getattr(t, _CONSTANT_ATTR, False)


# What kernels prepare from an engine's constants (mark_constant: never written), kept per
# constant tensor and key: cudnn_fp16's float16 weight (the 8-bit weight times its scale, in the
# input's layout), cublas_fp8_rowwise's scale vectors and bias, a Gather's wrapped indices. A
# CUDA graph then replays the layer without the small kernels that prepare it. A value changed
# in place (its version) or another dependency tensor prepares it again; nothing is kept while a
# stream is capturing (it would belong to that graph's memory pool), nor for values computed at
# run time (an arena's memory changes under the same tensor).
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def kept(owner: torch.Tensor, key: tuple, make: Callable[[], Any], *deps: Any) -> Any:
    """``make()``, kept for ``owner`` and ``key`` where ``owner`` and the tensors of ``deps``
    are constants; made on every call otherwise."""
    tensors = [d for d in deps if isinstance(d, torch.Tensor)]
    if not (is_constant(owner) and all(is_constant(d) for d in tensors)):
        return make()
    try:
        versions = (owner._version, *((id(d), d._version) for d in tensors))
    except RuntimeError:  # inference tensors keep no version: made on every call
        return make()
    entries = _KEPT.get(owner)
    hit = entries.get(key) if entries is not None else None
    if hit is not None and hit[0] == versions:
        return hit[1]
    value = make()
    if not (owner.is_cuda and torch.cuda.is_current_stream_capturing()):
        if entries is None:
            entries = _KEPT[owner] = {}
        entries[key] = (versions, value, tensors)  # (the dependencies held: their ids stay theirs)
    return value


def host_values(t: Any) -> np.ndarray | None:
    """The host copy attached to tensor ``t``, or None."""
    return getattr(t, _HOST_ATTR, None) if isinstance(t, torch.Tensor) else None


def host_list(t: Any) -> Any:
    """``t.tolist()``, without a device synchronization when ``t``'s values are known on the host."""
    if isinstance(t, torch.Tensor):
        known = getattr(t, _HOST_ATTR, None)
        if known is not None:
            return known.tolist()
        HOST_READ_MISSES[0] += 1
        return t.tolist()
    if isinstance(t, np.ndarray):
        return t.tolist()
    return t
