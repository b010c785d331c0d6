"""A model version being served: its engine, its completed configuration, a pool of execution
contexts (the config's instance_group count), and the checks every request passes before it
reaches the engine.

An ``model.onnx`` version is built when loaded (with a profile spanning batch 1 to
max_batch_size where the model has a batch dimension) and the engine is kept in an engine cache
folder. The folder is keyed by the ONNX file's hash, the backend and the tensorkiln version, so
the next start loads the engine instead of building it. A cached engine is read like any engine
file, with the same checks. The server never writes into the model repository.

The configuration is completed from the engine as Triton completes a TensorRT model's. Inputs
and outputs left out are filled from the engine. Those given are checked against it: the same
names, data types and dims, with the batch dimension left out when max_batch_size > 0.

``optimization { cuda { graphs: true } }`` runs a GPU engine as CUDA graphs, as Triton's TensorRT
backend does: a graph is captured per batch size the first time it is run, then replayed. To keep
the graphs few, a batch is padded up to the next graph batch size (the config's graph_spec
batch sizes, else the powers of two up to max_batch_size, and max_batch_size), and the padding
rows are dropped from the outputs.
"""

from __future__ import annotations

import hashlib
import math
import os
import queue
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.engine import Engine
from tensorkiln.engine.engine import TensorSpec
from tensorkiln.errors import InputError, ModelLoadError, TensorkilnError
from tensorkiln.serve import cuda_shm, protocol
from tensorkiln.serve.batcher import split_rows
from tensorkiln.serve.repository import ModelEntry, ModelVersion
from tensorkiln.version import __version__

# the engine's type names (tensorkiln.ir.dtypes.DType) -> the protocol's datatypes
DATATYPES = {
    "BOOL": "BOOL", "UINT8": "UINT8", "UINT16": "UINT16", "UINT32": "UINT32", "UINT64": "UINT64",
    "INT8": "INT8", "INT16": "INT16", "INT32": "INT32", "INT64": "INT64", "FLOAT16": "FP16",
    "FLOAT": "FP32", "DOUBLE": "FP64", "BFLOAT16": "BF16", "STRING": "BYTES",
}  # fmt: skip
_CHUNK = 1 << 20


