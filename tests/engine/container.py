"""Take an engine file apart and put it back together, written from the documented layout only.

The tests use these to edit an engine and recompute its checksums, so that only the semantic
validators stand between the edit and a loaded engine. Nothing here calls tensorkiln's own encoder.

    header  <8sIIQ32s>: magic, format version, reserved, payload length, sha256(payload)
    payload safetensors: u64 header length, JSON header (tensors + "__metadata__"), tensor bytes
"""

from __future__ import annotations

import copy
import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

HEADER = struct.Struct("<8sIIQ32s")
MAGIC = b"TKENGINE"
PLAN_KEY = "tensorkiln.plan"


@dataclass
class Container:
    """An engine file in pieces: header fields, the plan, the stored tensors and other metadata."""

    version: int
    reserved: int
    plan: Any
    tensors: dict[str, tuple[str, list[int], bytes]]  # key -> (safetensors dtype, shape, bytes)
    metadata: dict[str, str] = field(default_factory=dict)
    plan_text: str | None = None  # when set, stored instead of json.dumps(plan)
    with_plan: bool = True  # False: no plan in the metadata at all

    def copy(self) -> Container:
        return copy.deepcopy(self)


def split(data: bytes) -> tuple[bytes, bytes]:
    """(header bytes, payload bytes)."""
    return data[: HEADER.size], data[HEADER.size :]


def payload_layout(data: bytes) -> dict[str, tuple[int, int]]:
    """Absolute byte ranges in the file: 'header', 'st_header' (safetensors JSON), 'weights'."""
    _, payload = split(data)
    (n,) = struct.unpack_from("<Q", payload)
    start = HEADER.size + 8
    return {
        "header": (0, HEADER.size),
        "st_header": (HEADER.size, start + n),
        "weights": (start + n, len(data)),
    }


def plan_range(data: bytes) -> tuple[int, int]:
    """Absolute byte range of the plan JSON text inside the safetensors header."""
    lo, hi = payload_layout(data)["st_header"]
    at = data.find(json.dumps(PLAN_KEY).encode(), lo, hi)
    assert at > 0, "plan key not found"
    start = data.index(b'"', at + len(PLAN_KEY) + 3) + 1
    end = start
    while data[end : end + 1] != b'"' or data[end - 1 : end] == b"\\":
        end += 1
    return start, end


def unpack(data: bytes) -> Container:
    _magic, version, reserved, _length, _digest = HEADER.unpack_from(data)
    _, payload = split(data)
    (n,) = struct.unpack_from("<Q", payload)
    header = json.loads(payload[8 : 8 + n])
    body = payload[8 + n :]
    meta = header.pop("__metadata__", {})
    plan = json.loads(meta.pop(PLAN_KEY))
    tensors = {}
    for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        lo, hi = info["data_offsets"]
        tensors[key] = (info["dtype"], list(info["shape"]), bytes(body[lo:hi]))
    return Container(version, reserved, plan, tensors, meta)


def pack_payload(c: Container) -> bytes:
    text = c.plan_text if c.plan_text is not None else json.dumps(c.plan)
    meta = {**c.metadata, PLAN_KEY: text} if c.with_plan else dict(c.metadata)
    header: dict[str, Any] = {"__metadata__": meta}
    body = bytearray()
    for key, (dtype, shape, raw) in c.tensors.items():
        header[key] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(body), len(body) + len(raw)],
        }
        body += raw
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + bytes(body)


def wrap(payload: bytes, version: int = 1, reserved: int = 0) -> bytes:
    """A header with the right length and checksum for ``payload``."""
    digest = hashlib.sha256(payload).digest()
    return HEADER.pack(MAGIC, version, reserved, len(payload), digest) + payload


def pack(c: Container) -> bytes:
    """Engine bytes for ``c`` with the container's length and checksum recomputed."""
    return wrap(pack_payload(c), c.version, c.reserved)


def reseal(data: bytes) -> bytes:
    """``data`` with its header's payload length and checksum recomputed (other fields kept)."""
    _magic, version, reserved, _length, _digest = HEADER.unpack_from(data)
    return wrap(data[HEADER.size :], version, reserved)


def digest(raw: bytes, dtype: str, shape: list[int]) -> str:
    """The plan's per-tensor checksum: sha256 over the element type name, the shape and the bytes."""
    return hashlib.sha256(f"{dtype}{list(shape)}".encode() + raw).hexdigest()
