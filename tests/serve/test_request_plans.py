"""What makes a concurrency-1 request cheaper on the server, checked against the reference
backend's own results: request plans (the gRPC service works out once what a request's bytes
other than its tensors say), the tensors kept per CUDA region, and busy polling in the native
transport."""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("grpc")

from tensorkiln.serve import grpc as serve_grpc  # noqa: E402
from tensorkiln.serve import protocol  # noqa: E402
from tensorkiln.serve.protocol import ServeError  # noqa: E402
from tensorkiln.serve.shm import SharedMemory, _CudaRegion  # noqa: E402
from tests.serve.helpers import serving_with  # noqa: E402
from tests.serve.test_grpc import _input, native_or_skip  # noqa: E402
from tests.serve.test_http import _direct  # noqa: E402
from tests.serve.test_repository import _model  # noqa: E402


def _call(service, request) -> object:
    """``request`` (a ModelInferRequest) through the service as either transport hands it
    over: parsed from its bytes."""
    call = serve_grpc.parse("ModelInfer", request.SerializeToString())
    answer = service.loop.run_until_complete(service.ModelInfer(call, None))
    return protocol.message("inference.ModelInferResponse").FromString(answer)


def _request(x: np.ndarray, **kw):
    req = protocol.message("inference.ModelInferRequest")(model_name="digits", **kw)
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


@pytest.fixture
def service(tmp_path):
    from tensorkiln.serve.core import ServerCore

    _model(tmp_path)
    core = ServerCore(tmp_path, shared_memory=True)

    loop = asyncio.new_event_loop()  # (the batchers' loop: every call runs on it)
    loop.run_until_complete(core.load_all())
    service = serve_grpc.InferenceService(core)
    service.loop = loop
    yield service
    loop.run_until_complete(core.close())
    loop.close()


def test_requests_alike_but_for_their_tensors_share_one_plan(service):
    rng = np.random.default_rng()
    for _ in range(6):
        x = rng.standard_normal((2, 1, 8, 8)).astype(np.float32)
        reply = _call(service, _request(x, id="same"))
        y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(2, -1)
        np.testing.assert_allclose(y, _direct(x), rtol=1e-5, atol=1e-5)
        assert reply.id == "same"
        assert len(service._plans) == 1  # (the first request made it; the others took it)
    # another shape, another id: plans of their own, each answer still its request's
    x = rng.standard_normal((3, 1, 8, 8)).astype(np.float32)
    reply = _call(service, _request(x, id="other"))
    assert reply.id == "other" and len(service._plans) == 2
    y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(3, -1)
    np.testing.assert_allclose(y, _direct(x), rtol=1e-5, atol=1e-5)


def test_a_planned_request_is_still_checked(service):
    x = np.random.default_rng().standard_normal((2, 1, 8, 8)).astype(np.float32)
    _call(service, _request(x))
    assert len(service._plans) == 1
    short = _request(x)
    short.raw_input_contents[0] = x.tobytes()[:-4]
    with pytest.raises(ServeError, match=r"input 'input': 508 bytes of raw contents; shape"):
        _call(service, short)
    extra = _request(x)
    extra.raw_input_contents.append(b"\0" * 16)
    with pytest.raises(ServeError, match="1 inputs outside shared memory and 2 raw contents"):
        _call(service, extra)
    none = _request(x)
    del none.raw_input_contents[:]
    with pytest.raises(ServeError):  # (no tensor at all: typed contents are empty)
        _call(service, none)


def test_typed_contents_are_not_planned(service):
    x = np.random.default_rng().standard_normal((1, 1, 8, 8)).astype(np.float32)
    req = protocol.message("inference.ModelInferRequest")(model_name="digits")
    t = req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    t.contents.fp32_contents.extend(x.reshape(-1).tolist())
    reply = _call(service, req)
    y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(1, -1)
    np.testing.assert_allclose(y, _direct(x), rtol=1e-5, atol=1e-5)
    assert not service._plans


@pytest.fixture
def region():
    """A POSIX shared-memory object of 1 MiB (the client's side), removed after."""
    key = f"/tk_plan_{uuid.uuid4().hex[:12]}"
    path = "/dev/shm" + key
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    with open(path, "r+b") as f:
        memory = mmap.mmap(f.fileno(), 1 << 20)
    try:
        yield key, memory
    finally:
        memory.close()
        os.unlink(path)


