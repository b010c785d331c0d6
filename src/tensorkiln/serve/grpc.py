"""KServe v2 over gRPC: the GRPCInferenceService of the protocol's definitions, on grpcio's
asyncio server.

The service is registered with generic handlers whose messages come from protocol.py's descriptor
pool. There is no generated stub, and the wire format is the published one, so tritonclient.grpc
talks to it unchanged. Tensors come in as raw contents (what tritonclient sends) or typed
contents. Sizes are checked against shapes and data types before any array is made. A client's
error is answered with INVALID_ARGUMENT, NOT_FOUND or UNAVAILABLE and a message naming it. RPCs
not served here (tracing, logging settings) answer UNIMPLEMENTED. Tensors may lie in system or
CUDA shared memory (shm.py, cuda_shm.py).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc
import numpy as np
from google.protobuf import json_format

from tensorkiln.serve import cuda_shm, native, protocol, wire
from tensorkiln.serve.core import ServerCore, log
from tensorkiln.serve.protocol import ServeError
from tensorkiln.serve.shm import OFF as shm_off
from tensorkiln.serve.shm import SharedMemory, output_target

SERVICE = "inference.GRPCInferenceService"
MAX_MESSAGE = 64 << 20  # bytes, as the HTTP body bound
_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    503: grpc.StatusCode.UNAVAILABLE,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# typed contents: the InferTensorContents field of each datatype
_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}  # fmt: skip


def _m(name: str) -> Any:
    return protocol.message(f"inference.{name}")


class InferenceService:
    """The RPCs over a :class:`ServerCore`."""

    def __init__(self, core: ServerCore, max_message: int = 64 << 20) -> None:
        self.core = core
        self.max_message = max_message
        # inference requests' plans (see _Plan), by the request's bytes without its raw contents
        self._plans: dict[bytes, _Plan] = {}
        self._heads: dict[tuple, bytes] = {}  # (responses' bytes but for id and contents: _infer)
        core.shm.on_change.append(self._plans.clear)  # (plans hold views of CUDA regions)

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return _m("ServerLiveResponse")(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return _m("ServerReadyResponse")(ready=not self.core.failed)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        return _m("ModelReadyResponse")(ready=self.core.ready(request.name, request.version))

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return _m("ServerMetadataResponse")(**self.core.metadata())

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        meta = self.core.model(request.name, request.version).metadata()
        reply = _m("ModelMetadataResponse")()
        json_format.ParseDict(meta, reply)
        return reply

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        model = self.core.model(request.name, request.version)
        reply = _m("ModelConfigResponse")()
        reply.config.CopyFrom(model.config)
        return reply

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        reply = _m("RepositoryIndexResponse")()
        for item in self.core.index():
            if request.ready and item.get("state") != "READY":
                continue
            reply.models.add(
                **{k: item[k] for k in ("name", "version", "state", "reason") if k in item}
            )
        return reply

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self.core.request_load(request.model_name)
        return _m("RepositoryModelLoadResponse")()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self.core.request_unload(request.model_name)
        return _m("RepositoryModelUnloadResponse")()

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        reply = _m("SystemSharedMemoryStatusResponse")()
        for r in self.core.shm.status(request.name):
            reply.regions[r["name"]].CopyFrom(
                _m("SystemSharedMemoryStatusResponse.RegionStatus")(**r)
            )
        return reply

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self.core.shm_register(request.name, request.key, request.offset, request.byte_size)
        return _m("SystemSharedMemoryRegisterResponse")()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        await self.core.shm_unregister(request.name)
        return _m("SystemSharedMemoryUnregisterResponse")()

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        reply = _m("CudaSharedMemoryStatusResponse")()
        for r in self.core.shm.cuda_status(request.name):
            reply.regions[r["name"]].CopyFrom(
                _m("CudaSharedMemoryStatusResponse.RegionStatus")(**r)
            )
        return reply

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self.core.shm.register_cuda(
            request.name, request.raw_handle, request.device_id, request.byte_size
        )
        return _m("CudaSharedMemoryRegisterResponse")()

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.core.shm.unregister_cuda(request.name)
        return _m("CudaSharedMemoryUnregisterResponse")()

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        reply = _m("ModelStatisticsResponse")()
        stats = await self.core.model_statistics(request.name, request.version)
        json_format.ParseDict({"model_stats": stats}, reply)
        return reply

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        return await self._infer(request)  # (an InferCall, from parse)

    async def ModelStreamInfer(self, requests: AsyncIterator, context: Any) -> AsyncIterator:
        """Each request's response on the stream, in order; an error is a response carrying
        ``error_message`` and the stream goes on, as Triton's does. The requests come as bytes
        (a malformed one is such an error)."""
        async for data in requests:
            yield await self.stream_reply(data)

    async def stream_reply(self, data: Any) -> bytes:
        """ModelStreamInfer's response to one request's bytes (serialized)."""
        try:
            request = parse("ModelStreamInfer", data)
            return wire.field(2, await self._infer(request))  # (infer_response)
        except ServeError as exc:
            return _m("ModelStreamInferResponse")(error_message=str(exc)).SerializeToString()

    async def _infer(self, call: InferCall) -> bytes:
        """An inference request (from :func:`parse`) answered: the ModelInferResponse's
        bytes."""
        request, raw, header = call
        shm = self.core.shm
        plan = self._plans.get(header) if header is not None else None
        if plan is not None and plan.generation == shm.generation:
            feeds, wanted, targets = plan.feeds(raw, shm), plan.wanted, plan.targets
        else:
            feeds = _feeds(request, self.max_message, shm, raw)
            wanted = [o.name for o in request.outputs]
            targets = {}  # output -> (region, offset, byte size) in shared memory
            for o in request.outputs:
                target = output_target(_params(o.parameters))
                if target is not None:
                    targets[o.name] = target
            if header is not None and len(header) <= _PLAN_HEADER_MAX:
                plan = _Plan.of(request, raw, feeds, wanted, targets, shm)
                if plan is not None:
                    _keep(self._plans, header, plan)
        model, outputs = await self.core.infer(
            request.model_name, request.model_version, feeds, wanted
        )
        contents, params = [], {}
        # (a batching model's answers come back together: their copies into CUDA regions share
        # one wait; a batch-1 model's answer waits for its own copy at once, before another
        # run can be enqueued ahead of a shared wait)
        pending: set | None = set() if model.batching else None
        for n, y in outputs.items():
            if n in targets:
                params[n] = shm.output_to(targets[n], n, y, pending)
                contents.append(b"")  # (keeps the contents in output order)
            else:
                contents.append(cuda_shm.host(y).tobytes())
        for device in pending or ():
            await cuda_shm.copied(device)
        # (the response's bytes but for its id and contents: the same request after request)
        key = (model.name, model.version, *((n, y.dtype, y.shape, targets.get(n))
                                            for n, y in outputs.items()))  # fmt: skip
        head = self._heads.get(key)
        if head is None:
            head = _keep(self._heads, key, _head(model, outputs, params))
        ident = wire.field(3, request.id.encode()) if request.id else b""
        return b"".join([head, ident, *(wire.field(6, c) for c in contents)])


def _keep(cache: dict, key: Any, value: Any) -> Any:
    """``value`` stored in ``cache`` (plans, response heads: emptied when _PLANS_KEPT are
    there, so what strangers' requests leave behind stays bounded)."""
    if len(cache) >= _PLANS_KEPT:
        cache.clear()
    cache[key] = value
    return value


def _head(model: Any, outputs: dict, params: dict) -> bytes:
    """A ModelInferResponse's bytes without its id and raw contents (fields 3 and 6, which the
    caller appends: a message's fields may come in any order)."""
    reply = _m("ModelInferResponse")(model_name=model.name, model_version=str(model.version))
    for n, y in outputs.items():
        t = reply.outputs.add(name=n, datatype=protocol.datatype_of(y.dtype), shape=list(y.shape))
        for key, value in params.get(n, {}).items():
            if isinstance(value, str):
                t.parameters[key].string_param = value
            else:
                t.parameters[key].int64_param = value
    return reply.SerializeToString()


_PLAN_HEADER_MAX = 4096  # bytes of a request without its raw contents, at most, to keep a plan
_PLANS_KEPT = 256


class _Plan(NamedTuple):
    """What an inference request's bytes other than its raw contents say, worked out once:
    clients send the same names, shapes, data types and shared-memory places request after
    request, and only the tensors' bytes change. A request whose other bytes are the same as
    an earlier one's takes that one's plan; its raw contents are still checked (count and
    sizes) and viewed, and system shared memory read again. Kept only for requests whose
    inputs are raw contents or in shared memory, and only while no region is registered or
    dropped (``generation``)."""

    generation: int
    # per input: name, dtype, shape, datatype, and where (None: raw contents; the parameters
    # naming its system region; its view of a CUDA region)
    inputs: tuple
    raw_count: int
    wanted: list
    targets: dict

    @staticmethod
    def of(request: Any, raw: list, feeds: dict, wanted: list, targets: dict,
           shm: SharedMemory) -> _Plan | None:  # fmt: skip
        """The plan of a request whose ``feeds`` were just made from it and its raw contents
        ``raw``, or None where its inputs cannot be planned (typed contents)."""
        inputs = []
        for t in request.inputs:
            x = feeds[t.name]
            params = _params(t.parameters)
            host = isinstance(x, np.ndarray)
            dtype, shape = (x.dtype if host else None), tuple(x.shape)
            if "shared_memory_region" in params:
                # (a CUDA region's view stays as it is; system memory is copied out each time)
                inputs.append((t.name, dtype, shape, t.datatype, params if host else x))
            elif raw:
                inputs.append((t.name, dtype, shape, t.datatype, None))
            else:
                return None
        return _Plan(shm.generation, tuple(inputs), len(raw or ()), wanted, targets)

    def feeds(self, raw: list, shm: SharedMemory) -> dict[str, Any]:
        """This request's feeds: the plan's, with the raw contents ``raw`` (checked)."""
        if len(raw) != self.raw_count:
            raise ServeError(
                f"the request has {self.raw_count} inputs outside shared memory and {len(raw)} "
                "raw contents; give one per such input, or none"
            )
        feeds: dict[str, Any] = {}
        j = 0
        for name, dtype, shape, datatype, where in self.inputs:
            if where is None:
                feeds[name], j = _from_raw(raw[j], name, dtype, shape, datatype), j + 1
            elif isinstance(where, dict):
                feeds[name] = shm.input_from(where, name, dtype, shape)
            else:
                feeds[name] = where
        return feeds


def _params(parameters: Any) -> dict[str, Any]:
    """A protocol parameters map as plain values."""
    out = {}
    for key, p in parameters.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which else None
    return out


def _feeds(request: Any, limit: int = MAX_MESSAGE, shm: SharedMemory = shm_off,
           raw: list | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """The request's tensors as arrays, every size checked first (``shm``: the server's
    shared-memory regions, which inputs may name; ``raw``: its raw contents where they were
    taken out of the message, else the message's own)."""
    if not request.inputs:
        raise ServeError("the request has no inputs")
    if raw is None:  # (a message built in this process, as the tests build them)
        raw = list(request.raw_input_contents)
    in_shm = ["shared_memory_region" in t.parameters for t in request.inputs]
    if raw and len(raw) != in_shm.count(False):
        raise ServeError(
            f"the request has {in_shm.count(False)} inputs outside shared memory and {len(raw)} "
            "raw contents; give one per such input, or none"
        )
    feeds: dict[str, np.ndarray] = {}
    j = 0  # (raw contents are those of the inputs outside shared memory, in order)
    for i, t in enumerate(request.inputs):
        if not t.name:
            raise ServeError(f"input {i} has no name")
        if t.name in feeds:
            raise ServeError(f"input '{t.name}' is given twice")
        dtype, shape = protocol.declared(t.name, t.datatype, list(t.shape), limit)
        x = shm.input_from(_params(t.parameters), t.name, dtype, shape)
        if x is not None:
            feeds[t.name] = x
            continue
        if raw:
            feeds[t.name], j = _from_raw(raw[j], t.name, dtype, shape, t.datatype), j + 1
            continue
        field = _FIELD.get(t.datatype)
        if field is None:
            raise ServeError(f"input '{t.name}': {t.datatype} is sent as raw contents")
        feeds[t.name] = protocol.from_values(t.name, list(getattr(t.contents, field)), dtype, shape)
    return feeds


def _from_raw(data: Any, name: str, dtype: np.dtype, shape: tuple, datatype: str) -> np.ndarray:
    """An input's raw contents as an array of its declared shape (its byte count checked)."""
    want = math.prod(shape) * dtype.itemsize
    if len(data) != want:
        raise ServeError(
            f"input '{name}': {len(data)} bytes of raw contents; shape {list(shape)} of "
            f"{datatype} takes {want}"
        )
    return np.frombuffer(data, dtype).reshape(shape)


class InferCall(NamedTuple):
    """A ModelInferRequest parsed without its raw contents, and those contents as views into
    the received bytes (serve/wire.py: no copy of the tensors); ``header``: the request's
    bytes without them (None where the message was parsed whole)."""

    request: Any
    raw: list
    header: bytes | None = None


_RAW_INPUT_CONTENTS = 7  # ModelInferRequest's field number


def parse(name: str, data: Any) -> Any:
    """RPC ``name``'s request message from its bytes (an :class:`InferCall` for inference);
    bytes that are not one are the client's error (both transports take requests as bytes, so
    each answers this the same way)."""
    request_type = _request_type(name)
    try:
        if name not in ("ModelInfer", "ModelStreamInfer"):
            return request_type.FromString(data)  # (a bytearray parses without a copy first)
        split = wire.split_field(data, _RAW_INPUT_CONTENTS)
        if split is not None:
            return InferCall(request_type.FromString(split[0]), split[1], split[0])
        # (not fields protobuf-style: protobuf says why; it reads bytes, not any buffer)
        whole = request_type.FromString(memoryview(data))
        return InferCall(whole, list(whole.raw_input_contents))
    except Exception:  # (protobuf's DecodeError, whichever backend raises it)
        raise ServeError(f"{name}: the request is not a valid {request_type.__name__}") from None


def _unary(service: InferenceService, name: str) -> grpc.RpcMethodHandler:
    method = getattr(service, name)

    async def handle(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(parse(name, data), context)
        except ServeError as exc:
            await context.abort(_STATUS.get(exc.status, grpc.StatusCode.INTERNAL), str(exc))
        except Exception as exc:  # a fault of ours: answered, logged, the server goes on
            log.exception("internal error in %s", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")

    return grpc.unary_unary_rpc_method_handler(handle, response_serializer=_serialize)


@functools.cache
def _request_type(name: str) -> Any:
    method = protocol._pool().FindServiceByName(SERVICE).FindMethodByName(name)
    return protocol.message(method.input_type.full_name)


def _serialize(message: Any) -> bytes:
    """(inference answers come serialized already)"""
    return message if isinstance(message, bytes) else message.SerializeToString()


RPCS = (
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
    "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload", "ModelInfer",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "ModelStatistics", "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
)  # fmt: skip


def handlers(core: ServerCore, max_message: int = 64 << 20) -> grpc.GenericRpcHandler:
    """The service's generic handler over ``core``; no input may declare more than
    ``max_message`` bytes."""
    service = InferenceService(core, max_message)
    methods: dict[str, grpc.RpcMethodHandler] = {n: _unary(service, n) for n in RPCS}
    methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        service.ModelStreamInfer, response_serializer=_serialize
    )
    return grpc.method_handlers_generic_handler(SERVICE, methods)


TRANSPORTS = ("grpcio", "native")


def native_answer(service: InferenceService) -> Any:
    """The native transport's handler (serve/native): a method path and its request bytes to
    the response bytes, a client's error as a status (the grpcio transport's codes and
    messages)."""
    prefix = f"/{SERVICE}/"
    served = frozenset(RPCS)

    async def answer(path: str, data: Any, streaming: bool) -> bytes:
        if streaming:  # one request of ModelStreamInfer: errors go in the stream's response
            return await service.stream_reply(data)
        name = path[len(prefix) :] if path.startswith(prefix) else ""
        if name not in served:
            raise native.Reply(native.UNIMPLEMENTED, f"{path}: no such method here")
        try:
            return _serialize(await getattr(service, name)(parse(name, data), None))
        except ServeError as exc:
            code = native.STATUS_OF_HTTP.get(exc.status, native.INTERNAL)
            raise native.Reply(code, str(exc)) from None

    return answer


async def start(
    core: ServerCore,
    address: str,
    *,
    max_message: int = MAX_MESSAGE,
    reuse_port: bool = False,
    transport: str = "grpcio",
    busy_poll_us: int = 0,
) -> Any:
    """A started gRPC server on ``address`` ("host:port") over ``core``; ``reuse_port``: other
    processes may listen on the same port (front-end processes, serve/link.py); ``transport``:
    grpcio's asyncio server, or gRPC C++ through serve/native (the same service; it has
    ``stop(grace)`` as grpcio's server has); ``busy_poll_us``: the native transport polls for
    the next request this long after each answer (serve/native: NativeServer._poll)."""
    if transport == "native":
        service = InferenceService(core, max_message)
        # (a front end's core forwards the tensors to the engine process: plain buffers there)
        receive = getattr(core, "receive_buffer", None)
        server = native.NativeServer(
            native_answer(service), asyncio.get_running_loop(), receive, busy_poll_us
        )
        server.start(address, max_message, reuse_port)
        return server
    if transport != "grpcio":
        raise ServeError(f"unknown gRPC transport '{transport}'; known: {', '.join(TRANSPORTS)}")
    options = [
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message),
        ("grpc.http2.lookahead_bytes", 16 << 20),
        ("grpc.so_reuseport", int(reuse_port)),
    ]
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((handlers(core, max_message),))
    if server.add_insecure_port(address) == 0:
        raise ServeError(f"cannot listen for gRPC on {address}", 500)
    await server.start()
    return server
