"""Range and multirange types travel as PostgreSQL's canonical text, e.g. '[1,10)', 'empty',
'{[1,3),[5,7)}', '{}'."""

from __future__ import annotations

import struct

from cdc_apply.pgtypes.registry import PgType, ValueConversionError, fixed, lookup, register

RANGE_EMPTY, RANGE_LB_INC, RANGE_UB_INC, RANGE_LB_INF, RANGE_UB_INF = 0x01, 0x02, 0x04, 0x08, 0x10

# range OID -> (name, element OID, array OID)
RANGES = {
    3904: ("int4range", 23, 3905),
    3926: ("int8range", 20, 3927),
    3906: ("numrange", 1700, 3907),
    3912: ("daterange", 1082, 3913),
    3908: ("tsrange", 1114, 3909),
    3910: ("tstzrange", 1184, 3911),
}


# multirange OID -> (name, range OID, array OID) (PostgreSQL 14+)
MULTIRANGES = {
    4451: ("int4multirange", 3904, 6150),
    4536: ("int8multirange", 3926, 6157),
    4532: ("nummultirange", 3906, 6151),
    4535: ("datemultirange", 3912, 6155),
    4533: ("tsmultirange", 3908, 6152),
    4534: ("tstzmultirange", 3910, 6153),
}


def _element_text(element_oid: int, raw: bytes) -> str:
    element = lookup(element_oid)
    assert element is not None
    value = element.from_binary(raw, -1)
    rendered = element.to_json(value)
    text = str(rendered)
    return f'"{text}"' if any(ch in text for ch in ' ,()[]"\\') else text


def _range_binary(element_oid: int):  # type: ignore[no-untyped-def]
    def read(raw: bytes, typmod: int) -> str:
        if not raw:
            raise ValueConversionError("empty binary range")
        flags, pos = raw[0], 1
        if flags & RANGE_EMPTY:
            return "empty"
        bounds = []
        for present in (not flags & RANGE_LB_INF, not flags & RANGE_UB_INF):
            if not present:
                bounds.append("")
                continue
            if pos + 4 > len(raw):
                raise ValueConversionError("binary range truncated")
            (length,) = struct.unpack_from("!i", raw, pos)
            pos += 4
            if length < 0 or pos + length > len(raw):
                raise ValueConversionError("binary range bound length out of range")
            bounds.append(_element_text(element_oid, raw[pos:pos + length]))
            pos += length
        if pos != len(raw):
            raise ValueConversionError("trailing bytes after binary range")
        return f"{'[' if flags & RANGE_LB_INC else '('}{bounds[0]},{bounds[1]}{']' if flags & RANGE_UB_INC else ')'}"

    return read


def _multirange_binary(range_oid: int):  # type: ignore[no-untyped-def]
    """``multirange_send``: the range count, then each range as its length and ``range_send`` bytes;
    rendered as ``multirange_out`` prints it."""
    read_range = _range_binary(RANGES[range_oid][1])

    def read(raw: bytes, typmod: int) -> str:
        if len(raw) < 4:
            raise ValueConversionError("binary multirange truncated")
        (count,), pos = struct.unpack_from("!i", raw, 0), 4
        if count < 0 or count > (len(raw) - 4) // 5:
            raise ValueConversionError(f"binary multirange range count {count} out of range")
        ranges = []
        for _ in range(count):
            if pos + 4 > len(raw):
                raise ValueConversionError("binary multirange truncated")
            (length,) = struct.unpack_from("!i", raw, pos)
            pos += 4
            if length < 1 or pos + length > len(raw):
                raise ValueConversionError("binary multirange range length out of range")
            ranges.append(read_range(raw[pos:pos + length], -1))
            pos += length
        if pos != len(raw):
            raise ValueConversionError("trailing bytes after binary multirange")
        return "{" + ",".join(ranges) + "}"

    return read


def register_range_types() -> None:
    for oid, (name, element_oid, array_oid) in RANGES.items():
        register(PgType(oid, name, fixed("string"), lambda text, typmod: text, _range_binary(element_oid),
                        array_oid=array_oid))
    for oid, (name, range_oid, array_oid) in MULTIRANGES.items():
        register(PgType(oid, name, fixed("string"), lambda text, typmod: text, _multirange_binary(range_oid),
                        array_oid=array_oid))
