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

A request's input tensors do not go through the socket when they fit in the connection's
arena: a shared-memory file the engine process creates for each front end (under /dev/shm,
else beside the socket; 0600, its space reserved up front) and the front end maps. The front
end writes the tensors into a block of it and sends their descriptors alone (header
``"arena": true``); the engine process reads them where they lie, without a copy, and the
block is free again when the reply arrives. Streamed through the socket, a 602 KB image cost
the engine process about 0.4 ms of copies per request (into the socket buffer, the stream
reader's buffer, then out of it), which made the link the server's ceiling. A request that does
not fit (the arena full, or a tensor larger than it) goes through the socket as before.

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
import bisect
import contextlib
import json
import logging
import math
import mmap
import os
import re
import secrets
import stat
import struct
from typing import Any

import numpy as np

from tensorkiln.serve import protocol
from tensorkiln.serve.core import found, pick, server_metadata
from tensorkiln.serve.protocol import ServeError
from tensorkiln.serve.shm import SHM_DIR, SharedMemory

log = logging.getLogger("tensorkiln.serve")

_FRAME = struct.Struct("<II")
MAX_HEADER = 16 << 20
MAX_PAYLOAD = 2 << 30
LINK_BUFFER = 16 << 20  # (a stream reader pauses its socket past twice this: frames are large)
ARENA_BYTES = 32 << 20  # each front end's shared memory for requests' inputs (50 ResNet images)
_ALIGN = 64
_ARENA_NAME = re.compile(r"^tensorkiln-link-[0-9]+-[0-9a-f]{16}$")


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


def pack_tensors(
    tensors: dict[str, np.ndarray], align: int = 1
) -> tuple[list[dict[str, Any]], list]:
    """Descriptors (name, datatype, shape, offset, size) and payload chunks of ``tensors``;
    ``align``: each tensor's offset a multiple of it (the chunks then leave gaps between)."""
    descs, chunks, offset = [], [], 0
    for name, x in tensors.items():
        x = np.ascontiguousarray(x)
        datatype = protocol.datatype_of(x.dtype)
        if datatype is None or datatype == "BYTES":
            raise ServeError(f"tensor '{name}' has type {x.dtype}, which the link does not carry")
        view = memoryview(x.reshape(-1).view(np.uint8)) if x.size else memoryview(b"")
        offset = _aligned(offset, align)
        descs.append({"name": name, "datatype": datatype, "shape": list(x.shape),
                      "offset": offset, "size": view.nbytes})  # fmt: skip
        chunks.append(view)
        offset += view.nbytes
    return descs, chunks


def unpack_tensors(descs: Any, payload: Any) -> dict[str, np.ndarray]:
    """The arrays ``descs`` describe, as read-only views of ``payload`` (the frame's payload,
    or an arena: anything with the buffer protocol; sizes checked)."""
    if not isinstance(descs, list):
        raise ValueError("tensor descriptors must be a list")
    length = memoryview(payload).nbytes
    out = {}
    for d in descs:
        dtype = protocol.numpy_dtype(str(d["datatype"]))
        if dtype is None:
            raise ValueError(f"tensor '{d['name']}': datatype {str(d['datatype'])[:20]!r}")
        shape = tuple(int(s) for s in d["shape"])
        start, size = int(d["offset"]), int(d["size"])
        if start < 0 or size < 0 or start + size > length or any(s < 0 for s in shape):
            raise ValueError(f"tensor '{d['name']}' lies outside its frame")
        if size != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor '{d['name']}': {size} bytes for shape {list(shape)}")
        x = np.frombuffer(payload, dtype, count=size // dtype.itemsize, offset=start)
        x.flags.writeable = False  # (an arena is writable: the engine must not write into it)
        out[str(d["name"])] = x.reshape(shape)
    return out


# ---------------------------------------------------------------------- arenas
def _arena_dir(link_path: str) -> str:
    """Where the engine process creates arenas: /dev/shm (memory), else the link's folder."""
    if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK):
        return SHM_DIR
    return os.path.dirname(link_path)


def create_arena(folder: str, size: int) -> tuple[str, mmap.mmap]:
    """A new shared-memory file of ``size`` bytes in ``folder`` (0600, its space reserved so
    that a full /dev/shm fails here, not as a bus error on a later write), mapped; its name."""
    name = f"tensorkiln-link-{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(folder, name)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return name, mmap.mmap(fd, size)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def open_arena(folder: str, name: Any, size: Any) -> mmap.mmap:
    """The arena ``name`` the engine process created in ``folder``, mapped (the name, the file's
    kind, owner and size checked: nothing else is opened)."""
    if not isinstance(name, str) or not _ARENA_NAME.fullmatch(name):
        raise ValueError(f"arena name {str(name)[:60]!r} is not one the engine process makes")
    if not isinstance(size, int) or not 0 < size <= MAX_PAYLOAD:
        raise ValueError(f"arena size {size!r}")
    fd = os.open(os.path.join(folder, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
            raise ValueError(f"arena {name} is not a {size}-byte file of this user")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _aligned(n: int, align: int = _ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


class Blocks:
    """A front end's bookkeeping of its arena: first-fit blocks of ``_ALIGN`` bytes."""

    def __init__(self, size: int) -> None:
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), by offset

    def take(self, nbytes: int) -> int | None:
        """The offset of a free block of ``nbytes`` (None: no room)."""
        n = max(_ALIGN, _aligned(nbytes))
        for i, (offset, size) in enumerate(self._free):
            if size >= n:
                if size == n:
                    del self._free[i]
                else:
                    self._free[i] = (offset + n, size - n)
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Free the block ``take`` gave for ``nbytes`` at ``offset`` (joined with its free
        neighbours)."""
        n = max(_ALIGN, _aligned(nbytes))
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and self._free[i][0] == offset + n:
            n += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:
            offset, n = self._free[i - 1][0], self._free[i - 1][1] + n
            i -= 1
            del self._free[i]
        self._free.insert(i, (offset, n))

    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)


# ---------------------------------------------------------------------- the engine's side
class EngineLink:
    """The engine process's end: a Unix socket server over ``core`` that front ends connect
    to, and the pushes of state to every one of them."""

    def __init__(self, core: Any, arena_bytes: int = ARENA_BYTES) -> None:
        self.core = core
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.AbstractServer | None = None
        self.serving = 0  # front ends that said they listen
        self.arena_bytes = arena_bytes  # (0: no arenas, every tensor through the socket)
        self._arena_dir = ""
        core.on_change.append(self.push_state)
        core.on_shm_change.append(self._push_shm)

    async def start(self, path: str) -> None:
        self._arena_dir = _arena_dir(path)
        self.server = await asyncio.start_unix_server(
            self._connection, path=path, limit=LINK_BUFFER
        )

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

    def _new_arena(self) -> tuple[dict[str, Any] | None, mmap.mmap | None]:
        """A connection's arena (what the front end is told of it, and its mapping), or none
        where it cannot be made (the reason logged: requests then go through the socket)."""
        if self.arena_bytes <= 0:
            return None, None
        try:
            name, memory = create_arena(self._arena_dir, self.arena_bytes)
        except OSError as exc:
            log.warning(
                "no shared-memory arena of %d MiB in %s for a front end (%s): its requests' "
                "tensors go through the link's socket", self.arena_bytes >> 20, self._arena_dir,
                exc,
            )  # fmt: skip
            return None, None
        where = "shm" if self._arena_dir == SHM_DIR else "link"
        return {"name": name, "size": self.arena_bytes, "where": where}, memory

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.writers.add(writer)
        told, arena = self._new_arena()
        write_frame(writer, {**self.state(), "arena": told}, [])
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    header, body = await read_frame(reader)
                except EOFError:
                    break
                task = asyncio.create_task(self._answer(writer, header, body, arena))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (ValueError, ConnectionError) as exc:
            log.error("front-end link closed: %s", exc)
        finally:
            self.writers.discard(writer)
            writer.close()
            if told is not None:
                with contextlib.suppress(OSError):  # (the front end unlinks it once mapped)
                    os.unlink(os.path.join(self._arena_dir, told["name"]))
            if arena is not None:
                with contextlib.suppress(BufferError):  # (views still held: unmapped when freed)
                    arena.close()

    async def _answer(
        self, writer: asyncio.StreamWriter, header: dict, body: bytes, arena: Any
    ) -> None:
        rid = header.get("id")
        try:
            reply, chunks = await self._serve(header, body, arena)
            reply["id"] = rid
        except ServeError as exc:
            reply, chunks = {"id": rid, "error": str(exc), "status": exc.status}, []
        except Exception as exc:  # a fault of ours: answered, logged, and the link goes on
            log.exception("internal error on a front end's %s", header.get("op"))
            reply = {"id": rid, "error": f"internal error: {type(exc).__name__}", "status": 500}
            chunks = []
        if not writer.is_closing():
            write_frame(writer, reply, chunks)

    async def _serve(self, header: dict, body: bytes, arena: Any) -> tuple[dict, list]:
        op, core = header.get("op"), self.core
        if op == "infer":
            source = body
            if header.get("arena"):
                if arena is None:
                    raise ServeError("a front end's request names an arena it was not given", 400)
                source = arena
            try:
                feeds = unpack_tensors(header.get("inputs"), source)
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
        self.batching = False  # (a front end's outputs come from the link, not CUDA copies)

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

    def register_cuda(self, name: Any, raw_handle: Any, device_id: Any, byte_size: Any) -> None:
        self._check_enabled("CUDA")
        raise ServeError(
            "CUDA shared memory is served without --frontend-processes (the engine's process "
            "holds the GPU; front-end processes do not)"
        )


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
        self._arena: mmap.mmap | None = None  # the engine process's shared memory for inputs
        self._blocks: Blocks | None = None
        self._held: dict[int, tuple[int, int]] = {}  # request id -> its arena block

    async def connect(self, path: str) -> None:
        reader, self._writer = await asyncio.open_unix_connection(path, limit=LINK_BUFFER)
        header, _ = await read_frame(reader)
        self._map_arena(path, header.get("arena"))
        self._apply(header)
        asyncio.get_running_loop().create_task(self._read(reader))

    def _map_arena(self, path: str, told: Any) -> None:
        """Map the arena the engine process made for this front end, then unlink its file
        (both ends hold it mapped; nothing is left behind if either dies)."""
        if not isinstance(told, dict):
            return
        folder = SHM_DIR if told.get("where") == "shm" else os.path.dirname(path)
        try:
            self._arena = open_arena(folder, told.get("name"), told.get("size"))
            self._blocks = Blocks(len(self._arena))
        except (OSError, ValueError) as exc:
            log.warning("the engine process's arena could not be mapped (%s): tensors go "
                        "through the socket", exc)  # fmt: skip
        with contextlib.suppress(OSError, TypeError, ValueError):
            os.unlink(os.path.join(folder, os.path.basename(str(told.get("name")))))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, body = await read_frame(reader)
                rid = header.get("id")
                if rid is None:
                    self._apply(header)
                    continue
                block = self._held.pop(rid, None)
                if block is not None and self._blocks is not None:  # (the engine is done with it)
                    self._blocks.give(*block)
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

    async def _call(
        self, header: dict[str, Any], chunks: list | None = None, block: tuple | None = None
    ) -> tuple[dict, bytes]:
        """Send ``header`` (and ``chunks``, the payload); the reply. ``block``: the arena block
        the request's tensors lie in, freed when the reply comes (even if nobody awaits it)."""
        if self._writer is None or self.closed.is_set():
            if block is not None and self._blocks is not None:
                self._blocks.give(*block)
            raise ServeError("the engine process is gone", 503)
        self._next += 1
        rid = header["id"] = self._next
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        if block is not None:
            self._held[rid] = block
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
        descs, chunks = pack_tensors(feeds, align=_ALIGN)
        header = {"op": "infer", "model": name, "version": version, "inputs": descs,
                  "outputs": list(outputs)}  # fmt: skip
        block = self._place(descs, chunks)
        if block is not None:
            header["arena"], chunks = True, []
        else:  # (through the socket: packed again without the arena's alignment gaps)
            header["inputs"], chunks = pack_tensors(feeds)
        reply, body = await self._call(header, chunks, block)
        model = self._models.get(reply["model"], {}).get(int(reply["version"]))
        if model is None:  # (loaded since the last state: the reply's name and version)
            model = RemoteModel(reply["model"], int(reply["version"]), {}, None)
        return model, unpack_tensors(reply["outputs"], body)

    def _place(self, descs: list[dict[str, Any]], chunks: list) -> tuple[int, int] | None:
        """Copy a request's tensors into a free block of the arena, pointing ``descs`` there;
        the block (offset, bytes), or None where there is no arena or no room."""
        if self._arena is None or self._blocks is None or not descs:
            return None
        nbytes = descs[-1]["offset"] + descs[-1]["size"]
        base = self._blocks.take(nbytes)
        if base is None:
            return None
        for d, chunk in zip(descs, chunks):
            d["offset"] += base
            self._arena[d["offset"] : d["offset"] + d["size"]] = chunk
        return base, nbytes

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.shm.close()
        if self._arena is not None:
            with contextlib.suppress(BufferError):
                self._arena.close()
