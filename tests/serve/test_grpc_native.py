"""The gRPC transports side by side: what a client sees beyond tritonclient's calls (methods the
service does not have, bytes that are no message, messages over the size bound, many clients at
once, a stop with calls in flight) is the same with grpcio's server and with the native one
(gRPC C++, serve/native). tests/serve/test_grpc.py runs its whole suite on both as well."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
grpc = pytest.importorskip("grpc")

from tensorkiln.serve import grpc as serve_grpc  # noqa: E402
from tensorkiln.serve import protocol  # noqa: E402
from tests.serve import test_grpc  # noqa: E402
from tests.serve.helpers import serving_with  # noqa: E402
from tests.serve.test_grpc import _input, native_or_skip, serving  # noqa: E402
from tests.serve.test_http import _direct  # noqa: E402
from tests.serve.test_repository import _model, digit_inputs  # noqa: E402

METHOD = "/inference.GRPCInferenceService/"
server = test_grpc.server  # (the gRPC suite's server, on each transport)


def _raw(url: str, method: str, body: bytes, **kw) -> bytes:
    with grpc.insecure_channel(url, **kw) as channel:
        return channel.unary_unary(METHOD + method)(body, timeout=30)


def test_methods_not_served_are_unimplemented(server):
    url, _ = server
    for method in ("Trace", "NoSuchMethod"):
        with pytest.raises(grpc.RpcError) as info:
            _raw(url, method, b"")
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(url) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/other.Service/ModelInfer")(b"", timeout=30)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_bytes_that_are_no_message_are_refused_and_the_server_goes_on(server):
    url, _ = server
    rng = np.random.default_rng()
    for _ in range(5):
        junk = b"\xff" + rng.integers(0, 256, int(rng.integers(1, 300)), dtype=np.uint8).tobytes()
        with pytest.raises(grpc.RpcError) as info:
            _raw(url, "ModelInfer", junk)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid ModelInferRequest" in info.value.details()
    # a well-formed request naming no input: the service's own message
    body = protocol.message("inference.ModelInferRequest")(model_name="digits").SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        _raw(url, "ModelInfer", body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no inputs" in info.value.details()
    reply = protocol.message("inference.ServerLiveResponse").FromString(
        _raw(url, "ServerLive", b"")
    )
    assert reply.live


def test_a_message_over_the_bound_is_refused(server):
    url, _ = server
    req = protocol.message("inference.ModelInferRequest")(model_name="digits")
    req.inputs.add(name="input", datatype="FP32", shape=[1, 1, 8, 8])
    req.raw_input_contents.append(b"\0" * (serve_grpc.MAX_MESSAGE + 1))
    options = [("grpc.max_send_message_length", serve_grpc.MAX_MESSAGE + 4096)]
    with pytest.raises(grpc.RpcError) as info:
        _raw(url, "ModelInfer", req.SerializeToString(), options=options)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_concurrent_clients_each_get_their_own_answer(server):
    url, _ = server
    rng = np.random.default_rng()
    xs = [rng.standard_normal((int(rng.integers(1, 5)), 1, 8, 8)).astype(np.float32)
          for _ in range(48)]  # fmt: skip

    def one(x: np.ndarray) -> np.ndarray:
        client = grpcclient.InferenceServerClient(url)
        return client.infer("digits", [_input(x)]).as_numpy("logits")

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, xs))
    for x, y in zip(xs, got, strict=True):
        np.testing.assert_allclose(y, _direct(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", serve_grpc.TRANSPORTS)
def test_a_stop_answers_the_calls_in_flight(transport, tmp_path):
    if transport == "native":
        native_or_skip()
    _model(tmp_path)
    x = np.random.default_rng().standard_normal((2, 1, 8, 8)).astype(np.float32)
    results: list = []
    with serving(tmp_path, transport) as (url, _):
        client = grpcclient.InferenceServerClient(url)
        client.infer("digits", [_input(x)])  # (warm)

        def call() -> None:
            try:
                results.append(client.infer("digits", [_input(x)]).as_numpy("logits"))
            except Exception as exc:  # (a refusal is an answer too)
                results.append(exc)

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 8  # every call answered: a result, or an error status
    for r in results:
        if isinstance(r, np.ndarray):
            np.testing.assert_allclose(r, _direct(x), rtol=1e-5, atol=1e-5)


def test_the_unknown_transport_is_named(tmp_path):
    import asyncio

    from tensorkiln.serve.core import ServerCore

    async def go():
        await serve_grpc.start(ServerCore(tmp_path), "127.0.0.1:0", transport="quic")

    with pytest.raises(serve_grpc.ServeError, match="unknown gRPC transport 'quic'"):
        asyncio.run(go())


def test_a_malformed_message_in_a_stream_is_an_error_response_and_the_stream_goes_on(server):
    url, _ = server
    x = np.random.default_rng().standard_normal((2, 1, 8, 8)).astype(np.float32)
    good = protocol.message("inference.ModelInferRequest")(model_name="digits", id="ok")
    good.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    good.raw_input_contents.append(x.tobytes())
    Reply = protocol.message("inference.ModelStreamInferResponse")
    with grpc.insecure_channel(url) as channel:
        stream = channel.stream_stream(METHOD + "ModelStreamInfer")
        replies = [
            Reply.FromString(r)
            for r in stream(iter([b"\xff\xff\x07", good.SerializeToString()]), timeout=30)
        ]
    assert len(replies) == 2
    assert "not a valid ModelInferRequest" in replies[0].error_message
    assert replies[1].error_message == "" and replies[1].infer_response.id == "ok"
    y = np.frombuffer(replies[1].infer_response.raw_output_contents[0], np.float32)
    np.testing.assert_allclose(y.reshape(2, -1), _direct(x), rtol=1e-5, atol=1e-5)


def test_requests_received_into_the_cores_buffers(tmp_path):
    """An inference request's bytes go where the core's receive_buffer says (on a GPU, the
    pinned pool's numpy arrays; here plain numpy arrays as stand-ins): answers stay right,
    streamed ones too, and bytes that are no message are still refused."""
    native_or_skip()
    _model(tmp_path)
    given: list[int] = []

    def receive(size: int) -> np.ndarray:
        given.append(size)
        return np.empty(size, np.uint8)

    async def start(core, port):
        core.receive_buffer = receive
        await core.load_all()
        server = await serve_grpc.start(core, f"127.0.0.1:{port}", transport="native")
        return lambda: server.stop(5)

    rng = np.random.default_rng()
    with serving_with(tmp_path, start) as (url, _):
        client = grpcclient.InferenceServerClient(url)
        for n in (1, 16):
            x = rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
            got = client.infer("digits", [_input(x)]).as_numpy("logits")
            np.testing.assert_allclose(got, _direct(x), rtol=1e-5, atol=1e-5)
        results: list = []
        done = threading.Event()

        def callback(result, error):
            results.append((result, error))
            if len(results) == 3:
                done.set()

        xs = [rng.standard_normal((2, 1, 8, 8)).astype(np.float32) for _ in range(3)]
        client.start_stream(callback)
        for x in xs:
            client.async_stream_infer("digits", [_input(x)])
        assert done.wait(30)
        client.stop_stream()
        for x, (result, error) in zip(xs, results):
            assert error is None
            np.testing.assert_allclose(result.as_numpy("logits"), _direct(x), rtol=1e-5, atol=1e-5)
        junk = b"\xff" + rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()
        with pytest.raises(grpc.RpcError) as info:
            _raw(url, "ModelInfer", junk)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.is_server_live()
    assert len(given) == 6 and len(junk) in given  # (every inference request, and only those)


def test_several_transport_threads_answer_many_clients_and_the_count_is_bounded(tmp_path):
    import asyncio

    from tensorkiln.serve import native

    native_or_skip()
    _model(tmp_path)

    async def start(core, port):
        await core.load_all()
        service = serve_grpc.InferenceService(core, serve_grpc.MAX_MESSAGE)
        server = native.NativeServer(
            serve_grpc.native_answer(service), asyncio.get_running_loop(), pumps=3
        )
        server.start(f"127.0.0.1:{port}", serve_grpc.MAX_MESSAGE)
        return lambda: server.stop(5)

    rng = np.random.default_rng()
    xs = [
        rng.standard_normal((int(rng.integers(1, 5)), 1, 8, 8)).astype(np.float32)
        for _ in range(48)
    ]
    with serving_with(tmp_path, start) as (url, _):
        client = grpcclient.InferenceServerClient(url)

        def call(x):
            return client.infer("digits", [_input(x)]).as_numpy("logits")

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            for x, got in zip(xs, pool.map(call, xs)):
                np.testing.assert_allclose(got, _direct(x), rtol=1e-5, atol=1e-5)

    async def refused(pumps):
        server = native.NativeServer(lambda *a: None, asyncio.get_running_loop(), pumps=pumps)
        server.start("127.0.0.1:0", 1 << 20)

    for pumps in (0, 65):
        with pytest.raises(protocol.ServeError, match=f"takes 1 to 64 threads, not {pumps}"):
            asyncio.run(refused(pumps))


def test_streams_and_unary_calls_at_once_each_get_their_answers_in_order(server):
    # (many requests in flight at once: answers are handed to the transport's thread to send,
    # on streams as on unary calls)
    import queue

    url, _ = server
    rng = np.random.default_rng()
    streams = [digit_inputs(6) for _ in range(4)]
    unary = [rng.standard_normal((2, 1, 8, 8)).astype(np.float32) for _ in range(24)]

    def stream(xs):
        client = grpcclient.InferenceServerClient(url)
        replies: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: replies.put((result, error)))
        try:
            for i, x in enumerate(xs):
                client.async_stream_infer("digits", [_input(x)], request_id=str(i))
            return [replies.get(timeout=60) for _ in xs]
        finally:
            client.stop_stream()

    def call(x):
        return grpcclient.InferenceServerClient(url).infer("digits", [_input(x)]).as_numpy("logits")

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        streamed = [pool.submit(stream, xs) for xs in streams]
        answered = list(pool.map(call, unary))
        for xs, future in zip(streams, streamed):
            got = future.result(timeout=120)
            assert [r.get_response().id for r, _ in got] == [str(i) for i in range(len(xs))]
            for (result, error), x in zip(got, xs):
                assert error is None
                np.testing.assert_allclose(
                    result.as_numpy("logits"), _direct(x), rtol=1e-5, atol=1e-5
                )
    for x, y in zip(unary, answered):
        np.testing.assert_allclose(y, _direct(x), rtol=1e-5, atol=1e-5)
