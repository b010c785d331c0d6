"""tensorkiln.torch.compile: one engine for the whole module where it can be, else engines for
the blocks that can and PyTorch for the rest (Torch-TensorRT's ``require_full_compilation=False``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from tensorkiln.builder import BuilderConfig
from tensorkiln.errors import InputError, TensorkilnError
from tensorkiln.torch.compiler import BuildOptions, compile_whole
from tensorkiln.torch.dynamo import Report, backend, last_report
from tensorkiln.torch.module import CompiledModule


class PartialModule(torch.nn.Module):
    """A module run through ``torch.compile(backend="tensorkiln")``: engines for its supported
    blocks (built at the first call of each input signature), PyTorch for the rest. ``reason``
    says why the module is not one engine; :attr:`report` what runs where."""

    def __init__(self, module: torch.nn.Module, reason: str, options: dict) -> None:
        super().__init__()
        self.module = module
        self.reason = reason
        self.options = dict(options)
        self._compiled = torch.compile(module, backend=backend, options=self.options)

    @property
    def report(self) -> Report | None:
        """What runs where, for the latest input signature built."""
        return last_report()

    def extra_repr(self) -> str:
        return f"partial: {self.reason}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self._compiled(*args, **kwargs)


def compile(
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
    require_full_compilation: bool = False,
    min_block_size: int = 3,
    torch_ops: bool = True,
    progress: bool = False,
) -> CompiledModule | PartialModule:
    """Build ``module(*example_inputs, **example_kwargs)`` into a tensorkiln engine.

    ``module`` may also be a program torch.export captured already. Returns a
    :class:`CompiledModule` (one engine: saved with :func:`tensorkiln.torch.save`), or,
    where the module cannot be one engine (an op with no translation, a failed build) and
    ``require_full_compilation`` is False, a :class:`PartialModule` with a warning saying why.

    ``precision``: the precisions the builder may use ("fp32", "tf32", "fp16", "bf16", "int8",
    "fp8"), one or several. ``dynamic_shapes``: as torch.export takes it; each dynamic dimension
    needs a maximum (``torch.export.Dim('batch', min=1, max=64)``), which with the Dim's minimum
    and the example's size makes the engine's optimization profile. ``backend``: "cuda", "cpu",
    "reference", or "auto" (cuda when the example tensors are on a GPU, else cpu).
    ``calibration_data`` (int8/fp8): batches, each a tuple of positional arguments (or one
    tensor) or a dict of keyword arguments, as the module takes them. ``config``: a
    BuilderConfig for everything else. ``use_cuda_graph``: replay each input shape as a CUDA
    graph (default on the GPU). ``min_block_size``: the fewest ops a block built into an engine
    has, where the module falls back to blocks. ``torch_ops``: a custom op that nothing
    translates runs in PyTorch inside the engine, which stays one engine (a warning names it);
    False: such an op makes the module partial, or an error with ``require_full_compilation``.
    """
    built = BuildOptions(precision, backend, calibration_data, config, use_cuda_graph, torch_ops,
                         progress)  # fmt: skip
    try:
        compiled = compile_whole(module, example_inputs, example_kwargs, dynamic_shapes, built)
    except InputError:
        raise  # (the caller's mistake: blocks would not fix it)
    except TensorkilnError as err:
        if require_full_compilation:
            raise
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
    else:
        if compiled.torch_ops:
            warnings.warn(
                f"tensorkiln.torch.compile: {type(module).__name__}'s engine runs "
                f"{', '.join(compiled.torch_ops)} in PyTorch (nothing translates them); a "
                "tensorkiln plugin of the same name gives them a kernel of their own",
                stacklevel=2,
            )
        return compiled
    options = {"precision": precision, "backend": backend, "min_block_size": min_block_size}
    if use_cuda_graph is not None:
        options["use_cuda_graph"] = use_cuda_graph
    name = type(module).__name__
    if isinstance(module, torch.export.ExportedProgram):
        module = module.module()  # (a module running the program's graph)
    warnings.warn(
        f"tensorkiln.torch.compile: {name} runs partly in PyTorch ({reason}); "
        "engines are built for the blocks tensorkiln supports at the first call "
        "(require_full_compilation=True makes this an error)",
        stacklevel=2,
    )
    return PartialModule(module, reason, options)
