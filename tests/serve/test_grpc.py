"""KServe v2 over gRPC, driven by tritonclient.grpc: health, metadata, config, inference (unary
and streaming), the repository API; results checked against the engine run directly; malformed
requests answered with INVALID_ARGUMENT naming the problem."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("grpc")

from tritonclient.utils import InferenceServerException  # noqa: E402

from tensorkiln.serve import grpc as serve_grpc  # noqa: E402
from tensorkiln.serve import protocol  # noqa: E402
from tensorkiln.serve.core import ServerCore  # noqa: E402
from tests.serve.helpers import serving_with  # noqa: E402
from tests.serve.test_http import _direct  # noqa: E402
from tests.serve.test_repository import _model  # noqa: E402


def serving(repo: Path, transport: str = "grpcio", **core_kw):
    """The gRPC service on a free port in a thread of its own (models loaded at start)."""

    async def start(core: ServerCore, port: int):
        await core.load_all()
        server = await serve_grpc.start(core, f"127.0.0.1:{port}", transport=transport)
        return lambda: server.stop(5)

    return serving_with(repo, start, **core_kw)


def native_or_skip() -> None:
    """Skips where the native transport cannot be built (no gRPC C++ or compiler here)."""
    from tensorkiln.serve import native

    try:
        native.library()
    except native.NativeUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module", params=serve_grpc.TRANSPORTS)
def server(request, tmp_path_factory):
    if request.param == "native":
        native_or_skip()
    root = tmp_path_factory.mktemp("repo")
    _model(root)
    _model(root, name="broken", config="max_batch_size: -2")
    with serving(root, request.param) as s:
        yield s


def _input(x: np.ndarray, name: str = "input") -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def test_infer_health_and_metadata_through_tritonclient(server):
    url, _ = server
    client = grpcclient.InferenceServerClient(url)
    assert client.is_server_live() and not client.is_server_ready()  # ('broken')
    assert client.is_model_ready("digits") and not client.is_model_ready("broken")
    x = np.random.default_rng().standard_normal((3, 1, 8, 8)).astype(np.float32)
    result = client.infer("digits", [_input(x)], request_id="g1")
    np.testing.assert_allclose(result.as_numpy("logits"), _direct(x), rtol=1e-5, atol=1e-5)
    assert result.get_response().id == "g1"
    meta = client.get_model_metadata("digits", as_json=True)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "1", "8", "8"]}]
    config = client.get_model_config("digits", as_json=True)["config"]
    assert config["max_batch_size"] == 16
    assert client.get_server_metadata(as_json=True)["name"] == "tensorkiln"
    index = {
        (m["name"], m.get("state"))
        for m in client.get_model_repository_index(as_json=True)["models"]
    }
    assert ("digits", "READY") in index and ("broken", "UNAVAILABLE") in index
    with pytest.raises(InferenceServerException, match="max_batch_size is -2"):
        client.load_model("broken")


def test_streaming_answers_each_request_in_order(server):
    url, _ = server
    client = grpcclient.InferenceServerClient(url)
    replies: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    rng = np.random.default_rng()
    xs = [rng.standard_normal((2, 1, 8, 8)).astype(np.float32) for _ in range(4)]
    try:
        for i, x in enumerate(xs):
            client.async_stream_infer("digits", [_input(x)], request_id=str(i))
        client.async_stream_infer("digits", [_input(xs[0], "image")], request_id="bad")
        got = [replies.get(timeout=30) for _ in range(5)]
    finally:
        client.stop_stream()
    for (result, error), x in zip(got[:4], xs):
        assert error is None
        np.testing.assert_allclose(result.as_numpy("logits"), _direct(x), rtol=1e-5, atol=1e-5)
    assert got[4][0] is None and "has no input 'image'" in str(got[4][1])


def test_malformed_requests_are_invalid_arguments_naming_the_problem(server):
    url, _ = server
    client = grpcclient.InferenceServerClient(url)
    x = np.zeros((2, 1, 8, 8), np.float32)
    cases = [
        (dict(inputs=[_input(x, "image")]), "has no input 'image'"),
        (dict(inputs=[_input(np.zeros((2, 1, 8, 9), np.float32))]), "has shape [2, 1, 8, 9]"),
        (dict(inputs=[_input(np.zeros((17, 1, 8, 8), np.float32))]), "batch of 17"),
        (dict(inputs=[_input(x)], outputs=[grpcclient.InferRequestedOutput("probs")]), "no output 'probs'"),
    ]  # fmt: skip
    for kw, message in cases:
        with pytest.raises(
            InferenceServerException, match=message.replace("[", r"\[").replace("]", r"\]")
        ):
            client.infer("digits", **kw)
    with pytest.raises(InferenceServerException, match="unknown model 'nothing'"):
        client.infer("nothing", [_input(x)])


def test_raw_contents_that_disagree_with_their_shape_are_refused():
    Request = protocol.message("inference.ModelInferRequest")
    req = Request(model_name="digits")
    req.inputs.add(name="input", datatype="FP32", shape=[2, 1, 8, 8])
    req.raw_input_contents.append(b"\x00" * 100)
    with pytest.raises(serve_grpc.ServeError, match=r"100 bytes of raw contents.*takes 512"):
        serve_grpc._feeds(req)
    req = Request(model_name="digits")
    t = req.inputs.add(name="input", datatype="INT8", shape=[2])
    t.contents.int_contents.extend([1, 300])
    with pytest.raises(serve_grpc.ServeError, match="outside INT8's range"):
        serve_grpc._feeds(req)
    req = Request(model_name="digits")
    req.inputs.add(name="input", datatype="FP32", shape=[2**40, 2**40])
    with pytest.raises(serve_grpc.ServeError, match="bytes a request may have"):
        serve_grpc._feeds(req)
    t = Request(model_name="d").inputs.add(name="a", datatype="INT32", shape=[3])
    t.contents.int_contents.extend([1, -2, 3])
    req = Request(model_name="d")
    req.inputs.append(t)
    np.testing.assert_array_equal(serve_grpc._feeds(req)["a"], np.array([1, -2, 3], np.int32))
