"""The protocol's messages, built from the vendored definitions' compiled descriptors."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tensorkiln.serve import protocol

PROTO = protocol.DESCRIPTORS.parent


def test_every_message_of_the_vendored_definitions_is_built():
    """kserve.binpb is the compiled form of the .proto files beside it (regenerate it with
    scripts/gen_serve_protos.sh when they change): every top-level message they declare exists."""
    for path in sorted(PROTO.glob("*.proto")):
        text = path.read_text()
        package = re.search(r"^package ([\w.]+);", text, re.M).group(1)
        names = re.findall(r"^message (\w+)", text, re.M)
        assert names, path
        for name in names:
            assert protocol.message(f"{package}.{name}").DESCRIPTOR.name == name


def test_an_infer_request_round_trips_through_its_wire_form():
    rng = np.random.default_rng()
    data = rng.standard_normal((2, 3)).astype(np.float32)
    Request = protocol.message("inference.ModelInferRequest")
    req = Request(model_name="digits", id=str(rng.integers(1 << 30)))
    tensor = req.inputs.add(name="input", datatype="FP32", shape=list(data.shape))
    req.raw_input_contents.append(data.tobytes())
    back = Request.FromString(req.SerializeToString())
    assert back.inputs[0].name == "input" and list(back.inputs[0].shape) == [2, 3]
    got = np.frombuffer(back.raw_input_contents[0], protocol.numpy_dtype(tensor.datatype))
    np.testing.assert_array_equal(got.reshape(2, 3), data)


@pytest.mark.parametrize(
    "name", ["BOOL", "UINT8", "INT8", "INT32", "INT64", "FP16", "FP32", "FP64"]
)
def test_datatypes_map_both_ways(name):
    dtype = protocol.numpy_dtype(name)
    assert protocol.datatype_of(dtype) == name
    assert protocol.config_type_name(protocol.config_type(name)) == name


def test_types_numpy_lacks_are_none():
    assert protocol.numpy_dtype("BYTES") is None and protocol.numpy_dtype("BF16") is None
    assert protocol.datatype_of(np.dtype(np.complex64)) is None
    with pytest.raises(KeyError):
        protocol.config_type("FP12")
