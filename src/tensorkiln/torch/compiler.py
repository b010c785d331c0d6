"""A PyTorch module in, a CompiledModule running its one engine out (tensorkiln.torch.compile's
whole-module path; partial.py falls back to blocks where this fails)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.engine import Engine
from tensorkiln.engine.profile import OptimizationProfile
from tensorkiln.frontends.torch.export import TorchExport, export_module, flatten_inputs
from tensorkiln.torch import torch_ops
from tensorkiln.torch.module import CompiledModule


@dataclass(frozen=True)
class BuildOptions:
    """How tensorkiln.torch builds an engine (tensorkiln.torch.compile documents each)."""

    precision: str | Iterable[str] = "fp32"
    backend: str = "auto"
    calibration_data: Iterable[Any] | None = None
    config: BuilderConfig | None = None
    use_cuda_graph: bool | None = None
    torch_ops: bool = True  # custom ops nothing translates run in PyTorch inside the engine
    progress: bool = False


def compile_whole(
    module: torch.nn.Module | torch.export.ExportedProgram,
    example_inputs: Any,
    example_kwargs: dict | None = None,
    dynamic_shapes: Any = None,
    options: BuildOptions = BuildOptions(),
) -> CompiledModule:
    """One tensorkiln engine for ``module(*example_inputs, **example_kwargs)``; raises where
    the module cannot be one."""
    args = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    exported = export_module(
        module, tuple(args), example_kwargs, dynamic_shapes,
        untranslated=torch_ops.wrap if options.torch_ops else None,
    )  # fmt: skip
    backend, device = _target(options.backend, args, example_kwargs)
    cfg = _config(options.config, options.precision, exported)
    if options.calibration_data is not None:
        cfg.calibration_data = _calibration_feeds(options.calibration_data, exported)
    engine = Builder(backend, device).build(
        exported.model, cfg, progress=options.progress, source_name=exported.name
    )
    return _wrap(engine, exported, options.use_cuda_graph)


def _wrap(engine: Engine, exported: TorchExport, use_cuda_graph: bool | None) -> CompiledModule:
    return CompiledModule(
        engine,
        in_spec=exported.in_spec,
        out_spec=exported.out_spec,
        leaves=exported.leaves,
        constants=exported.constants,
        name=exported.name,
        use_cuda_graph=use_cuda_graph,
    )


def _target(backend: str, args: tuple, kwargs: dict | None) -> tuple[str, str | None]:
    """The backend ("auto": cuda where the example tensors are on a GPU, else cpu) and, for
    cuda, its device: "cpu" where every example tensor is on the CPU (its kernels on torch CPU
    tensors, as the tests run them), else the default."""
    values, _ = flatten_inputs(args, kwargs or {})
    devices = {v.device.type for v in values if isinstance(v, torch.Tensor)}
    if backend == "auto":
        backend = "cuda" if "cuda" in devices else "cpu"
    device = "cpu" if backend == "cuda" and devices == {"cpu"} else None
    return backend, device


def _config(config: BuilderConfig | None, precision: Any, exported: TorchExport) -> BuilderConfig:
    """The caller's config (a copy: its precisions and profiles are added to, and the caller's
    own is left as it was, for the next compile) with the module's profile and I/O types."""
    if config is None:
        cfg = BuilderConfig()
    else:
        cfg = replace(config, precisions=set(config.precisions), profiles=list(config.profiles))
    for p in [precision] if isinstance(precision, str) else list(precision):
        cfg.set_flag(p)
    if exported.shapes:
        profile = OptimizationProfile()
        for name, (lo, opt, hi) in exported.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        cfg.add_optimization_profile(profile)
    # the engine takes and gives the types PyTorch does: no casts at its edges
    cfg.input_io_formats = list(exported.input_formats)
    cfg.output_io_formats = list(exported.output_formats)
    return cfg


def _calibration_feeds(data: Iterable[Any], exported: TorchExport) -> Iterable[dict]:
    """Calibration batches as the name -> array feeds calibration reads: each a tuple of the
    module's positional arguments (or one tensor), or a dict of its keyword arguments."""
    names = {n for n in exported.leaves if n is not None}
    for batch in data:
        if isinstance(batch, dict):
            pairs = list(batch.items())  # (a tensor keyword is the ONNX input of its name)
        else:
            args = batch if isinstance(batch, tuple | list) else (batch,)
            pairs = list(zip(exported.leaves, flatten_inputs(tuple(args), {})[0]))
        feeds = {}
        for name, value in pairs:
            if name in names and isinstance(value, torch.Tensor):
                value = value.detach().cpu()
                feeds[name] = (value.float() if value.is_floating_point() else value).numpy()
        yield feeds
