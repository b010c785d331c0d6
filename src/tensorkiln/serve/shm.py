"""Triton's system shared-memory extension: a client on the same machine puts tensors in a POSIX
shared-memory object, registers it once, and then sends requests that name a region of it
instead of carrying the bytes; outputs can be written back into a region the same way.

A registered key can name any shared-memory object the server may open, and outputs are written
into it, so the extension is off unless the server is started with
``--allow-shared-memory true``. Keys are plain object names (no path), opened under
/dev/shm without following links; the object must be a regular file holding the whole region,
and regions are bounded in size and number. Input bytes are copied out of the region when the
request is read, so a region can be unregistered or rewritten at any time after.

CUDA shared-memory regions (serve/cuda_shm.py) are kept here too, in the same namespace as in
Triton: a region name is either kind's, and a request's tensors may name either.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkiln.serve import cuda_shm
from tensorkiln.serve.protocol import ServeError

SHM_DIR = "/dev/shm"
MAX_REGIONS = 1024
MAX_REGION_BYTES = 4 << 30
_KEY = re.compile(r"^/?[A-Za-z0-9_.\-]{1,200}$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
_VIEWS_KEPT = 64  # tensors kept per CUDA region (places in it that requests name)


@dataclass
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    memory: mmap.mmap

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip


@dataclass
class _CudaRegion:
    name: str
    device_id: int
    byte_size: int
    memory: Any  # a uint8 torch tensor over the client's GPU memory
    # The tensors this region's requests read and write, kept: a client names the same places
    # request after request, and slicing and viewing a GPU tensor costs tens of microseconds
    # on the host. A view reads the memory when the engine runs, so a kept one is as fresh as
    # a new one. They go with the region (and keep its memory mapped only as long as it).
    _views: dict = field(default_factory=dict, repr=False)

    def view(self, start: int, dtype: np.dtype, shape: tuple[int, ...], what: str) -> Any:
        key = (start, dtype, shape)
        got = self._views.get(key)
        if got is None:
            got = cuda_shm.view(self.memory, start, dtype, shape, what)
            self._keep(key, got)
        return got

    def span(self, start: int, nbytes: int) -> Any:
        """The region's bytes ``start`` to ``start + nbytes`` (a uint8 tensor)."""
        key = (start, nbytes)
        got = self._views.get(key)
        if got is None:
            got = self.memory[start : start + nbytes]
            self._keep(key, got)
        return got

    def _keep(self, key: tuple, tensor: Any) -> None:
        if len(self._views) >= _VIEWS_KEPT:
            self._views.clear()
        self._views[key] = tensor

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


_KIND = {_Region: "system", _CudaRegion: "CUDA"}  # (as messages name them)


