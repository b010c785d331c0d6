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
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx
import torch
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree

from tensorkiln.errors import InputError, ModelLoadError, UnsupportedOpError
from tensorkiln.ops import records as ops_records

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
    module: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple,
    kwargs: dict | None = None,
    dynamic_shapes: Any = None,
    untranslated: Callable[[list], Any] | None = None,
) -> TorchExport:
    """Export ``module`` called as ``module(*args, **kwargs)`` (in eval mode, without gradients)
    to an ONNX model; ``dynamic_shapes`` as torch.export takes it. Dynamic dimensions need a
    maximum (``torch.export.Dim(name, max=...)``): it is the engine profile's max. ``module``
    may be a program torch.export captured already (its own dynamic dimensions apply; ``args``
    are an example call, which sets the profile's opt). ``untranslated``, when given, is called
    with the captured program's ops that nothing translates yet, before the translation (it
    may register plugins for them)."""
    args, kwargs = tuple(args), dict(kwargs or {})
    if isinstance(module, torch.export.ExportedProgram):
        if dynamic_shapes is not None:
            raise InputError(
                "an ExportedProgram carries its own dynamic dimensions: leave dynamic_shapes out "
                "(or export again with the ones you want)"
            )
        name = "ExportedProgram"
        program = module
    elif isinstance(module, torch.nn.Module):
        name = type(module).__name__
        program = _capture(module, name, args, kwargs, dynamic_shapes)
    else:
        raise InputError(
            f"expected a torch.nn.Module or a torch.export.ExportedProgram, got "
            f"{type(module).__name__}"
        )
    if untranslated is not None:
        missing = untranslatable_ops(program)
        if missing:
            untranslated(missing)
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
    names = ("torch.onnx", "torch.export", "torch._export", "onnxscript", "onnx_ir")
    loggers = [logging.getLogger(n) for n in names]
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


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(err: BaseException) -> str:
    """The first line of ``err``, and of the innermost error that caused it where there is one
    (torch's exporter wraps the real reason in errors of its own)."""

    def line(e: BaseException) -> str:
        text = _ANSI.sub("", str(e)).strip() or type(e).__name__
        return text.splitlines()[0][:300]

    inner = err
    for _ in range(20):  # (a cycle of causes must not loop)
        nxt = inner.__cause__ or inner.__context__
        if nxt is None:
            break
        inner = nxt
    if inner is err:
        return line(err)
    return f"{line(err)} (cause: {type(inner).__name__}: {line(inner)})"


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
        return _export_onnx(program, args, kwargs)
    except Exception as err:
        first = err
    missing = [f"{op.namespace}::{op._opname}" for op in untranslatable_ops(program)]
    if missing:
        raise UnsupportedOpError(
            f"{name}: no ONNX translation of {', '.join(missing)}: register a tensorkiln "
            "plugin of that name (@tensorkiln.plugin('ns::op')), or run the module through "
            "torch.compile(module, backend='tensorkiln'), which leaves such ops to PyTorch "
            "and builds the rest"
        ) from first
    # The exporter's own decomposition table fails on some programs where PyTorch's core ATen
    # decompositions do not (torch 2.13: a view of a transposed tensor in T5's and Swin's
    # attention); the exporter takes a core-ATen program as well.
    try:
        with _quiet():
            core = program.run_decompositions()
        return _export_onnx(core, args, kwargs)
    except Exception:  # (the first error is the one to report)
        pass
    raise UnsupportedOpError(
        f"{name}: the ONNX exporter could not translate the captured program: "
        f"{type(first).__name__}: {_first_line(first)}"
    ) from first


def _export_onnx(program, args: tuple, kwargs: dict) -> onnx.ModelProto:
    with _quiet():
        exported = torch.onnx.export(
            program, args, kwargs=kwargs, dynamo=True, optimize=True, verbose=False,
            custom_translation_table=plugin_translations(program),
        )  # fmt: skip
        return exported.model_proto


# ---------------------------------------------------------------------- plugins
# a torch custom op argument's type -> the ONNX attribute type it is written as; the types of
# its tensor arguments (a plugin's inputs; torch_ops.py wraps ops of these argument types only)
ATTR_TYPES = {
    "float": onnx.defs.OpSchema.AttrType.FLOAT,
    "int": onnx.defs.OpSchema.AttrType.INT,
    "bool": onnx.defs.OpSchema.AttrType.INT,
    "str": onnx.defs.OpSchema.AttrType.STRING,
    "List[int]": onnx.defs.OpSchema.AttrType.INTS,
    "List[float]": onnx.defs.OpSchema.AttrType.FLOATS,
}
TENSOR_TYPES = ("Tensor", "Optional[Tensor]")