def test_plans_read_system_regions_afresh_and_go_when_regions_do(service, region):
    key, memory = region
    shm = service.core.shm
    shm.register("in", key, 0, 1 << 20)
    rng = np.random.default_rng()

    def request(x):
        req = protocol.message("inference.ModelInferRequest")(model_name="digits")
        t = req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
        t.parameters["shared_memory_region"].string_param = "in"
        t.parameters["shared_memory_byte_size"].int64_param = x.nbytes
        t.parameters["shared_memory_offset"].int64_param = 4096
        return req

    for _ in range(3):  # the same request bytes; the region's contents change between them
        x = rng.standard_normal((2, 1, 8, 8)).astype(np.float32)
        memory[4096 : 4096 + x.nbytes] = x.tobytes()
        reply = _call(service, request(x))
        y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(2, -1)
        np.testing.assert_allclose(y, _direct(x), rtol=1e-5, atol=1e-5)
    assert len(service._plans) == 1
    shm.unregister("in")
    assert not service._plans  # (dropped with the region: a plan may hold its memory)
    with pytest.raises(ServeError, match="no shared-memory region 'in' is registered"):
        _call(service, request(x))
    shm.register("in", key, 0, 1 << 20)  # registered again: read again, right
    memory[4096 : 4096 + x.nbytes] = x.tobytes()
    reply = _call(service, request(x))
    y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(2, -1)
    np.testing.assert_allclose(y, _direct(x), rtol=1e-5, atol=1e-5)


def test_shared_memory_counts_its_changes_and_calls_its_hooks(region):
    key, _ = region
    shm = SharedMemory(enabled=True)
    seen: list[int] = []
    shm.on_change.append(lambda: seen.append(shm.generation))
    shm.register("a", key, 0, 1024)
    shm.unregister("nothing-here")  # (no region dropped: no change)
    shm.unregister("a")
    assert seen == [1, 2] and shm.generation == 2


def test_cuda_regions_keep_their_views():
    torch = pytest.importorskip("torch")
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    region = _CudaRegion("r", 0, 4096, data)
    a = region.view(256, np.dtype(np.float32), (2, 8), "input 'x'")
    assert region.view(256, np.dtype(np.float32), (2, 8), "input 'x'") is a
    expect = np.frombuffer(data.numpy().tobytes()[256 : 256 + 64], np.float32).reshape(2, 8)
    np.testing.assert_array_equal(a.numpy(), expect)
    data[256:260] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # (a view sees the memory)
    np.testing.assert_array_equal(a.numpy().view(np.uint8)[0, :4], [1, 2, 3, 4])
    span = region.span(1024, 100)
    assert region.span(1024, 100) is span and span.shape == (100,)
    assert span.data_ptr() == data.data_ptr() + 1024
    for i in range(200):  # bounded: many places named do not grow it without end
        region.span(4 * i, 4)
    assert len(region._views) <= 64


def test_busy_polling_answers_right_and_stops_when_idle(tmp_path):
    native_or_skip()
    _model(tmp_path)
    held: dict = {}

    async def start(core, port):
        await core.load_all()
        server = await serve_grpc.start(
            core,
            f"127.0.0.1:{port}",
            transport="native",
            busy_poll_us=300_000,  # (0.3 s: a busy host)
        )
        held["server"] = server
        return lambda: server.stop(5)

    rng = np.random.default_rng()
    with serving_with(tmp_path, start) as (url, _):
        client = grpcclient.InferenceServerClient(url)
        for n in (1, 3, 16, 2):
            x = rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
            got = client.infer("digits", [_input(x)]).as_numpy("logits")
            np.testing.assert_allclose(got, _direct(x), rtol=1e-5, atol=1e-5)
        server = held["server"]
        assert server._spinning  # (polling: a request was answered a moment ago)
        deadline = time.monotonic() + 10
        while server._spinning and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server._spinning  # (idle: asleep again, woken by the eventfd)
        x = rng.standard_normal((4, 1, 8, 8)).astype(np.float32)
        got = client.infer("digits", [_input(x)]).as_numpy("logits")
        np.testing.assert_allclose(got, _direct(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--grpc-busy-poll-us", "-5"], "--grpc-busy-poll-us -5 must be 0 to 1000000"),
        (["--grpc-busy-poll-us", "100"], "--grpc-busy-poll-us needs --grpc-transport native"),
    ],
)
def test_the_busy_polling_flag_is_checked(tmp_path, flags, message):
    _model(tmp_path / "repo")
    run = subprocess.run(
        [sys.executable, "-m", "tensorkiln", "serve", "--model-repository", str(tmp_path / "repo"),
         *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0 and message in run.stderr
