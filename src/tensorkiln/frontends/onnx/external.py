"""External data: tensors whose bytes live in files next to the model, read safely and only once.

The model file names the data file, offset and length of each tensor; the model comes from a stranger,
so every reference is checked before a byte is read: the name must be relative and stay inside the
model's folder once symbolic links are resolved (a link to /etc/passwd or a linked folder is refused,
as onnx and onnxruntime refuse it), the file must be a regular file (not /dev/zero or a pipe), and the
bytes must lie inside the file and match the tensor's dtype and dims.

Each data file is mapped read-only once; tensors are views of that mapping, and tensors that name the
same bytes get the same array. Memory then follows the data files' sizes, not the number of tensors
that name them (a model whose 256 tensors all name one 32 MiB file maps 32 MiB).
"""

from __future__ import annotations

import mmap
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tensorkiln.errors import ModelLoadError

# Element types whose raw bytes are not one numpy element each (4-bit types pack two per byte,
# bool bytes must be normalized): decoded through onnx from a copy of their bytes.
_PACKED = frozenset(
    {
        onnx.TensorProto.INT4,
        onnx.TensorProto.UINT4,
        onnx.TensorProto.FLOAT4E2M1,
        onnx.TensorProto.BOOL,
        onnx.TensorProto.STRING,
    }
)


# Data files from this size on are mapped; smaller ones are read (see _map_or_read).
_MAP_MIN_BYTES = 1 << 20