class ServedModel:
    """One version of a repository model, loaded: :meth:`infer` runs checked requests."""

    def __init__(self, entry: ModelEntry, version: ModelVersion, engine: Engine) -> None:
        self.name = entry.name
        self.version = version.version
        self.engine = engine
        self.config = entry.config
        self.max_batch_size = entry.max_batch_size
        # (requests gathered into one run: dynamic batching asked for, and a batch dimension)
        self.batching = self.config.HasField("dynamic_batching") and self.max_batch_size > 0
        complete_config(self.config, engine, f"model '{self.name}' version {self.version}")
        count = sum(g.count or 1 for g in self.config.instance_group) or 1
        graphs = self.config.optimization.cuda.graphs and engine.runtime_backend.cuda_graphs
        # batch sizes that runs are padded up to (a CUDA graph each); () runs as given
        self.graph_batches = _graph_batches(self.config) if graphs else ()
        # page-locked staging buffers for the batches' inputs, per engine thread (a GPU engine)
        self._pinned = bool(engine.runtime_backend.streams)
        self._local = threading.local()
        self._contexts: queue.Queue = queue.Queue()
        for _ in range(count):
            self._contexts.put(engine.create_execution_context(use_cuda_graph=bool(graphs)))
        self.instances = count
        self.inputs = {t.name: _tensor_info(t) for t in self.config.input}
        self.outputs = {t.name: _tensor_info(t) for t in self.config.output}

    @classmethod
    def load(
        cls,
        entry: ModelEntry,
        version: ModelVersion,
        *,
        backend: str = "reference",
        cache_dir: str | Path | None = None,
    ) -> ServedModel:
        """Load ``version`` of ``entry``: its engine file, or its ONNX model built (or taken
        from ``cache_dir``, where the build is kept)."""
        where = f"model '{entry.name}' version {version.version}"
        try:
            if version.kind == "engine":
                engine = Engine.load(version.path)
            else:
                engine = _built(entry, version, backend, cache_dir)
        except TensorkilnError as exc:
            raise ModelLoadError(f"{where}: {exc}") from None
        return cls(entry, version, engine)

    # ------------------------------------------------------------------ description
    def metadata(self) -> dict[str, Any]:
        """The protocol's model metadata (name, versions, platform, inputs and outputs)."""

        def tensors(infos: Mapping[str, tuple]) -> list[dict]:
            return [
                {"name": n, "datatype": dt, "shape": self._full_shape(dims)}
                for n, (dt, dims) in infos.items()
            ]

        return {
            "name": self.name,
            "versions": [str(self.version)],
            "platform": self.config.platform or "tensorkiln_engine",
            "inputs": tensors(self.inputs),
            "outputs": tensors(self.outputs),
        }

    def _full_shape(self, dims: tuple[int, ...]) -> list[int]:
        return ([-1] if self.max_batch_size > 0 else []) + list(dims)

    # ------------------------------------------------------------------ requests
    def check(self, feeds: Mapping[str, np.ndarray]) -> int:
        """Refuse, with an :class:`InputError` naming the problem, a request the engine must
        not see: unknown or missing inputs, another data type, a shape the config does not
        allow, a batch over max_batch_size or batches that differ. Returns the batch size (1
        for a model without a batch dimension)."""
        unknown = sorted(set(feeds) - set(self.inputs))
        if unknown:
            raise InputError(
                f"model '{self.name}' has no input {', '.join(map(repr, unknown))}; its inputs "
                f"are {', '.join(map(repr, self.inputs))}"
            )
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise InputError(
                f"model '{self.name}': the request lacks input {', '.join(map(repr, missing))}"
            )
        batch = None
        for name, (datatype, dims) in self.inputs.items():
            x = feeds[name]
            if protocol.datatype_of(x.dtype) != datatype:  # (numpy, or torch: CUDA memory)
                got = protocol.datatype_of(x.dtype) or str(x.dtype)
                raise InputError(
                    f"model '{self.name}': input '{name}' is {datatype}, the request gives {got}"
                )
            shape = tuple(x.shape)
            if self.max_batch_size > 0:
                if not shape:
                    raise InputError(
                        f"model '{self.name}': input '{name}' needs a batch dimension first"
                    )
                n, shape = shape[0], shape[1:]
                if not 1 <= n <= self.max_batch_size:
                    raise InputError(
                        f"model '{self.name}': input '{name}' has a batch of {n}; the model "
                        f"takes 1 to {self.max_batch_size}"
                    )
                if batch is not None and n != batch:
                    raise InputError(
                        f"model '{self.name}': inputs have batches of {batch} and {n}; they "
                        "must agree"
                    )
                batch = n
            if len(shape) != len(dims) or any(d not in (-1, s) for d, s in zip(dims, shape)):
                raise InputError(
                    f"model '{self.name}': input '{name}' has shape {list(x.shape)}; the model "
                    f"takes {self._full_shape(dims)} (-1: any size)"
                )
        return batch or 1

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run checked ``feeds`` on a free execution context (waits for one)."""
        return self.infer_batch([feeds])[0]

    def infer_batch(self, requests: list[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Run checked requests (the same inputs, shapes alike but for the batch) as one batch:
        their rows joined, padded up to the next graph batch size, and the outputs split back.
        On a GPU the rows are joined in page-locked memory, which the upload reads at full
        speed; the buffer is the calling thread's own, reused by its next batch."""
        if not self._pinned and any(_on_device(r) for r in requests):
            # (a host engine given tensors in CUDA shared memory reads them on the host)
            requests = [{n: cuda_shm.host(x) for n, x in r.items()} for r in requests]
        if self.max_batch_size <= 0:  # (no batch dimension: one request, as it is)
            return [self._run(dict(r)) for r in requests]
        rows = [next(iter(r.values())).shape[0] for r in requests]
        total = sum(rows)
        size = next((b for b in self.graph_batches if b >= total), total)
        if _on_device(requests[0]):  # (tensors in CUDA shared memory: joined on the GPU)
            if len(requests) == 1 and size == total:
                return [self._run(dict(requests[0]))]
            return split_rows(self._run(_joined_on_device(requests, size - total)), rows)
        # (one request, no padding: its own arrays go to the engine, on a GPU where they lie
        # in page-locked memory already, a request received into the pinned pool; others are
        # joined in the staging buffer there, which the upload reads asynchronously)
        if len(requests) == 1 and size == total and (not self._pinned or _page_locked(requests[0])):
            return [self._run(dict(requests[0]))]
        feeds = {}
        for name, first in requests[0].items():
            buf = self._staging(name, first.dtype, first.shape[1:])[:size]
            np.concatenate([r[name] for r in requests], axis=0, out=buf[:total])
            buf[total:] = 0
            feeds[name] = buf
        return split_rows(self._run(feeds), rows)

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ctx = self._contexts.get()
        try:
            out = ctx.infer(feeds)
        finally:
            self._contexts.put(ctx)
        # (outputs stay on the GPU where the inputs came from it: CUDA shared memory)
        return {
            n: out[n] if hasattr(out[n], "is_cuda") else np.asarray(out[n]) for n in self.outputs
        }

    def _staging(self, name: str, dtype: np.dtype, inner: tuple[int, ...]) -> np.ndarray:
        """This thread's buffer of max_batch_size rows for input ``name``."""
        held = getattr(self._local, "buffers", None)
        if held is None:
            held = self._local.buffers = {}
        key = (name, dtype.str, inner)
        buf = held.get(key)
        if buf is None:
            shape = (self.max_batch_size, *inner)
            if self._pinned:
                import torch  # lazy: torch is optional (only a GPU engine pins, and has it)

                nbytes = math.prod(shape) * dtype.itemsize
                raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
                buf = raw.view(dtype).reshape(shape)
            else:
                buf = np.empty(shape, dtype)
            held[key] = buf
        return buf


