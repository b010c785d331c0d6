"""Backends: the seam between the runtime and the kernels (see :class:`Backend`).

``get_backend(name, device)`` makes one; ``reference`` needs numpy only, ``cpu`` and ``cuda``
import PyTorch, an optional dependency, when first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tensorkiln.backends.base import Backend
from tensorkiln.backends.reference import ReferenceBackend
from tensorkiln.errors import EngineCompatibilityError, InputError, TensorkilnError

NAMES = ("reference", "cpu", "cuda")

_TORCH_HINT = (
    "install the CPU build with `pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu`"
)


def torch_available() -> bool:
    """Whether PyTorch (the cpu and cuda backends' optional dependency) imports here."""
    try:
        import torch  # noqa: F401  (lazy: torch is optional)
    except ImportError:
        return False
    return True


def cuda_available() -> bool:
    """Whether PyTorch sees a CUDA device here."""
    if not torch_available():
        return False
    import torch  # lazy: torch is optional

    return torch.cuda.is_available()


def auto_backend() -> str:
    """What 'auto' picks here: cuda on a GPU, else cpu where PyTorch is installed, else the
    reference (numpy)."""
    if cuda_available():
        return "cuda"
    return "cpu" if torch_available() else "reference"


def resolve(name: str, device: str | None = None) -> tuple[str, str | None]:
    """Check a user's choice of backend and device; returns (backend name, device name) with
    'auto' and the default device resolved, or raises InputError saying what to choose."""
    if name not in ("auto", *NAMES):
        raise InputError(f"unknown backend '{name}'; choose auto, reference, cpu or cuda")
    if name == "auto":
        name = auto_backend()
    if name == "cpu" and not torch_available():
        raise InputError(
            f"the cpu backend needs PyTorch, and this Python has none; {_TORCH_HINT}, or use "
            "backend='reference'"
        )
    if name == "cuda" and device in (None, "cuda") and not cuda_available():
        raise InputError(
            "the cuda backend needs PyTorch with a CUDA device, and this machine has none; "
            "use backend='cpu' (PyTorch on the CPU), backend='reference' or 'auto'"
        )
    if device not in (None, "cpu", "cuda") or (name == "cpu" and device == "cuda"):
        raise InputError(f"unknown device '{device}' for the {name} backend")
    return name, {"reference": None, "cpu": "cpu"}.get(name, device or "cuda")


def get_backend(name: str | Backend = "reference", device: Any = None) -> Backend:
    """The backend ``name`` on ``device`` (a torch device or its name; None: the backend's
    default). A Backend passes through. Raises TensorkilnError when it cannot run here."""
    if isinstance(name, Backend):
        return name
    if name == "reference":
        if device not in (None, "cpu"):
            raise TensorkilnError(f"the reference backend runs on the CPU, not on '{device}'")
        return ReferenceBackend()
    if name not in NAMES:
        raise TensorkilnError(f"unknown backend '{name}'; choose reference, cpu or cuda")
    if not torch_available():
        raise TensorkilnError(
            f"the {name} backend needs PyTorch, and this Python has none; {_TORCH_HINT}, or use "
            "the reference backend"
        )
    # lazy: the cpu and cuda backends import torch, an optional dependency
    module = importlib.import_module(f"tensorkiln.backends.{name}")
    return module.make(device)


def device_of(name: str, target: dict[str, Any]) -> str:
    """The device an engine of backend ``name`` bound to ``target`` runs on: 'cuda' for the
    cuda backend on a GPU, else 'cpu' (the reference and cpu backends, and the cuda backend's
    kernels on torch CPU tensors)."""
    on_gpu = name == "cuda" and target.get("torch_device") != "cpu"
    return "cuda" if on_gpu else "cpu"


def for_target(name: str, target: dict[str, Any]) -> Backend:
    """The backend that runs an engine of backend ``name`` recorded for ``target``."""
    return get_backend(name, device_of(name, target))


def target_of(name: str, device: str | None = None) -> dict[str, Any]:
    """What an engine for backend ``name`` on ``device`` is bound to on this machine."""
    return get_backend(name, device).target()


def check_target(
    name: str, target: dict[str, Any], where: str, hint: str, show: Callable[[Any], str] = repr
) -> None:
    """Raise EngineCompatibilityError when this machine cannot run an engine of backend
    ``name`` built for ``target``; ``hint`` says how to rebuild it, ``show`` quotes a value read
    from the file (escaping what a terminal would interpret)."""
    if name == "reference":
        return
    if device_of(name, target) == "cpu":
        if not torch_available():
            raise EngineCompatibilityError(
                f"{where} needs PyTorch, which is not installed; {_TORCH_HINT}, or rebuild the "
                f"engine with --backend reference. {hint}"
            )
        return
    try:
        here = target_of("cuda")
    except Exception:  # no torch or no GPU here
        raise EngineCompatibilityError(
            f"{where} was built for the GPU ({show(target.get('device'))}, compute capability "
            f"{show(target.get('compute_capability'))}); this machine has no usable CUDA device. "
            f"{hint}"
        ) from None
    for key in ("device", "compute_capability"):
        if target.get(key) != here[key]:
            raise EngineCompatibilityError(
                f"{where} was built for {key} {show(target.get(key))}; this machine has "
                f"{here[key]!r}. {hint}"
            )
