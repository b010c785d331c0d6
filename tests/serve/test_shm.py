"""Triton's system shared-memory extension, driven by tritonclient's own shared-memory helpers:
inputs read from and outputs written to regions the client registered, over HTTP and gRPC,
equal to the engine's results; the extension off by default; hostile keys and spans refused."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
shm = pytest.importorskip("tritonclient.utils.shared_memory")
if not os.path.isdir("/dev/shm"):
    pytest.skip("no /dev/shm", allow_module_level=True)

from tests.serve import test_grpc, test_http  # noqa: E402
from tests.serve.test_http import _direct  # noqa: E402
from tests.serve.test_repository import _model  # noqa: E402

IN_BYTES, OUT_BYTES = 3 * 64 * 4, 3 * 10 * 4  # digits: 3 rows of 1x8x8 in, 3 rows of 10 out


@pytest.fixture
def regions():
    """An input and an output shared-memory object, unique to the test; removed after."""
    tag = uuid.uuid4().hex[:8]
    made = {
        "in": shm.create_shared_memory_region(f"in_{tag}", f"/tk_in_{tag}", IN_BYTES),
        "out": shm.create_shared_memory_region(f"out_{tag}", f"/tk_out_{tag}", OUT_BYTES),
    }
    yield tag, made
    for h in made.values():
        shm.destroy_shared_memory_region(h)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_through_shared_memory(tmp_path, regions, protocol):
    _model(tmp_path)
    tag, made = regions
    x = np.random.default_rng().standard_normal((3, 1, 8, 8)).astype(np.float32)
    shm.set_shared_memory_region(made["in"], [x])
    module, serving = (
        (httpclient, test_http.serving) if protocol == "http" else (grpcclient, test_grpc.serving)
    )
    with serving(tmp_path, shared_memory=True) as (url, _):
        client = module.InferenceServerClient(url)
        client.register_system_shared_memory(f"in_{tag}", f"/tk_in_{tag}", IN_BYTES)
        client.register_system_shared_memory(f"out_{tag}", f"/tk_out_{tag}", OUT_BYTES)
        status = client.get_system_shared_memory_status(
            **({"as_json": True} if protocol == "grpc" else {})
        )
        names = [r["name"] for r in status] if protocol == "http" else list(status["regions"])
        assert sorted(names) == sorted([f"in_{tag}", f"out_{tag}"])
        inp = module.InferInput("input", [3, 1, 8, 8], "FP32")
        inp.set_shared_memory(f"in_{tag}", IN_BYTES)
        out = module.InferRequestedOutput("logits")
        out.set_shared_memory(f"out_{tag}", OUT_BYTES)
        client.infer("digits", [inp], outputs=[out])
        got = shm.get_contents_as_numpy(made["out"], np.float32, [3, 10])
        np.testing.assert_allclose(got, _direct(x), rtol=1e-5, atol=1e-5)
        # a new input in the same region: the next answer follows it
        x2 = np.random.default_rng().standard_normal((3, 1, 8, 8)).astype(np.float32)
        shm.set_shared_memory_region(made["in"], [x2])
        client.infer("digits", [inp], outputs=[out])
        got = shm.get_contents_as_numpy(made["out"], np.float32, [3, 10])
        np.testing.assert_allclose(got, _direct(x2), rtol=1e-5, atol=1e-5)
        client.unregister_system_shared_memory()
        with pytest.raises(Exception, match=f"no shared-memory region 'in_{tag}'"):
            client.infer("digits", [inp])


def test_shared_memory_is_off_unless_asked_for(tmp_path, regions):
    _model(tmp_path)
    tag, _ = regions
    with test_http.serving(tmp_path) as (url, _):
        client = httpclient.InferenceServerClient(url)
        with pytest.raises(Exception, match="--allow-shared-memory"):
            client.register_system_shared_memory(f"in_{tag}", f"/tk_in_{tag}", IN_BYTES)


def test_hostile_keys_and_spans_are_refused(tmp_path, regions):
    _model(tmp_path)
    tag, _ = regions
    link = f"/dev/shm/tk_link_{tag}"
    os.symlink(f"/dev/shm/tk_in_{tag}", link)
    try:
        with test_http.serving(tmp_path, shared_memory=True) as (url, _):
            client = httpclient.InferenceServerClient(url)
            for key, size, message in [
                ("/../../etc/passwd", 8, "must be an object name"),
                ("etc/passwd", 8, "must be an object name"),
                (f"/tk_in_{tag}\n", 8, "must be an object name"),
                (f"/tk_absent_{tag}", 8, "cannot open shared memory"),
                (f"/tk_link_{tag}", 8, "cannot open shared memory"),  # (links not followed)
                (f"/tk_in_{tag}", IN_BYTES + 1, "past the end"),
                (f"/tk_in_{tag}", 0, "byte_size 0"),
            ]:
                with pytest.raises(Exception, match=message):
                    client.register_system_shared_memory(f"r_{tag}", key, size)
            client.register_system_shared_memory(f"in_{tag}", f"/tk_in_{tag}", IN_BYTES)
            with pytest.raises(Exception, match="already registered"):
                client.register_system_shared_memory(f"in_{tag}", f"/tk_in_{tag}", IN_BYTES)
            inp = httpclient.InferInput("input", [3, 1, 8, 8], "FP32")
            inp.set_shared_memory(f"in_{tag}", IN_BYTES - 4)  # (the shape takes 768 bytes)
            with pytest.raises(Exception, match="shared_memory_byte_size is 764"):
                client.infer("digits", [inp])
            inp.set_shared_memory(f"in_{tag}", IN_BYTES, offset=8)
            with pytest.raises(Exception, match="past the end of region"):
                client.infer("digits", [inp])
            big = json.dumps({"key": f"/tk_in_{tag}", "byte_size": 8, "pad": "x" * 10000})
            req = urllib.request.Request(
                f"http://{url}/v2/systemsharedmemory/region/big/register", big.encode(),
                method="POST",
            )  # fmt: skip
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(req, timeout=30)
            assert caught.value.code == 400 and b"at most 4,096 bytes" in caught.value.read()
            assert client.is_server_live()
    finally:
        os.unlink(link)
