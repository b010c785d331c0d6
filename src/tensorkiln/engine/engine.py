"""The Engine: an optimized graph bound to a backend, with its profiles, layers and memory plan.

An engine is built once (:class:`tensorkiln.builder.Builder`), saved to one file, loaded many times,
and runs through execution contexts (:meth:`Engine.create_execution_context`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from tensorkiln.backends import NAMES as BACKENDS
from tensorkiln.backends import Backend, check_target, device_of, for_target, target_of
from tensorkiln.engine import format as fmt
from tensorkiln.engine.memory import max_profile_symbols, plan_memory
from tensorkiln.engine.profile import OptimizationProfile
from tensorkiln.engine.schema import printable
from tensorkiln.engine.serialize import graph_from_json, graph_to_json
from tensorkiln.errors import EngineCompatibilityError, EngineFormatError, TensorkilnError
from tensorkiln.ir import Graph, TensorType
from tensorkiln.ir.verify import verify
from tensorkiln.ops import records as ops
from tensorkiln.runtime.context import ExecutionContext
from tensorkiln.runtime.executor import check_supported
from tensorkiln.version import __version__

__all__ = ["Engine", "TensorSpec", "read_plan", "read_source_model", "target_of"]

SOURCE_KEY = "source/model.onnx"  # the tensor holding an embedded source model


@dataclass(frozen=True)
class TensorSpec:
    """An engine input or output: name, dtype, shape (str dims are dynamic), profile ranges."""

    name: str
    dtype: str | None
    shape: tuple[int | str, ...] | None
    is_input: bool
    ranges: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()

    def __str__(self) -> str:
        shape = "?" if self.shape is None else "x".join(str(d) for d in self.shape)
        return f"{'input ' if self.is_input else 'output'} {self.name}: {self.dtype} [{shape}]"


class Engine:
    """A built model. Create with a Builder or :meth:`load`; run with execution contexts."""

    def __init__(
        self,
        graph: Graph,
        *,
        backend: str,
        profiles: list[OptimizationProfile] | None = None,
        layers: list[dict] | None = None,
        memory: dict | None = None,
        source: dict | None = None,
        source_model: bytes | None = None,
        build: dict | None = None,
        target: dict | None = None,
    ) -> None:
        self.graph = graph
        self.backend = backend
        self.profiles = list(profiles or [])
        self.layers = list(layers or [])
        self.memory = dict(memory or {})
        self.source = dict(source or {})
        self.source_model = source_model
        self.build = dict(build or {})
        self.target = dict(target or target_of(backend))
        # the torch device a cuda engine runs on ('cpu' runs its kernels on torch CPU tensors)
        self.device = device_of(backend, self.target)
        self.tensorkiln_version = __version__
        # the initializers on the device, uploaded by the first context and shared by all of them
        # (per device: {str(torch device): {value: tensor}})
        self.device_weights: dict[str, dict[Any, Any]] = {}
        # the cpu backend's shape-specialized functions, per layer name and input shapes: made
        # by the first context that runs a shape and used by all (the same kernels, so the
        # same numbers, in every context)
        self.cpu_specialized: dict[str, dict[Any, Any]] = {}

    # ------------------------------------------------------------------ description
    @cached_property
    def runtime_backend(self) -> Backend:
        """The Backend object that runs this engine (``backend`` is its name)."""
        return for_target(self.backend, self.target)

    @property
    def inputs(self) -> list[TensorSpec]:
        return [self._spec(v, True) for v in self.graph.inputs]

    @property
    def outputs(self) -> list[TensorSpec]:
        return [self._spec(v, False) for v in self.graph.outputs]

    def _spec(self, v: Any, is_input: bool) -> TensorSpec:
        t = v.type
        dtype = t.dtype.name if isinstance(t, TensorType) and t.dtype is not None else None
        shape = tuple(t.shape) if isinstance(t, TensorType) and t.shape is not None else None
        ranges = (
            tuple(p.shapes[v.name] for p in self.profiles if v.name in p.shapes) if is_input else ()
        )
        return TensorSpec(v.name, dtype, shape, is_input, ranges)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the engine's weights (initializers, subgraphs' included) as stored."""

        def total(g: Graph) -> int:
            n = sum(int(getattr(v.const, "nbytes", 0)) for v in g.initializers)
            return n + sum(total(sub) for node in g.nodes for sub in node.subgraphs())

        return total(self.graph)

    @property
    def num_layers(self) -> int:
        return len(self.graph.nodes)

    def create_execution_context(
        self,
        profile_index: int = 0,
        *,
        use_cuda_graph: bool = False,
        compile: bool | None = None,
    ) -> Any:
        """A context with its own activation memory; several may run at once from threads.

        ``use_cuda_graph`` (cuda engines): capture the whole engine as a CUDA graph per input
        shape and replay it. ``compile`` (cpu engines; default: TENSORKILN_CPU_COMPILE=1 in
        the environment): run the engine through torch.compile, compiled at the first run per
        input shape (runtime/cpu_compile.py).
        """
        return ExecutionContext(self, profile_index, use_cuda_graph=use_cuda_graph, compile=compile)

    # ------------------------------------------------------------------ files
    def _plan(self) -> tuple[dict, dict[str, np.ndarray]]:
        graph_json, tensors, _ = graph_to_json(self.graph)
        if self.source_model is not None:
            tensors[SOURCE_KEY] = np.frombuffer(self.source_model, dtype=np.uint8)
        plan = {
            "format_version": fmt.FORMAT_VERSION,
            "tensorkiln_version": self.tensorkiln_version,
            "backend": self.backend,
            "target": self.target,
            "io": {
                "inputs": [_spec_json(s) for s in self.inputs],
                "outputs": [_spec_json(s) for s in self.outputs],
            },
            "profiles": [p.to_json() for p in self.profiles],
            "layers": self.layers,
            "memory": self.memory,
            "source": self._source_json(),
            "build": self.build,
            "graph": graph_json,
        }
        plugins = used_plugins(self.graph)
        if plugins:
            plan["plugins"] = plugins
        return plan, tensors

    def _source_json(self) -> dict:
        source = {**self.source, "embedded": self.source_model is not None}
        if self.source_model is not None:  # what the loader checks the embedded bytes against
            source["sha256"] = hashlib.sha256(self.source_model).hexdigest()
        return source

    def serialize(self) -> bytes:
        plan, tensors = self._plan()
        return fmt.encode(plan, tensors)

    def save(self, path: str | os.PathLike) -> None:
        """Write the engine to one file (weights in safetensors, plan as JSON; no pickle)."""
        plan, tensors = self._plan()
        fmt.write(path, plan, tensors)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Engine:
        """Read and validate an engine file; raises EngineFormatError / EngineCompatibilityError."""
        path = Path(path)
        plan, tensors = fmt.read(path)
        return _from_plan(plan, tensors, f"'{path}'")

    @classmethod
    def deserialize(cls, data: bytes) -> Engine:
        plan, tensors = fmt.decode(data)
        return _from_plan(plan, tensors, "engine")

    def __repr__(self) -> str:
        return f"Engine({self.graph.name!r}, backend={self.backend!r}, {self.num_layers} layers)"


