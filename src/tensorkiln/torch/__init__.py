"""PyTorch in, PyTorch out.

    import tensorkiln.torch
    fast = tensorkiln.torch.compile(model, (x,), precision="fp16")
    y = fast(x)                                   # torch tensors in and out
    tensorkiln.torch.save(fast, "model.tkm")      # a folder: the engine and the call's structure
    fast = tensorkiln.torch.load("model.tkm")

``compile`` exports the module with torch.export (dynamic dimensions declared the torch.export
way, ``torch.export.Dim('batch', min=1, max=64)``, become the engine's optimization profile),
builds an engine and returns a :class:`CompiledModule`. Importing this module needs torch (and
onnxscript, which torch's ONNX exporter uses).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.engine import Engine
from tensorkiln.engine.profile import OptimizationProfile
from tensorkiln.errors import InputError, ModelLoadError
from tensorkiln.frontends.torch.export import TorchExport, export_module, flatten_inputs
from tensorkiln.torch.module import CompiledModule

__all__ = ["CompiledModule", "compile", "load", "save"]

SAVE_FORMAT = "tensorkiln.torch/1"
ENGINE_FILE = "model.engine"
MODULE_FILE = "module.json"
_MAX_MODULE_JSON = 16 << 20  # a module.json over 16 MiB is not one this code wrote


def compile(
    module: torch.nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: dict | None = None,
    dynamic_shapes: Any = None,
    precision: str | Iterable[str] = "fp32",
    backend: str = "auto",
    calibration_data: Iterable[Any] | None = None,
    config: BuilderConfig | None = None,
    use_cuda_graph: bool | None = None,
    progress: bool = False,
) -> CompiledModule:
    """Build a tensorkiln engine for ``module(*example_inputs, **example_kwargs)``.

    ``precision``: the precisions the builder may use ("fp32", "tf32", "fp16", "bf16", "int8",
    "fp8"), one or several. ``backend``: "cuda", "cpu", "reference", or "auto" (cuda when the
    example tensors are on a GPU, else cpu). ``calibration_data`` (int8/fp8): batches shaped like
    ``example_inputs`` (tuples of tensors, or single tensors). ``config``: a BuilderConfig for
    everything else (its precisions and profiles are added to). ``use_cuda_graph``: replay each
    input shape as a CUDA graph (default on the GPU).
    """
    args = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    exported = export_module(module, tuple(args), example_kwargs, dynamic_shapes)
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


# ---------------------------------------------------------------------- files
def save(module: CompiledModule, path: str | os.PathLike) -> None:
    """Write ``module`` to the folder ``path``: its engine file and a JSON file of the call's
    structure (no pickle: loading runs no code from the folder)."""
    if not isinstance(module, CompiledModule):
        raise InputError(
            f"save takes a tensorkiln.torch.CompiledModule, got {type(module).__name__}"
        )
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        in_spec, out_spec = (
            pytree.treespec_dumps(module.in_spec),
            pytree.treespec_dumps(module.out_spec),
        )
    except Exception as err:  # a pytree node type registered without a serialized name
        raise InputError(
            f"{module.name}'s inputs or outputs hold a type torch cannot write as JSON: {err}"
        ) from err
    meta = {
        "format": SAVE_FORMAT,
        "name": module.name,
        "in_spec": in_spec,
        "out_spec": out_spec,
        "leaves": list(module.leaves),
        "constants": [_constant_json(c) for c in module.constants],
        "engine": ENGINE_FILE,
    }
    module.engine.save(folder / ENGINE_FILE)
    (folder / MODULE_FILE).write_text(json.dumps(meta, indent=1))


def _constant_json(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise InputError(
        f"a compiled-in argument of type {type(value).__name__} cannot be saved; pass it as a "
        "tensor or leave it out of the call"
    )


def load(path: str | os.PathLike, *, use_cuda_graph: bool | None = None) -> CompiledModule:
    """Read a folder :func:`save` wrote; the engine is checked as ``Engine.load`` checks it (format,
    checksum, device)."""
    folder = Path(path)
    meta_path = folder / MODULE_FILE
    if not meta_path.is_file():
        raise ModelLoadError(f"'{folder}' is not a saved tensorkiln.torch module: no {MODULE_FILE}")
    if meta_path.stat().st_size > _MAX_MODULE_JSON:
        raise ModelLoadError(f"'{meta_path}' is larger than any module file tensorkiln writes")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"'{meta_path}' is not valid JSON: {err}") from err
    _check_meta(meta, meta_path)
    try:
        in_spec = pytree.treespec_loads(meta["in_spec"])
        out_spec = pytree.treespec_loads(meta["out_spec"])
    except Exception as err:  # malformed, or a type not registered in this process
        raise ModelLoadError(
            f"'{meta_path}': cannot read the input/output structure: {err}"
        ) from err
    engine = Engine.load(folder / ENGINE_FILE)  # (the name is ours, never the file's)
    _check_leaves(meta, engine, in_spec, meta_path)
    return CompiledModule(
        engine,
        in_spec=in_spec,
        out_spec=out_spec,
        leaves=meta["leaves"],
        constants=meta["constants"],
        name=meta["name"],
        use_cuda_graph=use_cuda_graph,
    )


def _check_meta(meta: Any, where: Path) -> None:
    if not isinstance(meta, dict) or meta.get("format") != SAVE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ModelLoadError(f"'{where}': format {found!r}, expected {SAVE_FORMAT!r}")
    kinds = {"name": str, "in_spec": str, "out_spec": str, "leaves": list, "constants": list}
    for key, kind in kinds.items():
        if not isinstance(meta.get(key), kind):
            raise ModelLoadError(f"'{where}': '{key}' is missing or not a {kind.__name__}")
    if not all(n is None or isinstance(n, str) for n in meta["leaves"]):
        raise ModelLoadError(f"'{where}': 'leaves' holds something other than input names")
    simple = (type(None), bool, int, float, str)
    if not all(isinstance(c, simple) for c in meta["constants"]):
        raise ModelLoadError(f"'{where}': 'constants' holds something other than plain values")


def _check_leaves(meta: dict, engine: Engine, in_spec: pytree.TreeSpec, where: Path) -> None:
    leaves, constants = meta["leaves"], meta["constants"]
    names = sorted(n for n in leaves if n is not None)
    if len(leaves) != in_spec.num_leaves or len(constants) != len(leaves):
        raise ModelLoadError(f"'{where}': {len(leaves)} inputs for a call of {in_spec.num_leaves}")
    if names != sorted(s.name for s in engine.inputs):
        raise ModelLoadError(
            f"'{where}': inputs {names} do not match the engine's "
            f"{sorted(s.name for s in engine.inputs)}"
        )