def plugin_translations(program: torch.export.ExportedProgram) -> dict:
    """ONNX translations of the custom ops in ``program`` that a tensorkiln plugin of the same
    name ('ns::op') implements: a node of domain ``ns``, op ``op``, the op's tensor arguments as
    inputs and its other arguments as attributes (by their names in the op's schema)."""
    table = {}
    for node in program.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target not in table and plugin_op(target):
            table[target] = _plugin_translation(target)
    return table


def plugin_op(target: torch._ops.OpOverload) -> bool:
    """Whether ``target``, an op outside ATen, is implemented by a tensorkiln plugin of its
    name ('ns::op')."""
    if target.namespace in ("aten", "prims"):
        return False
    rec = ops_records.get(target._opname, target.namespace)
    return rec is not None and rec.plugin_version is not None


def _plugin_translation(target: torch._ops.OpOverload) -> Any:
    import onnxscript  # lazy: torch's exporter needs it (a dependency of tensorkiln.torch)

    arguments = list(target._schema.arguments)
    attrs = [a for a in arguments if str(a.type) not in TENSOR_TYPES]
    for a in attrs:
        if str(a.type) not in ATTR_TYPES:
            raise UnsupportedOpError(
                f"custom op {target.namespace}::{target._opname}: argument '{a.name}' of type "
                f"{a.type} has no ONNX attribute type ({', '.join(ATTR_TYPES)} do)"
            )
    schema = _onnx_schema(target, attrs)
    node_op = onnxscript.values.Op(
        onnxscript.values.Opset(target.namespace, 1), target._opname, schema
    )

    def translate(*args: Any, **kwargs: Any) -> Any:
        bound = {a.name: v for a, v in zip(arguments, args)} | kwargs
        tensors = [bound.get(a.name) for a in arguments if str(a.type) in TENSOR_TYPES]
        while tensors and tensors[-1] is None:
            tensors.pop()
        values = {a.name: bound.get(a.name, a.default_value) for a in attrs}
        values = {k: int(v) if isinstance(v, bool) else v for k, v in values.items()}
        return node_op(*tensors, **{k: v for k, v in values.items() if v is not None})

    return translate


def _onnx_schema(target: torch._ops.OpOverload, attrs: list) -> onnx.defs.OpSchema:
    schema = onnx.defs.OpSchema
    variadic = schema.FormalParameterOption.Variadic
    types = [f"tensor({t})" for t in ("float", "float16", "bfloat16", "double", "int64", "int32",
                                       "int16", "int8", "uint8", "bool")]  # fmt: skip
    return schema(
        target._opname,
        target.namespace,
        1,
        inputs=[schema.FormalParameter("inputs", "T", param_option=variadic, is_homogeneous=False)],
        outputs=[
            schema.FormalParameter("outputs", "T", param_option=variadic, is_homogeneous=False)
        ],
        type_constraints=[("T", types, "")],
        attributes=[
            schema.Attribute(a.name, ATTR_TYPES[str(a.type)], "", required=False) for a in attrs
        ],
    )


@functools.cache
def onnx_registry() -> Any:
    """torch's table of ATen (and registered custom) ops -> ONNX translations."""
    from torch.onnx._internal.exporter import _registration  # lazy: torch (a private module)

    with _quiet():
        return _registration.ONNXRegistry.from_torchlib()


def untranslatable_ops(program: torch.export.ExportedProgram) -> list[Any]:
    """The ops of ``program`` that neither the ONNX exporter nor a tensorkiln plugin translates
    (custom ops: torch.library's, other libraries'), once each, in graph order."""
    found = [n.target for n in program.graph.nodes
             if n.op == "call_function" and not translatable(n.target)]  # fmt: skip
    return list(dict.fromkeys(found))


def translatable(target: Any) -> bool:
    """Whether a graph's call target reaches ONNX: anything but an op outside ATen with neither
    a translation in torch's exporter nor a tensorkiln plugin of its name."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in ("aten", "prims"):
        return True
    return plugin_op(target) or onnx_registry().is_registered(target)


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


def size_range(vr: Any) -> tuple[int, int | None]:
    """A symbolic size's range (torch's ValueRanges) as an engine profile takes it: its minimum,
    at least 1, and its maximum (None where it has none)."""
    return max(_bound(vr.lower) or 1, 1), _bound(vr.upper)


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
            lower, upper = size_range(ranges[dim.dim_param])
            if upper is None:
                raise InputError(
                    f"{name}: dimension {axis} of input '{graph_input.name}' is dynamic with no "
                    "maximum; declare it with one, e.g. torch.export.Dim('batch', max=64): the "
                    "engine is built for sizes up to it"
                )
            lo[axis], hi[axis] = lower, upper
        if tuple(lo) != example or tuple(hi) != example:
            shapes[graph_input.name] = (tuple(lo), example, tuple(hi))
    return shapes
