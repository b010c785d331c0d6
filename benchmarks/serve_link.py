"""The cost of the front-end link (serve/link.py) to the engine process, per request: the
process every request of ``tensorkiln serve --frontend-processes N`` goes through.

    python benchmarks/serve_link.py [--concurrency 16] [--seconds 5] [--side 224]

The engine process runs in a process of its own, as under the server; a front end's RemoteCore
in this process keeps ``--concurrency`` requests of one FP32 image (3 x side x side) in flight.
Two engine processes are measured, each with the input tensors through the shared-memory arena
and through the socket (the same run, alternating):

- ``link``: the link over a core that answers at once (the protocol's cost alone);
- ``server``: the link over a real ServerCore with dynamic batching (max 64, 200 us, two
  instances) whose engine runs are replaced by a lookup of precomputed outputs: every request is
  checked, queued, batched, joined into the staging buffer, split and answered as under load,
  without a model's compute.

Printed per variant: requests per second and the CPU time the engine process and this front end
spent per request (from /proc and the process clock). Every answer is checked first: the
stand-in engine returns, per row, the sum of the row's input, which each request compares with
its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

import numpy as np  # noqa: E402


def _row_sums(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1).sum(axis=1, dtype=np.float64)[:, None]


class _Answered:
    """A model as the link's replies name it."""

    name, version = "m", 1


class NullCore:
    """What EngineLink needs of a ServerCore, answering every request at once with its rows'
    sums (no scheduler, no checks)."""

    def __init__(self) -> None:
        self.on_change: list = []
        self.on_shm_change: list = []
        self._lock = threading.Lock()
        self.models: dict = {}
        self.failed: dict = {}
        self.shm = self

    def registrations(self) -> list:
        return []

    def index(self) -> list:
        return []

    async def infer(self, name, version, feeds, outputs):
        return _Answered, {"sums": _row_sums(feeds["input"])}


def _repository(folder: Path, side: int) -> Path:
    """A repository of one model with a 3 x side x side FP32 input, dynamic batching and two
    instances (its engine is never run: the engine process replaces the runs)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["input", "axes"], ["sums"], keepdims=0)],
        "sums",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, side, side])],
        [helper.make_tensor_value_info("sums", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor("axes", TensorProto.INT64, [3], [1, 2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    version = folder / "m" / "1"
    version.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(version / "model.onnx"))
    (folder / "m" / "config.pbtxt").write_text(
        'name: "m"\nmax_batch_size: 64\ninstance_group [ { count: 2 } ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 200 }\n"
    )
    return folder


def engine_process(path: str, kind: str, arena_bytes: int, work: str, side: int) -> None:
    """The engine process: a link over ``kind``'s core, until killed."""
    from tensorkiln.serve import link

    async def go() -> None:
        if kind == "link":
            core = NullCore()
        else:
            from tensorkiln.serve.core import ServerCore
            from tensorkiln.serve.model import ServedModel

            def stand_in(self, feeds):  # (the engine run, without the model)
                return {"sums": _row_sums(feeds["input"])[:, 0].astype(np.float32)}

            ServedModel._run = stand_in
            core = ServerCore(_repository(Path(work), side), cache_dir=Path(work) / "cache")
            await core.load("m")
        engine = link.EngineLink(core, arena_bytes=arena_bytes)
        await engine.start(path)
        await asyncio.Event().wait()

    asyncio.run(go())


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(path: str, concurrency: int, seconds: float, side: int) -> tuple[int, int]:
    """Requests answered and answers that were wrong, ``concurrency`` at a time."""
    from tensorkiln.serve import link
    from tensorkiln.serve.frontend import _connect

    remote = link.RemoteCore(shared_memory=False)
    # (the socket's file appears at bind, before it listens: connect as a front end does)
    await _connect(remote, path, 30.0)
    remote._models.setdefault("m", {1: link.RemoteModel("m", 1, {}, None)})
    rng = np.random.default_rng()
    inputs = [rng.standard_normal((1, 3, side, side)).astype(np.float32) for _ in range(8)]
    sums = [_row_sums(x).ravel() for x in inputs]
    done = wrong = 0
    stop = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal done, wrong
        while time.perf_counter() < stop:
            i = (k + done) % len(inputs)
            _, out = await remote.infer("m", None, {"input": inputs[i]}, [])
            got = np.asarray(out["sums"], np.float64).ravel()
            if got.shape != sums[i].shape or not np.allclose(got, sums[i], rtol=1e-3):
                wrong += 1
            done += 1

    try:
        await asyncio.gather(*(client(k) for k in range(concurrency)))
    finally:
        await remote.close()
    return done, wrong


def measure(kind: str, arena_bytes: int, args: argparse.Namespace, work: str) -> dict:
    folder = tempfile.mkdtemp(prefix="tk-link-")
    path = os.path.join(folder, "engine.sock")
    cmd = [sys.executable, __file__, "--engine", kind, path, str(arena_bytes), work]
    proc = subprocess.Popen([*cmd, str(args.side)])
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the {kind} engine process did not start")
            time.sleep(0.05)
        asyncio.run(_drive(path, args.concurrency, args.warmup, args.side))
        engine0, own0, t0 = _cpu_seconds(proc.pid), time.process_time(), time.perf_counter()
        done, wrong = asyncio.run(_drive(path, args.concurrency, args.seconds, args.side))
        engine1, own1, t1 = _cpu_seconds(proc.pid), time.process_time(), time.perf_counter()
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.rmdir(folder)
    n = max(done, 1)
    return {
        "kind": kind,
        "tensors": "arena" if arena_bytes else "socket",
        "requests": done,
        "wrong": wrong,
        "req_per_s": round(done / (t1 - t0), 1),
        "engine_us_per_request": round(1e6 * (engine1 - engine0) / n, 1),
        "front_end_us_per_request": round(1e6 * (own1 - own0) / n, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--side", type=int, default=224, help="the image's side (3 x side x side)")
    p.add_argument("--kinds", default="link,server")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from tensorkiln.serve.link import ARENA_BYTES

    rows = []
    with tempfile.TemporaryDirectory(prefix="tk-link-repo-") as work:
        for kind in args.kinds.split(","):
            for arena_bytes in (ARENA_BYTES, 0):
                row = measure(kind, arena_bytes, args, work)
                rows.append(row)
                print(
                    f"{kind:6s} {row['tensors']:6s}: {row['req_per_s']:>9,.0f} req/s; engine "
                    f"process {row['engine_us_per_request']:6.1f} us CPU per request, front end "
                    f"{row['front_end_us_per_request']:6.1f} us ({row['requests']} requests, "
                    f"{row['wrong']} wrong)",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if any(r["wrong"] or not r["requests"] for r in rows) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        kind, path, arena_bytes, work, side = sys.argv[2:7]
        engine_process(path, kind, int(arena_bytes), work, int(side))
    else:
        sys.exit(main())
