"""Reading ONNX files: the protobuf, its external data, and the checks that make bad files fail early.

Nothing here executes or unpickles anything from the file. External data is read only from regular files
inside the model's folder (see :mod:`tensorkiln.frontends.onnx.external`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from tensorkiln.errors import ModelLoadError
from tensorkiln.frontends.onnx.external import ExternalData, uses_external_data

ModelSource = str | os.PathLike | bytes | onnx.ModelProto

# A serialized protobuf message cannot exceed 2 GiB.
_PROTOBUF_LIMIT = 2**31


def load_model_proto(
    source: ModelSource, base_dir: str | os.PathLike | None = None
) -> onnx.ModelProto:
    """Read an ONNX model from a path, bytes or a ModelProto, with its external data loaded.

    Raises ModelLoadError for a missing, truncated or malformed file, for missing or unsafe
    external data, and for external data too large to hold inside one protobuf (2 GiB); such models
    import through :func:`open_model`, which maps their data instead.
    """
    model, external = open_model(source, base_dir)
    if external is not None:
        _embed_external(model, external)
    return model


def open_model(
    source: ModelSource, base_dir: str | os.PathLike | None = None
) -> tuple[onnx.ModelProto, ExternalData | None]:
    """Read and check an ONNX model, leaving its external data in its files.

    Returns the model and, when it has external data, the reader that maps it; every external
    reference has been checked (inside the model's folder, a regular file, bytes in range).
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
        model = _parse(_read_model_file(path), where)
        if base_dir is None:
            base_dir = path.parent
    _check_model(model, where)
    tensors = [t for t in iter_tensors(model.graph) if uses_external_data(t)]
    if not tensors:
        return model, None
    if base_dir is None:
        raise ModelLoadError(
            f"{where} keeps weights in external data files; load it from its path (or pass "
            "base_dir=) so the data files next to it can be found"
        )
    external = ExternalData(base_dir, where)
    for tensor in tensors:
        external.locate(tensor)
    return model, external


def _embed_external(model: onnx.ModelProto, external: ExternalData) -> None:
    """Copy every external tensor's bytes into the model (bounded by what protobuf can hold)."""
    tensors = [t for t in iter_tensors(model.graph) if uses_external_data(t)]
    total = sum(external.locate(t).length for t in tensors)
    if total + model.ByteSize() >= _PROTOBUF_LIMIT:
        raise ModelLoadError(
            f"{external.where}: its tensors name {total / 2**30:.1f} GiB of external data, more "
            "than one ONNX protobuf can hold (2 GiB); this step needs the weights inside the "
            "model. Build without embedding the source model."
        )
    for tensor in tensors:
        tensor.raw_data = external.read(tensor)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT


def _read_model_file(path: Path) -> bytes:
    """The file's bytes; a device or pipe (which could be read forever) and a file larger than a
    protobuf can be are refused before reading."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(
            f"'{path}' is not a regular file (a device or pipe?); refusing to read it as a model"
        )
    if st.st_size >= _PROTOBUF_LIMIT:
        raise ModelLoadError(
            f"'{path}' is {st.st_size:,} bytes, more than an ONNX protobuf can hold (2 GiB); a "
            "model that large keeps its weights in external data files"
        )
    return path.read_bytes()


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
