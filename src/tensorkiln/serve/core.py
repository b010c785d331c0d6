"""The server's state, apart from any protocol: the repository, the loaded models and their
batchers, and inference on them. The HTTP and gRPC front ends translate to and from this.

Errors a client causes are :class:`ServeError` with the HTTP status to answer with (400 for a bad
request, 404 for an unknown model, 503 for a model that is not ready). Nothing a request holds
reaches an engine before the model's checks pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tensorkiln.errors import InputError, TensorkilnError
from tensorkiln.serve import protocol
from tensorkiln.serve.batcher import DynamicBatcher, contiguous
from tensorkiln.serve.model import PINNED_POOL_BYTES, PinnedPool, ServedModel
from tensorkiln.serve.protocol import ServeError
from tensorkiln.serve.repository import ModelRepository
from tensorkiln.serve.shm import SharedMemory
from tensorkiln.version import __version__

try:
    from tensorkiln.serve.metrics import Metrics
except ImportError:  # (prometheus-client not installed: the server runs without /metrics)
    Metrics = None  # type: ignore[assignment,misc]

log = logging.getLogger("tensorkiln.serve")

SERVER_NAME = "tensorkiln"
EXTENSIONS = [
    "binary_tensor_data", "model_repository", "model_configuration", "statistics",
    "system_shared_memory",
]  # fmt: skip


@dataclass
class _Loaded:
    versions: dict[int, ServedModel]
    batchers: dict[int, DynamicBatcher] = field(default_factory=dict)


CONTROL_MODES = ("none", "explicit", "poll")
# a lone request to an idle model whose runs take at most this long runs on the event loop's
# thread, without the two thread hops of a worker's run (serve/batcher.py says when and why)
INLINE_RUN_MAX_S = 0.002


# (smaller requests are copied as fast as they are received)
RECEIVE_PINNED_MIN = 64 << 10


class ServerCore:
    """Models of a repository, loaded, and inference on them. ``backend``: the engines'
    backend for ONNX models built on load; ``cache_dir``: where those builds are kept;
    ``control_mode``: Triton's model control mode, which decides whether the repository API may
    load and unload models (only "explicit" lets it; "poll" follows the folder instead);
    ``pinned_pool_bytes``: the page-locked memory that requests to models on a GPU are
    received into, at most (0: none)."""

    def __init__(
        self,
        repository: str | Path,
        *,
        backend: str = "reference",
        cache_dir: Any = None,
        control_mode: str = "explicit",
        shared_memory: bool = False,
        pinned_pool_bytes: int = PINNED_POOL_BYTES,
    ) -> None:
        if control_mode not in CONTROL_MODES:
            raise ValueError(f"control_mode must be one of {CONTROL_MODES}, got {control_mode!r}")
        self.control_mode = control_mode
        self.shm = SharedMemory(enabled=shared_memory)  # Triton's system shared memory
        self.stats: dict[tuple[str, int], ModelStats] = {}  # the statistics extension's
        self._seen: dict[str, tuple] = {}  # poll mode: model -> fingerprint when last loaded
        self.repository = ModelRepository(repository)
        self.backend = backend
        self.cache_dir = cache_dir
        self.models: dict[str, _Loaded] = {}
        self.failed: dict[str, str] = {}  # model -> why it could not load
        self.metrics = None if Metrics is None else Metrics(lambda: self.stats)
        self._lock = threading.Lock()
        self.on_change: list[Any] = []  # called after models load, fail or unload
        self.on_shm_change: list[Any] = []  # called after a region is registered or dropped
        self._pinned: PinnedPool | None = None  # (made when a model on a GPU loads)
        self._pinned_bytes = pinned_pool_bytes

    def _changed(self) -> None:
        for hook in self.on_change:
            hook()

    def receive_buffer(self, size: int) -> Any:
        """Where to receive an inference request of ``size`` bytes: page-locked memory from
        the pinned pool once a model on a GPU is loaded and for requests of RECEIVE_PINNED_MIN
        bytes or more (the tensors in it then go to the GPU from where they arrived, with no
        staging copy), else a bytearray."""
        pool = self._pinned
        if pool is not None and size >= RECEIVE_PINNED_MIN:
            buf = pool.take(size)
            if buf is not None:
                return buf
        return bytearray(size)

    # ------------------------------------------------------------------ model control
    def _read(self, name: str) -> dict[int, ServedModel]:
        """``name``'s served versions, loaded (engines read or built: slow, off the loop)."""
        try:
            entry = self.repository.read(name)
            return {
                v.version: ServedModel.load(
                    entry, v, backend=self.backend, cache_dir=self.cache_dir
                )
                for v in entry.versions
            }
        except TensorkilnError as exc:
            with self._lock:
                self.failed[name] = str(exc)
                self.models.pop(name, None)
            log.error("model '%s' failed to load: %s", name, exc)
            raise ServeError(str(exc), 400) from None

    async def load(self, name: str) -> None:
        """(Re)load ``name``'s served versions; their batchers start on the running loop, and
        a version loaded before keeps serving until the new one is in place."""
        loop = asyncio.get_running_loop()
        try:
            versions = await loop.run_in_executor(None, self._read, name)
        except ServeError:
            self._changed()  # (recorded in self.failed)
            raise
        loaded = _Loaded(versions, {v: _batcher(m, self._ran) for v, m in versions.items()})
        if (
            self._pinned is None
            and self._pinned_bytes > 0
            and any(m._pinned for m in versions.values())
        ):
            self._pinned = PinnedPool(self._pinned_bytes)
        with self._lock:
            old = self.models.get(name)
            self.models[name] = loaded
            self.failed.pop(name, None)
        self._changed()
        if old is not None:
            await _close(old)
        log.info("model '%s' loaded: versions %s", name, sorted(versions))

    async def request_load(self, name: str) -> None:
        """The repository API's load: allowed in explicit model control mode only."""
        self._check_control("load")
        await self.load(name)

    async def request_unload(self, name: str) -> None:
        """The repository API's unload: allowed in explicit model control mode only."""
        self._check_control("unload")
        await self.unload(name)

    def _check_control(self, what: str) -> None:
        if self.control_mode != "explicit":
            raise ServeError(
                f"explicit model {what} is not allowed in model control mode "
                f"'{self.control_mode}' (start the server with --model-control-mode explicit)",
                400,
            )

    async def poll(self) -> None:
        """Poll mode's rescan: load models added to the repository, reload those whose files
        changed, unload those removed. A model that fails to load is recorded and tried again
        only when its files change."""
        names = set(self.repository.names())
        with self._lock:
            known = set(self.models) | set(self.failed) | set(self._seen)
        for name in sorted(known - names):
            self._seen.pop(name, None)
            with self._lock:
                dropped = self.failed.pop(name, None)
            if dropped is not None:
                self._changed()
            if name in self.models:
                with contextlib.suppress(ServeError):
                    await self.unload(name)
                log.info("model '%s' unloaded: its folder is gone", name)
        for name in sorted(names):
            mark = self.repository.fingerprint(name)
            if self._seen.get(name) == mark:
                continue
            self._seen[name] = mark
            with contextlib.suppress(ServeError):  # (recorded in self.failed)
                await self.load(name)

    async def unload(self, name: str) -> None:
        with self._lock:
            old = self.models.pop(name, None)
        if old is None:
            raise ServeError(f"model '{name}' is not loaded", 400)
        self._changed()
        await _close(old)

    async def load_all(self) -> None:
        """Every model of the repository (a model that fails is recorded, not fatal)."""
        for name in self.repository.names():
            self._seen[name] = self.repository.fingerprint(name)
            with contextlib.suppress(ServeError):  # (recorded in self.failed)
                await self.load(name)

    async def close(self) -> None:
        """Drain every batcher (requests in flight finish)."""
        with self._lock:
            loaded = list(self.models.values())
        for m in loaded:
            await _close(m)
        self.shm.close()

    # ------------------------------------------------------------------ lookup
    def model(self, name: str, version: str | None = None) -> ServedModel:
        with self._lock:
            loaded = self.models.get(name)
        return pick(name, version, None if loaded is None else loaded.versions, self.failed)

    def batcher(self, name: str, version: int) -> DynamicBatcher | None:
        with self._lock:
            loaded = self.models.get(name)
        return None if loaded is None else loaded.batchers.get(version)

    def ready(self, name: str, version: str | None = None) -> bool:
        return found(self.model, name, version)

    def index(self) -> list[dict[str, Any]]:
        out = []
        for item in self.repository.index():
            name = item["name"]
            with self._lock:
                loaded = self.models.get(name)
            if "version" in item:
                ready = loaded is not None and int(item["version"]) in loaded.versions
                item = {**item, "state": "READY" if ready else "UNAVAILABLE"}
                if not ready and name in self.failed:
                    item["reason"] = self.failed[name]
            out.append(item)
        return out

    def metadata(self) -> dict[str, Any]:
        return server_metadata()

    # ------------------------------------------------------------------ statistics
    def _stats(self, model: ServedModel) -> ModelStats:
        key = (model.name, model.version)
        st = self.stats.get(key)
        if st is None:
            st = self.stats[key] = ModelStats()
        return st

    def _ran(self, model: ServedModel, rows: int, queued: list[float], compute: float) -> None:
        """An engine run of ``rows`` rows for requests that waited ``queued`` seconds."""
        self._stats(model).run(rows, queued, compute)
        if self.metrics is not None:
            self.metrics.run(model.name, model.version, rows, queued, compute)

    def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        """The statistics extension's model_stats: every loaded model's versions, or ``name``'s
        (``version``'s)."""
        if name:
            if version:
                models = [self.model(name, version)]
            else:
                self.model(name)  # (unknown: 404; not ready: 503)
                with self._lock:
                    models = list(self.models[name].versions.values())
        else:
            with self._lock:
                models = [m for loaded in self.models.values() for m in loaded.versions.values()]
        return [self._stats(m).as_json(m.name, m.version) for m in models]

    # (the services call these, so that a front-end process can answer them over its link)
    async def model_statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        return self.statistics(name, version)

    async def shm_register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        self.shm.register(name, key, offset, byte_size)
        self._shm_changed()

    async def shm_unregister(self, name: Any) -> None:
        self.shm.unregister(name)
        self._shm_changed()

    def _shm_changed(self) -> None:
        for hook in self.on_shm_change:
            hook()

    # ------------------------------------------------------------------ inference
    async def infer(
        self,
        name: str,
        version: str | None,
        feeds: dict[str, np.ndarray],
        outputs: list[str] | tuple[str, ...] = (),
    ) -> tuple[ServedModel, dict[str, np.ndarray]]:
        """Check ``feeds`` against the model and run them through its scheduler; the model and
        the ``outputs`` asked for (every output when none is named), in that order, each of a
        protocol datatype. An output the model lacks is refused before the run."""
        model = self.model(name, version)
        start = time.perf_counter()
        ok = False
        try:
            unknown = [n for n in outputs if n not in model.outputs]
            if unknown:
                raise ServeError(
                    f"model '{model.name}' has no output {', '.join(map(repr, unknown))}", 400
                )
            try:
                batch = model.check(feeds)
            except InputError as exc:
                raise ServeError(str(exc), 400) from None
            batcher = self.batcher(name, model.version)
            if batcher is None:  # (unloaded since the model was looked up)
                raise ServeError(f"model '{name}' is not loaded", 503)
            try:
                out = await batcher.submit(feeds, batch)
            except TensorkilnError as exc:  # (the engine's own refusal: the request's fault)
                raise ServeError(f"model '{name}': {exc}", 400) from None
            chosen = {}
            for n in outputs or list(out):
                y = contiguous(out[n])  # (a torch tensor where the inputs were on the GPU)
                if protocol.datatype_of(y.dtype) is None:
                    raise ServeError(
                        f"model '{model.name}': output '{n}' has type {y.dtype}, which the "
                        "protocol lacks",
                        500,
                    )
                chosen[n] = y
            ok = True
            return model, chosen
        finally:
            took = time.perf_counter() - start
            self._stats(model).request(ok, took)
            if self.metrics is not None:
                self.metrics.request(model.name, model.version, ok, took)