def read_plan(path: str | os.PathLike) -> dict:
    """An engine file's plan, after the container checks but without the compatibility checks.

    For inspecting engines built for another device or version.
    """
    plan, _ = fmt.read(path)
    return plan


def read_source_model(path: str | os.PathLike) -> bytes | None:
    """The ONNX model embedded in an engine (``embed_source``), or None; no compatibility checks."""
    plan, tensors = fmt.read(path)
    return _source_model(plan, tensors, f"'{path}'")


def _source_model(plan: dict, tensors: dict[str, np.ndarray], where: str) -> bytes | None:
    """Take the embedded source model out of ``tensors``, checked against the plan's record."""
    arr = tensors.pop(SOURCE_KEY, None)
    source = plan.get("source")
    embedded = isinstance(source, dict) and source.get("embedded") is True
    if embedded != (arr is not None):
        raise EngineFormatError(
            f"{where}: the plan says the source model is {'' if embedded else 'not '}embedded, "
            f"but the weights {'lack' if arr is None else 'hold'} it"
        )
    if arr is None:
        return None
    data = arr.tobytes()
    if hashlib.sha256(data).hexdigest() != source.get("sha256"):
        raise EngineFormatError(
            f"{where}: the embedded source model does not match the sha256 the plan records"
        )
    return data


