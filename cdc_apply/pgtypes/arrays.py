"""Arrays of every registered type: nested Python lists (one level per dimension), NULL elements as None.

The Spark type is array<element> of depth one. A multi-dimensional value decodes to nested lists
all the same; the apply layer decides how a column of fixed depth takes it (docs/types.md).
Lower bounds other than 1 (``'[0:1]={1,2}'``) are not kept: Spark arrays start at 0.
"""

from __future__ import annotations

import struct
from typing import Any

from cdc_apply.pgtypes.registry import PgType, ValueConversionError, lookup, register, registered

MAX_DIMENSIONS = 6  # PostgreSQL's MAXDIM
_ARRAY_HEADER = struct.Struct("!iii")
_DIMENSION = struct.Struct("!ii")
_LENGTH = struct.Struct("!i")


def parse_array_literal(text: str) -> list[Any]:
    """'{1,NULL,"a b",{2,3}}' -> nested lists of element strings (None for NULL)."""
    if text.startswith("["):  # explicit bounds: '[0:1]={...}'
        equals = text.find("=")
        if equals < 0:
            raise ValueConversionError(f"malformed array bounds: {text[:40]!r}")
        text = text[equals + 1:]
    if not text.startswith("{"):
        raise ValueConversionError(f"array literal must start with '{{': {text[:40]!r}")
    value, end = _parse_level(text, 0, 1)
    if end != len(text):
        raise ValueConversionError(f"trailing characters after array literal at {end}")
    return value


def _parse_level(text: str, pos: int, depth: int) -> tuple[list[Any], int]:
    if depth > MAX_DIMENSIONS:
        raise ValueConversionError(f"array literal nested deeper than {MAX_DIMENSIONS} dimensions at {pos}")
    pos += 1  # past "{"
    items: list[Any] = []
    if text[pos:pos + 1] == "}":
        return items, pos + 1
    while pos < len(text):
        ch = text[pos]
        if ch == "{":
            item, pos = _parse_level(text, pos, depth + 1)
            items.append(item)
        elif ch == '"':
            chars = []
            pos += 1
            while pos < len(text) and text[pos] != '"':
                if text[pos] == "\\":
                    pos += 1
                    if pos >= len(text):
                        break
                chars.append(text[pos])
                pos += 1
            if pos >= len(text):
                raise ValueConversionError("unterminated quoted array element")
            items.append("".join(chars))
            pos += 1
        else:
            stop = pos
            while stop < len(text) and text[stop] not in ",}":
                stop += 1
            token = text[pos:stop]
            items.append(None if token == "NULL" else token)
            pos = stop
        if pos >= len(text):
            break
        if text[pos] == ",":
            pos += 1
        elif text[pos] == "}":
            return items, pos + 1
        else:
            raise ValueConversionError(f"unexpected {text[pos]!r} in array literal at {pos}")
    raise ValueConversionError("unterminated array literal")


def _map_nested(value: list[Any], convert: Any) -> list[Any]:
    return [_map_nested(v, convert) if isinstance(v, list) else (None if v is None else convert(v)) for v in value]


def array_type(array_oid: int, element: PgType) -> PgType:
    def from_text(text: str, typmod: int) -> list[Any]:
        return _map_nested(parse_array_literal(text), lambda v: element.from_text(v, typmod))

    def from_binary(raw: bytes, typmod: int) -> list[Any]:
        return decode_binary_array(raw, element, typmod)

    def to_json(value: list[Any]) -> list[Any]:
        return _map_nested(value, element.to_json)

    return PgType(array_oid, "_" + element.name, lambda typmod: f"array<{element.spark_type(typmod)}>",
                  from_text, from_binary, to_json)


def decode_binary_array(raw: bytes, element: PgType, typmod: int) -> list[Any]:
    if len(raw) < _ARRAY_HEADER.size:
        raise ValueConversionError("binary array shorter than its header")
    ndim, _has_nulls, _element_oid = _ARRAY_HEADER.unpack_from(raw)
    if ndim == 0:
        return []
    if not 0 < ndim <= 6 or len(raw) < 12 + 8 * ndim:
        raise ValueConversionError(f"binary array has bad dimension count {ndim}")
    dims = [_DIMENSION.unpack_from(raw, 12 + 8 * i)[0] for i in range(ndim)]
    if any(d < 0 for d in dims):
        raise ValueConversionError("binary array has a negative dimension")
    pos = 12 + 8 * ndim
    total = 1
    for d in dims:
        total *= d
    if total == 0:  # array_recv: any zero dimension is the empty array
        if pos != len(raw):
            raise ValueConversionError("trailing bytes after binary array")
        return []
    if total > len(raw):  # every element takes at least 4 bytes: a guard against absurd sizes
        raise ValueConversionError("binary array declares more elements than its bytes can hold")
    flat: list[Any] = []
    for _ in range(total):
        if pos + 4 > len(raw):
            raise ValueConversionError("binary array truncated")
        (length,) = _LENGTH.unpack_from(raw, pos)
        pos += 4
        if length == -1:
            flat.append(None)
            continue
        if length < 0 or pos + length > len(raw):
            raise ValueConversionError("binary array element length out of range")
        flat.append(element.from_binary(raw[pos:pos + length], typmod))
        pos += length
    if pos != len(raw):
        raise ValueConversionError("trailing bytes after binary array")
    return _reshape(flat, dims)


def _reshape(flat: list[Any], dims: list[int]) -> list[Any]:
    if len(dims) == 1:
        return flat
    step = len(flat) // dims[0] if dims[0] else 0
    return [_reshape(flat[i * step:(i + 1) * step], dims[1:]) for i in range(dims[0])]


def register_array_types() -> None:
    for element in registered():
        if element.array_oid is not None and lookup(element.array_oid) is None:
            register(array_type(element.array_oid, element))
