"""The native gRPC transport (``tensorkiln serve --grpc-transport native``): gRPC C++ carries
the KServe v2 RPCs, this process answers them.

grpcio's Python server spends about a millisecond and a half a call in its own machinery on a
server CPU (HTTP/2 frames, completion queues and thread hand-offs under the interpreter lock),
more than the whole batch-1 inference of a ResNet-50 on the GPU. Here transport.cc (gRPC C++'s
async generic service, compiled against the system's gRPC C++) does that work on a thread of its
own that polls one completion queue, and queues each received request; an eventfd watched by
the event loop says when some are waiting, and the loop takes them as bytes (no gRPC thread
calls into the interpreter). The same service as the grpcio transport (serve/grpc.py) parses
each, runs it and answers. Clients see the same service: the wire format, status codes and
messages do not change.

The library is compiled from transport.cc on first use into the user's cache folder (the one
kernels/common/build.py keeps; name: a hash of the source, compiler and gRPC version), which needs
a C++17 compiler and gRPC C++'s headers (Debian/Ubuntu: ``apt-get install g++ pkg-config
libgrpc++-dev``). ``TENSORKILN_GRPC_LIBRARY`` names a library built elsewhere instead (a machine
with only gRPC C++'s runtime libraries). Nothing a client sends reaches the build.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tensorkiln.kernels.common.build import cached_library, find_program, run
from tensorkiln.serve.protocol import ServeError

log = logging.getLogger("tensorkiln.serve")

SOURCE = Path(__file__).with_name("transport.cc")
ABI = 3  # tk_abi_version() of the library this module drives
PACKAGES = (
    "g++, pkg-config and gRPC C++ (Debian/Ubuntu: apt-get install g++ pkg-config libgrpc++-dev)"
)

# gRPC status codes (grpc/status.h)
OK, CANCELLED, INVALID_ARGUMENT, NOT_FOUND = 0, 1, 3, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14
STATUS_OF_HTTP = {400: INVALID_ARGUMENT, 404: NOT_FOUND, 413: RESOURCE_EXHAUSTED, 503: UNAVAILABLE}


class NativeUnavailable(ServeError):
    """The native transport cannot be built or loaded here (the message says what is missing)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 500)


def _build() -> Path:
    """transport.cc compiled into the cache folder (reused when already there)."""
    cxx = find_program("CXX", ("c++", "g++", "clang++"))
    if cxx is None or shutil.which("pkg-config") is None:
        raise NativeUnavailable(f"the native gRPC transport is built here and needs {PACKAGES}")
    flags = run(["pkg-config", "--cflags", "--libs", "grpc++"])
    version = run(["pkg-config", "--modversion", "grpc++"])
    if flags.returncode != 0:
        raise NativeUnavailable(f"gRPC C++ was not found by pkg-config; install {PACKAGES}")
    key = (cxx, run([cxx, "--version"]).stdout, flags.stdout, version.stdout)
    command = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-o", "{out}", "{src}"]
    try:
        return cached_library(
            "grpc_transport", SOURCE, (k.encode() for k in key),
            [command + flags.stdout.split()], timeout=600,
        )  # fmt: skip
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"building the native gRPC transport failed: {exc}") from None