class ModelStats:
    """One model version's counts and cumulative durations, as Triton's statistics extension
    reports them. The engine run's input and output copies are inside compute_infer."""

    def __init__(self) -> None:
        self.durations = {k: [0, 0] for k in ("success", "fail", "queue", "compute_infer")}
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference = 0  # ms since the epoch
        self.batches: dict[int, list[int]] = {}  # rows -> [runs, ns]

    def request(self, ok: bool, seconds: float) -> None:
        d = self.durations["success" if ok else "fail"]
        d[0] += 1
        d[1] += int(seconds * 1e9)
        self.last_inference = int(time.time() * 1000)

    def run(self, rows: int, queued: list[float], compute: float) -> None:
        ns = int(compute * 1e9)
        self.inference_count += rows
        self.execution_count += 1
        self.durations["compute_infer"][0] += 1
        self.durations["compute_infer"][1] += ns
        for q in queued:
            self.durations["queue"][0] += 1
            self.durations["queue"][1] += int(q * 1e9)
        if rows in self.batches or len(self.batches) < 1024:
            b = self.batches.setdefault(rows, [0, 0])
            b[0] += 1
            b[1] += ns

    def as_json(self, name: str, version: int) -> dict[str, Any]:
        def dur(count: int, ns: int) -> dict[str, int]:
            return {"count": count, "ns": ns}

        runs = self.execution_count
        stats = {k: dur(*v) for k, v in self.durations.items()}
        stats["compute_input"] = stats["compute_output"] = dur(runs, 0)
        stats["cache_hit"] = stats["cache_miss"] = dur(0, 0)
        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference,
            "inference_count": self.inference_count,
            "execution_count": runs,
            "inference_stats": stats,
            "batch_stats": [
                {
                    "batch_size": rows,
                    "compute_input": dur(n, 0),
                    "compute_infer": dur(n, ns),
                    "compute_output": dur(n, 0),
                }
                for rows, (n, ns) in sorted(self.batches.items())
            ],
        }


