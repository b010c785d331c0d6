"""PyTorch in, PyTorch out.

    import tensorkiln.torch
    fast = tensorkiln.torch.compile(model, (x,), precision="fp16")
    y = fast(x)                                   # torch tensors in and out
    tensorkiln.torch.save(fast, "model.tkm")      # a folder: the engine and the call's structure
    fast = tensorkiln.torch.load("model.tkm")

``compile`` exports the module with torch.export (dynamic dimensions declared the torch.export
way, ``torch.export.Dim('batch', min=1, max=64)``, become the engine's optimization profile),
builds an engine and returns a :class:`CompiledModule`; a module that cannot be one engine (an
op with no translation, a build that fails) becomes a :class:`PartialModule`: engines for the
blocks tensorkiln supports, PyTorch for the rest, and a warning saying why. Importing this module needs torch (and
onnxscript, which torch's ONNX exporter uses).
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("onnxscript") is None:
    raise ImportError(
        "tensorkiln.torch needs PyTorch and onnxscript (torch's ONNX exporter uses it): "
        "pip install 'tensorkiln[torch]'"
    )

from tensorkiln.torch.dynamo import backend, last_report
from tensorkiln.torch.files import load, save
from tensorkiln.torch.module import CompiledModule
from tensorkiln.torch.partial import PartialModule, compile

__all__ = ["CompiledModule", "PartialModule", "backend", "compile", "last_report", "load", "save"]


def _register_backend() -> None:
    """``torch.compile(backend="tensorkiln")``: an installed package declares the backend as an
    entry point (torch loads it when asked); a source tree registers it here."""
    from importlib.metadata import entry_points

    import torch

    if entry_points(group="torch_dynamo_backends", name="tensorkiln"):
        return  # (registering too would make torch's own lookup refuse a duplicate)
    if "tensorkiln" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(backend, name="tensorkiln")


_register_backend()