def uses_external_data(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` keeps its bytes in an external file."""
    return tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.EXTERNAL


@dataclass(frozen=True, slots=True)
class _Span:
    """Checked bytes of one tensor: a regular file inside the model folder, and a range in it."""

    path: str  # real path
    offset: int
    length: int


class ExternalData:
    """The external data files of one model folder, mapped on first use and shared by tensors."""

    def __init__(self, base_dir: str | os.PathLike, where: str) -> None:
        self.root = os.path.realpath(base_dir)
        self.where = where
        self._maps: dict[str, mmap.mmap | bytes] = {}
        self._arrays: dict[tuple, np.ndarray] = {}

    # ------------------------------------------------------------------ public
    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The tensor's data as a read-only array; the same bytes give the same array."""
        span = self.locate(tensor)
        key = (span, tensor.data_type, tuple(tensor.dims))
        arr = self._arrays.get(key)
        if arr is None:
            arr = self._decode(tensor, span)
            self._arrays[key] = arr
        return arr

    def read(self, tensor: onnx.TensorProto) -> bytes:
        """A copy of the tensor's bytes (for callers that need them inside a protobuf)."""
        span = self.locate(tensor)
        return bytes(self._map(span.path)[span.offset : span.offset + span.length])

    def locate(self, tensor: onnx.TensorProto) -> _Span:
        """Check the tensor's external reference; raises ModelLoadError naming what is wrong."""
        info = {e.key: e.value for e in tensor.external_data}
        name = tensor.name or "<unnamed>"
        location = info.get("location", "")
        if not location:
            raise self._error(name, "uses external data but names no file")
        path = self._resolve(name, location)
        size = self._file_size(name, location, path)
        offset, length = self._range(name, info)
        try:
            expected = _expected_bytes(tensor)
        except ValueError as exc:
            raise self._error(name, str(exc)) from None
        if length is None:  # (without a length, the tensor's own size says how much to read)
            length = expected
        if offset + length > size:
            raise self._error(
                name,
                f"reads bytes {offset}..{offset + length} of '{location}', which has only "
                f"{size} bytes (truncated data file?)",
            )
        if expected != length:
            raise self._error(
                name,
                f"has {length} bytes in '{location}', but its type and dims "
                f"{list(tensor.dims)} need {expected}",
            )
        return _Span(path, offset, length)

    # ------------------------------------------------------------------ checks
    def _error(self, name: str, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.where}: tensor '{name}' {what}")

    def _resolve(self, name: str, location: str) -> str:
        """The real path of ``location``, which must stay inside the model's folder."""
        parts = set(PurePosixPath(location).parts) | set(PureWindowsPath(location).parts)
        if (
            "\0" in location
            or os.path.isabs(location)
            or PureWindowsPath(location).is_absolute()
            or PureWindowsPath(location).drive
            or ".." in parts
        ):
            raise self._error(
                name,
                f"points at external data '{location}' outside the model's folder; refusing to "
                "read it (external data must be a relative path inside the folder)",
            )
        real = os.path.realpath(os.path.join(self.root, location))
        if os.path.commonpath([self.root, real]) != self.root:
            raise self._error(
                name,
                f"points at external data '{location}', which resolves to '{real}' outside the "
                f"model's folder '{self.root}' (a symbolic link?); refusing to read it",
            )
        return real

    def _file_size(self, name: str, location: str, path: str) -> int:
        try:
            st = os.stat(path)
        except OSError:
            raise self._error(
                name,
                f"keeps its data in '{location}', which was not found in '{self.root}'. Copy the "
                "data file next to the model.",
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise self._error(
                name,
                f"keeps its data in '{location}', which is not a regular file (a device, pipe or "
                "folder); refusing to read it",
            )
        return st.st_size

    def _range(self, name: str, info: dict[str, str]) -> tuple[int, int | None]:
        try:
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else None
        except ValueError:
            raise self._error(name, "has a bad external data offset/length") from None
        if offset < 0 or (length is not None and length < 0):
            raise self._error(name, f"has a negative external data offset/length ({info})")
        return offset, length

    # ------------------------------------------------------------------ reading
    def _map(self, path: str) -> mmap.mmap | bytes:
        """The whole file, mapped read-only once. The file is opened without following a link
        and checked again after opening, so swapping it for a device or link in between fails."""
        m = self._maps.get(path)
        if m is not None:
            return m
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise ModelLoadError(
                f"{self.where}: external data '{path}' cannot be opened: {exc}"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ModelLoadError(f"{self.where}: external data '{path}' is not a regular file")
            m = _map_or_read(fd, st.st_size)
        finally:
            os.close(fd)
        self._maps[path] = m
        return m

    def _decode(self, tensor: onnx.TensorProto, span: _Span) -> np.ndarray:
        buf = self._map(span.path)
        if span.offset + span.length > len(buf):
            raise self._error(tensor.name, f"lost its data: '{span.path}' shrank while being read")
        dims = tuple(tensor.dims)
        if tensor.data_type in _PACKED or sys.byteorder != "little":
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            del copy.external_data[:]
            copy.data_location = onnx.TensorProto.DEFAULT
            copy.raw_data = bytes(buf[span.offset : span.offset + span.length])
            try:
                return numpy_helper.to_array(copy)
            except Exception as exc:  # onnx raises assorted errors on malformed payloads
                raise self._error(tensor.name, f"could not be decoded: {exc}") from None
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        count = span.length // dtype.itemsize
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=span.offset)
        return arr.reshape(dims)


def _map_or_read(fd: int, size: int) -> mmap.mmap | bytes:
    """The file read-only: mapped when large, read when small. A mapping holds a duplicate of the
    descriptor, and models saved one file per tensor have thousands of small files."""
    if size >= _MAP_MIN_BYTES:
        try:
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError:  # out of descriptors or address space: read it instead
            pass
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 30))
        if not chunk:
            break  # (shrank since the check: the caller finds the bytes missing)
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _expected_bytes(tensor: onnx.TensorProto) -> int:
    """How many bytes the tensor's type and dims need."""
    if any(d < 0 for d in tensor.dims):
        raise ValueError(f"has negative dims {list(tensor.dims)}")
    if tensor.data_type == onnx.TensorProto.STRING:
        raise ValueError("keeps strings in external data, which ONNX does not allow")
    try:
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"has unknown element type {tensor.data_type}") from None
    count = int(np.prod(tensor.dims, dtype=object)) if tensor.dims else 1
    if tensor.data_type in (
        onnx.TensorProto.INT4,
        onnx.TensorProto.UINT4,
        onnx.TensorProto.FLOAT4E2M1,
    ):
        return (count + 1) // 2
    return count * dtype.itemsize