async def _close(loaded: _Loaded) -> None:
    for b in loaded.batchers.values():
        await b.close()


def found(lookup: Any, name: str, version: str | None) -> bool:
    """Whether ``lookup(name, version)`` finds a ready model (a ServeError: not)."""
    try:
        lookup(name, version)
    except ServeError:
        return False
    return True


def server_metadata() -> dict[str, Any]:
    """The server metadata endpoint's answer."""
    return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS}


def pick(name: str, version: str | None, versions: dict[int, Any] | None, failed: dict) -> Any:
    """Version ``version`` (the latest where none is named) of model ``name``, whose loaded
    versions are ``versions`` (None: not loaded; ``failed`` says why, if it failed); a
    ServeError with the status to answer with where there is none."""
    if versions is None:
        why = failed.get(name)
        if why is not None:
            raise ServeError(f"model '{name}' is not ready: {why}", 503)
        raise ServeError(f"unknown model '{name}'", 404)
    if version in (None, ""):
        return versions[max(versions)]
    if not version.isdigit():
        raise ServeError(f"model '{name}': version '{version}' is not a number", 400)
    v = int(version)
    if v not in versions:
        raise ServeError(
            f"model '{name}' has no version {v} loaded (loaded: {sorted(versions)})", 404
        )
    return versions[v]


def _batcher(model: ServedModel, ran: Any) -> DynamicBatcher:
    """The model's scheduler: dynamic batching where the config asks for it, else each request
    run alone, on the model's instances."""
    config = model.config
    gather = model.batching
    db = config.dynamic_batching
    batcher = DynamicBatcher(
        model.infer_batch,
        max_batch=max(1, model.max_batch_size),
        max_delay_s=db.max_queue_delay_microseconds / 1e6,
        preferred=tuple(db.preferred_batch_size),
        workers=model.instances,
        gather=gather,
        inline_max_s=INLINE_RUN_MAX_S,
        on_batch=lambda rows, queued, compute: ran(model, rows, queued, compute),
    )
    batcher.start()
    return batcher
