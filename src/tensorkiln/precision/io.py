"""The engine's input and output types (TensorRT's I/O formats, trtexec's --inputIOFormats and
--outputIOFormats).

A reduced-precision engine keeps float32 inputs and outputs by default and casts on the way in and
out (reduce.py's ``__cast_in`` / ``__cast_out`` layers). A deployment that already holds float16
data pays for two conversions it does not need: on an H200, the cast of ResNet-50's batch of 256
images took 0.19 ms of an 8 ms batch. Declaring an input or output float16 (or bfloat16) removes
its cast where the engine computes in that type, and adds one where it does not, so the engine
takes and gives exactly the declared types.

A format is ``type[:layout]`` as trtexec writes it: ``fp32``, ``fp16`` or ``bf16`` for float
tensors, or the tensor's own type (``int64``, ``int32``, ``bool``...) to leave it as it is; the
layout, when given, must be ``chw`` (row-major, the only layout engine I/O has). Formats are
given in input (output) order, one per tensor, or one for all: a single float format then applies
to every float tensor and leaves the others alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorkiln.errors import InputError
from tensorkiln.ir import Graph, Node, TensorType, Value
from tensorkiln.ir.dtypes import DType
from tensorkiln.kernels.evaluate import infer_shapes

FLOAT_TYPES = {"fp32": DType.FLOAT, "fp16": DType.FLOAT16, "bf16": DType.BFLOAT16}
_SPELLINGS = {
    "float": "fp32", "float32": "fp32", "float16": "fp16", "half": "fp16", "float64": "double",
    "fp64": "double",
}  # fmt: skip
LAYOUTS = ("chw", "linear")


def parse_formats(text: str, what: str) -> list[str]:
    """``fp16:chw,fp32`` -> ["fp16", "fp32"]: the type of each format (``what`` names the flag
    in errors)."""
    out = []
    for item in text.split(","):
        spec = item.strip().lower()
        if not spec:
            raise InputError(f"{what}: an empty format in '{text}'; give type[:chw],...")
        kind, _, layout = spec.partition(":")
        kind = _SPELLINGS.get(kind, kind)
        if layout and layout not in LAYOUTS:
            raise InputError(
                f"{what}: layout '{layout}' in '{item.strip()}' is not supported: engine inputs "
                "and outputs are row-major ('chw'); layouts inside the engine are the builder's "
                "choice"
            )
        if kind not in FLOAT_TYPES and not _kept_type(kind):
            raise InputError(
                f"{what}: unknown type '{kind}' in '{item.strip()}'; give fp32, fp16 or bf16 for "
                "float tensors, or the tensor's own type (int64, int32, bool, float64...)"
            )
        out.append(kind)
    return out


def _kept_type(kind: str) -> bool:
    """A type an engine input or output keeps as it is (integers, bool, float64...)."""
    dt = DType.__members__.get(kind.upper())
    return dt is not None and dt not in FLOAT_TYPES.values()


def set_io_types(graph: Graph, inputs: Sequence[str], outputs: Sequence[str]) -> list[str]:
    """Give the graph's inputs and outputs the types of the formats ``inputs`` / ``outputs``
    (see the module's docstring), in place; returns a note per tensor whose type changed."""
    notes = []
    for v, kind in _pairs(graph.inputs, inputs, "input"):
        if _retype_input(graph, v, FLOAT_TYPES[kind]):
            notes.append(f"input '{v.name}' is {kind} (I/O format)")
    for v, kind in _pairs(graph.outputs, outputs, "output"):
        if _retype_output(graph, v, FLOAT_TYPES[kind]):
            notes.append(f"output '{v.name}' is {kind} (I/O format)")
    if notes:
        infer_shapes(graph)
    return notes


def _pairs(values: list[Value], kinds: Sequence[str], what: str) -> list[tuple[Value, str]]:
    """(tensor, float type) for the float tensors the formats change."""
    if not kinds:
        return []
    flag = f"--{what}-io-formats"
    if len(kinds) == 1 and len(values) != 1:
        kind = kinds[0]
        if kind not in FLOAT_TYPES:
            raise InputError(
                f"{flag}: one format for {len(values)} {what}s must be a float type "
                f"(fp32, fp16, bf16), not '{kind}'; or give one format per {what}"
            )
        return [(v, kind) for v in values if _is_float(v)]
    if len(kinds) != len(values):
        names = ", ".join(f"'{v.name}'" for v in values)
        raise InputError(
            f"{flag}: {len(kinds)} formats for {len(values)} {what}s ({names}); give one per "
            f"{what}, in order, or one for all"
        )
    pairs = []
    for v, kind in zip(values, kinds):
        own = v.dtype.name.lower() if v.dtype is not None else "?"
        if kind in FLOAT_TYPES and _is_float(v):
            pairs.append((v, kind))
        elif kind not in FLOAT_TYPES and kind == own:
            continue  # (an integer or bool tensor named with its own type)
        else:
            raise InputError(
                f"{flag}: {what} '{v.name}' is {own}; it cannot be given as {kind} (only float "
                "tensors change type: give fp32, fp16 or bf16 for them, the own type otherwise)"
            )
    return pairs


def _is_float(v: Value) -> bool:
    return v.dtype in (DType.FLOAT, DType.FLOAT16, DType.BFLOAT16)


def _replace_uses(graph: Graph, old: Value, new: Value) -> None:
    for _, n in graph.walk():
        n.inputs = [new if x is old else x for x in n.inputs]


def _retype_input(graph: Graph, v: Value, dtype: DType) -> bool:
    """Input ``v`` of type ``dtype``: the casts that read it and convert to ``dtype`` go (a
    widening cast of ``dtype`` and back is exact), the other readers get one cast of it to the
    type they had. Returns whether the type changed."""
    old = v.dtype
    if old == dtype:
        return False
    inner = Value(f"{v.name}__io_{old.short}", TensorType(old, v.shape))
    _replace_uses(graph, v, inner)
    v.type = TensorType(dtype, v.shape)
    cast = Node("Cast", [v], [inner], {"to": int(old)}, name=f"{v.name}__io_in")
    graph.nodes.insert(0, cast)
    # Cast(Cast(v, float32), dtype) is v itself: float16 and bfloat16 widen to float32 exactly
    exact = old == DType.FLOAT
    for n in list(graph.nodes):
        if (
            exact
            and n.op == "Cast"
            and n.domain == ""
            and n.inputs
            and n.inputs[0] is inner
            and n.attrs.get("to") == int(dtype)
            and n.outputs[0] not in graph.outputs
        ):
            _replace_uses(graph, n.outputs[0], v)
            graph.nodes.remove(n)
    if not any(inner in n.inputs for _, n in graph.walk()) and inner not in graph.outputs:
        graph.nodes.remove(cast)
    return True


def _retype_output(graph: Graph, v: Value, dtype: DType) -> bool:
    """Output ``v`` of type ``dtype``: a cast producing it from a ``dtype`` value goes (the
    value itself becomes the output), otherwise one cast to ``dtype`` is added. Returns whether
    the type changed."""
    old = v.dtype
    if old == dtype:
        return False
    producer = graph.producers().get(v)
    if producer is None:
        what = "an input" if v in graph.inputs else "a constant"
        raise InputError(
            f"--output-io-formats: output '{v.name}' is {what} of the model passed straight out; "
            f"it keeps its type ({old.name.lower()})"
        )
    src = producer.inputs[0] if producer.op == "Cast" and producer.domain == "" else None
    if (
        src is not None
        and src.dtype == dtype
        and src not in graph.inputs
        and src not in graph.outputs
        and src.const is None
    ):
        # the value before the output cast becomes the output, under the output's name
        graph.nodes.remove(producer)
        for _, n in graph.walk():
            n.outputs = [v if x is src else x for x in n.outputs]
        _replace_uses(graph, src, v)
        v.type = TensorType(dtype, v.shape)
        return True
    inner = Value(f"{v.name}__io_{old.short}", TensorType(old, v.shape))
    for _, n in graph.walk():
        n.outputs = [inner if x is v else x for x in n.outputs]
    _replace_uses(graph, v, inner)  # (other readers keep the value in its computed type)
    v.type = TensorType(dtype, v.shape)
    graph.nodes.append(Node("Cast", [inner], [v], {"to": int(dtype)}, name=f"{v.name}__io_out"))
    return True
