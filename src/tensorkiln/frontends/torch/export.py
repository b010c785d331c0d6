"""A torch.nn.Module as an ONNX model the builder takes, with what running it in place needs.

torch.export captures the module (ATen ops; dynamic dimensions declared with torch.export.Dim,
with their bounds), and torch.onnx's exporter writes that program as an ONNX model in memory: the
user never handles a file. The builder then sees what it sees from any ONNX model, so every pass,
precision and tactic applies unchanged. (The alternative, a table from ATen ops to the IR here,
would repeat the exporter's table of several hundred ops; it earns its place only where the
exporter's translation loses something the builder needs.)

Beside the model, a :class:`TorchExport` keeps the module's input and output structure (pytree
specs), which flattened input feeds which ONNX input, the optimization profile the declared
dimensions give (min and max from the Dim, opt the example's size), and the engine I/O types that
make the engine take and give exactly the tensors PyTorch would.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import onnx
import torch
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree

from tensorkiln.errors import InputError, ModelLoadError, UnsupportedOpError

Shape3 = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

# torch dtype -> the engine I/O format (precision/io.py) that keeps it as PyTorch has it
_FLOAT_FORMATS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class TorchExport:
    """A module exported for the builder.

    ``leaves``: for each leaf of the flattened (args, kwargs), the ONNX input it feeds, or None
    where the exporter baked it in (a number, a string, None, an unused tensor); ``constants``
    holds those leaves' example values (a call must pass the same). ``shapes``: ONNX input ->
    (min, opt, max) for inputs with a dynamic dimension. ``input_formats`` and
    ``output_formats``: the engine's I/O types, in ONNX order.
    """

    model: onnx.ModelProto
    name: str
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    leaves: tuple[str | None, ...]
    constants: tuple[Any, ...]
    shapes: dict[str, Shape3]
    input_formats: list[str]
    output_formats: list[str]


def io_format(dtype: torch.dtype) -> str:
    """The engine I/O format keeping tensors of ``dtype`` as they are."""
    return _FLOAT_FORMATS.get(dtype) or str(dtype).removeprefix("torch.")


def flatten_inputs(args: tuple, kwargs: dict) -> tuple[list[Any], pytree.TreeSpec]:
    return pytree.tree_flatten((tuple(args), dict(kwargs)))


def export_module(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    dynamic_shapes: Any = None,
) -> TorchExport:
    """Export ``module`` called as ``module(*args, **kwargs)`` (in eval mode, without gradients)
    to an ONNX model; ``dynamic_shapes`` as torch.export takes it. Dynamic dimensions need a
    maximum (``torch.export.Dim(name, max=...)``): it is the engine profile's max."""
    if not isinstance(module, torch.nn.Module):
        raise InputError(f"expected a torch.nn.Module, got {type(module).__name__}")
    name = type(module).__name__
    args, kwargs = tuple(args), dict(kwargs or {})
    program = _capture(module, name, args, kwargs, dynamic_shapes)
    model = _to_onnx(program, name, args, kwargs)
    leaves, constants = _leaves(program, model, args, kwargs)
    examples = dict(zip(leaves, flatten_inputs(args, kwargs)[0]))
    graph_inputs = [i.name for i in model.graph.input]
    shapes = _profile(model, program, examples, name)
    input_formats = [io_format(examples[n].dtype) for n in graph_inputs]
    output_formats = [io_format(v.dtype) for v in _output_values(program, name)]
    if len(output_formats) != len(model.graph.output):
        raise UnsupportedOpError(
            f"{name}: the ONNX export has {len(model.graph.output)} outputs for the module's "
            f"{len(output_formats)} tensors; tensorkiln.torch cannot map them"
        )
    return TorchExport(
        model=model,
        name=name,
        in_spec=program.call_spec.in_spec,
        out_spec=program.call_spec.out_spec,
        leaves=tuple(leaves),
        constants=tuple(constants),
        shapes=shapes,
        input_formats=input_formats,
        output_formats=output_formats,
    )


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module):
    """The module in eval mode for the export, its own mode restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def _quiet():
    """The exporter's notices (missing optional packages, deprecations) are not the user's."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:500]


def _capture(module, name, args, kwargs, dynamic_shapes) -> torch.export.ExportedProgram:
    try:
        with _eval_mode(module), torch.no_grad(), _quiet():
            return torch.export.export(
                module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False
            )
    except Exception as err:  # torch.export raises many kinds; the user needs the first line
        raise ModelLoadError(
            f"torch.export could not capture {name}: {type(err).__name__}: {_first_line(err)}"
        ) from err