class SharedMemory:
    """The server's registered system (and CUDA) shared-memory regions."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()
        self.generation = 0  # counts registrations and drops (what was read of them may change)
        self.on_change: list[Any] = []  # called after a region is registered or dropped

    def _check_enabled(self, kind: str = "system") -> None:
        if not self.enabled:
            raise ServeError(
                f"{kind} shared memory is off on this server (start it with "
                "--allow-shared-memory true)",
                400,
            )

    def _check_new(self, name: Any, byte_size: Any) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ServeError(f"region name {str(name)[:60]!r} must be letters, digits, '_-.'")
        if not isinstance(byte_size, int) or isinstance(byte_size, bool) or byte_size < 0:
            raise ServeError(f"region '{name}': byte_size must be a byte count")
        if not 0 < byte_size <= MAX_REGION_BYTES:
            raise ServeError(
                f"region '{name}': byte_size {byte_size:,} must be 1 to {MAX_REGION_BYTES:,}"
            )
        with self._lock:
            if name in self._regions:
                raise ServeError(f"region '{name}' is already registered", 400)
            if len(self._regions) >= MAX_REGIONS:
                raise ServeError(f"{MAX_REGIONS} regions are registered already", 400)

    def _add(self, region: Any) -> None:
        with self._lock:
            if region.name in self._regions:  # (registered meanwhile)
                raise ServeError(f"region '{region.name}' is already registered", 400)
            self._regions[region.name] = region
            self.generation += 1
        self._changed()

    def _changed(self) -> None:
        for hook in self.on_change:
            hook()

    def register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the object ``key`` as region ``name``."""
        self._check_enabled()
        self._check_new(name, byte_size)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ServeError(f"region '{name}': offset must be a byte count")
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key.strip("/") in (".", ".."):
            raise ServeError(
                f"shared-memory key {str(key)[:60]!r} must be an object name such as '/input0'"
            )
        path = os.path.join(SHM_DIR, key.strip("/"))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ServeError(
                f"region '{name}': cannot open shared memory '{key}' ({exc.strerror})"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ServeError(f"region '{name}': '{key}' is not a shared-memory object")
            if offset + byte_size > st.st_size:
                raise ServeError(
                    f"region '{name}': offset {offset:,} + byte_size {byte_size:,} is past the "
                    f"end of '{key}' ({st.st_size:,} bytes)"
                )
            memory = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        try:
            self._add(_Region(name, key, offset, byte_size, memory))
        except ServeError:
            memory.close()
            raise

    def register_cuda(self, name: Any, raw_handle: Any, device_id: Any, byte_size: Any) -> None:
        """Open the GPU memory a client exported (``raw_handle``, its CUDA IPC handle) on
        device ``device_id``, ``byte_size`` bytes of it, as region ``name``."""
        self._check_enabled("CUDA")
        self._check_new(name, byte_size)
        memory = cuda_shm.open_region(name, raw_handle, device_id, byte_size)
        self._add(_CudaRegion(name, device_id, byte_size, memory))

    def unregister(self, name: str | None = None, kind: type = _Region) -> None:
        """Forget region ``name`` of ``kind`` (every such region when None); unknown names are
        no error, as in Triton."""
        self._check_enabled(_KIND[kind])
        self._forget(name, kind)

    def unregister_cuda(self, name: str | None = None) -> None:
        self.unregister(name, _CudaRegion)

    def _forget(self, name: str | None, kind: type | None = _Region) -> None:
        with self._lock:
            gone = [
                r for n, r in self._regions.items()
                if (not name or n == name) and (kind is None or isinstance(r, kind))
            ]  # fmt: skip
            for r in gone:
                del self._regions[r.name]
            if gone:
                self.generation += 1
        if gone:
            self._changed()
        for r in gone:
            if isinstance(r, _Region):
                with contextlib.suppress(BufferError):  # (an array still views it: freed with it)
                    r.memory.close()
            # (a CUDA region is closed when the last tensor viewing it is gone)

    def names(self) -> list[str]:
        with self._lock:
            return [n for n, r in self._regions.items() if isinstance(r, _Region)]

    def registrations(self) -> list[dict[str, Any]]:
        """Every registered system region's status (also where the extension is off: none)."""
        with self._lock:
            return [r.status() for r in self._regions.values() if isinstance(r, _Region)]

    def status(self, name: str | None = None, kind: type = _Region) -> list[dict[str, Any]]:
        what = _KIND[kind]
        self._check_enabled(what)
        with self._lock:
            if name:
                r = self._regions.get(name)
                if not isinstance(r, kind):
                    raise ServeError(f"no {what} shared-memory region '{name}' is registered", 400)
                return [r.status()]
            return [r.status() for r in self._regions.values() if isinstance(r, kind)]

    def cuda_status(self, name: str | None = None) -> list[dict[str, Any]]:
        return self.status(name, _CudaRegion)

    def _span(self, name: Any, offset: Any, byte_size: Any, what: str) -> tuple[Any, int]:
        self._check_enabled()
        if not isinstance(name, str):
            raise ServeError(f"{what}: shared_memory_region must be a region name")
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise ServeError(f"{what}: no shared-memory region '{name[:60]}' is registered")
        for label, v in (("shared_memory_offset", offset), ("shared_memory_byte_size", byte_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ServeError(f"{what}: {label} must be a byte count")
        if offset + byte_size > region.byte_size:
            raise ServeError(
                f"{what}: offset {offset:,} + {byte_size:,} bytes is past the end of region "
                f"'{name}' ({region.byte_size:,} bytes)"
            )
        return region, getattr(region, "offset", 0) + offset

    def read(self, name: Any, offset: Any, byte_size: Any, dtype: np.dtype,
             shape: tuple[int, ...], what: str) -> np.ndarray:  # fmt: skip
        """An input's tensor, copied out of its system region (its byte count checked), or a
        view of its CUDA region's GPU memory (a torch tensor)."""
        region, start = self._span(name, offset, byte_size, what)
        want = math.prod(shape) * dtype.itemsize
        if byte_size != want:
            raise ServeError(
                f"{what}: shared_memory_byte_size is {byte_size:,}; shape {list(shape)} of "
                f"{dtype} takes {want:,}"
            )
        if isinstance(region, _CudaRegion):
            return region.view(start, dtype, shape, what)
        view = np.frombuffer(region.memory, dtype, math.prod(shape), start)
        return view.reshape(shape).copy()

    def write(self, name: Any, offset: Any, byte_size: Any, data: np.ndarray, what: str,
              pending: set | None = None) -> None:  # fmt: skip
        """An output's tensor (a numpy array, or a torch tensor of a GPU engine's) into its
        region (it must fit in ``byte_size``). With a ``pending`` set, a copy into a CUDA region
        is only enqueued and its device added to the set (the caller awaits
        :func:`cuda_shm.copied` for each before it answers)."""
        region, start = self._span(name, offset, byte_size, what)
        nbytes = data.nbytes  # (numpy and torch alike)
        if nbytes > byte_size:
            raise ServeError(
                f"{what}: the output takes {nbytes:,} bytes, over the "
                f"shared_memory_byte_size of {byte_size:,}"
            )
        if isinstance(region, _CudaRegion):
            dst = region.span(start, nbytes)
            cuda_shm.write(dst, data, wait=pending is None)
            if pending is not None:
                pending.add(dst.device.index)
            return
        raw = np.ascontiguousarray(cuda_shm.host(data)).reshape(-1).view(np.uint8)
        np.frombuffer(region.memory, np.uint8, raw.size, start)[:] = raw

    def input_from(self, params: Mapping[str, Any], name: str, dtype: np.dtype,
                   shape: tuple[int, ...]) -> np.ndarray | None:  # fmt: skip
        """Input ``name`` read from the region its request parameters name (None when they
        name none)."""
        if "shared_memory_region" not in params:
            return None
        return self.read(
            params["shared_memory_region"], params.get("shared_memory_offset", 0),
            params.get("shared_memory_byte_size"), dtype, shape, f"input '{name}'",
        )  # fmt: skip

    def output_to(self, target: tuple, name: str, y: np.ndarray,
                  pending: set | None = None) -> dict[str, Any]:  # fmt: skip
        """Output ``name`` written into its ``target`` (from :func:`output_target`); the
        parameters its response tensor carries. ``pending``: as for :meth:`write`."""
        region, offset, size = target
        self.write(region, offset, size, y, f"output '{name}'", pending)
        params = {"shared_memory_region": region, "shared_memory_byte_size": y.nbytes}
        if offset:
            params["shared_memory_offset"] = offset
        return params

    def close(self) -> None:
        self._forget(None, None)


def output_target(params: Mapping[str, Any]) -> tuple | None:
    """(region, offset, byte size) a requested output's parameters name, or None."""
    if "shared_memory_region" not in params:
        return None
    return (
        params["shared_memory_region"], params.get("shared_memory_offset", 0),
        params.get("shared_memory_byte_size"),
    )  # fmt: skip


OFF = SharedMemory(enabled=False)  # (for a front end given no server's regions)
