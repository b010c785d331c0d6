"""Triton's CUDA shared-memory extension, where no client GPU memory is at hand: the extension
off by default, malformed registrations refused with messages naming them (over HTTP and gRPC,
with tritonclient's own calls), status and unregister of CUDA regions, and front-end processes
refusing it. The inference path with real GPU memory is tests/gpu/test_serve_gpu.py's."""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from tensorkiln.serve import link  # noqa: E402
from tensorkiln.serve.protocol import ServeError, datatype_of  # noqa: E402
from tensorkiln.serve.shm import SharedMemory  # noqa: E402
from tests.serve import test_grpc, test_http  # noqa: E402
from tests.serve.test_repository import _model  # noqa: E402


def _handle() -> bytes:
    return os.urandom(64)  # (no GPU allocation's: the driver refuses it, or there is none)


def test_cuda_shared_memory_is_off_unless_asked_for() -> None:
    with pytest.raises(ServeError, match=r"CUDA shared memory is off.*--allow-shared-memory"):
        SharedMemory().register_cuda("r", _handle(), 0, 64)
    with pytest.raises(ServeError, match="CUDA shared memory is off"):
        SharedMemory().cuda_status()


@pytest.mark.parametrize(
    "args, message",
    [
        (("r", b"short", 0, 64), "raw_handle must be the 64 bytes.*gives 5 bytes"),
        (("r", "x" * 64, 0, 64), "raw_handle must be the 64 bytes.*gives no bytes"),
        (("bad/name", _handle(), 0, 64), "must be letters, digits"),
        (("r", _handle(), 0, 0), "byte_size 0 must be 1"),
        (("r", _handle(), 0, -5), "byte_size must be a byte count"),
        (("r", _handle(), 0, 1 << 40), "must be 1 to"),
        # (a handle no driver knows: refused by the driver, or by the want of one)
        (("r", _handle(), 0, 64), r"region 'r'.*cannot be opened|needs a GPU and its driver"),
        (("r", _handle(), 9999, 64), r"device_id 9999 is not one of|needs a GPU and its driver"),
    ],
)
def test_malformed_registrations_are_refused(args, message) -> None:
    regions = SharedMemory(enabled=True)
    with pytest.raises(ServeError, match=message) as caught:
        regions.register_cuda(*args)
    assert caught.value.status == 400
    assert regions.cuda_status() == [] and regions.registrations() == []


@pytest.fixture
def system_object():
    """Regions with the extension on, and the key of a 256-byte shared-memory object of random
    bytes; both gone after the test."""
    regions = SharedMemory(enabled=True)
    key = f"tk_cuda_test_{uuid.uuid4().hex[:8]}"
    with open(f"/dev/shm/{key}", "wb") as f:
        f.write(os.urandom(256))
    yield regions, key
    regions.close()
    os.unlink(f"/dev/shm/{key}")


