"""Serving on a GPU: requests received into page-locked memory (the pinned pool) go to the engine
from where they arrived, and every answer equals the direct engine run on the reference backend.

Run on a GPU machine:  PYTHONPATH=src python3 -m pytest -q -m gpu tests/gpu/test_serve_gpu.py
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.builder import Builder  # noqa: E402
from tensorkiln.serve import ModelRepository  # noqa: E402
from tensorkiln.serve.core import RECEIVE_PINNED_MIN, ServerCore  # noqa: E402
from tensorkiln.serve.model import PinnedPool, ServedModel  # noqa: E402
from tests.serve.test_repository import CONFIG, DIGITS, _model  # noqa: E402

pytestmark = pytest.mark.gpu


def _pinned(a: np.ndarray) -> bool:
    return bool(torch.from_numpy(a.reshape(-1).view(np.uint8)).is_pinned())


def test_the_pinned_pool_bounds_the_page_locked_bytes_in_use() -> None:
    pool = PinnedPool(limit=3 << 20)
    a = pool.take(2 << 20)
    assert a is not None and a.dtype == np.uint8 and a.size == 2 << 20 and _pinned(a)
    assert pool.used == 2 << 20
    assert pool.take(2 << 20) is None  # (over the limit: the caller takes pageable memory)
    view = np.frombuffer(memoryview(a)[5:4005], np.float32)  # (a request's tensor, unaligned)
    del a
    gc.collect()
    assert pool.used == 2 << 20  # (a view of the buffer holds it)
    assert _pinned(view)
    del view
    gc.collect()
    assert pool.used == 0
    b = pool.take(3 << 20)
    assert b is not None and _pinned(b)


def test_a_lone_request_in_page_locked_memory_runs_where_it_lies(tmp_path) -> None:
    _model(tmp_path)
    entry = ModelRepository(tmp_path).read("digits")
    served = ServedModel.load(entry, entry.versions[-1], backend="cuda")
    direct = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
    pool = PinnedPool()
    rng = np.random.default_rng()
    for n in (1, 2, 4, 3, 1):
        x = rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
        buf = pool.take(x.nbytes + 3)
        feed = np.frombuffer(memoryview(buf)[3:], np.float32).reshape(x.shape)  # (unaligned)
        feed[...] = x
        want = direct.infer({"input": x})["logits"]
        for given in (feed, x.copy()):  # page-locked, where it lies; pageable, staged
            got = served.infer({"input": given})["logits"]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(feed, x)  # (the request's own bytes are not written)
    # two requests joined in a batch
    xs = [rng.standard_normal((k, 1, 8, 8)).astype(np.float32) for k in (1, 2)]
    got = served.infer_batch([{"input": x} for x in xs])
    for x, g in zip(xs, got):
        np.testing.assert_allclose(
            g["logits"], direct.infer({"input": x})["logits"], rtol=1e-4, atol=1e-5
        )


def test_the_core_receives_large_requests_in_page_locked_memory_once_a_gpu_model_loads(
    tmp_path,
) -> None:
    _model(tmp_path / "repo")

    async def main() -> None:
        core = ServerCore(tmp_path / "repo", backend="cuda")
        before = core.receive_buffer(RECEIVE_PINNED_MIN)
        assert isinstance(before, bytearray) and len(before) == RECEIVE_PINNED_MIN
        await core.load("digits")
        try:
            big = core.receive_buffer(RECEIVE_PINNED_MIN + 7)
            assert isinstance(big, np.ndarray) and big.size == RECEIVE_PINNED_MIN + 7
            assert _pinned(big)
            small = core.receive_buffer(RECEIVE_PINNED_MIN - 1)
            assert isinstance(small, bytearray)
        finally:
            await core.close()
        off = ServerCore(tmp_path / "repo", backend="cuda", pinned_pool_bytes=0)
        await off.load("digits")
        try:  # (--pinned-memory-pool-byte-size 0: no pool, every request is staged)
            assert isinstance(off.receive_buffer(RECEIVE_PINNED_MIN + 7), bytearray)
        finally:
            await off.close()

    asyncio.run(main())


# ---------------------------------------------------------------------- CUDA shared memory
GRAPHS = CONFIG.replace("instance_group", "optimization { cuda { graphs: true } }\ninstance_group")


def _reference(x: np.ndarray) -> np.ndarray:
    direct = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
    return direct.infer({"input": x})["logits"]


@pytest.mark.parametrize("config", [CONFIG, GRAPHS], ids=["plain", "graphs"])
def test_requests_on_the_gpu_run_and_join_there(tmp_path, config) -> None:
    """Tensors in CUDA shared memory reach the model as GPU tensors: a lone one runs as it is,
    several are joined (and padded up to a graph's batch) on the GPU, and the outputs stay
    there."""
    _model(tmp_path, config=config)
    entry = ModelRepository(tmp_path).read("digits")
    served = ServedModel.load(entry, entry.versions[-1], backend="cuda")
    rng = np.random.default_rng()
    xs = [rng.standard_normal((n, 1, 8, 8)).astype(np.float32) for n in (1, 3, 2)]
    feeds = [{"input": torch.from_numpy(x).cuda()} for x in xs]
    assert served.check(feeds[1]) == 3
    lone = served.infer(feeds[0])["logits"]
    assert isinstance(lone, torch.Tensor) and lone.is_cuda
    np.testing.assert_allclose(lone.cpu().numpy(), _reference(xs[0]), rtol=1e-4, atol=1e-5)
    got = served.infer_batch(feeds)
    for x, g in zip(xs, got):
        assert g["logits"].is_cuda and tuple(g["logits"].shape) == (x.shape[0], 10)
        np.testing.assert_allclose(g["logits"].cpu().numpy(), _reference(x), rtol=1e-4, atol=1e-5)


def _exported(nbytes: int) -> tuple[Any, bytes, int]:
    """A GPU buffer of this process's, as another process opens it: (the uint8 tensor, its
    CUDA IPC handle, the tensor's byte offset from the handle's base)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    _, handle, _, offset, *_ = buf.untyped_storage()._share_cuda_()
    handle = bytes(handle)
    if len(handle) == 66:  # (torch's form: a version byte, "c" for cudaMalloc, the handle)
        assert handle[1:2] == b"c"
        handle = handle[2:]
    return buf, handle, int(offset)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cuda_shared_memory_with_tritonclient(tmp_path, protocol) -> None:
    """``tensorkiln serve --backend cuda --allow-shared-memory true`` in its own process, and
    this process as the client: inputs and outputs in GPU memory this process exported, alone
    and beside tensors in the message, one at a time and 16 at once (joined by dynamic
    batching); every answer is the reference backend's for its own input."""
    import base64
    import concurrent.futures
    import subprocess
    import sys

    from tests.serve.helpers import free_port, wait_until

    module = pytest.importorskip(f"tritonclient.{protocol}")
    _model(tmp_path / "repo")
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorkiln", "serve", "--model-repository", str(tmp_path / "repo"),
         "--backend", "cuda", "--allow-shared-memory", "true", "--http-port", str(http_port),
         "--http-address", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-address",
         "127.0.0.1", "--allow-metrics", "false", "--engine-cache", str(tmp_path / "cache")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = f"127.0.0.1:{http_port if protocol == 'http' else grpc_port}"
        client = module.InferenceServerClient(url)
        wait_until(lambda: client.is_model_ready("digits"), proc)
        n_req = 16
        in_bytes, out_bytes = 4 * 64 * 4, 4 * 10 * 4  # (up to 4 rows a request)
        ins = [_exported(in_bytes) for _ in range(n_req)]
        outs = [_exported(out_bytes) for _ in range(n_req)]
        for i, (buf, handle, offset) in enumerate(ins + outs):
            client.register_cuda_shared_memory(
                f"r{i}", base64.b64encode(handle), 0, offset + buf.numel()
            )
        status = client.get_cuda_shared_memory_status(
            **({"as_json": True} if protocol == "grpc" else {})
        )
        listed = status if protocol == "http" else list(status["regions"].values())
        assert sorted(r["name"] for r in listed) == sorted(f"r{i}" for i in range(2 * n_req))

        def ask(i: int, rows: int, in_gpu: bool, out_gpu: bool, by: Any = client) -> tuple:
            x = np.random.default_rng().standard_normal((rows, 1, 8, 8)).astype(np.float32)
            inp = module.InferInput("input", list(x.shape), "FP32")
            buf, _, offset = ins[i]
            if in_gpu:
                buf[: x.nbytes].copy_(torch.from_numpy(x.reshape(-1).view(np.uint8)))
                torch.cuda.synchronize()
                inp.set_shared_memory(f"r{i}", x.nbytes, offset=offset)
            else:
                inp.set_data_from_numpy(x)
            out = module.InferRequestedOutput("logits")
            obuf, _, ooffset = outs[i]
            if out_gpu:
                out.set_shared_memory(f"r{n_req + i}", rows * 40, offset=ooffset)
            result = by.infer("digits", [inp], outputs=[out])
            if out_gpu:
                got = obuf[: rows * 40].cpu().numpy().view(np.float32).reshape(rows, 10)
            else:
                got = result.as_numpy("logits")
            return x, got

        for in_gpu, out_gpu in ((True, True), (True, False), (False, True)):
            for rows in (1, 3):
                x, got = ask(0, rows, in_gpu, out_gpu)
                np.testing.assert_allclose(got, _reference(x), rtol=1e-4, atol=1e-5)
        if protocol == "grpc":  # (16 at once: the dynamic batcher joins them on the GPU)
            clients = [module.InferenceServerClient(url) for _ in range(n_req)]

            def one(i: int) -> tuple[np.ndarray, np.ndarray]:
                return ask(i, 1 + i % 4, True, True, clients[i])

            with concurrent.futures.ThreadPoolExecutor(n_req) as pool:
                for x, got in pool.map(one, range(n_req)):
                    np.testing.assert_allclose(got, _reference(x), rtol=1e-4, atol=1e-5)
        # refused, naming the problem: past the region's end, a size past the allocation
        inp = module.InferInput("input", [4, 1, 8, 8], "FP32")
        inp.set_shared_memory("r0", in_bytes, offset=ins[0][2] + 4)
        with pytest.raises(Exception, match="past the end of region 'r0'"):
            client.infer("digits", [inp])
        with pytest.raises(Exception, match="past the end of the GPU allocation"):
            # (a small tensor's allocation is a 2 MiB block of torch's; 1 GiB is past it)
            client.register_cuda_shared_memory("huge", base64.b64encode(ins[0][1]), 0, 1 << 30)
        client.unregister_cuda_shared_memory("r0")
        inp.set_shared_memory("r0", in_bytes, offset=ins[0][2])
        with pytest.raises(Exception, match="no shared-memory region 'r0'"):
            client.infer("digits", [inp])
        client.unregister_cuda_shared_memory()
        assert client.is_server_live()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
