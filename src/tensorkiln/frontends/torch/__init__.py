"""PyTorch modules -> ONNX in memory, for the builder (tensorkiln.torch is the user's side).

Importing this package imports torch; nothing else in tensorkiln's default import path does.
"""

from tensorkiln.frontends.torch.export import TorchExport, export_module

__all__ = ["TorchExport", "export_module"]
