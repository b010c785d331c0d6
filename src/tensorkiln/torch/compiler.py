"""A PyTorch module in, a CompiledModule running its one engine out (tensorkiln.torch.compile's
whole-module path; partial.py falls back to blocks where this fails)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.engine import Engine
from tensorkiln.engine.profile import OptimizationProfile
from tensorkiln.frontends.torch.export import TorchExport, export_module, flatten_inputs
from tensorkiln.torch import torch_ops as torch_ops_module
from tensorkiln.torch.module import CompiledModule


def compile_whole(
    module: torch.nn.Module | torch.export.ExportedProgram,
    example_inputs: Any,
    *,
    example_kwargs: dict | None = None,
    dynamic_shapes: Any = None,
    precision: str | Iterable[str] = "fp32",
    backend: str = "auto",
    calibration_data: Iterable[Any] | None = None,
    config: BuilderConfig | None = None,
    use_cuda_graph: bool | None = None,
    torch_ops: bool = True,
    progress: bool = False,
) -> CompiledModule:
    """Build one tensorkiln engine for ``module(*example_inputs, **example_kwargs)``.

    ``precision``: the precisions the builder may use ("fp32", "tf32", "fp16", "bf16", "int8",
    "fp8"), one or several. ``backend``: "cuda", "cpu", "reference", or "auto" (cuda when the
    example tensors are on a GPU, else cpu). ``calibration_data`` (int8/fp8): batches shaped like
    ``example_inputs`` (tuples of tensors, or single tensors). ``config``: a BuilderConfig for
    everything else (its precisions and profiles are added to). ``use_cuda_graph``: replay each
    input shape as a CUDA graph (default on the GPU). ``torch_ops``: custom ops that nothing
    translates run in PyTorch inside the engine (torch_ops.py); False: they fail the build.
    """
    args = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    exported = export_module(
        module, tuple(args), example_kwargs, dynamic_shapes,
        untranslated=torch_ops_module.wrap if torch_ops else None,
    )  # fmt: skip
    backend = _backend(backend, args, example_kwargs)
    cfg = _config(config, precision, exported)
    if calibration_data is not None:
        cfg.calibration_data = _calibration_feeds(calibration_data, exported)
    engine = Builder(backend).build(
        exported.model, cfg, progress=progress, source_name=exported.name
    )
    return _wrap(engine, exported, use_cuda_graph)


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


def _backend(backend: str, args: tuple, kwargs: dict | None) -> str:
    if backend != "auto":
        return backend
    values, _ = flatten_inputs(args, kwargs or {})
    on_gpu = any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values)
    return "cuda" if on_gpu else "cpu"


def _config(config: BuilderConfig | None, precision: Any, exported: TorchExport) -> BuilderConfig:
    cfg = config if config is not None else BuilderConfig()
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
    """Batches shaped like the example inputs, as the name -> array feeds calibration reads."""
    for batch in data:
        args = batch if isinstance(batch, tuple | list) else (batch,)
        values, _ = flatten_inputs(tuple(args), {})
        feeds = {}
        for name, value in zip(exported.leaves, values):
            if name is not None and isinstance(value, torch.Tensor):
                feeds[name] = value.detach().float().cpu().numpy() if value.is_floating_point() \
                    else value.detach().cpu().numpy()  # fmt: skip
        yield feeds