def test_cuda_and_system_regions_share_one_namespace(system_object) -> None:
    regions, key = system_object
    regions.register("r", key, 0, 256)
    with pytest.raises(ServeError, match="'r' is already registered"):
        regions.register_cuda("r", _handle(), 0, 64)
    with pytest.raises(ServeError, match="no CUDA shared-memory region 'r'"):
        regions.cuda_status("r")
    regions.unregister_cuda("r")  # (a system region: CUDA's unregister leaves it)
    assert [r["name"] for r in regions.status()] == ["r"]
    regions.unregister_cuda()
    assert regions.names() == ["r"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tritonclient_registration_errors_name_the_problem(tmp_path, protocol) -> None:
    _model(tmp_path)
    module, serving = (
        (httpclient, test_http.serving) if protocol == "http" else (grpcclient, test_grpc.serving)
    )
    with serving(tmp_path, shared_memory=True) as (url, _):
        client = module.InferenceServerClient(url)
        # tritonclient takes the handle in base64 (cuda_shared_memory.get_raw_handle's form)
        for raw, size, message in [
            (base64.b64encode(b"x" * 10), 64, "raw_handle must be the 64 bytes"),
            (base64.b64encode(_handle()), 64, "cannot be opened|needs a GPU"),
            (base64.b64encode(_handle()), 0, "byte_size 0"),
        ]:
            with pytest.raises(Exception, match=message):
                client.register_cuda_shared_memory("r", raw, 0, size)
        status = client.get_cuda_shared_memory_status(
            **({"as_json": True} if protocol == "grpc" else {})
        )
        assert not (status if protocol == "http" else status.get("regions"))
        with pytest.raises(Exception, match="no CUDA shared-memory region 'r'"):
            client.get_cuda_shared_memory_status("r")
        client.unregister_cuda_shared_memory()  # (none registered: no error, as in Triton)
        client.unregister_cuda_shared_memory("r")
        # an input naming a region nobody registered never reaches the engine
        inp = module.InferInput("input", [1, 1, 8, 8], "FP32")
        inp.set_shared_memory("r", 256)
        with pytest.raises(Exception, match="no shared-memory region 'r'"):
            client.infer("digits", [inp])
        assert client.is_server_live()


def test_http_registration_bodies_are_checked(tmp_path) -> None:
    _model(tmp_path)
    with test_http.serving(tmp_path, shared_memory=True) as (url, _):
        for body, message in [
            ({"raw_handle": "abc", "byte_size": 64}, b'raw_handle must be {\\"b64\\"'),
            ({"raw_handle": {"b64": "%%%"}, "byte_size": 64}, b"raw_handle must be"),
            ({"raw_handle": {"b64": 5}, "byte_size": 64}, b"raw_handle must be"),
            ([1, 2], b"must be a JSON object"),
            ({"raw_handle": {"b64": "A" * 8000}}, b"at most 4,096 bytes"),
        ]:
            req = urllib.request.Request(
                f"http://{url}/v2/cudasharedmemory/region/r/register",
                json.dumps(body).encode(), method="POST",
            )  # fmt: skip
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(req, timeout=30)
            assert caught.value.code == 400
            assert message in caught.value.read()


def test_front_end_processes_refuse_cuda_shared_memory() -> None:
    remote = link.RemoteCore(shared_memory=True)
    with pytest.raises(ServeError, match="without --frontend-processes"):
        remote.shm.register_cuda("r", _handle(), 0, 64)
    with pytest.raises(ServeError, match="CUDA shared memory is off"):
        link.RemoteCore(shared_memory=False).shm.register_cuda("r", _handle(), 0, 64)


def test_torch_dtypes_have_their_protocol_datatypes() -> None:
    torch = pytest.importorskip("torch")
    for dtype in (np.float32, np.float16, np.int64, np.int8, np.uint8, np.bool_, np.float64):
        t = torch.from_numpy(np.zeros(1, dtype))
        assert datatype_of(t.dtype) == datatype_of(np.dtype(dtype)) is not None
    assert datatype_of(torch.bfloat16) is None  # (no numpy twin: such an output is refused)


# ---------------------------------------------------------------------- tensors, not arrays
# (on a GPU server a request in CUDA shared memory brings torch tensors and a GPU engine returns
# them; these paths are checked here with torch tensors on the CPU against numpy runs)


def test_tensor_requests_to_a_host_engine_run_on_the_host(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from tests.serve.test_batcher import _served_digits

    served, requests = _served_digits(tmp_path, 3)
    tensors = [{"input": torch.from_numpy(r["input"].copy())} for r in requests]
    assert served.check(tensors[0]) == requests[0]["input"].shape[0]
    for r, t in zip(requests, tensors):
        np.testing.assert_array_equal(served.infer(t)["logits"], served.infer(r)["logits"])
    joined = served.infer_batch(tensors)
    for r, got in zip(requests, joined):
        assert isinstance(got["logits"], np.ndarray)
        np.testing.assert_allclose(got["logits"], served.infer(r)["logits"], rtol=1e-5, atol=1e-5)
    bad = {"input": torch.zeros((1, 1, 8, 8), dtype=torch.float64)}
    with pytest.raises(Exception, match="input 'input' is FP32, the request gives FP64"):
        served.check(bad)


def test_tensor_and_array_requests_never_share_a_run(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    from tensorkiln.serve.batcher import DynamicBatcher
    from tests.serve.test_batcher import _run_all, _served_digits

    served, requests = _served_digits(tmp_path, 16)
    seen: list[set] = []

    def run(batch):
        seen.append({type(r["input"]) for r in batch})
        return served.infer_batch(batch)

    feeds = [
        {"input": torch.from_numpy(r["input"].copy())} if i % 2 else r
        for i, r in enumerate(requests)
    ]
    results = _run_all(DynamicBatcher(run, max_batch=16, max_delay_s=0.05, workers=2), feeds)
    for r, got in zip(requests, results):
        np.testing.assert_allclose(got["logits"], served.infer(r)["logits"], rtol=1e-5, atol=1e-5)
    assert all(len(kinds) == 1 for kinds in seen) and len(seen) >= 2


def test_split_rows_and_system_regions_take_tensors(system_object) -> None:
    torch = pytest.importorskip("torch")
    from tensorkiln.serve.batcher import split_rows

    y = np.random.default_rng().standard_normal((5, 10)).astype(np.float32)
    parts = split_rows({"y": torch.from_numpy(y)}, [2, 3])
    for got, want in zip(parts, (y[:2], y[2:])):
        assert isinstance(got["y"], torch.Tensor) and got["y"].is_contiguous()
        np.testing.assert_array_equal(got["y"].numpy(), want)
    regions, key = system_object
    regions.register("out", key, 0, 256)
    params = regions.output_to(("out", 16, 200), "y", torch.from_numpy(y[:4]))
    assert params == {
        "shared_memory_region": "out", "shared_memory_byte_size": 160, "shared_memory_offset": 16,
    }  # fmt: skip
    with open(f"/dev/shm/{key}", "rb") as f:
        written = np.frombuffer(f.read()[16:176], np.float32).reshape(4, 10)
    np.testing.assert_array_equal(written, y[:4])
    with pytest.raises(ServeError, match="takes 200 bytes, over the shared_memory_byte_size"):
        regions.output_to(("out", 0, 160), "y", torch.from_numpy(y))


def test_answers_of_one_loop_turn_share_one_wait() -> None:
    """The answers of one batched run (handed back in one turn of the loop) wait for their
    copies with one synchronization; later turns get their own; a failed wait fails each of
    its answers, and a cancelled answer leaves the others waiting."""
    import asyncio

    from tensorkiln.serve import cuda_shm

    rng = np.random.default_rng()
    calls: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def wait() -> None:
            assert asyncio.get_running_loop() is loop  # (on the loop's own thread)
            calls.append(1)

        first = int(rng.integers(2, 9))
        await asyncio.gather(*(cuda_shm.together("k", wait) for _ in range(first)))
        assert len(calls) == 1  # (one wait for all of the first turn's callers)
        await cuda_shm.together("k", wait)
        assert len(calls) == 2

        def fail() -> None:
            raise RuntimeError("copy failed")

        results = await asyncio.gather(
            *(cuda_shm.together("f", fail) for _ in range(3)), return_exceptions=True
        )
        assert [str(r) for r in results] == ["copy failed"] * 3

        tasks = [asyncio.ensure_future(cuda_shm.together("k", wait)) for _ in range(4)]
        await asyncio.sleep(0)  # (each task has joined the turn's waiters)
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert len(calls) == 3
        assert isinstance(done[1], asyncio.CancelledError)
        assert [done[i] for i in (0, 2, 3)] == [None] * 3
        assert not cuda_shm._together  # (nothing left behind)

    asyncio.run(main())
