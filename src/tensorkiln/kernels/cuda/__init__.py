"""The cuda backend's kernels: PyTorch for the CUDA layer, Triton for generated kernels.

Kernels follow the registry's convention (inputs positionally, attributes as keywords) on torch
tensors. They are device-agnostic torch code, so the test suite also runs them on CPU tensors;
the Triton kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
Importing this package registers every kernel of its modules (all but the helpers below); it
needs torch.
"""

from __future__ import annotations

import importlib
import pkgutil

_HELPERS = {"convert", "host"}

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name not in _HELPERS and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
