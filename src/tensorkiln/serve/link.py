"""Front-end processes: the HTTP and gRPC protocols handled outside the engine process.

One Python process serving every request spends about a millisecond of interpreter time per
request on protocol work (parsing, the socket reads of its tensors, building the reply), and the
interpreter lock makes that the server's ceiling however many cores there are. With
``tensorkiln serve --frontend-processes N``, N more processes listen on the same HTTP and gRPC
ports (SO_REUSEPORT: the kernel spreads the connections over every listening process), each with
its own interpreter. They parse requests and build replies; the engine process keeps every
model, batcher, statistic and shared-memory registration, so every process answers the same.

A front end talks to the engine process over a Unix socket in a folder only the server's user
can open. A frame is two little-endian uint32 (the JSON header's length and the payload's),
the JSON header, and the payload: the tensors' bytes, one after another, each described in the
header by name, datatype, shape, offset and size. Nothing in a frame is executed or unpickled.

What a front end asks (header ``op``): ``serving`` (once it listens), ``infer`` (the tensors checked and run by the engine
process's core as if its own HTTP or gRPC service had received them), ``statistics``, ``load``,
``unload``, ``shm_register`` and ``shm_unregister``. What the engine process sends unasked:
``state`` after every change of the loaded models (a front end answers metadata, config,
readiness and the repository index from the latest), and ``shm`` after every change of the
shared-memory registrations (every process maps the same regions, so an input in shared memory
is read, and an output written, by the process that received the request).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import struct
from typing import Any

import numpy as np

from tensorkiln.serve import protocol
from tensorkiln.serve.core import found, pick, server_metadata
from tensorkiln.serve.protocol import ServeError
from tensorkiln.serve.shm import SharedMemory

log = logging.getLogger("tensorkiln.serve")

_FRAME = struct.Struct("<II")
MAX_HEADER = 16 << 20
MAX_PAYLOAD = 2 << 30


# ---------------------------------------------------------------------- frames
async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """One frame: its header (a JSON object) and payload. Raises EOFError at a clean end."""
    try:
        head = await reader.readexactly(_FRAME.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise EOFError from None
        raise ValueError("a frame ended inside its length prefix") from None
    n_head, n_body = _FRAME.unpack(head)
    if n_head > MAX_HEADER or n_body > MAX_PAYLOAD:
        raise ValueError(f"a frame of {n_head:,} + {n_body:,} bytes is over the limits")
    header = json.loads(await reader.readexactly(n_head))
    if not isinstance(header, dict):
        raise ValueError("a frame's header must be a JSON object")
    body = await reader.readexactly(n_body) if n_body else b""
    return header, body


def write_frame(writer: asyncio.StreamWriter, header: dict[str, Any], chunks: list) -> None:
    """Queue one frame; ``chunks``: the payload's pieces (bytes-like), in order."""
    text = json.dumps(header).encode()
    size = sum(memoryview(c).nbytes for c in chunks)
    writer.writelines([_FRAME.pack(len(text), size), text, *chunks])


def pack_tensors(tensors: dict[str, np.ndarray]) -> tuple[list[dict[str, Any]], list]:
    """Descriptors (name, datatype, shape, offset, size) and payload chunks of ``tensors``."""
    descs, chunks, offset = [], [], 0
    for name, x in tensors.items():
        x = np.ascontiguousarray(x)
        datatype = protocol.datatype_of(x.dtype)
        if datatype is None or datatype == "BYTES":
            raise ServeError(f"tensor '{name}' has type {x.dtype}, which the link does not carry")
        view = memoryview(x.reshape(-1).view(np.uint8)) if x.size else memoryview(b"")
        descs.append({"name": name, "datatype": datatype, "shape": list(x.shape),
                      "offset": offset, "size": view.nbytes})  # fmt: skip
        chunks.append(view)
        offset += view.nbytes
    return descs, chunks


def unpack_tensors(descs: Any, payload: bytes) -> dict[str, np.ndarray]:
    """The arrays ``descs`` describe, as read-only views of ``payload`` (sizes checked)."""
    if not isinstance(descs, list):
        raise ValueError("tensor descriptors must be a list")
    out = {}
    for d in descs:
        dtype = protocol.numpy_dtype(str(d["datatype"]))
        if dtype is None:
            raise ValueError(f"tensor '{d['name']}': datatype {str(d['datatype'])[:20]!r}")
        shape = tuple(int(s) for s in d["shape"])
        start, size = int(d["offset"]), int(d["size"])
        if start < 0 or size < 0 or start + size > len(payload) or any(s < 0 for s in shape):
            raise ValueError(f"tensor '{d['name']}' lies outside its frame")
        if size != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"tensor '{d['name']}': {size} bytes for shape {list(shape)}")
        out[str(d["name"])] = np.frombuffer(payload, dtype, count=size // dtype.itemsize,
                                            offset=start).reshape(shape)  # fmt: skip
    return out


