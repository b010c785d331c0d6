"""Protocol buffers' wire format, as far as the gRPC service needs it: a ModelInferRequest's raw
tensor contents taken out of the received bytes without copying them, and length-delimited
fields written (a response's id and contents after the bytes kept for the rest of it).

Parsed whole, a request's 600 KB image is copied twice before the engine sees it: into the
parsed message, and out of it again when the field is read (protobuf's Python API hands out a
new bytes object). :func:`split_field` walks the message's top-level fields instead, returns
one field's values as views into the received bytes, and the rest of the message (names,
shapes, parameters: a few hundred bytes) as bytes for protobuf to parse. Anything that is not a
well-formed sequence of fields gives None, and the caller parses the whole message the usual
way, which reports what is wrong.
"""

from __future__ import annotations

_MAX_VARINT = 10  # bytes of a 64-bit varint


def _varint(buf: memoryview, i: int, n: int) -> tuple[int, int] | None:
    """The varint at ``buf[i]`` and the index after it; None where it runs past ``n`` or is
    longer than 64 bits allow."""
    if i < n and buf[i] < 0x80:  # (one byte: every tag and most lengths here)
        return buf[i], i + 1
    value = shift = 0
    for j in range(i, min(n, i + _MAX_VARINT)):
        byte = buf[j]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, j + 1
        shift += 7
    return None


def split_field(data: bytes | bytearray | memoryview, field: int) -> tuple[bytes, list] | None:
    """(the message's bytes without top-level field ``field``, that field's length-delimited
    values in order as memoryviews into ``data``), or None where ``data`` is not a well-formed
    sequence of fields (wire types 0, 1, 2 and 5; field numbers from 1)."""
    buf = memoryview(data)
    if buf.ndim != 1 or buf.itemsize != 1:
        buf = buf.cast("B")
    n = len(buf)
    rest = bytearray()
    values = []
    i = kept_from = 0
    while i < n:
        key = _varint(buf, i, n)
        if key is None:
            return None
        tag, j = key
        wire, number = tag & 7, tag >> 3
        if number == 0:
            return None
        if wire == 0:
            end = _varint(buf, j, n)
            if end is None:
                return None
            j = end[1]
        elif wire == 1:
            j += 8
        elif wire == 5:
            j += 4
        elif wire == 2:
            length = _varint(buf, j, n)
            if length is None:
                return None
            size, start = length
            j = start + size
            if j <= n and number == field:
                rest += buf[kept_from:i]
                values.append(buf[start:j])
                kept_from = j
        else:  # (groups: not in these messages)
            return None
        if j > n:
            return None
        i = j
    rest += buf[kept_from:n]
    return bytes(rest), values


def _encode_varint(value: int) -> bytes:
    if value < 0x80:  # (one byte: every key and most lengths here)
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(number: int, data: bytes | bytearray | memoryview) -> bytes:
    """Field ``number`` holding ``data`` (bytes, a string's UTF-8 or an embedded message), as
    protobuf writes it: the key, the length, the bytes."""
    return b"".join((_encode_varint(number << 3 | 2), _encode_varint(len(data)), data))
