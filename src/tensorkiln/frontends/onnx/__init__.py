"""The ONNX frontend: read a model file and turn it into the tensorkiln IR."""

from __future__ import annotations

import os

import onnx

from tensorkiln.errors import GraphError, ModelLoadError
from tensorkiln.frontends.onnx.functions import expand_functions
from tensorkiln.frontends.onnx.importer import convert_model, tensor_to_array
from tensorkiln.frontends.onnx.loader import ModelSource, load_model_proto, open_model
from tensorkiln.ir import Graph
from tensorkiln.ir.verify import verify
from tensorkiln.kernels.evaluate import infer_shapes

__all__ = ["import_onnx", "load_model_proto", "open_model", "tensor_to_array"]


def import_onnx(
    source: ModelSource, base_dir: str | os.PathLike | None = None, *, backend: str = "reference"
) -> Graph:
    """Read an ONNX model (path, bytes or ModelProto) into a verified, shape-inferred IR Graph.

    Model-local functions are inlined, and standard ops that ``backend`` has no kernel for but ONNX
    defines as a function of other ops are expanded into that function's body.
    """
    model, external = open_model(source, base_dir)  # external data stays mapped, not copied
    _check_opsets(model)
    model = expand_functions(model, backend)
    graph = convert_model(model, external)
    infer_shapes(graph)
    verify(graph)
    return graph


def _check_opsets(model: onnx.ModelProto) -> None:
    newest = onnx.defs.onnx_opset_version()
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and o.version > newest:
            raise ModelLoadError(
                f"the model imports opset {o.version} of the default ONNX domain; this "
                f"installation knows opsets up to {newest}. Upgrade the onnx package or export "
                "the model with an older opset."
            )
        if o.version < 0:
            raise ModelLoadError(f"the model imports a negative opset for domain '{o.domain}'")


# Re-exported so callers can catch import problems without reaching into submodules.
ImportErrors = (ModelLoadError, GraphError)
