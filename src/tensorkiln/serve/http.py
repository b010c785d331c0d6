"""KServe v2 over HTTP/REST, with Triton's binary tensor data, model configuration and model
repository extensions, on aiohttp's server.

A request body is bounded (``max_body``, Triton's --http-max-input-size) before it is read. Its
JSON is parsed and checked field by field. Every tensor's size is checked against its shape and
data type before an array is made. Anything malformed is answered 400 with ``{"error": ...}``
naming the problem, and never reaches an engine.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import numpy as np
from aiohttp import web
from google.protobuf import json_format

from tensorkiln.serve import cuda_shm, protocol
from tensorkiln.serve.core import ServerCore, log
from tensorkiln.serve.protocol import ServeError
from tensorkiln.serve.shm import OFF as shm_off
from tensorkiln.serve.shm import SharedMemory, output_target

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_BODY = 64 << 20  # bytes (Triton's --http-max-input-size default)
CORE = web.AppKey("core", ServerCore)
BODY_LIMIT = web.AppKey("body_limit", int)


def make_app(core: ServerCore, *, max_body: int = MAX_BODY, load: bool = True) -> web.Application:
    """The HTTP application over ``core``; with ``load``, every repository model is loaded at
    start."""
    app = web.Application(client_max_size=max_body, middlewares=[_errors])
    app[CORE] = core
    app[BODY_LIMIT] = max_body
    r = app.router
    r.add_get("/v2/health/live", _live)
    r.add_get("/v2/health/ready", _ready)
    r.add_get("/v2", _server_metadata)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(prefix, _model_metadata)
        r.add_get(prefix + "/ready", _model_ready)
        r.add_get(prefix + "/config", _model_config)
        r.add_post(prefix + "/infer", _infer)
        r.add_get(prefix + "/stats", _stats)
    r.add_get("/v2/models/stats", _stats)
    r.add_post("/v2/repository/index", _index)
    r.add_post("/v2/repository/models/{model}/load", _load)
    r.add_post("/v2/repository/models/{model}/unload", _unload)
    for prefix in ("/v2/systemsharedmemory", "/v2/systemsharedmemory/region/{region}"):
        r.add_get(prefix + "/status", _shm_status)
        r.add_post(prefix + "/status", _shm_status)
        r.add_post(prefix + "/unregister", _shm_unregister)
    r.add_post("/v2/systemsharedmemory/region/{region}/register", _shm_register)
    for prefix in ("/v2/cudasharedmemory", "/v2/cudasharedmemory/region/{region}"):
        r.add_get(prefix + "/status", _cuda_shm_status)
        r.add_post(prefix + "/status", _cuda_shm_status)
        r.add_post(prefix + "/unregister", _cuda_shm_unregister)
    r.add_post("/v2/cudasharedmemory/region/{region}/register", _cuda_shm_register)
    if load:
        app.on_startup.append(_load_all)
    app.on_shutdown.append(_drain)
    return app


def make_metrics_app(core: ServerCore) -> web.Application:
    """``GET /metrics``: the server's Prometheus metrics (Triton serves them on port 8002)."""
    if core.metrics is None:
        raise ServeError("metrics need prometheus-client: pip install 'tensorkiln[serve]'", 500)
    app = web.Application()
    app[CORE] = core
    app.router.add_get("/metrics", _metrics)
    return app


async def _metrics(request: web.Request) -> web.Response:
    body = _core(request).metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def _load_all(app: web.Application) -> None:
    await app[CORE].load_all()


async def _drain(app: web.Application) -> None:
    await app[CORE].close()


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ServeError as exc:
        return web.json_response({"error": str(exc)}, status=exc.status)
    except web.HTTPRequestEntityTooLarge as exc:
        return web.json_response({"error": f"request body too large: {exc.text}"}, status=413)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:  # (JSON, as every other error)
        return web.json_response(
            {"error": f"{exc.reason}: {request.method} {request.path[:200]}"}, status=exc.status
        )
    except web.HTTPException:
        raise
    except Exception as exc:  # a fault of ours: answered, logged, and the server goes on
        log.exception("internal error on %s", request.path)
        return web.json_response({"error": f"internal error: {type(exc).__name__}"}, status=500)


def _core(request: web.Request) -> ServerCore:
    return request.app[CORE]


