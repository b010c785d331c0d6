"""serve/wire.py's field splitter against protobuf's own parser (the oracle): random
ModelInferRequests (raw contents of any size, inputs, outputs, parameters, fields the schema
lacks) split and parsed agree with the whole message parsed; truncated and corrupted bytes are
either refused (None) or split into what protobuf itself makes of them, never an exception."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("google.protobuf")

from tensorkiln.serve import protocol, wire

Request = protocol.message("inference.ModelInferRequest")
RAW = 7


def _random_request(rng: np.random.Generator) -> bytes:
    req = Request(model_name="m" * int(rng.integers(0, 40)), id=str(rng.integers(1 << 40)))
    if rng.random() < 0.5:
        req.model_version = str(rng.integers(1, 9))
    for i in range(int(rng.integers(0, 4))):
        t = req.inputs.add(name=f"in{i}", datatype="FP32", shape=[int(rng.integers(1, 5)), 3])
        if rng.random() < 0.3:
            t.parameters["shared_memory_region"].string_param = "r"
        req.raw_input_contents.append(rng.bytes(int(rng.choice([0, 1, 127, 128, 5000, 70000]))))
    for i in range(int(rng.integers(0, 3))):
        req.outputs.add(name=f"out{i}")
    if rng.random() < 0.5:
        req.parameters["priority"].int64_param = int(rng.integers(-(1 << 40), 1 << 40))
    data = req.SerializeToString()
    if rng.random() < 0.5:  # fields the schema lacks: varint, 64-bit, bytes, 32-bit
        data += b"\xa0\x06\x96\x01" + b"\xa9\x06" + rng.bytes(8) + b"\xb2\x06\x03abc"
        data += b"\xbd\x06" + rng.bytes(4)
    if rng.random() < 0.5:  # a raw content before every other field (any order is valid)
        data = Request(raw_input_contents=[rng.bytes(10)]).SerializeToString() + data
    return data


def _agree(data: bytes) -> None:
    split = wire.split_field(data, RAW)
    try:
        whole = Request.FromString(data)
    except Exception:
        whole = None
    if split is None:
        return  # (the caller then parses the whole message, which says what is wrong)
    rest, raw = split
    try:
        parsed = Request.FromString(rest)
    except Exception:
        parsed = None
    assert (parsed is None) == (whole is None)
    if whole is None:
        return
    assert [bytes(v) for v in raw] == list(whole.raw_input_contents)
    whole.ClearField("raw_input_contents")
    assert parsed == whole


def test_split_requests_agree_with_the_whole_message_parsed() -> None:
    rng = np.random.default_rng()
    for _ in range(300):
        data = _random_request(rng)
        split = wire.split_field(data, RAW)
        assert split is not None
        _agree(data)


def test_the_raw_contents_are_views_into_the_received_bytes() -> None:
    x = np.random.default_rng().standard_normal((1, 3, 32, 32)).astype(np.float32)
    req = Request(model_name="b1")
    req.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    data = bytearray(req.SerializeToString())
    rest, raw = wire.split_field(data, RAW)
    assert len(rest) < 100 and len(raw) == 1
    y = np.frombuffer(raw[0], np.float32).reshape(x.shape)
    np.testing.assert_array_equal(y, x)
    assert raw[0].obj is data  # (no copy: a view of the buffer the transport filled)


def test_truncated_and_corrupted_bytes_are_refused_or_agree() -> None:
    rng = np.random.default_rng()
    for _ in range(300):
        data = bytearray(_random_request(rng))
        if not data:
            continue
        kind = rng.integers(3)
        if kind == 0:
            data = data[: int(rng.integers(0, len(data)))]
        elif kind == 1:
            for _ in range(int(rng.integers(1, 4))):
                data[int(rng.integers(len(data)))] = int(rng.integers(256))
        else:
            data = rng.bytes(int(rng.integers(1, 64)))
        _agree(bytes(data))
    for junk in (b"\x00", b"\x3a", b"\x3a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                 b"\x3a\x05ab", b"\x0b", b"\x3c", b"\xff" * 11):  # fmt: skip
        assert wire.split_field(junk, RAW) is None


def test_fields_written_parse_as_protobuf_writes_them() -> None:
    rng = np.random.default_rng()
    Response = protocol.message("inference.ModelInferResponse")
    for size in (0, 1, 127, 128, 300, 16383, 16384, int(rng.integers(20_000, 300_000))):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        ident = "req-" + "x" * int(rng.integers(0, 200))
        want = Response(model_name="digits", model_version="1", id=ident)
        want.raw_output_contents.extend([data, b""])
        head = Response(model_name="digits", model_version="1").SerializeToString()
        got = b"".join(
            [head, wire.field(3, ident.encode()), wire.field(6, data), wire.field(6, b"")]
        )
        assert Response.FromString(got) == want
        assert wire.field(6, memoryview(data)) == wire.field(6, data)