class _Library:
    def __init__(self, path: str) -> None:
        # (the calls made per request return at once and never call back into Python: they
        # keep the interpreter's lock, as PyDLL's do, rather than give it up and wait to take it
        # back from the engine's threads; only tk_stop, which waits, gives it up)
        lib = ctypes.PyDLL(path)
        lib.tk_abi_version.restype = ctypes.c_int
        if lib.tk_abi_version() != ABI:
            raise NativeUnavailable(f"{path} is another version of the native gRPC transport")
        lib.tk_start.restype = ctypes.c_void_p
        lib.tk_start.argtypes = [
            ctypes.c_char_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t,
        ]  # fmt: skip
        lib.tk_busy_poll.restype = None
        lib.tk_busy_poll.argtypes = [ctypes.c_void_p, ctypes.c_longlong]
        lib.tk_next.restype = ctypes.c_void_p
        lib.tk_next.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int),
        ]  # fmt: skip
        lib.tk_request_copy.restype = ctypes.c_int
        lib.tk_request_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.tk_reply.restype = None
        lib.tk_reply.argtypes = [
            ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p,
        ]  # fmt: skip
        waits = ctypes.CDLL(path)
        waits.tk_stop.restype = None
        waits.tk_stop.argtypes = [ctypes.c_void_p, ctypes.c_double]
        self.lib = lib
        self.stop = waits.tk_stop
        self.read = ctypes.PyDLL(None).read  # (libc's, the interpreter's lock kept: _take)
        self.read.restype = ctypes.c_ssize_t
        self.read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        self.path = path


@functools.cache
def library() -> _Library:
    """The transport library: ``TENSORKILN_GRPC_LIBRARY``'s, else built from transport.cc."""
    if not hasattr(os, "eventfd"):
        raise NativeUnavailable("the native gRPC transport needs Linux (it is woken by an eventfd)")
    named = os.environ.get("TENSORKILN_GRPC_LIBRARY", "").strip()
    path = Path(named) if named else _build()
    if named and not path.is_file():
        raise NativeUnavailable(f"TENSORKILN_GRPC_LIBRARY: no library at {named}")
    try:
        return _Library(str(path))
    except (OSError, AttributeError) as exc:
        raise NativeUnavailable(f"cannot load the native gRPC transport {path}: {exc}") from None


# Python 3.12's tasks can start at once: a request whose run is short (the batcher runs it on
# the loop's thread) is then answered within the callback that brought it
_EAGER = sys.version_info >= (3, 12)