# ---------------------------------------------------------------------- health and metadata
async def _live(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _ready(request: web.Request) -> web.Response:
    core = _core(request)
    return web.Response(status=200 if not core.failed else 400)


async def _server_metadata(request: web.Request) -> web.Response:
    return web.json_response(_core(request).metadata())


async def _model_metadata(request: web.Request) -> web.Response:
    model = _core(request).model(request.match_info["model"], request.match_info.get("version"))
    return web.json_response(model.metadata())


async def _model_ready(request: web.Request) -> web.Response:
    ready = _core(request).ready(request.match_info["model"], request.match_info.get("version"))
    return web.Response(status=200 if ready else 400)


async def _model_config(request: web.Request) -> web.Response:
    model = _core(request).model(request.match_info["model"], request.match_info.get("version"))
    return web.json_response(
        json_format.MessageToDict(model.config, preserving_proto_field_name=True)
    )


async def _stats(request: web.Request) -> web.Response:
    m = request.match_info
    stats = await _core(request).model_statistics(m.get("model", ""), m.get("version", ""))
    return web.json_response({"model_stats": stats})


# ---------------------------------------------------------------------- repository
async def _index(request: web.Request) -> web.Response:
    return web.json_response(_core(request).index())


async def _load(request: web.Request) -> web.Response:
    await _core(request).request_load(request.match_info["model"])
    return web.Response(status=200)


async def _unload(request: web.Request) -> web.Response:
    await _core(request).request_unload(request.match_info["model"])
    return web.Response(status=200)


# ---------------------------------------------------------------------- shared memory
async def _shm_status(request: web.Request) -> web.Response:
    return web.json_response(_core(request).shm.status(request.match_info.get("region")))


async def _json_body(request: web.Request) -> dict[str, Any]:
    """A shared-memory registration's body: a JSON object of at most 4,096 bytes."""
    if request.content_length is None or request.content_length > 4096:
        raise ServeError("a shared-memory registration is a JSON object of at most 4,096 bytes")
    body = await request.content.read(4097)
    if len(body) > 4096:  # (more than the header said)
        raise ServeError("a shared-memory registration is a JSON object of at most 4,096 bytes")
    header, _ = _split(body, None)
    if not isinstance(header, dict):
        raise ServeError("the registration must be a JSON object")
    return header


async def _shm_register(request: web.Request) -> web.Response:
    header = await _json_body(request)
    await _core(request).shm_register(
        request.match_info["region"], header.get("key"), header.get("offset", 0),
        header.get("byte_size"),
    )  # fmt: skip
    return web.Response(status=200)


async def _shm_unregister(request: web.Request) -> web.Response:
    await _core(request).shm_unregister(request.match_info.get("region"))
    return web.Response(status=200)


async def _cuda_shm_status(request: web.Request) -> web.Response:
    return web.json_response(_core(request).shm.cuda_status(request.match_info.get("region")))


async def _cuda_shm_register(request: web.Request) -> web.Response:
    """{"raw_handle": {"b64": the CUDA IPC handle in base64}, "device_id", "byte_size"}."""
    header = await _json_body(request)
    handle = header.get("raw_handle")
    b64 = handle.get("b64") if isinstance(handle, dict) else None
    try:
        raw = base64.b64decode(b64, validate=True) if isinstance(b64, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:
        raise ServeError('raw_handle must be {"b64": the CUDA IPC handle in base64}')
    _core(request).shm.register_cuda(
        request.match_info["region"], raw, header.get("device_id", 0), header.get("byte_size")
    )
    return web.Response(status=200)


async def _cuda_shm_unregister(request: web.Request) -> web.Response:
    _core(request).shm.unregister_cuda(request.match_info.get("region"))
    return web.Response(status=200)


# ---------------------------------------------------------------------- inference
async def _infer(request: web.Request) -> web.Response:
    limit = request.app[BODY_LIMIT]
    if request.content_length is not None and request.content_length > limit:
        # (refused from its header, before a byte of it is read)
        raise ServeError(
            f"request body of {request.content_length:,} bytes is over the {limit:,} accepted "
            "(--http-max-input-size)",
            413,
        )
    body = await request.read()
    header, binary = _split(body, request.headers.get(HEADER_LENGTH))
    core = _core(request)
    feeds, wanted, binary_default, rid = _parse_request(header, binary, limit, core.shm)
    name, version = request.match_info["model"], request.match_info.get("version")
    model, outputs = await core.infer(name, version, feeds, list(wanted))
    reply: dict[str, Any] = {"model_name": model.name, "model_version": str(model.version)}
    if rid is not None:
        reply["id"] = rid
    chunks, tensors = [], []
    for n, y in outputs.items():
        t: dict[str, Any] = {"name": n, "datatype": protocol.datatype_of(y.dtype),
                             "shape": list(y.shape)}  # fmt: skip
        target = wanted.get(n, binary_default)
        if isinstance(target, tuple):  # (into a shared-memory region)
            t["parameters"] = core.shm.output_to(target, n, y)
            tensors.append(t)
            continue
        y = cuda_shm.host(y)  # (a GPU engine's output, for a request in CUDA shared memory)
        if target:
            data = y.tobytes()
            t["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            t["data"] = y.reshape(-1).tolist()
        tensors.append(t)
    reply["outputs"] = tensors
    text = json.dumps(reply).encode()
    if not chunks:
        return web.Response(body=text, content_type="application/json")
    return web.Response(
        body=b"".join([text, *chunks]),
        headers={HEADER_LENGTH: str(len(text)), "Content-Type": "application/octet-stream"},
    )


def _split(body: bytes, length: str | None) -> tuple[Any, bytes]:
    """The request's JSON header (parsed) and its binary part."""
    if length is None:
        head, binary = body, b""
    else:
        if not length.isdigit() or int(length) > len(body):
            raise ServeError(
                f"{HEADER_LENGTH} is '{length[:40]}'; it must be the JSON header's byte count "
                f"(the body has {len(body)} bytes)"
            )
        head, binary = body[: int(length)], body[int(length) :]
    try:
        return json.loads(head, parse_constant=_not_json), binary
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ServeError(f"the request's JSON is malformed: {exc}") from None


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (send such values as binary tensor data)")


def _parse_request(header: Any, binary: bytes, limit: int,
                   shm: SharedMemory = shm_off) -> tuple[dict, dict, bool, Any]:  # fmt: skip
    """(feeds, requested outputs -> binary? or their (region, offset, bytes) in shared memory,
    the default for outputs, the request id); no input may declare more than ``limit`` bytes.
    ``shm``: the server's shared-memory regions, which inputs may name."""
    if not isinstance(header, dict):
        raise ServeError("the request must be a JSON object with 'inputs'")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ServeError("the request has no 'inputs' list")
    params = _params(header, "the request")
    binary_default = bool(params.get("binary_data_output", False))
    feeds: dict[str, np.ndarray] = {}
    offset = 0
    for i, t in enumerate(inputs):
        if not isinstance(t, dict):
            raise ServeError(f"input {i} is not an object")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise ServeError(f"input {i} has no name")
        if name in feeds:
            raise ServeError(f"input '{name}' is given twice")
        dtype, shape = protocol.declared(name, t.get("datatype"), t.get("shape"), limit)
        params = _params(t, f"input '{name}'")
        x = shm.input_from(params, name, dtype, shape)
        if x is not None:
            feeds[name] = x
            continue
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ServeError(f"input '{name}': binary_data_size must be a byte count")
            want = math.prod(shape) * dtype.itemsize
            if size != want:
                raise ServeError(
                    f"input '{name}': binary_data_size is {size} bytes; shape {list(shape)} of "
                    f"{t['datatype']} takes {want}"
                )
            if offset + size > len(binary):
                raise ServeError(
                    f"input '{name}': the binary data ends after {len(binary) - offset} of its "
                    f"{size} bytes"
                )
            feeds[name] = np.frombuffer(binary, dtype, math.prod(shape), offset).reshape(shape)
            offset += size
        else:
            if not isinstance(t.get("data"), list):
                raise ServeError(f"input '{name}' has neither 'data' nor binary_data_size")
            feeds[name] = protocol.from_values(name, t["data"], dtype, shape)
    if offset != len(binary):
        raise ServeError(
            f"the request has {len(binary) - offset} bytes of binary data no input uses"
        )
    wanted: dict[str, Any] = {}
    outputs = header.get("outputs", [])
    if not isinstance(outputs, list):
        raise ServeError("'outputs' must be a list")
    for i, o in enumerate(outputs):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise ServeError(f"output {i} has no name")
        params = _params(o, f"output '{o['name']}'")
        target = output_target(params)
        wanted[o["name"]] = (
            target if target is not None else bool(params.get("binary_data", binary_default))
        )
    rid = header.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ServeError("'id' must be a string")
    return feeds, wanted, binary_default, rid


def _params(obj: dict, what: str) -> dict:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise ServeError(f"{what}: 'parameters' must be an object")
    return params