def _spec_json(s: TensorSpec) -> dict:
    return {"name": s.name, "dtype": s.dtype, "shape": None if s.shape is None else list(s.shape)}


def _rebuild_hint(plan: dict, where: str) -> str:
    src = plan["source"]
    if src.get("embedded"):
        path = where.strip("'") if where.startswith("'") else "ENGINE_FILE"
        return f"Rebuild it here with `tensorkiln build --from-engine {path} -o NEW.engine`."
    name = printable(src.get("name") or "model.onnx")
    return f"Rebuild it from its model with `tensorkiln build {name} -o NEW.engine`."


def _check_compatible(plan: dict, where: str) -> str:
    """The plan's types were checked on reading (engine/schema.py); here, its values."""
    # The header's version was checked already; the plan's copy must agree with it.
    fv = plan["format_version"]
    if fv != fmt.FORMAT_VERSION:
        raise EngineFormatError(
            f"{where}: the plan's format version {fv} does not match the file's "
            f"{fmt.FORMAT_VERSION}"
        )
    version, backend, target = plan["tensorkiln_version"], plan["backend"], plan["target"]
    if backend not in BACKENDS:
        raise EngineFormatError(f"{where}: unknown backend {printable(repr(backend))} in the plan")
    hint = _rebuild_hint(plan, where)
    if version != __version__:
        raise EngineCompatibilityError(
            f"{where} was built by tensorkiln {printable(version)!r}; this is tensorkiln "
            f"{__version__}. {hint}"
        )
    check_target(backend, target, where, hint, show=lambda v: printable(repr(v)))
    return backend


