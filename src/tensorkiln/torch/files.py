"""Saving and loading a CompiledModule: a folder of its engine file and a JSON file of the call's
structure (pytree specs as JSON; no pickle, so loading runs no code from the folder)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch.utils import _pytree as pytree

from tensorkiln.engine import Engine
from tensorkiln.engine.engine import read_plan
from tensorkiln.errors import InputError, ModelLoadError, TensorkilnError
from tensorkiln.plugin import registered
from tensorkiln.torch.module import TORCH_OPS, CompiledModule
from tensorkiln.torch.torch_ops import wrap_by_name

SAVE_FORMAT = "tensorkiln.torch/1"
ENGINE_FILE = "model.engine"
MODULE_FILE = "module.json"
_MAX_MODULE_JSON = 16 << 20  # a module.json over 16 MiB is not one this code wrote


def save(module: CompiledModule, path: str | os.PathLike) -> None:
    """Write ``module`` to the folder ``path``: its engine file and a JSON file of the call's
    structure (no pickle: loading runs no code from the folder)."""
    if not isinstance(module, CompiledModule):
        partial = getattr(module, "reason", None)
        why = f" (it runs partly in PyTorch: {partial})" if partial else ""
        raise InputError(
            f"save takes a module compiled into one engine (tensorkiln.torch.CompiledModule), "
            f"got {type(module).__name__}{why}; the PyTorch parts of a partially compiled "
            "module are code, which tensorkiln does not write to files"
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
    engine_path = folder / ENGINE_FILE  # (the name is ours, never the file's)
    _wrap_torch_ops(engine_path)
    engine = Engine.load(engine_path)
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


def _wrap_torch_ops(engine_path: Path) -> None:
    """The custom ops the engine runs in PyTorch, wrapped again where torch has them registered
    (a missing one is named when the engine loads)."""
    try:
        plugins = read_plan(engine_path).get("plugins", [])
    except TensorkilnError:
        return  # (Engine.load says what is wrong with the file)
    for entry in plugins if isinstance(plugins, list) else []:
        name = str(entry.get("name")) if isinstance(entry, dict) else ""
        if name and entry.get("version") == TORCH_OPS and registered(name) is None:
            wrap_by_name(name)


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
