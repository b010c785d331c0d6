"""The engine container: a fixed header, then one safetensors blob holding weights and the plan.

    offset  size  field
    0       8     magic b"TKENGINE"
    8       4     format version (little-endian uint32)
    12      4     reserved, zero
    16      8     payload length in bytes (uint64)
    24      32    sha256 of the payload
    56      ...   payload: a safetensors file; its metadata key "tensorkiln.plan" holds the plan (JSON)

The plan lists every tensor with its dtype, shape and sha256, so a payload whose checksum was
recomputed after tampering still fails when tensors are swapped or edited. Dtypes safetensors cannot
hold (int4, float4, float8 variants, complex) are stored as raw bytes and restored from the plan's
dtype. Reading never unpickles or executes anything. See docs/engine-format.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from tensorkiln.engine.schema import check_plan, printable
from tensorkiln.errors import EngineCompatibilityError, EngineFormatError
from tensorkiln.ir.dtypes import DType

MAGIC = b"TKENGINE"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ32s")
HEADER_SIZE = _HEADER.size
PLAN_KEY = "tensorkiln.plan"

# numpy dtypes safetensors stores natively; everything else travels as raw bytes.
_NATIVE = {
    np.dtype(t)
    for t in (
        np.float64,
        np.float32,
        np.float16,
        np.int64,
        np.int32,
        np.int16,
        np.int8,
        np.uint64,
        np.uint32,
        np.uint16,
        np.uint8,
        np.bool_,
    )
}


def tensor_digest(arr: np.ndarray) -> str:
    """sha256 over a tensor's element type, shape and bytes (so a retyped or reshaped tensor fails)."""
    h = hashlib.sha256(f"{DType.from_numpy(arr.dtype).name}{list(arr.shape)}".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def encode(plan: dict[str, Any], tensors: dict[str, np.ndarray]) -> bytes:
    """The bytes of an engine file holding ``plan`` and ``tensors``."""
    from safetensors.numpy import save

    table = {}
    stored = {}
    for key, arr in tensors.items():
        arr = np.asarray(arr, order="C")  # keeps 0-d (ascontiguousarray makes it 1-d)
        table[key] = {
            "dtype": DType.from_numpy(arr.dtype).name,
            "shape": list(arr.shape),
            "sha256": tensor_digest(arr),
        }
        stored[key] = arr if arr.dtype in _NATIVE else arr.reshape(-1).view(np.uint8)
    plan = {**plan, "tensors": table}
    text = json.dumps(plan, separators=(",", ":"), allow_nan=True)
    payload = save(stored, metadata={PLAN_KEY: text})
    digest = hashlib.sha256(payload).digest()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(payload), digest) + payload


def write(path: str | os.PathLike, plan: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
    """Write an engine file atomically (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode(plan, tensors))
    os.replace(tmp, path)


def decode(data: bytes, where: str = "engine") -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(plan, tensors) from engine bytes, after checking magic, version, length and checksums."""
    if len(data) < HEADER_SIZE:
        raise EngineFormatError(f"{where} is not a tensorkiln engine: only {len(data)} bytes")
    magic, version, reserved, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        hint = (
            " (it looks like an ONNX model: build it with `tensorkiln build`)"
            if data[:1] == b"\x08"  # ModelProto starts with ir_version, field 1 varint
            else ""
        )
        raise EngineFormatError(f"{where} is not a tensorkiln engine: wrong magic {magic!r}{hint}")
    if version != FORMAT_VERSION:
        raise EngineCompatibilityError(
            f"{where} has engine format version {version}; this tensorkiln reads version "
            f"{FORMAT_VERSION}. Rebuild the engine with this tensorkiln (`tensorkiln build`)."
        )
    if reserved != 0:
        raise EngineFormatError(
            f"{where} is corrupted: its header's reserved field is {reserved:#x}, not 0"
        )
    payload = data[HEADER_SIZE:]
    if len(payload) != length:
        state = "truncated" if len(payload) < length else "has trailing bytes"
        raise EngineFormatError(
            f"{where} is {state}: the header promises {length} payload bytes, found {len(payload)}"
        )
    if hashlib.sha256(payload).digest() != digest:
        raise EngineFormatError(f"{where} is corrupted: its checksum does not match its content")
    plan_text, stored = _read_payload(payload, where)
    try:
        plan = json.loads(plan_text)
    # RecursionError: JSON nested deeper than Python's stack, which json reports as such
    except (ValueError, RecursionError) as exc:
        raise EngineFormatError(f"{where}: the plan is not valid JSON ({exc})") from None
    if not isinstance(plan, dict):
        raise EngineFormatError(f"{where}: the plan is not a JSON object")
    check_plan(plan, where)  # every reader of the plan, from here on, reads checked data
    return plan, _restore(plan, stored, where)


def read(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    path = Path(path)
    if not path.is_file():
        raise EngineFormatError(f"engine file '{path}' does not exist")
    return decode(path.read_bytes(), f"'{path}'")


def _read_payload(payload: bytes, where: str) -> tuple[str, dict[str, np.ndarray]]:
    from safetensors.numpy import load

    try:
        (n,) = struct.unpack_from("<Q", payload)
        header = json.loads(payload[8 : 8 + n])
        plan_text = header["__metadata__"][PLAN_KEY]
        stored = load(payload)
    except Exception as exc:  # safetensors and json raise assorted errors on damaged bytes
        raise EngineFormatError(f"{where}: the weights section is damaged ({exc})") from None
    if not isinstance(plan_text, str):
        raise EngineFormatError(f"{where}: the plan is missing")
    return plan_text, stored


def _restore(plan: dict, stored: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    table = plan.get("tensors")
    if not isinstance(table, dict) or set(table) != set(stored):
        raise EngineFormatError(f"{where}: the plan's tensor table does not match the weights")
    tensors = {}
    for key, arr in stored.items():
        info = table[key]
        try:
            dtype = DType[info["dtype"]].numpy
            shape = tuple(info["shape"])  # ints in int64's range (checked with the plan)
            if arr.dtype != dtype:
                # Only types safetensors cannot hold travel as raw bytes; any other mismatch
                # would reinterpret the bytes (their sha256 still matching) as another type.
                if dtype in _NATIVE or dtype.kind == "O" or arr.dtype != np.uint8:
                    raise ValueError(f"stored as {arr.dtype}, the plan says {info['dtype']}")
                arr = arr.view(dtype).reshape(shape)
            ok = arr.shape == shape and tensor_digest(arr) == info["sha256"]
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineFormatError(
                f"{where}: tensor {printable(repr(key))} does not decode ({exc})"
            ) from None
        if not ok:
            raise EngineFormatError(
                f"{where}: tensor {printable(repr(key))} does not match the plan (shape or "
                "checksum differs)"
            )
        tensors[key] = arr
    return tensors