def _on_device(feeds: Mapping[str, Any]) -> bool:
    """Whether ``feeds`` are GPU tensors (a request whose inputs are in CUDA shared memory; a
    request is all one kind, as the batcher keys requests by their dtypes)."""
    return any(not isinstance(x, np.ndarray) for x in feeds.values())


def _joined_on_device(requests: list[Mapping[str, Any]], padding: int) -> dict[str, Any]:
    """The requests' rows joined on the GPU (any on the host moved there), ``padding`` zero
    rows after them."""
    import torch  # lazy: torch is optional (tensors on a GPU come with it)

    first = next(x for x in requests[0].values() if not isinstance(x, np.ndarray))
    feeds = {}
    for name in requests[0]:
        parts = [torch.as_tensor(r[name], device=first.device) for r in requests]
        if padding:
            parts.append(parts[0].new_zeros((padding, *parts[0].shape[1:])))
        feeds[name] = torch.cat(parts)
    return feeds


def _page_locked(feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether every array of ``feeds`` lies, C-ordered, in page-locked memory."""
    from tensorkiln.kernels.cuda.convert import page_locked_bytes  # lazy: torch (cuda tree)

    return all(page_locked_bytes(a) is not None for a in feeds.values())


# Triton's default --pinned-memory-pool-byte-size
PINNED_POOL_BYTES = 256 << 20


class PinnedPool:
    """Page-locked buffers, at most ``limit`` bytes of them in use at once (Triton's pinned
    memory pool). The blocks come from torch's caching host allocator, which keeps a freed one
    for the next request of its size; a buffer counts against the limit until the array and
    the last view of it are gone."""

    def __init__(self, limit: int = PINNED_POOL_BYTES) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray | None:
        """A uint8 array of ``size`` bytes in page-locked memory, or None when the pool's
        limit would be passed (or the memory cannot be had)."""
        with self._lock:
            if self.used + size > self.limit:
                return None
            self.used += size
        try:
            import torch  # lazy: torch is optional (only a GPU engine pins, and has it)

            t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except Exception:  # (page-locked memory refused: the caller takes pageable memory)
            self._give(size)
            return None
        array = t.numpy()  # (holds the memory; the tensor object itself may go)
        weakref.finalize(array, self._give, size)  # (views of the array hold it)
        return array

    def _give(self, size: int) -> None:
        with self._lock:
            self.used -= size


def _graph_batches(config: Any) -> tuple[int, ...]:
    """The batch sizes CUDA graphs are captured for (empty: a model without a batch dimension,
    whose graphs are captured per input shape as requests come)."""
    most = config.max_batch_size
    if most <= 0:
        return ()
    given = {g.batch_size for g in config.optimization.cuda.graph_spec if 0 < g.batch_size <= most}
    if given:
        return tuple(sorted(given | {most}))
    sizes, b = {most}, 1
    while b < most:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


def _tensor_info(t: Any) -> tuple[str, tuple[int, ...]]:
    return protocol.config_type_name(t.data_type), tuple(int(d) for d in t.dims)


def complete_config(config: Any, engine: Engine, where: str) -> None:
    """Fill the inputs and outputs ``config`` leaves out from ``engine``; check those it gives."""
    batched = config.max_batch_size > 0
    for kind, specs, listed in (
        ("input", engine.inputs, config.input),
        ("output", engine.outputs, config.output),
    ):
        by_name = {s.name: s for s in specs}
        if not listed:
            for s in specs:
                datatype, dims = _from_spec(s, batched, where)
                listed.add(name=s.name, data_type=protocol.config_type(datatype), dims=dims)
            continue
        for t in listed:
            s = by_name.get(t.name)
            if s is None:
                raise ModelLoadError(
                    f"{where}: the config's {kind} '{t.name}' is not the engine's; its {kind}s "
                    f"are {', '.join(map(repr, by_name))}"
                )
            datatype, dims = _from_spec(s, batched, where)
            given = protocol.config_type_name(t.data_type)
            if given != datatype:
                raise ModelLoadError(
                    f"{where}: {kind} '{t.name}' is {given} in the config and {datatype} in "
                    "the engine"
                )
            if len(t.dims) != len(dims) or any(
                a != b and -1 not in (a, b) for a, b in zip(t.dims, dims)
            ):
                raise ModelLoadError(
                    f"{where}: {kind} '{t.name}' has dims {list(t.dims)} in the config and "
                    f"{dims} in the engine" + (" (batch dimension left out)" if batched else "")
                )
        if kind == "input" and len(listed) != len(specs):
            absent = [s.name for s in specs if s.name not in {t.name for t in listed}]
            raise ModelLoadError(f"{where}: the config lacks the engine's inputs {absent}")


def _from_spec(s: TensorSpec, batched: bool, where: str) -> tuple[str, list[int]]:
    datatype = DATATYPES.get(s.dtype or "")
    if datatype is None:
        raise ModelLoadError(f"{where}: tensor '{s.name}' has type {s.dtype}, not servable")
    if s.shape is None:
        raise ModelLoadError(f"{where}: tensor '{s.name}' has no known rank")
    dims = [d if isinstance(d, int) else -1 for d in s.shape]
    if batched:
        if not dims:
            raise ModelLoadError(
                f"{where}: max_batch_size > 0, but tensor '{s.name}' has no batch dimension"
            )
        dims = dims[1:]
    return datatype, dims


def _built(entry: ModelEntry, version: ModelVersion, backend: str, cache_dir: Any) -> Engine:
    """``version``'s ONNX model as an engine: from the cache where it was built before."""
    digest = hashlib.sha256()
    with open(version.path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    key = f"{digest.hexdigest()[:32]}-{backend}-mb{entry.max_batch_size}-{__version__}"
    cached = Path(cache_dir) / f"{entry.name}-{version.version}-{key}.engine" if cache_dir else None
    if cached is not None and cached.is_file():
        return Engine.load(cached)
    config = BuilderConfig()
    if entry.max_batch_size > 0:
        profile = _batch_profile(version.path, entry.max_batch_size)
        if profile is not None:
            config.add_optimization_profile(profile)
    engine = Builder(backend).build(str(version.path), config, progress=False)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        engine.save(tmp)
        os.replace(tmp, cached)  # (whole or absent: never a half-written engine)
    return engine


def _batch_profile(path: Path, max_batch: int) -> OptimizationProfile | None:
    """A profile spanning batch 1 to ``max_batch`` over every input whose first dimension is
    dynamic and whose other dimensions are fixed (None: no such input)."""
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    profile = OptimizationProfile()
    any_set = False
    for v in model.graph.input:
        if v.name in inits:
            continue
        dims = v.type.tensor_type.shape.dim
        if not dims or dims[0].HasField("dim_value"):
            continue
        rest = [d.dim_value for d in dims[1:]]
        if any(not d.HasField("dim_value") for d in dims[1:]):
            return None
        profile.set_shape(v.name, (1, *rest), (max_batch, *rest), (max_batch, *rest))
        any_set = True
    return profile if any_set else None