class NativeServer:
    """A running native transport whose requests ``answer`` (an async function of the method
    path, the request bytes and whether the call is ModelStreamInfer, returning the response
    bytes or raising :class:`Reply`) handles on ``loop``."""

    def __init__(
        self,
        answer: Any,
        loop: asyncio.AbstractEventLoop,
        receive_buffer: Any = None,
        busy_poll_us: int = 0,
        pumps: int = 1,
    ) -> None:
        self._lib = library()
        self._answer = answer
        # (an inference request's bytes go where receive_buffer(size) says: a writable buffer)
        self._receive = receive_buffer or bytearray
        self._loop = loop
        self._server: int | None = None
        self._efd = -1
        self._tasks: set[asyncio.Task] = set()
        # (tk_next's outputs, reused)
        self._method = ctypes.c_void_p()
        self._method_len = ctypes.c_size_t()
        self._size = ctypes.c_size_t()
        self._streaming = ctypes.c_int()
        self._counter = ctypes.create_string_buffer(8)  # (the eventfd's, read to reset it)
        self.port = 0
        # busy polling: after an answer, look for the next request on every turn of the loop
        # for this long rather than sleep until the eventfd wakes the loop (see _poll)
        self._spin_us = max(0, busy_poll_us)
        self._spin_s = self._spin_us / 1e6
        self._spin_until = 0.0
        self._spinning = False
        # (threads of the transport's own that poll its sockets and completion queue)
        self._pumps = pumps

    def start(self, address: str, max_message: int, reuse_port: bool = False) -> None:
        port = ctypes.c_int(0)
        err = ctypes.create_string_buffer(512)
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        server = self._lib.lib.tk_start(
            address.encode(), max_message, int(reuse_port), efd, self._pumps,
            ctypes.byref(port), err, len(err),
        )  # fmt: skip
        if not server:
            os.close(efd)
            raise ServeError(err.value.decode(errors="replace") or "cannot start gRPC", 500)
        if self._spin_us:  # (the transport's thread polls the sockets meanwhile: _poll)
            self._lib.lib.tk_busy_poll(server, self._spin_us)
        self._server, self._efd, self.port = server, efd, port.value
        self._loop.add_reader(efd, self._take, server)

    def _take(self, server: int) -> None:
        """(the event loop, when the eventfd is readable) every waiting request copied out and
        handled; every request is answered, an unexpected fault with INTERNAL."""
        lib = self._lib.lib
        # (reset first: a later arrival signals again; libc's read with the lock kept, as
        # os.eventfd_read gives it up; nothing waiting: EAGAIN, ignored)
        self._lib.read(self._efd, self._counter, 8)
        while True:
            call = lib.tk_next(
                server, ctypes.byref(self._method), ctypes.byref(self._method_len),
                ctypes.byref(self._size), ctypes.byref(self._streaming),
            )  # fmt: skip
            if not call:
                return
            try:
                name = ctypes.string_at(self._method.value, self._method_len.value).decode(
                    "utf-8", "replace"
                )
                size = self._size.value
                data = self._receive(size) if name.endswith("Infer") else bytearray(size)
                if size:
                    buf = (ctypes.c_char * size).from_buffer(data)
                    if lib.tk_request_copy(call, buf, size) != 0:
                        raise RuntimeError("the request could not be read")
            except Exception as exc:  # (a fault of ours: the call is still answered)
                lib.tk_reply(call, None, 0, INTERNAL, f"internal error: {exc}".encode()[:200])
                continue
            self._dispatch(call, name, data, bool(self._streaming.value))

    def _busy(self) -> None:
        """(after an answer) Poll for the next request for the next ``busy_poll_us``."""
        self._spin_until = time.perf_counter() + self._spin_s
        if not self._spinning and self._server is not None:
            self._spinning = True
            self._loop.call_soon(self._poll, self._server)

    def _poll(self, server: int) -> None:
        """One turn of busy polling. A loop asleep in epoll is woken by the eventfd tens of
        microseconds after a request arrives (more where its core has gone idle); polling
        finds it within a turn, at the cost of a busy core. Only while no request is in flight:
        then worker threads may need the interpreter's lock, which a polling loop would keep
        taking from them. (The transport's own thread polls the sockets meanwhile:
        tk_busy_poll.)"""
        busy = any(not t.done() for t in self._tasks)  # (the one answered last may be there)
        if self._server != server or busy or time.perf_counter() > self._spin_until:
            self._spinning = False
            return
        self._take(server)
        self._loop.call_soon(self._poll, server)

    def _dispatch(self, call: int, name: str, data: Any, streaming: bool) -> None:
        coro = self._respond(call, name, data, streaming)
        if _EAGER:  # (the request is handled now, up to its first wait, not a loop turn later)
            task = asyncio.Task(coro, loop=self._loop, eager_start=True)
        else:
            task = self._loop.create_task(coro)
        if not task.done():
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _respond(self, call: int, name: str, data: Any, streaming: bool) -> None:
        code, body, message = OK, b"", b""
        try:
            body = await self._answer(name, data, streaming)
        except Reply as r:
            code, message = r.code, r.message.encode("utf-8", "replace")
        except BaseException as exc:  # (answered whatever happens: it frees the call)
            log.exception("internal error in %s", name)
            code, message = INTERNAL, f"internal error: {type(exc).__name__}".encode()
            if not isinstance(exc, Exception):
                self._lib.lib.tk_reply(call, None, 0, code, message)
                raise
        self._lib.lib.tk_reply(call, body, len(body), code, message)
        if self._spin_s:
            self._busy()

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking calls; those open after ``grace`` seconds are cancelled (their received
        requests still get their answers: the loop keeps taking them while the library waits)."""
        server, self._server = self._server, None
        if server is not None:
            try:
                await asyncio.to_thread(self._lib.stop, server, float(grace or 0.0))
            finally:
                self._loop.remove_reader(self._efd)
                os.close(self._efd)
                self._efd = -1


class Reply(Exception):  # (a status answer, not a fault)
    """A call answered with a gRPC status ``code`` other than OK and ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
