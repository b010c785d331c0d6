"""tensorkiln: an open deep-learning inference optimizer and runtime.

import tensorkiln
outputs = tensorkiln.run_onnx("model.onnx", {"input": x})
"""

from tensorkiln.errors import (
    GraphError,
    InputError,
    KernelError,
    ModelLoadError,
    ShapeInferenceError,
    TensorkilnError,
    UnsupportedOpError,
)
from tensorkiln.frontends.onnx import import_onnx
from tensorkiln.plugin import TensorDesc, plugin
from tensorkiln.runtime import Runner, run_onnx
from tensorkiln.version import __version__

__all__ = [
    "GraphError",
    "InputError",
    "KernelError",
    "ModelLoadError",
    "Runner",
    "ShapeInferenceError",
    "TensorDesc",
    "TensorkilnError",
    "UnsupportedOpError",
    "__version__",
    "import_onnx",
    "plugin",
    "run_onnx",
]
