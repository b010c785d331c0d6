"""Triton's CUDA shared-memory extension: a client on the same machine allocates GPU memory,
exports it with ``cudaIpcGetMemHandle``, registers the 64-byte handle once, and then sends
requests that name a region of it instead of carrying the tensors. Inputs go to the engine from
the client's GPU memory where they lie (no copy through the host), and outputs are written back
into the client's GPU memory. A request then carries a few hundred bytes whatever the tensors'
size, which is what a latency-bound client on the server's machine wants.

The handle is opened with the CUDA driver API (``cuIpcOpenMemHandle`` in the device's primary
context, the one torch uses), through ctypes: nothing of the client's is executed, and a handle
that is not one the driver knows is refused by the driver. The opened range is bounded: the
region's byte_size must lie within the allocation the handle names (``cuMemGetAddressRange``).
A region stays mapped while a request still uses it, and is closed when it is unregistered and
the last such request is done. Like system shared memory, the extension is off unless the
server is started with ``--allow-shared-memory true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import math
import threading
import weakref
from typing import Any

import numpy as np

from tensorkiln.serve.protocol import ServeError

IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _Handle(ctypes.Structure):  # CUipcMemHandle, passed by value
    # (bytes, not c_char: a c_char array field is set up to its first NUL, and handles hold NULs)
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


class _Driver:
    """The few CUDA driver calls the extension needs, from libcuda."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, vp, i = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
        sigs = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGetCount": [ctypes.POINTER(i)],
            "cuDeviceGet": [ctypes.POINTER(i), i],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), i],
            "cuDevicePrimaryCtxRelease_v2": [i],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(vp)],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(u64), _Handle, ctypes.c_uint],
            "cuIpcCloseMemHandle": [u64],
            "cuMemGetAddressRange_v2": [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64],
            "cuGetErrorString": [i, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            setattr(self, name, fn)
        self.check(self.cuInit(0), "cuInit")
        count = ctypes.c_int()
        self.check(self.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        self.devices = count.value
        self._lock = threading.Lock()

    def check(self, code: int, what: str) -> None:
        if code != 0:
            text = ctypes.c_char_p()
            self.cuGetErrorString(code, ctypes.byref(text))
            message = (text.value or b"").decode(errors="replace") or f"error {code}"
            raise ServeError(f"{what}: {message}", 400)

    def in_context(self, device_id: int, call: Any) -> Any:
        """``call()`` with ``device_id``'s primary context current on this thread."""
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.cuDeviceGet(ctypes.byref(dev), device_id), "cuDeviceGet")
        self.check(self.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtx")
        try:
            self.check(self.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
            try:
                return call()
            finally:
                self.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            self.cuDevicePrimaryCtxRelease_v2(dev)


@functools.cache
def _driver() -> _Driver:
    try:
        return _Driver()
    except (OSError, AttributeError) as exc:
        raise ServeError(
            f"CUDA shared memory needs a GPU and its driver on the server ({exc})", 400
        ) from None


class _Opened:
    """A client's allocation opened in this process; closed when the last tensor viewing it is
    gone (torch holds this object for as long as its storage lives)."""

    def __init__(self, ptr: int, byte_size: int, device_id: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (byte_size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }  # fmt: skip
        # (not at exit: the process's mappings go with it, and the driver may be shut down)
        weakref.finalize(self, _close, ptr, device_id).atexit = False


def _close(ptr: int, device_id: int) -> None:
    d = _driver()
    with contextlib.suppress(ServeError):  # (a context gone already: nothing left to close)
        d.in_context(device_id, lambda: d.cuIpcCloseMemHandle(ptr))


def open_region(name: str, raw_handle: Any, device_id: Any, byte_size: int) -> Any:
    """The client's GPU memory that ``raw_handle`` exports, ``byte_size`` bytes of it from the
    start, as a uint8 torch tensor on device ``device_id`` (the region's checks: a handle of 64
    bytes, a device the server has, a size within the allocation)."""
    if not isinstance(raw_handle, bytes | bytearray) or len(raw_handle) != IPC_HANDLE_BYTES:
        got = len(raw_handle) if isinstance(raw_handle, bytes | bytearray) else "no"
        raise ServeError(
            f"region '{name}': raw_handle must be the {IPC_HANDLE_BYTES} bytes of a CUDA IPC "
            f"memory handle; the request gives {got} bytes"
        )
    d = _driver()
    if (
        not isinstance(device_id, int)
        or isinstance(device_id, bool)
        or not (0 <= device_id < d.devices)
    ):
        raise ServeError(
            f"region '{name}': device_id {str(device_id)[:20]} is not one of this server's "
            f"{d.devices} GPUs"
        )
    import torch  # lazy: torch is optional (only a GPU server maps CUDA memory)

    def opened() -> tuple[int, int, int]:
        ptr = ctypes.c_uint64()
        d.check(
            d.cuIpcOpenMemHandle_v2(
                ctypes.byref(ptr),
                _Handle.from_buffer_copy(bytes(raw_handle)),
                _LAZY_ENABLE_PEER_ACCESS,
            ),
            f"region '{name}': the CUDA IPC handle cannot be opened (cuIpcOpenMemHandle)",
        )
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        code = d.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr.value)
        if code != 0:
            d.cuIpcCloseMemHandle(ptr.value)
            d.check(code, f"region '{name}': cuMemGetAddressRange")
        return ptr.value, base.value, size.value

    with d._lock:
        ptr, base, size = d.in_context(device_id, opened)
    if ptr + byte_size > base + size:
        _close(ptr, device_id)
        raise ServeError(
            f"region '{name}': byte_size {byte_size:,} is past the end of the GPU allocation "
            f"the handle names ({base + size - ptr:,} bytes)"
        )
    memory = _Opened(ptr, byte_size, device_id)
    return torch.as_tensor(memory, device=f"cuda:{device_id}")


@functools.cache
def _torch_dtype(dtype: np.dtype) -> Any:
    import torch  # lazy: torch is optional (only a GPU server maps CUDA memory)

    return torch.from_numpy(np.empty(0, dtype)).dtype


def view(region: Any, start: int, dtype: np.dtype, shape: tuple[int, ...], what: str) -> Any:
    """``shape`` of ``dtype`` at byte ``start`` of a region's tensor, in place."""
    try:
        tdtype = _torch_dtype(dtype)
    except TypeError:
        raise ServeError(f"{what}: {dtype} cannot be read from CUDA shared memory") from None
    nbytes = math.prod(shape) * dtype.itemsize
    if start % dtype.itemsize:
        raise ServeError(
            f"{what}: the tensor starts at byte {start:,} of its CUDA region, which is not a "
            f"multiple of its {dtype} items' {dtype.itemsize} bytes"
        )
    return region[start : start + nbytes].view(tdtype).reshape(shape)


def write(dst: Any, data: Any, wait: bool = True) -> None:
    """``data`` (a numpy array or a torch tensor) copied into ``dst`` (a uint8 tensor of a
    region, its size), the copy finished; with ``wait=False`` only enqueued on the current
    stream (the caller awaits :func:`copied` before it answers)."""
    import torch  # lazy: torch is optional (only a GPU server maps CUDA memory)

    if isinstance(data, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    else:
        raw = data.contiguous().view(-1).view(torch.uint8)
    dst.copy_(raw)
    if wait:
        _current_stream(dst.device.index).synchronize()  # (the client reads it once answered)


async def copied(device: int) -> None:
    """Waits for the copies this thread enqueued on ``device``'s current stream, together with
    every other answer that awaits them in the same turn of the event loop: the answers of one
    batched run are handed back in one turn, and one synchronization then serves them all
    instead of one for each answer, each waiting in turn for the GPU to run its copy."""
    await together(("cuda", device), _current_stream(device).synchronize)


_together: dict[Any, list] = {}


async def together(key: Any, wait: Any) -> None:
    """``wait()`` called once for every caller that awaits this with ``key`` in the same turn of
    the running loop (in the next turn, on the loop's thread); its exception, if any, is each
    caller's. A caller cancelled meanwhile leaves the others waiting as before."""
    loop = asyncio.get_running_loop()
    waiters = _together.get((loop, key))
    if waiters is None:
        waiters = _together[(loop, key)] = []
        loop.call_soon(_settle, loop, key, wait)
    future = loop.create_future()
    waiters.append(future)
    await future


def _settle(loop: asyncio.AbstractEventLoop, key: Any, wait: Any) -> None:
    waiters = _together.pop((loop, key))
    try:
        wait()
    except Exception as exc:  # (each waiter gets it: a failed copy fails every answer it had)
        for future in waiters:
            if not future.done():
                future.set_exception(exc)
        return
    for future in waiters:
        if not future.done():
            future.set_result(None)


_streams: dict[tuple[int, int], Any] = {}


def _current_stream(device: int) -> Any:
    """``torch.cuda.current_stream(device)``, without building a new Stream object on every
    call (that alone takes tens of microseconds)."""
    import torch  # lazy: torch is optional (only a GPU server maps CUDA memory)

    try:
        sid, index, kind = torch._C._cuda_getCurrentStream(device)
    except (AttributeError, TypeError, ValueError):  # (another torch: the public way)
        return torch.cuda.current_stream(device)
    stream = _streams.get((index, sid))
    if stream is None:
        stream = _streams[(index, sid)] = torch.cuda.Stream(
            stream_id=sid, device_index=index, device_type=kind
        )
    return stream


def host(x: Any) -> np.ndarray:
    """``x`` as a numpy array: as it is, or a tensor on the GPU copied to the host."""
    if isinstance(x, np.ndarray):
        return x
    return x.detach().cpu().numpy()
