"""Reading ONNX files: the protobuf, its external data, and the checks that make bad files fail early.

Nothing here executes or unpickles anything from the file. External data is read only from files inside
the model's folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from tensorkiln.errors import ModelLoadError

ModelSource = str | os.PathLike | bytes | onnx.ModelProto


def load_model_proto(
    source: ModelSource, base_dir: str | os.PathLike | None = None
) -> onnx.ModelProto:
    """Read an ONNX model from a path, bytes or a ModelProto, with its external data loaded.

    Raises ModelLoadError for a missing, truncated or malformed file and for missing external data.
    """
    if isinstance(source, onnx.ModelProto):
        model, where = source, "the given ModelProto"
    elif isinstance(source, bytes | bytearray | memoryview):
        model, where = _parse(bytes(source), "the given bytes"), "the given bytes"
    else:
        path = Path(source)
        where = str(path)
        if not path.exists():
            raise ModelLoadError(f"model file '{path}' does not exist")
        if path.is_dir():
            raise ModelLoadError(f"'{path}' is a folder, not an ONNX model file")
        model = _parse(path.read_bytes(), where)
        if base_dir is None:
            base_dir = path.parent
    _check_model(model, where)
    if any(_uses_external_data(t) for t in iter_tensors(model.graph)):
        if base_dir is None:
            raise ModelLoadError(
                f"{where} keeps weights in external data files; load it from its path (or pass "
                "base_dir=) so the data files next to it can be found"
            )
        for tensor in iter_tensors(model.graph):
            if _uses_external_data(tensor):
                _load_external(tensor, Path(base_dir), where)
    return model


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    if not data:
        raise ModelLoadError(f"{where} is empty, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"{where} is not a valid ONNX model: the protobuf could not be parsed ({exc}). "
            "The file may be truncated or not an ONNX file at all."
        ) from None
    return model


def _check_model(model: onnx.ModelProto, where: str) -> None:
    if not model.HasField("graph"):
        raise ModelLoadError(f"{where} is not a valid ONNX model: it has no graph")
    if model.ir_version <= 0:
        raise ModelLoadError(f"{where} is not a valid ONNX model: ir_version is {model.ir_version}")
    if model.ir_version > onnx.IR_VERSION:
        raise ModelLoadError(
            f"{where} has ONNX IR version {model.ir_version}; this installation reads up to "
            f"{onnx.IR_VERSION}. Upgrade the onnx package."
        )
    if not model.graph.output:
        raise ModelLoadError(f"{where} is not a valid ONNX model: its graph has no outputs")
    if model.ir_version >= 3 and not model.opset_import:
        raise ModelLoadError(f"{where} is not a valid ONNX model: it imports no opset")


def iter_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of a graph: initializers and tensor attributes, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from iter_tensors(attr.g)
            for g in attr.graphs:
                yield from iter_tensors(g)


def _uses_external_data(tensor: onnx.TensorProto) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.EXTERNAL


def _load_external(tensor: onnx.TensorProto, base_dir: Path, where: str) -> None:
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    name = tensor.name or "<unnamed>"
    if not location:
        raise ModelLoadError(f"{where}: tensor '{name}' uses external data but names no file")
    if os.path.isabs(location) or ".." in Path(location).parts:
        raise ModelLoadError(
            f"{where}: tensor '{name}' points at external data '{location}' outside the model's "
            "folder; refusing to read it"
        )
    path = base_dir / location
    if not path.is_file():
        raise ModelLoadError(
            f"{where}: tensor '{name}' keeps its data in '{location}', which was not found in "
            f"'{base_dir}'. Copy the data file next to the model."
        )
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise ModelLoadError(
            f"{where}: tensor '{name}' has a bad external data offset/length"
        ) from None
    size = path.stat().st_size
    if (
        offset < 0
        or offset > size
        or (length is not None and (length < 0 or offset + length > size))
    ):
        raise ModelLoadError(
            f"{where}: tensor '{name}' reads bytes {offset}..{offset + (length or 0)} of '{location}', "
            f"which has only {size} bytes (truncated data file?)"
        )
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read() if length is None else f.read(length)
    tensor.raw_data = data
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
