"""Front-end processes (serve/link.py, serve/frontend.py, ``tensorkiln serve --frontend-processes``):
the link's frames and tensors, a front end's core answering from the engine process's (in one
process, over the Unix socket), and the CLI serving tritonclient through several processes.
Every answer is checked against the engine run directly (the reference backend)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from tensorkiln.builder import Builder
from tensorkiln.serve import link
from tensorkiln.serve.core import ServerCore
from tensorkiln.serve.protocol import ServeError
from tests.serve.helpers import free_port, wait_until
from tests.serve.test_repository import DIGITS, _model


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


@functools.cache
def _digits_context():
    return Builder("reference").build(str(DIGITS), progress=False).create_execution_context()


def _digits(x: np.ndarray) -> np.ndarray:
    return _digits_context().infer({"input": x})["logits"]


def test_tensors_cross_the_link_unchanged():
    rng = np.random.default_rng()
    tensors = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.integers(-100, 100, (7,)).astype(np.int64),
        "c": rng.standard_normal((2, 0, 4)).astype(np.float16),
        "d": rng.random((4, 4)) < 0.5,
        "e": rng.standard_normal((6, 3)).astype(np.float64)[:, 1],  # (a strided view)
    }
    descs, chunks = link.pack_tensors(tensors)
    payload = b"".join(bytes(c) for c in chunks)
    back = link.unpack_tensors(descs, payload)
    assert list(back) == list(tensors)
    for name, x in tensors.items():
        assert back[name].dtype == x.dtype and back[name].shape == x.shape
        np.testing.assert_array_equal(back[name], x)


@pytest.mark.parametrize(
    "change,why",
    [
        ({"offset": 10_000}, "outside its frame"),
        ({"size": 8}, "bytes for shape"),
        ({"shape": [-1, 3]}, "outside its frame"),
        ({"datatype": "BYTES"}, "datatype"),
    ],
)
def test_malformed_tensor_descriptors_are_refused(change, why):
    descs, chunks = link.pack_tensors({"a": np.ones((2, 3), np.float32)})
    descs[0].update(change)
    with pytest.raises(ValueError, match=why):
        link.unpack_tensors(descs, b"".join(bytes(c) for c in chunks))


def test_oversized_frames_are_refused_before_reading_them():
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(link._FRAME.pack(link.MAX_HEADER + 1, 0))
        with pytest.raises(ValueError, match="over the limits"):
            await link.read_frame(reader)
        reader = asyncio.StreamReader()
        reader.feed_data(link._FRAME.pack(2, 0) + b"[]")
        with pytest.raises(ValueError, match="JSON object"):
            await link.read_frame(reader)

    asyncio.run(go())


@contextlib.asynccontextmanager
async def _linked(tmp_path, arena_bytes: int = link.ARENA_BYTES):
    """A ServerCore with the digits model loaded, its EngineLink, and a RemoteCore connected to
    it over the Unix socket, in this event loop: (core, remote)."""
    core = ServerCore(tmp_path / "repo", cache_dir=tmp_path / "cache", control_mode="explicit")
    await core.load("digits")
    engine = link.EngineLink(core, arena_bytes=arena_bytes)
    path = str(tmp_path / f"engine{arena_bytes}.sock")
    await engine.start(path)
    remote = link.RemoteCore(shared_memory=False)
    await remote.connect(path)
    try:
        yield core, remote
    finally:
        await remote.close()
        await engine.close()
        await core.close()


def test_a_front_end_core_answers_as_the_engine_process_does(tmp_path):
    """A RemoteCore connected to an EngineLink over ServerCore, in one event loop: inference,
    refusals with their status, statistics, and state pushed after an unload."""
    _model(tmp_path / "repo")
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 1, 8, 8)).astype(np.float32)

    async def go():
        async with _linked(tmp_path) as (core, remote):
            model, out = await remote.infer("digits", None, {"input": x}, [])
            assert (model.name, model.version) == ("digits", 1)
            np.testing.assert_allclose(out["logits"], _digits(x), rtol=1e-5, atol=1e-5)
            assert (
                remote.ready("digits") and remote.model("digits", "1").config.max_batch_size == 16
            )
            assert remote.model("digits").metadata() == core.model("digits").metadata()
            assert remote.index() == core.index()
            with pytest.raises(ServeError) as bad:  # (the engine process's check, relayed)
                await remote.infer("digits", None, {"input": x[:, :, :4]}, [])
            assert bad.value.status == 400 and "input" in str(bad.value)
            with pytest.raises(ServeError) as unknown:
                await remote.infer("nope", None, {"input": x}, [])
            assert unknown.value.status == 404
            stats = await remote.model_statistics("digits")
            assert stats == core.statistics("digits")
            assert stats[0]["inference_count"] == 3
            await remote.request_unload("digits")
            assert not remote.ready("digits")  # (the state pushed before the reply)
            with pytest.raises(ServeError) as gone:
                await remote.infer("digits", None, {"input": x}, [])
            assert gone.value.status == 404

    asyncio.run(go())


def test_arena_blocks_never_overlap_and_join_again_when_freed():
    """Random takes and gives against an oracle: every byte owned by at most one block (a
    block is its size rounded up to 64 bytes), no room only where the oracle has no free run
    that long, the free bytes what the oracle counts, one whole block again at the end."""
    rng = np.random.default_rng()
    size = 64 * 200
    blocks = link.Blocks(size)
    owner = np.zeros(size, np.int64)  # the oracle: which block holds each byte (0: free)
    held: dict[int, tuple[int, int]] = {}
    for step in range(1, 3000):
        if held and (rng.random() < 0.45 or len(held) > 40):
            key = list(held)[rng.integers(len(held))]
            offset, n = held.pop(key)
            blocks.give(offset, n)
            owner[owner == key] = 0
        else:
            n = int(rng.integers(1, 64 * 12))
            whole = -(-n // 64) * 64
            offset = blocks.take(n)
            if offset is None:
                edges = np.flatnonzero(np.diff(np.r_[1, owner != 0, 1]))
                assert (edges[1::2] - edges[::2]).max(initial=0) < whole
                continue
            assert offset % 64 == 0 and offset + whole <= size
            assert not owner[offset : offset + whole].any()
            owner[offset : offset + whole] = step
            held[step] = (offset, n)
        assert blocks.free_bytes() == int((owner == 0).sum())
    for offset, n in held.values():
        blocks.give(offset, n)
    assert blocks._free == [(0, size)]


def _arena_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("tensorkiln-link-")}


def test_requests_cross_through_the_arena_or_the_socket_when_it_is_full(tmp_path):
    """Inputs written into the engine process's shared memory: every answer right with
    requests in flight that overflow the arena (those go through the socket), one larger than
    the arena, and none (arena_bytes=0); nothing left in /dev/shm once mapped."""
    _model(tmp_path / "repo")
    rng = np.random.default_rng()
    before = _arena_files() if os.path.isdir("/dev/shm") else set()

    async def go(arena_bytes: int) -> list[str]:
        ways = []
        sent = link.write_frame

        def spy(writer, header, chunks):  # (which way each request's tensors went)
            if header.get("op") == "infer":
                ways.append("arena" if header.get("arena") else "socket")
            sent(writer, header, chunks)

        async with _linked(tmp_path, arena_bytes) as (_, remote):
            assert (remote._arena is not None) == (arena_bytes > 0)
            if os.path.isdir("/dev/shm"):
                assert _arena_files() == before  # (unlinked once both ends hold it)
            link.write_frame = spy
            try:
                xs = [rng.standard_normal((int(rng.integers(1, 9)), 1, 8, 8)).astype(np.float32)
                      for _ in range(24)]  # fmt: skip
                answers = await asyncio.gather(
                    *(remote.infer("digits", None, {"input": x}, []) for x in xs)
                )
                for x, (_, out) in zip(xs, answers, strict=True):
                    np.testing.assert_allclose(out["logits"], _digits(x), rtol=1e-5, atol=1e-5)
                big = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)  # (4 KiB: over 3 KiB)
                _, out = await remote.infer("digits", None, {"input": big}, [])
                np.testing.assert_allclose(out["logits"], _digits(big), rtol=1e-5, atol=1e-5)
                if remote._blocks is not None:
                    assert remote._blocks.free_bytes() == arena_bytes and not remote._held
            finally:
                link.write_frame = sent
        return ways

    ways = asyncio.run(go(3 << 10))  # (room for a few requests of up to 8 images)
    assert "arena" in ways[:24] and "socket" in ways[:24] and ways[24] == "socket"
    assert set(asyncio.run(go(0))) == {"socket"}
    if os.path.isdir("/dev/shm"):
        assert _arena_files() == before


def test_a_front_end_opens_only_the_arenas_the_engine_process_makes(tmp_path):
    name, memory = link.create_arena(str(tmp_path), 4096)
    try:
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o600
        mapped = link.open_arena(str(tmp_path), name, 4096)
        mapped[:5] = b"hello"
        assert memory[:5] == b"hello"  # (the same memory)
        mapped.close()
        for bad in ("../x", "/etc/passwd", "tensorkiln-link-1-xyz", name + "\n", 7, None):
            with pytest.raises(ValueError, match="not one the engine process makes"):
                link.open_arena(str(tmp_path), bad, 4096)
        with pytest.raises(ValueError, match="not a 8192-byte file"):
            link.open_arena(str(tmp_path), name, 8192)
        for size in (0, -1, "4096", link.MAX_PAYLOAD + 1):
            with pytest.raises(ValueError, match="arena size"):
                link.open_arena(str(tmp_path), name, size)
        fake = "tensorkiln-link-1-0123456789abcdef"
        (tmp_path / fake).symlink_to(tmp_path / name)
        with pytest.raises(OSError):  # (a link is not followed)
            link.open_arena(str(tmp_path), fake, 4096)
    finally:
        memory.close()


def test_the_engine_process_refuses_an_arena_it_did_not_give(tmp_path):
    _model(tmp_path / "repo")

    async def go():
        async with _linked(tmp_path, 0) as (_, remote):
            descs, _ = link.pack_tensors({"input": np.ones((1, 1, 8, 8), np.float32)})
            header = {"op": "infer", "model": "digits", "inputs": descs, "arena": True}
            with pytest.raises(ServeError, match="arena it was not given") as bad:
                await remote._call(header)
            assert bad.value.status == 400

    asyncio.run(go())


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on TCP ``port`` (from /proc/net)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    found.add(fields[9])
    return found


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                out.add(target[8:-1])
    return out


@pytest.mark.parametrize("transport", ["grpcio", "native"])
def test_serve_with_front_end_processes_answers_every_client(transport, tmp_path):
    """``tensorkiln serve --frontend-processes 2``: 8 tritonclient clients, each with its own
    connections, over HTTP and gRPC (either transport); every answer right, every request
    counted once by the engine process's statistics (whichever process received it), SIGTERM
    stops them all."""
    httpclient = pytest.importorskip("tritonclient.http")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    if transport == "native":
        from tests.serve.test_grpc import native_or_skip

        native_or_skip()
    _model(tmp_path / "repo")
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorkiln", "serve", "--model-repository", str(tmp_path / "repo"),
         "--http-port", str(port), "--http-address", "127.0.0.1", "--grpc-port", str(grpc_port),
         "--grpc-address", "127.0.0.1", "--allow-metrics", "false", "--frontend-processes", "2",
         "--engine-cache", str(tmp_path / "cache"), "--grpc-transport", transport],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    rng = np.random.default_rng()
    xs = [rng.standard_normal((2, 1, 8, 8)).astype(np.float32) for _ in range(8)]
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        probe = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        # (the front ends listen before the server process has finished starting)
        wait_until(lambda: any("front-end processes started" in line for line in lines), proc)
        wait_until(lambda: probe.is_model_ready("digits"), proc)

        def client(i: int) -> np.ndarray:
            got = []
            for _ in range(6):  # (a fresh connection each time: spread over the processes)
                if i % 2:
                    c = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
                    inp = grpcclient.InferInput("input", [2, 1, 8, 8], "FP32")
                else:
                    c = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
                    inp = httpclient.InferInput("input", [2, 1, 8, 8], "FP32")
                assert c.is_model_ready("digits")
                inp.set_data_from_numpy(xs[i])
                got.append(c.infer("digits", [inp]).as_numpy("logits"))
                c.close()
            return np.stack(got)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(client, range(8)))
        for x, got in zip(xs, answers, strict=True):
            np.testing.assert_allclose(got, np.stack([_digits(x)] * 6), rtol=1e-5, atol=1e-5)
        stats = probe.get_inference_statistics("digits")["model_stats"][0]
        assert int(stats["inference_stats"]["success"]["count"]) == 8 * 6
        children = _children(proc.pid)
        assert len(children) == 2
        # (the front ends alone listen: the engine process keeps its interpreter for the models)
        for p in (port, grpc_port):
            listening = _listening_inodes(p)
            assert listening and not listening & _socket_inodes(proc.pid)
            assert all(listening & _socket_inodes(c) for c in children)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert "2 front-end processes started" in out
    assert "front end 1 serving" in out and "front end 2 serving" in out


def test_frontend_processes_flag_is_checked(tmp_path):
    _model(tmp_path / "repo")
    run = subprocess.run(
        [sys.executable, "-m", "tensorkiln", "serve", "--model-repository", str(tmp_path / "repo"),
         "--frontend-processes", "-1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0 and "--frontend-processes -1 must be 0 to 64" in run.stderr


def test_a_port_another_program_holds_stops_the_start_with_its_reason(tmp_path):
    """The front ends alone bind the ports: one that cannot says why, and the server exits 1."""
    import socket

    _model(tmp_path / "repo")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "tensorkiln", "serve", "--model-repository",
             str(tmp_path / "repo"), "--http-port", str(port), "--http-address", "127.0.0.1",
             "--allow-grpc", "false", "--allow-metrics", "false", "--frontend-processes", "1",
             "--engine-cache", str(tmp_path / "cache")],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-2000:]
    assert "address already in use" in out and "a front-end process exited with 1" in out
    assert "Traceback" not in out