def _to_onnx(program, name: str, args: tuple, kwargs: dict) -> onnx.ModelProto:
    try:
        with _quiet():
            exported = torch.onnx.export(
                program, args, kwargs=kwargs, dynamo=True, optimize=True, verbose=False
            )
            return exported.model_proto
    except Exception as err:
        missing = untranslatable_ops(program)
        if missing:
            raise UnsupportedOpError(
                f"{name}: no ONNX translation of {', '.join(missing)}: tensorkiln.torch.compile "
                "builds whole modules; torch.compile(module, backend='tensorkiln') leaves such "
                "ops to PyTorch and builds the rest"
            ) from err
        raise UnsupportedOpError(
            f"{name}: the ONNX exporter could not translate the captured program: "
            f"{type(err).__name__}: {_first_line(err)}"
        ) from err


@functools.cache
def onnx_registry() -> Any:
    """torch's table of ATen (and registered custom) ops -> ONNX translations."""
    from torch.onnx._internal.exporter import _registration  # lazy: torch (a private module)

    with _quiet():
        return _registration.ONNXRegistry.from_torchlib()


def untranslatable_ops(program: torch.export.ExportedProgram) -> list[str]:
    """The ops of ``program`` outside ATen that the ONNX exporter has no translation of (custom
    ops: torch.library's, other libraries'), by name, once each."""
    registry = onnx_registry()
    names = []
    for node in program.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace in ("aten", "prims") or registry.is_registered(target):
            continue
        names.append(f"{target.namespace}::{target._opname}")
    return list(dict.fromkeys(names))


def _leaves(program, model: onnx.ModelProto, args: tuple, kwargs: dict) -> tuple[list, list]:
    """Per flattened input leaf: the ONNX input it feeds (or None), and its example value where
    it feeds none."""
    values, _ = flatten_inputs(args, kwargs)
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(specs) != len(values):
        raise UnsupportedOpError(
            f"the exported program takes {len(specs)} inputs for {len(values)} given; "
            "tensorkiln.torch cannot map them"
        )
    names = {i.name for i in model.graph.input}
    leaves, constants = [], []
    for spec, value in zip(specs, values):
        arg = spec.arg
        feeds = isinstance(arg, TensorArgument) and arg.name in names
        leaves.append(arg.name if feeds else None)
        constants.append(None if feeds or isinstance(value, torch.Tensor) else value)
    missing = names - {n for n in leaves if n}
    if missing:
        raise UnsupportedOpError(f"ONNX inputs {sorted(missing)} match no argument of the module")
    return leaves, constants


def _output_values(program, name: str) -> list[Any]:
    out = next(n for n in program.graph.nodes if n.op == "output")
    values = []
    for arg in out.args[0]:
        val = getattr(arg, "meta", {}).get("val")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedOpError(
                f"{name}: output {arg} is not a tensor; tensorkiln.torch returns tensors only"
            )
        values.append(val)
    return values


def _bound(value: Any) -> int | None:
    try:
        return int(value)
    except Exception:  # sympy's infinity (an unbounded dimension) has no int
        return None


def _profile(model, program, examples: dict, name: str) -> dict[str, Shape3]:
    """ONNX input -> (min, opt, max) where a dimension is symbolic: the bounds the program's
    range constraints give, opt the example's size."""
    ranges = {str(sym): vr for sym, vr in program.range_constraints.items()}
    shapes: dict[str, Shape3] = {}
    for graph_input in model.graph.input:
        dims = graph_input.type.tensor_type.shape.dim
        example = tuple(examples[graph_input.name].shape)
        lo, hi = list(example), list(example)
        for axis, dim in enumerate(dims):
            if not dim.dim_param or dim.dim_param not in ranges:
                continue
            vr = ranges[dim.dim_param]
            upper = _bound(vr.upper)
            if upper is None:
                raise InputError(
                    f"{name}: dimension {axis} of input '{graph_input.name}' is dynamic with no "
                    "maximum; declare it with one, e.g. torch.export.Dim('batch', max=64): the "
                    "engine is built for sizes up to it"
                )
            lo[axis] = max(_bound(vr.lower) or 0, 1)
            hi[axis] = upper
        if tuple(lo) != example or tuple(hi) != example:
            shapes[graph_input.name] = (tuple(lo), example, tuple(hi))
    return shapes
