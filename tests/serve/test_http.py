"""The HTTP/REST front end, driven by Triton's own client (tritonclient.http) as users drive
Triton: health, metadata, config, inference with binary and JSON tensors, the repository API;
results checked against the engine run directly; malformed requests answered 4xx."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
pytest.importorskip("aiohttp")

from aiohttp import web  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tensorkiln.builder import Builder  # noqa: E402
from tensorkiln.serve.core import ServerCore  # noqa: E402
from tensorkiln.serve.http import HEADER_LENGTH as HEADER  # noqa: E402
from tensorkiln.serve.http import make_app  # noqa: E402
from tests.serve.helpers import serving_with  # noqa: E402
from tests.serve.test_repository import DIGITS, _model, digit_inputs  # noqa: E402


def serving(repo: Path, **core_kw):
    """The HTTP application on a free port in a thread of its own (models loaded at start)."""

    async def start(core: ServerCore, port: int):
        runner = web.AppRunner(make_app(core))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner.cleanup

    return serving_with(repo, start, **core_kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    _model(root)  # dynamic batching, 2 instances
    _model(root, name="plain", config="max_batch_size: 8")  # no batcher
    _model(root, name="broken", config="max_batch_size: -2")
    slow = "max_batch_size: 16 dynamic_batching { max_queue_delay_microseconds: 100000 }"
    _model(root, name="gathered", config=slow)  # (a queue delay long enough to gather)
    with serving(root) as (url, core):
        yield url, core


def _direct(x: np.ndarray) -> np.ndarray:
    ctx = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
    return ctx.infer({"input": x})["logits"]


@pytest.mark.parametrize("model", ["digits", "plain"])
@pytest.mark.parametrize("binary", [True, False])
def test_infer_through_tritonclient_matches_the_engine(server, model, binary):
    url, _ = server
    client = httpclient.InferenceServerClient(url)
    x = np.random.default_rng().standard_normal((3, 1, 8, 8)).astype(np.float32)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("logits", binary_data=binary)
    result = client.infer(model, [inp], outputs=[out], request_id="r1")
    np.testing.assert_allclose(result.as_numpy("logits"), _direct(x), rtol=1e-5, atol=1e-5)
    assert result.get_response()["id"] == "r1"


def test_health_metadata_config_and_repository(server):
    url, _ = server
    client = httpclient.InferenceServerClient(url)
    assert client.is_server_live()
    assert not client.is_server_ready()  # ('broken' failed to load, as Triton reports it)
    assert client.is_model_ready("digits") and not client.is_model_ready("broken")
    meta = client.get_model_metadata("digits")
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    config = client.get_model_config("digits")
    assert config["max_batch_size"] == 16 and config["dynamic_batching"][
        "preferred_batch_size"
    ] == [4, 8]
    assert client.get_server_metadata()["name"] == "tensorkiln"
    index = {(m["name"], m.get("state")) for m in client.get_model_repository_index()}
    assert ("digits", "READY") in index and ("broken", "UNAVAILABLE") in index
    client.unload_model("plain")
    assert not client.is_model_ready("plain")
    client.load_model("plain")
    assert client.is_model_ready("plain")
    with pytest.raises(InferenceServerException, match="max_batch_size is -2"):
        client.load_model("broken")


def test_concurrent_clients_are_batched_and_each_gets_its_own_rows(server):
    url, core = server
    xs = digit_inputs(24)
    client = httpclient.InferenceServerClient(url, concurrency=24)
    pending = []
    for x in xs:
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        pending.append(client.async_infer("gathered", [inp]))
    for x, p in zip(xs, pending):
        got = p.get_result().as_numpy("logits")
        np.testing.assert_allclose(got, _direct(x), rtol=1e-5, atol=1e-5)
    batcher = core.batcher("gathered", 1)
    assert batcher is not None and sum(batcher.stats.requests) == 24
    assert max(batcher.stats.requests) > 1, batcher.stats.requests
    # the metrics count what the batcher ran
    if core.metrics is not None:
        from tests.serve.helpers import samples as labels_of

        key = (("model", "gathered"), ("version", "1"))
        assert labels_of(core.metrics, "nv_inference_request_success")[key] == 24
        assert labels_of(core.metrics, "nv_inference_exec_count")[key] == len(batcher.stats.sizes)
        assert labels_of(core.metrics, "nv_inference_count")[key] == sum(x.shape[0] for x in xs)
        assert labels_of(core.metrics, "tensorkiln_batch_size_count")[key] == len(
            batcher.stats.sizes
        )


def _post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    import urllib.request

    req = urllib.request.Request(
        f"http://{url}{path}", data=body, headers=headers or {}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _tensor(**kw) -> dict:
    t = {"name": "input", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}
    t.update(kw)
    return t


@pytest.mark.parametrize(
    "body,headers,status,message",
    [
        (b"{not json", {}, 400, "malformed"),
        (b"[]", {}, 400, "JSON object"),
        (json.dumps({"inputs": []}).encode(), {}, 400, "no 'inputs'"),
        (json.dumps({"inputs": [_tensor(name="image")]}).encode(), {}, 400, "has no input 'image'"),
        (json.dumps({"inputs": [_tensor(datatype="FP64")]}).encode(), {}, 400, "is FP32, the request gives FP64"),
        (json.dumps({"inputs": [_tensor(datatype="STRINGY")]}).encode(), {}, 400, "not one served here"),
        (json.dumps({"inputs": [_tensor(shape=[1, 1, 8, 9])]}).encode(), {}, 400, "64 values for shape"),
        (json.dumps({"inputs": [_tensor(shape=[-1, 8])]}).encode(), {}, 400, "must be a list"),
        (json.dumps({"inputs": [_tensor(shape=[10**9, 10**9])]}).encode(), {}, 400, "bytes a request may have"),
        (json.dumps({"inputs": [_tensor(data=["a"] * 64)]}).encode(), {}, 400, "not all FP32 values"),
        (json.dumps({"inputs": [_tensor(shape=[17, 1, 8, 8], data=[0.0] * 17 * 64)]}).encode(), {}, 400, "batch of 17"),
        (json.dumps({"inputs": [_tensor(data=None, parameters={"binary_data_size": 256})]}).encode(), {HEADER: "0"}, 400, "JSON is malformed"),
        (json.dumps({"inputs": [_tensor(data=None, parameters={"binary_data_size": 100})]}).encode(), {}, 400, "takes 256"),
        (json.dumps({"inputs": [_tensor(data=None, parameters={"binary_data_size": 256})]}).encode(), {}, 400, "ends after 0 of its 256"),
        (json.dumps({"inputs": [_tensor()], "outputs": [{"name": "probs"}]}).encode(), {}, 400, "no output 'probs'"),
        (json.dumps({"inputs": [_tensor()]}).encode(), {HEADER: "99999"}, 400, "byte count"),
        (json.dumps({"inputs": [_tensor(), _tensor()]}).encode(), {}, 400, "given twice"),
    ],
)  # fmt: skip
def test_malformed_requests_get_a_4xx_naming_the_problem(server, body, headers, status, message):
    url, _ = server
    code, reply = _post(url, "/v2/models/digits/infer", body, headers)
    assert code == status and message in reply.get("error", ""), (code, reply)


def test_unknown_models_and_versions_and_oversized_bodies(server):
    url, _ = server
    body = json.dumps({"inputs": [_tensor()]}).encode()
    code, reply = _post(url, "/v2/models/nothing/infer", body)
    assert code == 404 and "unknown model 'nothing'" in reply["error"]
    code, reply = _post(url, "/v2/models/digits/versions/7/infer", body)
    assert code == 404 and "no version 7" in reply["error"]
    code, reply = _post(url, "/v2/models/broken/infer", body)
    assert code == 503 and "not ready" in reply["error"]
    code, _ = _post(url, "/v2/models/digits/infer", b"x" * (65 << 20))
    assert code == 413
    # and the server still serves
    code, reply = _post(url, "/v2/models/digits/infer", body)
    assert code == 200 and reply["outputs"][0]["shape"] == [1, 10]


def test_an_input_is_bounded_by_the_servers_body_limit(tmp_path):
    _model(tmp_path)

    async def start(core: ServerCore, port: int):
        runner = web.AppRunner(make_app(core, max_body=4096))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner.cleanup

    with serving_with(tmp_path, start) as (url, _):
        # a small body declaring an input of 17 x 256 bytes, over the 4,096 accepted
        body = json.dumps({"inputs": [_tensor(shape=[17, 1, 8, 8], data=[0.5])]}).encode()
        code, reply = _post(url, "/v2/models/digits/infer", body)
        assert code == 400 and "more than the 4,096 bytes" in reply["error"], reply
        x = np.random.default_rng().standard_normal((1, 1, 8, 8)).astype(np.float32)
        body = json.dumps({"inputs": [_tensor(data=x.reshape(-1).tolist())]}).encode()
        code, reply = _post(url, "/v2/models/digits/infer", body)
        assert code == 200 and len(reply["outputs"][0]["data"]) == 10, reply