# ---------------------------------------------------------------------- the engine's side
class EngineLink:
    """The engine process's end: a Unix socket server over ``core`` that front ends connect
    to, and the pushes of state to every one of them."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.AbstractServer | None = None
        self.serving = 0  # front ends that said they listen
        core.on_change.append(self.push_state)
        core.on_shm_change.append(self._push_shm)

    async def start(self, path: str) -> None:
        self.server = await asyncio.start_unix_server(self._connection, path=path)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self.writers):
            w.close()

    def state(self) -> dict[str, Any]:
        """What a front end answers on its own: loaded models (metadata and config per version),
        failures, the repository index and the shared-memory registrations."""
        models = {}
        with self.core._lock:
            loaded = {name: dict(entry.versions) for name, entry in self.core.models.items()}
            failed = dict(self.core.failed)
        for name, versions in loaded.items():
            models[name] = {
                str(v): {
                    "metadata": m.metadata(),
                    "config": base64.b64encode(m.config.SerializeToString()).decode(),
                }
                for v, m in versions.items()
            }
        return {"op": "state", "models": models, "failed": failed, "index": self.core.index(),
                "shm": self.core.shm.registrations()}  # fmt: skip

    def push_state(self) -> None:
        self._push(self.state())

    def _push_shm(self) -> None:
        self._push({"op": "shm", "regions": self.core.shm.registrations()})

    def _push(self, header: dict[str, Any]) -> None:
        for w in list(self.writers):
            if not w.is_closing():
                write_frame(w, header, [])

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.writers.add(writer)
        write_frame(writer, self.state(), [])
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    header, body = await read_frame(reader)
                except EOFError:
                    break
                task = asyncio.create_task(self._answer(writer, header, body))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (ValueError, ConnectionError) as exc:
            log.error("front-end link closed: %s", exc)
        finally:
            self.writers.discard(writer)
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, header: dict, body: bytes) -> None:
        rid = header.get("id")
        try:
            reply, chunks = await self._serve(header, body)
            reply["id"] = rid
        except ServeError as exc:
            reply, chunks = {"id": rid, "error": str(exc), "status": exc.status}, []
        except Exception as exc:  # a fault of ours: answered, logged, and the link goes on
            log.exception("internal error on a front end's %s", header.get("op"))
            reply = {"id": rid, "error": f"internal error: {type(exc).__name__}", "status": 500}
            chunks = []
        if not writer.is_closing():
            write_frame(writer, reply, chunks)

    async def _serve(self, header: dict, body: bytes) -> tuple[dict, list]:
        op, core = header.get("op"), self.core
        if op == "infer":
            try:
                feeds = unpack_tensors(header.get("inputs"), body)
            except (KeyError, TypeError, ValueError) as exc:
                raise ServeError(f"malformed request from a front end: {exc}", 400) from None
            model, outputs = await core.infer(
                str(header.get("model", "")), header.get("version"), feeds,
                [str(n) for n in header.get("outputs") or []],
            )  # fmt: skip
            descs, chunks = pack_tensors(outputs)
            return {"model": model.name, "version": model.version, "outputs": descs}, chunks
        if op == "serving":
            self.serving += 1
            return {}, []
        if op == "statistics":
            name, version = str(header.get("model", "")), str(header.get("version", ""))
            return {"stats": await core.model_statistics(name, version)}, []
        if op in ("load", "unload"):
            name = str(header.get("model", ""))
            await (core.request_load(name) if op == "load" else core.request_unload(name))
            return {}, []
        if op == "shm_register":
            a = header.get("args") or {}
            await core.shm_register(
                a.get("name"), a.get("key"), a.get("offset"), a.get("byte_size")
            )
            return {}, []
        if op == "shm_unregister":
            await core.shm_unregister(header.get("name"))
            return {}, []
        raise ServeError(f"unknown link operation {op!r}", 400)


# ---------------------------------------------------------------------- the front end's side
class RemoteModel:
    """A model version as a front end sees it: name, version, metadata and config."""

    def __init__(self, name: str, version: int, metadata: dict, config: Any) -> None:
        self.name, self.version, self.config = name, version, config
        self._metadata = metadata

    def metadata(self) -> dict[str, Any]:
        return self._metadata


class _RemoteShm(SharedMemory):
    """The registrations as the engine process last sent them; register and unregister go
    there (every process then maps the same regions)."""

    def replace(self, regions: list[dict[str, Any]]) -> None:
        keep = {r["name"] for r in regions}
        for name in [n for n in self.names() if n not in keep]:
            SharedMemory.unregister(self, name)
        for r in regions:
            if r["name"] not in self.names():
                with contextlib.suppress(ServeError):  # (gone since: the next push says)
                    SharedMemory.register(self, r["name"], r["key"], r["offset"], r["byte_size"])


class RemoteCore:
    """What the HTTP and gRPC services need of a ServerCore, answered by the engine process
    over the link (inference, statistics, model control, shared-memory registration) or from
    the state it last pushed (metadata, config, readiness, index)."""

    def __init__(self, shared_memory: bool) -> None:
        self.shm = _RemoteShm(enabled=shared_memory)
        self.metrics = None
        self.failed: dict[str, str] = {}
        self._models: dict[str, dict[int, RemoteModel]] = {}
        self._index: list[dict[str, Any]] = []
        self._pending: dict[int, asyncio.Future] = {}
        self._next = 0
        self._writer: asyncio.StreamWriter | None = None
        self.closed = asyncio.Event()

    async def connect(self, path: str) -> None:
        reader, self._writer = await asyncio.open_unix_connection(path, limit=1 << 20)
        header, _ = await read_frame(reader)
        self._apply(header)
        asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, body = await read_frame(reader)
                rid = header.get("id")
                if rid is None:
                    self._apply(header)
                    continue
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result((header, body))
        except (EOFError, ValueError, ConnectionError) as exc:
            log.info("the engine process's link closed (%s)", type(exc).__name__)
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ServeError("the engine process is gone", 503))
            self._pending.clear()
            self.closed.set()

    def _apply(self, header: dict[str, Any]) -> None:
        if header.get("op") == "shm":
            self.shm.replace(header["regions"])
            return
        if header.get("op") != "state":
            return
        models = {}
        for name, versions in header["models"].items():
            models[name] = {}
            for v, entry in versions.items():
                config = protocol.model_config()
                config.ParseFromString(base64.b64decode(entry["config"]))
                models[name][int(v)] = RemoteModel(name, int(v), entry["metadata"], config)
        self._models, self.failed, self._index = models, dict(header["failed"]), header["index"]
        self.shm.replace(header["shm"])

    async def _call(self, header: dict[str, Any], chunks: list | None = None) -> tuple[dict, bytes]:
        if self._writer is None or self.closed.is_set():
            raise ServeError("the engine process is gone", 503)
        self._next += 1
        rid = header["id"] = self._next
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        write_frame(self._writer, header, chunks or [])
        reply, body = await fut
        if "error" in reply:
            raise ServeError(str(reply["error"]), int(reply.get("status", 500)))
        return reply, body

    # (ServerCore's interface, as the services use it)
    def model(self, name: str, version: str | None = None) -> RemoteModel:
        return pick(name, version, self._models.get(name), self.failed)

    def ready(self, name: str, version: str | None = None) -> bool:
        return found(self.model, name, version)

    def index(self) -> list[dict[str, Any]]:
        return list(self._index)

    def metadata(self) -> dict[str, Any]:
        return server_metadata()

    async def serving(self) -> None:
        """Tell the engine process this front end listens (its start waits for every one)."""
        await self._call({"op": "serving"})

    async def model_statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        reply, _ = await self._call({"op": "statistics", "model": name, "version": version})
        return reply["stats"]

    async def request_load(self, name: str) -> None:
        await self._call({"op": "load", "model": name})

    async def request_unload(self, name: str) -> None:
        await self._call({"op": "unload", "model": name})

    async def shm_register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        args = {"name": name, "key": key, "offset": offset, "byte_size": byte_size}
        await self._call({"op": "shm_register", "args": args})

    async def shm_unregister(self, name: Any) -> None:
        await self._call({"op": "shm_unregister", "name": name})

    async def infer(
        self, name: str, version: str | None, feeds: dict[str, np.ndarray], outputs: Any = ()
    ) -> tuple[RemoteModel, dict[str, np.ndarray]]:
        self.model(name, version)  # (unknown or not ready: answered here)
        descs, chunks = pack_tensors(feeds)
        header = {"op": "infer", "model": name, "version": version, "inputs": descs,
                  "outputs": list(outputs)}  # fmt: skip
        reply, body = await self._call(header, chunks)
        model = self._models.get(reply["model"], {}).get(int(reply["version"]))
        if model is None:  # (loaded since the last state: the reply's name and version)
            model = RemoteModel(reply["model"], int(reply["version"]), {}, None)
        return model, unpack_tensors(reply["outputs"], body)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.shm.close()