def _from_plan(plan: dict, tensors: dict[str, np.ndarray], where: str) -> Engine:
    backend = _check_compatible(plan, where)
    _check_plugins(plan.get("plugins", []), where)
    source_model = _source_model(plan, tensors, where)
    try:
        graph, _ = graph_from_json(plan["graph"], tensors, plan["build"].get("precision", "fp32"))
        verify(graph)
        engine = Engine(
            graph,
            backend=backend,
            profiles=_profiles(plan, where),
            layers=plan["layers"],
            memory=plan["memory"],
            source=plan["source"],
            source_model=source_model,
            build=plan["build"],
            target=plan["target"],
        )
        _check_io(engine, plan, where)
        _check_memory(engine, where)
        check_supported(graph, backend)
    except (EngineFormatError, EngineCompatibilityError):
        raise
    except TensorkilnError as exc:
        raise EngineFormatError(f"{where}: the engine's graph is invalid: {exc}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError) as exc:
        raise EngineFormatError(
            f"{where}: the plan is damaged ({type(exc).__name__}: {exc})"
        ) from None
    return engine


def used_plugins(graph: Graph) -> list[dict[str, str]]:
    """The plugins (custom ops registered with tensorkiln.plugin) ``graph`` uses: name and
    version, what an engine records of them (never their code)."""
    found = {}
    for _, node in graph.walk():
        rec = ops.get(node.op, node.domain)
        if rec is not None and rec.plugin_version is not None:
            found[f"{node.domain}::{node.op}"] = rec.plugin_version
    return [{"name": k, "version": v} for k, v in sorted(found.items())]


def _check_plugins(plugins: list[dict], where: str) -> None:
    """Every plugin the engine was built with is registered here, at the same version."""
    for entry in plugins:
        name, version = entry["name"], entry["version"]
        domain, _, op = name.partition("::")
        rec = ops.get(op, domain) if op else None
        have = None if rec is None else rec.plugin_version
        if have is None and version == "torch":  # (tensorkiln.torch's wrapped custom ops)
            raise EngineCompatibilityError(
                f"{where} runs the PyTorch custom op '{name}', which is not registered: import "
                "the module that defines it (torch.library), then load with "
                "tensorkiln.torch.load"
            )
        if have is None:
            raise EngineCompatibilityError(
                f"{where} uses plugin '{name}' (version {version}), which is not registered: "
                f"import the module that registers it (@tensorkiln.plugin('{name}', "
                f"version='{version}')) before loading the engine; on the command line, "
                "--plugins MODULE"
            )
        if have != version:
            raise EngineCompatibilityError(
                f"{where} was built with plugin '{name}' version {version}; this process has "
                f"version {have}: register version {version}, or rebuild the engine"
            )


def _profiles(plan: dict, where: str) -> list:
    try:
        return [OptimizationProfile.from_json(p) for p in plan["profiles"]]
    except TensorkilnError as exc:  # ranks that differ, min > opt or opt > max
        raise EngineFormatError(
            f"{where}: an optimization profile in the plan is damaged ({exc})"
        ) from None


def _check_memory(engine: Engine, where: str) -> None:
    """The memory plan must be the one the graph needs at the profiles' largest shapes.

    A cuda context reserves device memory from this plan before its first run, so a plan is
    never taken on trust: it is planned again from the graph (planning is deterministic, and an
    engine only loads in the tensorkiln version that built it) and must come out the same. An
    empty plan (an engine made without the builder) reserves nothing.
    """
    if not engine.memory:
        return
    # (the builder's planner and its choice of symbol sizes, reused rather than copied)
    expected = plan_memory(
        engine.graph, max_profile_symbols(engine.graph, engine.profiles)
    ).to_json()
    if engine.memory == expected:
        return
    got = engine.memory
    differs = next((k for k in expected if got.get(k) != expected[k]), None) or next(
        k for k in got if k not in expected
    )
    raise EngineFormatError(
        f"{where}: the plan's activation memory plan does not match its graph (its "
        f"{printable(repr(differs))} differs: the plan asks for a peak of "
        f"{printable(repr(got.get('peak_bytes')))} bytes, the graph needs {expected['peak_bytes']:,} "
        "at the profiles' largest shapes); refusing to reserve memory from it. Rebuild the engine."
    )


def _check_io(engine: Engine, plan: dict, where: str) -> None:
    """The plan's description of the engine (IO, layers, profiles) must agree with its graph:
    tools such as `tensorkiln inspect` show the plan, the runtime runs the graph."""
    for kind, specs in (("inputs", engine.inputs), ("outputs", engine.outputs)):
        declared = plan["io"][kind]
        if [d["name"] for d in declared] != [s.name for s in specs]:
            raise EngineFormatError(f"{where}: the plan's {kind} do not match its graph")
        for d, s in zip(declared, specs):
            if d != _spec_json(s):
                raise EngineFormatError(
                    f"{where}: {kind[:-1]} {printable(repr(s.name))} is declared "
                    f"{printable(repr(d))} in the plan but the graph has {printable(repr(_spec_json(s)))}"
                )
    if len(engine.layers) != len(engine.graph.nodes):
        raise EngineFormatError(
            f"{where}: the plan lists {len(engine.layers)} layers for {len(engine.graph.nodes)} nodes"
        )
    for i, (layer, node) in enumerate(zip(engine.layers, engine.graph.nodes)):
        _check_layer(i, layer, node, where)
    names = {v.name for v in engine.graph.inputs}
    for p in engine.profiles:
        unknown = set(p.shapes) - names
        if unknown:
            raise EngineFormatError(
                f"{where}: a profile names unknown inputs {printable(repr(sorted(unknown)))}"
            )


def _check_layer(i: int, layer: dict, node: Any, where: str) -> None:
    """A layer's record names its node: the same name, op, inputs and outputs, where given."""
    facts = {
        "name": node.name,
        "op": f"{node.domain}.{node.op}" if node.domain else node.op,
        "inputs": [v.name if v is not None else "" for v in node.inputs],
        "outputs": [v.name if v is not None else "" for v in node.outputs],
        "compute_precision": node.precision,
        "format": node.format,
    }
    for key, fact in facts.items():
        if key in layer and layer[key] != fact:
            raise EngineFormatError(
                f"{where}: layer {i} of the plan gives {key} {printable(repr(layer[key]))}, but "
                f"its node has {printable(repr(fact))}"
            )
